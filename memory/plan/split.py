"""Planning the exact split path (:mod:`..vae.split_layout`, :mod:`..executors.split`): the prefix's output
and peak meta-sized on this latent, the suffix's traced reach (the halo) and its cost model (calibrated once
per structure like the untiled one, keyed ``split``), then the fewest tiles that fit. When the prefix on the whole
latent does not fit and it runs in tiles (:attr:`..vae.split_layout.SplitLayout.prefix_units`: DC-AE), the largest
of :data:`PREFIX_TILES` whose meta-sized peak fits.

Tiles are planned in latent px (the suffix's cost model is indexed by the latent area a tile stands for) and
run in px of the prefix's output: ``prefix_scale`` of them per latent px."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from ..cost.calibration import cost_model_for
from ..cost.phases import CostModel
from ..executors.prefix_tiles import run_units
from ..geometry import Geometry, VaeGeometry
from ..measure.reach import ReachReport, default_halo, traced_reach
from ..measure.sizing import MetaSizer
from ..report import fmt_bytes
from ..vae.families import structure_digest
from ..vae.split_layout import SplitLayout
from .grid import ImpossibleBudgetError, Tiling, plan_tiling
from .types import Plan

__all__ = ["EXECUTOR", "PHASES", "PREFIX_TILES", "SplitPlanner", "plan_split", "prefix_tile", "split_planner",
           "suffix_reach", "suffix_run", "tail_reach", "tile_px"]

EXECUTOR = "split"
"""The suffix's cost-model key (:func:`..cost.calibration.vae_key`)."""
PHASES = (("const", "px"),)
"""The suffix's feature phases: no attention (a global op would be in the prefix), so no quadratic term."""
PREFIX_TILES = (64, 32, 16, 8, 4)
"""Tile sides of a tiled prefix in latent px (at a map ``s`` times the latent's resolution: ``s`` times more),
tried largest first."""


@dataclasses.dataclass(frozen=True)
class SplitPlanner:
    """What split plans of one job are computed from."""

    layout: SplitLayout
    prefix_scale: int
    """Prefix output px per latent px."""
    prefix_channels: int
    prefix_peak: int
    """Tracked peak of the prefix on this latent (one item, meta-sized)."""
    prefix_bytes: int
    """Its output, alive while the suffix's tiles run."""
    reach: ReachReport
    """The suffix's traced reach in prefix px."""
    suffix: CostModel
    prefix_tiled: Callable[[int], int] | None = None
    """Tracked peak of the prefix in tiles of a given latent px (meta-sized, kept); None: it runs whole only."""

    @property
    def halo(self) -> int:
        """Prefix px of context per tile: the suffix's reach, rounded up."""
        return default_halo(self.reach)

    @property
    def halo_latent(self) -> int:
        return -(-self.halo // self.prefix_scale)

    def describe_reach(self) -> str:
        return f"suffix conv reach {self.reach.total:g} px of the prefix's output ({self.reach.method}); " \
               f"halo {self.halo} px"


_REACH: dict[str, tuple[int, int, ReachReport]] = {}


def _meta_prefix(layout: SplitLayout, model: Any, channels: int, hw: tuple[int, int], dtype: torch.dtype,
                 device: torch.device) -> tuple[tuple[int, ...], int]:
    """The prefix's output shape and tracked peak on a ``(1, channels, *hw)`` latent (fake tensors)."""
    with torch.inference_mode(), MetaSizer([model], dtype, device) as sizer:
        x = layout.prefix(torch.empty((1, channels, *hw), dtype=dtype, device=device))
        shape = tuple(int(s) for s in x.shape)
        del x
    return shape, int(sizer.peak_bytes)


def tail_reach(model: Any, prefix: Callable[[torch.Tensor], torch.Tensor],
               tail: Callable[[torch.Tensor], Any], latent: tuple[int, ...], dtype: torch.dtype,
               device: torch.device) -> tuple[int, int, ReachReport]:
    """(prefix scale, prefix channels, the reach of ``tail`` in px of the prefix's output) of a decoder that is a
    global ``prefix`` then a local ``tail``, traced on a fake latent of shape ``latent`` once per structure.
    Serves the split path's suffix and the carried families' chunks."""
    key = f"{type(model).__module__}.{type(model).__qualname__}/{structure_digest(model)}/{latent}"
    if key not in _REACH:
        with torch.inference_mode(), MetaSizer([model], dtype, device):
            x = prefix(torch.empty(latent, dtype=dtype, device=device))
            report = traced_reach(model, lambda: tail(x), (int(x.shape[-2]), int(x.shape[-1])))
            scale, c = int(x.shape[-2]) // latent[-2], int(x.shape[1])
        _REACH[key] = (scale, c, report)
    return _REACH[key]


def suffix_reach(layout: SplitLayout, model: Any, channels: int, dtype: torch.dtype,
                 device: torch.device) -> tuple[int, int, ReachReport]:
    """(prefix scale, prefix channels, the suffix's reach) of a split layout (:func:`tail_reach`)."""
    return tail_reach(model, layout.prefix, layout.suffix, (1, channels, 8, 8), dtype, device)


def split_planner(job: Any, layout: SplitLayout, env: Any, first_use: Any = None) -> SplitPlanner:
    """The planner of ``job`` (a :class:`.image.ImageJob`) on the split path: the suffix's cost model is the
    store's or calibrated now (meta sizing; a ``first_use`` phase)."""
    model = job.vae.first_stage_model
    scale, c, report = suffix_reach(layout, model, job.channels, job.dtype, job.device)
    hw = (int(job.z.shape[2]), int(job.z.shape[3]))
    shape, peak = _meta_prefix(layout, model, job.channels, hw, job.dtype, job.device)
    elem = torch.empty((), dtype=job.dtype).element_size()
    run = suffix_run(layout, model, job.channels, job.dtype, job.device)
    suffix = cost_model_for(job.subject, env.cost_models, executor=EXECUTOR, run=run, first_use=first_use,
                            phases=PHASES)
    tiled = _prefix_tiled_peak(layout, model, job.channels, hw, job.dtype, job.device) if layout.prefix_units \
        else None
    return SplitPlanner(layout, scale, c, peak, math.prod(shape) * elem, report, suffix, tiled)


def _prefix_tiled_peak(layout: SplitLayout, model: Any, channels: int, hw: tuple[int, int], dtype: torch.dtype,
                       device: torch.device) -> Callable[[int], int]:
    """``peak(tile)``: the tracked peak of the prefix in tiles of ``tile`` latent px on a ``(1, channels, *hw)``
    latent (fake tensors, one tile per shape), kept per tile."""
    sized: dict[int, int] = {}

    def peak(tile: int) -> int:
        if tile not in sized:
            with torch.inference_mode(), MetaSizer([model], dtype, device) as sizer:
                x = run_units(layout.prefix_units, torch.empty((1, channels, *hw), dtype=dtype, device=device), tile,
                              sizing=True)
                del x
            sized[tile] = int(sizer.peak_bytes)
        return sized[tile]

    return peak


def suffix_run(layout: SplitLayout, model: Any, channels: int, dtype: torch.dtype,
               device: torch.device | str) -> Callable[[Geometry], None]:
    """``run(g)`` for a calibration of the suffix's cost model (executor :data:`EXECUTOR`): the suffix on a
    random prefix output of the size ``g``'s latent decodes to, under ``torch.inference_mode``."""
    dev = torch.device(device)
    scale, c, _ = suffix_reach(layout, model, channels, dtype, dev)

    def run(g: Geometry) -> None:
        with torch.inference_mode():
            x = torch.randn((g.batch, c, g.latent_h * scale, g.latent_w * scale), dtype=torch.float32)
            out = layout.suffix(x.to(device=dev, dtype=dtype))
            del out, x

    return run


def plan_split(job: Any, sp: SplitPlanner, budget: int, tile: int | None, extra: int) -> Plan:
    """Exact split tiles, the fewest that fit ``budget`` (or the user's ``tile`` in output px, flagged when
    over); ``extra``: bytes alive besides the decode (output buffer, one processed image)."""
    geo = VaeGeometry(job.family, job.ratio, halo=sp.halo_latent)
    shape = (1, job.channels, int(job.z.shape[2]), int(job.z.shape[3]))
    room = max(0, budget - extra - sp.prefix_bytes)
    over = False
    try:
        if tile is not None:
            p = plan_tiling(shape, geo, room, sp.suffix, halo=sp.halo_latent, min_tile=1,
                            max_tile=max(1, tile // job.ratio), split_batch=False)
        else:
            p = plan_tiling(shape, geo, room, sp.suffix, halo=sp.halo_latent, min_tile=1, split_batch=False)
    except ImpossibleBudgetError as e:
        if tile is None:
            raise
        p, over = e.smallest, True
    pre_tile, pre_peak = 0, sp.prefix_peak
    if extra + max(pre_peak, sp.prefix_bytes + p.predicted_peak) > budget and sp.prefix_tiled is not None:
        lh, lw = int(job.z.shape[2]), int(job.z.shape[3])
        for t in [t for t in PREFIX_TILES if t < max(lh, lw)] or [PREFIX_TILES[-1]]:
            pre_tile, pre_peak = t, sp.prefix_tiled(t)
            if extra + max(pre_peak, sp.prefix_bytes + p.predicted_peak) <= budget:
                break
    planned = extra + max(pre_peak, sp.prefix_bytes + p.predicted_peak)
    where = "on the whole latent" if not pre_tile else f"in tiles of {pre_tile} latent px (its linear attention's " \
        "sums over all tiles)"
    if planned > budget and not over:
        if tile is None:
            raise ImpossibleBudgetError(
                f"exact split tiles need {fmt_bytes(planned)} (the prefix runs {where})",
                budget=budget, minimum=planned, smallest=p)
        over = True
    largest = max(p.tiles(), key=lambda t: (t.cy1 - t.cy0) * (t.cx1 - t.cx0))
    g = Geometry(largest.cy1 - largest.cy0, largest.cx1 - largest.cx0, spatial_ratio=job.ratio)
    tracked = extra + max(pre_peak, sp.prefix_bytes + sp.suffix.predict_tracked(g))
    th, tw = p.tile_h * sp.prefix_scale, p.tile_w * sp.prefix_scale
    res = job.ratio // sp.prefix_scale
    desc = f"{p.rows}x{p.cols} suffix tiles of {th}x{tw} px at 1/{res} resolution, " \
           f"halo {sp.halo} px; prefix {where}"
    return Plan("split", p, desc, planned, tracked, exact=True, reason=sp.layout.describe(), halo=sp.halo,
                over_budget=over, units=1 + p.rows * p.cols, stats={"prefix_tile": pre_tile})


def prefix_tile(p: Plan) -> int:
    """The plan's prefix tile in latent px (0: the prefix on the whole latent)."""
    return int(p.stats.get("prefix_tile") or 0)


def tile_px(p: Plan, sp: SplitPlanner) -> tuple[int, int]:
    """The executor's tile in prefix px."""
    t: Tiling = p.config
    return t.tile_h * sp.prefix_scale, t.tile_w * sp.prefix_scale
