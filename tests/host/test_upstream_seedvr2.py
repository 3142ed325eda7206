"""The rewritten upstream SeedVR2 video VAE (``comfy/ldm/seedvr/vae.py`` 1fa9472c, ``tests/upstream/files``) decoded
exactly under a budget again (issue 41 item 4), loaded over a ComfyUI 0.33.0 host by ``scripts.upstream.newest`` and
built as the newest ``comfy/sd.py`` builds it (``scripts.upstream_seedvr2``: a narrow random-weight
``comfy.sd.VAE``, the module's own classes and keys).

The pack tells this variant from 0.33.0's by its structure (blocks' ``run``, SiLU folded into the norm wrapper, a
``CausalMemoryCache``), walks it with the same executor, checks it at first use against the host's own decode, and
uses the model's own hints (its reliable decode estimate, its preferred tile), saying so in the plan row. References
are core ``VAEDecode`` / ``VAEEncode`` under the same overlay. Skipped on a host without SeedVR2 (0.3.75)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import time

import pytest
import torch

from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

log = logging.getLogger("vramfit.tests.upstream_seedvr2")

VIDEO = "VRAMFit_TemporalChunkVideoDecode"
SHAPE = (1, 16, 3, 6, 5)
"""3 latent frames (the host's 2 time slices: 2 + 1, carried frames used), 9 frames of 48x40 px (32-px tiles: 2x2)."""


@pytest.fixture(scope="module")
def upstream(comfy):
    if importlib.util.find_spec("comfy.ldm.seedvr") is None or importlib.util.find_spec("comfy.ldm.minimax") is None:
        pytest.skip("this host has no comfy.ldm.seedvr / comfy.ldm.minimax: the newest upstream VAE files load over "
                    "a ComfyUI 0.33.0 host only (0.3.75 predates SeedVR2's VAE)")
    from scripts.upstream import newest
    from scripts.upstream_seedvr2 import build, no_pinned_offload

    with newest() as mods, no_pinned_offload():
        vae = build()
        assert type(vae.first_stage_model) is mods["comfy.ldm.seedvr.vae"].VideoAutoencoderKLWrapper
        yield vae


@pytest.fixture(scope="module")
def pack(comfy):
    """``name -> the pack's module`` as ComfyUI loaded it (under its folder name, not ``vramfit``)."""
    root = sys.modules[comfy.NODE_CLASS_MAPPINGS[VIDEO].__module__].__name__.rsplit(".", 2)[0]
    return lambda name: importlib.import_module(f"{root}.{name}")


@pytest.fixture(scope="module")
def case(comfy, upstream):
    z = structured_latent(SHAPE, seed=5)
    with torch.inference_mode():
        t0 = time.perf_counter()
        (ref,) = comfy.VAEDecode().decode(upstream, {"samples": z})
        log.info("core VAEDecode of the newest SeedVR2 (narrow), latent %s: %.1f s", SHAPE, time.perf_counter() - t0)
    return z, ref


def _walk(pack, model, z, tile, **kw):
    lay = pack("memory.vae.seedvr2_layout").seedvr2_layout(model)
    out = torch.full((int(z.shape[0]), 3, lay.frames(int(z.shape[2])), int(z.shape[3]) * 8, int(z.shape[4]) * 8),
                     float("nan"))
    with torch.inference_mode():
        pack("memory.executors.seedvr2").decode_seedvr2(model, z, tile, out=out, compute_device="cpu",
                                                        dtype=torch.float32, **kw)
    return out


def test_the_rewritten_file_is_described_as_its_own_variant(pack, upstream):
    """Found by structure: the rewritten file's blocks (``run``, no ``conv_act``/``nonlinearity`` modules, no
    ``use_slicing``), its cache object and its hints; the same segments as 0.33.0's decoder."""
    lay_m = pack("memory.vae.seedvr2_layout")
    model = upstream.first_stage_model
    assert not hasattr(model, "use_slicing") and not hasattr(model.decoder, "conv_act")
    assert lay_m.seedvr2_of(model) == lay_m.FAMILY
    lay = lay_m.seedvr2_layout(model)
    assert lay.reason is None and lay.variant == "run", lay.reason
    assert lay.cache_type is sys.modules["comfy.ldm.seedvr.vae"].CausalMemoryCache
    assert lay.slices(4) == [(0, 2, "INITIALIZING"), (2, 3, "ACTIVE"), (3, 4, "ACTIVE")]
    assert lay.frames(3) == 9
    kinds = [s.kind for s in lay.segments]
    assert kinds.count("up") == 3 and kinds[-1] == "out" and kinds.count("res1") == kinds.count("res2") == 12
    assert lay.hints.names() == ["comfy_memory_used_decode", "comfy_decode_estimate_is_reliable",
                                 "preferred_decode_tile"]


def test_walk_equals_the_hosts_decode(pack, upstream, case):
    """Whole frames and 16-px tiles, 2 time slices, and a batch of two of 1 latent frame (one slice): the raw walk
    equals ``first_stage_model.decode`` within 1e-4."""
    model = upstream.first_stage_model
    z, _ = case
    with torch.inference_mode():
        ref = model.decode(z)
    for tile in (None, (16, 16)):
        stats: dict = {}
        d = (_walk(pack, model, z, tile, stats=stats) - ref).abs().max().item()
        log.info("newest SeedVR2 walk, tile %s: max abs %.3g vs first_stage_model.decode", tile, d)
        assert stats["chunks"] == 2 and d <= 1e-4, (tile, d)
    z2 = structured_latent((2, 16, 1, 3, 4), seed=8)
    with torch.inference_mode():
        ref2 = model.decode(z2)
    assert (_walk(pack, model, z2, (8, 8)) - ref2).abs().max().item() <= 1e-4


def test_video_node_exact_in_tiles_below_the_hosts_peak(pack, upstream, case):
    """Temporal-Chunk Video Decode at a budget below the host decode's own peak: >= 4 tiles, the first-use
    self-check passed, equal to core VAE Decode within 1e-4, the report exact and the model's hints named."""
    video = pack("nodes.video_decode")
    vj = pack("memory.decode.video")
    ps = pack("memory.plan.seedvr2")
    pv = pack("memory.plan.video")
    z, ref = case
    job = vj.make_job(upstream, z, "cpu")
    whole = ps.seedvr2_peak(job, ps.SeedVR2Config(None, "device", 2), pv.PeakStore())
    tiled = ps.seedvr2_peak(job, ps.SeedVR2Config((32, 32), "device", 2, (2, 2)), pv.PeakStore())
    host = pv.host_decode_peak(job, pv.PeakStore())
    out_b = ref.numel() * 4
    budget = (whole + tiled) // 2 + out_b
    log.info("newest SeedVR2 peaks (meta): host decode %.1f MiB, walk whole %.1f, 32-px tiles %.1f; budget %.1f MiB",
             host / 2**20, whole / 2**20, tiled / 2**20, budget / 2**20)
    assert tiled < whole and budget < host + out_b, (tiled, whole, host)
    with torch.inference_mode():
        r = video.decode(upstream, {"samples": z}, budget_mb=budget / 2**20)
    text = r.report.text()
    assert r.plan.path == "seedvr2" and r.plan.exact, text
    cfg = r.plan.config
    assert cfg.tile == (32, 32) and cfg.grid[0] * cfg.grid[1] >= 4, text
    rows = dict(r.report.rows)
    assert "self-check passed" in rows["check"] and r.report.summary.startswith("exact"), text
    assert "comfy_memory_used_decode, reliable): over the budget, so the walk" in rows["plan"], text
    assert "preferred_decode_tile" in rows["plan"] and "preferred_decode_tile" in rows["hints"], text
    assert r.images.shape == ref.shape
    d = (r.images - ref).abs().max().item()
    log.info("newest SeedVR2 node, %dx%d tiles of 32 px: max abs %.3g vs VAE Decode; measured %s", *cfg.grid, d,
             rows.get("measured"))
    assert d <= 1e-4, text


def test_a_budget_the_models_own_estimate_fits_takes_its_own_decode(pack, upstream, case):
    """The model's estimate is marked reliable: where it fits the budget, its own decode runs (VAE Decode's result by
    construction, no self-check of the walk) and the plan row says why; a tile size asked for keeps the walk."""
    video = pack("nodes.video_decode")
    z, ref = case
    est = upstream.first_stage_model.comfy_memory_used_decode(tuple(z.shape), torch.float32)
    with torch.inference_mode():
        r = video.decode(upstream, {"samples": z}, budget_mb=2 * est / 2**20)
        asked = video.decode(upstream, {"samples": z}, budget_mb=2 * est / 2**20, tile_size=16)
    text = r.report.text()
    assert r.plan.path == "host" and "comfy_decode_estimate_is_reliable), fits the budget" in text, text
    assert dict(r.report.rows)["check"] == "exact tiled executor not used", text  # relied on: nothing to check
    assert torch.equal(r.images, ref), text
    text = asked.report.text()
    assert asked.plan.path == "seedvr2" and "a tile size was asked for" in text, text
    assert (asked.images - ref).abs().max().item() <= 1e-4, text


def test_an_oom_inside_a_tile_resumes(pack, upstream, case):
    """An out-of-memory error in a tile (the node's fault hook): the tile is halved, finished tiles kept, the result
    still VAE Decode's."""
    video = pack("nodes.video_decode")
    z, ref = case
    fired: list[int] = []

    def hook(kind: str, step: int) -> None:
        if kind == "step" and step == 30 and not fired:
            fired.append(step)
            raise torch.OutOfMemoryError("injected")

    old, video._FAULT_HOOK = video._FAULT_HOOK, hook
    try:
        with torch.inference_mode():
            r = video.decode(upstream, {"samples": z}, tile_size=32)
    finally:
        video._FAULT_HOOK = old
    text = r.report.text()
    assert fired == [30] and r.plan.path == "seedvr2", text
    assert "1 out-of-memory error(s): tile halved" in dict(r.report.rows).get("oom", ""), text
    assert (r.images - ref).abs().max().item() <= 1e-4, text


def test_packed_carried_frames_take_the_hosts_decode(pack, upstream, case, monkeypatch):
    """Where the host would int8-pack carried frames (its ``CausalMemoryCache`` on an accelerator), tiles cannot
    reproduce that rounding: the plan is the host's own decode with the reason (a CPU build cannot make the CUDA
    tensors the check asks about: the check's answer is stood in)."""
    import dataclasses

    ps = pack("memory.plan.seedvr2")
    pv = pack("memory.plan.video")
    z, _ = case
    job = pack("memory.decode.video").make_job(upstream, z, "cpu")
    assert ps.packed_tails(job, ps.seedvr2_layout(upstream.first_stage_model)) is None  # nothing packed on a CPU
    monkeypatch.setattr(ps, "packed_tails", lambda job, lay: "the host int8-packs carried frames of this size")
    p = ps.plan_seedvr2(dataclasses.replace(job, device=torch.device("cuda")), 1 << 20, pv.PeakStore())
    assert p.path == "host" and p.reason.startswith("the host int8-packs"), p


@pytest.mark.parametrize("node", ["VRAMFit_TiledVAEEncode", "VRAMFit_TemporalChunkVideoEncode"])
def test_encode_nodes_equal_vae_encode(comfy, pack, upstream, node):
    """Tiled VAE Encode and Temporal-Chunk Video Encode on it: core VAE Encode's latent (the host's own encode, the
    report saying why)."""
    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS[node].__module__]
    pixels = torch.rand((9, 48, 40, 3), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(upstream, pixels)
        r = mod.encode(upstream, pixels, **({"node": mod.VIDEO_REPORT_NODE} if hasattr(mod, "VIDEO_REPORT_NODE")
                                            else {}))
    text = r.report.text()
    got = r.latent
    assert "the host's own encode" in dict(r.report.rows)["path"], text
    assert got.shape == ref["samples"].shape, text
    assert (got - ref["samples"]).abs().max().item() <= 1e-4, text
    log.info("%s on the newest SeedVR2: %s", node, text)
