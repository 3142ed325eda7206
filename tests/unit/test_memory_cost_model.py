"""Cost model: NNLS, max-of-phases fit, calibration with a real tracker, storage and shipped defaults."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vramfit.memory.cost.phases import (
    CostModel,
    CostModelStore,
    FitPoint,
    ModelKey,
    Phase,
    calibrate,
    default_models,
    fit_model,
    fit_phases,
    nnls,
)
from vramfit.memory.geometry import Geometry
from vramfit.memory.measure.tracker import tracker_factory
from vramfit.memory.vae.families import FAMILIES

KEY = ModelKey("toy", "full", "float32", "cpu")


def test_nnls_recovers_exact_nonnegative_solution() -> None:
    rows = [[1, 10, 3], [1, 20, 1], [1, 30, 7], [1, 45, 2]]
    true = [100.0, 7.0, 0.0]
    y = [sum(a * b for a, b in zip(r, true, strict=True)) for r in rows]
    got = nnls(rows, y)
    assert got == pytest.approx(true, abs=1e-6)


def test_nnls_clamps_negative_directions() -> None:
    # unconstrained LS wants a negative slope; NNLS must keep it at 0 and fit the mean
    rows = [[1, 1], [1, 2], [1, 3]]
    y = [3.0, 2.0, 1.0]
    c, s = nnls(rows, y)
    assert s == 0.0 and c == pytest.approx(2.0)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0, 1e4), min_size=3, max_size=3),
    st.lists(st.tuples(st.integers(1, 64), st.integers(1, 64)), min_size=4, max_size=8, unique=True),
)
def test_nnls_never_negative_and_exact_when_consistent(coefs, sizes) -> None:
    feats = ("const", "px", "latent")
    points = [FitPoint(Geometry(h, w), 0) for h, w in sizes]
    rows = [p.geometry.features(feats) for p in points]
    y = [sum(c * v for c, v in zip(coefs, r, strict=True)) for r in rows]
    got = nnls(rows, y)
    assert all(c >= 0 for c in got)
    pred = [sum(c * v for c, v in zip(got, r, strict=True)) for r in rows]
    for p, t in zip(pred, y, strict=True):
        assert p == pytest.approx(t, rel=1e-6, abs=1e-3)


def _points(fn, geoms) -> list[FitPoint]:
    return [FitPoint(g, int(fn(g))) for g in geoms]


def test_two_phase_fit_recovers_a_max_model() -> None:
    # the measured KL structure: up path 2560 B/px, mid attention 192.5 B/px + 8 B/token^2
    def truth(g: Geometry) -> float:
        return max(
            2560 * g.features(["px"])[0], 192.5 * g.features(["px"])[0] + 8 * g.features(["tokens_sq"])[0]
        )

    geoms = [Geometry(s, s) for s in (8, 16, 32, 64, 128, 160, 192)] + [Geometry(128, 192)]
    phases = fit_phases(_points(truth, geoms), (("const", "px"), ("const", "px", "tokens_sq")))
    model = CostModel(KEY, phases)
    for s in (24, 100, 176, 240):  # held out, on both sides of the crossover
        g = Geometry(s, s)
        assert model.predict(g) == pytest.approx(truth(g), rel=1e-6)


def test_single_linear_phase_cannot_follow_a_max_but_margin_covers_fit_points() -> None:
    def truth(g: Geometry) -> float:
        return max(1000 * g.features(["px"])[0], 4 * g.features(["tokens_sq"])[0])

    geoms = [Geometry(s, s) for s in (8, 64, 128, 192, 256)]
    pts = _points(truth, geoms)
    model = fit_model(KEY, pts, (("const", "px"),))
    assert model.margin > 0
    assert all(model.predict(p.geometry) >= p.measured for p in pts)


def test_calibrate_with_real_allocations_and_tracker() -> None:
    # a "decoder" whose peak is exactly known: 3 float32 activations per output pixel + 1 KiB
    def run(g: Geometry) -> None:
        px = g.batch * g.out_h * g.out_w
        keep = torch.empty(256)  # 1 KiB
        a = torch.empty(px)
        b = torch.empty(px)
        c = a + b  # 3 px-sized buffers alive together
        del a, b, c, keep

    geoms = [Geometry(4, 4), Geometry(8, 8), Geometry(8, 16, batch=2)]
    model = calibrate(run, geoms, tracker_factory("cpu"), key=KEY, phases=(("const", "px"),))
    assert [p.measured for p in model.points] == [1024 + 12 * g.batch * g.out_h * g.out_w for g in geoms]
    assert model.phases[0].coefs == pytest.approx((1024.0, 12.0), rel=1e-9)
    held_out = Geometry(32, 24, batch=3)
    with tracker_factory("cpu")() as t:
        run(held_out)
    assert model.predict(held_out) == pytest.approx(t.peak_bytes, abs=2)  # ceil of a float fit
    assert "toy/full/float32/cpu" in model.describe() and "3 fit points" in model.describe()


def test_predict_is_monotone_in_pass_size() -> None:
    model = CostModel(
        KEY,
        (
            Phase(("const", "px", "px_step", "px_frames"), (1e6, 1e3, 2e3, 10.0)),
            Phase(("tokens_sq",), (8.0,)),
        ),
        margin=0.05,
        overhead=0.5,
    )
    base = Geometry(10, 10, 1, 3, spatial_ratio=8, temporal_ratio=4)
    p0 = model.predict(base)
    assert p0 == math.ceil(math.ceil(model.phases[0].predict(base) * 1.05) * 1.5)
    for bigger in (
        Geometry(11, 10, 1, 3, spatial_ratio=8, temporal_ratio=4),
        Geometry(10, 10, 2, 3, spatial_ratio=8, temporal_ratio=4),
        Geometry(10, 10, 1, 4, spatial_ratio=8, temporal_ratio=4),
    ):
        assert model.predict(bigger) > p0
    assert model.predict_tracked(base) < p0


def test_json_roundtrip_and_store_cache(tmp_path) -> None:
    model = fit_model(
        KEY,
        [FitPoint(Geometry(8, 8), 1000), FitPoint(Geometry(16, 16), 3000)],
        (("const", "px"),),
        source="unit",
        inputs={"seed": 0},
    )
    again = CostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model and again.inputs == {"seed": 0}

    cache = tmp_path / "sub" / "costs.json"
    store = CostModelStore(cache, defaults_dir=None)
    calls = []

    def fit() -> CostModel:
        calls.append(1)
        return model

    assert store.get(KEY) is None
    assert store.get_or_calibrate(KEY, fit) == model
    assert store.get_or_calibrate(KEY, fit) == model
    assert len(calls) == 1  # calibrated once
    assert cache.is_file()
    # a new store (a new ComfyUI session) reads the cache instead of calibrating again
    store2 = CostModelStore(cache, defaults_dir=None)
    assert store2.get_or_calibrate(KEY, fit) == model and len(calls) == 1
    # in-memory store: nothing written
    mem = CostModelStore(None, defaults_dir=None)
    mem.put(model)
    assert mem.get(KEY) == model


def test_broken_cache_is_ignored(tmp_path) -> None:
    cache = tmp_path / "costs.json"
    cache.write_text('{"schema": 99, "models": []}')
    store = CostModelStore(cache, defaults_dir=None)
    assert store.get(KEY) is None


def test_phase_validation() -> None:
    with pytest.raises(ValueError):
        Phase(("nope",), (1.0,))
    with pytest.raises(ValueError):
        Phase(("px",), (-1.0,))
    with pytest.raises(ValueError):
        fit_phases([], (("px",),))


def test_shipped_defaults_cover_known_families() -> None:
    models = default_models()
    for family, fam in FAMILIES.items():
        keys = [k for k in models if (k.family, k.executor, k.dtype, k.device_type) == (family, "full", "float32",
                                                                                     "cpu")]
        if fam.host_keyed:  # one model per measured host behaviour (ComfyUI 0.3.75 and 0.33), none unkeyed
            assert len({k.variant for k in keys}) >= 2 and all(k.variant for k in keys), keys
        else:
            assert keys == [ModelKey(family, "full", "float32", "cpu")], f"no shipped cost model for {family}"
        for key in keys:
            _check_shipped(models[key])
    store = CostModelStore(None)
    assert store.is_default(ModelKey("kl", "full", "float32", "cpu"))


def _check_shipped(m: CostModel) -> None:
    key = m.key
    assert len(m.points) >= 5, "defaults must record the calibration points they were fitted on"
    assert m.inputs, "defaults must record their calibration inputs"
    # fit quality on its own points (meta sizing is exact; the model is a few % off at worst)
    assert max(abs(e[3]) for e in m.errors()) < 0.15
    # the real decodes the defaults were checked against (held out) are within 15 %
    assert m.validation, f"{key}: no real-decode validation recorded"
    for g, measured, predicted, err in m.errors(validation=True):
        assert abs(err) <= 0.15, f"{key} {g.describe()}: predicted {predicted} vs measured {measured}"


def test_model_key_variant_in_text_and_json() -> None:
    k = ModelKey.make("wan21", "full", torch.float32, "cpu", "per_call-3406k")
    assert str(k) == "wan21/full/float32/cpu/per_call-3406k" and k.slug() == "wan21.full.float32.cpu.per_call-3406k"
    assert ModelKey("kl", "full", "float32", "cpu").slug() == "kl.full.float32.cpu"
    m = CostModel(k, (Phase(("px",), (1.0,)),))
    assert CostModel.from_dict(json.loads(json.dumps(m.to_dict()))).key == k
    old = m.to_dict()
    del old["key"]["variant"]  # files written before variants existed
    assert CostModel.from_dict(old).key == ModelKey("wan21", "full", "float32", "cpu")
