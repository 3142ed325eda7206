"""The VAEs of the field's cases: FLUX's (InfiniteYou) and Sana's DC-AE, through Tiled VAE Decode.

* FLUX.1's VAE (16-channel KL, no quant convs): ComfyUI's ``VAELoader`` builds it from the fixture's keys;
  Tiled VAE Decode takes the exact path and equals core ``VAEDecode`` within float noise.
* Sana's DC-AE (32x, EfficientViT blocks with global linear attention), loaded as ComfyUI_ExtraModels'
  ``ExtraVAELoader`` does (``scripts/sana_vae.py``): exact split tiles (the attention stages once on the whole
  latent, the ResBlock stages in tiles with a halo of their reach), whatever halo the user set for the
  approximate path. Before the split path the same tiles were approximate: 22.9 dB with a 2-latent-px halo
  (docs/BENCHMARKS.md). More DC-AE cases: ``test_vae_coverage.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures import structured_latent

pytestmark = pytest.mark.host

@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture(scope="module")
def dcae(host_config, fixture_vaes):
    from scripts.sana_vae import load_dcae

    return load_dcae(str(host_config.models_dir / "vae" / fixture_vaes["dcae_sana"]), torch.float32)


def test_flux_vae_tiles_are_exact(comfy, tiled, flux_vae):
    assert type(flux_vae.first_stage_model).__name__ == "AutoencodingEngine"
    assert flux_vae.latent_channels == 16
    z = structured_latent((1, 16, 20, 24), seed=5)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(flux_vae, {"samples": z})[0].clone()
    r = tiled.decode(flux_vae, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert r.plan.path == "exact" and r.plan.config.tile == 64, text
    assert "self-check passed" in text, text
    diff = (r.images - ref).abs().max().item()
    assert diff <= 1e-4, (diff, text)


def test_dcae_loads_as_extramodels_does(dcae):
    assert dcae.latent_dim == 32 and dcae.latent_scale == 32
    assert not hasattr(dcae, "patcher") and type(dcae).decode is not type(dcae).__mro__[1].decode
    out = dcae.decode(structured_latent((1, 32, 2, 3), seed=1))
    assert out.shape == (1, 64, 96, 3) and 0.0 <= out.min().item() and out.max().item() <= 1.0
    assert out.std().item() > 0.02


def test_dcae_tiles_are_exact_whatever_the_halo(tiled, dcae):
    z = structured_latent((1, 32, 8, 8), seed=2)
    ref = dcae.decode(z)
    r = tiled.decode(dcae, {"samples": z}, tile_size=128, halo=2)
    text = r.report.text()
    assert r.plan.path == "split" and "exact: global prefix once" in text, text
    assert "2x2 tiles" in text, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text
