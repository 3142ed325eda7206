"""SeedVR2's video VAE (ComfyUI 0.33's ``comfy.ldm.seedvr.vae``, ``handles_tiling``) decoded exactly under a budget
(issue 36, item 2): the host's time slices with their carried causal frames, the mid block (per-frame attention) once
per slice on the whole latent, the up path in spatial tiles with per-frame GroupNorm statistics shared across tiles.

The VAE is the narrow fixture twin (``scripts.fixtures`` ``seedvr2_narrow``: the host's class and key names, a quarter
of the channels) loaded through ComfyUI's ``VAELoader`` as a user's file is. The reference is the host's own
``VAE Decode`` (the model's ``decode`` with its ``seedvr2_tiling`` off); its tiled decode (``seedvr2_tiling`` on, core's
``VAE Decode (Tiled)``) is another result, measured beside it. Skipped where the host has no such class (0.3.75)."""

from __future__ import annotations

import logging
import math
import sys

import pytest
import torch

from scripts.fixtures.host import available
from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

log = logging.getLogger("vramfit.tests.seedvr2")

VIDEO = "VRAMFit_TemporalChunkVideoDecode"
TILED = "VRAMFit_TiledVAEDecode"
SHAPE = (1, 16, 4, 6, 5)
"""4 latent frames (the host's 3 time slices: 2 + 1 + 1), 13 frames of 48x40 px."""


@pytest.fixture(scope="module")
def seedvr2(comfy, fixture_vaes):
    if not available("seedvr2_narrow"):
        pytest.skip("this host has no comfy.ldm.seedvr.vae (ComfyUI 0.33 has SeedVR2's VAE)")
    vae = fixture_vaes.load(comfy, "seedvr2_narrow")
    assert type(vae.first_stage_model).__name__ == "VideoAutoencoderKLWrapper" and vae.handles_tiling
    return vae


@pytest.fixture(scope="module")
def case(comfy, seedvr2):
    z = structured_latent(SHAPE, seed=5)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(seedvr2, {"samples": z})
    return z, ref


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__]


def _as_video(ref: torch.Tensor) -> torch.Tensor:
    """VAE Decode's ``(frames, H, W, 3)`` as the executor's ``(1, 3, frames, H, W)``."""
    return ref.permute(3, 0, 1, 2).unsqueeze(0)


def _walk(model, z, tile, **kw):
    from vramfit.memory.executors.seedvr2 import decode_seedvr2
    from vramfit.memory.vae.seedvr2_layout import seedvr2_layout

    frames = seedvr2_layout(model).frames(int(z.shape[2]))
    out = torch.full((int(z.shape[0]), 3, frames, int(z.shape[3]) * 8, int(z.shape[4]) * 8), float("nan"))
    with torch.inference_mode():
        decode_seedvr2(model, z, tile, out=out, compute_device="cpu", dtype=torch.float32, **kw)
    return out


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def test_layout_slices_and_segments(seedvr2):
    from vramfit.memory.vae.seedvr2_layout import seedvr2_layout

    lay = seedvr2_layout(seedvr2.first_stage_model)
    assert lay.reason is None
    assert lay.slices(4) == [(0, 2, "INITIALIZING"), (2, 3, "ACTIVE"), (3, 4, "ACTIVE")]
    assert lay.slices(2) == [(0, 2, "DISABLED")]
    assert lay.frames(4) == 13
    kinds = [s.kind for s in lay.segments]
    assert kinds.count("up") == 3 and kinds[-1] == "out" and kinds.count("res1") == kinds.count("res2") == 12


@pytest.mark.parametrize("tile", [None, (16, 16), (7, 9)])
def test_executor_equals_vae_decode(seedvr2, case, tile):
    """Whole frames and tiles (16 px: 3x3 tiles at full resolution; 7x9 px: 7x5), 3 time slices: equal to VAE Decode
    (the host's ``process_output`` applied to ours) within 1e-4."""
    z, ref = case
    stats: dict = {}
    out = _walk(seedvr2.first_stage_model, z, tile, stats=stats)
    assert stats["chunks"] == 3
    got = seedvr2.process_output(out.clone())
    d = (got - _as_video(ref)).abs().max().item()
    log.info("SeedVR2 exact walk, tile %s: max abs %.3g vs VAE Decode", tile, d)
    assert torch.isfinite(out).all() and d <= 1e-4


def test_executor_batch_and_short_latents(seedvr2):
    """A batch of two (the host decodes them together, the walk item by item); 1 and 2 latent frames (one slice,
    no carried frames); raw outputs against ``first_stage_model.decode``."""
    model = seedvr2.first_stage_model
    for shape in [(2, 16, 3, 3, 4), (1, 16, 1, 3, 3), (1, 16, 2, 4, 3)]:
        z = structured_latent(shape, seed=8)
        with torch.inference_mode():
            ref = model.decode(z)
        out = _walk(model, z, (8, 8))
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() <= 1e-4, shape


def test_the_comparisons_can_fail_and_seedvr2_tiling_is_another_result(comfy, seedvr2, case):
    """Without shared statistics (each tile its own GroupNorm statistics, as the host's tiled decode does) the
    result is off; the host's ``seedvr2_tiling`` (core's VAE Decode (Tiled)) is another result than VAE Decode."""
    z, ref = case
    model = seedvr2.first_stage_model
    with torch.inference_mode():
        tiled = model.decode(z, seedvr2_tiling={"enable_tiling": True, "tile_size": (16, 16),
                                               "tile_overlap": (8, 8), "temporal_size": None,
                                               "temporal_overlap": None})
    got_tiled = seedvr2.process_output(tiled.float().clone())
    ours = seedvr2.process_output(_walk(model, z, (16, 16)).clone())
    d_tiled = (got_tiled - _as_video(ref)).abs().max().item()
    d_ours = (ours - _as_video(ref)).abs().max().item()
    log.info("SeedVR2 vs VAE Decode: exact walk %.3g max abs (%.1f dB); seedvr2_tiling 16 px / 8 overlap %.3g "
             "(%.1f dB)", d_ours, _psnr(ours, _as_video(ref)), d_tiled, _psnr(got_tiled, _as_video(ref)))
    assert d_tiled > 1e-3 and d_ours <= 1e-4


def test_progress_cancel_and_oom_resume(seedvr2, case):
    from vramfit.memory.executors.seedvr2 import units
    from vramfit.memory.vae.seedvr2_layout import seedvr2_layout

    z, ref = case
    model = seedvr2.first_stage_model
    total = units(seedvr2_layout(model), 4, 6, 5, (16, 16))
    seen: list[tuple[int, int]] = []
    _walk(model, z, (16, 16), progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, total) for i in range(1, total + 1)]

    class Cancelled(Exception):
        pass

    calls = []

    def stop():
        calls.append(1)
        if len(calls) == 40:
            raise Cancelled

    seen.clear()
    with pytest.raises(Cancelled):
        _walk(model, z, (16, 16), should_stop=stop, progress=lambda d, t: seen.append((d, t)))
    assert 0 < len(seen) < 40

    fired, freed = [], []

    def hook(step: int) -> None:
        if step == 200 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected")

    stats: dict = {}
    out = _walk(model, z, (16, 16), fault_hook=hook, on_oom=lambda: freed.append(1),
                oom_exceptions=(torch.OutOfMemoryError,), stats=stats)
    assert fired == [200] and freed == [1] and stats["restarts"] == 1 and stats["tiles"] == (8, 8)
    assert (seedvr2.process_output(out.clone()) - _as_video(ref)).abs().max().item() <= 1e-4


def test_video_node_decodes_it_exactly_in_tiles_under_a_budget(video, seedvr2, case):
    """Temporal-Chunk Video Decode under a budget below the whole-frame walk: tiles (>= 4 at full resolution),
    checked at first use against the host's decode, equal to VAE Decode, said so in the report."""
    from vramfit.memory.decode.video import make_job
    from vramfit.memory.plan.seedvr2 import SeedVR2Config, seedvr2_peak
    from vramfit.memory.plan.video import PeakStore

    z, ref = case
    job = make_job(seedvr2, z, "cpu")
    whole = seedvr2_peak(job, SeedVR2Config(None, "device", 3), PeakStore())
    tiled = seedvr2_peak(job, SeedVR2Config((16, 16), "device", 3), PeakStore())
    assert tiled < whole, (tiled, whole)
    budget_mb = (whole + tiled) / 2 / 2**20 + r_out_mb(ref)
    with torch.inference_mode():
        r = video.decode(seedvr2, {"samples": z}, budget_mb=budget_mb)
    text = r.report.text()
    assert r.plan.path == "seedvr2" and r.plan.exact, text
    cfg = r.plan.config
    assert cfg.tile is not None and cfg.grid[0] * cfg.grid[1] >= 4, text
    assert "equal to VAE Decode" in text and "self-check passed" in text, text
    assert r.report.summary.startswith("exact"), text
    assert r.images.shape == ref.shape
    assert (r.images - ref).abs().max().item() <= 1e-4, text


@pytest.mark.parametrize("tile", [(7, 9), (16, 16)])
def test_sizing_one_tile_per_shape_gives_the_full_peak(seedvr2, tile):
    """The planner sizes the walk with one tile of each shape per segment (``sizing=True``): on fake tensors the
    same peak, to the byte, as every tile (at 4K the full walk on fake tensors took minutes)."""
    from vramfit.memory.executors.seedvr2 import decode_seedvr2
    from vramfit.memory.measure.sizing import MetaSizer
    from vramfit.memory.vae.seedvr2_layout import seedvr2_layout

    model = seedvr2.first_stage_model
    b, c, t, h, w = SHAPE
    frames = seedvr2_layout(model).frames(3)

    def peak(sizing: bool) -> int:
        with torch.inference_mode(), MetaSizer([model], torch.float32, "cpu") as sz:
            out = torch.empty((1, 3, frames, h * 8, w * 8))
            decode_seedvr2(model, torch.empty((1, c, 3, h, w)), tile, out=out, compute_device="cpu",
                           dtype=torch.float32, sizing=sizing)
            del out
        return sz.peak_bytes

    full = peak(False)
    assert full > 0 and peak(True) == full


def test_plan_candidates(seedvr2):
    """The planner's order: on the CPU whole frames then ever smaller tiles (those not smaller than the frame left
    out); on an accelerator whole frames and 512 px with the store on the device, then every tile with the store in
    host memory; a user's tile_size alone."""
    import dataclasses

    from vramfit.memory.decode.video import make_job
    from vramfit.memory.plan.seedvr2 import candidates

    z = torch.zeros(1, 16, 5, 135, 240)  # 1080p
    job = make_job(seedvr2, z, "cpu")
    cpu = [(c.tile, c.store) for c in candidates(job)]
    assert cpu == [(None, "device"), ((512, 512), "device"), ((256, 256), "device"), ((128, 128), "device"),
                   ((64, 64), "device"), ((32, 32), "device")]
    assert candidates(job)[1].grid == (3, 4) and candidates(job)[0].slices == 4
    gpu = [(c.tile, c.store) for c in candidates(dataclasses.replace(job, device=torch.device("cuda")))]
    assert gpu[:3] == [(None, "device"), ((512, 512), "device"), (None, "host")] and len(gpu) == 8
    assert all(s == "host" for _, s in gpu[2:])
    small = make_job(seedvr2, torch.zeros(1, 16, 2, 6, 5), "cpu")
    assert [c.tile for c in candidates(small)] == [None, (32, 32)]
    user = [(c.tile, c.store) for c in candidates(dataclasses.replace(job, tile_size=200))]
    assert user == [((200, 200), "device")]


def test_a_store_in_host_memory_only_where_the_hosts_ram_holds_it(seedvr2, monkeypatch):
    """Planning for an accelerator under a budget that no store on the device meets: the store in host memory when
    the host's RAM holds it; the store on the device at ever smaller tiles when it does not, the plan row saying
    why. The sizes are stand-ins (the meta sizing of a host store: test_memory_sizing; a CPU build cannot run the
    walk on fake CUDA tensors): whole frames 900, each tile size less, a store in host memory 300 less and 50 MB
    of RAM."""
    import dataclasses

    from vramfit.memory.decode.video import make_job
    from vramfit.memory.plan import seedvr2 as ps
    from vramfit.memory.plan.video import PeakStore

    def sizes(job, cfg, peaks):
        peak = 900 - (0 if cfg.tile is None else 1000 // cfg.tile[0]) - (300 if cfg.store == "host" else 0)
        return peak, (50 << 20 if cfg.store == "host" else 0)

    monkeypatch.setattr(ps, "_sizes", sizes)
    z = torch.zeros(1, 16, 3, 12, 10)
    job = dataclasses.replace(make_job(seedvr2, z, "cpu"), device=torch.device("cuda"))  # planning only
    assert ps.seedvr2_host_bytes(job, ps.candidates(job)[-1], PeakStore()) == 50 << 20
    free = ps.plan_seedvr2(job, 100, PeakStore())  # nothing fits: the last candidate, in host memory
    assert free.config.store == "host" and free.over_budget and "not used" not in free.description
    roomy = ps.plan_seedvr2(dataclasses.replace(job, host_room=50 << 20), 100, PeakStore())
    assert roomy.config == free.config
    fits = ps.plan_seedvr2(dataclasses.replace(job, host_room=50 << 20), 600, PeakStore())
    assert fits.config.store == "host" and fits.config.tile is None and not fits.over_budget
    tight = ps.plan_seedvr2(dataclasses.replace(job, host_room=(50 << 20) - 1), 600, PeakStore())
    assert tight.config.store == "device" and tight.config.tile == (32, 32) and tight.over_budget
    assert "store in host memory not used: it needs 50.0 MiB, the host's RAM has room for 50.0 MiB" in \
        tight.description


def test_self_check_is_cached_per_structure(seedvr2, case):
    from vramfit.memory.decode.seedvr2 import CHECK_LATENT, check_seedvr2
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import make_job

    z, _ = case
    job = make_job(seedvr2, z, "cpu")
    store = CheckStore()
    first = check_seedvr2(job, store)
    assert first.ok and not first.cached, first.describe()
    assert CHECK_LATENT[0] == 2 and CHECK_LATENT[1] >= 4  # a batch, >= 3 time slices
    again = check_seedvr2(job, store)
    assert again.ok and again.cached


def r_out_mb(ref: torch.Tensor) -> float:
    return ref.numel() * 4 / 2**20


def test_tiled_node_decodes_single_frames(comfy, seedvr2):
    """Tiled VAE Decode: a 4-D latent on this video VAE is one frame per batch item, through the same path (no
    refusal any more)."""
    tiled = sys.modules[comfy.NODE_CLASS_MAPPINGS[TILED].__module__]
    z = structured_latent((2, 16, 4, 4), seed=7)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(seedvr2, {"samples": z.unsqueeze(2)})
        r = tiled.decode(seedvr2, {"samples": z})
    text = r.report.text()
    assert r.plan.path == "seedvr2" and "equal to VAE Decode" in text, text
    assert r.images.shape == ref.shape and (r.images - ref).abs().max().item() <= 1e-4, text


def test_a_failed_self_check_takes_the_hosts_own_decode(monkeypatch, seedvr2, case):
    """A walk that does not reproduce the host (here: shifted by 0.01) fails its check; the decode then takes the
    host's own decode, exact by construction, and says why."""
    import vramfit.memory.decode.seedvr2 as ds
    from vramfit.memory.decode.env import DecodeEnv
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import decode_video, make_job

    real = ds.decode_seedvr2

    def shifted(*a, **kw):
        return real(*a, **kw).add_(0.01)

    monkeypatch.setattr(ds, "decode_seedvr2", shifted)
    z, ref = case
    with torch.inference_mode():
        r = decode_video(make_job(seedvr2, z, "cpu"), DecodeEnv(checks=CheckStore()), budget_mb=64)
    text = r.report.text()
    assert r.plan.path == "host" and "self-check FAILED" in text, text
    assert "equal to VAE Decode" not in text, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_its_decode_takes_the_steps_of_every_video_decode(seedvr2, case):
    """The same flow as every video decode (``decode/video_flow.run_flow``): the executor's self-check runs after the
    plan that takes it, before the weights and the run (``test_never_worse.py`` STEPS, the video node)."""
    from vramfit.memory.decode.env import DecodeEnv
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import decode_video, make_job

    seen: list[str] = []
    env = DecodeEnv(checks=CheckStore(), stage_hook=lambda s: seen.append(s) if s not in seen else None)
    z, ref = case
    with torch.inference_mode():
        r = decode_video(make_job(seedvr2, z, "cpu"), env, budget_mb=64)
    text = r.report.text()
    assert r.plan.path == "seedvr2" and "self-check passed" in dict(r.report.rows)["check"], text
    assert seen == ["identify", "prepare", "plan", "check", "weights", "run", "report"], seen
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_its_plan_takes_the_paths_observed_ratio(seedvr2, case):
    """A measured over predicted peak learned for the path (``cost/observed``) plans as every planner does
    (``plan/grid.scaled``): for the budget divided by it, the predicted peak scaled back by it."""
    from vramfit.memory.cost.observed import observed_key
    from vramfit.memory.decode.env import DecodeEnv
    from vramfit.memory.decode.own_executor import own_path
    from vramfit.memory.decode.seedvr2 import SEEDVR2
    from vramfit.memory.decode.self_check import CheckStore
    from vramfit.memory.decode.video import make_job

    z, _ = case
    job = make_job(seedvr2, z, "cpu")
    env = DecodeEnv(checks=CheckStore())
    env.observed.put(observed_key("seedvr2", job.family, job.dtype, job.device), 2.0)
    with torch.inference_mode():
        p, per_item = own_path(SEEDVR2).plan(job, 64 << 20, env, 0)
        q = SEEDVR2.plan(job, 32 << 20, env.peaks)
    assert not per_item and p.path == q.path == "seedvr2" and p.config == q.config, (p.description, q.description)
    assert p.ratio == 2.0 and p.planned == 2 * q.planned > 0, (p.planned, q.planned)
