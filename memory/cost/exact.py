"""Planning the Tiled VAE Decode node: a measured cost model of the exact executor, and the choice of
how to decode (untiled, exact tiled with the store on the device or the host, with or without
recomputation, or generic tiles).

Cost model of ``tiled_exact.decode_exact`` (``ExactCostModel``)
--------------------------------------------------------------
The executor's memory at any moment is the full-size activations alive in its *store* plus the
working set of the one tile being computed. Both are measured by meta sizing (fake tensors, the same
byte count as a real run, no compute; see ``sizing.MetaSizer``) of the executor itself, *decomposed
per unit of work*: ``should_stop`` (called before every unit) opens a nested ``PeakTracker`` and
``progress`` (called after the unit's core is written) closes it, so each unit ``j`` yields

* ``S_j``: live bytes when the unit starts (the stores: activations alive in this segment), and
* ``W_j``: the unit's own peak above that (input tile with halo, normalised copy, convolution
  outputs, shortcut, statistics).

The executor's peak is ``max_j S_j + W_j``. The store is kept in row bands that a segment allocates
and releases as its rows of tiles pass, so ``S`` varies within a segment; its live elements at every
row of tiles are known exactly from the geometry (``tiled_exact.store_schedule`` mirrors the
executor's band allocation and release), so per segment ``S = d x live + b`` (``d``: the dtype's
bytes with the store on the device, 0 elsewhere; ``b``: the largest residual seen, i.e. statistics
partials and GroupNorm affine caches, a few KiB). A tile's working set is a sum of tensors over its
input region (with halo) and its core, so per *segment signature* (kind, channels, halo, scale: the
same code path on the same channel counts, shared by e.g. every 512->512 block of the SD decoder)
and number of reads that span store bands (each is assembled into a new tensor; a read inside one
band is a view of the store) ``W = c_in x in_px + c_core x core_px + c_0`` is fitted by non-negative
least squares on every unit observed. Prediction for any size and tile evaluates the same geometry
the executor uses (balanced tiles of ``split_even``, halos clipped at the borders, band rows) and
takes the worst tile of every row of tiles of every segment.

The mid block (``conv_in`` + ``block_1`` + the global ``attn_1`` + ``block_2``) runs once on the
whole latent. Its memory depends on the attention kernel (on CPU ComfyUI's split attention
materialises ``N^2`` scores, sliced by the free RAM of the moment), so it is meta-sized at plan time
on the actual latent (``measure_mid_peak``: the executor run on fake tensors and stopped at its
first tile, ~0.1-0.5 s) rather than extrapolated.

Three calibration runs (two small tiled latents and one untiled, ~2-5 s of meta sizing on a CPU) per (decoder structure,
dtype, device type, recompute, store placement); models are cached in memory and, when the node
passes a path, in a JSON file.

Choosing a plan (``choose_plan``)
---------------------------------
Fastest first: (1) untiled (ComfyUI's own ``first_stage_model.decode``, batched) when it fits: it is
the reference result itself; (2) exact tiles with the store on the compute device, the largest tile
that fits; (3) the same with ``recompute`` (a smaller store for channel-changing blocks, ~+15 % compute) when it allows a clearly
larger tile; (4) on an accelerator, the store in host memory (only a tile + the mid block on the
device; any size fits, at the cost of transfers). Decoders the exact executor does not support use
(1) or generic tiles planned by ``planner.plan_decode`` with the untiled decode's cost model.

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..executors.kl_exact import (
    SegmentInfo,
    decode_exact,
    find_decoder,
    plan_exact,
    split_even,
    store_schedule,
    unsupported_reason,
)
from ..measure.sizing import MetaSizer
from ..measure.tracker import PeakTracker
from ..plan.grid import ImpossibleBudgetError
from .phases import dtype_name, nnls

log = logging.getLogger("vramfit.memory.decode_plan")

__all__ = [
    "ExactCostModel",
    "ExactCostStore",
    "write_exact_models",
    "ExactPeak",
    "ExactChoice",
    "calibrate_exact",
    "choose_exact",
    "exact_key",
    "measure_mid_peak",
    "tile_candidates",
]

SCHEMA = 2
TILE_CANDIDATES = (2048, 1536, 1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32, 24, 16)
"""Tile sides (px at each activation's resolution) the auto plan tries, largest first."""
MIN_AUTO_TILE = 16
MIN_MARGIN = 0.01
"""Safety margin on every exact prediction (the fit is within 0.3 % of meta-sized peaks)."""
RECOMPUTE_COST = 1.15
"""Compute factor of ``recompute=True`` (CPU measurement, docs/TILED_DECODE.md)."""
HOST_STORE_COST = 1.5
"""Rough time factor of a host store on an accelerator (every activation crosses the bus twice)."""


# --------------------------------------------------------------------------------------------------
# Geometry of the executor's tiles (mirrors tiled_exact's regions)


def _pre_scale(model: Any) -> int:
    """Mid-block resolution / latent resolution (2 for Flux-2 style latent batch-norm + pixel shuffle)."""
    bn = getattr(model, "bn", None)
    return 2 if isinstance(bn, torch.nn.BatchNorm2d) else 1


def _axis_extents(info: SegmentInfo, n_out: int, tile: int) -> list[tuple[int, int, int]]:
    """``(start, core length, input extent)`` of every tile along one axis of segment ``info``'s output
    (``n_out`` px). Input extent: px of the segment's input read (core + halo, clipped; for ``upsample``
    the low-resolution rows)."""
    out = []
    h = info.halo
    if info.kind == "upsample":
        n_in = n_out // 2
        for a, b in split_even(n_out, tile):
            lo0 = max(0, (a - h) // 2)
            lo1 = min(n_in, (b - 1 + h) // 2 + 1)
            out.append((a, b - a, lo1 - lo0))
        return out
    for a, b in split_even(n_out, tile):
        out.append((a, b - a, min(n_out, b + h) - max(0, a - h)))
    return out


def signature(info: SegmentInfo) -> str:
    """Segments with the same signature run the same code on the same channel counts."""
    inplace = "i" if info.inplace_of is not None else ""
    shortcut = "+s" if info.shortcut_output is not None else ""
    return (
        f"{info.kind}:{info.in_channels}>{info.out_channels}:r{info.residual_channels}"
        f":h{info.halo}:s{info.scale}{inplace}{shortcut}"
    )


def _cls(sig: str, copies: int) -> str:
    """Tile-cost class: how many of a tile's reads span two or more store bands (each is assembled into a
    new tensor; a read inside one band is a view of the store)."""
    return f"{sig}|c{int(copies)}"


def _segment_dims(model: Any, latent_hw: tuple[int, int], info: SegmentInfo) -> tuple[int, int]:
    p = _pre_scale(model)
    return latent_hw[0] * p * info.level_scale, latent_hw[1] * p * info.level_scale


def _schedule(model: Any, latent_hw: tuple[int, int], tile: tuple[int, int], recompute: bool):
    p = _pre_scale(model)
    return store_schedule(model, (latent_hw[0] * p, latent_hw[1] * p), tile, recompute)


def _units(model: Any, latent_hw: tuple[int, int], tile: tuple[int, int], recompute: bool):
    """``(segment index, in_px, core_px, copies, live store elements)`` of every tile unit of one batch
    item, in execution order (rows of tiles, left to right)."""
    plan = plan_exact(model, (1, 1, *latent_hw), tile, recompute)
    schedule = _schedule(model, latent_hw, tile, recompute)
    for k, (info, steps) in enumerate(zip(plan.segments, schedule, strict=True)):
        _, w = _segment_dims(model, latent_hw, info)
        cols = _axis_extents(info, w, tile[1])
        for st in steps:
            for _, cw, iw in cols:
                yield k, st.in_rows * iw, st.core_rows * cw, st.copies, st.live


# --------------------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class TileCost:
    """Working set of one tile of segments with this signature: ``c_in in_px + c_core core_px + c_0``."""

    signature: str
    c_in: float
    c_core: float
    c_0: float
    points: int = 0
    worst_error: float = 0.0

    def predict(self, in_px: float, core_px: float) -> float:
        return self.c_in * in_px + self.c_core * core_px + self.c_0


@dataclasses.dataclass(frozen=True)
class SegmentCost:
    """Store bytes alive while a row of segment ``name``'s tiles runs: ``per_element x live + const``, where
    ``live`` is the store's live elements of that row (:func:`.tiled_exact.store_schedule`: row bands,
    released as the tiles pass): the dtype's bytes with the store on the device, 0 elsewhere."""

    name: str
    signature: str
    per_element: float
    const: float


@dataclasses.dataclass(frozen=True)
class ExactPeak:
    """Predicted peak of one exact decode of one batch item (bytes, as the tracker counts them)."""

    tracked: int
    """max(mid, worst segment): what ``PeakTracker`` measures around ``decode_exact``."""
    store: int
    """Store bytes at the worst segment (0 when the store is elsewhere)."""
    work: int
    """Tile working set at the worst segment, or the mid block's working set when it is the peak."""
    segment: str
    """Where the peak is (a segment name, or ``mid``)."""
    mid: int
    tiles: int
    """Tile units of the decode (all segments, this item)."""

    def with_overhead(self, overhead: float) -> int:
        """Planning figure: untracked overhead (CPU scratch) scales the working set, not the store."""
        return int(math.ceil(self.store + self.work * (1.0 + overhead)))


@dataclasses.dataclass(frozen=True)
class ExactCostModel:
    key: str
    dtype: str
    device_type: str
    recompute: bool
    store_on_device: bool
    segments: tuple[SegmentCost, ...]
    tiles: tuple[TileCost, ...]
    dtype_bytes: int = 0
    margin: float = 0.0
    """At least ``MIN_MARGIN``; raised so that no calibration run's peak is under-predicted."""
    calibration_seconds: float = 0.0
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def tile_cost(self, sig: str) -> TileCost:
        for t in self.tiles:
            if t.signature == sig:
                return t
        raise KeyError(f"no tile cost for segment signature {sig} in {self.key}")

    def work(self, info: SegmentInfo, copies: int, in_px: float, core_px: float,
             costs: Mapping[str, TileCost] | None = None) -> float:
        """Working set of one tile. A class never seen in calibration falls back conservatively to the
        nearest one seen: with fewer assembled reads, plus one input region's bytes per missing copy."""
        if costs is None:
            costs = {t.signature: t for t in self.tiles}
        sig = signature(info)
        cost = costs.get(_cls(sig, copies))
        if cost is not None:
            return cost.predict(in_px, core_px)
        seen = [c for c in range(4) if _cls(sig, c) in costs]
        if not seen:
            raise KeyError(f"no tile cost for segment signature {sig} in {self.key}")
        near = min(seen, key=lambda c: (abs(c - copies), -c))
        extra = max(0, copies - near) * info.in_channels * in_px * max(1, self.dtype_bytes)
        return costs[_cls(sig, near)].predict(in_px, core_px) + extra

    def predict(
        self,
        model: Any,
        latent_hw: tuple[int, int],
        tile: int | tuple[int, int] | None,
        mid_bytes: int,
    ) -> ExactPeak:
        """Predicted tracked peak of ``decode_exact`` of one ``latent_hw`` item with ``tile``; ``mid_bytes``:
        the whole-latent phase (:func:`measure_mid_peak`), which does not depend on the tile. Every row of
        tiles of every segment: its store (live elements, :func:`.tiled_exact.store_schedule`) + the worst
        tile of the row."""
        t = _tile_pair(tile)
        lh, lw = int(latent_hw[0]), int(latent_hw[1])
        plan = plan_exact(model, (1, 1, lh, lw), t, self.recompute)
        if len(plan.segments) != len(self.segments):
            raise ValueError(f"{self.key}: model has {len(plan.segments)} segments, cost model {len(self.segments)}")
        schedule = _schedule(model, (lh, lw), t, self.recompute)
        costs = {c.signature: c for c in self.tiles}
        best = (0.0, 0.0, 0.0, "mid")
        for info, seg, steps in zip(plan.segments, self.segments, schedule, strict=True):
            _, w = _segment_dims(model, (lh, lw), info)
            cols = {(c, i) for _, c, i in _axis_extents(info, w, t[1])}
            for st in steps:
                store = seg.per_element * st.live + seg.const
                work = max(self.work(info, st.copies, st.in_rows * iw, st.core_rows * cw, costs) for cw, iw in cols)
                total = (store + work) * (1.0 + self.margin)
                if total > best[0]:
                    best = (total, store * (1.0 + self.margin), work * (1.0 + self.margin), info.name)
        mid = int(mid_bytes)
        tiles = sum(plan.tiles_per_segment)
        if mid >= best[0]:
            return ExactPeak(int(math.ceil(mid)), 0, int(math.ceil(mid)), "mid", int(mid), tiles)
        return ExactPeak(int(math.ceil(best[0])), int(best[1]), int(math.ceil(best[2])), best[3], int(mid), tiles)

    def describe(self) -> str:
        worst = max((t.worst_error for t in self.tiles), default=0.0)
        return (
            f"exact cost model {self.key}: {len(self.segments)} segments, {len(self.tiles)} tile signatures, "
            f"worst unit fit error {worst:.1%}, margin {self.margin:.1%}, calibrated in "
            f"{self.calibration_seconds:.1f} s (meta sizing)"
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema"] = SCHEMA
        d["inputs"] = dict(self.inputs)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ExactCostModel:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"exact cost model schema {d.get('schema')!r} is not {SCHEMA}")
        return cls(
            key=str(d["key"]),
            dtype=str(d["dtype"]),
            device_type=str(d["device_type"]),
            recompute=bool(d["recompute"]),
            store_on_device=bool(d["store_on_device"]),
            segments=tuple(SegmentCost(**s) for s in d["segments"]),
            tiles=tuple(TileCost(**t) for t in d["tiles"]),
            dtype_bytes=int(d.get("dtype_bytes", 0)),
            margin=float(d.get("margin", 0.0)),
            calibration_seconds=float(d.get("calibration_seconds", 0.0)),
            inputs=dict(d.get("inputs", {})),
        )


def _tile_pair(tile: int | Sequence[int] | None) -> tuple[int, int]:
    if tile is None:
        return (1 << 30, 1 << 30)
    if isinstance(tile, int):
        return (tile, tile)
    return int(tile[0]), int(tile[1])


def structure_signature(model: Any) -> str:
    """A short description of the decoder's segment structure (part of the cost-model key)."""
    plan = plan_exact(model, (1, 1, 8, 8), (8, 8), False)
    sigs = ",".join(signature(s) for s in plan.segments)
    dec = find_decoder(model)
    tail = f"|tanh={bool(getattr(dec, 'tanh_out', False))}|bn={_pre_scale(model)}"
    # Compact but collision-safe enough: segment count + a stable hash of the signature list.
    digest = 0
    for ch in sigs + tail:
        digest = (digest * 131 + ord(ch)) % (1 << 61)
    return f"{len(plan.segments)}seg-{digest:x}"


def executor_digest() -> str:
    """The exact executor's version (``tiled_exact.EXECUTOR_VERSION``), part of every exact cost-model key."""
    from ..executors import kl_exact as tiled_exact

    return tiled_exact.EXECUTOR_VERSION


def exact_key(
    model: Any, dtype: torch.dtype | str, device: torch.device | str, recompute: bool, store_on_device: bool
) -> str:
    """Cache key: decoder class and segment structure, executor version, dtype, device type, configuration."""
    dev = torch.device(device).type
    cls = type(model)
    return (
        f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}/{structure_signature(model)}/exact-{executor_digest()}"
        f"/{dtype_name(dtype)}/{dev}/{'recompute' if recompute else 'store'}/{'device' if store_on_device else 'host'}"
    )


# --------------------------------------------------------------------------------------------------
# Calibration by decomposed meta sizing


class _Windows:
    """``should_stop`` / ``progress`` callbacks measuring every unit of an exact decode."""

    def __init__(self, outer: PeakTracker, device: torch.device) -> None:
        self.outer = outer
        self.device = device
        self.inner: PeakTracker | None = None
        self.start = 0
        self.units: list[tuple[int, int]] = []  # (S_j, W_j)

    def should_stop(self) -> None:
        if self.inner is not None:  # a unit that raised: drop its window
            self.inner.__exit__(None, None, None)
        self.start = self.outer.current_bytes
        self.inner = PeakTracker(self.device, method="dispatch")
        self.inner.__enter__()

    def progress(self, done: int, total: int) -> None:
        if self.inner is None:
            return
        self.inner.__exit__(None, None, None)
        self.units.append((self.start, self.inner.peak_bytes))
        self.inner = None

    def close(self) -> None:
        if self.inner is not None:
            self.inner.__exit__(None, None, None)
            self.inner = None


def _meta_units(
    model: Any,
    latent: tuple[int, int, int],
    tile: tuple[int, int],
    dtype: torch.dtype,
    device: torch.device,
    recompute: bool,
    store_on_device: bool,
) -> tuple[list[tuple[int, int]], int]:
    """Per-unit ``(S, W)`` of one meta-sized exact decode of a ``(1, C, h, w)`` latent, and its peak."""
    c, h, w = latent
    store = device if store_on_device else torch.device("meta")
    with MetaSizer([model], dtype, device) as sizer:
        with PeakTracker(device, method="dispatch") as outer:
            win = _Windows(outer, device)
            try:
                z = torch.empty((1, c, h, w), dtype=dtype, device=device)
                out = decode_exact(
                    model,
                    z,
                    tile,
                    store_device=store,
                    compute_device=device,
                    out_device=store,
                    recompute=recompute,
                    progress=win.progress,
                    should_stop=win.should_stop,
                    pin_memory=False,
                )
                del out, z
            finally:
                win.close()
    return win.units, sizer.peak_bytes


def _calibration_runs(model: Any) -> list[tuple[int, int, int]]:
    """``(latent h, latent w, tile)`` of the calibration runs: two different latent areas and tiles
    relative to the top resolution, so the upper levels are cut into a few tiles (edge and interior
    tiles: the input region varies independently of the core; reads spanning store bands) while the
    runs stay small (~200 units; ~3 s of meta sizing for the SD decoder on a busy 2-core CPU), and one
    run with every activation in one tile (reads that are views of one band, as large tiles make)."""
    levels = len(find_decoder(model).up)
    top = (2 ** (levels - 1)) * _pre_scale(model)
    return [(7, 5, 2 * top), (5, 9, 3 * top), (6, 6, 1 << 16)]


class _StopSizing(Exception):
    """Raised by the fault hook to end a meta run at its first tile."""


def measure_mid_peak(
    model: Any,
    latent_hw: tuple[int, int],
    latent_channels: int,
    dtype: torch.dtype,
    device: torch.device | str,
    store_on_device: bool = True,
) -> int:
    """Tracked peak of the exact executor's whole-latent phase (``conv_in`` + mid block of one item, its
    store, the first segment's store), meta-sized on the actual latent: the executor is run on fake
    tensors and stopped inside its first tile."""
    dev = torch.device(device)
    store = dev if store_on_device else torch.device("meta")

    def stop(step: int) -> None:
        raise _StopSizing

    sizer = MetaSizer([model], dtype, dev)
    try:
        with sizer:
            z = torch.empty((1, latent_channels, *latent_hw), dtype=dtype, device=dev)
            decode_exact(model, z, latent_hw, store_device=store, compute_device=dev, out_device=store,
                         fault_hook=stop, pin_memory=False)
    except _StopSizing:
        pass
    return int(sizer.peak_bytes)


def calibrate_exact(
    model: Any,
    latent_channels: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    recompute: bool = False,
    store_on_device: bool = True,
    runs: Sequence[tuple[int, int, int]] | None = None,
) -> ExactCostModel:
    """Fit an :class:`ExactCostModel` for ``model`` from meta-sized exact decodes (see module docstring).

    ``store_on_device=False`` sizes the executor with its store on another device (``meta`` stands in
    for the host), so the stores are not counted and every tile's inputs are copied in."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"exact tiled decode does not support this model: {reason}")
    dev = torch.device(device)
    t0 = time.perf_counter()
    runs = list(runs) if runs is not None else _calibration_runs(model)
    if len({h * w for h, w, _ in runs}) < 2:
        raise ValueError("calibration needs two runs with different latent areas")
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    per_element = float(dtype_bytes) if store_on_device else 0.0
    store_const: dict[int, float] = {}
    tile_obs: dict[str, list[tuple[float, float, float]]] = {}
    mid_obs: list[int] = []
    infos: tuple[SegmentInfo, ...] = ()
    run_peaks: list[int] = []
    for h, w, t in runs:
        units, run_peak = _meta_units(model, (latent_channels, h, w), (t, t), dtype, dev, recompute, store_on_device)
        plan = plan_exact(model, (1, latent_channels, h, w), (t, t), recompute)
        infos = plan.segments
        geo = list(_units(model, (h, w), (t, t), recompute))
        if len(units) != plan.mid_steps + len(geo):
            raise RuntimeError(
                f"calibration: {len(units)} units measured, {plan.mid_steps + len(geo)} expected (executor changed?)"
            )
        run_peaks.append(run_peak)
        mid_s, mid_w = units[0]
        mid_obs.append(int(mid_s + mid_w))
        for (k, in_px, core_px, copies, live), (s, wk) in zip(geo, units[plan.mid_steps :], strict=True):
            # The store is simulated exactly; what the simulation does not hold (statistics, caches) is a
            # per-segment constant: the largest residual seen.
            resid = float(s) - per_element * live
            store_const[k] = max(store_const.get(k, resid), resid)
            tile_obs.setdefault(_cls(signature(infos[k]), copies), []).append((float(in_px), float(core_px), float(wk)))
    segments = [SegmentCost(info.name, signature(info), per_element, store_const[k]) for k, info in enumerate(infos)]
    tiles = []
    for sig, obs in tile_obs.items():
        targets = [y for *_, y in obs]
        weights = [1.0 / max(1.0, y) ** 2 for y in targets]
        if len({i / c for i, c, _ in obs if c}) >= 2:
            c_in, c_core, c_0 = nnls([[i, c, 1.0] for i, c, _ in obs], targets, weights)
        else:
            # The input region never varied independently of the core (no tile of this signature had a
            # halo): attribute the area term to the input region, which is >= the core for every tile.
            c_in, c_0 = nnls([[i, 1.0] for i, _, _ in obs], targets, weights)
            c_core = 0.0
        cost = TileCost(sig, c_in, c_core, c_0, len(obs))
        worst = max(abs(cost.predict(i, c) - y) / max(1.0, y) for i, c, y in obs)
        tiles.append(dataclasses.replace(cost, worst_error=worst))
    fitted = ExactCostModel(
        key=exact_key(model, dtype, dev, recompute, store_on_device),
        dtype=dtype_name(dtype),
        device_type=dev.type,
        recompute=recompute,
        store_on_device=store_on_device,
        segments=tuple(segments),
        tiles=tuple(tiles),
        dtype_bytes=dtype_bytes,
    )
    # Margin: at least MIN_MARGIN, and no calibration run's peak under-predicted (its mid phase included).
    margin = MIN_MARGIN
    for (h, w, t), peak, mid in zip(runs, run_peaks, mid_obs, strict=True):
        pred = fitted.predict(model, (h, w), (t, t), mid_bytes=mid).tracked
        if pred > 0 and peak > pred * (1.0 + margin):
            margin = peak / pred - 1.0
    return dataclasses.replace(
        fitted,
        margin=round(margin, 6),
        calibration_seconds=time.perf_counter() - t0,
        inputs={
            "runs": [list(r) for r in runs],
            "latent_channels": latent_channels,
            "method": "meta sizing of decode_exact, one tracker window per unit",
            "torch": torch.__version__,
        },
    )


# --------------------------------------------------------------------------------------------------
# Cache


DEFAULTS_DIR = pathlib.Path(__file__).resolve().parent / "data" / "exact"
"""Shipped exact cost models (``bench/tiled_decode.py --write-defaults``); a key carries the executor's
source digest, so a default made for another version of ``tiled_exact.py`` is never used."""


def _read_exact_models(path: pathlib.Path) -> list[ExactCostModel]:
    data = json.loads(path.read_text())
    return [ExactCostModel.from_dict(d) for d in data.get("models", [])]


def write_exact_models(path: str | pathlib.Path, models: Iterable[ExactCostModel]) -> None:
    """Write ``models`` as one JSON file (the format :class:`ExactCostStore` reads)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"schema": SCHEMA, "models": [m.to_dict() for m in sorted(models, key=lambda m: m.key)]}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


class ExactCostStore:
    """Exact cost models by key: calibrations cached on this machine (in memory, and in a JSON file when
    ``path`` is given: the node passes one under ComfyUI's user folder), then the shipped defaults."""

    def __init__(self, path: str | pathlib.Path | None = None, defaults_dir: pathlib.Path | None = DEFAULTS_DIR) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._models: dict[str, ExactCostModel] = {}
        self._defaults: dict[str, ExactCostModel] = {}
        if defaults_dir is not None and defaults_dir.is_dir():
            for f in sorted(defaults_dir.glob("*.json")):
                try:
                    self._defaults.update((m.key, m) for m in _read_exact_models(f))
                except (ValueError, KeyError, TypeError) as e:
                    log.warning("ignoring unreadable shipped exact cost models %s: %s", f, e)
        if self.path is not None and self.path.is_file():
            try:
                self._models.update((m.key, m) for m in _read_exact_models(self.path))
            except (ValueError, KeyError, TypeError) as e:  # a broken cache is ignored, not fatal
                log.warning("ignoring unreadable exact cost-model cache %s: %s", self.path, e)

    def get(self, key: str) -> ExactCostModel | None:
        with self._lock:
            return self._models.get(key) or self._defaults.get(key)

    def put(self, model: ExactCostModel) -> None:
        with self._lock:
            self._models[model.key] = model
            if self.path is None:
                return
            try:
                write_exact_models(self.path, self._models.values())
            except OSError as e:
                log.warning("could not write the exact cost-model cache %s: %s", self.path, e)

    def get_or_calibrate(self, key: str, calibrate_fn: Callable[[], ExactCostModel]) -> ExactCostModel:
        found = self.get(key)
        if found is not None:
            return found
        model = calibrate_fn()
        self.put(model)
        log.info("%s", model.describe())
        return model


# --------------------------------------------------------------------------------------------------
# Choosing an exact plan


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
        return f"{tiling}, {self.peak.tiles} tile steps per image, {store}{rec}"


def tile_candidates(max_side: int, min_tile: int = MIN_AUTO_TILE) -> list[int]:
    """Tile sides the auto plan tries, largest first: the whole image, then ``TILE_CANDIDATES`` below it."""
    out = [int(max_side)]
    out += [t for t in TILE_CANDIDATES if min_tile <= t < max_side]
    return out


def _score(tile: int, max_side: int, recompute: bool, store_on_device: bool) -> float:
    halo = 1.0 if tile >= max_side else (1.0 + 4.0 / tile) ** 2
    return halo * (RECOMPUTE_COST if recompute else 1.0) * (1.0 if store_on_device else HOST_STORE_COST)


def choose_exact(
    predict: Callable[[bool, bool, int], ExactPeak],
    max_side: int,
    budget: int,
    *,
    overhead: float = 0.0,
    extra_bytes: int = 0,
    post_bytes: int = 0,
    host_store: bool = False,
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
    ``host_store``: allow the store in host memory (accelerators). ``tile``: a user tile (used as is;
    the configuration is still chosen to fit, and ``fits`` says whether one did). ``allow_whole=False``:
    only tiles smaller than the image (a re-plan after the untiled decode ran out of memory).

    Order: store on device without recomputation at the largest fitting tile; if that tile is below
    ``good_tile``, also recomputation (a larger tile for ~15 % more compute) and, with ``host_store``,
    the store in host memory; the lowest ``score`` wins. Raises :class:`.planner.ImpossibleBudgetError`
    when nothing fits (auto tile).
    """
    budget = int(budget)
    configs = [(False, True), (True, True)] + ([(False, False), (True, False)] if host_store else [])

    def make(rec: bool, dev: bool, t: int) -> ExactChoice:
        pk = predict(rec, dev, t)
        planned = int(extra_bytes) + max(pk.with_overhead(overhead), int(post_bytes))
        tracked = int(extra_bytes) + max(pk.tracked, int(post_bytes))
        return ExactChoice(t, rec, dev, pk, planned, tracked, _score(t, max_side, rec, dev),
                           planned <= budget, t >= max_side)

    if tile is not None:
        tried = [make(rec, dev, int(tile)) for rec, dev in configs[:1]]
        if not tried[0].fits:
            tried += [make(rec, dev, int(tile)) for rec, dev in configs[1:]]
        fitting = [c for c in tried if c.fits]
        return fitting[0] if fitting else min(tried, key=lambda c: c.planned)

    cands = tile_candidates(max_side, min_tile)
    if not allow_whole:
        cands = [t for t in cands if t < max_side] or [min_tile]
    smallest: list[ExactChoice] = []

    def best(rec: bool, dev: bool) -> ExactChoice | None:
        for t in cands:
            c = make(rec, dev, t)
            if c.fits:
                return c
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
        f"budget {_mib(budget)} is too small for an exact tiled decode{(' of ' + what) if what else ''}: "
        f"the smallest plan (tiles of {low.tile} px, {cfg}) needs {_mib(low.planned)} ({low.planned} bytes; "
        f"peak at {low.peak.segment}); free at least {_mib(low.planned - budget)} more",
        budget=budget,
        minimum=low.planned,
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:,.1f} KiB"
