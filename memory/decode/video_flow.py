"""The video decode flow: the steps every video path takes, written once (prepare, plan, check, weights, run,
report), with what differs plugged in by a :class:`VideoPath`: the chunked paths' (Wan's, carried, overlap-blended:
``decode/video.CHUNKED``) and the VAEs with executors of their own (SeedVR2's walk, MiniMax H3's grid:
:func:`.own_executor.own_path`). The host's own decode, every path's exact fallback, runs here. Nothing here imports
ComfyUI."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..oom import oom_types
from ..plan.types import Plan
from ..plan.video import REPORT_NODE, VideoJob
from ..report import Report
from ..run_context import RunContext
from .env import DecodeEnv, load_weights, measured, prepare
from .first_use import CLIP_SIZING, FirstUse
from .floor import host_oom_error
from .video_out import VideoDecodeResult, buffer_bytes, host_decode, output_buffer, post_process

__all__ = ["Checking", "PlanFn", "VideoPath", "run_flow"]

PlanFn = Callable[[VideoJob], tuple[Plan, bool]]
"""The path's plan of a job within the flow's budget: ``(plan, per_item)`` (``per_item``: one batch item a pass)."""


@dataclasses.dataclass(frozen=True)
class Checking:
    """What the check step of :func:`run_flow` gives a path's ``verify``."""

    env: DecodeEnv
    first: FirstUse
    replan: PlanFn
    """The plan again (a failed check re-plans without what failed)."""
    available: int
    """The budget's bytes."""
    allow_approximate: bool
    """The user allows an approximate plan under the fidelity floor."""


@dataclasses.dataclass(frozen=True)
class VideoPath:
    """What a video decode path plugs into :func:`run_flow`."""

    geometry: Callable[[VideoJob], tuple[int, int, int]]
    """``(frames, height, width)`` of one batch item's output."""
    plan: Callable[[VideoJob, int, DecodeEnv, int], tuple[Plan, bool]]
    """``(job, available bytes, env, output buffer bytes) -> (plan, per_item)``; may raise
    :class:`..plan.grid.ImpossibleBudgetError`."""
    verify: Callable[[VideoJob, Plan, bool, Checking], tuple[VideoJob, Plan, bool, str]]
    """The check step: ``(job, plan, per_item, checking) -> (job, plan, per_item, refused)``: the plan as it may run
    once what it relies on is proven (``refused``: why an approximate plan was not taken, "" when none was)."""
    run: Callable[[VideoJob, Plan, bool, torch.Tensor, DecodeEnv, RunContext], None]
    """``(job, plan, per_item, view, env, run context)``: the path's executor into the output view
    ``(B, C, frames, H, W)`` (the host's own decode runs in the flow)."""
    report: Callable[[VideoJob, Plan, Any, str, dict, float, float, int | None, str, FirstUse], Report]
    """``(job, plan, budget, offload text, stats, seconds, plan seconds, measured peak, method, first) -> Report``."""
    bar_total: Callable[[Plan, int], int] = lambda p, b: 1
    """The progress bar's total at the start (an executor may set its own once it knows)."""
    ratio_path: Callable[[Plan], str] = lambda p: p.path
    """The path whose observed ratio planned ``p`` and learns from its run (:mod:`..cost.observed`)."""


def run_flow(job: VideoJob, env: DecodeEnv, path: VideoPath, *, budget_mb: float = 0, unload_others: bool = True,
             t_start: float | None = None, allow_approximate: bool = False) -> VideoDecodeResult:
    """Decode ``job`` by ``path`` within the budget: offload and budget for the fastest plan's peak (``prepare``),
    the plan (a new clip shape's sizing tagged first use), the check of what it relies on (a failed one re-plans),
    the weights, the run into one output buffer (the host's own decode where the plan is the host's), the observed
    ratio learned from a plan that finished as planned, the report. Returns frames ``(B*T, H, W, C)`` on [0, 1]
    as VAEDecode, with the report (:class:`.video_out.VideoDecodeResult`)."""
    vae = job.vae
    b = int(job.z.shape[0])
    t0 = time.perf_counter() if t_start is None else t_start  # planning time, offload included
    first = FirstUse(env.phase)
    env.at("prepare")
    frames, oh, ow = path.geometry(job)
    out_bytes = buffer_bytes(job, frames, oh, ow)

    def plan_at(available: int) -> PlanFn:  # a new clip shape's sizing is first-use work
        return lambda j: first.sized(lambda: path.plan(j, available, env, out_bytes), *CLIP_SIZING)

    prep = prepare(vae, env, lambda: plan_at(1 << 62)(job)[0].planned or None, budget_mb, unload_others,
                   (job.device, job.out_device, out_bytes))
    budget = prep.budget
    job = dataclasses.replace(job, host_room=prep.host_room)
    env.at("plan")
    plan_batch = plan_at(int(budget.available))
    p, per_item = plan_batch(job)
    env.at("check")
    check = Checking(env, first, plan_batch, int(budget.available), allow_approximate)
    job, p, per_item, refused = path.verify(job, p, per_item, check)
    plan_seconds = time.perf_counter() - t0
    env.at("weights")
    load_weights(vae, env, p.planned)

    buf, view = output_buffer(job, frames, oh, ow)  # (B * T, H, W, C) and its (B, C, T, H, W) view
    bar = env.progress_bar(max(1, path.bar_total(p, b))) if env.progress_bar is not None else None
    stats: dict = {}
    t1 = time.perf_counter()
    env.at("run")
    with measured(env, job.device) as m:
        if p.path == "host":
            try:
                host_decode(job, view, bar, env, stats)
            except oom_types(env.oom_exceptions) as e:
                if refused and p.over_budget:  # taken instead of the approximate plan: say how to allow that
                    raise host_oom_error(REPORT_NODE, e, refused) from e
                raise
        else:
            path.run(job, p, per_item, view, env, env.run_context(bar, stats))
        post_process(vae, view)
    seconds = time.perf_counter() - t1
    env.at("report")
    if not (stats.get("shrinks") or stats.get("restarts")):  # a finished plan, not re-planned smaller
        env.observed.note(observed_key(path.ratio_path(p), job.family, job.dtype, job.device), m.peak,
                          int(p.planned / p.ratio), m.kind)
    report = path.report(job, p, budget, prep.offload, stats, seconds, plan_seconds, m.peak, m.method, first)
    return VideoDecodeResult(buf, report, p, budget, seconds, m.peak, m.method, stats, plan_seconds)
