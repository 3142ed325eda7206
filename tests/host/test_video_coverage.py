"""Video VAEs without an exact chunked path yet (issue 23): Temporal-Chunk Video Decode with chunks forced never
crashes, is exact where it can be and says approximate, with the reason, where it cannot.

* Mochi (``comfy.ldm.genmo``, both hosts): causal decoder without a host cache, temporal reach 46 latent frames
  (docs/VIDEO_DECODE.md): forced chunks take the overlap-blend, reported approximate; the error is logged.
* CogVideoX (``comfy.ldm.cogvideo``, ComfyUI 0.33 only): a chunk of an even number of latent frames decodes to
  ``4 l`` frames, not the ``4 l - 3`` of its ``upscale_ratio``; such chunks cannot be placed, so the node takes
  the host's own decode (exact, equal to VAE Decode) and says why; odd chunks blend (approximate). Before, the
  blend path crashed here (``decode_fn gave 8 frames for latent [0, 2)``).
"""

from __future__ import annotations

import logging
import math
import sys

import pytest
import torch

from scripts.fixtures import available, structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]
log = logging.getLogger("vramfit.tests.video_coverage")


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]


def _case(comfy, fixture_vaes, kind: str, shape: tuple[int, ...]):
    vae = comfy.VAELoader().load_vae(fixture_vaes[kind])[0]
    z = structured_latent(shape, seed=4)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    return vae, z, ref


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def test_mochi_forced_chunks_blend_and_say_approximate(comfy, fixture_vaes, video):
    vae, z, ref = _case(comfy, fixture_vaes, "mochi", (1, 12, 4, 4, 4))
    r = video.decode(vae, {"samples": z}, frames_per_chunk=2)
    text = r.report.text()
    assert r.plan.path == "blend" and not r.plan.exact, text
    assert r.report.summary.startswith("approximate"), text
    assert r.images.shape == ref.shape, (tuple(r.images.shape), tuple(ref.shape))
    log.info("mochi blend k=2 vs VAEDecode: PSNR %.1f dB, max abs %.3f", _psnr(r.images, ref),
             (r.images - ref).abs().max().item())


@pytest.fixture(scope="module")
def cog(comfy, fixture_vaes):
    if not available("cogvideox"):
        pytest.skip("CogVideoX's VAE is not in this host (ComfyUI >= 0.33.0)")
    return _case(comfy, fixture_vaes, "cogvideox", (1, 16, 3, 4, 4))


def test_cogvideox_even_chunks_take_the_host_decode(cog, video):
    vae, z, ref = cog
    r = video.decode(vae, {"samples": z}, frames_per_chunk=2)
    text = r.report.text()
    assert r.plan.path == "host", text
    assert "overlap-blend chunks do not apply" in text and "decodes to 8 frames" in text, text
    assert r.report.summary.startswith("exact"), text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_cogvideox_odd_chunks_blend(comfy, fixture_vaes, cog, video):
    vae, _, _ = cog
    z = structured_latent((1, 16, 5, 4, 4), seed=6)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    r = video.decode(vae, {"samples": z}, frames_per_chunk=3)
    text = r.report.text()
    assert r.plan.path == "blend" and r.report.summary.startswith("approximate"), text
    assert r.images.shape == ref.shape
    log.info("cogvideox blend k=3 vs VAEDecode: PSNR %.1f dB, max abs %.3f", _psnr(r.images, ref),
             (r.images - ref).abs().max().item())
