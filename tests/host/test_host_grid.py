"""VAEs that tile internally (ComfyUI 0.33's ``VAE.handles_tiling``): MiniMax H3's video VAE decoded by the pack as
the host's own grid, one tile at a time (issue 36, item 4).

The VAE is built as a user's file loads it: a state dict with the host's key names (random weights from the host's
own class, ``comfy.ldm.minimax.vae.MiniMaxH3VideoVAE``) through ``comfy.sd.VAE``, which picks it by
``decoder.transformer_blocks.0.scale1`` and ``encoder.down.5.block.0.conv1.weight``. Narrow: inside the load the
module's ``ViT3DDecoder`` gets 2 layers of 2 heads x 32 (instead of 36 x 32 x 64) and the VAE ``ch`` 32 (instead of
128), both constructor arguments of the host's classes; ``tile_size`` 64 / ``tile_overlap_min`` 16 (constructor
arguments of the host's class) make a 10x10-latent video 3x3 tiles. The reference is the host's own
``VAE.decode`` (its tiled result: the model's untiled decode is another, worse result). Skipped where the host has
no such class (0.3.75).
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

VIDEO = "VRAMFit_TemporalChunkVideoDecode"
TILED = "VRAMFit_TiledVAEDecode"
SHAPE = (1, 24, 12, 10, 10)
"""12 latent frames (two clips of the host's grid, the second's kept tail flushed: 39 frames), 160x160 px: 3x3
tiles of 64 px."""


def _minimax_module():
    try:
        import comfy.ldm.minimax.vae as mv
    except ImportError:
        return None
    return mv if hasattr(mv, "MiniMaxH3VideoVAE") else None


@contextlib.contextmanager
def _narrow(mv):
    """The host's classes with narrower constructor arguments while ``comfy.sd.VAE`` builds the model."""
    vae_cls, dec_cls = mv.MiniMaxH3VideoVAE, mv.ViT3DDecoder

    def vae(*a, **kw):
        return vae_cls(*a, **{"ch": 32, "tile_size": 64, "tile_overlap_min": 16, **kw})

    def dec(*a, **kw):
        return dec_cls(*a, **{"num_layers": 2, "heads": 2, "dim_head": 32, **kw})

    mv.MiniMaxH3VideoVAE, mv.ViT3DDecoder = vae, dec
    try:
        yield
    finally:
        mv.MiniMaxH3VideoVAE, mv.ViT3DDecoder = vae_cls, dec_cls


def _state_dict(mv, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the narrow model, keyed as the host's class keys them."""
    with _narrow(mv), torch.device("meta"):
        model = mv.MiniMaxH3VideoVAE()
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in model.state_dict().items():
        if k in ("latents_mean", "latents_std"):
            sd[k] = getattr(mv, "LATENTS_MEAN" if k == "latents_mean" else "LATENTS_STD")
            sd[k] = torch.tensor(sd[k])
            continue
        fan = v.shape[-1] if v.ndim > 1 else 1
        w = torch.randn(v.shape, generator=gen) / max(1.0, fan ** 0.5)
        if k.endswith(("scale1", "scale2")):
            w = w.abs() * 0.5 + 0.5
        elif v.ndim == 1 and ("norm" in k) and k.endswith("weight"):
            w = 1.0 + 0.1 * w
        sd[k] = w
    return sd


@pytest.fixture(scope="module")
def minimax(comfy):
    mv = _minimax_module()
    if mv is None:
        pytest.skip("this host has no comfy.ldm.minimax.vae.MiniMaxH3VideoVAE (ComfyUI 0.33 has it)")
    import comfy.sd

    with _narrow(mv):
        vae = comfy.sd.VAE(sd=_state_dict(mv))
    assert type(vae.first_stage_model) is mv.MiniMaxH3VideoVAE and vae.handles_tiling
    return vae


@pytest.fixture(scope="module")
def case(comfy, minimax):
    z = structured_latent(SHAPE, seed=5)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z})
    return z, ref


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]


def _ref_video(ref: torch.Tensor) -> torch.Tensor:
    """VAE Decode's ``(frames, H, W, 3)`` as the executor's ``(1, 3, frames, H, W)``."""
    return ref.permute(3, 0, 1, 2).unsqueeze(0)


def _grid(model, z, **kw):
    from vramfit.memory.executors.host_grid import decode_host_grid

    shape = tuple(int(v) for v in model.decode_output_shape(tuple(z.shape)))
    out = torch.empty(shape)
    with torch.inference_mode():
        decode_host_grid(model, z, out=out, compute_device="cpu", dtype=torch.float32, **kw)
    return out


def test_the_grid_has_three_tiles_a_side_two_clips_and_is_not_the_untiled_decode(comfy, minimax, case):
    """The comparisons below could fail: 3x3 tiles over two clips, and the host's tiled result is another than
    its untiled decode."""
    from vramfit.memory.plan.host_grid import grid_config

    z, ref = case
    model = minimax.first_stage_model
    cfg = grid_config(model, SHAPE)
    assert (len(cfg.rows[0]), len(cfg.cols[0]), len(cfg.clips)) == (3, 3, 2), cfg
    assert any(p.blend for c in cfg.clips for p in c.parts) and cfg.clips[-1].flush > 0, cfg
    model.tiling = False
    try:
        with torch.inference_mode():
            (untiled,) = comfy.VAEDecode().decode(minimax, {"samples": z})
    finally:
        model.tiling = True
    assert untiled.shape == ref.shape
    assert (untiled - ref).abs().max().item() > 1e-3


def test_grid_executor_reproduces_the_host_in_less_memory(minimax, case):
    """Same frames as the host's own ``decode`` (its tiled result) with fewer live tensor bytes: one tile at a time
    instead of the whole clip's canvas (both with their float32 output)."""
    from vramfit.memory.measure.tracker import PeakTracker

    z, ref = case
    model = minimax.first_stage_model
    with PeakTracker("cpu") as host, torch.inference_mode():
        host_out = model.decode(z)
    with PeakTracker("cpu") as ours:
        out = _grid(model, z)
    assert out.shape == host_out.shape == _ref_video(ref).shape
    assert (out - _ref_video(ref)).abs().max().item() <= 1e-4
    assert torch.equal(out, host_out)
    assert ours.peak_bytes < host.peak_bytes, (ours.peak_bytes, host.peak_bytes)


@pytest.mark.parametrize("t", [1, 8])
def test_grid_executor_one_frame_and_a_padded_clip(minimax, comfy, t):
    """``decode``'s one-frame case; 8 latent frames: the host pads the second clip and drops its tail."""
    z = structured_latent((1, 24, t, 10, 10), seed=6)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z})
    out = _grid(minimax.first_stage_model, z)
    assert (out - _ref_video(ref)).abs().max().item() <= 1e-4


def test_progress_per_tile_and_cancel_before_a_tile(minimax, case):
    z, _ = case
    seen: list[tuple[int, int]] = []
    _grid(minimax.first_stage_model, z, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, 18) for i in range(1, 19)]

    class Cancelled(Exception):
        pass

    calls = []

    def stop():
        calls.append(1)
        if len(calls) == 4:
            raise Cancelled

    seen.clear()
    with pytest.raises(Cancelled):
        _grid(minimax.first_stage_model, z, should_stop=stop, progress=lambda d, t: seen.append((d, t)))
    assert len(seen) == 3


def test_an_oom_in_a_tile_decodes_that_tile_again_and_keeps_the_finished_ones(minimax, case):
    z, ref = case
    fired, freed = [], []

    def hook(step: int) -> None:
        if step == 4 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected")

    stats: dict = {}
    out = _grid(minimax.first_stage_model, z, fault_hook=hook, on_oom=lambda: freed.append(1),
                oom_exceptions=(torch.OutOfMemoryError,), stats=stats)
    assert fired == [4] and freed == [1]
    assert stats["restarts"] == 1 and stats["steps"] == 19  # 18 tiles, one of them twice
    assert (out - _ref_video(ref)).abs().max().item() <= 1e-4


def test_video_node_decodes_it_exactly_under_a_budget(video, minimax, case):
    """Temporal-Chunk Video Decode: the host's grid reproduced (checked at first use), said so in the report."""
    z, ref = case
    with torch.inference_mode():
        r = video.decode(minimax, {"samples": z}, budget_mb=64)
    text = r.report.text()
    assert r.plan.path == "host_grid" and r.plan.exact, text
    assert "exact (the host's own tiled result reproduced)" in text, text
    assert "self-check passed" in text, text
    assert r.report.summary.startswith("exact") and "18 grid tiles" in r.report.summary, text
    # predicted (output buffer included) bounds the measured working memory (the buffer is made before the window)
    out = r.images.numel() * 4
    assert r.measured_peak <= r.plan.planned - out <= 3 * r.measured_peak, (r.measured_peak, r.plan.planned, out)
    assert r.images.shape == ref.shape
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_self_check_is_cached_per_structure(video, minimax, case):
    from vramfit.memory.decode.host_grid import check_host_grid
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import make_job

    z, _ = case
    job = make_job(minimax, z, "cpu")
    store = CheckStore()
    first = check_host_grid(job, store)
    assert first.ok and not first.cached, first.describe()
    again = check_host_grid(job, store)
    assert again.ok and again.cached


def test_tiled_node_decodes_a_single_frame_latent(comfy, minimax):
    """Tiled VAE Decode: a 4-D latent on this video VAE is one frame per batch item, through the same grid."""
    tiled = sys.modules[comfy.NODE_CLASS_MAPPINGS[TILED].__module__]
    z = structured_latent((1, 24, 10, 10), seed=7)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z.unsqueeze(2)})
        r = tiled.decode(minimax, {"samples": z})
    text = r.report.text()
    assert r.plan.path == "host_grid" and "exact (the host's own tiled result reproduced)" in text, text
    assert r.images.shape == ref.shape and (r.images - ref).abs().max().item() <= 1e-4, text


def test_a_failed_self_check_takes_the_hosts_own_decode(monkeypatch, video, minimax, case):
    """An executor that does not reproduce the host (here: shifted by 0.01) fails its check; the decode then takes
    the host's own decode, exact by construction, and says why."""
    import vramfit.memory.decode.host_grid as dh
    from vramfit.memory.decode.env import DecodeEnv
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import decode_video, make_job

    real = dh.decode_host_grid

    def shifted(*a, **kw):
        return real(*a, **kw).add_(0.01)

    monkeypatch.setattr(dh, "decode_host_grid", shifted)
    z, ref = case
    with torch.inference_mode():
        r = decode_video(make_job(minimax, z, "cpu"), DecodeEnv(checks=CheckStore()), budget_mb=64)
    text = r.report.text()
    assert r.plan.path == "host" and "self-check FAILED" in text, text
    assert "exact (the host's own tiled result reproduced)" not in text, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_a_batch_of_two_videos_decodes_item_by_item(comfy, video, minimax):
    """The executor decodes one batch item at a time; the host decodes the batch together (no op mixes items)."""
    z = torch.cat([structured_latent((1, 24, 2, 6, 6), seed=s) for s in (8, 9)])
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(minimax, {"samples": z})
        r = video.decode(minimax, {"samples": z})
    text = r.report.text()
    assert r.plan.path == "host_grid" and r.images.shape == ref.shape, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text
    half = ref.shape[0] // 2
    assert (ref[:half] - ref[half:]).abs().max().item() > 1e-2  # the two videos differ
