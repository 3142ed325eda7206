"""Never worse than core's node: the pack's own path, and the host's own decode (or encode) when the pack's
machinery fails.

A node runs its whole job (identification, self-checks, cost models, planning, execution, report) through
:func:`never_worse`. An exception from that machinery (anything but the user's bad input, a cancel, or an
out-of-memory error, which keeps its own re-plans) is logged once with its traceback, and the host's own node
(``VAEDecode`` / ``VAEEncode`` / ``VAEEncodeForInpaint``, passed in as ``host``) runs on the whole input
instead: its output is core's, bit for bit. The report's verdict says so and why, names the stage that failed
(:data:`STAGES`, set by :meth:`..env.DecodeEnv.at` as the flow moves on) and flags a measured peak over the
budget. ``VRAMFIT_STRICT=1`` re-raises instead (the pack's own tests: a bug must fail them, not hide behind
the host's result).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..plan.grid import ImpossibleBudgetError
from ..report import Report, flag_measured_overrun, fmt_seconds, measured_text, peak_verdict, summary_line
from .env import measured
from .floor import HostOomError

log = logging.getLogger("vramfit.memory.decode.guard")

__all__ = ["STAGES", "STRICT_ENV", "HostResult", "NotDescribed", "failure_text", "never_worse"]

STRICT_ENV = "VRAMFIT_STRICT"
"""``VRAMFIT_STRICT=1``: a failure of the pack's own path is raised, not replaced by the host's result."""

STAGES: dict[str, str] = {
    "identify": "identification (family, layout, job)",
    "check": "self-check",
    "cost": "cost model",
    "prepare": "offload and budget",
    "plan": "planner",
    "weights": "weight loading",
    "run": "executor",
    "report": "report",
}
"""The steps of every decode and encode, in order; :meth:`..env.DecodeEnv.at` names the current one."""

R = TypeVar("R")
MESSAGE_CHARS = 240
"""At most this much of an exception's message in the report (the log has all of it)."""


class NotDescribed(Exception):  # noqa: N818 - a verdict, not an error
    """The pack has no description of this VAE for this node: the host's own decode (or encode) runs, said in the
    report; not a failure (no traceback logged)."""


@dataclasses.dataclass
class HostResult:
    """The host's own result and the report saying why it was taken. ``images`` is what the host's node
    returned as its first output (an IMAGE tensor, or a LATENT dict for an encode)."""

    images: Any
    report: Report
    failure: BaseException

    @property
    def latent(self) -> Any:
        return self.images


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


def _where(exc: BaseException) -> str:
    """``memory/plan/image.py:93 make_job``: the innermost frame of the pack's own code (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    pack = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    own = [f for f in frames if os.path.abspath(f.filename).startswith(pack + os.sep)]
    f = (own or frames or [None])[-1]
    if f is None:
        return ""
    name = os.path.relpath(os.path.abspath(f.filename), pack) if own else os.path.basename(f.filename)
    return f"{name}:{f.lineno} {f.name}"


def failure_text(exc: BaseException) -> str:
    """``RuntimeError: message`` (the message shortened to :data:`MESSAGE_CHARS`)."""
    msg = " ".join(str(exc).split())
    if len(msg) > MESSAGE_CHARS:
        msg = msg[: MESSAGE_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def never_worse(
    node: str,
    env: Any,
    own: Callable[[], R],
    host: Callable[[], Any],
    *,
    vae: Any,
    budget_mb: float = 0,
    passthrough: tuple[type[BaseException], ...] = (),
    work: str = "decode",
) -> R | HostResult:
    """``own()``; when it raises anything but ``passthrough`` (the user's bad input, cancel, out of memory), an
    impossible budget or the host's own decode out of memory, the host's ``host()`` instead, measured, with a
    report naming the stage ``env.stage`` the failure came from."""
    try:
        return own()
    except (*passthrough, ImpossibleBudgetError, HostOomError):
        raise
    except NotDescribed as exc:
        log.info("VRAM Fit · %s: %s; the host's own %s runs", node, exc, work)
        return _host(node, env, host, vae, budget_mb, exc, "", "", work)
    except Exception as exc:  # noqa: BLE001 - the point: any failure of the pack's machinery
        if strict():
            raise
        stage = getattr(env, "stage", "") or "identify"
        where = _where(exc)
        log.warning("VRAM Fit · %s: the pack's own %s failed in its %s (%s); running the host's own %s instead",
                    node, work, STAGES.get(stage, stage), where, work, exc_info=exc)
        return _host(node, env, host, vae, budget_mb, exc, stage, where, work)


def _host(node: str, env: Any, host: Callable[[], Any], vae: Any, budget_mb: float, exc: BaseException,
          stage: str, where: str, work: str) -> HostResult:
    device = torch.device(getattr(vae, "device", "cpu") or "cpu")
    try:
        budget = env.budget(vae, budget_mb)
    except Exception as e:  # noqa: BLE001 - the budget is information here, never a reason to fail
        log.debug("no budget for the host's %s report: %s", work, e)
        budget = None
    t0 = time.perf_counter()
    with measured(env, device) as m:
        out = host()
    seconds = time.perf_counter() - t0
    as_core = f"the host's own {work} (as VAE {work.capitalize()})"
    r = Report(node, str(device))
    if isinstance(exc, NotDescribed):
        why = f"not described: {exc}"
        r.add("path", f"exact: {as_core}; this VAE is {why}")
    else:
        why = f"the pack's own path failed: {failure_text(exc)}"
        r.add("path", f"exact: {as_core}, because the pack's own path failed in its {STAGES.get(stage, stage)}: "
                      f"{failure_text(exc)}")
        r.add("failed at", f"{where} (the traceback is in ComfyUI's log)" if where else "see ComfyUI's log")
    avail = int(budget.available) if budget is not None else 0
    if budget is not None:
        r.add("budget", budget.describe())
    r.add("measured", measured_text(m.peak, m.method))
    if budget is not None:
        flag_measured_overrun(r, m.peak, m.method, avail, log)
    r.add("time", f"{fmt_seconds(seconds)} ({work}, the host's own)")
    r.summary = summary_line(
        f"host {work}: {why}",
        peak_verdict(m.peak, m.method, avail) if budget is not None else "",
        fmt_seconds(seconds),
    )
    return HostResult(out, r, exc)
