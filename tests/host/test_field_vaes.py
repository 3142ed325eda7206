"""The VAEs of the field's cases: FLUX's (InfiniteYou) and Sana's DC-AE, through Tiled VAE Decode.

* FLUX.1's VAE (16-channel KL, no quant convs): ComfyUI's ``VAELoader`` builds it from the fixture's keys;
  Tiled VAE Decode takes the exact path and equals core ``VAEDecode`` within float noise.
* Sana's DC-AE (32x, EfficientViT blocks with global linear attention), loaded as ComfyUI_ExtraModels'
  ``ExtraVAELoader`` does (``scripts/sana_vae.py``): no exact path exists (its attention is global), so
  tiles go through the approximate halo-and-crop path and the report says so. Measured on the fixture,
  256x256 px, 128-px tiles (4 latent px) with a 2-latent-px halo: PSNR vs its untiled decode 22.9 dB, max
  abs diff 0.34 (the threshold below leaves a margin); with a 4-px halo or the auto halo (the decoder's conv
  reach, 20 latent px) each tile sees this whole 8x8 latent and the output equals the untiled decode. docs/BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from scripts.fixtures import structured_latent

pytestmark = pytest.mark.host

DCAE_TILE_PSNR_DB = 18.0
"""Lower bound for the approximate DC-AE tiles above (measured 22.9 dB)."""


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


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


def test_dcae_tiles_are_approximate_and_say_so(tiled, dcae):
    z = structured_latent((1, 32, 8, 8), seed=2)
    ref = dcae.decode(z)
    r = tiled.decode(dcae, {"samples": z}, tile_size=128, halo=2)
    text = r.report.text()
    assert r.plan.path == "generic" and "approximate" in text, text
    assert "2x2 tiles" in text, text
    value = _psnr(r.images, ref)
    assert DCAE_TILE_PSNR_DB <= value < 60.0, (value, text)
