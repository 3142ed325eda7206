"""Hunyuan Image 2.1's refiner VAE exact in tiles: the KL walker in 3-D (issue 36, item 5).

ComfyUI builds it for a file with a 32-channel 5-D ``decoder.conv_in.weight`` (``comfy/sd.py``, both hosts):
``comfy.ldm.hunyuan_video.vae_refiner`` with ``refiner_vae`` False, ``not_video``. Its decoder is Hunyuan Image 2.1's
(forward-order stages, pixel-shuffle upsampling, the latent's channel-repeat shortcut) with zero-padded 3x3x3
convolutions and GroupNorms over the whole clip; two of its upsamples double the frames, and a one-frame latent
keeps only the last of the 4 decoded frames. The walker tiles it in space, every tile holding all frames, with
GroupNorm statistics merged over the tiles' cores of every frame (``memory/vae/kl_layout.py``,
``memory/executors/kl_exact.py``); Tiled VAE Decode takes its one-frame latents as images
(``memory/vae/one_frame.py``).

Thresholds: equal to the host's own decode (``VAEDecode`` / ``first_stage_model.decode``) within 1e-4 (max abs,
float32) with at least 4 tiles; the node's fixture is the narrow twin (``scripts.fixtures.kinds.NARROW_KINDS``: the host's
classes and key names, a quarter of the channels).
"""

from __future__ import annotations

import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from scripts.fixtures.weights import build_model
from tests.helpers import assert_freed, unload_and_watch

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode", "one_thread")]

TOL = 1e-4
KIND = "hunyuan_image_refiner"
MiB = 2**20


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]


@pytest.fixture(scope="module")
def refiner(comfy, fixture_vaes):
    vae = fixture_vaes.load(comfy, narrow(KIND))
    assert type(vae.first_stage_model.decoder).__module__.endswith("hunyuan_video.vae_refiner")
    assert vae.first_stage_model.decoder.refiner_vae is False and vae.not_video
    return vae


@pytest.fixture(scope="module")
def case(comfy, refiner):
    """A one-frame latent of 96x128 px, as the refiner's nodes make it ``(B, C, 1, h, w)``, and VAE Decode's images."""
    z = structured_latent((1, 32, 1, 6, 8), seed=3)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(refiner, {"samples": z})
    assert tuple(ref.shape) == (1, 96, 128, 3)
    return z, ref.clone()


def _tiny_refiner(seed: int = 0) -> torch.nn.Module:
    """The host's ``vae_refiner`` classes with ``refiner_vae`` False at 32-64 channels (4x in space, 4x in time)."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    from tests.video_refs import _tiny

    module = "comfy.ldm.hunyuan_video.vae_refiner"
    dd = {"block_out_channels": [32, 32, 64], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
          "ffactor_spatial": 4, "ffactor_temporal": 4, "downsample_match_channel": True,
          "upsample_match_channel": True, "z_channels": 8, "refiner_vae": False}
    return _tiny(lambda: AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": f"{module}.Encoder", "params": dd},
        decoder_config={"target": f"{module}.Decoder", "params": dd}), seed)


@pytest.mark.parametrize("frames", [1, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_3d_walker_equals_the_hosts_decode(comfy, frames, recompute):
    """One-frame latents (the image: the last of 4 decoded frames) and a 2-frame clip (8 frames, none dropped), a
    batch of 2, tiles of 8 px (3x4 at full resolution): the host's own ``decode`` within 1e-4."""
    from vramfit.memory.executors.kl_exact import decode_exact
    from vramfit.memory.vae.kl_layout import kl_layout

    model = _tiny_refiner()
    lay = kl_layout(model, recompute)
    assert lay.reason is None and lay.dims == 3
    assert [s.frames for s in lay.segments if s.kind == "upsample"] == [2, 4]
    z = torch.randn((2, 8, frames, 6, 7), generator=torch.Generator().manual_seed(1))
    ref = model.decode(z)
    out = decode_exact(model, z, 8, recompute=recompute)
    assert out.shape == ref.shape == (2, 3, 1 if frames == 1 else 8, 24, 28)
    assert (out - ref).abs().max().item() <= TOL
    if frames == 1:  # a 4-D latent is taken as one frame each and returned 4-D
        out4 = decode_exact(model, z[:, :, 0], 8, recompute=recompute)
        assert (out4 - ref[:, :, 0]).abs().max().item() <= TOL


def test_reading_no_context_in_space_is_not_exact(comfy):
    """The test can fail: the walker with a spatial halo of 0 (tiles without their neighbours' pixels) differs."""
    import dataclasses

    from vramfit.memory.executors.kl_exact import decode_exact
    from vramfit.memory.vae import kl_layout as kll

    model = _tiny_refiner()
    lay = kll.kl_layout(model)
    z = torch.randn((1, 8, 1, 6, 7), generator=torch.Generator().manual_seed(1))
    ref = model.decode(z)
    blind = dataclasses.replace(lay, segments=tuple(dataclasses.replace(s, halo=0) for s in lay.segments))
    kll._LAYOUTS[model] = {False: blind}
    try:
        out = decode_exact(model, z, 8)
    finally:
        kll._LAYOUTS.pop(model, None)
    assert (out - ref).abs().max().item() > 1e-3


def test_the_refiners_layout(comfy):
    """The full-size host model (meta device, as ComfyUI's loader configures it): 4 pixel-shuffle upsamples (16x),
    the first two also 2x in time, channels 1024 -> 128, the latent repeated 32x onto conv_in's 1024 channels."""
    from vramfit.memory.vae.kl_layout import kl_layout

    lay = kl_layout(build_model(KIND))
    assert lay.reason is None and lay.dims == 3 and lay.in_repeats == 32 and lay.levels == 5
    ups = [(s.in_channels, s.out_channels, s.halo, s.tscale, s.frames) for s in lay.segments if s.kind == "upsample"]
    assert ups == [(1024, 1024, 2, 2, 2), (1024, 512, 2, 2, 4), (512, 256, 2, 1, 4), (256, 128, 2, 1, 4)]
    assert lay.segments[-1].kind == "out" and lay.segments[-1].frames == 1


@pytest.mark.slow
def test_tiles_of_the_users_size_are_exact(tiled, refiner, case):
    z, ref = case
    r = tiled.decode(refiner, {"samples": z}, tile_size=32)
    text = r.report.text()
    assert r.plan.path == "exact" and r.plan.exact, text
    assert "3x4 tiles" in r.report.summary and r.report.summary.startswith("exact"), text
    assert "exact tiled walker: self-check passed" in text, text
    assert "one-frame latents of a 3-D image VAE" in text, text
    assert "blend" not in text and "approximate" not in text, text
    diff = (r.images - ref).abs().max().item()
    assert diff <= TOL, (diff, text)


def test_a_budget_below_the_hosts_decode_plans_exact_tiles(tiled, refiner, case):
    """No tile set: a budget of 3/4 of the untiled decode's plan makes the planner take >= 4 exact tiles within it
    (measured on CPU, float32: untiled 21 MiB planned; at 15 MiB 3x4 tiles of 32 px, tensor peak 13.6 MiB)."""
    z, ref = case
    whole = tiled.decode(refiner, {"samples": z}, budget_mb=4096)
    assert whole.plan.path == "untiled" and whole.report.summary.startswith("exact"), whole.report.text()
    assert (whole.images - ref).abs().max().item() <= TOL
    r = tiled.decode(refiner, {"samples": z}, budget_mb=int(whole.plan.planned * 0.75 / MiB))
    text = r.report.text()
    assert r.plan.path == "exact" and r.report.summary.startswith("exact"), text
    h, w = 96, 128
    tile = r.plan.config.tile
    assert -(-h // tile) * -(-w // tile) >= 4, text
    assert "OVER BUDGET" not in text, text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_the_video_node_decodes_its_one_frame_latents_as_images(video, refiner, case):
    """Temporal-Chunk Video Decode given the refiner's one-frame latent takes the same image engine (before: the
    host's decode over budget, tile_size ignored): exact tiles of the user's size within the budget."""
    z, ref = case
    r = video.decode(refiner, {"samples": z}, frames_per_chunk=4, tile_size=32, budget_mb=64)
    text = r.report.text()
    assert r.report.node == "Temporal-Chunk Video Decode" and "3x4 tiles" in r.report.summary, text
    assert r.report.summary.startswith("exact") and "OVER BUDGET" not in text, text
    assert "frames_per_chunk 4 does not apply" in text and "blend" not in text, text
    assert (r.images - ref).abs().max().item() <= TOL, text


def test_a_dropped_vae_is_freed(comfy, fixture_vaes, tiled, video):
    """The one-frame wrapper lives with the host's VAE object: a graph that drops the VAE frees its model (a cache
    keyed by the model kept it alive through the wrapper, and left ComfyUI a dead entry that made it collect all
    garbage on every later model load: 0.4 s a load late in the test run)."""
    vae = fixture_vaes.load(comfy, narrow(KIND))
    z = structured_latent((1, 32, 1, 6, 8), seed=3)
    for node in (tiled, video):
        node.decode(vae, {"samples": z})
    assert "_vramfit_one_frame" in vae.__dict__  # the path under test ran
    model = unload_and_watch(vae)
    del vae
    assert_freed(model, KIND)
