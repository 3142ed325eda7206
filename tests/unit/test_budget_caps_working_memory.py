"""Reports compare the measured peak with the budget; a user budget caps the decode's working memory.

* A decode whose measured peak exceeds the budget gets an ``over budget`` row right after ``measured``
  (naming what was measured: live tensors, process RSS or ``max_memory_allocated``) and a logged warning;
  one within its budget gets neither.
* ``Budget.describe()`` of a user budget says that it caps working memory (the VAE's weights are not in it).
"""

from __future__ import annotations

import logging

import pytest
import torch
from vramfit.memory.budget import compute_budget
from vramfit.memory.decode import image as idm
from vramfit.memory.report import OVER_BUDGET_ROW, Report, flag_measured_overrun

from tests.unit.test_image_decode import TinyVAE, _stores
from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 2**20


def _report() -> Report:
    return Report("Tiled VAE Decode", "cpu").add("predicted", "peak 200 MiB").add("measured", "peak x").add("time", "1 s")


@pytest.mark.parametrize("method", ["process RSS high-water mark", "live tensor bytes (PeakTracker dispatch)",
                                    "CUDA max_memory_allocated"])
def test_measured_over_budget_adds_a_row_and_warns(caplog, method) -> None:
    r = _report()
    with caplog.at_level(logging.WARNING, logger="vramfit.test"):
        assert flag_measured_overrun(r, int(379.9 * MiB), method, 256 * MiB, logging.getLogger("vramfit.test"))
    keys = [k for k, _ in r.rows]
    assert keys == ["predicted", "measured", OVER_BUDGET_ROW, "time"]
    row = dict(r.rows)[OVER_BUDGET_ROW]
    assert "379.9 MiB" in row and "256.0 MiB" in row and "123.9 MiB" in row and method in row, row
    assert "over budget" in caplog.text and method in caplog.text
    assert Report.parse(r.text()).rows == r.rows


def test_measured_within_budget_adds_nothing(caplog) -> None:
    for measured in (None, 0, 256 * MiB):
        r = _report()
        with caplog.at_level(logging.WARNING):
            assert not flag_measured_overrun(r, measured, "process RSS high-water mark", 256 * MiB)
        assert [k for k, _ in r.rows] == ["predicted", "measured", "time"]
    assert caplog.text == ""


def _decode(**kw) -> idm.DecodeResult:
    vae = TinyVAE(_model(ch_mult=(1, 1, 1, 1)), ratio=8)
    full, exact = _stores()
    job = idm.make_job(vae, _latent((1, 4, 24, 24)), core=True, out_device="cpu", tile_size=kw.pop("tile_size", 0))
    env = idm.DecodeEnv(cost_models=full, exact_cost_models=exact, measure_cpu_tensors=True)
    return idm.decode_image(job, env, **kw)


@pytest.mark.slow
def test_a_decode_over_its_budget_is_flagged_one_within_is_not() -> None:
    """A user tile larger than the budget allows runs over it (tracked live tensors); the auto plan does not."""
    with torch.no_grad():
        free = _decode(tile_size=16, budget_mb=1024)
        budget_mb = free.plan.planned / 2 / MiB
        over = _decode(tile_size=16, budget_mb=budget_mb)
        within = _decode(budget_mb=1024)
    assert over.plan.over_budget and over.measured_peak > over.budget.available
    assert OVER_BUDGET_ROW in dict(over.report.rows)  # the engine's own report flags it
    assert flag_measured_overrun(over.report, over.measured_peak, over.measure_method, over.budget.available)
    assert "live tensor bytes" in dict(over.report.rows)[OVER_BUDGET_ROW]
    assert within.measured_peak <= within.budget.available
    assert not flag_measured_overrun(within.report, within.measured_peak, within.measure_method,
                                     within.budget.available)
    assert OVER_BUDGET_ROW not in dict(within.report.rows)


def test_user_budget_describes_working_memory() -> None:
    b = compute_budget("cpu", lambda d: 40 * 2**30, user_budget_mb=256)
    assert b.available == 256 * MiB
    text = b.describe()
    assert "user budget 256 MiB" in text and "working memory" in text and "weights" in text, text
