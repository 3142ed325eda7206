"""``memory/cost/exact.py`` (the exact executor's cost model, decomposed meta sizing) and ``memory/plan/exact.py``
(the plan choice).

On the tiny pure-torch KL decoder of ``test_tiled_exact.py`` (no ComfyUI). Thresholds: predictions
within 2 % of the tensor-level peak of the executor itself (meta-sized and real; measured < 1 %);
the chooser's decisions are checked against a synthetic predictor whose answers are known.
"""

from __future__ import annotations

import json

import pytest
import torch
from vramfit.memory.cost import exact as dp
from vramfit.memory.executors import kl_exact as te
from vramfit.memory.measure.sizing import MetaSizer
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.plan import exact as pe
from vramfit.memory.plan.grid import ImpossibleBudgetError
from vramfit.memory.vae import kl_layout as kll

from tests.unit.test_tiled_exact import _latent, _model

TOL = 0.02


@pytest.fixture(scope="module")
def kl():
    return _model(ch=8, ch_mult=(1, 2, 4), num_res_blocks=1)


@pytest.fixture(scope="module")
def calibrated(kl):
    return {rec: dp.calibrate_exact(kl, 4, torch.float32, "cpu", recompute=rec) for rec in (False, True)}


def _meta_peak(model, latent, tile, recompute=False) -> int:
    with MetaSizer([model], torch.float32) as s:
        z = torch.empty(latent)
        out = te.decode_exact(model, z, tile, recompute=recompute)
        del out, z
    return s.peak_bytes


@pytest.mark.parametrize("recompute", [pytest.param(False, marks=pytest.mark.slow), True])
def test_calibrated_model_predicts_the_executor(kl, calibrated, recompute):
    model = calibrated[recompute]
    assert model.recompute is recompute and model.margin >= dp.MIN_MARGIN
    assert len(model.segments) == len(kll.exact_geometry(kl, (1, 4, 8, 8), (8, 8), recompute).segments)
    for latent, tile in [((1, 4, 16, 16), 16), ((1, 4, 23, 17), 24), ((1, 4, 40, 28), 32), ((1, 4, 12, 30), None)]:
        mid = dp.measure_mid_peak(kl, latent[2:], 4, torch.float32, "cpu")
        pred = model.predict(kl, latent[2:], tile, mid).tracked
        real = _meta_peak(kl, latent, tile, recompute)
        assert abs(pred - real) / real <= TOL, (latent, tile, pred, real)


def test_prediction_holds_for_a_real_tracked_run(kl, calibrated):
    """Meta sizing counts what a real decode counts (here within 0.5 %: the tiny decoder's SDPA picks
    another CPU kernel on fake tensors), so the predictions hold for real runs."""
    z = _latent((1, 4, 21, 19), seed=2)
    with torch.no_grad(), PeakTracker("cpu") as t:
        out = te.decode_exact(kl, z, 24)
        del out
    assert abs(_meta_peak(kl, (1, 4, 21, 19), 24) - t.peak_bytes) / t.peak_bytes <= 0.01
    model = calibrated[False]
    pred = model.predict(kl, (21, 19), 24, dp.measure_mid_peak(kl, (21, 19), 4, torch.float32, "cpu"))
    assert abs(pred.tracked - t.peak_bytes) / t.peak_bytes <= TOL


def test_cost_model_json_roundtrip_and_store(tmp_path, calibrated):
    model = calibrated[False]
    assert dp.ExactCostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    path = tmp_path / "exact.json"
    store = dp.ExactCostStore(path, defaults_dir=None)
    calls = []
    got = store.get_or_calibrate(model.key, lambda: calls.append(1) or model)
    assert got == model and calls == [1]
    again = dp.ExactCostStore(path, defaults_dir=None).get_or_calibrate(model.key, lambda: calls.append(2) or model)
    assert again == model and calls == [1]  # read back from the file, not recalibrated
    path.write_text("{not json")
    assert dp.ExactCostStore(path, defaults_dir=None).get(model.key) is None  # a broken cache is ignored
    shipped = tmp_path / "defaults"
    dp.write_exact_models(shipped / "tiny.json", [model])
    assert dp.ExactCostStore(None, defaults_dir=shipped).get(model.key) == model  # shipped defaults are used


def test_key_tracks_structure_dtype_and_configuration(kl):
    other = _model(ch=8, ch_mult=(1, 2), num_res_blocks=1)
    keys = {
        dp.exact_key(kl, torch.float32, "cpu", False, True),
        dp.exact_key(kl, torch.bfloat16, "cpu", False, True),
        dp.exact_key(kl, torch.float32, "cpu", True, True),
        dp.exact_key(kl, torch.float32, "cpu", False, False),
        dp.exact_key(other, torch.float32, "cpu", False, True),
    }
    assert len(keys) == 5


# ------------------------------------------------------------------------------- choose_exact


def _synthetic(store_px: float = 100.0, n: int = 256 * 256, mid: int = 1000):
    """Store ``store_px`` B/px (x0.75 with recompute, 0 on the host), tile working set 10 B per tile px."""

    def predict(recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
        store = int(store_px * n * (0.75 if recompute else 1.0)) if on_device else 0
        work = 10 * min(tile, 256) ** 2
        total = max(store + work, mid)
        return dp.ExactPeak(total, store, work, "seg", mid, (256 // min(tile, 256)) ** 2)

    return predict


def test_choose_largest_fitting_tile_first():
    predict = _synthetic()
    store = 100 * 256 * 256
    c = pe.choose_exact(predict, 256, store + 10 * 256**2)
    assert c.whole and c.tile == 256 and not c.recompute and c.fits
    c = pe.choose_exact(predict, 256, store + 10 * 192**2 + 5)
    assert c.tile == 192 and not c.recompute and c.planned <= store + 10 * 192**2 + 5


def test_recompute_when_it_buys_a_much_larger_tile():
    predict = _synthetic()
    store = 100 * 256 * 256
    budget = store + 10 * 24**2  # without recompute only 24-px tiles fit; with it the whole image
    c = pe.choose_exact(predict, 256, budget)
    assert c.recompute and c.whole
    assert c.score < pe.choose_exact(predict, 256, budget, tile=24).score


def test_host_store_only_where_allowed_and_needed():
    predict = _synthetic()
    budget = 10 * 128**2 + 1  # no device store fits at all
    with pytest.raises(ImpossibleBudgetError):
        pe.choose_exact(predict, 256, budget)
    c = pe.choose_exact(predict, 256, budget, host_store=True)
    assert not c.store_on_device and c.tile == 128


def test_host_store_left_out_where_the_hosts_ram_cannot_hold_it():
    """``host_fits`` refuses the store in host memory: the choice is the device store's (or none), never the host's;
    the user's tile alike."""
    predict = _synthetic()
    budget = 10 * 128**2 + 1  # no device store fits at all
    asked: list[tuple[bool, int]] = []

    def never(rec: bool, tile: int) -> bool:
        asked.append((rec, tile))
        return False

    with pytest.raises(ImpossibleBudgetError):
        pe.choose_exact(predict, 256, budget, host_store=True, host_fits=never)
    assert asked  # asked, refused
    c = pe.choose_exact(predict, 256, budget, host_store=True, host_fits=lambda rec, t: t <= 128)
    assert not c.store_on_device and c.tile == 128
    forced = pe.choose_exact(predict, 256, budget, host_store=True, host_fits=never, tile=64)
    assert forced.store_on_device and not forced.fits
    assert not pe.choose_exact(predict, 256, budget, host_store=True, tile=64).store_on_device


def test_impossible_budget_states_a_minimum_that_works():
    predict = _synthetic()
    with pytest.raises(ImpossibleBudgetError) as err:
        pe.choose_exact(predict, 256, 1000)
    minimum = err.value.minimum
    assert "too small" in str(err.value) and str(minimum) in str(err.value)
    c = pe.choose_exact(predict, 256, minimum)
    assert c.fits and c.planned == minimum
    with pytest.raises(ImpossibleBudgetError):
        pe.choose_exact(predict, 256, minimum - 1)


def test_overhead_and_extras_count_against_the_budget():
    predict = _synthetic()
    store = 100 * 256 * 256
    c = pe.choose_exact(predict, 256, store + 2 * 10 * 256**2 + 500, overhead=1.0, extra_bytes=500)
    assert c.whole and c.planned == store + 2 * 10 * 256**2 + 500 and c.tracked == store + 10 * 256**2 + 500
    c = pe.choose_exact(predict, 256, store + 2 * 10 * 256**2 + 499, overhead=1.0, extra_bytes=500)
    assert not c.whole or c.recompute


def test_user_tile_is_kept_even_over_budget():
    predict = _synthetic()
    c = pe.choose_exact(predict, 256, 1000, tile=64)
    assert c.tile == 64 and not c.fits
    c = pe.choose_exact(predict, 256, 10**9, tile=64)
    assert c.tile == 64 and c.fits and not c.recompute


def test_no_whole_image_plan_after_an_untiled_oom():
    c = pe.choose_exact(_synthetic(), 256, 10**9, allow_whole=False)
    assert c.tile < 256 and not c.whole
