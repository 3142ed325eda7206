"""Measured over predicted peak, per decode path, learned from the decodes this machine ran.

The cost models count tensors (meta sizing, or CPU measurements shipped with the pack). On a GPU the allocator
also holds what kernels ask for (cuDNN workspaces, layout copies), which no tensor count sees. The first GPU
suite (H200, 2026-11-26, docs/BENCHMARKS.md) measured:

* KL untiled decode: 1.70x its prediction (2048^2 and 4096^2, bfloat16);
* Wan chunked decode: 1.1x to 1.35x;
* the KL walker's tiles: 0.99x.

So after a decode whose measured peak is a tensor or allocator count (not the process RSS), the ratio is kept,
per path, family key, dtype and device type, as the largest seen (at most :data:`MAX_RATIO`). Later plans of
that key plan against ``budget / ratio`` and report ``planned * ratio`` (:func:`..plan.grid.scaled`). A
ratio only grows: one decode over its prediction is flagged in its report; the next ones plan for it. The
nodes keep the ratios in ``<ComfyUI user folder>/vramfit/observed_peaks.json``: deleting it forgets them (a
peak inflated by other work in the process, or by the host's own hidden fallbacks, stays until then).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..store import Store

__all__ = ["LEARNS_FROM", "MAX_RATIO", "ObservedStore", "observed_key", "ratio_text"]

MAX_RATIO = 4.0
"""Largest ratio kept (a measurement disturbed by other work in the process cannot shrink plans further)."""
MIN_PREDICTED = 16 << 20
"""Predictions below 16 MiB teach nothing (the allocator's rounding and fixed costs dominate them)."""
LEARNS_FROM = ("cuda", "dispatch")
"""Tracker methods whose peak is comparable with a prediction (allocator / live tensor counts; not RSS)."""
SLACK = 1.02
"""A ratio within 2 % of 1 is noise, not kept."""
CUDA_PRIORS = {"untiled": 1.70, "wan": 1.35}
"""The ratio a CUDA path plans with before this machine measured its own: the largest the GPU suites measured
(KL untiled decode 1.70x on an H200, 2026-11-26; Wan chunks 1.1-1.35x there and 1.19-1.27x on an H100, 2026-11-27,
where a first tiled plan that had learned only whole frames' 1.19 ran 0.4 MiB over its budget). A measured ratio
above the prior replaces it; one below is not kept (the prior stays: plans a little under the budget rather than
a first decode over it)."""


def observed_key(path: str, family: str, dtype: torch.dtype | str, device: torch.device | str) -> str:
    """``path/family/dtype/device type``: what one ratio holds for."""
    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    name = str(dtype).removeprefix("torch.")
    return f"{path}/{family}/{name}/{dev}"


class ObservedStore(Store[float]):
    """Ratios by :func:`observed_key` (the nodes persist theirs under ComfyUI's user folder)."""

    section = "observed"
    what = "observed peak ratio"

    def decode(self, value: Any) -> float:
        return min(MAX_RATIO, max(1.0, float(value)))

    def ratio(self, key: str) -> float:
        """The ratio to plan ``key`` with: the learned one, else on CUDA the path's :data:`CUDA_PRIORS`, else 1.0."""
        found = self.get(key)
        if found is not None:
            return found
        path, *_, device = key.split("/")
        return CUDA_PRIORS.get(path, 1.0) if device == "cuda" else 1.0

    def ratios(self, family: str, dtype: torch.dtype | str, device: torch.device | str) -> Callable[[str], float]:
        """``ratio(path)`` for one decode's family, dtype and device (what the planners take)."""
        return lambda path: self.ratio(observed_key(path, family, dtype, device))

    def note(self, key: str, measured: int | None, predicted: int, method: str) -> float | None:
        """Keep ``measured / predicted`` when it is larger than the ratio held (and than :data:`SLACK`), for a
        peak measured as :data:`LEARNS_FROM` says; returns the ratio kept, else None."""
        if measured is None or method not in LEARNS_FROM or predicted < MIN_PREDICTED:
            return None
        r = min(MAX_RATIO, measured / predicted)
        if r <= SLACK or r <= self.ratio(key) * SLACK:
            return None
        self.put(key, r)
        return r


def ratio_text(ratio: float) -> str:
    """The report's note of a ratio the plan was scaled by ("" for 1)."""
    if ratio <= 1.0:
        return ""
    return (f"; x{ratio:.2f}: this path's measured peaks on this device (before its first decode: on the GPUs "
            "measured so far) ran over its predictions by that much")
