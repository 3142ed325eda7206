"""Choosing an exact tiled decode: the tile, ``recompute`` and the store's placement that fit a budget,
fastest first, from the predictions of the measured cost model (:class:`..cost.exact.ExactCostModel`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..cost.exact import ExactPeak
from ..report import fmt_bytes
from .grid import ImpossibleBudgetError

__all__ = ["ExactChoice", "MIN_AUTO_TILE", "choose_exact", "exact_choice", "exact_score", "tile_candidates"]

TILE_CANDIDATES = (2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16)
"""Tile sides (px at each activation's resolution) the auto plan tries, largest first."""
MIN_AUTO_TILE = 16
RECOMPUTE_COST = 1.15
"""Compute factor of ``recompute=True`` (CPU measurement, docs/TILED_DECODE.md)."""
HOST_STORE_COST = 1.5
"""Rough time factor of a host store on an accelerator (every activation crosses the bus twice)."""


@dataclasses.dataclass(frozen=True)
class ExactChoice:
    """One exact-executor configuration and its predicted memory."""

    tile: int
    """Tile side in px at every activation's own resolution (>= ``max_side``: every activation is one tile)."""
    recompute: bool
    store_on_device: bool
    peak: ExactPeak
    """Predicted tracked peak of ``decode_exact`` for one batch item."""
    planned: int
    """Bytes compared with the budget: ``extra + max(peak with untracked overhead, post)``."""
    tracked: int
    """Predicted tracked peak of the whole run: ``extra + max(peak, post)``."""
    score: float
    """Relative compute time (1 = untiled): halo recomputation x recompute x host transfers."""
    fits: bool
    whole: bool

    def describe(self) -> str:
        tiling = "every activation in one tile" if self.whole else f"tiles of {self.tile} px at every level"
        store = "store on the compute device" if self.store_on_device else "store in host memory"
        rec = ", recompute conv1" if self.recompute else ""
        return f"{tiling}, {self.peak.steps} steps per image, {store}{rec}"


def tile_candidates(max_side: int, min_tile: int = MIN_AUTO_TILE) -> list[int]:
    """Tile sides the auto plan tries, largest first: the whole image, then ``TILE_CANDIDATES`` below it."""
    out = [int(max_side)]
    out += [t for t in TILE_CANDIDATES if min_tile <= t < max_side]
    return out


def exact_score(tile: int, max_side: int, recompute: bool, store_on_device: bool) -> float:
    """Relative compute time of a configuration (:attr:`ExactChoice.score`)."""
    halo = 1.0 if tile >= max_side else (1.0 + 4.0 / tile) ** 2
    return halo * (RECOMPUTE_COST if recompute else 1.0) * (1.0 if store_on_device else HOST_STORE_COST)


def exact_choice(pk: ExactPeak, tile: int, recompute: bool, store_on_device: bool, *, max_side: int, budget: int,
                 overhead: float = 0.0, extra_bytes: int = 0, post_bytes: int = 0) -> ExactChoice:
    """One configuration with its figures (:class:`ExactChoice`) from its predicted peak ``pk``; the keywords
    as in :func:`choose_exact`."""
    planned = int(extra_bytes) + max(pk.with_overhead(overhead), int(post_bytes))
    tracked = int(extra_bytes) + max(pk.tracked, int(post_bytes))
    score = exact_score(tile, max_side, recompute, store_on_device)
    return ExactChoice(tile, recompute, store_on_device, pk, planned, tracked, score, planned <= int(budget),
                       tile >= max_side)


def choose_exact(
    predict: Callable[[bool, bool, int], ExactPeak],
    max_side: int,
    budget: int,
    *,
    overhead: float = 0.0,
    extra_bytes: int = 0,
    post_bytes: int = 0,
    host_store: bool = False,
    host_fits: Callable[[bool, int], bool] | None = None,
    tile: int | None = None,
    good_tile: int = 128,
    min_tile: int = MIN_AUTO_TILE,
    allow_whole: bool = True,
    what: str = "",
) -> ExactChoice:
    """The fastest exact configuration whose planned bytes fit ``budget``.

    ``predict(recompute, store_on_device, tile)``: an :class:`ExactPeak` (cost models are fetched lazily
    by the caller, so configurations that are never needed are never calibrated). ``max_side``: the
    largest activation side (output px). ``extra_bytes``: allocated on the device for the whole run
    (the output buffer when it lives there); ``post_bytes``: the post-processing peak of one item.
    ``host_store``: allow the store in host memory (accelerators); ``host_fits(recompute, tile)``: whether that
    store fits the host's RAM (None: always). ``tile``: a user tile (used as is;
    the configuration is still chosen to fit, and ``fits`` says whether one did). ``allow_whole=False``:
    only tiles smaller than the image (a re-plan after the untiled decode ran out of memory).

    Order: store on device without recomputation at the largest fitting tile; if that tile is below
    ``good_tile``, also recomputation (a larger tile for ~15 % more compute) and, with ``host_store``,
    the store in host memory; the lowest ``score`` wins. Raises :class:`.grid.ImpossibleBudgetError`
    when nothing fits (auto tile).
    """
    budget = int(budget)
    configs = [(False, True), (True, True)] + ([(False, False), (True, False)] if host_store else [])

    def allowed(rec: bool, dev: bool, t: int) -> bool:
        return dev or host_fits is None or host_fits(rec, t)

    def make(rec: bool, dev: bool, t: int) -> ExactChoice:
        return exact_choice(predict(rec, dev, t), t, rec, dev, max_side=max_side, budget=budget, overhead=overhead,
                            extra_bytes=extra_bytes, post_bytes=post_bytes)

    if tile is not None:
        tried = [make(rec, dev, int(tile)) for rec, dev in configs[:1]]
        if not tried[0].fits:
            tried += [make(rec, dev, int(tile)) for rec, dev in configs[1:] if allowed(rec, dev, int(tile))]
        fitting = [c for c in tried if c.fits]
        return fitting[0] if fitting else min(tried, key=lambda c: c.planned)

    cands = tile_candidates(max_side, min_tile)
    if not allow_whole:
        cands = [t for t in cands if t < max_side] or [min_tile]
    smallest: list[ExactChoice] = []

    def best(rec: bool, dev: bool) -> ExactChoice | None:
        c = None
        for t in cands:
            if not allowed(rec, dev, t):
                continue
            c = make(rec, dev, t)
            if c.fits:
                return c
        if c is not None:
            smallest.append(c)
        return None

    found = [c for c in [best(*configs[0])] if c is not None]
    if not found or not (found[0].whole or found[0].tile >= good_tile):
        for cfg in configs[1:]:
            if cfg[1] is False and found and max(c.tile for c in found) >= min(good_tile, max_side):
                break  # the host store only when the device store cannot give a good tile
            c = best(*cfg)
            if c is not None:
                found.append(c)
    if found:
        return min(found, key=lambda c: (c.score, c.planned))
    low = min(smallest, key=lambda c: c.planned)
    cfg = ("recompute, " if low.recompute else "") + ("store on device" if low.store_on_device else "store on host")
    raise ImpossibleBudgetError(
        f"budget {fmt_bytes(budget)} is too small for an exact tiled decode{(' of ' + what) if what else ''}: "
        f"the smallest plan (tiles of {low.tile} px, {cfg}) needs {fmt_bytes(low.planned)} ({low.planned} bytes; "
        f"peak at {low.peak.segment}); free at least {fmt_bytes(low.planned - budget)} more",
        budget=budget,
        minimum=low.planned,
    )
