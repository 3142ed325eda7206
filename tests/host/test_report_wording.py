"""The figures and words of the decode and encode reports, as a user reads them (issue 37, item 6).

On CPU, a KL VAE, a batch of 2, Tiled VAE Decode under ``budget_mb`` 2048 (the untiled decode fits):

* one budget figure, named once: the ``budget`` row says the user's 2,048 MiB; the ``plan`` row names no budget
  (it said "of 2,046 MiB budget": the plan's own figure less the output buffer) and every budget figure in the
  report (rows and verdict) is 2,048 MiB;
* the ``predicted`` row leads with the plan's tensor-level prediction, the figure the live-tensor measure compares
  with (within 15 % of it), then the planning figure (with the CPU's untracked overhead) and its share of the
  budget; it said ``peak <planning figure> (N% of budget)`` first, about twice the measured peak.

Tiled VAE Encode's report speaks of encoding: its budget is "available for encoding" and nothing in it says
"decod" (it said "available for decoding" and "later decodes skip it").
"""

from __future__ import annotations

import re
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from tests.host.test_tiled_encode_exact import _pixels

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

MiB = 2**20
BUDGET_MB = 2048
_UNIT = {"KiB": 2**10, "MiB": MiB, "GiB": 2**30}


def _node_module(comfy, node_id: str):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[node_id].__module__]


def _bytes(figure: str, unit: str) -> float:
    return float(figure.replace(",", "")) * _UNIT[unit]


@pytest.fixture(scope="module")
def decoded(comfy, kl_vae):
    mod = _node_module(comfy, "VRAMFit_TiledVAEDecode")
    z = structured_latent((2, 4, 16, 20), seed=3)  # 2 x 128x160 px: the untiled decode fits 2,048 MiB
    return mod.decode(kl_vae, {"samples": z}, budget_mb=BUDGET_MB)


def test_decode_names_one_budget_figure(decoded):
    r = decoded
    rows = dict(r.report.rows)
    assert r.plan.path == "untiled" and r.plan.config.images_per_pass == 2, r.report.text()
    assert int(r.budget.available) == BUDGET_MB * MiB
    assert rows["budget"] == "cpu: user budget 2,048 MiB of working memory (VAE weights not counted)", rows["budget"]
    assert "budget" not in rows["plan"], rows["plan"]
    text = r.report.text()
    figures = re.findall(r"([\d.,]+) (KiB|MiB|GiB)(?: tensor)? budget", text)
    figures += re.findall(r"user budget ([\d.,]+) (KiB|MiB|GiB)", text)
    assert len(figures) >= 2, text  # the budget row and the verdict
    assert {_bytes(n, u) for n, u in figures} == {BUDGET_MB * MiB}, figures


def test_decode_predicted_row_leads_with_the_figure_measured(decoded):
    r = decoded
    row = dict(r.report.rows)["predicted"]
    assert r.measure_method.startswith("live tensor bytes"), r.measure_method
    m = re.match(r"peak ([\d.,]+) (KiB|MiB) tensor-level \(compare with measured\); planned as ([\d.,]+) (KiB|MiB) "
                 r"with the overhead measured beyond it on this device \(scratch, allocator caches\): (\d+)% of "
                 r"budget$", row)
    assert m, row
    tracked, planned = _bytes(m[1], m[2]), _bytes(m[3], m[4])
    assert abs(tracked - r.plan.tracked) <= 0.05 * MiB and abs(planned - r.plan.planned) <= 0.05 * MiB, row
    assert planned > tracked  # CPU: the planning figure adds the untracked overhead
    assert int(m[5]) == round(100 * r.plan.planned / (BUDGET_MB * MiB)), row
    assert abs(tracked - r.measured_peak) <= 0.15 * r.measured_peak, (row, r.measured_peak)


def test_encode_report_speaks_of_encoding(comfy, kl_vae):
    mod = _node_module(comfy, "VRAMFit_TiledVAEEncode")
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        r = mod.encode(kl_vae, _pixels(2, 96, 128, seed=5))  # free memory: the budget row shows its sum
    text = r.report.text()
    rows = dict(r.report.rows)
    assert rows["budget"].startswith("cpu: free ") and " available for encoding" in rows["budget"], rows["budget"]
    assert "decod" not in text.lower(), text
    if "first use" in rows:  # the self-check ran in this process (not when an earlier test ran it)
        assert rows["first use"].endswith("later encodes skip it"), rows["first use"]
    assert re.match(r"peak [\d.,]+ (KiB|MiB) \(\d+% of budget, [^)]+\)", rows["predicted"]), rows["predicted"]
