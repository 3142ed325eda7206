"""Exact chunked + tiled Wan decode on *tiny* Wan 2.1 / 2.2 models built from ComfyUI's own classes.

``comfy.ldm.wan.vae.WanVAE`` / ``comfy.ldm.wan.vae2_2.WanVAE`` with ``dim=8`` (the real code, every
layer and cache protocol of the releases, 8-32 channels instead of 96-1024), weights initialised as
the fixture generator does. Small enough to test the whole matrix (versions x chunk sizes x tiles x
split points x batch), the convolutional reach by impulses, and OOM re-planning in a few seconds each.
The real-size fixture VAEs are compared with ComfyUI's ``VAEDecode`` in ``test_video_chunked_host.py``.

Thresholds (outputs in [-1, 1], float32, CPU): chunked/tiled vs ComfyUI's ``WanVAE.decode`` max abs
diff <= 1e-5 (measured: 0 to 1e-6); OOM-resumed vs uninterrupted <= 1e-5; a halo of 0 must be visibly
wrong (> 1e-3; measured ~0.3) so the exact cases cannot pass by accident; the impulse extent equals
the structural reach within 1/8 latent px (one output pixel).
"""

from __future__ import annotations

import importlib
import logging
import math

import pytest
import torch
from vramfit.memory import tiles
from vramfit.memory.executors import blend
from vramfit.memory.executors import wan as vc
from vramfit.memory.measure.reach import impulse_extent
from vramfit.memory.plan.types import Chunking
from vramfit.memory.vae import wan_layout as wl

from tests.video_refs import tiny_wan

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]  # tiny tensors: one intra-op thread
log = logging.getLogger("vramfit.tests.video_chunked_tiny")

TOL = 1e-5


class FakeOOM(RuntimeError):
    pass


class Stop(Exception):
    pass


@pytest.fixture(scope="module", params=["2.1", "2.2"])
def tiny(request, host_config):
    from scripts.host import import_comfy

    import_comfy(host_config)
    return request.param, tiny_wan(request.param)


@pytest.fixture(scope="module")
def case21(host_config):
    """Wan 2.1 only, for the version-independent control flow (OOM, stop, progress, cache modes)."""
    from scripts.host import import_comfy

    import_comfy(host_config)
    model = tiny_wan("2.1")
    z = _z((1, 4, 4, 5, 7))
    with torch.no_grad():
        ref = model.decode(z)
    return "2.1", model, z, ref


def _z(shape, seed=0):
    from scripts.fixtures.latents import structured_latent

    return structured_latent(shape, seed=seed)


@pytest.fixture(scope="module")
def case(tiny):
    """An odd-sized latent with 4 latent frames (13 output frames) and ComfyUI's own decode of it."""
    version, model = tiny
    z = _z((1, 4, 4, 5, 7))
    with torch.no_grad():
        ref = model.decode(z)
    return version, model, z, ref


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------------------------------
# Layout


def test_layout_matches_comfy_decoder(tiny):
    version, model = tiny
    lay = wl.wan_layout(model)
    assert lay.version == version
    assert (lay.temporal_ratio, lay.decoder_ratio) == (4, 8)
    assert lay.patch == (1 if version == "2.1" else 2) and lay.spatial_ratio == 8 * lay.patch
    assert lay.out_channels == 3
    mod = importlib.import_module(type(model).__module__)
    count = getattr(mod, "count_conv3d", None) or mod.count_cache_layers  # renamed in ComfyUI 0.33
    assert lay.n_cache == count(model.decoder)
    # Every cache entry ComfyUI's own decoder leaves behind (frame 0 alone, then a call of two latent
    # frames: full entries under both cache protocols) has the channels and scale the walk predicts.
    feat = [None] * lay.n_cache
    h, w = 3, 5
    x = model.conv2(_z((1, 4, 3, h, w)))
    with torch.no_grad():
        for a, b in ((0, 1), (1, 3)):
            kw = {"first_chunk": a == 0} if version == "2.2" else {}
            model.decoder(x[:, :, a:b], feat_cache=feat, feat_idx=[0], **kw)
    used = [e for e in feat if e is not None]
    assert len(used) == len(lay.slots)
    total = 0
    for slot, e in zip(lay.slots, feat, strict=False):
        assert isinstance(e, torch.Tensor), slot
        assert tuple(e.shape) == (1, slot.channels, 2, h * slot.scale, w * slot.scale), slot
        total += e.numel() * e.element_size()
    assert lay.cache_bytes(h, w, 1, 4, part="all") == total
    # Default split: the last cut at scale <= 2.
    assert lay.split_info().scale <= 2 < lay.splits[lay.default_split + 1].scale


def test_cache_protocol_probe_says_what_comfy_decoder_does(tiny):
    """The probe (one block, two one-frame calls) agrees with ComfyUI's whole decoder driven by two one-frame
    calls: its latent-scale entries then hold 2 frames ("carry": ComfyUI 0.3.x) or 1 ("per_call": 0.33's
    Wan 2.1, whose own decode never makes two such calls in a row). Wan 2.2's blocks carry on every host."""
    version, model = tiny
    proto = wl.cache_protocol(model)
    lay = wl.wan_layout(model)
    feat = [None] * lay.n_cache
    x = model.conv2(_z((1, 4, 2, 3, 5)))
    with torch.no_grad():
        for a in (0, 1):
            kw = {"first_chunk": a == 0} if version == "2.2" else {}
            model.decoder(x[:, :, a : a + 1], feat_cache=feat, feat_idx=[0], **kw)
    kept = [int(feat[s.index].shape[2]) for s in lay.slots if s.frames == 1 and s.kind == "conv"]
    log.info("Wan %s: cache protocol %s; latent-scale entries after two one-frame calls: %s", version, proto, kept)
    assert len(set(kept)) == 1 and proto.name == {2: "carry", 1: "per_call"}[kept[0]]
    assert proto.frames_kept == kept[0]
    if version == "2.2":
        assert proto.name == "carry" and not proto.views


def test_impulse_extent_equals_structural_reach(tiny):
    """An impulse added to the global part's output (one latent pixel, all channels, frame 0) changes the
    output exactly within the walked reach of the tiled part, in frame 0 and in the frames of later
    chunks (the caches carry it forward but do not widen it)."""
    version, model = tiny
    lay = wl.wan_layout(model)
    z = _z((1, 4, 3, 3, 29))
    S = lay.spatial_ratio
    for split in sorted({0, lay.default_split} if version == "2.1" else {lay.default_split}):
        si = lay.splits[split]
        assert si.reach == pytest.approx(12.25 if split == 0 else (2.75 if version == "2.1" else 5.75))

        def poke(x: torch.Tensor, s0: int, s=si.scale) -> torch.Tensor:
            if s0 == 0:
                x = x.clone()
                x[:, :, :, 1 * s : 2 * s, 14 * s : 15 * s] += 1.0
            return x

        base = vc.decode_wan_chunked(model, z, 2, split=split)
        hit = vc.decode_wan_chunked(model, z, 2, split=split, split_hook=poke)
        delta = (hit - base)[0].movedim(1, 0)  # (T, C, H, W)
        first = impulse_extent(delta[:1], (1, 14), S)
        later = impulse_extent(delta[5:], (1, 14), S)
        assert si.reach - 1 / 8 <= first <= si.reach, (split, first)
        assert si.reach - 1 / 8 <= later <= si.reach, (split, later)


# --------------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("tile", [None, (3, 4)])
def test_chunked_and_tiled_equal_comfy_decode(case, k, tile):
    version, model, z, ref = case
    stats: dict = {}
    out = vc.decode_wan_chunked(model, z, k, tile, stats=stats)
    r = 8 if version == "2.1" else 16
    assert out.shape == ref.shape == (1, 3, 13, 5 * r, 7 * r)
    assert _diff(out, ref) <= TOL
    n_tiles = 1 if tile is None else 4
    chunks = len(tiles.chunk_ranges(4, k))
    # tile-major: every tile runs every chunk once; phase 1 (the store) only when there are tiles
    assert stats["units"] == stats["steps"] == n_tiles * chunks and stats["tiles"] == n_tiles
    assert stats["global_chunks"] == (0 if tile is None else chunks)
    assert stats["store"] == (None if tile is None else "device")


def test_every_split_point_is_exact_and_a_short_halo_is_not(case):
    version, model, z, ref = case
    lay = wl.wan_layout(model)
    for split in sorted({0, lay.default_split, len(lay.splits) - 1}):
        assert _diff(vc.decode_wan_chunked(model, z, 3, (5, 4), split=split), ref) <= TOL, split
    wrong = _diff(vc.decode_wan_chunked(model, z, 3, (5, 4), halo=0), ref)
    assert wrong > 1e-3, wrong


def test_batch_of_two_tiled(tiny):
    _, model = tiny
    z = _z((2, 4, 3, 5, 6), seed=3)
    with torch.no_grad():
        ref = model.decode(z)
    out = vc.decode_wan_chunked(model, z, 2, (2, 4))
    assert _diff(out, ref) <= TOL
    assert _diff(out[1], ref[1]) <= TOL and _diff(out[0], out[1]) > 0.01  # the items differ


def test_preallocated_out_is_filled_and_returned(case21):
    _, model, z, ref = case21
    out = torch.full(ref.shape, float("nan"))
    got = vc.decode_wan_chunked(model, z, 2, (5, 4), out=out)
    assert got is out and _diff(out, ref) <= TOL
    with pytest.raises(ValueError, match="shape"):
        vc.decode_wan_chunked(model, z, 2, out=torch.empty(1, 3, 12, 1, 1))


def test_cache_modes_in_place_and_host_store(case21):
    """rollback=False is ComfyUI's in-place protocol (whole frames and per tile); a store_device other than
    the compute device takes the host-store path (on CPU: 'cpu:0' vs 'cpu' exercises that code)."""
    _, model, z, ref = case21
    stats: dict = {}
    for tile in (None, (3, 4)):
        assert _diff(vc.decode_wan_chunked(model, z, 2, tile, rollback=False, stats=stats), ref) <= TOL
        assert stats["rollback"] is False
    off = torch.device("cpu", 0)
    assert _diff(vc.decode_wan_chunked(model, z, 3, (3, 4), store_device=off, stats=stats), ref) <= TOL
    assert stats["store"] == "host" and stats["rollback"] is True


@pytest.mark.slow
def test_tile_major_peak_scales_with_the_tile(host_config):
    """Only one tile's caches are alive at a time: on a 16x16 latent, 4x4 tiles (halo 3) peak well below
    the whole-frame decode (live tensor bytes; measured 12.2 vs 34.0 MiB: 0.36x), at the same output."""
    from vramfit.memory.measure.tracker import PeakTracker

    from scripts.host import import_comfy

    import_comfy(host_config)
    model = tiny_wan("2.1")
    z = _z((1, 4, 3, 16, 16), seed=4)
    out = torch.empty(1, 3, 9, 128, 128)  # outside the tracked blocks
    peaks, outs = {}, {}
    for tile in (None, (4, 4)):
        with PeakTracker("cpu", method="dispatch") as t:
            vc.decode_wan_chunked(model, z, 1, tile, out=out)
        peaks[tile], outs[tile] = t.peak_bytes, out.clone()
    assert _diff(outs[None], outs[(4, 4)]) <= TOL
    log.info("tiny 16x16: peak whole %.1f MiB, 4x4 tiles %.1f MiB", peaks[None] / 2**20, peaks[(4, 4)] / 2**20)
    assert peaks[(4, 4)] < 0.5 * peaks[None], peaks


# --------------------------------------------------------------------------------------------------
# OOM re-planning, stop, progress


def _faults(steps: set[int]):
    def hook(step: int) -> None:
        if step in steps:
            raise FakeOOM(f"injected OOM at step {step}")

    return hook


@pytest.mark.parametrize(
    "tile,k,fail,kw,expect",
    [
        # whole frames, chunk [1, 4) (3 frames): one frame per chunk, resume from the committed cache
        (None, 4, {1}, {}, {"shrinks": 1, "frames_per_chunk": 1, "restarts": 0}),
        # tile 0 (core 5x3 of 2 tiles): chunk [1, 4) halves k; at one frame ([2, 3)) the tile splits into
        # 3x3 + 2x3 halves that resume at frame 2 from windows of its cache; the first half fails again
        # and splits (2x3 + 1x3)
        ((5, 4), 4, {1, 3, 4}, {}, {"shrinks": 3, "frames_per_chunk": 1, "restarts": 0, "tile": (2, 3)}),
        # whole frames at one frame per chunk, in chunk [2, 3): phase 1 from the committed global cache,
        # then two halves from windows of the committed whole-frame cache
        (None, 1, {2}, {}, {"shrinks": 1, "tile": (5, 4), "global_chunks": 2, "restarts": 0}),
        # in-place caches: the decode starts again from frame 0
        (None, 4, {1}, {"rollback": False}, {"shrinks": 1, "restarts": 1}),
        # in-place, tiles: only tile 1 starts again (tile 0 is finished: steps 0-2)
        ((3, 4), 2, {4}, {"rollback": False}, {"shrinks": 1, "restarts": 1, "frames_per_chunk": 1}),
        # host store, chunk [1, 3) of tile 2
        ((3, 4), 2, {7}, {"store_device": torch.device("cpu", 0)}, {"shrinks": 1, "frames_per_chunk": 1}),
        # the first chunk (one frame): the whole frame splits into two tiles at once
        (None, 2, {0}, {}, {"shrinks": 1, "frames_per_chunk": 2, "tile": (5, 4)}),
    ],
)
def test_oom_mid_video_resumes_identically(case21, tile, k, fail, kw, expect):
    _, model, z, ref = case21
    seen: list[tuple[int, int]] = []
    oomed: list[int] = []
    stats: dict = {}
    out = vc.decode_wan_chunked(
        model,
        z,
        k,
        tile,
        fault_hook=_faults(fail),
        oom_exceptions=(FakeOOM,),
        on_oom=lambda: oomed.append(1),
        progress=lambda d, t: seen.append((d, t)),
        stats=stats,
        **kw,
    )
    assert _diff(out, ref) <= TOL
    assert len(oomed) == stats["shrinks"] == expect["shrinks"]
    for key, val in expect.items():
        assert stats[key] == val, (key, stats)
    if kw.get("rollback", True):  # nothing finished is decoded again: one attempt per unit + the failures
        assert stats["steps"] == stats["units"] + len(fail)
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] == stats["units"] + stats["global_chunks"]
    assert all(b[0] >= a[0] for a, b in zip(seen, seen[1:], strict=False))


def test_oom_in_the_global_part_keeps_the_committed_cache(case21):
    """An OOM raised after the global part of chunk [1, 3) rewrote its cache entries (the split hook runs
    after it) must not leak those entries into the retry."""
    _, model, z, ref = case21
    fired: list[int] = []

    def hook(x: torch.Tensor, s0: int) -> torch.Tensor:
        if s0 == 1 and not fired:
            fired.append(s0)
            raise FakeOOM("after the global part")
        return x

    stats: dict = {}
    out = vc.decode_wan_chunked(model, z, 2, (3, 4), split_hook=hook, oom_exceptions=(FakeOOM,), stats=stats)
    assert fired == [1] and stats["shrinks"] == 1 and stats["frames_per_chunk"] == 1
    assert _diff(out, ref) <= TOL


def test_oom_that_cannot_shrink_propagates(case21):
    _, model, z, _ = case21
    with pytest.raises(FakeOOM):
        vc.decode_wan_chunked(
            model, z, 1, (2, 2), fault_hook=_faults(set(range(100))), oom_exceptions=(FakeOOM,), min_tile=2
        )


def test_should_stop_propagates_between_tiles(case21):
    _, model, z, _ = case21
    calls: list[int] = []

    def should_stop() -> None:  # as comfy.model_management.throw_exception_if_processing_interrupted
        calls.append(1)
        if len(calls) == 5:
            raise Stop

    done: list[int] = []
    with pytest.raises(Stop):
        vc.decode_wan_chunked(
            model, z, 2, (3, 4), should_stop=should_stop, progress=lambda d, t: done.append(d)
        )
    # checks before the 3 phase-1 chunks and before each tile-chunk: stopped before tile 0's second chunk
    assert max(done) == 4
    with pytest.raises(InterruptedError):
        vc.decode_wan_chunked(model, z, 2, should_stop=lambda: True)


def test_progress_total_is_known_up_front(case21):
    _, model, z, _ = case21
    seen: list[tuple[int, int]] = []
    vc.decode_wan_chunked(model, z, 2, (3, 4), progress=lambda d, t: seen.append((d, t)))
    total = len(tiles.chunk_ranges(4, 2)) * (1 + 4)  # phase 1 + 4 tiles
    assert seen == [(i, total) for i in range(total + 1)]


# --------------------------------------------------------------------------------------------------
# Overlap-blend vs ComfyUI's own temporal tiling


def test_blend_equals_comfy_tiled_scale_multidim_along_time(host_config):
    """Same chunks, same frame formula, same weights as ``comfy.utils.tiled_scale_multidim`` (one spatial
    tile) on a decoder with chunk-dependent artefacts."""
    from scripts.host import import_comfy

    import_comfy(host_config)
    import comfy.utils

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 3, 4 * 9 - 3, 6, 5, generator=gen)
    up = lambda a: max(0, a * 4 - 3)  # noqa: E731

    def decode_fn(zc: torch.Tensor) -> torch.Tensor:
        p, n = int(zc[0, 0, 0, 0, 0]), zc.shape[2]
        return base[:, :, 4 * p : 4 * p + up(n)] + 0.3 * math.sin(p + 1)  # a per-chunk offset

    z = torch.zeros(1, 2, 9, 6, 5)
    z[:, 0] = torch.arange(9, dtype=torch.float32).view(1, 9, 1, 1)
    for k, o in ((3, 1), (4, 2), (5, 1)):
        ref = comfy.utils.tiled_scale_multidim(
            z,
            decode_fn,
            tile=(k, 64, 64),
            overlap=(o, 0, 0),
            upscale_amount=(up, 1, 1),
            out_channels=3,
            index_formulas=(4, 1, 1),
        )
        ours = blend.decode_overlap_blend(decode_fn, z, k, o, upscale_ratio=up, index_formula=4)
        assert ours.shape == ref.shape
        assert _diff(ours, ref) <= 1e-6, (k, o)
        assert _diff(ours, base) > 0.01  # the artefacts are there (approximate by design)


# --------------------------------------------------------------------------------------------------
# Planner (memory.plan.video): sizing shortcuts are exact, peaks persist


def _job(model, z):
    import types

    from vramfit.memory.decode import video as vd

    vae = types.SimpleNamespace(first_stage_model=model, vae_dtype=torch.float32, device="cpu")
    return vd.make_job(vae, z, "cpu")


def _meta_peak(model, z, tile, **kw) -> int:
    from vramfit.memory.measure.sizing import MetaSizer

    with MetaSizer([model], torch.float32, "cpu") as sz:
        zf = torch.empty(z.shape)
        vc.decode_wan_chunked(model, zf, 1, tile, **kw)
        del zf
    return sz.peak_bytes


@pytest.mark.parametrize("tile,split,rollback", [((2, 2), None, True), ((2, 3), 3, False)])
def test_sizing_on_the_peak_tiles_gives_the_full_peak(tiny, tile, split, rollback):
    """``sizing=True`` runs phase 2 only on the tiles whose extents no other tile reaches (here 4 of 9 / 2
    of 6): the same peak (live tensor bytes on fake tensors) to the byte."""
    _, model = tiny
    z = _z((1, 4, 3, 5, 6))
    full = _meta_peak(model, z, tile, split=split, rollback=rollback)
    assert _meta_peak(model, z, tile, split=split, rollback=rollback, sizing=True) == full


def test_lower_bound_is_below_every_sized_peak(case21):
    from vramfit.memory.plan import video as pv

    _, model, _, _ = case21
    job = _job(model, _z((1, 4, 3, 6, 6)))
    lay = wl.wan_layout(model)
    store = pv.PeakStore()
    cands = pv.candidates(job, 0, None)
    picked = cands[:: max(1, len(cands) // 8)]
    assert any(c.tile is None for c in picked) and any(c.tile is not None for c in picked)
    for cd in picked:
        low, peak = pv.lower_bound(job, lay, cd), pv.decode_peak(job, lay, cd, store, "s")
        assert 0 < low <= peak, (cd, low, peak)


@pytest.mark.slow
def test_scaled_bound_is_below_every_sized_peak(tiny):
    """The planner skips a candidate by :func:`scaled_bound` from one sized before (k and the extended tile
    scaled down; phase 1, which no tile changes): on both Wan versions the bound is at most the candidate's
    own sized peak for every pair of a sample (a bound above would skip a plan that fits), and it does bound
    something (it is not the trivial 0)."""
    from vramfit.memory.plan import video as pv

    _, model = tiny
    job = _job(model, _z((1, 4, 5, 9, 10)))
    lay = wl.wan_layout(model)
    h, w = 9, 10
    store = pv.PeakStore()
    cands = [c for c in pv.candidates(job, 0, None) if c.k in (1, 2, 4)]
    picked = cands[:: max(1, len(cands) // 14)]
    sized = {id(c): pv.decode_peaks(job, lay, c, store, "s") for c in picked}
    useful = 0
    for f in picked:
        peak, phase1 = sized[id(f)]
        assert phase1 is None if f.tile is None else 0 < phase1 <= peak
        for cd in picked:
            bound = pv.scaled_bound(f, peak, phase1, cd, (pv._ext_area(lay, h, w, f), pv._ext_area(lay, h, w, cd)))
            assert bound <= sized[id(cd)][0], (f, cd, bound, sized[id(cd)][0])
            useful += cd is not f and bound > 0.5 * sized[id(cd)][0]
    assert useful > 0


@pytest.mark.parametrize("device,tile_k", [("cpu", 1), ("cuda", 2)])
def test_whole_frames_one_latent_frame_per_call_come_first(case21, device, tile_k):
    """The speed order: whole frames at k = 1 first on every device (on an H200 larger whole-frame calls
    took as long as the host's one-frame calls, at 6.3x its memory); tiles keep the CUDA call overhead
    (larger k first there). Ordering only: nothing is allocated on ``device``."""
    import dataclasses

    from vramfit.memory.plan import video as pv

    _, model, _, _ = case21
    job = dataclasses.replace(_job(model, _z((1, 4, 3, 6, 6))), device=torch.device(device))
    cands = pv.candidates(job, 0, None)
    assert cands[0].tile is None and cands[0].k == 1
    assert next(c for c in cands if c.tile is not None).k == tile_k


def test_least_memory_first_among_equal_speeds_then_the_fitting_twins(case21):
    """On an accelerator the host store and the context spent in place come first among equally fast candidates
    (a failure there rules their twins out); the plan then takes the fitting candidate's twin with the rollback
    cache, then with the device store, each only when it fits."""
    import dataclasses

    from vramfit.memory.plan import video as pv
    from vramfit.memory.plan.types import Plan

    _, model, _, _ = case21
    job = dataclasses.replace(_job(model, _z((1, 4, 3, 6, 6))), device=torch.device("cuda"))
    tiled = [c for c in pv.candidates(job, 0, None) if c.tile is not None]
    first = tiled[0]
    assert (first.rollback, first.store) == (False, "host")
    same = [c for c in tiled if (c.k, c.tile, c.split) == (first.k, first.tile, first.split)]
    assert [(c.rollback, c.store) for c in same] == [(False, "host"), (False, "device"), (True, "host"),
                                                     (True, "device")]
    need = {(False, "host"): 10, (True, "host"): 12, (False, "device"): 13, (True, "device"): 15}

    def size(c):
        return Plan("wan", c, "", need[c.rollback, c.store])

    for budget, want in [(10, (False, "host")), (12, (True, "host")), (14, (True, "host")), (15, (True, "device"))]:
        got = pv._better_twin(size(first), size, budget).config
        assert (got.rollback, got.store) == want, budget
    assert pv._better_twin(size(dataclasses.replace(first, store="host")), size, 13).config.store == "host"


def test_a_store_in_host_memory_only_where_the_hosts_ram_holds_it(case21):
    """On an accelerator the host-store candidates are left out when the clip's store does not fit
    :attr:`VideoJob.host_room` (kept when it does, or when the RAM is unknown); a tiled plan on the device then
    says why in its row. Planning only: nothing runs on the device."""
    import dataclasses

    from vramfit.memory.plan import video as pv

    _, model, _, _ = case21
    job = dataclasses.replace(_job(model, _z((1, 4, 3, 6, 6))), device=torch.device("cuda"))
    splits = {c.split for c in pv.candidates(job, 0, None) if c.store == "host"}
    assert splits
    need = {s: pv.host_store_bytes(job, s) for s in splits}
    assert all(n > 0 for n in need.values())
    for room, kept in [(None, splits), (max(need.values()), splits), (min(need.values()) - 1, set())]:
        j = dataclasses.replace(job, host_room=room)
        assert {c.split for c in pv.candidates(j, 0, None) if c.store == "host"} == kept, room
    small = dataclasses.replace(job, host_room=0)
    cd = next(c for c in pv.candidates(small, 0, None) if c.tile is not None)
    assert cd.store == "device"
    assert pv.host_store_note(small, cd).startswith(" (store in host memory not used: it needs ")
    assert pv.host_store_note(job, cd) == "" and pv.host_store_note(dataclasses.replace(small, device=torch.device(
        "cpu")), cd) == ""


def test_planner_persists_sized_peaks_and_a_new_key_resizes(case21, tmp_path, monkeypatch):
    """A second plan (a new store read from the file the first wrote) sizes nothing and gives the same plan;
    another executor version (the key) sizes again. The tight budget makes the planner tile."""
    from vramfit.memory.plan import video as pv

    _, model, _, _ = case21
    job = _job(model, _z((1, 4, 3, 8, 8)))
    calls: list[object] = []
    real = pv.size_candidate

    def counting(j, cd, *a):
        calls.append(cd)
        return real(j, cd, *a)

    monkeypatch.setattr(pv, "size_candidate", counting)
    path = tmp_path / "peaks.json"
    free = pv.plan_wan(job, 1 << 40, 0, None, pv.PeakStore(path))
    budget = int(0.6 * free.planned)
    n0 = len(calls)
    st: dict = {}
    first = pv.plan_wan(job, budget, 0, None, pv.PeakStore(path), st)
    assert first.config.tile is not None and first.planned <= budget
    assert st["sized"] == len(calls) - n0 > 0 and path.is_file()
    n = len(calls)
    st2: dict = {}
    second = pv.plan_wan(job, budget, 0, None, pv.PeakStore(path), st2)
    assert len(calls) == n and st2["sized"] == 0
    assert (second.config, second.planned) == (
        first.config, first.planned)
    monkeypatch.setattr(pv.vc, "EXECUTOR_VERSION", "v-changed")
    third = pv.plan_wan(job, budget, 0, None, pv.PeakStore(path))
    assert len(calls) > n and third.planned == first.planned


@pytest.mark.parametrize("rollback", [True, False])
def test_planner_prediction_equals_the_tracked_tile_major_peak(case21, rollback):
    """The planner's sized peak of a tile-major candidate (peak tiles only, fake tensors) equals the live
    tensor bytes a real run of every tile counts (latent and output allocated inside, as when sized), to
    the byte."""
    from vramfit.memory.measure.tracker import PeakTracker
    from vramfit.memory.plan import video as pv

    _, model, _, _ = case21
    z = _z((1, 4, 3, 7, 9), seed=3)
    job = _job(model, z)
    lay = wl.wan_layout(model)
    cd = Chunking(1, (2, 3), (4, 3), lay.default_split, rollback, "device")
    with PeakTracker("cpu", method="dispatch") as t:
        zz = z.clone()
        out = vc.decode_wan_chunked(model, zz, 1, cd.tile, split=cd.split, rollback=rollback)
        del zz, out
    out_b = 3 * lay.out_frames(3) * 7 * 9 * lay.spatial_ratio**2 * 4
    predicted = pv.decode_peak(job, lay, cd, pv.PeakStore(), "s")
    log.info("tiny 7x9, 4x3 tiles, rollback=%s: predicted %d, tracked %d B", rollback, predicted, t.peak_bytes - out_b)
    assert predicted == t.peak_bytes - out_b  # measured: equal to the byte
