"""Once-per-VAE work inside a decode (the exactness self-check, cost-model calibration): shown while it runs
(``show``: the node's progress text) and reported after, so a slow first decode says why."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..report import fmt_seconds

log = logging.getLogger("vramfit.memory.decode.first_use")

__all__ = ["FirstUse", "first_use_tag"]

T = TypeVar("T")


class FirstUse:
    """Runs and times the once-per-VAE phases of one decode."""

    def __init__(self, show: Callable[[str], None] | None = None, work: str = "decode") -> None:
        self.show = show
        self.work = work
        """What later runs are (``"decode"``, ``"encode"``): they skip this work."""
        self.done: list[tuple[str, float]] = []

    def run(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, announced as ``what`` ("checking exactness", "calibrating ...") and timed."""
        text = f"first use of this VAE: {what} (once per VAE structure on this host)"
        log.info("%s", text)
        if self.show is not None:
            self.show(text)
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.done.append((what, time.perf_counter() - t0))

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.done)

    def describe(self) -> str:
        """``""`` when nothing ran, else each phase and its time, e.g. for the report."""
        if not self.done:
            return ""
        parts = ", ".join(f"{what} {fmt_seconds(s)}" for what, s in self.done)
        once = f"once per VAE structure on this host, later {self.work}s skip it"
        return f"{fmt_seconds(self.seconds)}: {parts}; {once}"


def first_use_tag(first: FirstUse | None) -> str:
    """The verdict line's part for once-per-VAE work: ``first use +14.8 s`` ("" when none ran)."""
    return f"first use +{fmt_seconds(first.seconds)}" if first is not None and first.done else ""
