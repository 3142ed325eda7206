"""Temporal-Chunk Video Decode (VRAM Fit) on the in-process ComfyUI host, against ComfyUI's ``VAEDecode``.

The node comes from ComfyUI's registry (loaded by ComfyUI's own loader); hooks are set on the module
ComfyUI imported. Thresholds (frames on [0, 1]):

* Wan 2.1 / 2.2 vs core ``VAEDecode`` (run under ``torch.inference_mode``, as ComfyUI runs nodes): same
  shape (B*T, H, W, 3), max abs diff <= 1e-5 for k in {1, 2, 3} (Wan 2.1; Wan 2.2: 9 frames, k in {1, 2}),
  whole frames and spatial tiles (Wan 2.2 k = 1 tiles is ``slow``), odd latent sizes, under both cache
  protocols (ComfyUI 0.3.x "carry", 0.33 "per_call": the report names the one detected);
* budget sweep: tracked peak (live tensor bytes) <= the budget and the plan's meta-sized prediction
  within +-15 % of the tracked peak; tighter budgets give other plans; a second plan of the same input
  sizes nothing (the persisted peaks);
* OOM injected mid-video (inside a later chunk): the run re-plans, resumes and equals the clean run;
* HunyuanVideo: its overlap-blend measures under 30 dB: the host's decode unless allow_approximate, then the
  approximate path, said in the report with its measured dB, VAEDecode's shape.

Every decode runs under ``torch.inference_mode`` (the ``inference_mode`` fixture; module fixtures enter it
themselves), as ComfyUI's executor runs the node: a plan is validated in the mode users run (issue 22).

The latents and their ``VAEDecode`` references are shared with ``test_video_chunked_host.py``
(``tests/video_refs.py``: decoded once per process); decodes of the node that two tests check alike
(k = 2 whole frames: fidelity and the OOM tests' clean run; the auto plan: report rows and progress) run
once per module.
"""

from __future__ import annotations

import logging
import math
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from tests.video_refs import HUNYUAN, WAN21, WAN22, reference

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread", "inference_mode")]
log = logging.getLogger("vramfit.tests.node_video_decode")

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"
TOL = 1e-3
FIDELITY = 1e-5
"""Max abs diff (frames on [0, 1]) of an exact Wan decode vs core VAEDecode (measured <= 2.8e-6 on both hosts)."""
MiB = 2**20


def _pv(mod):
    """The node's planning module (``memory.plan.video`` of the package ComfyUI loaded)."""
    return sys.modules[mod.__name__.rsplit(".nodes.", 1)[0] + ".memory.plan.video"]


@pytest.fixture(scope="module")
def node(comfy):
    return comfy.NODE_CLASS_MAPPINGS[NODE_ID]


@pytest.fixture(scope="module")
def mod(node):
    m = sys.modules[node.__module__]
    yield m
    m._FAULT_HOOK = None
    m.MEASURE_CPU_TENSORS = True


@pytest.fixture()
def hook(mod):
    yield lambda fn: setattr(mod, "_FAULT_HOOK", fn)
    mod._FAULT_HOOK = None


@pytest.fixture(scope="module")
def wan21(comfy, fixture_vaes):
    return reference(comfy, fixture_vaes, "wan21", WAN21)


@pytest.fixture(scope="module")
def wan22(comfy, fixture_vaes):
    return reference(comfy, fixture_vaes, narrow("wan22"), WAN22)  # the narrow twin (scripts.fixtures.kinds.NARROW_KINDS)


@pytest.fixture(scope="module")
def runs():
    """Node results by (k, tile px) of the Wan 2.1 latent, shared by tests that check the same decode."""
    return {}


def _diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------------ schema


def test_schema_ids_and_tooltips(node):
    schema = node.define_schema()
    assert schema.node_id == NODE_ID and schema.display_name == "Temporal-Chunk Video Decode (VRAM Fit)"
    ids = [i.id for i in schema.inputs]
    assert ids == ["samples", "vae", "frames_per_chunk", "tile_size", "budget_mb", "unload_others", "allow_approximate"]
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)
    assert [o.get_io_type() for o in schema.outputs] == ["IMAGE", "STRING"]


# ------------------------------------------------------------------------------------------ fidelity


@pytest.mark.parametrize(
    "k,tile_px",
    [(1, 0), (3, 0), (2, 24), *(pytest.param(k, t, marks=pytest.mark.slow) for k, t in ((2, 0), (1, 24), (3, 24)))],
)
def test_wan21_matches_core_vaedecode(mod, wan21, runs, k, tile_px):
    vae, z, ref = wan21
    r = mod.decode(vae, {"samples": z}, frames_per_chunk=k, tile_size=tile_px)
    runs[(k, tile_px)] = r
    assert r.images.shape == ref.shape and r.images.dtype == ref.dtype
    d = _diff(r.images, ref)
    log.info("wan21 k=%d tile=%d px: %s, max abs diff %.2e, %.2f s (plan %.2f s)", k, tile_px, r.plan.description, d,
             r.seconds, r.plan_seconds)
    assert r.plan.config.k == k and (r.plan.config.tile is None) == (tile_px == 0)
    if tile_px:
        assert r.plan.config.grid[0] * r.plan.config.grid[1] > 1
    rows = dict(r.report.rows)
    assert rows["path"].startswith("exact") and "self-check passed" in rows["check"]
    assert d <= FIDELITY


@pytest.mark.parametrize(
    "k,tile_px",
    [(1, 0), (2, 0), (2, 32), pytest.param(1, 32, marks=pytest.mark.slow)],
)
def test_wan22_matches_core_vaedecode(mod, wan22, k, tile_px):
    vae, z, ref = wan22
    r = mod.decode(vae, {"samples": z}, frames_per_chunk=k, tile_size=tile_px)
    assert r.images.shape == ref.shape
    d = _diff(r.images, ref)
    log.info("wan22 k=%d tile=%d px: %s, max abs diff %.2e, %.2f s", k, tile_px, r.plan.description, d, r.seconds)
    assert r.plan.halo == 6  # the walked reach at the default split, not families.py's 4
    if tile_px:
        assert r.plan.config.grid[0] * r.plan.config.grid[1] > 1
    assert d <= FIDELITY


@pytest.fixture(scope="module")
def auto_run(mod, wan21):
    """The auto plan's decode, with ComfyUI's progress bar updates recorded: ``(result, [(value, total)])``."""
    import comfy.utils

    vae, z, _ = wan21
    events: list[tuple[int, int | None]] = []
    orig = comfy.utils.ProgressBar.update_absolute

    def spy(self, value, total=None, preview=None):
        events.append((value, total))
        return orig(self, value, total, preview)

    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():  # as ComfyUI runs the node
        mp.setattr(comfy.utils.ProgressBar, "update_absolute", spy)
        r = mod.decode(vae, {"samples": z})
    return r, events


def test_auto_plan_report_rows(auto_run, wan21):
    _, _, ref = wan21
    r, _ = auto_run
    rows = dict(r.report.rows)
    for key in ("vae", "path", "budget", "offload", "plan", "cache", "predicted", "measured", "time"):
        assert key in rows, key
    assert rows["path"].startswith("exact") and "k = " in rows["plan"]
    assert r.plan.config.tile is None  # free memory: whole frames
    s = r.report.summary  # the verdict: exact, chunks, measured peak vs budget, time
    assert s.startswith(f"exact · {r.stats['chunks']} chunks · ") and " tensor budget" in s, s
    verdict, _, first_use = s.partition(" · first use +")  # a new clip shape's sizing is first-use work
    assert verdict.endswith(rows["time"].split(" (")[0]) and r.report.text().splitlines()[1] == s, s
    assert bool(first_use) == ("first use" in rows), s
    assert _diff(r.images, ref) <= TOL


# ------------------------------------------------------------------------------------------ budget


@pytest.mark.slow
def test_budget_sweep_tracked_within_budget_and_prediction(mod, wan21):
    """Budgets from the unconstrained plan's prediction downwards: every run stays within its budget,
    the meta-sized prediction is within +-15 % of the tracked peak, and tighter budgets change the plan
    (in-place cache, tiles). Planning the same input again sizes nothing (persisted peaks)."""
    vae, z, ref = wan21
    job = mod._validate(vae, {"samples": z}, 0, 0)
    mod.MEASURE_CPU_TENSORS = True
    seen = []
    try:
        free = _pv(mod).plan(job, 4096 * MiB, mod.comfy_env().peaks)  # the node's auto plan (issue 35: capped)
        low = _smallest_plan(_pv(mod), job, free.planned, mod.comfy_env().peaks)
        for budget_mb in (int(free.planned / MiB) + 1, math.ceil(low.planned / MiB)):
            r = mod.decode(vae, {"samples": z}, budget_mb=budget_mb)
            tracked = r.measured_peak
            err = (r.plan.planned - tracked) / tracked
            log.info("budget %d MiB: %s; predicted %.1f MiB, tracked %.1f MiB (%+.1f%%)", budget_mb,
                     r.plan.description, r.plan.planned / MiB, tracked / MiB, 100 * err)
            assert r.plan.planned <= budget_mb * MiB
            assert tracked <= budget_mb * MiB, (budget_mb, tracked)
            assert abs(err) <= 0.15, (budget_mb, r.plan.planned, tracked)
            assert _diff(r.images, ref) <= TOL
            seen.append((r.plan.config.k, r.plan.config.tile, r.plan.config.rollback))
            again: dict = {}
            _pv(mod).plan_wan(job, int(r.budget.available), 0, None, mod.comfy_env().peaks, again)
            assert again["sized"] == 0, again
    finally:
        mod.MEASURE_CPU_TENSORS = True
    assert seen[0] == (free.config.k, free.config.tile, free.config.rollback)
    if math.ceil(low.planned / MiB) * MiB < free.planned:  # a whole MiB between the smallest plan and the free one
        assert len(set(seen)) == len(seen), f"every budget should give another plan: {seen}"


def _smallest_plan(pv, job, below: int, peaks):
    """The smallest Wan plan under ``below`` bytes (the auto plan is capped by the host decode's peak, so on these
    tiny latents the plans below it may lie within one MiB of it)."""
    low = pv.plan_wan(job, below - 1, 0, None, peaks)
    while True:
        try:
            low = pv.plan_wan(job, low.planned - 1, 0, None, peaks)
        except ValueError:  # ImpossibleBudgetError: nothing smaller
            return low


def test_impossible_budget_is_a_clear_error(mod, wan21):
    """The error says what the smallest plan needs and names the budget as the report does (the flow of every
    decode adds it, as for images and encodes)."""
    vae = wan21[0]
    z = structured_latent((1, 16, 2, 3, 3), seed=1)
    with pytest.raises(ValueError, match=r"no plan fits the budget of 1.0 MiB: .*the smallest .* needs .*"
                                         r"\(budget: .*user budget 1 MiB"):
        mod.decode(vae, {"samples": z}, budget_mb=1)


# ------------------------------------------------------------------------------------------ OOM, cancel, progress


@pytest.fixture(scope="module")
def clean_k2(mod, wan21, runs):
    vae, z, _ = wan21
    if (2, 0) in runs:
        return runs[(2, 0)]
    with torch.inference_mode():
        return mod.decode(vae, {"samples": z}, frames_per_chunk=2)


@pytest.mark.parametrize("fail_step", [1, 2])
def test_oom_mid_video_resumes_identically(mod, wan21, clean_k2, hook, fail_step):
    """Chunks: frame 0, [1, 3), [3, 4). An OOM in chunk [1, 3) halves k; one in the last chunk (one latent
    frame) tiles it; both resume after the last finished chunk and equal the clean run."""
    vae, z, _ = wan21
    clean = clean_k2
    steps: list[int] = []

    def fault(where: str, step: int) -> None:
        steps.append(step)
        if step == fail_step and steps.count(fail_step) == 1:
            raise torch.OutOfMemoryError("injected mid-video")

    hook(fault)
    r = mod.decode(vae, {"samples": z}, frames_per_chunk=2)
    assert r.stats["shrinks"] == 1 and r.stats["restarts"] == 0
    assert steps.count(0) == 1  # frame 0 was not decoded again
    if fail_step == 1:
        assert r.stats["frames_per_chunk"] == 1
    else:
        assert r.stats["tile"] is not None
    assert "oom" in dict(r.report.rows)
    assert torch.equal(r.images[0], clean.images[0])  # frame 0 (finished before the OOM) is untouched
    assert _diff(r.images, clean.images) <= 1e-5  # other chunk sizes: float noise (measured <= 1.2e-6)


def test_cancel_between_chunks(mod, wan21, hook):
    import comfy.model_management as mm

    vae, z, _ = wan21
    steps: list[int] = []

    def fault(where: str, step: int) -> None:
        steps.append(step)
        if step == 1:
            mm.interrupt_current_processing(True)

    hook(fault)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            mod.decode(vae, {"samples": z}, frames_per_chunk=1)
    finally:
        mm.interrupt_current_processing(False)
    assert steps == [0, 1]


def test_progress_reaches_total(auto_run):
    r, events = auto_run
    assert r.plan.config.tile is None  # free memory: whole frames (k = 1, or 2 on 0.33: issue 35's cap)
    n = len(range(1, 4, r.plan.config.k)) + 1  # frame 0 + the chunks of the 3 later latent frames
    values = [v for v, _ in events]
    assert values == sorted(values) and events[-1] == (n, n)


# ------------------------------------------------------------------------------------------ errors, other VAEs


@pytest.mark.parametrize(
    "kind,shape,needle,to_tiled",
    [
        ("wan21", (1, 4, 3, 5, 7), "expects 16", False),
        ("kl_f8", (1, 4, 3, 5, 7), "wrong VAE for this latent", False),
    ],
)
def test_input_errors_name_node_and_shape(comfy, fixture_vaes, mod, kind, shape, needle, to_tiled):
    vae = comfy.VAELoader().load_vae(fixture_vaes[kind])[0]
    with pytest.raises(ValueError) as e:
        mod.decode(vae, {"samples": torch.zeros(shape)})
    msg = str(e.value)
    assert "Temporal-Chunk Video Decode" in msg and str(shape) in msg and needle in msg
    assert ("Tiled VAE Decode" in msg) == to_tiled  # named only where it decodes the same input


def test_an_image_latent_on_an_image_vae_decodes_as_vae_decode_does(comfy, fixture_vaes, mod):
    """Every latent VAE Decode takes decodes here too (issue 42): an image VAE's latent goes to Tiled VAE Decode's
    engine, the report says so."""
    vae = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]
    z = structured_latent((1, 4, 5, 7), seed=2)
    with torch.inference_mode():
        r = mod.decode(vae, {"samples": z})
        (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
    text = r.report.text()
    assert r.images.shape == ref.shape and (r.images - ref).abs().max().item() <= 1e-4, text
    assert "on an image VAE: decoded as images by Tiled VAE Decode's engine" in dict(r.report.rows)["input"], text


@pytest.mark.slow
def test_hunyuan_is_approximate_with_core_shape(comfy, fixture_vaes, mod, node):
    """HunyuanVideo's 3-D KL decoder has no exact chunks: its overlap-blend measures under 30 dB on the first-use
    check (18.9 dB on 0.3.75, 19.4 dB on 0.33.0, k = 3, on this fixture), so without ``allow_approximate`` the host's own decode runs (exact,
    the measure in its reason); with it, the blend, its measured dB in the path row."""
    vae, z, ref = reference(comfy, fixture_vaes, "hunyuan_video", HUNYUAN)
    out = node.execute(samples={"samples": z}, vae=vae, frames_per_chunk=3, tile_size=0, budget_mb=0,
                       unload_others=True)
    images, text = out.args
    assert text.splitlines()[1].startswith("exact · host decode"), text
    assert "measured " in text and "not taken without allow_approximate" in text, text
    assert (images - ref).abs().max().item() <= 1e-4, text
    out = node.execute(samples={"samples": z}, vae=vae, frames_per_chunk=3, tile_size=0, budget_mb=0,
                       unload_others=True, allow_approximate=True)
    images, text = out.args
    assert images.shape == ref.shape
    assert "APPROXIMATE" in text and "dB vs VAE Decode on the first-use check" in text, text
    assert text.splitlines()[1].startswith("approximate · "), text
    err = (images - ref).abs()
    log.info("hunyuan overlap-blend k=3 vs VAEDecode: mean abs %.3f, max %.3f", err.mean().item(), err.max().item())
    assert err.mean().item() <= 0.15


@pytest.mark.slow  # ~10 s on CPU; the slow tier runs in CI (.ci/run), keeping the user's default run in 15 min
def test_a_new_clip_shapes_sizing_is_tagged_first_use(mod, wan21, fresh_stores):
    """A clip shape's plans are meta-sized once (issue 43 item 4: every report tags first-use work): the first
    decode with fresh stores says so in its ``first use`` row and verdict line; the second, on the same shape, sizes
    nothing and says nothing (before: the sizing was untagged planning time)."""
    vae, z, ref = wan21
    with torch.inference_mode():
        first = mod.decode(vae, {"samples": z})
        warm = mod.decode(vae, {"samples": z})
    rows = dict(first.report.rows)
    assert "sizing the plans of this clip shape" in rows.get("first use", ""), first.report.text()
    assert "per clip shape" in rows["first use"] and "first use +" in first.report.summary
    assert "first use" not in dict(warm.report.rows) and "first use" not in warm.report.summary, warm.report.text()
    assert torch.equal(first.images, warm.images) and _diff(first.images, ref) <= TOL
