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

import math
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent

pytestmark = pytest.mark.host

@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture(scope="module")
def dcae(host_config, fixture_vaes):
    from scripts.sana_vae import load_dcae

    return load_dcae(str(host_config.models_dir / "vae" / fixture_vaes["dcae_sana"]), torch.float32)


@pytest.mark.slow
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


@pytest.mark.slow
def test_dcae_tiles_are_exact_whatever_the_halo(tiled, dcae):
    z = structured_latent((1, 32, 8, 8), seed=2)
    ref = dcae.decode(z)
    r = tiled.decode(dcae, {"samples": z}, tile_size=128, halo=2)
    text = r.report.text()
    assert r.plan.path == "split" and "exact: global prefix once" in text, text
    assert "2x2 tiles" in text, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


@pytest.mark.slow
def test_dcae_prefix_in_tiles_equals_the_hosts_decode(dcae):
    """The prefix in tiles (2 latent px: 2x3 tiles at every level, the linear attention's sums added over them)
    then the suffix in tiles: the host's decode within float noise; the prefix alone within float32 rounding."""
    from vramfit.memory.executors.prefix_tiles import run_units
    from vramfit.memory.executors.split import decode_split
    from vramfit.memory.vae.split_layout import split_layout

    model = dcae.first_stage_model
    layout = split_layout(model)
    assert layout.prefix_units and sum(u.attention is not None for u in layout.prefix_units) == 9
    z = structured_latent((1, 32, 4, 6), seed=3)
    with torch.inference_mode():
        whole = layout.prefix(z)
        parts = run_units(layout.prefix_units, z, 2)
        assert parts.shape == whole.shape and 0 < (parts - whole).abs().max().item() <= 1e-4 * whole.abs().max().item()
        ref = model.decode(z).float()
        out = decode_split(layout, z, 8, 16, prefix_tile=2)
    assert (out - ref).abs().max().item() <= 1e-4


def test_dcae_prefix_runs_in_tiles_under_a_budget_below_its_whole_peak(dcae):
    """A budget below the prefix's peak on the whole latent (the EfficientViT stages' linear attention: 10 GiB at
    4096^2 in bfloat16, meta-sized) plans the prefix in tiles, the largest whose meta-sized peak fits; the row says
    so; a budget that holds the whole prefix keeps it whole. Planning only (a 768x1024 decode of the full-size
    fixture takes minutes here): the suffix's smallest tile is sized on a stand-in cost model."""
    from vramfit.memory.decode.image import make_job
    from vramfit.memory.plan.split import (
        SplitPlanner,
        _meta_prefix,
        _prefix_tiled_peak,
        plan_split,
        prefix_tile,
        suffix_reach,
    )
    from vramfit.memory.vae.split_layout import split_layout

    class OneMiB:  # the suffix's cost model: every tile 1 MiB
        def predict(self, g):
            return 1 << 20

        predict_tracked = predict

    model = dcae.first_stage_model
    layout = split_layout(model)
    z = structured_latent((1, 32, 24, 32), seed=3)
    cpu = torch.device("cpu")
    shape, whole = _meta_prefix(layout, model, 32, (24, 32), torch.float32, cpu)
    peak = _prefix_tiled_peak(layout, model, 32, (24, 32), torch.float32, cpu)
    assert peak(8) < peak(16) < 0.5 * whole, (peak(8), peak(16), whole)
    scale, c, reach = suffix_reach(layout, model, 32, torch.float32, cpu)
    sp = SplitPlanner(layout, scale, c, whole, math.prod(shape) * 4, reach, OneMiB(), peak)
    job = make_job(dcae, z, core=False, out_device="cpu")
    p = plan_split(job, sp, peak(16) + (2 << 20), None, 0)
    assert prefix_tile(p) == 16 and "prefix in tiles of 16 latent px" in p.description and not p.over_budget
    assert p.planned <= peak(16) + (2 << 20)
    roomy = plan_split(job, sp, whole + (64 << 20), None, 0)
    assert prefix_tile(roomy) == 0 and "prefix on the whole latent" in roomy.description
