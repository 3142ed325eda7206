"""A batch of Wan 2.1 clips under a budget below its whole-batch floor, on the host the tests run (0.3.75 included).

When no chunked plan holds the whole batch, Temporal-Chunk Video Decode plans one clip within what the batch's
output leaves and decodes the batch one clip at a time (``memory/decode/video.py``, "one batch item at a time";
before, "no plan fits"; with the user's frames_per_chunk, the whole batch over the budget); the chunked executor per clip, or the host's own decode per clip where that fits (0.33.0's
Wan decode on these tiny clips). Here: the floors are read from the node's own refusals (the whole batch's, one clip's), a
budget between them gives the host's frames clip by clip within the budget, and an out-of-memory error inside the
second clip re-plans that clip and resumes it, the first clip left as it was (nothing finished is decoded again).
"""

from __future__ import annotations

import logging
import math
import re
import sys

import pytest
import torch

from tests.video_refs import reference

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]
log = logging.getLogger("vramfit.tests.wan_batch_items")

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"
MiB = 2**20
FIDELITY = 1e-5
"""Max abs diff (frames on [0, 1]) of an exact Wan decode vs core VAEDecode (as test_node_video_decode.py)."""
LATENT = (2, 16, 4, 2, 3)
"""Two clips of 13 frames of 16x24 px: long enough that the host's own decode of one clip does not fit where its
chunks do (on both hosts)."""


@pytest.fixture(scope="module")
def mod(comfy):
    m = sys.modules[comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__]
    yield m
    m._FAULT_HOOK = None


@pytest.fixture(scope="module")
def case(comfy, fixture_vaes, mod):
    """``(vae, z, VAEDecode(z), budget_mb)``: the budget lies between one clip's smallest plan (plus the other clip's
    output, held throughout) and the whole batch's lower bound, both as the node's refusals state them, as high as
    it can (a clip's plan with room to shrink after an out-of-memory error)."""
    vae, z, ref = reference(comfy, fixture_vaes, "wan21", LATENT, seed=4)
    refusals = {}
    for name, latent in (("batch", z), ("clip", z[:1])):
        with pytest.raises(ValueError, match="no plan fits") as e:
            mod.decode(vae, {"samples": latent}, budget_mb=1)
        refusals[name] = e.value.__cause__  # the node's input error, from the planner's ImpossibleBudgetError
    found = re.search(r"the smallest found .* needs ([0-9.]+) MiB", str(refusals["clip"]))
    assert found, refusals["clip"]
    other_out = ref[: ref.shape[0] // 2].numel() * 4  # the other clip's frames, float32, held while one decodes
    low = float(found.group(1)) * MiB + other_out  # a plan of one clip that fits, beside the other's output
    high = refusals["batch"].minimum  # no plan of the whole batch fits below this
    budget_mb = math.ceil(high / MiB) - 1  # the node takes whole MiB; the most room below the batch's floor
    assert budget_mb * MiB >= low, f"no whole MiB between one clip's smallest plan ({low / MiB:.1f} MiB with the " \
                                   f"other's output) and the batch's floor ({high / MiB:.1f} MiB): per-clip not reached"
    return vae, z, ref.clone(), budget_mb


@pytest.fixture(scope="module")
def clean(mod, case):
    """The node's decode at the case's budget, and the executor steps it reported (each clip counts its own)."""
    vae, z, _, budget_mb = case
    steps: list[int] = []
    mod._FAULT_HOOK = lambda where, step: steps.append(step)
    try:
        return mod.decode(vae, {"samples": z}, budget_mb=budget_mb), steps
    finally:
        mod._FAULT_HOOK = None


def test_clip_by_clip_within_a_budget_below_the_whole_batch(case, clean):
    _, _, ref, budget_mb = case
    r, steps = clean
    text = r.report.text()
    assert r.plan.path in ("wan", "host") and "one batch item at a time" in r.plan.description, text
    assert r.report.summary.startswith("exact") and "OVER BUDGET" not in text, text
    assert r.images.shape == ref.shape
    assert (r.images - ref).abs().max().item() <= FIDELITY, text
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB, text
    if r.plan.path == "wan":  # the chunked executor per clip (0.33.0: the host's own decode of one clip fits here)
        per_clip = len(steps) // 2
        assert per_clip >= 2 and steps == steps[:per_clip] * 2, steps  # two clips, one after the other, alike
    log.info("budget %d MiB: measured %.1f MiB, %s", budget_mb, r.measured_peak / MiB, r.report.summary)


def test_an_oom_in_the_second_clip_resumes_it_and_keeps_the_first(mod, case, clean):
    vae, z, ref, budget_mb = case
    first, clean_steps = clean
    if first.plan.path != "wan":
        pytest.skip(f"{first.plan.description}: the host's own decode per clip, no chunked executor to fail inside")
    per_clip = len(clean_steps) // 2
    steps: list[int] = []

    def fault(where: str, step: int) -> None:
        steps.append(step)
        if len(steps) == per_clip + 2:  # the second clip's second chunk, once
            raise torch.OutOfMemoryError("injected in the second clip")

    mod._FAULT_HOOK = fault
    try:
        r = mod.decode(vae, {"samples": z}, budget_mb=budget_mb)
    finally:
        mod._FAULT_HOOK = None
    text = r.report.text()
    assert "one batch item at a time" in r.plan.description and "oom" in dict(r.report.rows), text
    assert steps[:per_clip] == clean_steps[:per_clip] and steps.count(0) == 2, steps  # no clip's start decoded twice
    half = ref.shape[0] // 2
    assert torch.equal(r.images[:half], first.images[:half]), "the first clip changed"
    assert (r.images - ref).abs().max().item() <= FIDELITY, text


def test_the_users_frames_per_chunk_goes_clip_by_clip_too(mod, case):
    """With the user's ``frames_per_chunk`` the whole batch's plan is over the budget (a user's chunk size is never
    refused): one clip at a time with that chunk size fits, and runs (before: the whole batch, flagged over budget)."""
    vae, z, ref, budget_mb = case
    r = mod.decode(vae, {"samples": z}, budget_mb=budget_mb, frames_per_chunk=1)
    text = r.report.text()
    assert r.plan.path == "wan" and "one batch item at a time" in r.plan.description, text
    assert r.report.summary.startswith("exact") and "OVER BUDGET" not in text, text
    assert (r.images - ref).abs().max().item() <= FIDELITY, text
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB, text
