"""Tiled VAE Encode (VRAM Fit) as ComfyUI runs it (in-process host, ``torch.inference_mode``), vs core
``VAEEncode`` on the random-weight fixtures.

* free memory: the encoder's own forward (untiled), the same latent as ``VAEEncode`` (``torch.equal``);
* a budget below the untiled encode's peak: exact tiles (>= 4 at full resolution), max abs diff <= 1e-4, the
  measured live-tensor peak within the budget, the report saying exact with the self-check;
* an OOM inside a tile resumes from the finished tiles (same latent within 1e-5); one outside a tile (the
  untiled pass) re-plans to tiles;
* a VAE the walker cannot run (attention in its down path) takes the host's own encode (``torch.equal``);
* bad input names the node and the value.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from tests.host.test_tiled_encode_exact import _pixels

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.node_tiled_encode")

NODE_ID = "VRAMFit_TiledVAEEncode"
MiB = 2**20
PX = (2, 96, 128)  # batch 2


@pytest.fixture(scope="module")
def node(comfy):
    return comfy.NODE_CLASS_MAPPINGS[NODE_ID]


@pytest.fixture(scope="module")
def mod(node):
    m = sys.modules[node.__module__]
    yield m
    m._FAULT_HOOK = None


@pytest.fixture(scope="module")
def case(comfy, kl_vae):
    pixels = _pixels(*PX, seed=5)
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(kl_vae, pixels)
    return pixels, ref["samples"].clone()


def _encode(mod, vae, pixels, **kw):
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        return mod.encode(vae, pixels, **kw)


def test_schema_and_registration(node):
    schema = node.define_schema()
    assert schema.node_id == NODE_ID and schema.display_name == "Tiled VAE Encode (VRAM Fit)"
    names = [i.id for i in schema.inputs]
    assert names == ["pixels", "vae", "tile_size", "budget_mb", "unload_others"]
    assert all(getattr(i, "tooltip", None) for i in schema.inputs)


def test_free_memory_is_the_encoders_own_forward(mod, kl_vae, case):
    pixels, ref = case
    r = _encode(mod, kl_vae, pixels)
    assert r.plan.path == "untiled"
    assert r.latent.dtype == ref.dtype and r.latent.shape == ref.shape
    assert torch.equal(r.latent, ref)
    assert r.report.summary.startswith("exact · untiled")
    assert "ComfyUI's estimate" in dict(r.report.rows)["predicted"]  # fits by the host's own figure: not sized


def test_a_budget_below_the_untiled_peak_takes_exact_tiles(mod, kl_vae, case):
    from vramfit.memory.plan import encode as pe

    pixels, ref = case
    # The untiled encode's sized peak (with free memory the auto plan takes the host's own, larger figure).
    job = mod._validate(kl_vae, pixels[:1], 0)
    untiled = pe._out_bytes(job) + pe.encode_peak(job, None, pe.PeakStore(), pe.attention_bytes(1 << 30))
    budget_mb = max(1, int(untiled * 0.85 / MiB))  # exact tiles hold 0.67-0.8x the untiled peak (CPU)
    r = _encode(mod, kl_vae, pixels, budget_mb=budget_mb)
    rows = dict(r.report.rows)
    log.info("%s", r.report.text())
    assert r.plan.path == "exact" and r.plan.planned <= budget_mb * MiB
    tiles = -(-PX[1] // r.plan.config.tile) * -(-PX[2] // r.plan.config.tile)
    assert tiles >= 4, r.plan.description
    assert (r.latent - ref).abs().max().item() <= 1e-4
    assert r.measured_peak is not None and r.measured_peak <= budget_mb * MiB
    assert rows["path"].startswith("exact: layer-synchronous") and "self-check passed" in rows["check"]


def test_oom_inside_a_tile_and_outside_resume(mod, kl_vae, case):
    pixels, ref = case
    fired: list[tuple[str, int]] = []

    def hook(kind: str, k: int) -> None:
        if (kind, k) in (("tile", 7), ("pass", 0)) and (kind, k) not in fired:
            fired.append((kind, k))
            raise torch.OutOfMemoryError(f"injected at {kind} {k}")

    mod._FAULT_HOOK = hook
    try:
        inside = _encode(mod, kl_vae, pixels, tile_size=32)
        outside = _encode(mod, kl_vae, pixels)  # untiled: the pass's OOM re-plans to exact tiles
    finally:
        mod._FAULT_HOOK = None
    assert ("tile", 7) in fired and ("pass", 0) in fired
    assert (inside.latent - ref).abs().max().item() <= 1e-4
    assert "tile halved" in dict(inside.report.rows)["oom"]
    assert outside.plan.path == "exact" and outside.oom_events, outside.report.text()
    assert (outside.latent - ref).abs().max().item() <= 1e-4
    assert "oom" in dict(outside.report.rows)


def test_an_encoder_the_walker_cannot_run_takes_the_hosts_encode(comfy, fixture_vaes, mod):
    """A KL encoder with attention in its down path (an identity here, so the latent is the fixture's): the walker
    refuses it, with the reason, and the host's own encode runs."""
    vae = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]  # a fresh model object: walked after the change
    enc = vae.first_stage_model.encoder
    enc.down[0].attn = torch.nn.ModuleList([torch.nn.Identity() for _ in enc.down[0].block])
    pixels = torch.cat([_pixels(1, 64, 64, seed=6), torch.ones(1, 64, 64, 1)], dim=-1)  # RGBA, as LoadImage can
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(vae, pixels)
    r = _encode(mod, vae, pixels)
    rows = dict(r.report.rows)
    assert r.plan.path == "host" and "does not support" in rows["path"] and "attention" in rows["path"], rows
    assert torch.equal(r.latent, ref["samples"])


@pytest.mark.parametrize(
    "pixels,tile,needle",
    [
        (torch.zeros(1, 3, 64, 64), 0, "pixels (1, 3, 64, 64)"),  # channels first: not an IMAGE
        (torch.zeros(1, 64, 64, 3), 20, "tile_size 20"),
    ],
)
def test_bad_input_names_node_and_value(mod, kl_vae, pixels, tile, needle):
    with pytest.raises(ValueError) as e:
        mod.encode(kl_vae, pixels, tile_size=tile)
    assert "Tiled VAE Encode" in str(e.value) and needle in str(e.value)


def test_cancel_stops_the_encode_between_tiles(mod, kl_vae, case):
    """Cancel (ComfyUI's interrupt, checked before every tile) stops the encode; the next one runs whole."""
    import dataclasses

    from vramfit.memory.decode.encode import encode_image

    class Interrupted(Exception):
        pass

    pixels, ref = case
    calls = []

    def stop() -> None:
        calls.append(1)
        if len(calls) == 10:
            raise Interrupted

    job = mod._validate(kl_vae, pixels, 32)
    env = dataclasses.replace(mod.comfy_env(), should_stop=stop)
    with pytest.raises(Interrupted), torch.inference_mode():
        encode_image(job, env)
    assert len(calls) == 10
    assert (_encode(mod, kl_vae, pixels, tile_size=32).latent - ref).abs().max().item() <= 1e-4


def test_inpaint_companion_equals_vae_encode_for_inpaint(comfy, kl_vae, case):
    """VAE Encode for Inpaint (VRAM Fit): the host's own preprocessing, the encode in exact tiles: the same
    latent (<= 1e-4) and the same noise mask as core ``VAEEncodeForInpaint``."""
    pixels = case[0][:1, :, :100]  # 96x100: the host crops to 96x96
    mask = torch.zeros(1, 96, 100)
    mask[:, 20:60, 30:70] = 1.0
    (ref,) = _inference(lambda: comfy.VAEEncodeForInpaint().encode(kl_vae, pixels, mask, 6))
    inpaint = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_VAEEncodeForInpaint"].__module__]
    latent, result = _inference(lambda: inpaint.encode_inpaint(kl_vae, pixels, mask, 6, tile_size=32))
    assert result.plan.path == "exact" and result.report.node == "VAE Encode for Inpaint", result.report.text()
    assert torch.equal(latent["noise_mask"], ref["noise_mask"])
    assert (latent["samples"] - ref["samples"]).abs().max().item() <= 1e-4


def _inference(fn):
    with torch.inference_mode():
        return fn()


def test_progress_is_one_bar_that_reaches_its_total(mod, kl_vae, case):
    """One bar over the batch (two images, each in tiles), rising to its total: the run step's progress, as the
    decodes' (``memory.decode.execute.Progress``)."""
    import comfy.utils

    pixels, _ = case
    events: list[tuple[int, int | None]] = []
    orig = comfy.utils.ProgressBar.update_absolute

    def spy(self, value, total=None, preview=None):
        events.append((value, total))
        return orig(self, value, total, preview)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comfy.utils.ProgressBar, "update_absolute", spy)
        r = _encode(mod, kl_vae, pixels, tile_size=64)
    values = [v for v, _ in events]
    assert r.plan.path == "exact" and len(events) > 4, r.report.text()
    assert values == sorted(values) and events[-1][0] == events[-1][1], events
    assert len({t for _, t in events}) == 1, events  # one total, known from the start
