"""Video decode of SeedVR2's VAE (ComfyUI 0.33's ``handles_tiling`` model ``comfy.ldm.seedvr.vae``): exact tiles and
the host's time slices (:mod:`..executors.seedvr2`), after the same offload and budget steps as every decode, with
its first-use self-check against the host's own ``decode`` (its tiling off, as VAE Decode runs it) and its report.
Entered from ``decode/video.decode_video`` when :func:`..vae.seedvr2_layout.seedvr2_of` recognises the model.
Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..executors.seedvr2 import EXECUTOR_VERSION, decode_seedvr2
from ..plan.seedvr2 import plan_seedvr2
from ..plan.types import Chunking, Plan
from ..plan.video import REPORT_NODE, VideoJob, model_key
from ..report import (
    Report,
    flag_measured_overrun,
    fmt_bytes,
    fmt_seconds,
    measured_text,
    peak_verdict,
    summary_line,
)
from ..vae.seedvr2_layout import seedvr2_layout
from .env import DecodeEnv, load_weights, measured, prepare
from .first_use import FirstUse, first_use_tag
from .self_check import CheckStore, Verdict, checked

log = logging.getLogger("vramfit.memory.decode.seedvr2")

__all__ = ["CHECK_LATENT", "CHECK_TILE", "EXACT_TEXT", "check_seedvr2", "decode_seedvr2_video"]

CHECK_LATENT = (2, 4, 2, 3)
"""``(B, T, h, w)`` of the self-check's latent: two videos (the host decodes them together, the walk item by item),
three of the host's time slices (the first of two latent frames, then two carried ones), 16x24 px."""
CHECK_TILE = (4, 4)
"""The self-check's tile: 1x1 to 4x6 tiles per segment (every tile edge inside a frame at full resolution)."""
EXACT_TEXT = "exact (equal to VAE Decode: the host's decode with its own tiling off)"


def _key(job: VideoJob) -> str:
    lay = seedvr2_layout(job.vae.first_stage_model)
    return f"seedvr2/{model_key(job)}/{EXECUTOR_VERSION}/check2/slices{lay.slice_min}-{int(lay.use_slicing)}"


def check_seedvr2(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                  first_use: FirstUse | None = None, norm_params: Any = None) -> Verdict:
    """Self-check of the executor for this model on this host: a random latent of :data:`CHECK_LATENT` decoded by
    the host's ``first_stage_model.decode`` and by the executor in :data:`CHECK_TILE` tiles and on whole frames,
    compared on [-1, 1] as VAE Decode's output is clamped (in half precision a random model's raw outputs past 1
    carry ulps of 2 or 4). Cached per structure (code fingerprint, the host's slicing, executor version, dtype, device type); an
    inconclusive check is never cached."""
    model = job.vae.first_stage_model
    c = int(job.z.shape[1])
    b, t, h, w = CHECK_LATENT
    z = torch.randn((b, c, t, h, w), generator=torch.Generator().manual_seed(0)).to(job.device, job.dtype)
    shape = (b, 3, seedvr2_layout(model).frames(t), h * 8, w * 8)

    def run(tile: tuple[int, int] | None) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            out = torch.empty(shape, dtype=job.dtype, device=job.device)
            return decode_seedvr2(model, z, tile, out=out, compute_device=job.device, dtype=job.dtype,
                                  norm_params=norm_params).clamp_(-1.0, 1.0)
        return go

    configs = [(f"2 videos x 3 time slices, {CHECK_TILE[0]}x{CHECK_TILE[1]}-px tiles", run(CHECK_TILE)),
               ("2 videos x 3 time slices, whole frames", run(None))]
    return checked(_key(job), store, model, lambda: model.decode(z).clamp_(-1.0, 1.0), configs, job.dtype, prepare,
                   first_use)


def decode_seedvr2_video(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                         t_start: float | None = None) -> Any:
    """``decode_video`` for SeedVR2: offload and budget (:func:`.env.prepare`), self-check, plan
    (:func:`..plan.seedvr2.plan_seedvr2`), the executor into the output buffer (or, when the self-check failed, the
    host's own decode), report. Returns a ``decode.video.VideoDecodeResult``."""
    from .video import VideoDecodeResult, _host_decode, _post  # decode/video.py enters here: no import cycle

    vae, z = job.vae, job.z
    model = vae.first_stage_model
    lay = seedvr2_layout(model)
    b, _, t, h, w = (int(v) for v in z.shape)
    t0 = time.perf_counter() if t_start is None else t_start
    first = FirstUse(env.phase)

    def ratio(path: str) -> float:
        return env.observed.ratio(observed_key(path, job.family, job.dtype, job.device))

    prep = prepare(vae, env, lambda: plan_seedvr2(job, 1 << 62, env.peaks, "", True).planned or None, budget_mb,
                   unload_others)
    budget = prep.budget
    verdict = check_seedvr2(job, env.checks, lambda: load_weights(vae, env, 0), first, env.norm_params)
    job = dataclasses.replace(job, verdict=verdict)
    r = ratio("seedvr2")
    p = plan_seedvr2(job, int(budget.available / max(1.0, r)), env.peaks, verdict.describe(), verdict.ok)
    p.ratio = max(1.0, r)
    p.planned = int(p.planned * p.ratio)
    if not verdict.ok:  # not proven on this host: the host's own decode (exact by construction)
        p = Plan("host", Chunking(max(1, t - 1)), "the host's own decode (first_stage_model.decode, as VAE Decode), "
                 "one batch item at a time", 0, reason=f"the exact tiled executor's {verdict.describe()}")
    plan_seconds = time.perf_counter() - t0
    load_weights(vae, env, p.planned)

    frames = lay.frames(t)
    oh, ow = h * 8, w * 8
    buf = torch.empty((b * frames, oh, ow, 3), dtype=torch.float32, device=job.out_device)
    view = buf.view(b, frames, oh, ow, 3).permute(0, 4, 1, 2, 3)
    bar = env.progress_bar(max(1, p.units * b)) if env.progress_bar is not None else None
    hook = env.fault_hook
    stats: dict = {}
    t1 = time.perf_counter()
    with measured(env, job.device) as m:
        if p.path == "host":
            _host_decode(job, view, bar, env, stats)
        else:
            cfg = p.config
            decode_seedvr2(model, z, cfg.tile, out=view, compute_device=job.device, dtype=job.dtype,
                           store_device="cpu" if cfg.store == "host" else None, progress=bar,
                           should_stop=env.should_stop,
                           fault_hook=(lambda s: hook("step", s)) if hook is not None else None,
                           oom_exceptions=env.oom_exceptions, on_oom=env.on_oom, norm_params=env.norm_params,
                           stats=stats)
        _post(vae, view)
    seconds = time.perf_counter() - t1
    if p.planned and not stats.get("restarts"):
        env.observed.note(observed_key(p.path, job.family, job.dtype, job.device), m.peak, int(p.planned / p.ratio),
                          m.kind)
    report = _report(job, p, budget, prep.offload, stats, seconds, plan_seconds, m.peak, m.method, first)
    return VideoDecodeResult(buf, report, p, budget, seconds, m.peak, m.method, stats, plan_seconds)


def _report(job: VideoJob, plan: Plan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, peak: int | None, method: str, first: FirstUse) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.path == "host":
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    else:
        r.add("path", f"{EXACT_TEXT}: SeedVR2 in tiles with shared per-frame statistics, its time slices carried")
    r.add("check", f"exact tiled executor: {job.verdict.describe()}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.description)
    if job.frames_per_chunk:
        r.add("note", f"frames_per_chunk {job.frames_per_chunk} not used: SeedVR2's own time slices are part of "
                      "its result")
    if plan.planned:
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        over = " - OVER BUDGET (the smallest tile sized)" if plan.over_budget else ""
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, meta sizing){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload and self-check included)")
    else:
        r.add("predicted", "not predicted")
    r.add("measured", measured_text(peak, method))
    flag_measured_overrun(r, peak, method, int(budget.available), log)
    tile = stats.get("tiles")
    r.add("time", f"{fmt_seconds(seconds)} ({stats.get('chunks', '?')} time slices, "
                  f"{'whole frames' if tile is None else f'tiles of {tile[0]}x{tile[1]} px'})")
    if first.done:
        r.add("first use", first.describe())
    if stats.get("restarts"):
        r.add("oom", f"{stats['restarts']} out-of-memory error(s): tile halved and decoding went on (finished "
                     "tiles kept)")
    b = int(job.z.shape[0])
    shape = "host decode" if plan.path == "host" else (
        f"{stats.get('chunks', '?')} slices" + ("" if tile is None else f" x tiles of {tile[0]} px"))
    r.summary = summary_line(
        "exact",
        shape + (f" x {b} videos" if b > 1 and plan.path == "host" else ""),
        peak_verdict(peak, method, int(budget.available), plan.planned or None),
        "planned over budget" if plan.over_budget and not (peak or 0) > budget.available else "",
        fmt_seconds(seconds),
        f"{stats['restarts']} out-of-memory retr{'ies' if stats['restarts'] != 1 else 'y'}"
        if stats.get("restarts") else "",
        first_use_tag(first),
    )
    return r
