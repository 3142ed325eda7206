"""Exact tiled encode (``executors.kl_exact.encode_exact``, issue 24's engine) on the real ComfyUI KL encoders
(random-weight fixtures: SD KL, FLUX.1, FLUX.2 with its latent batch-norm, Hunyuan Image 2.1's 32x encoder with
its conv-then-space-to-depth downsamples and channel-mean shortcut) vs ComfyUI's own ``VAEEncode``.

The layout walks the encoder the other way round from the decoder (``kl_layout(..., direction="encode")``):
``conv_in`` and the down path in segments and tiles with shared GroupNorm statistics, then the mid block, the
output convolution and the host's own rest of ``encode`` once per item. Thresholds: max abs diff vs
``VAEEncode`` <= 1e-4 (float32), with >= 4 tiles at full resolution; an OOM inside a tile resumes from the
finished tiles and equals the uninterrupted run within 1e-5; a decoder-only walk (no GroupNorm statistics
shared: each tile normalised alone) differs, so the test can fail.
"""

from __future__ import annotations

import logging

import pytest
import torch
from vramfit.memory.executors import kl_exact as te
from vramfit.memory.vae import kl_layout as kll

from scripts.fixtures.narrow import narrow

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.tiled_encode_exact")

PX = (64, 96)
TILE = 16  # px at each activation's resolution: 4 x 6 tiles at full resolution


def _pixels(b: int, h: int, w: int, seed: int) -> torch.Tensor:
    """A smooth image with detail (B, H, W, 3) on [0, 1], as LoadImage gives."""
    g = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 1, h).view(1, h, 1, 1)
    x = torch.linspace(0, 1, w).view(1, 1, w, 1)
    base = 0.5 + 0.3 * torch.sin(6 * x + 4 * y + torch.rand(b, 1, 1, 3, generator=g) * 3)
    return (base + 0.1 * torch.rand(b, h, w, 3, generator=g)).clamp(0, 1)


def _vae(comfy, fixture_vaes, kind: str):
    """The fixture by ``VAELoader``; Hunyuan Image 2.1 as its narrow twin (the host's classes, a quarter of the
    channels: the same downsamples and reach)."""
    return fixture_vaes.load(comfy, narrow(kind))


def _exact(vae, pixels: torch.Tensor, **kw) -> torch.Tensor:
    """What the node will run: ComfyUI's own crop and input processing, then the exact walk."""
    with torch.inference_mode():
        x = vae.vae_encode_crop_pixels(pixels)[..., :3].movedim(-1, 1)
        x = vae.process_input(x).to(vae.vae_dtype).to(vae.device)
        return te.encode_exact(vae.first_stage_model, x, TILE, **kw).float().clone()


DOWNSAMPLES = {"kl_f8": 3, "flux": 3, "flux2": 3, "hunyuan_image": 5}


@pytest.mark.parametrize("kind", list(DOWNSAMPLES))
def test_exact_tiles_equal_vae_encode(comfy, fixture_vaes, kind):
    vae = _vae(comfy, fixture_vaes, kind)
    model = vae.first_stage_model
    layout = kll.kl_layout(model, direction="encode")
    assert layout.reason is None, layout.reason
    assert layout.segments[0].kind == "in" and sum(s.kind == "downsample" for s in layout.segments) == DOWNSAMPLES[kind]
    assert layout.ratio == int(vae.spacial_compression_encode())  # FLUX.2: 8x, then its latent 2x2 shuffle
    pixels = _pixels(2, *PX, seed=1)
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(vae, pixels)
    ref = ref["samples"].float()
    calls: list[tuple[int, int]] = []
    out = _exact(vae, pixels, progress=lambda d, t: calls.append((d, t)))
    assert out.shape == ref.shape
    steps = calls[-1][1]  # per item: the tail + every tile of every segment
    assert steps == 2 * layout.steps(ref.shape[2:], (TILE, TILE))
    assert layout.tile_counts(ref.shape[2:], (TILE, TILE))[0] == (PX[0] // TILE) * (PX[1] // TILE) >= 4
    diff = (out - ref).abs().max().item()
    log.info("%s: exact tiled encode vs VAEEncode: max abs %.2e over %d steps", kind, diff, steps)
    assert diff <= 1e-4


@pytest.mark.slow
def test_tiles_without_shared_statistics_differ(comfy, fixture_vaes):
    """The same walk, each tile normalised with its own statistics (what a naive tiled encode does, and core's
    ``VAEEncodeTiled`` per tile): the latent is off by far more than float noise."""
    vae = _vae(comfy, fixture_vaes, "kl_f8")
    pixels = _pixels(1, *PX, seed=2)
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(vae, pixels)
        (tiled,) = comfy.VAEEncodeTiled().encode(vae, pixels, 32, 8)
    core = (tiled["samples"].float() - ref["samples"].float()).abs().max().item()
    ours = (_exact(vae, pixels) - ref["samples"].float()).abs().max().item()
    log.info("core VAEEncodeTiled 32/8: max abs %.3g; exact tiles: %.2e", core, ours)
    assert core > 1e-2 and ours <= 1e-4


def test_oom_inside_a_tile_resumes_to_the_same_latent(comfy, fixture_vaes):
    vae = _vae(comfy, fixture_vaes, "kl_f8")
    pixels = _pixels(1, *PX, seed=3)
    clean = _exact(vae, pixels)
    fired: list[int] = []

    def hook(step: int) -> None:
        if step == 5 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected at tile step 5")

    calls: list[tuple[int, int]] = []
    out = _exact(vae, pixels, fault_hook=hook, progress=lambda d, t: calls.append((d, t)))
    assert fired == [5]
    assert (out - clean).abs().max().item() <= 1e-5
    assert calls[-1][0] == calls[-1][1]  # progress reaches its (grown) total


def test_an_unsupported_encoder_says_why(comfy, fixture_vaes):
    vae = _vae(comfy, fixture_vaes, "wan21")
    reason = kll.kl_layout(vae.first_stage_model, direction="encode").reason
    assert reason is not None
    with pytest.raises(ValueError, match="exact tiled encode does not support"):
        te.encode_exact(vae.first_stage_model, torch.zeros(1, 3, 16, 16), TILE)


def test_hunyuan_image_tiles_need_the_downsamples_context(comfy, fixture_vaes, monkeypatch):
    """Hunyuan Image 2.1's downsample reads whole 2x2 cells around its conv's 1-px reach; reading the core's cells
    only (no context) differs, so the exact test above can fail."""
    vae = _vae(comfy, fixture_vaes, "hunyuan_image")
    pixels = _pixels(1, *PX, seed=4)
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(vae, pixels)
    real = kll.read_span
    monkeypatch.setattr(te, "read_span", lambda info, name, a, b, n: (
        (2 * a, 2 * b) if info.kind == "downsample" and info.halo else real(info, name, a, b, n)))
    diff = (_exact(vae, pixels) - ref["samples"].float()).abs().max().item()
    assert diff > 1e-3, diff


def test_a_store_in_host_memory_only_where_the_hosts_ram_holds_it(comfy, fixture_vaes, monkeypatch):
    """Planning an encode for an accelerator under a budget no store on the device meets: the store in host memory
    when the host's RAM holds it, else only device stores (none fits: the error), the out-of-memory re-plan
    likewise; the plan row says why. Sizes are stand-ins (the host store's meta sizing: test_memory_sizing): 900
    bytes on the device, 300 with the store in host memory, which takes 50 MB of RAM."""
    import dataclasses

    from vramfit.memory.decode.encode import make_job
    from vramfit.memory.plan import encode as pen
    from vramfit.memory.plan.grid import ImpossibleBudgetError
    from vramfit.memory.plan.types import Plan
    from vramfit.memory.plan.video import PeakStore

    vae = _vae(comfy, fixture_vaes, "kl_f8")
    monkeypatch.setattr(pen, "encode_peak", lambda job, cfg, *a, **k: 300 if cfg is not None and cfg.store == "host"
                        else 900)
    monkeypatch.setattr(pen, "encode_host_bytes", lambda job, cfg, *a, **k: 50 << 20)
    x = torch.zeros(1, 3, *PX)
    job = dataclasses.replace(make_job(vae, x, "cpu"), device=torch.device("cuda"))  # planning only
    assert job.exact_reason is None
    free = pen.plan(job, 400, PeakStore())
    assert free.config.store == "host" and "not used" not in free.description
    assert pen.plan(dataclasses.replace(job, host_room=50 << 20), 400, PeakStore()).config.store == "host"
    tight = dataclasses.replace(job, host_room=(50 << 20) - 1)
    with pytest.raises(ImpossibleBudgetError):
        pen.plan(tight, 400, PeakStore())
    forced = pen.plan(dataclasses.replace(tight, tile_size=32), 400, PeakStore())
    assert forced.config.store == "device" and forced.over_budget
    assert "store in host memory not used: it needs 50.0 MiB, the host's RAM has room for 50.0 MiB" in \
        forced.description
    on_device = Plan("exact", pen.ExactEncode(32, "device"), "", 900)
    assert pen.smaller(job, on_device, PeakStore()).config.store == "host"
    assert pen.smaller(tight, on_device, PeakStore()).config == pen.ExactEncode(16, "device")
