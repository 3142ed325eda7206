"""What an executor's run takes from the decode around it, named once: the progress callback, Cancel, the tests'
fault hook, what counts as out of memory and what to do after one, the stats it fills (:class:`RunContext`; the
decode builds it from its environment, ``decode/env.DecodeEnv.run_context``). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FaultHook", "NormParamsFn", "ProgressFn", "RunContext", "StopFn"]

ProgressFn = Callable[[int, int], None]
"""``progress(done, total)``: the node's progress bar."""
StopFn = Callable[[], Any]
"""Raises when the user pressed Cancel (ComfyUI's ``throw_exception_if_processing_interrupted``)."""
FaultHook = Callable[[int], None]
"""Tests: called at every step of an executor (raise an out-of-memory error there to exercise the recovery)."""
NormParamsFn = Callable[[Any, torch.Tensor], "tuple[torch.Tensor | None, torch.Tensor | None]"]
"""``norm_params(norm, x)``: a GroupNorm's affine weight and bias cast as the host casts them (ComfyUI's weight
casting), for the executors that run GroupNorm themselves (``decode/env.DecodeEnv.norm_params``)."""


@dataclasses.dataclass(frozen=True)
class RunContext:
    """The keyword arguments every chunked or tiled executor takes besides its data (:meth:`kwargs`)."""

    progress: ProgressFn | None = None
    should_stop: StopFn | None = None
    fault_hook: FaultHook | None = None
    oom_exceptions: tuple[type[BaseException], ...] = ()
    on_oom: Callable[[], None] | None = None
    stats: dict = dataclasses.field(default_factory=dict)
    """Filled by the executor (chunks, tiles, restarts, shrinks): the report reads it."""

    def kwargs(self, fault: bool = True, stats: bool = True) -> dict[str, Any]:
        """The executor's keyword arguments (``fault``: it takes a ``fault_hook``; ``stats``: a ``stats`` dict)."""
        kw: dict[str, Any] = dict(progress=self.progress, should_stop=self.should_stop,
                                  oom_exceptions=self.oom_exceptions, on_oom=self.on_oom)
        if fault:
            kw["fault_hook"] = self.fault_hook
        if stats:
            kw["stats"] = self.stats
        return kw

    def with_progress(self, progress: ProgressFn | None) -> RunContext:
        """The same context reporting to ``progress`` (a pass's share of one bar)."""
        return dataclasses.replace(self, progress=progress)
