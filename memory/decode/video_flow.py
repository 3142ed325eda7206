"""The video paths in the flow of every decode (:func:`.flow.run`): what every video path shares (its output
buffer, a new clip shape's sizing as first use, the host's own decode: every path's exact fallback), with what
differs plugged in by a :class:`VideoPath`: the chunked paths' (Wan's, carried, overlap-blended:
``decode/video.CHUNKED``) and the VAEs with executors of their own (SeedVR2's walk, MiniMax H3's grid:
:func:`.own_executor.own_path`). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..oom import oom_types
from ..plan.types import Plan
from ..plan.video import REPORT_NODE, VideoJob
from ..report import Report
from ..run_context import ProgressFn, RunContext
from . import flow
from .env import DecodeEnv, Measured
from .first_use import CLIP_SIZING, FirstUse
from .floor import host_oom_error
from .flow import Flow, Ran, Work
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


class _VideoWork(Work):
    """A video path as :func:`.flow.run` takes it: the output buffer of its geometry, a new clip shape's sizing
    tagged first use, the host's own decode (every path's exact fallback) written once for all of them."""

    def __init__(self, job: VideoJob, path: VideoPath) -> None:
        self.job, self.path = job, path
        self.per_item = False
        self.refused = ""
        self.stats: dict = {}
        self.buf = self.view = None

    @functools.cached_property
    def geometry(self) -> tuple[int, int, int]:
        """``(frames, height, width)`` of one batch item's output (first read in the prepare step)."""
        return self.path.geometry(self.job)

    def _plans(self, f: Flow, available: int) -> PlanFn:  # a new clip shape's sizing is first-use work
        out = self.out_bytes()
        return lambda j: f.first.sized(lambda: self.path.plan(j, available, f.env, out), *CLIP_SIZING)

    def need(self, f: Flow) -> int | None:
        return self._plans(f, 1 << 62)(self.job)[0].planned or None

    def out_bytes(self) -> int:
        return buffer_bytes(self.job, *self.geometry)

    def plan(self, f: Flow) -> Plan:
        p, self.per_item = self._plans(f, f.available)(self.job)
        return p

    def verify(self, p: Plan, f: Flow) -> Plan:
        check = Checking(f.env, f.first, self._plans(f, f.available), f.available, f.allow_approximate)
        self.job, p, self.per_item, self.refused = self.path.verify(self.job, p, self.per_item, check)
        return p

    def bar_total(self, p: Plan) -> int:
        return self.path.bar_total(p, int(self.job.z.shape[0]))

    def output(self, p: Plan, f: Flow) -> None:  # (B * T, H, W, C) and its (B, C, T, H, W) view
        self.buf, self.view = output_buffer(self.job, *self.geometry)

    def run(self, p: Plan, bar: ProgressFn | None, f: Flow) -> Ran:
        job, env, stats = self.job, f.env, self.stats
        if p.path == "host":
            try:
                host_decode(job, self.view, bar, env, stats)
            except oom_types(env.oom_exceptions) as e:
                if self.refused and p.over_budget:  # taken instead of the approximate plan: say how to allow that
                    raise host_oom_error(REPORT_NODE, e, self.refused) from e
                raise
        else:
            self.path.run(job, p, self.per_item, self.view, env, env.run_context(bar, stats))
        post_process(job.vae, self.view)
        return Ran(p, bool(stats.get("shrinks") or stats.get("restarts")))

    def observed_key(self, p: Plan) -> str:
        return observed_key(self.path.ratio_path(p), self.job.family, self.job.dtype, self.job.device)

    def finish(self, ran: Ran, f: Flow, seconds: float, plan_seconds: float, m: Measured) -> VideoDecodeResult:
        p = ran.plan
        report = self.path.report(self.job, p, f.budget, f.offload, self.stats, seconds, plan_seconds, m.peak,
                                  m.method, f.first)
        return VideoDecodeResult(self.buf, report, p, f.budget, seconds, m.peak, m.method, self.stats, plan_seconds)


def run_flow(job: VideoJob, env: DecodeEnv, path: VideoPath, *, budget_mb: float = 0, unload_others: bool = True,
             t_start: float | None = None, allow_approximate: bool = False) -> VideoDecodeResult:
    """Decode ``job`` by ``path`` through the flow of every decode (:func:`.flow.run`): offload and budget for the
    fastest plan's peak, the plan (a new clip shape's sizing tagged first use), the check of what it relies on (a
    failed one re-plans), the weights, the run into one output buffer (the host's own decode where the plan is the
    host's), the observed ratio learned from a plan that finished as planned, the report. Returns frames
    ``(B*T, H, W, C)`` on [0, 1] as VAEDecode, with the report (:class:`.video_out.VideoDecodeResult`)."""
    return flow.run(_VideoWork(job, path), env, budget_mb=budget_mb, unload_others=unload_others, t_start=t_start,
                    allow_approximate=allow_approximate)
