"""A video VAE served by an executor of its own, with the host's decode as the fallback (MiniMax H3's grid, SeedVR2's
walk), as a path of the video flow (:func:`own_path` for :func:`.video_flow.run_flow`): its plan (scaled by the
path's observed ratio, :func:`..plan.grid.scaled`), its executor's first-use self-check after the plan (failed: the host's own decode, exact by
construction), its executor into the output buffer, its report. Each family gives an :class:`OwnExecutor`: its
check, planner, geometry, run and report wording. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..plan.grid import scaled
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
from ..run_context import RunContext
from .env import DecodeEnv, load_weights
from .first_use import FirstUse, first_use_tag
from .self_check import Verdict
from .video_flow import Checking, VideoPath

log = logging.getLogger("vramfit.memory.decode.own_executor")

__all__ = ["OwnExecutor", "own_path"]


@dataclasses.dataclass(frozen=True)
class OwnExecutor:
    path: str
    """The plan's path (and its observed ratio's key)."""
    name: str
    """The executor in the report's ``check`` row and the fallback's reason (``grid executor``)."""
    exact_text: str
    """The report's ``path`` row when the executor runs."""
    check: Callable[[VideoJob, DecodeEnv, Callable[[], None], FirstUse], Verdict]
    plan: Callable[[VideoJob, int, PeakStore], Plan]
    """``(job, budget, peaks)``: the executor's plan, not exact until its check passed (or the host's own decode)."""
    geometry: Callable[[VideoJob], tuple[int, int, int]]
    """``(frames, height, width)`` of one batch item's output."""
    run: Callable[[VideoJob, Plan, torch.Tensor, DecodeEnv, RunContext], None]
    """The executor into the output view ``(B, C, frames, H, W)``."""
    over_text: str
    """Why a plan is over the budget (the predicted row)."""
    time_text: Callable[[dict], str]
    shape_text: Callable[[dict], str]
    """The summary's shape of an executor run."""
    oom_text: Callable[[int], str]
    notes: Callable[[VideoJob], list[tuple[str, str]]] = lambda job: []


def own_path(ex: OwnExecutor) -> VideoPath:
    """``ex`` as a path of the video flow."""

    def plan(job: VideoJob, available: int, env: DecodeEnv, out_bytes: int) -> tuple[Plan, bool]:
        r = env.observed.ratio(observed_key(ex.path, job.family, job.dtype, job.device))
        # its peak scaled by the path's observed ratio as every planner's
        return scaled(lambda budget: ex.plan(job, budget, env.peaks), available, r), False

    def verify(job: VideoJob, p: Plan, per_item: bool, ck: Checking) -> tuple[VideoJob, Plan, bool, str]:
        """The executor's self-check where the plan takes it (the host's own decode relies on nothing); failed:
        the host's own decode (exact by construction), the reason said."""
        if p.path == "host":
            return job, p, per_item, ""
        verdict = ex.check(job, ck.env, lambda: load_weights(job.vae, ck.env, 0), ck.first)
        job = dataclasses.replace(job, verdict=verdict)
        if verdict.ok:
            return job, dataclasses.replace(p, exact=True, reason=verdict.describe()), per_item, ""
        return job, host_plan(int(job.z.shape[2]), 0, f"the {ex.name}'s {verdict.describe()}"), per_item, ""

    return VideoPath(geometry=ex.geometry, plan=plan, verify=verify,
                     run=lambda job, p, per_item, view, env, ctx: ex.run(job, p, view, env, ctx),
                     report=functools.partial(_report, ex=ex), bar_total=lambda p, b: p.units * b,
                     ratio_path=lambda p: ex.path)  # its own host plans too: planned with this path's ratio


def _report(job: VideoJob, plan: Plan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, peak: int | None, method: str, first: FirstUse, *, ex: OwnExecutor) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.path == "host":
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    else:
        r.add("path", ex.exact_text)
    r.add("check", f"{ex.name}: {job.verdict.describe()}" if job.verdict is not None else f"{ex.name} not used")
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
