"""Video VAEs beyond Wan through Temporal-Chunk Video Decode with chunks forced (issue 23): exact where a path
exists, never a crash, and approximate with the reason where not.

* Mochi (``comfy.ldm.genmo``, both hosts): a causal decoder without a host cache whose temporal reach is 46
  latent frames (docs/VIDEO_DECODE.md): the carried-context executor (``memory/executors/carry.py``) decodes it
  in chunks of 1 + k latent frames, each causal convolution reading the previous chunk's last frames: equal to
  VAE Decode within 1e-4, at least 3 chunks; an out-of-memory error inside a chunk halves k and resumes there.
  (The overlap-blend it took before: 29.3 dB, max abs 0.25, k = 2, 4 latent frames.)
* HunyuanVideo 1.5 (``comfy.ldm.hunyuan_video.vae_refiner``, both hosts): attention over the whole clip in its
  mid block, then causal convolutions that carry their last 2 input frames: the carried-context executor runs
  ``conv_in`` and the mid block once on the whole latent, then the up path in chunks of k >= 2 latent frames with
  the host's own carry lists: equal to VAE Decode within 1e-4, at least 3 chunks; an OOM halves k (not below 2).
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
def hv15(comfy, fixture_vaes):
    return _case(comfy, fixture_vaes, "hunyuan_video15", (1, 32, 7, 2, 3))


@pytest.mark.parametrize("k", [2, 3])
def test_hunyuan_video15_carried_chunks_are_exact(hv15, video, k):
    vae, z, ref = hv15
    r = video.decode(vae, {"samples": z}, frames_per_chunk=k)
    text = r.report.text()
    assert r.plan.path == "carry" and r.plan.exact, text
    assert r.stats["chunks"] >= 3, text
    assert r.report.summary.startswith("exact"), text
    assert "carried chunks: self-check passed" in text and "mid block" in text, text
    assert r.images.shape == ref.shape, (tuple(r.images.shape), tuple(ref.shape))
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_hunyuan_video15_carried_tiles_are_exact(hv15, video):
    """Spatial tiles: the chunks after the prefix are local, each tile carries its own context (tile_size 16 px:
    one latent px per tile core, 2x3 tiles, each read with the traced halo)."""
    vae, z, ref = hv15
    r = video.decode(vae, {"samples": z}, frames_per_chunk=2, tile_size=16)
    text = r.report.text()
    assert r.plan.path == "carry" and r.plan.config.tile == (1, 1) and r.stats["tiles"] == 6, text
    assert r.plan.halo >= 7, text  # the up path's first stage alone reaches 7 latent px
    assert "tile-chunks" in r.report.summary and r.report.summary.startswith("exact"), text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


class _Small(torch.nn.Module):
    """The host's HunyuanVideo 1.5 ``Decoder`` class at small widths (so tiles are far smaller than the frame)."""

    def __init__(self, decoder_cls: type) -> None:
        super().__init__()
        self.decoder = decoder_cls(z_channels=4, out_channels=3, block_out_channels=[16, 16, 8], num_res_blocks=1,
                                   ffactor_spatial=4, ffactor_temporal=2)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z)


@pytest.mark.parametrize("halo, exact", [(None, True), (3, False)])
def test_hunyuan_video15_tiles_need_the_traced_halo(comfy, halo, exact):
    """4x4 tiles of a 24x24 latent through the host's decoder class: with the traced halo equal to its decode;
    with 3 latent px, not (so the halo matters and the tile test can fail)."""
    import importlib

    vae_mod = sys.modules[[m for m in sys.modules if m.endswith(".memory.vae.carry_layout")][0]]
    carry = importlib.import_module(vae_mod.__name__.replace(".vae.carry_layout", ".executors.carry"))
    plan_video = importlib.import_module(vae_mod.__name__.replace(".vae.carry_layout", ".plan.video"))
    refiner = importlib.import_module("comfy.ldm.hunyuan_video.vae_refiner")
    torch.manual_seed(0)
    model = _Small(refiner.Decoder).eval()
    with torch.no_grad():  # ComfyUI's ops skip initialisation
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                torch.nn.init.uniform_(p, 0.5, 1.5)
            elif p.ndim > 1:
                torch.nn.init.normal_(p, std=p[0].numel() ** -0.5)
            else:
                torch.nn.init.normal_(p, std=0.02)
    layout = vae_mod.carry_layout(model).require()
    z = torch.randn(1, 4, 5, 24, 24)
    with torch.inference_mode():
        ref = model.decode(z).float()
        traced = plan_video.carry_halo(model, layout, 4, torch.float32, torch.device("cpu"))
        out = torch.empty_like(ref)
        stats: dict = {}
        carry.decode_carried(model, layout, z, 2, out=out, dtype=torch.float32, compute_device="cpu",
                             tile=(6, 6), halo=traced if halo is None else halo, stats=stats)
    diff = (out - ref).abs().max().item()
    assert stats["tiles"] == 16 and 9 <= traced <= 12, (stats, traced)
    assert (diff <= 1e-4) == exact, (diff, traced)


def test_hunyuan_video15_resumes_after_oom_not_below_two_frames(hv15, video):
    vae, z, ref = hv15
    fired: list[int] = []

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step == 1 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected in the second chunk")

    video._FAULT_HOOK = hook
    try:
        r = video.decode(vae, {"samples": z}, frames_per_chunk=3)
    finally:
        video._FAULT_HOOK = None
    text = r.report.text()
    # k = 3 halves to 1, held at the family's 2: chunks [0, 3), [3, 6) failed, [3, 5), [5, 7)
    assert fired == [1] and r.stats["shrinks"] == 1 and r.stats["frames_per_chunk"] == 2, text
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
