"""One report format for every VRAM Fit node (decode plans, offload, the VRAM monitor).

A report is a title line, a one-line verdict (:attr:`Report.summary`, unindented) and aligned
``key : value`` rows, easy to read in ComfyUI's text preview, in ``/history`` for API runs and in logs;
:meth:`Report.to_dict` gives the same content as data.

    VRAM Fit | Tiled VAE Decode | cpu
    exact · 2x3 tiles · RSS peak 5.02 GiB of 6.61 GiB tensor budget · 12.30 s
      budget    : cpu: free 7,440 MiB - VAE weights to load 160 MiB - reserve 512 MiB = 6,768 MiB available
                  for decoding
      plan      : 2x3 tiles of 64x96 latent px, 1 image/pass, exact
      predicted : peak 2,500.0 MiB tensor-level (compare with measured); planned as 5,100.0 MiB with the overhead
                  measured beyond it on this device (scratch, allocator caches): 75% of budget
      measured  : peak 5.02 GiB (process RSS high-water mark; ...)

The budget bounds the decode's tensor-level working memory (allocator bytes); the verdict names the
figure measured (:func:`measure_tag`). The ``budget`` row names the budget once, as the plan was made with
it; the ``predicted`` row gives the plan's own prediction and its share of that budget (:func:`predicted_text`).
A decode report whose measured peak exceeds the budget says ``OVER BUDGET`` in its verdict and gets an
``over budget`` row and a logged warning (:func:`flag_measured_overrun`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

TITLE_PREFIX = "VRAM Fit"
OVER_BUDGET_ROW = "over budget"
OVER_BUDGET = "OVER BUDGET"
"""In a verdict whose measured peak exceeds the budget."""
SEP = " · "
"""Between the parts of a verdict."""
BUDGET_BOUNDS = "the budget bounds the decode's tensor-level working memory (allocator bytes)"
log = logging.getLogger("vramfit.memory.report")


_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))
_UNIT_SIZE = dict(_UNITS)


def byte_unit(n: float) -> tuple[str, int]:
    """The binary unit :func:`fmt_bytes` picks for ``n`` bytes and its size, e.g. ``("MiB", 2**20)``."""
    a = abs(float(n))
    return next(((u, s) for u, s in _UNITS[:-1] if a < 1024 * s), _UNITS[-1])


def fmt_bytes(
    n: float | None,
    unit: str | None = None,
    digits: int = 1,
    *,
    sign: bool = False,
    small: str | None = None,
    suffix: bool = True,
) -> str:
    """Human-readable bytes in binary units, ``-`` for unknown.

    By default the unit follows the size (:func:`byte_unit`): whole ``B``, ``KiB``/``MiB`` with one
    decimal, ``GiB`` with two. ``unit`` (``"KiB"``, ``"MiB"``, ``"GiB"``) fixes it instead: ``digits``
    decimals, thousands separators, a ``+`` on gains with ``sign``; ``small``: the unit (with one more
    decimal) for sizes under one ``unit``; ``suffix=False`` leaves the unit name off (for ``a -> b MiB``).
    """
    if n is None:
        return "-"
    if unit is None:
        name, size = byte_unit(n)
        neg = "-" if n < 0 else ""
        a = abs(float(n))
        text = f"{neg}{int(a)}" if name == "B" else f"{neg}{a / size:.{2 if name == 'GiB' else 1}f}"
    else:
        name = unit
        if small is not None and abs(n) < _UNIT_SIZE[unit]:
            name, digits = small, digits + 1
        text = format(n / _UNIT_SIZE[name], f"{'+' if sign else ''},.{digits}f")
    return f"{text} {name}" if suffix else text


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def measure_tag(method: str) -> str:
    """A peak measure's short name for a verdict: ``RSS`` (process RSS high-water mark), ``tensor`` (live
    tensor bytes), ``allocated`` (``max_memory_allocated``); empty when nothing was measured."""
    m = method.lower()
    if "rss" in m:
        return "RSS"
    if "max_memory_allocated" in m:
        return "allocated"
    return "tensor" if "tensor" in m else ""


def measure_note(method: str) -> str:
    """What a measured peak is, next to what the budget bounds (a decode report's ``measured`` row)."""
    tag = measure_tag(method)
    if tag == "RSS":
        return ("the whole process above the decode's start, allocator caches and libraries included, often "
                f"2-4x the tensor-level peak; {BUDGET_BOUNDS}: compare it with the predicted peak")
    if tag:
        return ("allocator bytes, " if tag == "allocated" else "") + "the figure the budget bounds"
    return f"not measured; {BUDGET_BOUNDS}"


def measured_text(measured: int | None, method: str) -> str:
    """A decode report's ``measured`` row: the peak, its measure and what that is next to the budget."""
    if measured is None:
        return f"{method} ({measure_note(method)})"
    return f"peak {fmt_bytes(measured)} ({method}: {measure_note(method)})"


def peak_verdict(measured: int | None, method: str, budget: int, predicted: int | None = None) -> str:
    """The peak part of a decode's verdict: ``RSS peak 310.0 MiB of 512.0 MiB tensor budget``; a measured
    peak over the budget: ``... > 512.0 MiB tensor budget: OVER BUDGET``; unmeasured: the prediction."""
    limit = f"{fmt_bytes(budget)} tensor budget"
    if measured is None:
        return f"predicted {fmt_bytes(predicted)} of {limit}" if predicted else f"peak not measured, {limit}"
    tag = measure_tag(method)
    head = f"{tag + ' ' if tag else ''}peak {fmt_bytes(measured)}"
    return f"{head} > {limit}: {OVER_BUDGET}" if measured > budget else f"{head} of {limit}"


def predicted_text(planned: int, budget: int, tracked: int = 0, *, where: str = "", how: str = "",
                   over: str = "", note: str = "") -> str:
    """A decode or encode report's ``predicted`` row: the plan's predicted peak and its share of the budget the
    plan was made with (the ``budget`` row names that figure; it is not repeated here).

    ``tracked``: the tensor-level prediction (the figure a tensor-level measure compares with) when it differs
    from ``planned``, the planning figure compared with the budget (it adds the untracked overhead measured on
    the device: on CPU oneDNN scratch and allocator caches, ``CostModel.overhead``, and a learned ratio); 0:
    ``planned`` alone. ``where``: where the peak falls (``", at up.0.block.0.conv1"``); ``how``:
    how it was sized (``"meta sizing"``); ``over``: an over-budget flag; ``note``: appended (a ratio's note).
    """
    mib = lambda n: fmt_bytes(n, "MiB", 1, small="KiB")  # noqa: E731
    share = f"{planned / budget:.0%} of budget" if budget > 0 else "no budget"
    share += f", {how}" if how else ""
    if tracked and tracked != planned:
        return (f"peak {mib(tracked)} tensor-level{where} (compare with measured); planned as {mib(planned)} with "
                f"the overhead measured beyond it on this device (scratch, allocator caches): {share}{over}{note}")
    return f"peak {mib(planned)}{where} ({share}){over}{note}"


def summary_line(*parts: str) -> str:
    """A verdict line from its parts (empty ones left out), joined by :data:`SEP`."""
    return SEP.join(p for p in parts if p)


@dataclasses.dataclass
class Report:
    """A titled list of ``(key, value)`` rows under a one-line verdict; values may span several lines."""

    node: str
    device: str = ""
    rows: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    summary: str = ""
    """The verdict: one line under the title (what the node did, at a glance); empty: none."""

    def add(self, key: str, value: Any) -> Report:
        self.rows.append((str(key), str(value)))
        return self

    def insert_after(self, after: str, key: str, value: Any) -> Report:
        """Add a row right after the first row named ``after`` (at the end when there is none)."""
        at = next((i + 1 for i, (k, _) in enumerate(self.rows) if k == after), len(self.rows))
        self.rows.insert(at, (str(key), str(value)))
        return self

    def extend(self, rows: list[tuple[str, Any]]) -> Report:
        for key, value in rows:
            self.add(key, value)
        return self

    @property
    def title(self) -> str:
        parts = [TITLE_PREFIX, self.node] + ([self.device] if self.device else [])
        return " | ".join(parts)

    def text(self) -> str:
        width = max((len(k) for k, _ in self.rows), default=0)
        lines = [self.title] + ([" ".join(self.summary.split())] if self.summary.strip() else [])
        for key, value in self.rows:
            first, *rest = value.splitlines() or [""]
            lines.append(f"  {key.ljust(width)} : {first}")
            lines.extend(f"  {' ' * width}   {line}" for line in rest)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "device": self.device, "summary": self.summary,
                "rows": [list(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        return cls(node=data["node"], device=data.get("device", ""), rows=[tuple(r) for r in data["rows"]],
                   summary=data.get("summary", ""))

    @classmethod
    def parse(cls, text: str) -> Report:
        """Inverse of :meth:`text` (used by tests and the headless runner to read reports back)."""
        lines = text.splitlines()
        if not lines or not lines[0].startswith(TITLE_PREFIX + " | "):
            raise ValueError(f"not a VRAM Fit report: {lines[:1]}")
        head = lines[0].split(" | ")
        report = cls(node=head[1], device=head[2] if len(head) > 2 else "")
        rest = lines[1:]
        if rest and rest[0].strip() and not rest[0].startswith(" "):  # the verdict (older reports: none)
            report.summary, rest = rest[0], rest[1:]
        for line in rest:
            key, sep, value = line[2:].partition(" : ")
            if sep and key.strip():
                report.rows.append((key.strip(), value))
            elif report.rows:  # continuation line of a multi-line value
                k, v = report.rows[-1]
                report.rows[-1] = (k, v + "\n" + line.strip())
        return report


def flag_measured_overrun(report: Report, measured: int | None, method: str, budget: int,
                          logger: logging.Logger | None = None) -> bool:
    """When the measured peak (bytes above the decode's start, measured by ``method``: live tensors,
    process RSS or ``max_memory_allocated``) exceeds ``budget`` bytes, add an ``over budget`` row after
    ``measured`` and log a warning; returns whether it did."""
    if measured is None or measured <= budget:
        return False
    over = measured - budget
    pct = f" (+{over / budget:.0%})" if budget > 0 else ""
    text = f"measured peak {fmt_bytes(measured)} ({method}) > budget {fmt_bytes(budget)}, by {fmt_bytes(over)}{pct}"
    if measure_tag(method) == "RSS":
        text += f"; RSS counts the whole process, {BUDGET_BOUNDS}"
    report.insert_after("measured", OVER_BUDGET_ROW, text)
    (logger or log).warning("VRAM Fit · %s: over budget: %s", report.node, text)
    return True
