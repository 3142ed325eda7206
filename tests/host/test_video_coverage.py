"""Video VAEs beyond Wan through Temporal-Chunk Video Decode with chunks forced (issue 23): exact where a path
exists, never a crash, and approximate with the reason where not.

* Mochi (``comfy.ldm.genmo``, both hosts): a causal decoder without a host cache whose temporal reach is 46
  latent frames (docs/VIDEO_DECODE.md): the carried-context executor (``memory/executors/carry.py``) decodes it
  in chunks of 1 + k latent frames, each causal convolution reading the previous chunk's last frames: equal to
  VAE Decode within 1e-4, at least 3 chunks; an out-of-memory error inside a chunk halves k and resumes there.
  (The overlap-blend it took before: 29.3 dB, max abs 0.25, k = 2, 4 latent frames.)
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


@pytest.fixture(scope="module")
def mochi(comfy, fixture_vaes):
    return _case(comfy, fixture_vaes, "mochi", (1, 12, 4, 4, 4))


@pytest.mark.parametrize("k", [1, 2])
def test_mochi_carried_chunks_are_exact(mochi, video, k):
    vae, z, ref = mochi
    r = video.decode(vae, {"samples": z}, frames_per_chunk=k)
    text = r.report.text()
    assert r.plan.path == "carry" and r.plan.exact, text
    assert r.stats["chunks"] >= 3, text
    assert r.report.summary.startswith("exact"), text
    assert "carried chunks: self-check passed" in text, text
    assert r.images.shape == ref.shape, (tuple(r.images.shape), tuple(ref.shape))
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_mochi_carried_chunks_resume_after_oom(mochi, video):
    vae, z, ref = mochi
    fired: list[int] = []

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step == 1 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected in the second chunk")

    video._FAULT_HOOK = hook
    try:
        r = video.decode(vae, {"samples": z}, frames_per_chunk=2)
    finally:
        video._FAULT_HOOK = None
    text = r.report.text()
    assert fired == [1] and r.stats["shrinks"] == 1, text
    assert "oom" in dict(r.report.rows), text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


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
