"""Temporal-chunk video decode (``memory/executors/wan.py``, ``blend.py``, ``vae/wan_layout.py``): the pure parts, without ComfyUI.

* chunk / tile / overlap geometry (partitions, halos, ComfyUI's temporal tile positions);
* Wan 2.2's unpatchify reshape against the ``einops`` pattern ComfyUI uses;
* the overlap-blend executor with synthetic ``decode_fn``s: a temporally consistent decoder must be
  reproduced exactly (any misplaced frame or wrong weight breaks that), the cross-fade ramps
  monotonically across an overlap, OOM re-plans complete identically, stop/progress behave;
* the planner-facing geometry of :class:`WanLayout` on a hand-built layout.

The Wan executor itself needs ComfyUI's decoder modules: ``tests/host/test_video_chunked_tiny.py``
(tiny real-code models) and ``tests/host/test_video_chunked_host.py`` (fixture VAEs).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vramfit.memory import oom, tiles
from vramfit.memory.executors import blend
from vramfit.memory.executors import wan as vc
from vramfit.memory.vae import wan_layout as wl

UP4 = lambda a: max(0, a * 4 - 3)  # noqa: E731  (ComfyUI's upscale_ratio[0] for Wan/Hunyuan/...)


class FakeOOM(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------------
# Geometry


@settings(max_examples=200, deadline=None)
@given(t=st.integers(0, 200), k=st.integers(-1, 60))
def test_chunk_ranges_first_frame_alone_then_k(t, k):
    ranges = tiles.chunk_ranges(t, k)
    if t == 0:
        assert ranges == []
        return
    assert ranges[0] == (0, 1)
    pos = 0
    for a, b in ranges:
        assert a == pos and b > a
        pos = b
    assert pos == t
    kk = t if k <= 0 else k
    assert all(b - a <= kk for a, b in ranges[1:])
    assert all(b - a == kk for a, b in ranges[1:-1])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), tile=st.integers(1, 120), halo=st.integers(0, 20))
def test_tile_spans_partition_with_clipped_halo(n, tile, halo):
    spans = tiles.spans(n, tile, halo)
    assert len(spans) == -(-n // tile)
    pos = 0
    for c0, c1, e0, e1 in spans:
        assert c0 == pos and c1 > c0 and c1 - c0 <= tile
        assert e0 == max(0, c0 - halo) and e1 == min(n, c1 + halo)
        pos = c1
    assert pos == n
    sizes = [c1 - c0 for c0, c1, _, _ in spans]
    assert max(sizes) - min(sizes) <= 1  # balanced


def _comfy_positions(t: int, k: int, o: int) -> list[tuple[int, int]]:
    """Transcription of ``comfy.utils.tiled_scale_multidim``'s position loop (ComfyUI 0.3.75) for one axis.
    The host tests compare the blend with the real function."""
    if t <= k:
        return [(0, t)]
    out = []
    for it in range(0, t - o, k - o):
        pos = max(0, min(t - o, it))
        out.append((pos, pos + min(k, t - pos)))
    return out


@settings(max_examples=200, deadline=None)
@given(t=st.integers(1, 80), k=st.integers(1, 20), o=st.integers(0, 19))
def test_overlap_chunks_match_comfy_positions_and_cover(t, k, o):
    o = min(o, k - 1)
    chunks = tiles.overlap_chunks(t, k, o)
    assert chunks == _comfy_positions(t, k, o)
    covered = set()
    for a, b in chunks:
        assert 0 <= a < b <= t and b - a <= k
        covered.update(range(a, b))
    assert covered == set(range(t))


def test_unpatchify_matches_einops_pattern():
    einops = pytest.importorskip("einops")
    x = torch.randn(2, 12, 3, 5, 7)
    ref = einops.rearrange(x, "b (c r q) f h w -> b c f (h q) (w r)", q=2, r=2)
    assert torch.equal(vc._unpatchify(x, 2), ref)
    assert vc._unpatchify(x, 1) is x


# --------------------------------------------------------------------------------------------------
# Overlap-blend with synthetic decoders


def _signal(i: torch.Tensor, h: int = 4, w: int = 5) -> torch.Tensor:
    """A smooth (B=1, C=2, len(i), h, w) video: output frame ``i`` of a temporally consistent decoder."""
    yy = torch.arange(h, dtype=torch.float64).view(1, 1, h, 1)
    xx = torch.arange(w, dtype=torch.float64).view(1, 1, 1, w)
    f = i.to(torch.float64).view(-1, 1, 1, 1)
    c0 = torch.sin(0.37 * f + 0.5 * yy) * torch.cos(0.21 * xx)
    c1 = torch.cos(0.11 * f * xx + 0.3 * yy)
    return torch.cat([c0, c1], dim=1).permute(1, 0, 2, 3).unsqueeze(0).float()


def _latent(t: int) -> torch.Tensor:
    """Channel 0 carries the latent frame index (so a decoder knows where its chunk starts)."""
    z = torch.zeros(1, 2, t, 1, 1)
    z[:, 0] = torch.arange(t, dtype=torch.float32).view(1, t, 1, 1)
    return z


def _consistent_decode(offsets: dict[int, float] | None = None):
    """decode_fn: chunk starting at latent ``p`` with ``l`` frames -> global frames ``4p .. 4p + 4l - 4``,
    plus a per-chunk constant ``offsets[p]`` (a chunk-dependent artefact, 0 by default)."""
    calls: list[tuple[int, int]] = []

    def fn(zc: torch.Tensor) -> torch.Tensor:
        p, n = int(zc[0, 0, 0, 0, 0]), zc.shape[2]
        calls.append((p, n))
        frames = _signal(torch.arange(4 * p, 4 * p + UP4(n)))
        return frames + (offsets or {}).get(p, 0.0)

    fn.calls = calls
    return fn


@pytest.mark.parametrize("t,k,o", [(7, 3, 1), (9, 4, 2), (5, 2, 1), (6, 6, 1), (8, 3, 0), (10, 5, 4)])
def test_blend_reproduces_a_consistent_decoder_exactly(t, k, o):
    fn = _consistent_decode()
    stats: dict = {}
    out = blend.decode_overlap_blend(fn, _latent(t), k, o, upscale_ratio=UP4, index_formula=4, stats=stats)
    ref = _signal(torch.arange(UP4(t)))
    assert out.shape == ref.shape == (1, 2, UP4(t), 4, 5)
    assert (out - ref).abs().max().item() <= 1e-6
    oo = min(max(o, 1), k - 1)  # overlap 0 is raised to 1 (as ComfyUI does)
    assert [(p, p + n) for p, n in fn.calls] == tiles.overlap_chunks(t, k, oo) == stats["ranges"]
    assert stats["exact"] is False


def test_blend_cross_fade_ramps_monotonically_across_the_overlap():
    # Chunks [0, 4) and [2, 6) (k=4, o=2): the second one is off by +1. Frames 8..12 are covered by
    # both; the offset seen there must rise strictly from ~0 to ~1 (ComfyUI's linear feather of 5 frames).
    fn = _consistent_decode({0: 0.0, 2: 1.0})
    out = blend.decode_overlap_blend(fn, _latent(6), 4, 2, upscale_ratio=UP4, index_formula=4)
    offset = (out - _signal(torch.arange(UP4(6)))).mean(dim=(0, 1, 3, 4))
    assert offset[:8].abs().max() < 1e-6  # only the first chunk
    assert (offset[13:] - 1).abs().max() < 1e-6  # only the second chunk
    ramp = offset[8:13]
    assert bool((ramp[1:] > ramp[:-1]).all()), ramp
    assert 0 < ramp[0] < 0.5 < ramp[-1] < 1, ramp


def test_blend_resumes_after_oom_identically_and_reports_progress():
    t = 13
    fn = _consistent_decode()
    seen: list[tuple[int, int]] = []

    def fault(step: int) -> None:
        if step in (1, 3):
            raise FakeOOM(f"injected at {step}")

    stats: dict = {}
    out = blend.decode_overlap_blend(
        fn,
        _latent(t),
        8,
        3,
        upscale_ratio=UP4,
        index_formula=4,
        fault_hook=fault,
        oom_exceptions=(FakeOOM,),
        progress=lambda d, n: seen.append((d, n)),
        stats=stats,
    )
    assert (out - _signal(torch.arange(UP4(t)))).abs().max().item() <= 1e-6
    assert stats["shrinks"] == 2 and stats["frames_per_chunk"] == 2 and stats["overlap"] == 1
    assert stats["steps"] == stats["chunks"] + 2
    assert seen[-1][0] == seen[-1][1] == stats["chunks"]
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1))


def test_blend_oom_at_one_frame_propagates_and_stop_is_honoured():
    def always(_step: int) -> None:
        raise FakeOOM("no memory at all")

    with pytest.raises(FakeOOM):
        blend.decode_overlap_blend(
            _consistent_decode(),
            _latent(5),
            2,
            1,
            upscale_ratio=UP4,
            index_formula=4,
            fault_hook=always,
            oom_exceptions=(FakeOOM,),
        )

    class Stop(Exception):
        pass

    calls = []

    def should_stop() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise Stop

    fn = _consistent_decode()
    with pytest.raises(Stop):
        blend.decode_overlap_blend(
            fn, _latent(7), 3, 1, upscale_ratio=UP4, index_formula=4, should_stop=should_stop
        )
    assert len(fn.calls) == 1
    with pytest.raises(InterruptedError):
        blend.decode_overlap_blend(
            fn, _latent(7), 3, 1, upscale_ratio=UP4, index_formula=4, should_stop=lambda: True
        )


def test_bare_exception_is_not_treated_as_oom():
    """ComfyUI's OOM_EXCEPTION is ``Exception`` without CUDA: passing it must not swallow other errors."""

    def boom(_step: int) -> None:
        raise ValueError("a bug, not an OOM")

    with pytest.raises(ValueError, match="a bug"):
        blend.decode_overlap_blend(
            _consistent_decode(),
            _latent(7),
            4,
            1,
            upscale_ratio=UP4,
            index_formula=4,
            fault_hook=boom,
            oom_exceptions=(Exception,),
        )
    assert oom.oom_types((Exception, FakeOOM)) == (FakeOOM,)
    assert oom.oom_types(None) == oom.default_oom_exceptions()


def test_blend_rejects_a_decoder_with_the_wrong_frame_count():
    def bad(zc: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, 3, 4 * zc.shape[2], 2, 2)  # 4 l instead of 4 l - 3

    with pytest.raises(RuntimeError, match="frames"):
        blend.decode_overlap_blend(bad, _latent(5), 2, 1, upscale_ratio=UP4, index_formula=4)


# --------------------------------------------------------------------------------------------------
# Planner-facing geometry of a layout


def _layout() -> wl.WanLayout:
    slots = (
        wl.CacheSlot(0, "conv1", 16, 1, "conv"),
        wl.CacheSlot(1, "middle.0.residual.2", 384, 1, "conv"),
        wl.CacheSlot(2, "upsamples.0.time_conv", 384, 1, "time_up"),
        wl.CacheSlot(3, "upsamples.1.residual.2", 192, 2, "conv"),
        wl.CacheSlot(4, "head.2", 96, 8, "conv"),
    )
    splits = (wl.SplitInfo(0, 1, 384, 1, 12.25, 2), wl.SplitInfo(1, 2, 192, 2, 2.75, 3))
    return wl.WanLayout("2.1", 16, 4, 8, 1, 3, slots, splits, 1, (), 5)


def test_layout_geometry_for_the_planner():
    lay = _layout()
    assert [lay.out_frames(t) for t in (0, 1, 2, 21)] == [0, 1, 5, 81]
    assert lay.chunk_out_frames(1, first=True) == 1 and lay.chunk_out_frames(3) == 12
    assert [lay.out_frame_start(s) for s in (0, 1, 2, 5)] == [0, 1, 5, 17]
    # Chunks tile the output frames exactly.
    for t in (1, 2, 7):
        for k in (1, 2, 5):
            n = sum(lay.chunk_out_frames(b - a, first=a == 0) for a, b in tiles.chunk_ranges(t, k))
            assert n == lay.out_frames(t)
    h, w, b, item = 5, 7, 2, 2
    tiled = (192 * 4 + 96 * 64) * 2 * h * w * b * item  # slots >= first_slot 3 of split 1, 2 frames each
    assert lay.cache_bytes(h, w, b, item) == tiled
    glob = (16 + 384 + 384) * 2 * h * w * b * item
    assert lay.cache_bytes(h, w, b, item, part="global") == glob
    assert lay.cache_bytes(h, w, b, item, part="all") == tiled + glob
    assert lay.cache_bytes(h, w, b, item, split=0) == (384 + 192 * 4 + 96 * 64) * 2 * h * w * b * item
    assert lay.split_info().halo == 3 and lay.split_info(0).halo == 13
    # the store: frame 0 yields one frame, later latent frames frame_factor each (2 at split 1, 1 at 0)
    assert [lay.store_frames(t) for t in (0, 1, 2, 21)] == [0, 1, 3, 41]
    assert lay.store_frames(21, split=0) == 21 and lay.store_frames(21, start=5) == 41 - 9
    assert lay.store_bytes(h, w, 21, b, item) == b * 192 * 41 * (h * 2) * (w * 2) * item
    assert lay.store_bytes(h, w, 21, b, item, split=0) == b * 384 * 21 * h * w * item
    assert lay.spatial_ratio == 8


def test_non_wan_models_are_rejected():
    assert not wl.is_wan_vae(torch.nn.Conv2d(3, 3, 3))
    with pytest.raises(ValueError, match="not a Wan VAE"):
        wl.wan_layout(torch.nn.Sequential(torch.nn.Conv3d(3, 3, 3)))
    with pytest.raises(ValueError, match="not a Wan VAE"):
        vc.decode_wan_chunked(torch.nn.Identity(), torch.zeros(1, 16, 2, 2, 2))
