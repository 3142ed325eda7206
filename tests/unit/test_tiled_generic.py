"""Generic single-pass tiled decode (``memory/executors/generic.py``) and convolutional reach (``memory/measure/reach.py``).

Exactness of the tile assembly is checked with *local* decoders, for which tiling with a halo of at
least the reach must reproduce the whole-image decode:

* a pointwise decoder (1x1 conv + nearest x8): any halo, bit-identical (``torch.equal``);
* a conv stack (3x3 convs at latent res, nearest x4, 3x3 convs at 4x res) whose reach
  ``memory/measure/reach.py`` computes: halo = ceil(reach) gives max abs diff <= 1e-5 (float32 conv noise);
  halo = ceil(reach) - 1 must differ by > 1e-3 somewhere (the reach is tight).

The KL VAE through this path (GroupNorm + attention, hence approximate) is measured in
``tests/host/test_tiled_generic_host.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from vramfit.memory.executors import generic as tg
from vramfit.memory.measure import reach as rc


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread (OpenMP spinning on a loaded 2-core machine costs ~10x)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Pointwise(nn.Module):
    """Per latent pixel, elementwise ops only (bit-reproducible on any tile shape), then nearest x8.

    (A 1x1 conv is pointwise too, but its GEMM may round differently for different tile shapes.)
    """

    def __init__(self, scale=8):
        super().__init__()
        self.scale = scale

    def forward(self, z):
        y = torch.tanh(z[:, :3] * 0.7 - z[:, 1:4] * 0.4 + z[:, 3:4] * z[:, :1])
        return y.repeat_interleave(self.scale, -2).repeat_interleave(self.scale, -1)


class LocalStack(nn.Module):
    """No normalisation, no attention: a truly local decoder with reach 2 + 0.25 * 3 = 2.75 latent px."""

    def __init__(self, c=4, mid=6, out=3):
        super().__init__()
        self.conv_a = nn.Conv2d(c, mid, 3, padding=1)
        self.conv_b = nn.Conv2d(mid, mid, 3, padding=1)
        self.conv_c = nn.Conv2d(mid, mid, 3, padding=1)
        self.conv_d = nn.Conv2d(mid, mid, 3, padding=1)
        self.conv_e = nn.Conv2d(mid, out, 3, padding=1)

    def forward(self, z):
        h = F.silu(self.conv_b(F.silu(self.conv_a(z))))
        h = F.interpolate(h, scale_factor=4, mode="nearest")
        return self.conv_e(F.silu(self.conv_d(F.silu(self.conv_c(h)))))


def _z(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pointwise():
    torch.manual_seed(0)
    return Pointwise().eval()


@pytest.fixture(scope="module")
def local():
    torch.manual_seed(1)
    return LocalStack().eval()


# --------------------------------------------------------------------------------------------------
# Assembly exactness


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(1, 23), w=st.integers(1, 23), b=st.integers(1, 2),
    th=st.integers(1, 12), tw=st.integers(1, 12), halo=st.integers(0, 3),
)
def test_pointwise_decoder_tiles_exactly(pointwise, h, w, b, th, tw, halo):
    z = _z((b, 4, h, w), seed=h * 31 + w)
    with torch.no_grad():
        ref = pointwise(z)
    out = tg.decode_generic(pointwise, z, (th, tw), halo)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_local_decoder_exact_with_halo_equal_to_reach(local):
    z = _z((2, 4, 21, 29), seed=3)
    with torch.no_grad():
        ref = local(z)
    report = rc.traced_reach(local, lambda: local(z[:, :, :6, :6]), (6, 6))
    assert report.total == pytest.approx(2.75)
    halo = rc.default_halo(report)
    assert halo == 3
    out = tg.decode_generic(local, z, (7, 8), halo)
    assert (out - ref).abs().max().item() <= 1e-5
    short = tg.decode_generic(local, z, (7, 8), halo - 1)
    assert (short - ref).abs().max().item() > 1e-3


def test_feather_is_a_partition_of_unity(pointwise):
    """Blending identical predictions must give them back: weights sum to 1 everywhere."""
    z = _z((2, 4, 19, 26), seed=4)
    with torch.no_grad():
        ref = pointwise(z)
    out = tg.decode_generic(pointwise, z, (6, 7), halo=3, feather=2)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-6


def test_five_d_latent_is_tiled_over_space(pointwise):
    def video_fn(t):  # (1, C, T, h, w) -> (1, 3, T, 8h, 8w), pointwise per frame
        b, c, f, h, w = t.shape
        frames = pointwise(t.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w))
        return frames.reshape(b, f, 3, 8 * h, 8 * w).permute(0, 2, 1, 3, 4)

    z = _z((1, 4, 3, 9, 11), seed=5)
    with torch.no_grad():
        ref = video_fn(z)
    out = tg.decode_generic(video_fn, z, (4, 4), 1)
    assert out.shape == (1, 3, 3, 72, 88)
    assert torch.equal(out, ref)


def test_scale_mismatch_is_an_error():
    with pytest.raises(ValueError, match="per latent px"):
        tg.decode_generic(lambda t: F.interpolate(t, size=(5, 5)), _z((1, 4, 8, 8)), (4, 4), 0, scale=8)


# --------------------------------------------------------------------------------------------------
# Progress, stop, OOM


class FakeOOM(RuntimeError):
    pass


def test_progress_counts_to_the_announced_total(pointwise):
    z = _z((2, 4, 10, 13), seed=6)
    calls = []
    tg.decode_generic(pointwise, z, (4, 4), 1, progress=lambda d, t: calls.append((d, t)))
    total = 2 * 3 * 4  # batch x 3 x 4 tiles of 4 px over 10 x 13 (the planner's Tiling.rows * cols per item)
    assert calls == [(d, total) for d in range(total + 1)]


def test_should_stop_propagates(pointwise):
    z = _z((1, 4, 10, 13), seed=6)
    ran = []
    n = 0

    class Interrupted(Exception):
        pass

    def stop():
        nonlocal n
        n += 1
        if n == 4:
            raise Interrupted

    with pytest.raises(Interrupted):
        tg.decode_generic(pointwise, z, (4, 4), 1, should_stop=stop, fault_hook=ran.append,
                          oom_exceptions=(Exception,))
    assert ran == [0, 1, 2]


@pytest.mark.parametrize("feather", [0, 2])
@pytest.mark.parametrize("fail_at", [0, 3, 7])
def test_oom_resume_skips_finished_tiles(fail_at, feather):
    torch.manual_seed(2)
    net = LocalStack().eval()
    z = _z((2, 4, 17, 22), seed=7)
    tile = (12, 12)  # with feather 2 the tile can shrink only down to 4 * feather = 8
    halo = 3 + feather  # reach 2.75; feathered pixels lie up to `feather` px outside the core
    clean = tg.decode_generic(net, z, tile, halo, feather=feather)
    seen, decoded = [], []

    def hook(k):
        seen.append(k)
        if k == fail_at:
            raise FakeOOM

    def fn(t):
        decoded.append(tuple(t.shape[-2:]))
        return net(t)

    progress = []
    out = tg.decode_generic(fn, z, tile, halo, feather=feather, fault_hook=hook, oom_exceptions=(FakeOOM,),
                            progress=lambda d, t: progress.append((d, t)))
    # Halo >= reach: the resumed decode equals the uninterrupted one (conv float noise only).
    assert (out - clean).abs().max().item() <= 1e-5
    assert len(decoded) == len(seen) - 1  # the failing attempt decoded nothing; no tile decoded twice
    assert progress[-1][0] == progress[-1][1] == len(decoded)


def test_oom_at_min_tile_raises(pointwise):
    def always(_k):
        raise FakeOOM

    with pytest.raises(FakeOOM):
        tg.decode_generic(pointwise, _z((1, 4, 8, 8)), (8, 8), 1, fault_hook=always, oom_exceptions=(FakeOOM,),
                          min_tile=2)


# --------------------------------------------------------------------------------------------------
# Reach helpers


def test_conv_radius():
    assert rc.conv_radius(nn.Conv2d(1, 1, 3, padding=1)) == 1
    assert rc.conv_radius(nn.Conv2d(1, 1, 1)) == 0
    assert rc.conv_radius(nn.Conv2d(1, 1, 5, dilation=2)) == 4
    assert rc.conv_radius(nn.Conv3d(1, 1, (3, 7, 7))) == 3
    assert rc.conv_radius(nn.Conv2d(1, 1, (3, 5))) == 2


def test_impulse_extent_geometry():
    d = torch.zeros(1, 3, 40, 40)
    d[0, 1, 8:16, 8:16] = 1.0  # footprint of latent pixel (1, 1) at scale 8
    assert rc.impulse_extent(d, (1, 1), 8) == 0
    d[0, 0, 8, 35] = 1e-3  # 35 - 15 = 20 output px right of the footprint
    assert rc.impulse_extent(d, (1, 1), 8) == pytest.approx(20 / 8)
    assert rc.impulse_extent(d, (1, 1), 8, rel_tol=1e-2) == 0
    assert rc.impulse_extent(torch.zeros(4, 4), (0, 0), 1) == 0


def test_impulse_on_local_decoder_matches_reach(local):
    z = _z((1, 4, 15, 15), seed=8)
    with torch.no_grad():
        ref = local(z)
        z2 = z.clone()
        z2[0, :, 7, 7] += 1.0
        delta = local(z2) - ref
    assert rc.impulse_extent(delta, (7, 7), 4) == pytest.approx(2.75)


def test_default_halo():
    rep = rc.ReachReport(12.25, 5.0, ("mid.attn_1",), (), "structure")
    assert rep.total == 17.25 and rep.has_global_ops
    assert rc.default_halo(rep) == 18
    assert rc.default_halo(rep, include_pre_up=False) == 13
    assert rc.default_halo(rep, cap=8) == 8
    assert "12.25" in rep.describe()


def test_groupnorm_freezer_replays_statistics():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 3, 3, padding=1))
    x = _z((1, 4, 12, 12), seed=9)
    f = rc.GroupNormFreezer(net)
    with torch.no_grad():
        with f.record():
            ref = net(x)
        with f.replay():
            again = net(x)
        assert (again - ref).abs().max().item() <= 1e-5
        x2 = x.clone()
        x2[0, :, 6, 6] += 5.0
        with f.replay():  # both runs replayed: identical arithmetic outside the reach
            frozen = net(x2) - net(x)
        live = net(x2) - ref
    # Frozen statistics keep the change local (two 3x3 convs: 2 px); live GroupNorm spreads it.
    assert rc.impulse_extent(frozen, (6, 6), 1) == 2
    assert rc.impulse_extent(live, (6, 6), 1) > 2
    assert math.isfinite(float(frozen.abs().max()))
