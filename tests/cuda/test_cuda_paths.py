"""The device paths of Tiled VAE Decode, on the suite's device (CUDA on a GPU; CPU in the dry run).

Each test records what it measured with ``record_property`` (the suite puts it in its table):

* the peak tracker against ``torch.cuda.max_memory_allocated`` (CPU: against known allocations);
* the exact executor with its store on the device and in (pinned) host memory: the two equal each other
  bit for bit, and are as close to the float32 decode of the same weights as ComfyUI's own decode in the
  same dtype is (at most twice its max abs error, or the dtype's noise floor). Equality with ComfyUI's own
  decode is not the criterion below float32: on an H200 in bfloat16 the two differ by up to 0.21 at 1024^2
  (random weights; convolution algorithms differ with the tile shapes), ``bit_equal_core`` and
  ``max_abs_vs_core`` record it (docs/BENCHMARKS.md, GPU results);
* an out-of-memory error injected inside tile k: the decode resumes from its finished tiles and equals an
  uninterrupted run within float noise;
* Cancel in the middle of a decode, and 100 repeated decodes (5 in the dry run): memory back to its
  baseline;
* the planner's predicted peak against the measured one, within 10 % (CUDA: the planned peak, overhead
  included, against ``max_memory_allocated``; CPU: the tensor-level prediction against the live-tensor
  count, the planner's unit there).
"""

from __future__ import annotations

import gc

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from tests.cuda.conftest import SMALL

pytestmark = pytest.mark.cuda

MiB = 2**20
PX = 96 if SMALL else 1024
"""Image side of the decodes (px)."""
TILE = 32 if SMALL else 256
REPEATS = 5 if SMALL else 100


def _allocated(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device))
    return 0


def _latent(seed: int, px: int = PX) -> torch.Tensor:
    return structured_latent((1, 4, px // 8, px // 8), seed=seed)


def _raises(fn, exc: type[BaseException]) -> bool:
    """True when ``fn()`` raised ``exc``; the exception (and the frames it holds) is gone on return, as
    when ComfyUI's executor reports an interrupted prompt."""
    try:
        fn()
    except exc:
        return True
    return False


def _tolerance(pack_memory, dtype: torch.dtype) -> float:
    return pack_memory("decode.self_check").tolerance(dtype)


def test_tracker_matches_allocator(device, pack_memory, record_property):
    tracker = pack_memory("measure.tracker")
    n = 64 * MiB
    with tracker.PeakTracker(device) as t:
        a = torch.empty(n // 4, device=device)
        b = torch.empty(n // 8, device=device)
        del a
        c = torch.empty(n // 16, device=device)
        del b, c
    record_property("torch", torch.__version__)
    record_property("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    record_property("method", t.method)
    record_property("peak_mib", t.peak_bytes / MiB)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        x = torch.empty(n // 4, device=device)
        y = torch.empty(n // 8, device=device)
        del x, y
        truth = torch.cuda.max_memory_allocated(device) - base
        record_property("max_memory_allocated_mib", truth / MiB)
        assert t.peak_bytes == truth
    else:
        assert t.peak_bytes == n + n // 2  # a and b alive together
    assert t.end_bytes == 0


@pytest.mark.parametrize("store", ["device", "host"])
def test_exact_store_placement_matches_core(device, suite_kl, suite_kl_fp32, pack_memory, store,
                                           record_property):
    te = pack_memory("executors.kl_exact")
    vae = suite_kl
    import comfy.model_management as mm

    z = _latent(7, px=64 if SMALL else PX).to(vae.vae_dtype).to(device)
    mm.load_models_gpu([suite_kl_fp32.patcher])  # first: loading it may offload the VAE under test
    with torch.inference_mode():
        truth = suite_kl_fp32.first_stage_model.decode(z.float()).float().cpu()
    mm.load_models_gpu([vae.patcher])
    model = vae.first_stage_model
    with torch.inference_mode():
        ref = model.decode(z).float().cpu()
    host = torch.device("cpu")
    out = te.decode_exact(model, z, TILE, store_device=device if store == "device" else host,
                          compute_device=device, out_device=host, pin_memory=store == "host")
    diff = (out.float() - ref).abs().max().item()
    err_core = (ref - truth).abs().max().item()
    err_ours = (out.float() - truth).abs().max().item()
    tol = _tolerance(pack_memory, vae.vae_dtype)
    record_property("dtype", str(vae.vae_dtype))
    record_property("max_abs_vs_core", diff)
    record_property("bit_equal_core", bool(torch.equal(out.float(), ref)))
    record_property("core_vs_fp32", err_core)
    record_property("tiles_vs_fp32", err_ours)
    bound = max(2 * err_core, _tolerance(pack_memory, torch.float32))
    assert err_ours <= bound, f"store on {store}: {err_ours} from fp32 > {bound} (core: {err_core})"
    if vae.vae_dtype == torch.float32:
        assert diff <= tol, f"store on {store}: {diff} > {tol}"
    other = te.decode_exact(model, z, TILE, store_device=host if store == "device" else device,
                            compute_device=device, out_device=host, pin_memory=store != "host")
    assert torch.equal(out, other), "the store's placement changed the values"


def test_oom_inside_tile_resumes_and_matches(device, suite_kl, tiled, pack_memory, record_property):
    z = _latent(11)
    clean = tiled.decode(suite_kl, {"samples": z}, tile_size=TILE)
    assert clean.plan.path == "exact", clean.report.text()
    fired = []

    def hook(kind: str, k: int) -> None:
        if kind == "tile" and k == 3 and not fired:
            fired.append(k)
            raise torch.OutOfMemoryError("injected by the GPU suite at tile 3")

    tiled._FAULT_HOOK = hook
    try:
        r = tiled.decode(suite_kl, {"samples": z}, tile_size=TILE)
    finally:
        tiled._FAULT_HOOK = None
    assert fired == [3]
    diff = (r.images - clean.images).abs().max().item()
    record_property("oom_events", "; ".join(r.oom_events))
    record_property("max_abs_vs_uninterrupted", diff)
    assert r.oom_events, r.report.text()
    assert diff <= _tolerance(pack_memory, suite_kl.vae_dtype)


def test_cancel_mid_decode_returns_memory(device, suite_kl, tiled, pack_memory, record_property):
    import comfy.model_management as mm

    z = _latent(13)
    tiled.decode(suite_kl, {"samples": z}, tile_size=TILE)  # weights loaded, caches warm
    base = _allocated(device)

    def hook(kind: str, k: int) -> None:
        if kind == "tile" and k == 2:
            mm.interrupt_current_processing(True)

    tiled._FAULT_HOOK = hook
    try:
        with pack_memory("measure.tracker").PeakTracker(device) as t:
            cancelled = _raises(lambda: tiled.decode(suite_kl, {"samples": z}, tile_size=TILE),
                                mm.InterruptProcessingException)
            gc.collect()
    finally:
        tiled._FAULT_HOOK = None
        mm.interrupt_current_processing(False)
    after = _allocated(device)
    record_property("allocated_after_cancel_minus_baseline_mib", (after - base) / MiB)
    record_property("peak_before_cancel_mib", t.peak_bytes / MiB)
    assert cancelled, "Cancel did not stop the decode"
    assert t.peak_bytes > 0, "the decode was cancelled before it allocated anything"
    assert after == base
    assert t.end_bytes <= 0, f"{t.end_bytes} bytes of the cancelled decode's tensors still alive"


def test_repeated_decodes_do_not_leak(device, suite_kl, tiled, pack_memory, record_property):
    z = _latent(17, px=64 if SMALL else 512)
    tiled.decode(suite_kl, {"samples": z}, tile_size=TILE)
    base = _allocated(device)
    tracker = pack_memory("measure.tracker")
    with tracker.PeakTracker(device) as t:
        for _ in range(REPEATS):
            tiled.decode(suite_kl, {"samples": z}, tile_size=TILE)
        gc.collect()
    after = _allocated(device)
    record_property("repeats", REPEATS)
    record_property("allocated_growth_mib", (after - base) / MiB)
    assert after == base
    assert t.end_bytes <= 0, f"{t.end_bytes} bytes of tensors still alive after {REPEATS} decodes"


def test_planner_prediction_within_10_percent(device, suite_kl, tiled, record_property):
    z = _latent(19)
    free = tiled.decode(suite_kl, {"samples": z})  # untiled: the budget that forces tiles is below its peak
    budget_mb = max(16, int(0.4 * free.plan.planned / MiB))
    tiled.MEASURE_CPU_TENSORS = device.type == "cpu"  # CPU: live tensors (the planner's unit), not RSS
    try:
        r = tiled.decode(suite_kl, {"samples": z}, budget_mb=budget_mb)
    finally:
        tiled.MEASURE_CPU_TENSORS = True
    assert r.plan.path == "exact" and r.plan.exact, r.report.text()
    predicted = r.plan.planned if device.type == "cuda" else r.plan.tracked
    measured = r.measured_peak
    record_property("budget_mb", budget_mb)
    record_property("predicted_mib", predicted / MiB)
    record_property("measured_mib", measured / MiB)
    record_property("measure", r.measure_method)
    assert measured is not None
    assert abs(predicted - measured) <= 0.10 * measured, r.report.text()


def test_carried_chunks_pass_their_self_check_on_the_device(device, comfy, host_config, pack_memory,
                                                            record_property):
    """HunyuanVideo 1.5's carried chunks (narrow twin) pass their first-use self-check on the suite's device:
    on an H100 (2026-11-27) every carried family's check failed there ("Expected all tensors to be on the same
    device"): the executor writes into a host buffer while the host's decode returns on the device, and the
    check compared the two where they were. The verdict is checked, not cached (a fresh store)."""
    from scripts.fixtures.files import load_vae

    vae = load_vae(comfy, "hunyuan_video15_narrow", host_config.models_dir / "vae", torch.float32)
    video = pack_memory("decode.video")
    z = structured_latent((1, 32, 5, 2, 2), seed=0)
    job = video.make_job(vae, z, "cpu")
    store = pack_memory("decode.self_check").CheckStore()
    verdict = video.check_carried(job, store)
    record_property("verdict", verdict.describe())
    assert job.carry is not None and verdict.conclusive and verdict.ok, verdict.describe()
