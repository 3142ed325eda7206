"""Exact tiled decode on the real ComfyUI KL VAE (random-weight fixture) vs ComfyUI's own ``VAEDecode``.

Thresholds (images on [0, 1] after ComfyUI's ``process_output``):

* PSNR vs core ``VAEDecode`` >= 60 dB (measured ~130 dB: float32 noise);
* seam ratio <= 1.2: mean abs error in 8-px bands centred on every tile border of every level /
  mean abs error elsewhere, each plus a floor of 1e-5 (1/400 of an 8-bit step) so float noise of
  ~1e-7 cannot make a ratio of two near-zeros meaningful; the generic path's real seams give > 1.2
  with the same metric (``test_tiled_generic_host.py``);
* OOM-resumed run vs uninterrupted run: max abs diff <= 1e-5.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vramfit.memory.cost import exact as dp
from vramfit.memory.executors import kl_exact as te
from vramfit.memory.measure import reach as rc
from vramfit.memory.vae import kl_layout as kll

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.weights import build_model
from tests.helpers import exact_tile_borders, psnr, seam_ratio

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.tiled_exact")

LATENT = (2, 4, 21, 29)  # 168 x 232 px, not a multiple of the tile
TILE = (64, 64)  # px at each level's resolution: 3 x 4 tiles at full resolution


@pytest.fixture(scope="module")
def reference(comfy, kl_vae):
    z = structured_latent(LATENT, seed=3)
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        (image,) = comfy.VAEDecode().decode(kl_vae, {"samples": z})
    return z, image.clone()


def exact_image(vae, z, **kw) -> torch.Tensor:
    """decode_exact + ComfyUI's own post-processing, as the node does (under ``torch.inference_mode``):
    (B, H, W, 3) on [0, 1]."""
    with torch.inference_mode():
        out = te.decode_exact(vae.first_stage_model, z.to(vae.vae_dtype).to(vae.device), TILE, **kw)
        image = vae.process_output(out.float()).movedim(1, -1)
    return image.clone()


@pytest.fixture(scope="module")
def exact_clean(kl_vae, reference):
    z, _ = reference
    calls: list[tuple[int, int]] = []
    out = exact_image(kl_vae, z, progress=lambda d, t: calls.append((d, t)))
    return out, calls


def test_fixture_is_supported(kl_vae):
    assert kll.supports_exact(kl_vae.first_stage_model), kll.unsupported_reason(kl_vae.first_stage_model)


@pytest.mark.parametrize("kind", ["kl_f8", "flux", "flux2"])
def test_shipped_exact_cost_models_match_this_executor(comfy, kind):
    """The shipped models (memory/cost/data/exact/: kl_cpu.json, flux_cpu.json, flux2_cpu.json) are keyed by
    the executor's version and each KL fixture's class and structure: after a change to either they must be
    regenerated (``bench/tiled_decode.py --write-defaults``), else every first decode calibrates (12-30 s on
    CPU) and the default test run plans with fresh calibrations. The models are built on ``meta`` as ComfyUI's
    loader builds them (the loaded fixtures: ``test_first_use_shipped.py``)."""
    model = build_model(kind, "meta")
    shipped = dp.ExactCostStore(None)  # the shipped defaults only
    keys = {dp.exact_key(model, torch.float32, "cpu", recompute, True) for recompute in (False, True)}
    for key in keys:
        assert shipped.get(key) is not None, f"no shipped exact cost model {key}: run --write-defaults"
    assert len(keys) == 2 and all(shipped.get(k).key == k for k in keys)


def test_exact_matches_core_vae_decode(kl_vae, reference, exact_clean):
    z, ref = reference
    out, calls = exact_clean
    plan = kll.exact_geometry(kl_vae.first_stage_model, z.shape, TILE)
    assert plan.tiles_per_segment[-1] == 12  # 3 x 4 tiles per image at full resolution
    assert out.shape == ref.shape == (2, 168, 232, 3)
    value = psnr(out, ref)
    ys, xs = exact_tile_borders(plan, 8)
    ratio = seam_ratio(out, ref, ys, xs)
    log.info("exact vs VAEDecode: PSNR %.1f dB, max abs %.2e, seam ratio %.3f", value,
             (out - ref).abs().max().item(), ratio)
    assert value >= 60.0
    assert ratio <= 1.2
    # Progress: one call per unit, ending at the total announced up front.
    assert calls[0] == (0, plan.total_steps) and calls[-1] == (plan.total_steps, plan.total_steps)
    assert len(calls) == plan.total_steps + 1


def test_host_store_with_oom_resume_matches_uninterrupted(kl_vae, reference, exact_clean):
    """Store explicitly on the host (pinned allocation attempted: falls back to pageable without CUDA),
    OOM injected in the middle of the first full-resolution segment, tile halved, decode resumed."""
    z, ref = reference
    clean, _ = exact_clean
    plan = kll.exact_geometry(kl_vae.first_stage_model, (1, *z.shape[1:]), TILE)
    first_full = next(i for i, s in enumerate(plan.segments) if s.level_scale == 8)
    fail_at = sum(plan.tiles_per_segment[:first_full]) + 5  # 6th tile of the first full-res segment
    seen: list[int] = []
    freed: list[int] = []

    class FakeOOM(RuntimeError):
        pass

    def hook(k: int) -> None:
        seen.append(k)
        if k == fail_at:
            raise FakeOOM("injected")

    # Batch item 0 alone (statistics are per item, so it must equal item 0 of the batch-2 run).
    out = exact_image(kl_vae, z[:1], store_device="cpu", pin_memory=True, fault_hook=hook,
                      oom_exceptions=(FakeOOM,), on_oom=lambda: freed.append(1))
    assert fail_at in seen and freed == [1]
    assert (out - clean[:1]).abs().max().item() <= 1e-5
    assert psnr(out, ref[:1]) >= 60.0


def test_seam_metric_detects_a_faint_seam(kl_vae, reference, exact_clean):
    """Control for the seam threshold: a 2-px line off by one 8-bit step on one tile border fails it."""
    z, ref = reference
    out = exact_clean[0].clone()
    plan = kll.exact_geometry(kl_vae.first_stage_model, z.shape, TILE)
    ys, xs = exact_tile_borders(plan, 8)
    y = min(ys)
    out[:, y - 1 : y + 1, :, :] += 1.0 / 255.0
    assert seam_ratio(out, ref, ys, xs) > 1.2


def test_should_stop_interrupts(kl_vae):
    z = structured_latent((1, 4, 8, 8), seed=5)

    class Interrupted(Exception):
        pass

    n = 0

    def stop():
        nonlocal n
        n += 1
        if n > 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        te.decode_exact(kl_vae.first_stage_model, z, (16, 16), should_stop=stop)
    assert n == 4


def test_reach_of_the_kl_decoder(kl_vae):
    """Structure walk, execution trace and an impulse experiment agree: up path 12.25 latent px."""
    model = kl_vae.first_stage_model
    s = rc.structural_reach(model)
    assert s.up_path == pytest.approx(12.25) and s.pre_up == pytest.approx(5.0)
    assert s.global_ops == ("mid.attn_1",)
    z = structured_latent((1, 4, 15, 15), seed=6)
    t = rc.traced_reach(model, lambda: model.decode(z), (15, 15), up_path_from="decoder.mid.block_2")
    assert t.up_path == pytest.approx(12.25) and t.pre_up == pytest.approx(5.0)

    # Impulse at latent pixel (1, 1) of the mid block's output; the far sides have 13 latent px.
    pos = (1, 1)
    on = {"add": False}

    def add_impulse(_m, _i, out):
        if not on["add"]:
            return out
        out = out.clone()
        out[:, :, pos[0], pos[1]] += 1.0
        return out

    handle = model.decoder.mid.block_2.register_forward_hook(add_impulse)
    freezer = rc.GroupNormFreezer(model.decoder)
    try:
        with torch.no_grad():
            with freezer.record():
                model.decode(z)
            with freezer.replay():
                base = model.decode(z)
                on["add"] = True
                pert = model.decode(z)
    finally:
        handle.remove()
    delta = pert - base
    assert rc.impulse_extent(delta, pos, 8) == pytest.approx(12.25)
    log.info("impulse extent at rel tol 1e-3: %.3f latent px", rc.impulse_extent(delta, pos, 8, 1e-3))
