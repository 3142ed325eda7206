"""Tiled VAE Decode (VRAM Fit) on the in-process ComfyUI host, against ComfyUI's own ``VAEDecode``.

The node is taken from ComfyUI's registry (``NODE_CLASS_MAPPINGS``, loaded by ComfyUI's own loader);
its module is the one ComfyUI imported (test hooks are set there). Thresholds (images on [0, 1]):

* exact path vs core ``VAEDecode``: PSNR >= 60 dB (measured ~129 dB: float32 noise), seam ratio <= 1.2
  (mean abs error in 8-px bands centred on every tile border of every level / elsewhere, each plus a
  floor of 1e-5 = 1/400 of an 8-bit step), for odd sizes (not multiples of the tile) and batch 2;
* budget sweep: tracked peak (live tensor bytes, ``PeakTracker``) <= the budget, and the plan's
  predicted tensor-level peak within +-15 % of it (measured: within 2 %);
* out-of-memory injected inside tile k, or before a pass (re-plan + retry): max abs diff <= 1e-5 vs
  the uninterrupted run (measured 0 or < 1e-6);
* approximate path on a local decoder (ComfyUI's TAESD, random weights): the auto halo (traced
  convolutional reach) reproduces ``VAEDecode`` within 1e-5; a halo below the reach does not.
"""

from __future__ import annotations

import logging
import math
import re
import sys

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.host import clone_node
from tests.helpers import exact_tile_borders, psnr, seam_ratio

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.node_tiled_decode")

NODE_ID = "VRAMFit_TiledVAEDecode"
MiB = 2**20
ODD = (2, 4, 21, 29)  # 168 x 232 px, batch 2: not a multiple of the tile
SMALL = (2, 4, 13, 18)  # 104 x 144 px, batch 2


@pytest.fixture(scope="module")
def node(comfy):
    return comfy.NODE_CLASS_MAPPINGS[NODE_ID]


@pytest.fixture(scope="module")
def mod(node):
    """The node module as ComfyUI imported it (hooks must be set on this one)."""
    m = sys.modules[node.__module__]
    yield m
    m._FAULT_HOOK = None
    m.MEASURE_CPU_TENSORS = True


@pytest.fixture(scope="module")
def pack(mod):
    """The pack's ``memory`` modules as ComfyUI's loader imported them."""
    base = mod.__name__.rsplit(".nodes.", 1)[0]
    return {name.rsplit(".", 1)[-1]: sys.modules[f"{base}.memory.{name}"]
            for name in ("executors.kl_exact", "vae.kl_layout", "report", "cost.exact")}


@pytest.fixture(scope="module")
def odd_case(comfy, kl_vae):
    z = structured_latent(ODD, seed=3)
    (ref,) = comfy.VAEDecode().decode(kl_vae, {"samples": z})
    return z, ref


@pytest.fixture(scope="module")
def small_case(comfy, kl_vae):
    z = structured_latent(SMALL, seed=11)
    (ref,) = comfy.VAEDecode().decode(kl_vae, {"samples": z})
    return z, ref


@pytest.fixture(scope="module")
def clean_small(mod, kl_vae, small_case):
    """Uninterrupted exact decode of the small batch-2 case with 64-px tiles."""
    z, _ = small_case
    return mod.decode(kl_vae, {"samples": z}, tile_size=64)


@pytest.fixture()
def hook(mod):
    """Set ``mod._FAULT_HOOK`` for one test; always cleared."""
    yield lambda fn: setattr(mod, "_FAULT_HOOK", fn)
    mod._FAULT_HOOK = None


# ------------------------------------------------------------------------------------------ schema


def test_schema(node, comfy):
    schema = node.GET_SCHEMA()
    assert schema.node_id == NODE_ID and schema.display_name == "Tiled VAE Decode (VRAM Fit)"
    assert schema.category == "VRAM Fit"
    ids = [i.id for i in schema.inputs]
    assert ids == ["samples", "vae", "tile_size", "halo", "budget_mb", "unload_others", "allow_approximate"]
    assert all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    assert [o.io_type for o in schema.outputs] == ["IMAGE", "STRING"]
    assert all(o.tooltip for o in schema.outputs)
    defaults = {i.id: getattr(i, "default", None) for i in schema.inputs}
    assert defaults["tile_size"] == 0 and defaults["halo"] == -1 and defaults["budget_mb"] == 0
    assert defaults["unload_others"] is True and defaults["allow_approximate"] is False
    assert [h.value for h in schema.hidden] == ["UNIQUE_ID"]


# ------------------------------------------------------------------------------------------ exact


@pytest.mark.slow
def test_exact_tiles_match_vae_decode_odd_size_batch2(mod, pack, kl_vae, odd_case):
    """Forced tiles (64 px at every level: 3 x 4 tiles at full resolution) on 168 x 232, batch 2."""
    z, ref = odd_case
    r = mod.decode(kl_vae, {"samples": z}, tile_size=64)
    out = r.images
    assert r.plan.path == "exact" and r.plan.config.tile == 64
    assert out.shape == ref.shape == (2, 168, 232, 3)
    assert out.dtype == ref.dtype and out.device == ref.device
    assert 0.0 <= out.min().item() and out.max().item() <= 1.0
    value = psnr(out, ref)
    ys, xs = exact_tile_borders(pack["kl_layout"].exact_geometry(kl_vae.first_stage_model, (1, *ODD[1:]), (64, 64)), 8)
    assert len(ys) >= 2 and len(xs) >= 3
    ratio = seam_ratio(out, ref, ys, xs)
    log.info("exact node vs VAEDecode: PSNR %.1f dB, max abs %.2e, seam ratio %.3f", value,
             (out - ref).abs().max().item(), ratio)
    assert value >= 60.0, value
    assert ratio <= 1.2, ratio
    text = r.report.text()
    parsed = pack["report"].Report.parse(text)
    rows = dict(parsed.rows)
    assert parsed.node == "Tiled VAE Decode" and rows["path"].startswith("exact")
    for key in ("vae", "budget", "offload", "plan", "predicted", "measured", "time"):
        assert key in rows, text
    # the verdict under the title: path, tiles, measured peak vs budget, time
    assert text.splitlines()[1] == parsed.summary and parsed.summary.startswith("exact · "), text
    assert re.match(r"exact · \d+x\d+ tiles x 2 images · ", parsed.summary), parsed.summary
    assert " tensor budget · " in parsed.summary, parsed.summary
    # ... and, when once-per-VAE work ran in this decode (the batch self-check, the first time a batch is split in
    # this process), that work's time after it, as the report's first-use row says
    verdict = parsed.summary
    if "first use" in rows:
        verdict, tag = verdict.rsplit(" · ", 1)
        assert tag.startswith("first use +"), parsed.summary
    else:
        assert "first use" not in verdict, parsed.summary
    assert verdict.endswith(rows["time"].split(" decoding")[0]), parsed.summary


def test_untiled_when_it_fits_is_core_decode(mod, kl_vae, small_case):
    z, ref = small_case
    r = mod.decode(kl_vae, {"samples": z})
    assert r.plan.path == "untiled" and r.plan.config.images_per_pass == 2
    assert torch.equal(r.images, ref)


@pytest.mark.slow
def test_budget_sweep_tracked_within_budget_and_prediction(mod, kl_vae, small_case):
    """Decreasing budgets move the plan from untiled to exact tiles, smaller tiles and recomputation;
    every run stays within its budget and its prediction is within +-15 % of the tracked peak."""
    z, ref = small_case[0][:1], small_case[1][:1]
    mod.MEASURE_CPU_TENSORS = True
    seen = []
    try:
        # With band freeing recomputation saves only ~8 % of the store (the first full-res block's h + s
        # vs y), so only the tightest budget, which no plan without it fits (16-px tiles: 18.6 MiB
        # planned; with recompute 17.2 MiB), recomputes.
        for budget_mb in (160, 64, 44, 36, 28, 21, 18):
            r = mod.decode(kl_vae, {"samples": z}, budget_mb=budget_mb)
            tracked, predicted = r.measured_peak, r.plan.tracked
            err = (predicted - tracked) / tracked
            label = (r.plan.path, getattr(r.plan.config, "tile", None), getattr(r.plan.config, "recompute", None))
            log.info("budget %d MiB: %s; planned %.1f MiB, predicted tensor-level %.1f MiB, tracked %.1f MiB "
                     "(%+.1f%%), PSNR %.1f dB", budget_mb, label, r.plan.planned / MiB, predicted / MiB,
                     tracked / MiB, 100 * err, psnr(r.images, ref))
            assert r.plan.planned <= budget_mb * MiB
            assert tracked <= budget_mb * MiB, (budget_mb, tracked)
            assert abs(err) <= 0.15, (budget_mb, predicted, tracked)
            assert psnr(r.images, ref) >= 60.0
            assert "live tensor bytes" in dict(r.report.rows)["measured"]
            seen.append(label)
    finally:
        mod.MEASURE_CPU_TENSORS = True
    assert seen[0][0] == "untiled" and all(p == "exact" for p, _, _ in seen[1:]), seen
    assert len(set(seen)) == len(seen), f"every budget should give another plan: {seen}"
    assert any(rec for _, _, rec in seen[1:]), f"the tightest budgets should recompute: {seen}"


def test_impossible_budget_names_the_minimum(mod, kl_vae, small_case):
    z, _ = small_case
    with pytest.raises(ValueError) as err:
        mod.decode(kl_vae, {"samples": z}, budget_mb=4)
    text = str(err.value)
    assert "Tiled VAE Decode" in text and "too small" in text and "needs" in text, text
    minimum = int(text.split(" bytes")[0].rsplit("(", 1)[1])
    budget_mb = math.ceil(minimum / MiB)
    r = mod.decode(kl_vae, {"samples": z[:1]}, budget_mb=budget_mb)  # the minimum is per image
    assert r.plan.path == "exact" and r.plan.planned <= budget_mb * MiB


# ------------------------------------------------------------------------------------------ OOM


def test_oom_inside_tile_resumes_identically(mod, kl_vae, small_case, clean_small, hook):
    z, _ = small_case
    clean = clean_small
    seen: list[int] = []
    fail_at = 40  # item 0, inside the full-resolution segments

    def fault(where: str, k: int) -> None:
        if where == "tile":
            seen.append(k)
            if k == fail_at and seen.count(fail_at) == 1:
                raise torch.OutOfMemoryError("injected at tile 40")

    hook(fault)
    r = mod.decode(kl_vae, {"samples": z}, tile_size=64)
    assert fail_at in seen
    diff = (r.images - clean.images).abs().max().item()
    log.info("OOM at tile %d: max abs diff vs uninterrupted %.2e; %s", fail_at, diff, r.oom_events)
    assert diff <= 1e-5
    assert any("inside a tile" in e for e in r.oom_events)
    assert "oom" in dict(r.report.rows)


@pytest.mark.slow
def test_oom_outside_tile_replans_and_retries(mod, kl_vae, small_case, clean_small, hook):
    """An OOM before item 1's pass (as in the mid block or a store allocation): re-planned with
    recomputation, item 1 retried; item 0 (finished) is kept as is."""
    z, _ = small_case
    clean = clean_small
    calls: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "pass":
            calls.append(k)
            if k == 1:
                raise torch.OutOfMemoryError("injected before pass 1")

    hook(fault)
    r = mod.decode(kl_vae, {"samples": z}, tile_size=64)
    assert calls == [0, 1, 2]
    assert r.plan.config.recompute and len(r.oom_events) == 1
    assert torch.equal(r.images[0], clean.images[0])
    assert (r.images - clean.images).abs().max().item() <= 1e-5


def test_oom_in_untiled_pass_falls_back_to_exact_tiles(mod, kl_vae, small_case, hook):
    z, ref = small_case

    def fault(where: str, k: int) -> None:
        if where == "pass" and k == 0:
            raise torch.OutOfMemoryError("injected in the untiled pass")

    hook(fault)
    r = mod.decode(kl_vae, {"samples": z})
    assert r.plan.path == "exact" and not r.plan.config.whole
    assert "untiled pass" in r.oom_events[0]
    assert psnr(r.images, ref) >= 60.0


# ------------------------------------------------------------------------------------------ cancel, progress


def test_cancel_between_tiles(mod, kl_vae, hook):
    import comfy.model_management as mm

    z = structured_latent((1, 4, 8, 8), seed=2)
    tiles: list[int] = []

    def fault(where: str, k: int) -> None:
        if where == "tile":
            tiles.append(k)
            if k == 3:
                mm.interrupt_current_processing(True)

    hook(fault)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            mod.decode(kl_vae, {"samples": z}, tile_size=32)
    finally:
        mm.interrupt_current_processing(False)
    assert tiles == [0, 1, 2, 3]  # stopped before tile 4


def test_progress_bar_reaches_its_total(mod, pack, kl_vae):
    import comfy.utils

    z = structured_latent((1, 4, 8, 8), seed=2)
    events: list[tuple[int, int]] = []
    old = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda v, t, preview=None, node_id=None: events.append((v, t)))
    try:
        mod.decode(kl_vae, {"samples": z}, tile_size=32, node_id="7")
    finally:
        comfy.utils.set_progress_bar_global_hook(old)
    total = pack["kl_layout"].kl_layout(kl_vae.first_stage_model).steps(z.shape[-2:], (32, 32))  # batch 1
    assert events[0] == (0, total) and events[-1] == (total, total)
    assert [v for v, _ in events] == sorted(v for v, _ in events)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "shape,kw,needle",
    [
        ((1, 16, 3, 8, 8), {}, "5-D video latent"),
        ((1, 16, 8, 8), {}, "has 16 channels but the VAE expects 4"),
        ((1, 4, 8, 8), {"tile_size": 60}, "tile_size 60"),
        ((1, 4, 8, 8), {"tile_size": 16}, "tile_size 16"),
    ],
)
def test_input_errors_name_node_and_shape(mod, kl_vae, shape, kw, needle):
    with pytest.raises(ValueError) as err:
        mod.decode(kl_vae, {"samples": torch.zeros(shape)}, **kw)
    text = str(err.value)
    assert "[VRAM Fit · Tiled VAE Decode]" in text and needle in text, text
    if len(shape) == 5 or shape[1] == 16:  # a wrong VAE: the video node refuses it too, so it is not named
        assert str(tuple(shape)) in text and "wrong VAE for this latent" in text
        assert "Temporal-Chunk" not in text


# ------------------------------------------------------------------------------------------ node entry point


def test_execute_returns_image_report_and_preview(node, pack, kl_vae):
    z = structured_latent((1, 4, 8, 8), seed=4)
    cls = clone_node(node, "12")
    out = cls.execute(samples={"samples": z}, vae=kl_vae, tile_size=32, halo=-1, budget_mb=0, unload_others=True)
    image, text = out.args
    assert image.shape == (1, 64, 64, 3)
    assert out.ui.as_dict() == {"text": (text,)}
    rows = dict(pack["report"].Report.parse(text).rows)
    assert "tiles of 32 px" in rows["plan"] and rows["path"].startswith("exact")


# ------------------------------------------------------------------------------------------ approximate path


def _random_taesd_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    import comfy.taesd.taesd

    gen = torch.manual_seed(seed)
    del gen
    model = comfy.taesd.taesd.TAESD()
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.Conv2d.reset_parameters(m)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def taesd_vae():
    """ComfyUI's own VAE class around a random-weight TAESD decoder: a *local* decoder (convs, ReLU,
    nearest upsampling; no normalisation, no attention) that the exact executor does not support."""
    import comfy.sd

    return comfy.sd.VAE(sd=_random_taesd_state_dict())


@pytest.mark.slow
def test_generic_path_auto_halo_reproduces_vae_decode(comfy, mod, taesd_vae):
    z = structured_latent((1, 4, 40, 44), seed=9)  # 320 x 352 px
    (ref,) = comfy.VAEDecode().decode(taesd_vae, {"samples": z})
    r = mod.decode(taesd_vae, {"samples": z}, tile_size=128)
    rows = dict(r.report.rows)
    assert r.plan.path == "generic" and r.plan.config.tiled
    assert rows["path"].startswith("approximate") and "decoder has no" in rows["path"]
    assert "inf dB (equal)" in rows["path"] and ">= the 30 dB floor" in rows["path"], rows["path"]  # its measure
    assert r.plan.halo >= 17 and r.plan.feather == 0, rows["halo"]  # TAESD's traced reach: 18.125 latent px
    assert r.images.shape == ref.shape
    diff = (r.images - ref).abs().max().item()
    log.info("TAESD generic, auto halo %d: max abs diff %.2e (%s)", r.plan.halo, diff, rows["halo"])
    assert diff <= 1e-5

    short = mod.decode(taesd_vae, {"samples": z}, tile_size=128, halo=4)
    log.info("TAESD generic, halo 4: %s", dict(short.report.rows)["path"])
    assert short.plan.halo == 4
    assert (short.images - ref).abs().max().item() > 1e-3  # a halo below the reach is not exact


def test_third_party_vae_subclass_uses_its_own_decode(comfy, mod, taesd_vae):
    """A ``comfy.sd.VAE`` subclass in the style of ComfyUI_ExtraModels' ``EXVAE``: no ``VAE.__init__``,
    no patcher, no ``latent_channels``/``upscale_ratio``; its own ``decode`` (own scaling, BHWC)."""
    import comfy.sd

    class ThirdPartyVAE(comfy.sd.VAE):
        def __init__(self, model):
            self.first_stage_model = model
            self.latent_dim = 4  # EXVAE: latent *channels* here
            self.latent_scale = 8
            self.device = torch.device("cpu")
            self.vae_dtype = torch.float32

        def decode(self, samples_in):
            x = self.first_stage_model.decode(samples_in.to(self.vae_dtype).to(self.device))
            return torch.clamp((x.float() + 1.0) / 2.0, 0.0, 1.0).cpu().movedim(1, -1)

    vae = ThirdPartyVAE(taesd_vae.first_stage_model)
    z = structured_latent((2, 4, 24, 20), seed=10)
    with torch.no_grad():
        ref = vae.decode(z)
    r = mod.decode(vae, {"samples": z}, tile_size=64)
    rows = dict(r.report.rows)
    assert r.plan.path == "generic" and "skipped" in rows["offload"]
    assert r.images.shape == ref.shape == (2, 192, 160, 3)
    assert (r.images - ref).abs().max().item() <= 1e-5


# ------------------------------------------------------------------------------------------ mid-block attention


def test_bounded_split_attention_equals_comfy_attention(mod, kl_vae):
    """The mid block's split attention with score slices bounded by the budget (CPU path): identical to
    ComfyUI's own when one slice fits, float-noise close when sliced; and it lowers the mid phase."""
    comfy_glue = sys.modules[mod.__name__.rsplit(".", 1)[0] + "._vae_ops"]
    model = kl_vae.first_stage_model
    attn = model.decoder.mid.attn_1
    z = structured_latent((1, 4, 20, 26), seed=6)
    with torch.no_grad():
        h = model.decoder.mid.block_1(model.decoder.conv_in(model.post_quant_conv(z)))
        ref = attn(h)
        with comfy_glue.bounded_vae_attention(model, 1 << 40) as n:
            whole = attn(h)
        with comfy_glue.bounded_vae_attention(model, 1 << 16):
            sliced = attn(h)
    assert n >= 1 and attn.optimized_attention.__name__ == "normal_attention"  # restored
    assert torch.equal(whole, ref)
    assert (sliced - ref).abs().max().item() <= 1e-5
