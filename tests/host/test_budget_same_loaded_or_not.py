"""The decode nodes on the in-process ComfyUI host: measured peak vs budget, and what ``budget_mb`` caps.

* A decode whose measured peak (live tensor bytes here) exceeds the budget says so in an ``over budget``
  row and a logged warning; one within its budget does not (Tiled VAE Decode and Temporal-Chunk Video
  Decode).
* ``budget_mb`` caps the decode's working memory, not the VAE's weights: the same budget on the same latent
  gives the same budget, plan and success whether the VAE's weights were loaded beforehand (by a core
  ``VAEDecode``) or not (a VAE fresh from ``VAELoader``). Both nodes' tooltips say so.

Loads and decodes run under ``torch.inference_mode`` (the ``inference_mode`` fixture), as ComfyUI's executor
runs every node.
"""

from __future__ import annotations

import logging
import sys

import pytest

from scripts.fixtures.latents import structured_latent
from tests.video_refs import WAN21, reference

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]

IMAGE_NODE = "VRAMFit_TiledVAEDecode"
VIDEO_NODE = "VRAMFit_TemporalChunkVideoDecode"
OVER = "over budget"
MiB = 2**20
SMALL = (1, 4, 13, 18)  # 104 x 144 px


@pytest.fixture(scope="module")
def image(comfy):
    m = sys.modules[comfy.NODE_CLASS_MAPPINGS[IMAGE_NODE].__module__]
    yield m
    m.MEASURE_CPU_TENSORS = True


@pytest.fixture(scope="module")
def video(comfy):
    m = sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO_NODE].__module__]
    yield m
    m.MEASURE_CPU_TENSORS = True


@pytest.fixture(scope="module")
def wan21(comfy, fixture_vaes):
    return reference(comfy, fixture_vaes, "wan21", WAN21)


def _rows(result) -> dict:
    return dict(result.report.rows)


# ------------------------------------------------------------------------------------------ measured vs budget


def test_image_decode_over_budget_is_flagged(image, kl_vae, caplog):
    z = structured_latent(SMALL, seed=11)
    image.MEASURE_CPU_TENSORS = True
    try:
        within = image.decode(kl_vae, {"samples": z}, budget_mb=64)
        with caplog.at_level(logging.WARNING, logger="vramfit"):
            over = image.decode(kl_vae, {"samples": z}, tile_size=104, budget_mb=18)  # user tile: too big
    finally:
        image.MEASURE_CPU_TENSORS = True
    assert within.measured_peak <= within.budget.available and OVER not in _rows(within), within.report.text()
    assert over.plan.over_budget and over.measured_peak > 18 * MiB, over.report.text()
    row = _rows(over).get(OVER, "")
    assert "live tensor bytes" in row and "18.0 MiB" in row, over.report.text()
    keys = [k for k, _ in over.report.rows]
    assert keys.index(OVER) == keys.index("measured") + 1
    assert "over budget" in caplog.text and "Tiled VAE Decode" in caplog.text


@pytest.mark.slow
def test_video_decode_over_budget_is_flagged(video, wan21, caplog):
    vae, z, _ = wan21
    video.MEASURE_CPU_TENSORS = True
    try:
        within = video.decode(vae, {"samples": z}, budget_mb=4096)
        with caplog.at_level(logging.WARNING, logger="vramfit"):  # user chunk and tile: too big for 1 MiB
            over = video.decode(vae, {"samples": z}, frames_per_chunk=2, tile_size=40, budget_mb=1)
    finally:
        video.MEASURE_CPU_TENSORS = True
    assert within.measured_peak <= within.budget.available and OVER not in _rows(within), within.report.text()
    assert over.measured_peak > 1 * MiB, over.report.text()
    assert "live tensor bytes" in _rows(over).get(OVER, ""), over.report.text()
    assert "over budget" in caplog.text and "Temporal-Chunk Video Decode" in caplog.text


# ------------------------------------------------------------------------------------------ what budget_mb caps


def _fresh(comfy, fixture_vaes, kind):
    vae = comfy.VAELoader().load_vae(fixture_vaes[kind])[0]
    assert vae.patcher.loaded_size() == 0 < vae.patcher.model_size()
    return vae


def _outcome(mod, vae, z, **kw):
    try:
        r = mod.decode(vae, {"samples": z}, **kw)
    except ValueError as e:
        return ("error", str(e).split(" (budget:")[0])
    return ("ok", r.budget.available, r.plan.description)


def test_image_budget_same_whether_weights_were_loaded(comfy, fixture_vaes, image, kl_vae):
    """36 MiB: exact tiles (the fixture KL VAE's weights are 319 MiB, far more than the budget)."""
    z = structured_latent(SMALL, seed=11)
    comfy.VAEDecode().decode(kl_vae, {"samples": z})  # loaded (and the host's self-check cached)
    assert kl_vae.patcher.loaded_size() == kl_vae.patcher.model_size()
    loaded = _outcome(image, kl_vae, z, budget_mb=36)
    fresh = _outcome(image, _fresh(comfy, fixture_vaes, "kl_f8"), z, budget_mb=36)
    assert loaded[0] == "ok" and fresh == loaded, (loaded, fresh)
    assert loaded[1] == 36 * MiB


@pytest.mark.slow
def test_video_budget_same_whether_weights_were_loaded(comfy, fixture_vaes, video, wan21):
    vae, z, _ = wan21  # loaded by the reference VAEDecode
    top = sys.modules[video.__name__.rsplit('.nodes.', 1)[0] + '.memory.plan.video'].plan_wan(video._validate(vae, {"samples": z}, 0, 0), 4096 * MiB, 0, None, video.comfy_env().peaks)
    budget_mb = int(top.planned / MiB) + 1
    loaded = _outcome(video, vae, z, budget_mb=budget_mb)
    fresh = _outcome(video, _fresh(comfy, fixture_vaes, "wan21"), z, budget_mb=budget_mb)
    assert loaded[0] == "ok" and fresh == loaded, (loaded, fresh)


@pytest.mark.parametrize("node_id", [IMAGE_NODE, VIDEO_NODE])
def test_budget_tooltip_says_what_it_caps(comfy, node_id):
    schema = comfy.NODE_CLASS_MAPPINGS[node_id].define_schema()
    tip = next(i.tooltip for i in schema.inputs if i.id == "budget_mb").lower()
    assert "working memory" in tip and "weights" in tip and "not counted" in tip, tip
