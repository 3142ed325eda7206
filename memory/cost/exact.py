"""Measured cost model of the exact KL executor (:func:`..executors.kl_exact.decode_exact`): decomposed meta
sizing (one tracker window per unit of work: store bytes at its start ``S_j`` and its own peak ``W_j``),
a store term per segment and a tile working set per segment signature fitted by NNLS, evaluated on the
layout's geometry (:mod:`..vae.kl_layout`); calibration, cache keys and the store of fitted models.
Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..executors.kl_exact import EXECUTOR_VERSION, decode_exact
from ..measure.sizing import MetaSizer
from ..measure.tracker import PeakTracker
from ..store import Store, write_entries
from ..tiles import pair
from ..vae.kl_layout import SegmentInfo, axis_extents, kl_layout
from .phases import dtype_name, nnls

log = logging.getLogger("vramfit.memory.cost.exact")

__all__ = [
    "ExactCostModel",
    "ExactCostStore",
    "ExactPeak",
    "calibrate_exact",
    "estimate_exact_peak",
    "exact_key",
    "measure_mid_peak",
    "write_exact_models",
]

SCHEMA = 2
"""Schema of one model's dict (:meth:`ExactCostModel.to_dict`)."""
STORE_SCHEMA = 3
"""Schema of the store files (:class:`ExactCostStore`)."""
MIN_MARGIN = 0.01
"""Safety margin on every exact prediction (the fit is within 0.3 % of meta-sized peaks)."""


def signature(info: SegmentInfo) -> str:
    """Segments with the same signature run the same code on the same channel counts."""
    inplace = "i" if info.inplace_of is not None else ""
    shortcut = "+s" if info.shortcut_output is not None else ""
    frames = f":t{info.frames}" if info.frames != 1 else ""  # a 3-D decoder's frames (2-D keys unchanged)
    return (
        f"{info.kind}:{info.in_channels}>{info.out_channels}:r{info.residual_channels}"
        f":h{info.halo}:s{info.scale}{inplace}{shortcut}{frames}"
    )


def _cls(sig: str, copies: int) -> str:
    """Tile-cost class: how many of a tile's reads span two or more store bands (each is assembled into a
    new tensor; a read inside one band is a view of the store)."""
    return f"{sig}|c{int(copies)}"


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
    ``live`` is the store's live elements of that row (:func:`..vae.kl_layout.store_schedule`: row bands,
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
    steps: int
    """Progress units of the decode of this item (:meth:`..vae.kl_layout.KlLayout.steps`: mid block + tiles)."""

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
        tiles of every segment: its store (live elements, :func:`..vae.kl_layout.store_schedule`) + the worst
        tile of the row."""
        t = pair(tile)
        lh, lw = int(latent_hw[0]), int(latent_hw[1])
        lay = kl_layout(model, self.recompute).require()
        if len(lay.segments) != len(self.segments):
            raise ValueError(f"{self.key}: model has {len(lay.segments)} segments, cost model {len(self.segments)}")
        costs = {c.signature: c for c in self.tiles}
        best = (0.0, 0.0, 0.0, "mid")
        for info, seg, steps in zip(lay.segments, self.segments, lay.schedule((lh, lw), t), strict=True):
            cols = {(c, i) for _, c, i in axis_extents(info, lay.segment_hw(info, (lh, lw))[1], t[1])}
            for st in steps:
                store = seg.per_element * st.live + seg.const
                work = max(self.work(info, st.copies, st.in_rows * iw, st.core_rows * cw, costs) for cw, iw in cols)
                total = (store + work) * (1.0 + self.margin)
                if total > best[0]:
                    best = (total, store * (1.0 + self.margin), work * (1.0 + self.margin), info.name)
        mid = int(mid_bytes)
        steps = lay.steps((lh, lw), t)
        if mid >= best[0]:
            return ExactPeak(int(math.ceil(mid)), 0, int(math.ceil(mid)), "mid", int(mid), steps)
        return ExactPeak(int(math.ceil(best[0])), int(best[1]), int(math.ceil(best[2])), best[3], int(mid), steps)

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


def structure_signature(model: Any) -> str:
    """A short description of the decoder's segment structure (part of the cost-model key)."""
    lay = kl_layout(model, False).require()
    sigs = ",".join(signature(s) for s in lay.segments)
    tail = f"|tanh={lay.tanh_out}|bn={lay.pre_scale}"
    # Compact but collision-safe enough: segment count + a stable hash of the signature list.
    digest = 0
    for ch in sigs + tail:
        digest = (digest * 131 + ord(ch)) % (1 << 61)
    return f"{len(lay.segments)}seg-{digest:x}"


def executor_digest() -> str:
    """The exact executor's version (``kl_exact.EXECUTOR_VERSION``), part of every exact cost-model key."""
    return EXECUTOR_VERSION


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
    lay = kl_layout(model).require()
    top = (2 ** (lay.levels - 1)) * lay.pre_scale
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
    lay = kl_layout(model, recompute).require()
    infos = lay.segments
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
    run_peaks: list[int] = []
    for h, w, t in runs:
        units, run_peak = _meta_units(model, (latent_channels, h, w), (t, t), dtype, dev, recompute, store_on_device)
        geo = list(lay.units((h, w), (t, t)))
        if len(units) != 1 + len(geo):
            raise RuntimeError(
                f"calibration: {len(units)} units measured, {1 + len(geo)} expected (executor changed?)"
            )
        run_peaks.append(run_peak)
        mid_s, mid_w = units[0]
        mid_obs.append(int(mid_s + mid_w))
        for (k, in_px, core_px, copies, live), (s, wk) in zip(geo, units[1:], strict=True):
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
            # halo): attribute the area term to the input region, which is >= the core for every tile. One
            # input size only leaves slope and constant undetermined: proportional, the largest ratio seen
            # (a constant fitted there under-predicts larger tiles).
            if len({i for i, _, _ in obs}) >= 2:
                c_in, c_0 = nnls([[i, 1.0] for i, _, _ in obs], targets, weights)
            else:
                c_in, c_0 = max(y / max(1.0, i) for i, _, y in obs), 0.0
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
version, so a default made for another version of the executor is never used."""


class ExactCostStore(Store[ExactCostModel]):
    """Exact cost models by key (:class:`..store.Store`): calibrations cached on this machine (in memory,
    and in ``path`` when given: the node passes one under ComfyUI's user folder), then the shipped defaults."""

    section = "models"
    schema = STORE_SCHEMA
    what = "exact cost-model"

    def __init__(self, path: str | pathlib.Path | None = None,
                 defaults_dir: pathlib.Path | None = DEFAULTS_DIR) -> None:
        super().__init__(path, defaults_dir)

    def decode(self, value: Any) -> ExactCostModel:
        return ExactCostModel.from_dict(value)

    def encode(self, value: ExactCostModel) -> dict[str, Any]:
        return value.to_dict()

    def get_or_calibrate(self, key: str, calibrate_fn: Callable[[], ExactCostModel]) -> ExactCostModel:
        def make() -> ExactCostModel:
            model = calibrate_fn()
            log.info("%s", model.describe())
            return model

        return self.get_or_make(key, make)


def write_exact_models(path: str | pathlib.Path, models: Iterable[ExactCostModel]) -> None:
    """Write ``models`` as one store file (the format :class:`ExactCostStore` reads)."""
    write_entries(path, ExactCostStore.section, ExactCostStore.schema, {m.key: m.to_dict() for m in models})


# --------------------------------------------------------------------------------------------------
# Analytic sizes (the measured model is :class:`ExactCostModel`; this is the fallback for the whole-latent
# phase when it cannot be meta-sized)


def tile_bytes(info: SegmentInfo, core: tuple[int, int], dtype_bytes: int, inputs_copied: bool = True) -> int:
    """Peak bytes one tile of segment ``info`` with core ``(h, w)`` holds on the compute device.

    Phase by phase (``d`` = activation bytes, GroupNorm works in float32 ``f = 4``, or in float64 for
    float64 activations): the input tile with halo (only when ``inputs_copied``: the store lives
    elsewhere), its normalised copy (float32 temp + cast back for half types), each convolution's
    input and output with halo, the shortcut path, and the float32 copy of the core that the
    statistics of the next GroupNorm reduce (half types only).
    """
    d = int(dtype_bytes)
    f = 8 if d == 8 else 4
    th, tw = core
    cin, cout = info.in_channels, info.out_channels
    load = d if inputs_copied else 0
    half = d < f

    def gn(c: int, px: int) -> int:  # input alive while its normalised copy is made
        return c * px * (load + f + (d if half else 0))

    stats = cout * th * tw * f if half else 0
    if info.kind == "upsample":
        lo = (th // 2 + 2) * (tw // 2 + 2)
        hi = (th + 4) * (tw + 4)
        # The loaded tile stays referenced until the module returns: load + upsampled + conv output.
        return cin * lo * load + cin * hi * d + cout * hi * d + stats
    h = info.halo
    px = (th + 2 * h) * (tw + 2 * h)
    p1 = (th + 2) * (tw + 2)
    core_px = th * tw
    if info.kind in ("conv1", "out"):
        # conv1 of a channel-changing block also keeps shortcut(x) (core; a 3x3 conv_shortcut: the region).
        sc = 0 if info.shortcut_output is None else cout * px * d
        return max(gn(cin, px), cin * px * d + cout * px * d, cout * px * d + stats) + sc
    cres = info.residual_channels or cin
    shortcut_in = cres * core_px * load if info.kind == "conv2" else 0
    shortcut = shortcut_in + cout * core_px * d * 2  # shortcut output and the sum
    if info.kind == "conv2":
        return max(gn(cout, px), cout * px * d * 2, cout * px * d + shortcut + stats)
    # conv12: conv1 on the 2-px halo, then conv2 on its output.
    return max(
        gn(cin, px),
        cin * px * d + cout * px * d,
        gn(cout, px) - cout * px * load + cout * px * d,
        cout * px * d * 2,
        cout * px * d + cres * p1 * load + shortcut + stats,
    )


def estimate_exact_peak(
    model: Any,
    latent_shape: Sequence[int],
    tile: tuple[int, int],
    dtype_bytes: int,
    store_on_device: bool,
    recompute: bool = False,
    attention_scores: bool = True,
) -> dict[str, int]:
    """Analytic bytes of one exact decode: a conservative starting point (calibrate by measurement).

    Returns ``store`` (all stores at their peak), ``tile`` (one tile's working set, :func:`tile_bytes`;
    measured on CPU it is 0.9-1.6x of this), ``mid`` (the whole-latent mid block of one item: 8
    activations, plus the ``N x N`` attention scores twice when ``attention_scores``, i.e. when the
    attention kernel materialises them as the CPU math path does; flash / memory-efficient kernels do
    not), ``device`` (what the compute device needs on top of the model weights: the larger of tile and
    mid, plus the store when ``store_on_device``) and ``host`` (the store when it is not on the device).
    Convolution workspaces (cuDNN) are not included.
    """
    lay = kl_layout(model, recompute)
    plan = lay.geometry(latent_shape, tile)
    store = plan.store_peak_elements * dtype_bytes
    tile_b = max((tile_bytes(info, core, dtype_bytes, inputs_copied=not store_on_device)
                  for info, core in zip(plan.segments, plan.segment_cores, strict=True)), default=0)
    work_bytes = max(dtype_bytes, 4)
    mh, mw = lay.mid_hw(plan.latent_shape[2:])
    n = mh * mw
    mid = 8 * plan.mid_elements * work_bytes + (2 * n * n * work_bytes if attention_scores else 0)
    work = max(tile_b, mid)
    return {
        "store": store,
        "tile": tile_b,
        "mid": mid,
        "device": work + (store if store_on_device else 0),
        "host": 0 if store_on_device else store,
    }
