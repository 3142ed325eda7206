"""Out-of-memory resume driver shared by the executors (tiled exact, tiled generic, image decode).

Every executor that survives an out-of-memory error has the same loop: run the work; if one of the
OOM exception types escapes, and the error did not come from the cancel check, and the executor can
still do something about it (a smaller tile, another plan), leave the ``except`` block first, so the
failed attempt's frames and the tensors they hold are released (ComfyUI's own ``VAE.decode`` does
the same), then release cached memory (``on_oom``, e.g. ``comfy.model_management.soft_empty_cache``),
let the executor shrink or re-plan, and run again; the executor keeps its finished work, so the new
attempt resumes rather than restarts.

:class:`OomResume` is that loop::

    driver = OomResume(oom_exceptions, should_stop=should_stop, on_oom=on_oom)
    # the executor calls driver.check_stop() (not should_stop) before every unit of work
    result = driver.run(attempt, can_recover=lambda e: tile > min_tile, recover=shrink)

* ``check_stop()`` wraps the caller's ``should_stop``: its exception propagates through :meth:`run`
  even when ``oom_exceptions`` contains ``Exception`` (ComfyUI's ``OOM_EXCEPTION`` where torch lacks
  ``OutOfMemoryError``). A driver's ``check_stop`` may itself be passed as another executor's
  ``should_stop``: a cancel then propagates through every level.
* ``can_recover(exc)`` runs inside the ``except`` block (it may look at the exception);
  ``recover(event)`` runs outside it and gets an :class:`OomEvent` (type name, message, count): the
  exception object itself is never kept, since its traceback would keep the failed frames alive.
* ``max_retries`` bounds the recoveries over the driver's lifetime (None: unbounded; the executors
  bound them by their minimum tile instead).

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

__all__ = ["OomEvent", "OomResume", "default_oom_exceptions", "oom_types"]

log = logging.getLogger("vramfit.memory.oom")

T = TypeVar("T")


def default_oom_exceptions() -> tuple[type[BaseException], ...]:
    """``torch.OutOfMemoryError`` (alias of ``torch.cuda.OutOfMemoryError``) where torch has it."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom,) if oom is not None else ()


def oom_types(given: Sequence[type[BaseException]] | None) -> tuple[type[BaseException], ...]:
    """The exception types every executor treats as out-of-memory: ``given`` without a bare
    ``Exception``/``BaseException`` (ComfyUI's ``OOM_EXCEPTION`` without CUDA; catching it would turn a bug
    or a cancel into re-plans), :func:`default_oom_exceptions` when ``given`` is None or held nothing else."""
    if given is None:
        return default_oom_exceptions()
    given = tuple(given)
    kept = tuple(t for t in given if t not in (Exception, BaseException))
    if len(kept) == len(given):
        return kept
    log.debug("ignoring Exception/BaseException as an out-of-memory type")
    return kept or default_oom_exceptions()


@dataclasses.dataclass(frozen=True)
class OomEvent:
    """What :meth:`OomResume.run` caught, without the exception (whose traceback holds the failed frames)."""

    type_name: str
    message: str
    retry: int
    """1 for the first recovery of this driver, 2 for the second, ..."""


class OomResume:
    """The attempt / catch / leave the ``except`` block / release / shrink / resume loop (module docstring)."""

    def __init__(
        self,
        oom_exceptions: tuple[type[BaseException], ...],
        *,
        should_stop: Callable[[], None] | None = None,
        on_oom: Callable[[], None] | None = None,
        max_retries: int | None = None,
    ) -> None:
        self.oom_exceptions = tuple(oom_exceptions)
        self.should_stop = should_stop
        self.on_oom = on_oom
        self.max_retries = max_retries
        self.retries = 0

    def check_stop(self) -> None:
        """Call the caller's ``should_stop``; an exception it raises is never treated as out of memory."""
        if self.should_stop is None:
            return
        try:
            self.should_stop()
        except BaseException as e:
            # The mark travels with this exception only: a check that raised (and was caught by the
            # caller) leaves no state behind that could turn a later, genuine OOM into a re-raise.
            e._vramfit_from_stop = True  # type: ignore[attr-defined]
            raise

    def run(
        self,
        attempt: Callable[[], T],
        *,
        can_recover: Callable[[BaseException], bool] = lambda e: True,
        recover: Callable[[OomEvent], None] | None = None,
    ) -> T:
        """``attempt()`` until it returns; after each recoverable OOM: ``on_oom()``, then ``recover(event)``."""
        while True:
            event: OomEvent | None = None
            try:
                return attempt()
            except self.oom_exceptions as e:
                if getattr(e, "_vramfit_from_stop", False) or (
                    self.max_retries is not None and self.retries >= self.max_retries
                ):
                    raise
                if not can_recover(e):
                    raise
                event = OomEvent(type(e).__name__, str(e), self.retries + 1)
            # Out of the except block: the failed attempt's frames and their tensors are gone now.
            self.retries = event.retry
            if self.on_oom is not None:
                self.on_oom()
            if recover is not None:
                recover(event)
