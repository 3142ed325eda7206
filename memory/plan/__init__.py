"""Planning: :func:`plan` (one entry for both decodes) returns a :class:`.types.Plan`. Image plans
(``image``) come from the untiled decode's cost model and the exact executor's (``exact``); tile grids from
``grid``; video plans (``video``) from peaks sized on fake tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .image import ImageJob
from .image import plan as plan_image
from .types import Plan
from .video import VideoJob
from .video import plan as plan_video

__all__ = ["Plan", "plan"]


def plan(job: ImageJob | VideoJob, budget: int, models: Any,
         ratio: Callable[[str], float] | None = None) -> Plan:
    """The fastest plan of ``job`` whose predicted peak fits ``budget`` bytes (the user's settings are the
    job's). ``models``: what the prediction comes from: an :class:`.image.ImageModels` for an image job, the
    :class:`.video.PeakStore` of sized peaks for a video job. Raises :class:`.grid.ImpossibleBudgetError`
    when nothing fits and the user set nothing; with a user setting, the smallest plan, ``over_budget``.
    ``ratio(path)``: the measured over predicted peak learned for a path on this machine (default 1)."""
    if isinstance(job, VideoJob):
        return plan_video(job, budget, models, ratio)
    return plan_image(job, budget, models, ratio)
