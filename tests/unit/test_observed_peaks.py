"""Measured over predicted peaks learned per path (``memory/cost/observed.py``) and the plans scaled by them.

The first GPU suite measured ComfyUI's untiled KL decode at 1.70x its tensor-level prediction on an H200
(cuDNN workspaces no tensor count sees). A decode measured over its prediction keeps the ratio; the next plan
of that path plans against ``budget / ratio``: a budget the unscaled prediction fits takes tiles instead.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from vramfit.memory.cost import observed
from vramfit.memory.cost.observed import MAX_RATIO, ObservedStore, observed_key
from vramfit.memory.decode import flow
from vramfit.memory.decode import image as idm
from vramfit.memory.decode.env import Measured
from vramfit.memory.plan.grid import ImpossibleBudgetError

from tests.unit.test_image_decode import MiB, TinyVAE, _latent, _model, _stores, decode

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_ratio_is_kept_only_from_comparable_measures_and_only_grows(tmp_path):
    path = tmp_path / "observed_peaks.json"
    s = ObservedStore(path)
    key = observed_key("untiled", "kl", torch.bfloat16, "cpu")
    assert key == "untiled/kl/bfloat16/cpu" and s.ratio(key) == 1.0
    assert s.note(key, 170 * MiB, 100 * MiB, "rss") is None  # the process RSS is not a tensor count
    assert s.note(key, 17 * MiB, 1 * MiB, "cuda") is None  # too small to teach anything
    assert s.note(key, 101 * MiB, 100 * MiB, "cuda") is None  # noise
    assert s.note(key, 170 * MiB, 100 * MiB, "cuda") == pytest.approx(1.7)
    assert s.note(key, 150 * MiB, 100 * MiB, "cuda") is None  # a smaller ratio does not replace a larger one
    assert s.note(key, 900 * MiB, 100 * MiB, "dispatch") == MAX_RATIO
    assert ObservedStore(path).ratio(key) == MAX_RATIO  # persisted
    assert ObservedStore(path).ratio(observed_key("exact", "kl", torch.bfloat16, "cuda")) == 1.0


def test_a_cuda_path_plans_with_the_measured_prior_until_it_learns_more(tmp_path):
    """Before this machine measured a CUDA path, it plans with the largest ratio the GPU suites measured for it
    (untiled KL 1.70x, Wan chunks 1.35x): a first decode is not planned at 1.0 and then run over its budget."""
    s = ObservedStore(tmp_path / "observed_peaks.json")
    untiled = observed_key("untiled", "kl", torch.bfloat16, "cuda")
    wan = observed_key("wan", "wan21", torch.bfloat16, "cuda")
    assert s.ratio(untiled) == observed.CUDA_PRIORS["untiled"] == 1.70
    assert s.ratio(wan) == observed.CUDA_PRIORS["wan"] == 1.35
    assert s.ratio(observed_key("wan", "wan21", torch.bfloat16, "cpu")) == 1.0  # tensor counts: no prior
    assert s.ratio(observed_key("carry", "mochi", torch.bfloat16, "cuda")) == 1.0  # nothing measured yet
    assert s.note(wan, 127 * MiB, 100 * MiB, "cuda") is None  # below the prior: the prior stays
    assert s.note(wan, 150 * MiB, 100 * MiB, "cuda") == pytest.approx(1.5)
    assert s.ratio(wan) == pytest.approx(1.5)


@pytest.fixture(scope="module")
def vae():
    return TinyVAE(_model(ch_mult=(1, 1, 1, 1)), ratio=8)


def _with_ratio(job: idm.ImageJob, path: str, ratio: float) -> ObservedStore:
    s = ObservedStore(None)
    s.put(observed_key(path, job.subject.key_name, job.dtype, job.device), ratio)
    return s


def test_a_learned_ratio_makes_the_untiled_path_plan_for_it(vae):
    z = _latent((1, 4, 7, 9), seed=1)
    stores = _stores()
    raw = decode(vae, z, stores, budget_mb=1024).plan
    assert raw.path == "untiled" and raw.ratio == 1.0
    job = idm.make_job(vae, z, core=True, out_device="cpu")
    budget = int(raw.planned * 1.2)

    # 1.5x measured before: the untiled decode no longer fits 1.2x its raw prediction; exact tiles do
    r = decode(vae, z, stores, budget_mb=budget / MiB, env_kw={"observed": _with_ratio(job, "untiled", 1.5)})
    assert r.plan.path == "exact" and r.plan.planned <= budget

    # a larger budget: still untiled, its prediction scaled and the report saying why
    r = decode(
        vae, z, stores, budget_mb=2 * raw.planned / MiB, env_kw={"observed": _with_ratio(job, "untiled", 1.5)}
    )
    assert r.plan.path == "untiled" and r.plan.ratio == 1.5
    assert r.plan.planned == int(raw.planned * 1.5)
    assert "x1.50" in dict(r.report.rows)["predicted"]


def test_an_impossible_budget_is_told_in_the_users_bytes(vae):
    z = _latent((1, 4, 7, 9), seed=1)
    job = idm.make_job(vae, z, core=True, out_device="cpu", tile_size=0)
    with pytest.raises(ImpossibleBudgetError) as err:
        decode(vae, z, _stores(), budget_mb=0.05, env_kw={"observed": _with_ratio(job, "exact", 2.0)})
    assert "2.00x" in str(err.value) and err.value.budget == int(0.05 * MiB)


def test_a_decode_over_its_prediction_teaches_the_next_plan(vae, monkeypatch):
    z = _latent((1, 4, 7, 9), seed=1)
    job = idm.make_job(vae, z, core=True, out_device="cpu")

    @contextlib.contextmanager
    def over(env, device):  # an allocator that measured 1 GiB: far over any prediction of this decode
        m = Measured("CUDA max_memory_allocated", kind="cuda")
        yield m
        m.peak = 1 << 30

    monkeypatch.setattr(flow, "measured", over)
    monkeypatch.setattr(observed, "MIN_PREDICTED", 0)  # the tiny decode's prediction is a few MiB
    s = ObservedStore(None)
    r = decode(vae, z, _stores(), budget_mb=1024, env_kw={"observed": s})
    assert r.plan.path == "untiled"
    key = observed_key("untiled", job.subject.key_name, job.dtype, job.device)
    assert s.ratio(key) == pytest.approx(min(MAX_RATIO, (1 << 30) / r.plan.planned))
    assert s.ratio(observed_key("exact", job.subject.key_name, job.dtype, job.device)) == 1.0
