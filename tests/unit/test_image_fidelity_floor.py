"""No approximate image tiles under 30 dB without the user asking (issue 36 item 3, the image side).

Before generic halo tiles run, the Tiled VAE Decode engine measures them (``decode.floor.check_generic``: tiles of
the planned size, at most 16 latent px, with the plan's halo, on a random latent of two tiles plus the halos, against
the host's untiled decode of it; PSNR on ``[0, 1]``, cached per structure, tile and halo). At or above the floor the
tiles run and the path row states the measured dB; under it the host's own untiled decode runs (exact; flagged over
budget; an out-of-memory error there names the node, the dB and ``allow_approximate``), unless ``allow_approximate``
is set. The decoder: a tiny GroupNorm decoder with attention at full resolution (no exact path), whose tiles without
a halo measure ~17 dB.
"""

from __future__ import annotations

import re

import pytest
import torch
from vramfit.memory.decode import floor as fl
from vramfit.memory.decode import image as idm
from vramfit.memory.decode import self_check as sc

from tests.unit.test_image_decode import FakeOOM, MiB, TinyVAE, _stores, env
from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")

Z = _latent((1, 4, 24, 20), seed=5)


@pytest.fixture(scope="module")
def vae() -> TinyVAE:
    return TinyVAE(_model(up_attn=True), ratio=4)


@pytest.fixture(scope="module")
def stores():
    return _stores()


@pytest.fixture(scope="module")
def ref(vae) -> torch.Tensor:
    with torch.inference_mode():
        return vae.process_output(vae.first_stage_model.decode(Z)).movedim(1, -1).float()


def _decode(vae, stores, checks=None, env_kw=None, z=Z, **kw) -> idm.DecodeResult:
    job_kw = {k: kw.pop(k) for k in ("tile_size", "halo") if k in kw}
    job = idm.make_job(vae, z, core=True, out_device="cpu", **job_kw)
    e = env(stores, **(env_kw or {}))
    e.checks = checks if checks is not None else sc.CheckStore()
    return idm.decode_image(job, e, unload_others=False, **kw)


def _db(path: str) -> float:
    m = re.search(r"measured ([\d.]+) dB vs VAE Decode", path)
    assert m, path
    return float(m.group(1))


def _tight(vae, stores) -> float:
    """A budget (MB) under the untiled decode of ``Z``: the plan is tiles."""
    whole = _decode(vae, stores, budget_mb=1024)
    assert whole.plan.path == "untiled"
    return whole.plan.planned * 0.6 / MiB


def test_tiles_without_halo_measure_under_the_floor_and_the_hosts_decode_runs(vae, stores, ref):
    budget = _tight(vae, stores)
    r = _decode(vae, stores, budget_mb=budget, halo=0)
    path = dict(r.report.rows)["path"]
    assert r.plan.path == "untiled" and r.plan.exact and fl.is_floor_host(r.plan), path
    assert r.plan.over_budget and "OVER BUDGET (approximate tiles under the fidelity floor" in r.report.text()
    assert path.startswith("exact: untiled") and "not taken without allow_approximate" in path, path
    assert _db(path) < sc.FIDELITY_FLOOR_DB and "< the 30 dB floor" in path
    assert torch.equal(r.images, ref)
    assert r.report.summary.startswith("exact · untiled")


def test_the_user_may_ask_for_the_far_off_tiles(vae, stores, ref):
    budget = _tight(vae, stores)
    r = _decode(vae, stores, budget_mb=budget, halo=0, allow_approximate=True)
    path = dict(r.report.rows)["path"]
    assert r.plan.path == "generic" and r.plan.config.rows * r.plan.config.cols > 1, path
    assert path.startswith("approximate: generic tiles") and "taken because allow_approximate is on" in path, path
    assert _db(path) < sc.FIDELITY_FLOOR_DB and r.plan.planned <= budget * MiB
    assert (r.images - ref).abs().max().item() > 0.05  # far off indeed


@pytest.mark.slow  # ~21 s; generic tiles above the floor, their measure in the report: also test_node_tiled_decode.py:370, test_decoder_self_check.py:137
def test_tiles_that_measure_above_the_floor_run_and_say_their_measure(vae, stores):
    """The auto halo (the decoder's traced reach, 13 latent px) in tiles of 8: the tiles measure at least 30 dB (the
    check's latent, 24x20, is the job's here: each tile's context holds most of it)."""
    checks = sc.CheckStore()
    r = _decode(vae, stores, checks, budget_mb=1024, tile_size=32)
    path = dict(r.report.rows)["path"]
    assert r.plan.path == "generic" and _db(path) >= sc.FIDELITY_FLOOR_DB and ">= the 30 dB floor" in path, path
    assert "measuring the approximate tiles' fidelity" in dict(r.report.rows)["first use"]
    again = _decode(vae, stores, checks, budget_mb=1024, tile_size=32)  # cached per structure, tile and halo: not measured again
    assert again.plan.path == "generic" and _db(dict(again.report.rows)["path"]) == _db(path)
    assert "measuring" not in dict(again.report.rows).get("first use", "")


def test_a_forced_tile_size_under_the_floor_is_not_applied(vae, stores, ref):
    r = _decode(vae, stores, budget_mb=1024, tile_size=32, halo=0)
    path = dict(r.report.rows)["path"]
    assert fl.is_floor_host(r.plan) and not r.plan.over_budget and torch.equal(r.images, ref)
    assert "tile_size 32 not applied" in path and "allow_approximate" in path, path
    forced = _decode(vae, stores, budget_mb=1024, tile_size=32, halo=0, allow_approximate=True)
    assert forced.plan.path == "generic" and forced.plan.config.tile_h == 8


def test_one_tile_holding_the_latent_is_the_hosts_decode(vae, stores, ref):
    r = _decode(vae, stores, budget_mb=1024, tile_size=128, halo=0)
    path = dict(r.report.rows)["path"]
    assert fl.is_floor_host(r.plan) and "one tile holds the whole latent" in path and torch.equal(r.images, ref), path
    assert "allow_approximate" not in path


def test_the_hosts_decode_out_of_memory_names_the_measure_and_allow_approximate(vae, stores):
    budget = _tight(vae, stores)

    def fault(where: str, k: int) -> None:
        if where == "pass":
            raise FakeOOM("injected")

    with pytest.raises(RuntimeError) as err:
        _decode(vae, stores, env_kw={"fault_hook": fault}, budget_mb=budget, halo=0)
    text = str(err.value)
    assert text.startswith("Tiled VAE Decode: the host's own decode ran out of memory (FakeOOM)"), text
    assert "ran over the budget" in text and " dB vs VAE Decode" in text, text
    assert "Set allow_approximate to true" in text and isinstance(err.value.__cause__, FakeOOM)


def test_an_untiled_pass_out_of_memory_does_not_fall_back_to_far_off_tiles(vae, stores, ref):
    """The untiled decode fits but runs out of memory once: the re-plan's generic tiles (no halo) measure under the
    floor, so the host's decode is retried, not the tiles; out of memory again, the error names the floor."""
    passes: list[int] = []

    def once(where: str, k: int) -> None:
        if where == "pass":
            passes.append(k)
            if k == 0:
                raise FakeOOM("injected once")

    r = _decode(vae, stores, env_kw={"fault_hook": once}, budget_mb=1024, halo=0)
    assert fl.is_floor_host(r.plan) and passes == [0, 1] and torch.equal(r.images, ref)
    assert len(r.oom_events) == 1 and "re-planned" in r.oom_events[0]

    def always(where: str, k: int) -> None:
        if where == "pass":
            raise FakeOOM("injected")

    with pytest.raises(RuntimeError, match="allow_approximate") as err:
        _decode(vae, stores, env_kw={"fault_hook": always}, budget_mb=1024, halo=0)
    assert "it was taken because the approximate tiles that fit measured" in str(err.value)
