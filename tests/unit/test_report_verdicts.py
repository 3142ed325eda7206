"""The one-line verdict every report carries under its title (issue 22): its form per node, ``OVER BUDGET``
when the measured peak exceeds the budget, ``approximate`` on the approximate paths, the measured figure
named (RSS, live tensors, ``max_memory_allocated``) next to what the budget bounds; and the reach row's
short list of global modules."""

from __future__ import annotations

import re

import pytest
import torch
from vramfit.memory.budget import compute_budget
from vramfit.memory.decode import image as idm
from vramfit.memory.decode import video as vdm
from vramfit.memory.measure import reach as rc
from vramfit.memory.measure.monitor import MemorySample, Timeline
from vramfit.memory.measure.procfs import rss_peak_supported as rss_supported
from vramfit.memory.plan.types import Chunking, Plan
from vramfit.memory.report import OVER_BUDGET, Report, measure_tag, peak_verdict

from tests.unit.test_image_decode import TinyVAE, _stores
from tests.unit.test_tiled_exact import _latent, _model

pytestmark = pytest.mark.usefixtures("one_thread")
MiB = 2**20
RSS = "process RSS high-water mark"
TENSORS = "live tensor bytes (PeakTracker dispatch)"
CUDA = "CUDA max_memory_allocated"
DECODE_VERDICT = re.compile(
    r"^(exact|approximate) · [^·]+ · (RSS|tensor|allocated) peak [\d.]+ [KMG]?i?B (of|>) [\d.]+ [KMG]?i?B "
    r"tensor budget(: OVER BUDGET)?( · [^·]+)? · [\d.]+ m?s( · .+)?$"
)


# ------------------------------------------------------------------------------------------ the format


def test_the_verdict_is_the_line_under_the_title_and_parses_back() -> None:
    r = Report("Tiled VAE Decode", "cpu", summary="exact · 2x3 tiles · 1.2 s").add("plan", "2x3 tiles\nexact")
    lines = r.text().splitlines()
    assert lines[:2] == ["VRAM Fit | Tiled VAE Decode | cpu", "exact · 2x3 tiles · 1.2 s"]
    back = Report.parse(r.text())
    assert (back.summary, back.rows, back.node, back.device) == (r.summary, r.rows, r.node, r.device)
    assert Report.from_dict(r.to_dict()).summary == r.summary
    old = Report.parse("VRAM Fit | VRAM Monitor | cpu\n  rss : 1 GiB")  # a report without a verdict
    assert old.summary == "" and old.rows == [("rss", "1 GiB")]
    assert Report("x", summary="a\nb").text().splitlines()[1] == "a b"  # always one line


@pytest.mark.parametrize(("method", "tag"), [(RSS, "RSS"), (TENSORS, "tensor"), (CUDA, "allocated"),
                                             ("not measured on this device", "")])
def test_peak_verdict_names_the_measure_and_flags_an_overrun(method, tag) -> None:
    assert measure_tag(method) == tag
    within = peak_verdict(300 * MiB, method, 512 * MiB)
    over = peak_verdict(600 * MiB, method, 512 * MiB)
    assert within == f"{tag + ' ' if tag else ''}peak 300.0 MiB of 512.0 MiB tensor budget"
    assert over == f"{tag + ' ' if tag else ''}peak 600.0 MiB > 512.0 MiB tensor budget: {OVER_BUDGET}"
    unmeasured = peak_verdict(None, method, 512 * MiB, 100 * MiB)
    assert unmeasured == "predicted 100.0 MiB of 512.0 MiB tensor budget"


# ------------------------------------------------------------------------------------------ image decode


def _decode(vae, z, **kw) -> idm.DecodeResult:
    full, exact = _stores()
    job = idm.make_job(vae, z, core=True, out_device="cpu", tile_size=kw.pop("tile_size", 0))
    env = idm.DecodeEnv(cost_models=full, exact_cost_models=exact,
                        measure_cpu_tensors=kw.pop("tensors", True))
    with torch.no_grad():
        return idm.decode_image(job, env, **kw)


@pytest.fixture(scope="module")
def kl_vae():
    return TinyVAE(_model(ch_mult=(1, 1, 1, 1)), ratio=8)


def test_image_verdicts_name_path_tiles_peak_budget_and_time(kl_vae) -> None:
    z = _latent((2, 4, 7, 9), seed=1)  # 56 x 72 px
    untiled = _decode(kl_vae, z, budget_mb=1024)
    tiles = _decode(kl_vae, z, tile_size=16, budget_mb=1024)
    approx = _decode(TinyVAE(_model(up_attn=True), ratio=4), _latent((1, 4, 12, 10), seed=3), tile_size=16,
                     budget_mb=1024)
    for r in (untiled, tiles, approx):
        s = r.report.summary
        assert DECODE_VERDICT.match(s) and len(s) < 120, s
        assert Report.parse(r.report.text()).summary == s and r.report.text().splitlines()[1] == s
        assert "tensor peak" in s and OVER_BUDGET not in s, s
        assert "the figure the budget bounds" in dict(r.report.rows)["measured"]
    assert untiled.report.summary.startswith("exact · untiled x 2 images · tensor peak ")
    assert tiles.plan.path == "exact" and tiles.report.summary.startswith("exact · 4x5 tiles x 2 images · ")
    g = approx.plan.config
    assert approx.plan.path == "generic"
    assert approx.report.summary.startswith(f"approximate · {g.rows}x{g.cols} tiles")


@pytest.mark.slow
def test_an_image_decode_over_its_budget_says_so_in_its_verdict(kl_vae) -> None:
    z = _latent((1, 4, 24, 24))
    free = _decode(kl_vae, z, tile_size=16, budget_mb=1024)
    over = _decode(kl_vae, z, tile_size=16, budget_mb=free.plan.planned / 2 / MiB)
    assert over.measured_peak > over.budget.available
    assert DECODE_VERDICT.match(over.report.summary), over.report.summary
    assert f"tensor budget: {OVER_BUDGET}" in over.report.summary
    assert f"tensor budget: {OVER_BUDGET}" not in free.report.summary


@pytest.mark.skipif(not rss_supported(), reason="no RSS high-water mark on this platform")
def test_an_rss_measure_is_named_with_what_the_budget_bounds(kl_vae) -> None:
    r = _decode(kl_vae, _latent((1, 4, 7, 9), seed=1), budget_mb=1024, tensors=False)
    assert " · RSS peak " in r.report.summary and "tensor budget" in r.report.summary, r.report.summary
    measured = dict(r.report.rows)["measured"]
    assert RSS in measured and "tensor-level working memory" in measured and "predicted" in measured


# ------------------------------------------------------------------------------------------ video decode


class _Job:
    """The fields ``video._report`` reads of a job (no Wan layout: the overlap-blend path)."""

    wan = False
    one_frame = False
    family = "tiny video"
    dtype = torch.float32
    device = torch.device("cpu")
    z = torch.zeros(1, 4, 5, 2, 2)


@pytest.mark.parametrize(("measured", "method"), [(90 * MiB, RSS), (300 * MiB, RSS), (90 * MiB, CUDA)])
def test_video_verdict_says_approximate_chunks_and_flags_an_overrun(measured, method) -> None:
    budget = compute_budget("cpu", lambda d: 40 * 2**30, user_budget_mb=256)
    p = Plan("blend", Chunking(2), "chunks of 2 latent frames", 100 * MiB, exact=False,
             reason="not a Wan VAE")
    r = vdm._report(_Job(), p, budget, "skipped", {"chunks": 3}, 1.5, 0.2, measured, method)
    s = r.summary
    assert DECODE_VERDICT.match(s) and s.startswith("approximate · 3 chunks · "), s
    assert (OVER_BUDGET in s) == (measured > budget.available) and s.endswith(" · 1.50 s")
    assert f"{measure_tag(method)} peak {measured // MiB}.0 MiB" in s
    assert Report.parse(r.text()).summary == s


# ------------------------------------------------------------------------------------------ VRAM Monitor


def test_monitor_verdict_shows_the_sample_peak_allocated_and_free() -> None:
    tl = Timeline("p")
    for i, label in enumerate(("before decode", "after decode")):
        tl.add(MemorySample(
            label=label, device="cuda:0", wall_time=float(i), allocated=150 * MiB, reserved=None,
            free=1000 * MiB, total=2000 * MiB, peak=700 * MiB, peak_since="x", rss=None,
            methods=(("peak", "torch.cuda.max_memory_allocated, reset at each sample"),),
        ))
    s = tl.report().summary
    assert s == ("#2 after decode · allocated peak 700.0 MiB · allocated 150.0 MiB · "
                 "free 1000.0 MiB of 1.95 GiB")
    assert Report.parse(tl.report().text()).summary == s
    assert Timeline("empty").report().summary == "no samples"


# ------------------------------------------------------------------------------------------ reach row


def test_the_reach_row_counts_global_modules_and_names_the_first_few() -> None:
    names = tuple(f"decoder.up.{i}.attn.{j}" for i in range(4) for j in range(6))  # 24, as a DC-AE has
    text = rc.ReachReport(12.25, 5.0, names, (), "trace").describe()
    head = "global: 24 modules (decoder.up.0.attn.0, decoder.up.0.attn.1, decoder.up.0.attn.2, +21 more)"
    assert head in text
    assert "decoder.up.3.attn.5" not in text and len(text) < 200
    one = rc.ReachReport(12.25, 5.0, ("mid.attn_1",), (), "structure").describe()
    assert one.endswith("; global: 1 module (mid.attn_1)")
    assert "global" not in rc.ReachReport(1.0, 0.0, (), (), "trace").describe()
