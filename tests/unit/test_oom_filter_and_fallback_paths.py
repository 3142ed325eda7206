"""Decode paths without ComfyUI: what counts as out of memory, the figures an exact re-plan reports, the
budget of the approximate video path, and how much the video path asks to offload.

* ComfyUI's ``OOM_EXCEPTION`` is ``Exception`` without CUDA: a bug (ValueError, RuntimeError) raised by the
  decoder must propagate at once on every path, while ``torch.OutOfMemoryError`` still re-plans.
* An exact re-plan after an out-of-memory error reports the planned/tracked bytes of the configuration it
  moved to (the one that ran), not those of the plan that failed.
* Non-Wan video: the chunk follows the budget (meta-sized peaks; the smallest chunk, flagged, when nothing
  fits), the plan's peak is predicted and reported; an int ``upscale_ratio`` (spatial only) decodes.
* Video offload asks for ``min(needed, budget)`` plus the weights still to load, as the image path does.
"""

from __future__ import annotations

import pytest
import torch
from vramfit.memory import oom
from vramfit.memory.cost import exact as dp
from vramfit.memory.decode import env as denv
from vramfit.memory.decode import image as idm
from vramfit.memory.decode import video as vd
from vramfit.memory.executors import generic as tg
from vramfit.memory.executors import kl_exact as te
from vramfit.memory.plan import exact as pe
from vramfit.memory.plan import image as pim
from vramfit.memory.plan import video as pv
from vramfit.memory.plan.types import Plan
from vramfit.memory.report import fmt_bytes

from tests.unit.test_image_decode import TinyVAE, _stores
from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 2**20
OOM = torch.OutOfMemoryError


# ------------------------------------------------------------------------------------------ OOM types


def test_oom_types_drop_a_bare_exception_in_one_place():
    assert oom.oom_types((Exception,)) == oom.default_oom_exceptions() == (OOM,)
    assert oom.oom_types((BaseException, KeyError)) == (KeyError,)
    assert oom.oom_types(None) == oom.default_oom_exceptions()
    assert oom.oom_types(()) == ()
    assert oom.oom_types((Exception,)) == oom.oom_types((Exception,))

@pytest.fixture(scope="module")
def vae():
    return TinyVAE(_model(ch_mult=(1, 1, 1, 1)), ratio=8)


@pytest.fixture(scope="module")
def stores():
    return _stores()


def _decode(vae, z, stores, env_kw, **kw) -> idm.DecodeResult:
    full, exact = stores
    job_kw = {k: kw.pop(k) for k in ("tile_size", "halo") if k in kw}
    job = idm.make_job(vae, z, core=True, out_device="cpu", **job_kw)
    return idm.decode_image(job, idm.DecodeEnv(cost_models=full, exact_cost_models=exact, **env_kw), **kw)


@pytest.mark.parametrize("exc", [ValueError, RuntimeError])
@pytest.mark.parametrize("where, kw", [
    ("pass", {"budget_mb": 1024}),  # the untiled decode: outside a tile
    ("tile", {"budget_mb": 1024, "tile_size": 16}),  # inside an exact tile
])
def test_image_path_bug_propagates_at_once_when_oom_exception_is_exception(vae, stores, exc, where, kw):
    calls: list[tuple[str, int]] = []

    def fault(w: str, k: int) -> None:
        calls.append((w, k))
        if w == where:
            raise exc("a bug, not an out-of-memory error")

    with pytest.raises(exc, match="a bug"):
        _decode(vae, _latent((1, 4, 7, 9), seed=1), stores, {"fault_hook": fault, "oom_exceptions": (Exception,)},
                **kw)
    assert [c for c in calls if c[0] == where] == [(where, 0)]


def test_image_path_generic_bug_propagates_at_once():
    vae = TinyVAE(_model(up_attn=True), ratio=4)  # not exact: the approximate (generic) path
    tiles: list[int] = []

    def fault(w: str, k: int) -> None:
        if w == "tile":
            tiles.append(k)
            raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        _decode(vae, _latent((1, 4, 12, 10), seed=3), _stores(), {"fault_hook": fault, "oom_exceptions": (Exception,)},
                tile_size=16, budget_mb=1024)
    assert tiles == [0]


def test_image_path_real_oom_still_replans_when_oom_exception_is_exception(vae, stores):
    passes: list[int] = []

    def fault(w: str, k: int) -> None:
        if w == "pass":
            passes.append(k)
            if k == 0:
                raise OOM("injected")

    r = _decode(vae, _latent((1, 4, 7, 9), seed=1), stores, {"fault_hook": fault, "oom_exceptions": (Exception,)},
                budget_mb=1024)
    assert passes == [0, 1] and r.plan.path == "exact" and len(r.oom_events) == 1


def test_executors_bug_propagates_at_once_oom_shrinks():
    kl = _model()
    z = _latent((1, 4, 6, 6), seed=2)
    steps: list[int] = []

    def bug(k: int) -> None:
        steps.append(k)
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        te.decode_exact(kl, z, (8, 8), fault_hook=bug, oom_exceptions=(Exception,))
    assert steps == [0]
    steps.clear()
    with pytest.raises(RuntimeError, match="shape mismatch"):
        tg.decode_generic(lambda t: t.repeat_interleave(2, -1).repeat_interleave(2, -2), z, (3, 3), 1,
                          fault_hook=bug, oom_exceptions=(Exception,))
    assert steps == [0]

    shrank: list[int] = []
    with torch.no_grad():
        ref = kl.decode(z)

    def oom_once(k: int) -> None:
        if k == 0 and not shrank:
            raise OOM("injected")

    out = te.decode_exact(kl, z, (16, 16), fault_hook=oom_once, oom_exceptions=(Exception,), min_tile=4,
                          on_oom=lambda: shrank.append(1))
    assert shrank == [1] and (out - ref).abs().max().item() <= 1e-4


# ------------------------------------------------------------------------------------------ exact re-plan figures


class FigPlanner(pim.ExactPlanner):
    """The image planner with peaks that differ per configuration, so a re-plan's figures show which
    configuration they are of."""

    def __init__(self, job: pim.ImageJob) -> None:
        super().__init__(job, None, 0.25, 0)

    def predict(self, recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
        work = tile * 10**6 * (1 if recompute else 2)  # above the output buffer and post-processing
        store = 5000 if on_device else 0
        return dp.ExactPeak(store + work, store, work, f"seg{tile}", 0, 4)


def test_exact_fallback_reports_the_figures_of_the_plan_that_ran(vae):
    job = idm.make_job(vae, _latent((1, 4, 7, 9), seed=1), core=True, out_device="cpu")
    planner = FigPlanner(job)
    pk = planner.predict(False, True, 64)
    extra, post = pim.buffer_bytes(job), pim.item_image_bytes(job)
    first = pe.ExactChoice(64, False, True, pk, extra + max(pk.with_overhead(0.25), post),
                           extra + max(pk.tracked, post), 1.0, True, False)
    p = Plan("exact", first, first.describe(), first.planned, first.tracked)
    for _ in range(3):
        old = p
        p = pim.fallback(job, p, pim.ImageModels(None, planner), 10**9)
        c = p.config
        want = planner.predict(c.recompute, c.store_on_device, c.tile)
        assert c.peak == want
        assert p.planned == c.planned == extra + max(want.with_overhead(0.25), post)
        assert p.tracked == c.tracked == extra + max(want.tracked, post)
        assert p.planned != old.planned and c.fits and not p.over_budget


def test_exact_replan_report_shows_the_new_plan(vae, stores):
    """Two re-plans before item 1 (recompute, then half the tile: the tiny decoder's peak segment does not
    change with recompute, the halved tile's does): the plan, its figures and the report are the last one's."""
    z = _latent((2, 4, 7, 9), seed=1)

    def fault(w: str, k: int) -> None:
        if w == "pass" and k in (1, 2):
            raise OOM("injected before item 1")

    clean = _decode(vae, z, stores, {}, tile_size=16, budget_mb=1024)
    r = _decode(vae, z, stores, {"fault_hook": fault}, tile_size=16, budget_mb=1024)
    assert r.plan.config.recompute and r.plan.config.tile == 8 and len(r.oom_events) == 2
    job = idm.make_job(vae, z, core=True, out_device="cpu")
    overhead = float(pim.full_cost_model(job, idm.DecodeEnv(cost_models=stores[0])).overhead)
    extra, post = pim.buffer_bytes(job), pim.item_image_bytes(job)
    assert r.plan.planned == extra + max(r.plan.config.peak.with_overhead(overhead), post)
    assert r.plan.tracked == extra + max(r.plan.config.peak.tracked, post)
    assert r.plan.planned < clean.plan.planned and r.plan.tracked < clean.plan.tracked
    assert fmt_bytes(r.plan.planned, "MiB", 1, small="KiB") in dict(r.report.rows)["predicted"]


# ------------------------------------------------------------------------------------------ non-Wan video


class TinyVideoDecoder(torch.nn.Module):
    """A causal-style video decoder (not Wan): ``4 T - 3`` frames, ``2x`` spatial, 3 channels."""

    def __init__(self, temporal: bool = True) -> None:
        super().__init__()
        self.proj = torch.nn.Conv3d(4, 3, 1)
        self.temporal = temporal

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        x = self.proj(z).repeat_interleave(2, -1).repeat_interleave(2, -2)
        if self.temporal:
            x = x.repeat_interleave(4, 2)[:, :, 3:]
        return torch.tanh(x)


class Patcher:
    def model_size(self) -> int:
        return 1000

    def loaded_size(self) -> int:
        return 400


class TinyVideoVAE:
    def __init__(self, upscale_ratio=None, temporal: bool = True, patcher: bool = False) -> None:
        self.first_stage_model = TinyVideoDecoder(temporal)
        self.vae_dtype = torch.float32
        self.device = torch.device("cpu")
        self.latent_channels = 4
        self.upscale_ratio = (lambda a: max(0, 4 * a - 3), 2, 2) if upscale_ratio is None else upscale_ratio
        if temporal and upscale_ratio is None:
            self.upscale_index_formula = (4, 2, 2)
        if patcher:
            self.patcher = Patcher()

    def process_output(self, image: torch.Tensor) -> torch.Tensor:
        return torch.clamp((image + 1.0) / 2.0, min=0.0, max=1.0)


def _video(vae, z, env=None, **kw) -> vd.VideoDecodeResult:
    return vd.decode_video(vd.make_job(vae, z, "cpu"), env or denv.DecodeEnv(), unload_others=False, **kw)


def test_non_wan_video_chunk_follows_the_budget():
    vae = TinyVideoVAE()
    z = torch.randn(1, 4, 9, 16, 16, generator=torch.Generator().manual_seed(0))
    whole = _video(vae, z, budget_mb=1024)  # the host's own decode fits: exact by construction
    assert whole.plan.path == "host" and whole.plan.exact and not whole.plan.over_budget
    ref = vae.process_output(vae.first_stage_model.decode(z)).movedim(1, -1).reshape(whole.images.shape)
    assert torch.equal(whole.images, ref.float())
    big = _video(vae, z, budget_mb=whole.plan.planned * 0.99 / MiB)  # it does not: overlap-blend chunks
    assert not vd.make_job(vae, z, "cpu").wan and big.plan.path == "blend" and not big.plan.exact
    assert big.plan.planned > 0 and not big.plan.over_budget and big.plan.config.k == 4 == pv.BLEND_MAX_K
    assert f"peak {fmt_bytes(big.plan.planned)}" in dict(big.report.rows)["predicted"]
    plans = [big.plan]
    for frac in (0.9, 0.75, 0.6):
        r = _video(vae, z, budget_mb=big.plan.planned * frac / MiB)
        assert r.plan.config.k <= plans[-1].config.k and r.plan.planned > 0
        assert r.plan.planned <= big.plan.planned * frac or (r.plan.config.k == 2 and r.plan.over_budget)
        assert r.images.shape == big.images.shape
        plans.append(r.plan)
    assert plans[-1].config.k < big.plan.config.k
    tiny = _video(vae, z, budget_mb=0.01)
    assert tiny.plan.config.k == 2 and tiny.plan.over_budget and tiny.plan.planned > 0
    assert "OVER BUDGET" in dict(tiny.report.rows)["predicted"]


def test_non_wan_video_int_upscale_ratio_decodes():
    vae = TinyVideoVAE(upscale_ratio=2, temporal=False)  # spatial only: one output frame per latent frame
    z = torch.randn(2, 4, 5, 6, 7, generator=torch.Generator().manual_seed(1))
    r = _video(vae, z, budget_mb=1024)
    assert r.images.shape == (2 * 5, 12, 14, 3) and r.plan.planned > 0
    ref = vae.process_output(vae.first_stage_model.decode(z)).movedim(1, -1).reshape(-1, 12, 14, 3)
    assert (r.images - ref).abs().max().item() <= 1e-6  # framewise decoder: the blend is exact


def test_non_wan_video_unusable_upscale_ratio_is_a_clear_error():
    vae = TinyVideoVAE(upscale_ratio=(lambda a: a, None, 8))  # no h ratio
    with pytest.raises(ValueError, match="Temporal-Chunk Video Decode.*upscale_ratio"):
        _video(vae, torch.zeros(1, 4, 3, 4, 4))


# ------------------------------------------------------------------------------------------ video offload


@pytest.mark.parametrize("budget_mb", [0, 1024, 0.05])
def test_video_offload_asks_min_of_need_and_budget(budget_mb):
    vae = TinyVideoVAE(patcher=True)
    z = torch.randn(1, 4, 9, 16, 16, generator=torch.Generator().manual_seed(0))
    asked: list[int | None] = []

    class Freed:
        def describe(self) -> str:
            return "freed"

    def offload(v, need):
        asked.append(need)
        return Freed()

    env = denv.DecodeEnv(offload=offload, budget=lambda v, mb: denv.default_budget(v, mb or 1024))
    r = vd.decode_video(vd.make_job(vae, z, "cpu"), env, budget_mb=budget_mb, unload_others=True)
    assert dict(r.report.rows)["offload"] == "freed"
    if budget_mb == 0.05:  # needed > budget: the budget
        assert r.plan.over_budget and asked == [int(0.05 * MiB) + 600]
    else:  # the plan that ran is the fastest (it fits): its peak, not the whole budget, + the weights to load
        assert not r.plan.over_budget and r.plan.planned > 0
        assert asked == [r.plan.planned + 600] and r.plan.planned < 1024 * MiB
