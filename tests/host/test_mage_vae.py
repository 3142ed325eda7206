"""Mage-VAE (``comfy.ldm.mage_flow.vae.MageVAE``, ComfyUI 0.33.0+) through Tiled VAE Decode: exact split tiles.

Its decode is a one-step diffusion decoder: the CoD decoder (GroupNorm ResBlocks, self-attention in 32-px windows
at latent resolution), the denoiser's patch embedding and 21 DiCo blocks (adaptive layer norm by the timestep,
channel attention over the whole map: an adaptive average pool) at latent resolution, then a per-patch MLP that
paints each latent px's 16x16 output px. Every global operation sits at latent resolution, before the per-patch
tail: the split path (``memory/vae/split_layout.py``, description ``mage``) runs them once on the whole latent and
the tail in tiles (reach 0: no halo). Before it, Tiled VAE Decode took generic halo tiles, approximate, 17-22 dB
(issue 36).

On the narrow twin (``mage_narrow``: the host's classes and key names, a quarter of the widths); skipped where the
host has no ``comfy.ldm.mage_flow`` (ComfyUI 0.3.75).
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures.host import available
from scripts.fixtures.kinds import FIXTURES
from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]

TOL = 1e-4
KIND = narrow("mage")


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture(scope="module")
def engine(tiled):
    pack = tiled.__name__.rsplit(".nodes.", 1)[0]
    return lambda name: sys.modules[f"{pack}.memory.{name}"]


@pytest.fixture(scope="module")
def mage(comfy, fixture_vaes):
    if not available(KIND):
        spec = FIXTURES[KIND]
        pytest.skip(f"this host has no {spec.module} (Mage-VAE: ComfyUI >= {spec.min_comfyui})")
    vae = fixture_vaes.load(comfy, KIND)
    assert type(vae.first_stage_model).__name__ == "MageVAE"
    return vae


@pytest.fixture(scope="module")
def case(comfy, mage):
    z = structured_latent((1, 128, 8, 12), seed=4)
    with torch.inference_mode():
        return z, comfy.VAEDecode().decode(mage, {"samples": z})[0].clone()


@pytest.fixture()
def hook(tiled):
    yield lambda fn: setattr(tiled, "_FAULT_HOOK", fn)
    tiled._FAULT_HOOK = None


def test_mage_layout_puts_every_global_op_in_the_prefix(engine, mage):
    lay = engine("vae.split_layout").split_layout(mage.first_stage_model)
    assert lay.reason is None and lay.family == "mage", lay.reason
    assert [s.name for s in lay.stages[: lay.split]] == ["y_embedder.decoder", "s_embedder", "blocks"]
    assert [s.name for s in lay.stages[lay.split:]] == ["per-patch tail"]
    assert engine("vae.split_layout").is_global(torch.nn.AdaptiveAvgPool2d(1))  # the DiCo blocks' pooling


def test_mage_split_tiles_are_exact(tiled, mage, case):
    z, ref = case
    r = tiled.decode(mage, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert r.plan.path == "split" and r.plan.exact, text
    assert r.plan.config.rows * r.plan.config.cols >= 4, text
    assert r.report.summary.startswith("exact"), text
    assert "split path: self-check passed" in text, text
    assert "blocks on the whole latent" in text, text
    diff = (r.images - ref).abs().max().item()
    assert diff <= TOL, (diff, text)


def test_mage_batch_of_two_in_tiles_is_exact(comfy, tiled, mage):
    """Its decode treats the items of a batch independently (per-item GroupNorm, windows and pooling; the batch
    self-check runs first), so the split path's one item per pass is VAE Decode's batch."""
    z = structured_latent((2, 128, 6, 8), seed=6)
    ref = comfy.VAEDecode().decode(mage, {"samples": z})[0]
    r = tiled.decode(mage, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert r.plan.path == "split" and r.plan.exact and r.report.summary.startswith("exact"), text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_mage_split_under_a_budget_plans_tiles(comfy, tiled, mage):
    """No tile set: a budget below the untiled decode's makes the planner take exact split tiles. (On a latent
    smaller than one 32-px attention window the window's padding makes the prefix's peak the untiled decode's.)"""
    z = structured_latent((1, 128, 16, 24), seed=5)
    ref = comfy.VAEDecode().decode(mage, {"samples": z})[0]
    r = tiled.decode(mage, {"samples": z}, budget_mb=16)
    text = r.report.text()
    assert r.plan.path == "split" and r.plan.config.rows * r.plan.config.cols >= 4, text
    assert "OVER BUDGET" not in text, text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_mage_split_resumes_after_oom_in_a_tile(tiled, mage, case, hook):
    z, ref = case
    fired: list[int] = []

    def fh(kind: str, k: int) -> None:
        if kind == "tile" and k == 2 and not fired:
            fired.append(k)
            raise torch.OutOfMemoryError(f"injected at tile {k}")

    hook(fh)
    r = tiled.decode(mage, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert fired == [2] and r.oom_events, text
    assert r.plan.path == "split", text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_mage_blocks_in_tiles_are_not_exact(engine, mage, case):
    """Control: the same tiles with the DiCo blocks in the suffix (their channel attention then pools each tile,
    not the map) differ from the host's decode, so the tests above can fail."""
    z, _ = case
    split_layout = engine("vae.split_layout")
    lay = split_layout.split_layout(mage.first_stage_model)
    ref = engine("executors.split").decode_split(lay, z, 4, 0)
    wrong = split_layout.SplitLayout(None, lay.family, lay.stages, lay.split - 1)
    out = engine("executors.split").decode_split(wrong, z, 4, 0)
    assert (out - ref).abs().max().item() > 1e-2
