"""Once-per-VAE work inside a decode or encode (the exactness self-check, cost-model calibration; the meta sizing of
a new image or clip shape's plans): shown while it runs (``show``: the node's progress text) and reported after, so a slow
first decode says why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..measure.sizing import MetaSizer
from ..report import fmt_seconds

log = logging.getLogger("vramfit.memory.decode.first_use")

__all__ = ["CLIP_SIZING", "FirstUse", "first_use_tag"]

T = TypeVar("T")

STRUCTURE = "VAE structure"
"""What a phase is done once for by default (``FirstUse.run``'s ``per``): the self-check and the calibrations (a
shape's meta sizing: once per image shape, :data:`..plan.encode.SIZING`)."""
CLIP_SIZING = ("sizing the plans of this clip shape", "clip shape")
"""The video decodes' first-use phase of a new clip shape's plans (:meth:`FirstUse.sized`)."""


class FirstUse:
    """Runs and times the once-per-VAE phases of one decode."""

    def __init__(self, show: Callable[[str], None] | None = None, work: str = "decode") -> None:
        self.show = show
        self.work = work
        """What later runs are (``"decode"``, ``"encode"``): they skip this work."""
        self.done: list[tuple[str, float]] = []
        self.per: list[str] = []
        """What the phases are done once for (:data:`STRUCTURE`, an image shape), in order, each once."""

    def run(self, what: str, fn: Callable[[], T], per: str = STRUCTURE) -> T:
        """``fn()``, announced as ``what`` ("checking exactness", "calibrating ...") and timed; a phase run again
        under the same ``what`` (the sizing of each candidate plan) adds its time to the first entry."""
        text = f"first use of this VAE: {what} (once per {per} on this host)"
        if all(w != what for w, _ in self.done):  # announced once
            log.info("%s", text)
            if self.show is not None:
                self.show(text)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self._add(what, time.perf_counter() - t0, per)

    def sized(self, fn: Callable[[], T], what: str, per: str) -> T:
        """``fn()``, a plan step; when it meta-sized anything (a new shape: :attr:`..measure.sizing.MetaSizer.entered`),
        its time is the phase ``what``, once per ``per``."""
        n, t0 = MetaSizer.entered, time.perf_counter()
        try:
            return fn()
        finally:
            if MetaSizer.entered != n:
                self._add(what, time.perf_counter() - t0, per)

    def _add(self, what: str, seconds: float, per: str) -> None:
        names = [w for w, _ in self.done]
        if what in names:
            i = names.index(what)
            self.done[i] = (what, self.done[i][1] + seconds)
        else:
            self.done.append((what, seconds))
        if per not in self.per:
            self.per.append(per)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.done)

    def describe(self) -> str:
        """``""`` when nothing ran, else each phase and its time, e.g. for the report."""
        if not self.done:
            return ""
        parts = ", ".join(f"{what} {fmt_seconds(s)}" for what, s in self.done)
        once = f"once per {' and per '.join(self.per)} on this host, later {self.work}s skip it"
        return f"{fmt_seconds(self.seconds)}: {parts}; {once}"


def first_use_tag(first: FirstUse | None) -> str:
    """The verdict line's part for once-per-VAE work: ``first use +14.8 s`` ("" when none ran)."""
    return f"first use +{fmt_seconds(first.seconds)}" if first is not None and first.done else ""
