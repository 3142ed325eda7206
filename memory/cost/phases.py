"""Measured cost model: peak bytes of a decode pass as a function of its geometry.

A :class:`CostModel` is keyed by ``(family, executor, dtype, device type)`` and predicts the peak
bytes a pass allocates on the decode device *above what was allocated before it* (the VAE weights
are not part of it: :mod:`.budget` accounts for them).

The model is a maximum over one or more *phases*, each a non-negative linear combination of
geometry features (:data:`.geometry.FEATURES`)::

    tracked(g) = (1 + margin) * max_p  sum_i c[p,i] * feature[p,i](g)
    peak(g)    = (1 + overhead) * tracked(g)

``tracked`` is what the key's tracker measures (CPU: live tensor bytes; CUDA: allocator peak);
``margin`` only lifts the fit so no calibration point is under-predicted. ``overhead`` is a
separately measured factor for memory the tracker cannot see (on CPU: oneDNN scratch/re-layouts
and allocator growth, measured with the ``rss`` tracker); it is 0 unless a measurement set it.

One phase is a plain linear model. Several phases describe decoders whose peak moves between stages
as the size grows (measured: the KL decoder's peak is in its full-resolution up path up to ~1.1
Mpx, then in the mid-block attention, which is quadratic in latent tokens on CPU). Every
coefficient is >= 0 and every feature grows with the pass size, so predictions grow monotonically
with batch, tile and chunk size; the planner relies on that.

:func:`calibrate` fits a model by running the real decoder (or a ``meta`` stand-in) on a few
geometries under a :class:`.tracker.PeakTracker`; the measured points are stored in the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import pathlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..geometry import FEATURES, Geometry
from ..measure.tracker import PeakMeter
from ..store import Store

log = logging.getLogger("vramfit.memory.cost.phases")

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
SCHEMA = 1


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.float16`` -> ``"float16"`` (stable JSON key)."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True, order=True)
class ModelKey:
    """What a cost model is valid for. ``family`` is a known family name (``kl``, ``wan21``, ...) or,
    for an unknown VAE, the class name of its ``first_stage_model``. ``variant``: the host decoder's
    measured behaviour, for families whose memory depends on it (:func:`.calibration.host_variant`);
    "" otherwise."""

    family: str
    executor: str
    dtype: str
    device_type: str
    variant: str = ""

    @classmethod
    def make(
        cls, family: str, executor: str, dtype: torch.dtype | str, device: torch.device | str, variant: str = ""
    ) -> ModelKey:
        dev = device.type if isinstance(device, torch.device) else torch.device(device).type
        return cls(family, executor, dtype_name(dtype), dev, variant)

    def slug(self) -> str:
        tail = f".{self.variant}" if self.variant else ""
        return f"{self.family}.{self.executor}.{self.dtype}.{self.device_type}{tail}"

    def __str__(self) -> str:
        tail = f"/{self.variant}" if self.variant else ""
        return f"{self.family}/{self.executor}/{self.dtype}/{self.device_type}{tail}"


@dataclasses.dataclass(frozen=True)
class Phase:
    features: tuple[str, ...]
    coefs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.features) != len(self.coefs):
            raise ValueError("Phase: features and coefs differ in length")
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise ValueError(f"Phase: unknown features {unknown}; known: {sorted(FEATURES)}")
        if any(c < 0 or not math.isfinite(c) for c in self.coefs):
            raise ValueError(f"Phase: coefficients must be finite and >= 0, got {self.coefs}")

    def predict(self, g: Geometry) -> float:
        return sum(c * v for c, v in zip(self.coefs, g.features(self.features), strict=True))

    def describe(self) -> str:
        return " + ".join(f"{c:.6g}*{f}" for f, c in zip(self.features, self.coefs, strict=True) if c)


@dataclasses.dataclass(frozen=True)
class FitPoint:
    geometry: Geometry
    measured: int
    seconds: float = dataclasses.field(default=0.0, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "geometry": self.geometry.to_dict(),
            "measured": self.measured,
            "seconds": round(self.seconds, 3),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FitPoint:
        return cls(Geometry.from_dict(d["geometry"]), int(d["measured"]), float(d.get("seconds", 0.0)))


@dataclasses.dataclass(frozen=True)
class CostModel:
    key: ModelKey
    phases: tuple[Phase, ...]
    margin: float = 0.0
    points: tuple[FitPoint, ...] = ()
    source: str = ""
    notes: str = ""
    overhead: float = 0.0
    validation: tuple[FitPoint, ...] = ()
    """Measurements *not* used for fitting (e.g. real decodes checking a meta-sized fit)."""
    inputs: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False, compare=False)
    """How the calibration was made (model file, seed, tracker, torch/ComfyUI versions, ...)."""

    def predict_tracked(self, g: Geometry) -> int:
        """Predicted peak of pass ``g`` as the calibration tracker measures it (fit + margin)."""
        raw = max(p.predict(g) for p in self.phases)
        return int(math.ceil(raw * (1.0 + self.margin)))

    def predict(self, g: Geometry) -> int:
        """Predicted peak bytes of pass ``g``: tracked peak x (1 + overhead). The planner uses this."""
        return int(math.ceil(self.predict_tracked(g) * (1.0 + self.overhead)))

    def __call__(self, g: Geometry) -> int:
        return self.predict(g)

    def errors(self, validation: bool = False) -> list[tuple[Geometry, int, int, float]]:
        """``(geometry, measured, predicted tracked peak, relative error)`` of every fit point (or
        every validation point)."""
        out = []
        for p in self.validation if validation else self.points:
            pred = self.predict_tracked(p.geometry)
            out.append((p.geometry, p.measured, pred, (pred - p.measured) / max(1, p.measured)))
        return out

    def describe(self) -> str:
        body = " | ".join(
            f"max[{p.describe()}]" if len(self.phases) > 1 else p.describe() for p in self.phases
        )
        text = f"cost model {self.key}: peak = {body} bytes"
        if self.margin:
            text += f" x {1 + self.margin:.3f}"
        if self.overhead:
            text += f", x {1 + self.overhead:.2f} untracked overhead"
        if self.points:
            worst = max(abs(e[3]) for e in self.errors())
            text += f" ({len(self.points)} fit points, worst fit error {worst:.1%}"
            if self.validation:
                worst_v = max(abs(e[3]) for e in self.errors(validation=True))
                text += f"; {len(self.validation)} held-out checks, worst {worst_v:.1%}"
            text += f"; {self.source})" if self.source else ")"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "key": dataclasses.asdict(self.key),
            "phases": [{"features": list(p.features), "coefs": list(p.coefs)} for p in self.phases],
            "margin": self.margin,
            "overhead": self.overhead,
            "source": self.source,
            "notes": self.notes,
            "points": [p.to_dict() for p in self.points],
            "validation": [p.to_dict() for p in self.validation],
            "inputs": dict(self.inputs),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CostModel:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"cost model schema {d.get('schema')!r} is not {SCHEMA}")
        key = ModelKey(**d["key"])
        if not all(isinstance(v, str) for v in dataclasses.astuple(key)):
            raise TypeError(f"cost model key fields must be strings: {d['key']!r}")
        return cls(
            key=key,
            phases=tuple(
                Phase(tuple(p["features"]), tuple(float(c) for c in p["coefs"])) for p in d["phases"]
            ),
            margin=float(d.get("margin", 0.0)),
            overhead=float(d.get("overhead", 0.0)),
            validation=tuple(FitPoint.from_dict(p) for p in d.get("validation", ())),
            inputs=dict(d.get("inputs", {})),
            points=tuple(FitPoint.from_dict(p) for p in d.get("points", ())),
            source=str(d.get("source", "")),
            notes=str(d.get("notes", "")),
        )


# --------------------------------------------------------------------------- fitting


def nnls(
    rows: Sequence[Sequence[float]], targets: Sequence[float], weights: Sequence[float] | None = None
) -> list[float]:
    """Weighted least squares with non-negative coefficients (exact, by enumerating supports).

    Exact for the handful of features used here: the NNLS optimum is the unconstrained least-squares
    solution on its support, so the best non-negative subset solution is the NNLS solution.
    """
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    n, k = a.shape
    if k > 10:
        raise ValueError("nnls: at most 10 features")
    w = torch.ones(n, dtype=torch.float64) if weights is None else torch.tensor(weights, dtype=torch.float64)
    sw = w.sqrt()
    scale = a.abs().amax(dim=0).clamp_min(1e-300)
    aw = (a / scale) * sw[:, None]
    yw = y * sw
    best: tuple[float, torch.Tensor] | None = None
    for size in range(1, k + 1):
        for support in itertools.combinations(range(k), size):
            cols = list(support)
            sub = aw[:, cols]
            sol = torch.linalg.lstsq(sub, yw[:, None], driver="gelsd").solution[:, 0]
            if bool((sol < -1e-12).any()):
                continue
            coef = torch.zeros(k, dtype=torch.float64)
            coef[cols] = sol.clamp_min(0.0)
            resid = float(((aw @ coef - yw) ** 2).sum())
            if best is None or resid < best[0] * (1 - 1e-12):
                best = (resid, coef)
    if best is None:
        return [0.0] * k
    return [float(c) for c in (best[1] / scale)]


def fit_phases(
    points: Sequence[FitPoint], phases: Sequence[Sequence[str]], max_partitions: int = 1 << 14
) -> tuple[Phase, ...]:
    """Fit a max-of-phases model to measured points, minimising squared *relative* error.

    One phase: a weighted non-negative least squares. Several: every assignment of points to
    phases is tried (exhaustive, so deterministic and exact for the small point counts used), each
    phase fitted on its points, and the assignment whose max-model has the lowest error wins.
    """
    if not points:
        raise ValueError("fit_phases: no points")
    if not phases or any(not p for p in phases):
        raise ValueError("fit_phases: every phase needs at least one feature")
    targets = [float(p.measured) for p in points]
    weights = [1.0 / max(1.0, t) ** 2 for t in targets]

    def fit_one(features: Sequence[str], idx: Sequence[int]) -> Phase:
        if not idx:
            return Phase(tuple(features), tuple(0.0 for _ in features))
        rows = [points[i].geometry.features(features) for i in idx]
        coefs = nnls(rows, [targets[i] for i in idx], [weights[i] for i in idx])
        return Phase(tuple(features), tuple(coefs))

    def error(model: Sequence[Phase]) -> float:
        return sum(
            w * (max(ph.predict(p.geometry) for ph in model) - t) ** 2
            for p, t, w in zip(points, targets, weights, strict=True)
        )

    if len(phases) == 1:
        return (fit_one(phases[0], range(len(points))),)
    n_assign = len(phases) ** len(points)
    if n_assign > max_partitions:
        raise ValueError(
            f"fit_phases: {len(points)} points x {len(phases)} phases is too many assignments "
            f"({n_assign} > {max_partitions}); use fewer points or phases"
        )
    best: tuple[float, tuple[Phase, ...]] | None = None
    for assign in itertools.product(range(len(phases)), repeat=len(points)):
        model = tuple(
            fit_one(feats, [i for i, a in enumerate(assign) if a == j]) for j, feats in enumerate(phases)
        )
        err = error(model)
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, model)
    assert best is not None
    return best[1]


def fit_model(
    key: ModelKey,
    points: Sequence[FitPoint],
    phases: Sequence[Sequence[str]] = (("const", "px"),),
    *,
    cover_fit_points: bool = True,
    source: str = "",
    notes: str = "",
    inputs: Mapping[str, Any] | None = None,
) -> CostModel:
    """Fit a :class:`CostModel`; with ``cover_fit_points`` the margin is raised just enough that no
    fit point is under-predicted (the fit is a least-squares compromise otherwise)."""
    fitted = fit_phases(points, phases)
    margin = 0.0
    if cover_fit_points:
        for p in points:
            raw = max(ph.predict(p.geometry) for ph in fitted)
            if raw > 0 and p.measured > raw:
                margin = max(margin, p.measured / raw - 1.0)
    return CostModel(
        key=key,
        phases=fitted,
        margin=round(margin, 6),
        points=tuple(points),
        source=source,
        notes=notes,
        inputs=dict(inputs or {}),
    )


def calibrate(
    run: Callable[[Geometry], object],
    geometries: Iterable[Geometry],
    tracker_factory: Callable[[], PeakMeter],
    *,
    key: ModelKey,
    phases: Sequence[Sequence[str]] = (("const", "px"),),
    warmup: bool = False,
    source: str = "calibrated",
    notes: str = "",
    inputs: Mapping[str, Any] | None = None,
) -> CostModel:
    """Run ``run(g)`` for each geometry under a fresh tracker and fit a model to the peaks.

    ``run`` must build its input (e.g. a latent of ``g``'s shape) *inside* the call and drop its
    output, so the tracked peak is the pass itself. ``warmup`` runs the first geometry once, untracked,
    first (lazy allocations, cuDNN autotuning on a GPU).
    """
    geoms = list(geometries)
    if not geoms:
        raise ValueError("calibrate: no geometries")
    if warmup:
        run(geoms[0])
    points: list[FitPoint] = []
    for g in geoms:
        t0 = time.perf_counter()
        tracker = tracker_factory()
        with tracker:
            run(g)
        dt = time.perf_counter() - t0
        points.append(FitPoint(g, int(tracker.peak_bytes), dt))
        log.info(
            "calibrate %s: %s -> peak %.1f MiB (%.2fs)", key, g.describe(), tracker.peak_bytes / 2**20, dt
        )
    return fit_model(key, points, phases, source=source, notes=notes, inputs=inputs)


# --------------------------------------------------------------------------- storage


class CostModelStore(Store[CostModel]):
    """Cost models by :class:`ModelKey` (:class:`.store.Store`): calibrations learned on this machine (in
    memory, and in ``cache_path`` when given), then the shipped defaults (``memory/cost/data/*.json``)."""

    section = "models"
    schema = 2
    what = "cost-model"

    def __init__(self, cache_path: str | pathlib.Path | None = None, defaults_dir: pathlib.Path | None = DATA_DIR):
        super().__init__(cache_path, defaults_dir)

    def decode(self, value: Any) -> CostModel:
        return CostModel.from_dict(value)

    def encode(self, value: CostModel) -> dict[str, Any]:
        return value.to_dict()

    def models(self) -> list[CostModel]:
        return [m for m in (super(CostModelStore, self).get(k) for k in super().keys()) if m is not None]

    def get(self, key: ModelKey) -> CostModel | None:  # type: ignore[override]
        return super().get(str(key))

    def is_default(self, key: ModelKey) -> bool:  # type: ignore[override]
        return super().is_default(str(key))

    def put(self, model: CostModel) -> None:  # type: ignore[override]
        super().put(str(model.key), model)

    def get_or_calibrate(self, key: ModelKey, calibrate_fn: Callable[[], CostModel]) -> CostModel:
        """The stored model for ``key``, or calibrate once (``calibrate_fn``) and keep the result."""

        def make() -> CostModel:
            model = calibrate_fn()
            return model if model.key == key else dataclasses.replace(model, key=key)

        return super().get_or_make(str(key), make)


def default_models() -> dict[ModelKey, CostModel]:
    """The shipped defaults (``memory/cost/data/*.json``)."""
    return {m.key: m for m in CostModelStore(None).models()}
