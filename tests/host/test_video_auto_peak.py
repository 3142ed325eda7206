"""Never hungrier than VAE Decode (issue 35): with the budget at least the host decode's peak, Temporal-Chunk
Video Decode's auto plan holds at most the live tensor bytes of the host's own decode, and is still exact.

On an H200 (docs/BENCHMARKS.md, "GPU results, second session") the auto plan (whole frames, k = 1, the
committed caches kept for an OOM resume) held 1.72x core ``VAEDecode``'s peak. Here, on tiny Wan 2.1 / 2.2
models from the host's own classes (``tests/video_refs.tiny_wan``), ComfyUI 0.3.75 and 0.33.0:

* the node's auto decode (``budget_mb = 0``: free memory) and the host's own ``first_stage_model.decode`` of
  the same latent, each counted by the same tracker (``PeakTracker(method="dispatch")``: live tensor bytes; the
  node's output buffer is made before its measured window, as the host's output lives on ComfyUI's
  intermediate device on a GPU): the node's peak <= the host's, frames within 1e-5 of the host's;
* the same at the real architecture's proportions (Wan 2.1 dim 96, Wan 2.2 dim 160; 480p latent, 13 frames) on
  fake tensors (``MetaSizer``: the same byte counts, nothing computed): the plan's prediction <= the host
  decode's, and the rollback cache the previous auto plan took is above it (the case the cap exists for).
"""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from tests.video_refs import tiny_wan

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.video_auto_peak")

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"
TOL = 1e-5


def _pack(mod, name: str):
    return sys.modules[mod.__name__.rsplit(".nodes.", 1)[0] + name]


def _vae(model: torch.nn.Module, channels: int) -> types.SimpleNamespace:
    """A duck-typed ComfyUI VAE around a Wan model (CPU, float32, no model patcher)."""
    return types.SimpleNamespace(
        first_stage_model=model, vae_dtype=torch.float32, device=torch.device("cpu"), latent_dim=3,
        latent_channels=channels, process_output=lambda x: torch.clamp((x + 1.0) / 2.0, 0.0, 1.0))


@pytest.fixture()
def mod(comfy, monkeypatch):
    """The node module with fresh in-memory peak and self-check stores and live tensor counting."""
    m = sys.modules[comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__]
    monkeypatch.setitem(_pack(m, ".nodes._decode_node")._STORES, "video_peaks.json",
                        _pack(m, ".memory.plan.video").PeakStore())
    checks = _pack(m, ".memory.decode.self_check")
    store = checks.CheckStore()
    monkeypatch.setattr(checks, "store_at", lambda path: store)
    monkeypatch.setattr(m, "MEASURE_CPU_TENSORS", True)
    return m


@pytest.mark.parametrize("version", ["2.1", pytest.param("2.2", marks=pytest.mark.slow)])
def test_auto_plan_holds_at_most_the_host_decode(mod, version):
    tracker = _pack(mod, ".memory.measure.tracker")
    model = tiny_wan(version)
    z = structured_latent((1, 4, 7, 12, 16), seed=3)
    with torch.inference_mode():  # as ComfyUI runs nodes
        with tracker.PeakTracker("cpu", method="dispatch") as t:
            ref = model.decode(z)
        host = t.peak_bytes
        r = mod.decode(_vae(model, 4), {"samples": z})
    frames = torch.clamp((ref + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1).reshape(r.images.shape)
    diff = (r.images - frames).abs().max().item()
    c = r.plan.config
    log.info("Wan %s tiny: host decode %d B, auto %d B (%.3fx; predicted %d B), %s, %s; max abs diff %.1e",
             version, host, r.measured_peak, r.measured_peak / host, r.plan.planned, r.plan.description,
             "rollback" if c.rollback else "in place", diff)
    assert "live tensor bytes" in r.measure_method
    assert r.plan.path in ("wan", "host") and r.plan.exact
    assert r.measured_peak <= host, (r.measured_peak, host, r.plan.description)
    assert c.tile is None  # whole-frame chunks or the host's own decode: the host's speed, not slower tiles
    assert diff <= TOL


@pytest.mark.parametrize("version", ["2.1", "2.2"])
def test_auto_plan_at_real_proportions_is_capped_by_the_host_decode(mod, version):
    """Fake tensors, the real architecture, 832x480 x 13 frames: the rollback plan the auto plan used to take
    holds more than the host's decode (so the cap decides), and the plan now predicts at most the host's."""
    pv = _pack(mod, ".memory.plan.video")
    module = importlib.import_module("comfy.ldm.wan.vae" if version == "2.1" else "comfy.ldm.wan.vae2_2")
    kw = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
    with torch.device("meta"):
        model = module.WanVAE(dim=96, z_dim=16, **kw) if version == "2.1" else module.WanVAE(dim=160, z_dim=48, **kw)
    model = model.to_empty(device="cpu").eval()  # the values are never read: every run below is on fake tensors
    c, r = (16, 8) if version == "2.1" else (48, 16)
    z = torch.empty((1, c, 4, 480 // r, 832 // r))
    with torch.inference_mode():
        job = mod._validate(_vae(model, c), {"samples": z}, 0, 0)
        peaks = pv.PeakStore()
        host = pv.plan_host_decode(job, 1 << 62, peaks, "").planned
        p = pv.plan(job, 1 << 62, peaks)
        rollback = pv.plan_wan(job, 1 << 62, 1, None, peaks)  # whole frames, k = 1, committed caches kept
    log.info("Wan %s 832x480x13 (fake tensors): host %.1f MiB, auto %.1f MiB (%s, %s), whole-frame rollback "
             "%.1f MiB", version, host / 2**20, p.planned / 2**20, p.description,
             "rollback" if p.config.rollback else "in place", rollback.planned / 2**20)
    assert rollback.config.rollback and rollback.planned > host
    assert p.planned <= host and p.config.tile is None  # whole-frame chunks or the host's decode: its speed


# --------------------------------------------------------------------------------------------------
# Calls and copies (issue 35, item 2): the executor's counts equal what the plan predicts


@pytest.mark.parametrize("version", ["2.1", pytest.param("2.2", marks=pytest.mark.slow)])
def test_calls_and_copies_equal_the_plans_prediction(mod, version):
    """``decode_wan_chunked``'s own counters (``stats["calls"]``, ``stats["moves"]``) against
    :func:`memory.plan.video.traffic` for whole frames and tile-major plans (store on the device, and in a
    store placed apart on the host: on this CPU no copy is made to read it, and none is predicted), squares
    and strips, k = 1..3: tiles cost a phase-1 call per chunk and one call per tile-chunk."""
    pv = _pack(mod, ".memory.plan.video")
    vc = _pack(mod, ".memory.executors.wan")
    types_ = _pack(mod, ".memory.plan.types")
    model = tiny_wan(version)
    z = structured_latent((1, 4, 6, 6, 8), seed=5)
    with torch.inference_mode():
        job = mod._validate(_vae(model, 4), {"samples": z}, 0, 0)
        lay = job.layout
        split = lay.default_split
        for k in (1, 2, 3):
            for tile, store in ((None, None), ((3, 4), "device"), ((6, 3), "device"), ((3, 8), "host")):
                grid = (1, 1) if tile is None else (-(-6 // tile[0]), -(-8 // tile[1]))
                cd = types_.Chunking(k, tile, grid, split, True, store)
                stats: dict = {}
                vc.decode_wan_chunked(model, z, k, tile, split=split, store_device="cpu" if store == "host" else None,
                                      stats=stats)
                want = pv.traffic(job, cd)
                log.info("Wan %s k=%d tile=%s store=%s: calls %d, moves %s", version, k, tile, store, stats["calls"],
                         stats["moves"])
                assert stats["calls"] == want["calls"], (k, tile)
                assert stats["moves"] == want["moves"], (k, tile)
