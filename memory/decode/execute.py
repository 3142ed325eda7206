"""The run step of an image decode or an encode (:mod:`.flow`): one progress bar over all its passes
(:class:`Progress`), the passes over the batch with the re-plans after an out-of-memory error outside a tile
(:func:`run_passes`, through :class:`..oom.OomResume`).

What a path plugs in: how far a pass of its plan goes, the pass itself (its executors), its next smaller plan and
the plan after which there is none. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..oom import OomEvent, OomResume, oom_types
from ..plan.types import Plan
from ..run_context import ProgressFn, RunContext
from .env import DecodeEnv

log = logging.getLogger("vramfit.memory.decode.execute")

__all__ = ["Progress", "pass_context", "pass_driver", "run_passes"]


class Progress:
    """One progress bar for the whole run: each pass's executor progress is offset by the units already done, and
    the total is what is done + the current pass's total + the passes still planned."""

    def __init__(self, bar: ProgressFn | None, total: int) -> None:
        self.done = 0
        self.total = max(1, int(total))
        self.bar = bar
        self._base = 0
        self._rest = 0

    def start_pass(self, rest: int) -> ProgressFn:
        """Callback for the next pass; ``rest``: units planned after it."""
        self._base, self._rest = self.done, int(rest)

        def cb(done: int, total: int) -> None:
            self.total = max(1, self._base + int(total) + self._rest)
            self.done = self._base + int(done)
            if self.bar is not None:
                self.bar(self.done, self.total)

        return cb


def pass_driver(env: DecodeEnv, max_retries: int) -> OomResume:
    """The passes' re-plan driver: what counts as out of memory on every level (a bare ``Exception``, ComfyUI's
    ``OOM_EXCEPTION`` without CUDA, is dropped: a bug propagates at once), Cancel, at most ``max_retries``
    re-plans; its ``check_stop`` is the executors' ``should_stop`` (:func:`pass_context`)."""
    return OomResume(oom_types(env.oom_exceptions), should_stop=env.should_stop, on_oom=env.on_oom,
                     max_retries=max_retries)


def pass_context(env: DecodeEnv, driver: OomResume, events: list[str], work: str) -> RunContext:
    """What every pass's executor takes (its progress: the pass's, :meth:`..run_context.RunContext.with_progress`):
    Cancel through the re-plan ``driver`` (a cancel propagates through every level), what it counts as out of
    memory, the tests' fault hook called as ``("tile", k)``; after an out-of-memory error inside a tile (the
    executor halves the tile and resumes) the event among ``events`` (``work``: "decode", "encode") and
    ``env.on_oom``."""
    hook = env.fault_hook

    def tile_oom() -> None:
        events.append(f"out of memory inside a tile: tile halved, {work} resumed")
        if env.on_oom is not None:
            env.on_oom()

    return RunContext(None, driver.check_stop, None if hook is None else lambda k: hook("tile", k),
                      driver.oom_exceptions, tile_oom)


def run_passes(
    items: int,
    plan: Plan,
    driver: OomResume,
    progress: Progress,
    extent: Callable[[Plan, int], tuple[int, int]],
    one_pass: Callable[[Plan, int, int, ProgressFn], None],
    smaller: Callable[[Plan], Plan],
    final: Callable[[Plan, BaseException], BaseException | None],
    events: list[str],
    node: str,
) -> Plan:
    """Items ``0 .. items - 1`` in passes of ``plan``:
    ``extent(p, start)`` gives a pass's ``(stop, units planned after it)``, ``one_pass(p, start, stop, progress)``
    runs it. Out of memory outside a tile: ``smaller(p)`` (the next smaller plan, as it may run) and the unfinished
    items again, outside the ``except`` block (the failed pass's frames and tensors are released first; finished
    items are kept); none after a plan ``p`` for which ``final(p, oom)`` is an error, raised instead (``oom`` itself:
    re-raised as it came). Each re-plan is one of ``events``, logged under ``node``. Returns the plan that finished."""
    state = {"plan": plan, "start": 0, "stop": 0}

    def attempt() -> None:
        p, start = state["plan"], state["start"]
        stop, rest = extent(p, start)
        state["stop"] = stop
        one_pass(p, start, stop, progress.start_pass(rest))

    def recover(event: OomEvent) -> None:
        old: Plan = state["plan"]
        what = f"{event.type_name} in the {old.path} pass of item(s) {state['start']}..{state['stop'] - 1}"
        state["plan"] = smaller(old)
        events.append(f"{what}: re-planned ({old.description} -> {state['plan'].description}); retrying")
        log.warning("%s: %s", node, events[-1])

    while state["start"] < items:
        try:
            driver.run(attempt, recover=recover, can_recover=lambda e: final(state["plan"], e) is None)
        except driver.oom_exceptions as e:
            error = final(state["plan"], e)
            if error is not None and error is not e:
                raise error from e
            raise
        state["start"] = state["stop"]
    return state["plan"]
