"""Exact tiles for the image VAEs beyond the SD/FLUX KL family, on the running host (issue 23).

* Sana's DC-AE f32c32 (loaded as ComfyUI_ExtraModels' ``ExtraVAELoader`` does, ``scripts/sana_vae.py``): the
  split path (``memory/vae/split_layout.py``): its EfficientViT stages with the global linear attention run
  once on the whole latent (1/8 resolution), the ResBlock stages in tiles with a halo of their traced reach.
* Hunyuan Image 2.1 (``comfy.ldm.hunyuan_video.vae``, loaded by ComfyUI's ``VAELoader``): the KL walker
  (``memory/vae/kl_layout.py``: forward-order up path, pixel-shuffle upsampling, the latent's channel-repeat
  shortcut).

Each: at least 4 tiles, equal to the host's own decode within 1e-4 (float32), the first-use self-check passed,
and an out-of-memory error inside a tile resumes from the finished tiles with the same result.

Hunyuan Image 2.1 runs on its narrow twin (``scripts.fixtures.kinds.NARROW_KINDS``: the host's classes, a quarter of the
channels); the full-size fixture in ``test_hunyuan_image_full_size_tiles_are_exact`` (``VRAMFIT_FULL_FIXTURES=1``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from scripts.fixtures.weights import build_model
from tests.helpers import full_size

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]

TOL = 1e-4


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture()
def hook(tiled):
    yield lambda fn: setattr(tiled, "_FAULT_HOOK", fn)
    tiled._FAULT_HOOK = None


@pytest.fixture(scope="module")
def dcae(host_config, fixture_vaes):
    from scripts.sana_vae import load_dcae

    return load_dcae(str(host_config.models_dir / "vae" / fixture_vaes["dcae_sana"]), torch.float32)


def _hunyuan_image(comfy, fixture_vaes, kind: str):
    vae = fixture_vaes.load(comfy, kind)
    assert type(vae.first_stage_model.decoder).__module__.endswith("hunyuan_video.vae")
    return vae


@pytest.fixture(scope="module")
def hunyuan_image(comfy, fixture_vaes):
    return _hunyuan_image(comfy, fixture_vaes, narrow("hunyuan_image"))


@pytest.fixture(scope="module")
def dcae_case(dcae):
    z = structured_latent((1, 32, 8, 12), seed=2)
    with torch.inference_mode():
        return z, dcae.decode(z)


def _hunyuan_case(comfy, vae):
    z = structured_latent((1, 64, 4, 6), seed=3)
    with torch.inference_mode():
        return z, comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()


@pytest.fixture(scope="module")
def hunyuan_case(comfy, hunyuan_image):
    return _hunyuan_case(comfy, hunyuan_image)


def _oom_at(step: int, fired: list[int]):
    def fh(kind: str, k: int) -> None:
        if kind == "tile" and k == step and not fired:
            fired.append(k)
            raise torch.OutOfMemoryError(f"injected at tile {k}")

    return fh


def test_dcae_split_tiles_are_exact(tiled, dcae, dcae_case):
    z, ref = dcae_case
    r = tiled.decode(dcae, {"samples": z}, tile_size=128)
    text = r.report.text()
    assert r.plan.path == "split" and r.plan.exact, text
    assert r.plan.config.rows * r.plan.config.cols >= 4, text
    assert r.report.summary.startswith("exact"), text
    assert "split path: self-check passed" in text, text
    assert "up_blocks.3 on the whole latent" in text, text  # the linear-attention stages are the prefix
    diff = (r.images - ref).abs().max().item()
    assert diff <= TOL, (diff, text)


@pytest.mark.slow
def test_dcae_split_under_a_budget_plans_tiles(tiled, dcae, dcae_case):
    """No tile set: the budget alone (below the untiled decode) makes the planner take exact split tiles."""
    z, ref = dcae_case
    r = tiled.decode(dcae, {"samples": z}, budget_mb=200)
    text = r.report.text()
    assert r.plan.path == "split" and r.plan.config.rows * r.plan.config.cols >= 4, text
    assert "OVER BUDGET" not in text, text
    assert (r.images - ref).abs().max().item() <= TOL, text


@pytest.mark.slow
def test_dcae_split_resumes_after_oom_in_a_tile(tiled, dcae, dcae_case, hook):
    z, ref = dcae_case
    fired: list[int] = []
    hook(_oom_at(2, fired))
    r = tiled.decode(dcae, {"samples": z}, tile_size=128)
    text = r.report.text()
    assert fired == [2] and r.oom_events, text
    assert r.plan.path == "split", text
    assert (r.images - ref).abs().max().item() <= TOL, text


def _assert_hunyuan_image_tiles_are_exact(tiled, vae, case):
    z, ref = case
    r = tiled.decode(vae, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert r.plan.path == "exact", text
    assert "2x3 tiles" in r.report.summary, text
    assert "exact tiled walker: self-check passed" in text, text
    diff = (r.images - ref).abs().max().item()
    assert diff <= TOL, (diff, text)


def test_hunyuan_image_tiles_are_exact(tiled, hunyuan_image, hunyuan_case):
    _assert_hunyuan_image_tiles_are_exact(tiled, hunyuan_image, hunyuan_case)


@full_size
def test_hunyuan_image_full_size_tiles_are_exact(tiled, comfy, fixture_vaes):
    """The full-size fixture (405 M parameters), as ComfyUI's loader detects it from the file."""
    import comfy.model_management as mm

    vae = _hunyuan_image(comfy, fixture_vaes, "hunyuan_image")
    try:
        _assert_hunyuan_image_tiles_are_exact(tiled, vae, _hunyuan_case(comfy, vae))
    finally:
        others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
        mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)


def test_hunyuan_image_resumes_after_oom_in_a_tile(tiled, hunyuan_image, hunyuan_case, hook):
    z, ref = hunyuan_case
    fired: list[int] = []
    hook(_oom_at(30, fired))
    r = tiled.decode(hunyuan_image, {"samples": z}, tile_size=64)
    text = r.report.text()
    assert fired == [30] and r.oom_events, text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_hunyuan_image_layout(hunyuan_image):
    """The walker reads Hunyuan Image 2.1's decoder in its forward order: 5 pixel-shuffle upsamples (32x),
    channels 1024 -> 128, the latent repeated 16x onto conv_in's 1024 channels (the full-size host model, built on
    the meta device as ComfyUI's loader configures it; its narrow twin: a quarter of each)."""
    kl_layout = sys.modules[[m for m in sys.modules if m.endswith(".memory.vae.kl_layout")][0]]
    small = kl_layout.kl_layout(hunyuan_image.first_stage_model)
    assert small.reason is None and small.in_repeats == 4 and small.levels == 6
    assert [(s.in_channels, s.out_channels, s.halo) for s in small.segments if s.kind == "upsample"] == [
        (256, 256, 2), (256, 128, 2), (128, 128, 2), (128, 64, 2), (64, 32, 2)]
    lay = kl_layout.kl_layout(build_model("hunyuan_image"))
    assert lay.reason is None and lay.in_repeats == 16 and lay.levels == 6
    ups = [s for s in lay.segments if s.kind == "upsample"]
    assert [(s.in_channels, s.out_channels, s.halo) for s in ups] == [
        (1024, 1024, 2), (1024, 512, 2), (512, 512, 2), (512, 256, 2), (256, 128, 2)]
