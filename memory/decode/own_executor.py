"""The decode of a video VAE served by an executor of its own with the host's decode as the fallback (MiniMax H3's
grid, SeedVR2's walk): offload and budget (:func:`.env.prepare`), the executor's first-use self-check, its plan
(scaled by the path's observed ratio), the executor into the output buffer (or the host's own decode when the check
failed), the observed ratio learned, the report. Each family gives an :class:`OwnExecutor`: its check, planner,
geometry, run and report wording. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..plan.types import Plan
from ..plan.video import REPORT_NODE, PeakStore, VideoJob, host_plan
from ..report import (
    Report,
    flag_measured_overrun,
    fmt_bytes,
    fmt_seconds,
    measured_text,
    peak_verdict,
    summary_line,
)
from .env import DecodeEnv, load_weights, measured, prepare
from .first_use import CLIP_SIZING, FirstUse, first_use_tag
from .self_check import Verdict
from .video_out import VideoDecodeResult, buffer_bytes, host_decode, output_buffer, post_process

log = logging.getLogger("vramfit.memory.decode.own_executor")

__all__ = ["OwnExecutor", "decode_own"]


@dataclasses.dataclass(frozen=True)
class OwnExecutor:
    path: str
    """The plan's path (and its observed ratio's key)."""
    name: str
    """The executor in the report's ``check`` row and the fallback's reason (``grid executor``)."""
    exact_text: str
    """The report's ``path`` row when the executor runs."""
    check: Callable[[VideoJob, DecodeEnv, Callable[[], None], FirstUse], Verdict]
    plan: Callable[[VideoJob, int, PeakStore, str, bool], Plan]
    geometry: Callable[[VideoJob], tuple[int, int, int]]
    """``(frames, height, width)`` of one batch item's output."""
    run: Callable[[VideoJob, Plan, torch.Tensor, Any, DecodeEnv, dict], None]
    """The executor into the output view ``(B, C, frames, H, W)`` (``bar``: the progress bar, ``stats`` filled)."""
    over_text: str
    """Why a plan is over the budget (the predicted row)."""
    time_text: Callable[[dict], str]
    shape_text: Callable[[dict], str]
    """The summary's shape of an executor run."""
    oom_text: Callable[[int], str]
    notes: Callable[[VideoJob], list[tuple[str, str]]] = lambda job: []


def decode_own(job: VideoJob, env: DecodeEnv, ex: OwnExecutor, *, budget_mb: float = 0, unload_others: bool = True,
               t_start: float | None = None) -> Any:
    """``decode_video`` for a VAE with its own executor ``ex``. Returns a :class:`.video_out.VideoDecodeResult`."""
    vae, z = job.vae, job.z
    b, _, t, _, _ = (int(v) for v in z.shape)
    t0 = time.perf_counter() if t_start is None else t_start
    first = FirstUse(env.phase)
    key = observed_key(ex.path, job.family, job.dtype, job.device)
    env.at("prepare")
    frames, oh, ow = ex.geometry(job)
    prep = prepare(vae, env, lambda: first.sized(lambda: ex.plan(job, 1 << 62, env.peaks, "", True), *CLIP_SIZING)
                   .planned or None, budget_mb,
                   unload_others, (job.device, job.out_device, buffer_bytes(job, frames, oh, ow)))
    budget = prep.budget
    env.at("check")
    verdict = ex.check(job, env, lambda: load_weights(vae, env, 0), first)
    job = dataclasses.replace(job, verdict=verdict, host_room=prep.host_room)
    env.at("plan")
    r = max(1.0, env.observed.ratio(key))
    p = first.sized(lambda: ex.plan(job, int(budget.available / r), env.peaks, verdict.describe(), verdict.ok),
                    *CLIP_SIZING)
    p.ratio = r
    p.planned = int(p.planned * r)
    if not verdict.ok:  # not proven on this host: the host's own decode (exact by construction)
        p = host_plan(t, 0, f"the {ex.name}'s {verdict.describe()}")
    plan_seconds = time.perf_counter() - t0
    env.at("weights")
    load_weights(vae, env, p.planned)

    buf, view = output_buffer(job, frames, oh, ow)
    bar = env.progress_bar(max(1, p.units * b)) if env.progress_bar is not None else None
    stats: dict = {}
    t1 = time.perf_counter()
    env.at("run")
    with measured(env, job.device) as m:
        if p.path == "host":
            host_decode(job, view, bar, env, stats)
        else:
            ex.run(job, p, view, bar, env, stats)
        post_process(vae, view)
    seconds = time.perf_counter() - t1
    env.at("report")
    if p.planned and not stats.get("restarts"):
        env.observed.note(key, m.peak, int(p.planned / p.ratio), m.kind)
    report = _report(job, ex, p, budget, prep.offload, stats, seconds, plan_seconds, m.peak, m.method, first)
    return VideoDecodeResult(buf, report, p, budget, seconds, m.peak, m.method, stats, plan_seconds)


def _report(job: VideoJob, ex: OwnExecutor, plan: Plan, budget: Any, offload_text: str, stats: dict,
            seconds: float, plan_seconds: float, peak: int | None, method: str, first: FirstUse) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.path == "host":
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    else:
        r.add("path", ex.exact_text)
    r.add("check", f"{ex.name}: {job.verdict.describe()}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.description)
    for row, text in ex.notes(job):
        r.add(row, text)
    if plan.planned:
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        why = "the host's own decode" if plan.path == "host" else ex.over_text
        over = f" - OVER BUDGET ({why})" if plan.over_budget else ""
        sized = plan.stats.get("sized", "meta sizing")
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, {sized}){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload and self-check included)")
    else:
        r.add("predicted", "not predicted")
    r.add("measured", measured_text(peak, method))
    flag_measured_overrun(r, peak, method, int(budget.available), log)
    r.add("time", f"{fmt_seconds(seconds)} ({ex.time_text(stats)})")
    if first.done:
        r.add("first use", first.describe())
    restarts = int(stats.get("restarts") or 0)
    if restarts:
        r.add("oom", ex.oom_text(restarts))
    b = int(job.z.shape[0])
    shape = "host decode" if plan.path == "host" else ex.shape_text(stats)
    r.summary = summary_line(
        "exact",
        shape + (f" x {b} videos" if b > 1 and plan.path == "host" else ""),
        peak_verdict(peak, method, int(budget.available), plan.planned or None),
        "planned over budget" if plan.over_budget and not (peak or 0) > budget.available else "",
        fmt_seconds(seconds),
        f"{restarts} out-of-memory retr{'ies' if restarts != 1 else 'y'}" if restarts else "",
        first_use_tag(first),
    )
    return r
