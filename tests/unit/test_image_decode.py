"""Image-decode orchestration (``memory/decode/image.py``) without ComfyUI: path choice, OOM re-plans and
resume, cancel, progress, on a duck-typed VAE around the tiny pure-torch KL decoder of
``test_tiled_exact.py``.

Thresholds: the untiled path is the decoder itself (``torch.equal``); exact tiles vs untiled max abs
diff <= 1e-4 on [0, 1] (float32 noise, as in ``test_tiled_exact.py``); a resumed run vs an uninterrupted
one <= 1e-5, finished items ``torch.equal``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from vramfit.memory.cost import exact as dp
from vramfit.memory.cost.phases import CostModelStore
from vramfit.memory.decode import image as idm
from vramfit.memory.plan import exact as pe
from vramfit.memory.plan import image as pim
from vramfit.memory.plan.grid import ImpossibleBudgetError
from vramfit.memory.plan.types import Plan
from vramfit.memory.vae.kl_layout import kl_layout

from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 2**20


class TinyVAE:
    """The parts of ``comfy.sd.VAE`` the orchestration uses (no patcher: nothing to offload or load)."""

    def __init__(self, model: torch.nn.Module, ratio: int) -> None:
        self.first_stage_model = model
        self.vae_dtype = torch.float32
        self.device = torch.device("cpu")
        self.latent_channels = 4
        self.upscale_ratio = ratio

    def process_output(self, image: torch.Tensor) -> torch.Tensor:
        return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)


class FakeOOM(RuntimeError):
    pass


def _stores():
    """Fresh cost-model stores (an unknown VAE's untiled model is keyed by its model class, so each decoder
    structure needs its own)."""
    return CostModelStore(None, defaults_dir=None), dp.ExactCostStore(None, defaults_dir=None)


@pytest.fixture(scope="module")
def stores():
    """Cost models of ``vae``, calibrated (meta sizing) at first use, once for the module."""
    return _stores()


@pytest.fixture(scope="module")
def vae():
    """Three 2x upsamples at few channels: the full-resolution activations, not the mid block's
    attention, dominate the untiled decode, so exact tiles need less than it (as for SD's KL)."""
    return TinyVAE(_model(ch_mult=(1, 1, 1, 1)), ratio=8)


def env(stores, **kw) -> idm.DecodeEnv:
    full, exact = stores
    kw.setdefault("oom_exceptions", (FakeOOM,))
    return idm.DecodeEnv(cost_models=full, exact_cost_models=exact, **kw)


def decode(vae, z, stores, env_kw=None, **kw) -> idm.DecodeResult:
    job_kw = {k: kw.pop(k) for k in ("tile_size", "halo") if k in kw}
    job = idm.make_job(vae, z, core=True, out_device="cpu", **job_kw)
    return idm.decode_image(job, env(stores, **(env_kw or {})), **kw)


@pytest.fixture(scope="module")
def case(vae):
    z = _latent((2, 4, 7, 9), seed=1)  # 56 x 72 px
    with torch.no_grad():
        ref = vae.process_output(vae.first_stage_model.decode(z)).movedim(1, -1)
    return z, ref


@pytest.fixture(scope="module")
def clean(vae, case, stores):
    """Uninterrupted exact decode with 16-px tiles."""
    return decode(vae, case[0], stores, tile_size=16, budget_mb=1024)


# ------------------------------------------------------------------------------------------ path choice


def test_untiled_when_it_fits_is_the_decoder_itself(vae, case, stores):
    z, ref = case
    r = decode(vae, z, stores, budget_mb=1024)
    assert r.plan.path == "untiled" and r.plan.config.images_per_pass == 2
    assert torch.equal(r.images, ref)
    rows = dict(r.report.rows)
    assert rows["path"].startswith("exact: untiled") and "skipped" in rows["offload"]


def test_exact_tiles_under_a_budget_the_untiled_decode_exceeds(vae, case, stores, clean):
    z, ref = case
    untiled = decode(vae, z[:1], stores, budget_mb=1024).plan
    budget = int(untiled.planned * 0.8)
    r = decode(vae, z, stores, budget_mb=budget / MiB)
    assert r.plan.path == "exact" and r.plan.planned <= budget
    assert (r.images - ref).abs().max().item() <= 1e-4
    assert clean.plan.path == "exact" and clean.plan.config.tile == 16 and not clean.plan.config.whole
    assert (clean.images - ref).abs().max().item() <= 1e-4
    assert dict(clean.report.rows)["path"].startswith("exact: layer-synchronous")


def test_unsupported_decoder_takes_the_approximate_path():
    vae = TinyVAE(_model(up_attn=True), ratio=4)
    z = _latent((1, 4, 12, 10), seed=3)
    r = decode(vae, z, _stores(), tile_size=16, budget_mb=1024)
    assert r.plan.path == "generic" and r.plan.config.tiled
    assert r.plan.halo >= 1 and r.plan.feather == r.plan.halo // 2  # GroupNorm/attention: global ops
    rows = dict(r.report.rows)
    assert rows["path"].startswith("approximate") and "attention" in rows["path"] and "halo" in rows
    assert r.images.shape == (1, 48, 40, 3)


def test_impossible_budget_names_budget_and_minimum(vae, case, stores):
    with pytest.raises(ImpossibleBudgetError) as err:
        decode(vae, case[0], stores, budget_mb=0.01)
    assert "too small" in str(err.value) and "(budget: cpu: user budget" in str(err.value)
    assert err.value.minimum > 0.01 * MiB
    r = decode(vae, case[0][:1], stores, budget_mb=err.value.minimum / MiB)  # the minimum is per image
    assert r.plan.path == "exact" and r.plan.planned <= err.value.minimum


# ------------------------------------------------------------------------------------------ OOM re-plan


class StubPlanner(pim.ExactPlanner):
    """The image planner with stub predictions: ``fallback`` only asks for the peak of the configuration
    it moves to."""

    def __init__(self, job: pim.ImageJob) -> None:
        super().__init__(job, None, 0.0, 0)
        self.asked: list[tuple[bool, bool, int]] = []

    def predict(self, recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
        self.asked.append((recompute, on_device, tile))
        return dp.ExactPeak(1, 0, 1, "seg", 0, 1)


def _exact_plan(tile: int, recompute: bool, on_device: bool) -> Plan:
    pk = dp.ExactPeak(1, 0, 1, "seg", 0, 1)
    c = pe.ExactChoice(tile, recompute, on_device, pk, 10, 10, 1.0, True, False)
    return Plan("exact", c, c.describe(), 10, 10)


@pytest.mark.parametrize("device, order", [
    ("cuda", [(True, True, 64), (False, False, 64), (True, False, 64), (True, False, 32), (True, False, 16)]),
    ("cpu", [(True, True, 64), (True, True, 32), (True, True, 16), (True, True, 8), (True, True, 8)]),
])
def test_exact_fallback_order(vae, case, device, order):
    """recompute -> host store (accelerators only) -> host store + recompute -> half the tile, down to
    the executor's minimum tile."""
    job = idm.make_job(vae, case[0], core=True, out_device="cpu")
    job = dataclasses.replace(job, device=torch.device(device))  # planning only: nothing runs
    planner = StubPlanner(job)
    p = _exact_plan(64, False, True)
    seen = []
    for _ in order:
        p = pim.fallback(job, p, pim.ImageModels(None, planner), 10**9)
        c = p.config
        seen.append((c.recompute, c.store_on_device, c.tile))
    assert seen == order and planner.asked == order


def test_exact_fallback_skips_a_host_store_the_hosts_ram_cannot_hold(vae, case):
    """On an accelerator whose host RAM has no room for the store (:attr:`ImageJob.host_room`), the fallback goes
    from recomputation to half the tile on the device; the plan row says why."""

    class BigStore(StubPlanner):
        def predict(self, recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
            self.asked.append((recompute, on_device, tile))
            return dp.ExactPeak(1, 5 << 30, 1, "seg", 0, 1)

    job = idm.make_job(vae, case[0], core=True, out_device="cpu")
    job = dataclasses.replace(job, device=torch.device("cuda"), host_room=1 << 30)  # planning only
    planner = BigStore(job)
    p = _exact_plan(64, False, True)
    seen = []
    for _ in range(3):
        p = pim.fallback(job, p, pim.ImageModels(None, planner), 10**9)
        seen.append((p.config.recompute, p.config.store_on_device, p.config.tile))
    assert seen == [(True, True, 64), (True, True, 32), (True, True, 16)]
    assert "store in host memory not used: it needs 5.00 GiB, the host's RAM has room for 1.00 GiB" in p.description


def test_oom_in_the_untiled_pass_falls_back_to_tiles_smaller_than_the_image(vae, case, stores):
    z, ref = case
    passes: list[int] = []
    freed: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "pass":
            passes.append(k)
            if k == 0:
                raise FakeOOM("injected in the untiled pass")

    r = decode(vae, z, stores, {"fault_hook": fault, "on_oom": lambda: freed.append(1)}, budget_mb=1024)
    assert r.plan.path == "exact" and not r.plan.config.whole
    assert len(r.oom_events) == 1 and "FakeOOM in the untiled pass of item(s) 0..1" in r.oom_events[0]
    assert passes == [0, 1, 2] and freed == [1]  # the untiled pair failed; then one exact pass per item
    assert (r.images - ref).abs().max().item() <= 1e-4
    assert "oom" in dict(r.report.rows)


def test_oom_outside_a_tile_replans_and_keeps_finished_items(vae, case, stores, clean):
    """An OOM before item 1's pass (as in the mid block or a store allocation): re-planned with
    recomputation, item 1 retried; item 0 (finished) is kept as is."""
    z, _ = case
    passes: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "pass":
            passes.append(k)
            if k == 1:
                raise FakeOOM("injected before pass 1")

    r = decode(vae, z, stores, {"fault_hook": fault}, tile_size=16, budget_mb=1024)
    assert passes == [0, 1, 2]
    assert r.plan.config.recompute and not clean.plan.config.recompute and len(r.oom_events) == 1
    assert "exact pass of item(s) 1..1" in r.oom_events[0]
    assert torch.equal(r.images[0], clean.images[0])
    assert (r.images - clean.images).abs().max().item() <= 1e-5


def test_oom_inside_a_tile_shrinks_and_resumes(vae, case, stores, clean):
    z, _ = case
    tiles: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "tile":
            tiles.append(k)
            if k == 20 and tiles.count(20) == 1:
                raise FakeOOM("injected at tile 20")

    r = decode(vae, z, stores, {"fault_hook": fault}, tile_size=16, budget_mb=1024)
    assert 20 in tiles and r.oom_events == ["out of memory inside a tile: tile halved, decode resumed"]
    assert r.plan.config.tile == 16  # the plan is kept; the executor shrank its own tile
    assert (r.images - clean.images).abs().max().item() <= 1e-5


def test_replans_are_bounded(vae, case, stores):
    passes: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "pass":
            passes.append(k)
            raise FakeOOM("always")

    with pytest.raises(FakeOOM):
        decode(vae, case[0], stores, {"fault_hook": fault}, tile_size=16, budget_mb=1024)
    assert passes == list(range(idm.MAX_RETRIES + 1))


def test_cancel_is_never_taken_for_an_oom(vae, case, stores):
    """Even when every Exception counts as out of memory (ComfyUI's OOM_EXCEPTION off CUDA), a cancel
    propagates from inside the executor through the re-plan loop: no re-plan, no retry."""

    class Interrupted(Exception):
        pass

    calls = 0
    passes: list[int] = []

    def stop() -> None:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise Interrupted

    def fault(where: str, k: int) -> None:
        if where == "pass":
            passes.append(k)

    with pytest.raises(Interrupted):
        decode(vae, case[0], stores, {"should_stop": stop, "fault_hook": fault, "oom_exceptions": (Exception,)},
               tile_size=16, budget_mb=1024)
    assert calls == 5 and passes == [0]


def test_one_progress_bar_over_all_passes(vae, case, stores):
    z, _ = case
    totals: list[int] = []
    events: list[tuple[int, int]] = []

    def bar(total: int):
        totals.append(total)
        return lambda done, t: events.append((done, t))

    r = decode(vae, z, stores, {"progress_bar": bar}, tile_size=16, budget_mb=1024)
    assert r.plan.path == "exact"
    c = r.plan.config
    per_item = r.plan.units
    assert per_item == kl_layout(vae.first_stage_model, c.recompute).steps(z.shape[-2:], c.tile) > 1
    assert totals == [2 * per_item]
    assert events[0] == (0, 2 * per_item) and events[-1] == (2 * per_item, 2 * per_item)
    assert [d for d, _ in events] == sorted(d for d, _ in events)


def test_the_approximate_paths_bar_counts_the_planned_tiles():
    """The generic executor's steps are the plan's tiles (``Plan.units`` = ``Tiling.rows * cols``)."""
    vae = TinyVAE(_model(up_attn=True), ratio=4)
    totals: list[int] = []
    events: list[tuple[int, int]] = []

    def bar(total: int):
        totals.append(total)
        return lambda done, t: events.append((done, t))

    z = _latent((2, 4, 12, 10), seed=3)
    r = decode(vae, z, _stores(), {"progress_bar": bar}, tile_size=16, budget_mb=1024)
    tiling = r.plan.config
    assert r.plan.path == "generic" and r.plan.units == tiling.rows * tiling.cols > 1
    assert totals == [2 * r.plan.units] and events[-1] == (2 * r.plan.units, 2 * r.plan.units)
    done = [d for d, _ in events]
    assert done == sorted(done) and sorted(set(done)) == list(range(2 * r.plan.units + 1))


def test_a_decode_identifies_the_vae_once(vae, case, stores, monkeypatch):
    """The job's family is identified once and handed on: the cost-model lookup does not identify again."""
    from vramfit.memory.cost import calibration
    from vramfit.memory.vae import families

    calls: list[object] = []
    real = families.identify

    def counting(v):
        calls.append(v)
        return real(v)

    for mod in (families, calibration, pim):
        monkeypatch.setattr(mod, "identify", counting)
    r = decode(vae, case[0], stores, tile_size=16, budget_mb=1024)
    assert r.plan.path == "exact"
    assert len(calls) == 1
