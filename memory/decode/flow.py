"""The flow of every decode and encode, written once: **cost** (the path's cost models, where it has any),
**prepare** (offload for the fastest plan, budget, host room), **plan**, **check** (what the plan relies on, proven on
this host; a failed check re-plans without it), **weights**, **run** (one progress bar, inside the measured window),
the observed ratio of a run that finished as planned, **report**. Each step is a stage of the never-worse guard
(``DecodeEnv.at``: a failure anywhere gives the host's own decode, ``decode/guard``).

What differs plugs in as a :class:`Work`, made per call by its entry: the image decode's (``decode/image``), the
encode's (``decode/encode``), the video paths' (``decode/video_flow``). Design: docs/ARCHITECTURE.md ("Reading one
decode"). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..plan.grid import ImpossibleBudgetError
from ..plan.types import Plan
from ..run_context import ProgressFn
from .env import DecodeEnv, Measured, load_weights, measured, prepare
from .first_use import FirstUse

__all__ = ["Flow", "Ran", "Work", "run"]


@dataclasses.dataclass
class Flow:
    """What the flow gives a work's steps: the environment, the first-use record, the user's setting, and the
    budget and offload once prepared."""

    env: DecodeEnv
    first: FirstUse
    allow_approximate: bool = False
    """The user allows an approximate plan under the fidelity floor."""
    budget: Any = None
    offload: str = ""
    """The report's offload row."""

    @property
    def available(self) -> int:
        """The budget's bytes."""
        return int(self.budget.available)


@dataclasses.dataclass(frozen=True)
class Ran:
    """What the run step gives back."""

    plan: Plan
    """The plan that finished (after an out-of-memory re-plan: the smaller one)."""
    replanned: bool
    """An out-of-memory error re-planned, shrank or restarted it: its peak teaches no ratio."""


class Work:
    """What a path plugs into :func:`run`: one object per call, holding its job as the steps leave it."""

    job: Any
    """The job (``vae``, ``device``, ``out_device``, ``host_room``: the flow sets the room after the offload)."""
    words = "decode"
    """What :class:`.first_use.FirstUse` calls the work (``"decode"``, ``"encode"``)."""
    budget_words = "decoding"
    """What the budget's text says the bytes are for (:meth:`..budget.Budget.describe`)."""
    has_cost = False
    """The path has a cost step (:meth:`cost`) before the offload."""

    def cost(self, f: Flow) -> None:
        """The cost step: the path's cost models and observed ratios."""

    def need(self, f: Flow) -> int | None:
        """Bytes the fastest plan needs (the offload frees that much; None: unknown, free everything)."""
        raise NotImplementedError

    def out_bytes(self) -> int:
        """Bytes of the output on the output device (the host room leaves them free)."""
        return 0

    def plan(self, f: Flow) -> Plan:
        """The plan within ``f.available`` (may raise :class:`..plan.grid.ImpossibleBudgetError`)."""
        raise NotImplementedError

    def verify(self, p: Plan, f: Flow) -> Plan:
        """The check step: ``p`` as it may run once what it relies on is proven (a failed check re-plans)."""
        return p

    def bar_total(self, p: Plan) -> int:
        """The progress bar's total at the start (an executor may set its own once it knows)."""
        return 1

    def output(self, p: Plan, f: Flow) -> None:
        """Allocate the output the run writes (before the measured window, as the host's decode's own output)."""

    def run(self, p: Plan, bar: ProgressFn | None, f: Flow) -> Ran:
        """The run step, inside the measured window: the path's executor or the host's own decode."""
        raise NotImplementedError

    def observed_key(self, p: Plan) -> str | None:
        """The observed-ratio key the finished plan ``p`` learns under (:mod:`..cost.observed`; None: none)."""
        return None

    def finish(self, ran: Ran, f: Flow, seconds: float, plan_seconds: float, m: Measured) -> Any:
        """The report step: the path's report and result."""
        raise NotImplementedError


def run(work: Work, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
        t_start: float | None = None, allow_approximate: bool = False) -> Any:
    """``work`` through every step (module docstring). ``budget_mb``: 0 = free memory (``env.budget``);
    ``unload_others``: offload upstream models first (``env.offload``, VAEs with a patcher). ``t_start``:
    ``time.perf_counter()`` when planning started (validation included). Raises
    :class:`..plan.grid.ImpossibleBudgetError` (its message with the budget) when no plan fits. Returns
    ``work.finish``'s result."""
    t0 = time.perf_counter() if t_start is None else t_start  # planning time: offload, checks and weights included
    f = Flow(env, FirstUse(env.phase, work.words), allow_approximate)
    if work.has_cost:
        env.at("cost")
        work.cost(f)
    env.at("prepare")
    vae, device = work.job.vae, work.job.device  # what the checks leave as they are
    prep = prepare(vae, env, lambda: work.need(f), budget_mb, unload_others,
                   (device, work.job.out_device, work.out_bytes()))
    f.budget, f.offload = prep.budget, prep.offload
    work.job = dataclasses.replace(work.job, host_room=prep.host_room)
    try:
        env.at("plan")
        p = work.plan(f)
        env.at("check")
        p = work.verify(p, f)
    except ImpossibleBudgetError as e:
        raise ImpossibleBudgetError(f"{e} (budget: {f.budget.describe(work.budget_words)})", budget=e.budget,
                                    minimum=e.minimum, smallest=e.smallest) from e
    env.at("weights")
    load_weights(vae, env, p.planned)
    plan_seconds = time.perf_counter() - t0

    bar = env.progress_bar(max(1, work.bar_total(p))) if env.progress_bar is not None else None
    work.output(p, f)
    t1 = time.perf_counter()
    env.at("run")
    with measured(env, device) as m:
        ran = work.run(p, bar, f)
    seconds = time.perf_counter() - t1
    env.at("report")
    result = work.finish(ran, f, seconds, plan_seconds, m)
    key = work.observed_key(ran.plan)
    if key is not None and not ran.replanned:  # a plan that finished as planned: its measured over predicted peak
        env.observed.note(key, m.peak, int(ran.plan.planned / ran.plan.ratio), m.kind)
    return result
