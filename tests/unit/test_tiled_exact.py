"""Exact layer-synchronous tiled decode (``memory/executors/kl_exact.py``, layout ``memory/vae/kl_layout.py``) on a tiny pure-torch KL decoder.

The decoder below mirrors ComfyUI's ``comfy.ldm.modules.diffusionmodules.model.Decoder`` (same module
names, same forward) with few channels, so these tests run in seconds without ComfyUI. The real
fixture VAE is exercised in ``tests/host/test_tiled_exact_host.py``.

Thresholds: tiled vs untiled max abs diff <= 1e-4 (float32 noise; outputs are O(1)) and PSNR >= 60 dB
on [0, 1]; OOM-resumed vs uninterrupted max abs diff <= 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from vramfit.memory.cost import exact as dp
from vramfit.memory.executors import kl_exact as te
from vramfit.memory.tiles import largest_span, spans, split_even
from vramfit.memory.vae import kl_layout as kll

# Tiny tensors: one intra-op thread (with 2 on a loaded 2-core machine, OpenMP spinning made this module
# ~10x slower: 55 s vs 6 s measured).
pytestmark = pytest.mark.usefixtures("one_thread")

GROUPS = 4


def _gn(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, c, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, conv_shortcut: bool = False) -> None:
        super().__init__()
        self.in_channels, self.out_channels = cin, cout
        self.use_conv_shortcut = conv_shortcut
        self.swish = nn.SiLU(inplace=True)
        self.norm1 = _gn(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = _gn(cout)
        self.dropout = nn.Dropout(0.0, inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            if conv_shortcut:
                self.conv_shortcut = nn.Conv2d(cin, cout, 3, padding=1)
            else:
                self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(self.swish(self.norm1(x)))
        h = self.conv2(self.dropout(self.swish(self.norm2(h))))
        if self.in_channels != self.out_channels:
            x = self.conv_shortcut(x) if self.use_conv_shortcut else self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = _gn(c)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        b, c, hh, ww = h.shape
        q, k, v = (m(h).reshape(b, 1, c, hh * ww).transpose(2, 3) for m in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, hh, ww)
        return x + self.proj_out(o)


class Upsample(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.with_conv = True
        self.scale_factor = 2.0
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Decoder(nn.Module):
    def __init__(self, ch=8, ch_mult=(1, 2, 4), num_res_blocks=1, z=4, out_ch=3, conv_shortcut=False,
                 up_attn=False, give_pre_end=False, tanh_out=False) -> None:
        super().__init__()
        self.give_pre_end, self.tanh_out = give_pre_end, tanh_out
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z, block_in, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = ResnetBlock(block_in, block_in)
        self.mid.attn_1 = AttnBlock(block_in)
        self.mid.block_2 = ResnetBlock(block_in, block_in)
        self.up = nn.ModuleList()
        for i in reversed(range(len(ch_mult))):
            level = nn.Module()
            level.block = nn.ModuleList()
            level.attn = nn.ModuleList()
            block_out = ch * ch_mult[i]
            for _ in range(num_res_blocks + 1):
                level.block.append(ResnetBlock(block_in, block_out, conv_shortcut))
                block_in = block_out
                if up_attn:
                    level.attn.append(AttnBlock(block_in))
            if i != 0:
                level.upsample = Upsample(block_in)
            self.up.insert(0, level)
        self.norm_out = _gn(block_in)
        self.conv_out = nn.Conv2d(block_in, out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i in reversed(range(len(self.up))):
            for j, blk in enumerate(self.up[i].block):
                h = blk(h)
                if len(self.up[i].attn) > 0:
                    h = self.up[i].attn[j](h)
            if i != 0:
                h = self.up[i].upsample(h)
        if self.give_pre_end:
            return h
        h = self.conv_out(F.silu(self.norm_out(h)))
        return torch.tanh(h) if self.tanh_out else h


class KL(nn.Module):
    """``first_stage_model`` stand-in: ``post_quant_conv`` then the decoder."""

    def __init__(self, z: int = 4, **kw) -> None:
        super().__init__()
        self.post_quant_conv = nn.Conv2d(z, z, 1)
        self.decoder = Decoder(z=z, **kw)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))


def _model(seed: int = 0, **kw) -> KL:
    torch.manual_seed(seed)
    model = KL(**kw).eval()
    with torch.no_grad():  # non-trivial GroupNorm affines, so a wrong affine cannot pass
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model


def _latent(shape, seed: int = 0) -> torch.Tensor:
    """Regions of different statistics (what per-tile GroupNorm statistics get wrong)."""
    g = torch.Generator().manual_seed(seed)
    b, c, h, w = shape
    z = torch.randn(shape, generator=g)
    z[:, :, : h // 2, : w // 3] = z[:, :, : h // 2, : w // 3] * 3.0 + 1.5
    z[:, :, h // 2 :, w // 2 :] = z[:, :, h // 2 :, w // 2 :] * 0.2 - 1.0
    return z


def psnr01(a: torch.Tensor, b: torch.Tensor) -> float:
    a = ((a.double() + 1) / 2).clamp(0, 1)
    b = ((b.double() + 1) / 2).clamp(0, 1)
    mse = (a - b).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def kl():
    return _model()


@pytest.fixture(scope="module")
def ref_case(kl):
    z = _latent((2, 4, 11, 13), seed=1)
    with torch.no_grad():
        ref = kl.decode(z)
    return z, ref


# --------------------------------------------------------------------------------------------------
# Geometry


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), t=st.integers(1, 300), halo=st.integers(0, 40))
def test_largest_span_is_the_longest_extended_tile(n, t, halo):
    """The planner's skip rule reads it: the longest tile with its halo."""
    tiles = spans(n, t, halo)
    assert largest_span(n, t, halo) == max(e1 - e0 for _, _, e0, e1 in tiles) <= n
    assert largest_span(n, t, halo) >= min(n, -(-n // len(tiles)) + halo)


def test_largest_span_is_not_monotone_in_the_tile():
    """A smaller tile can make an interior tile with a halo on both sides (30 px in tiles of 14 and 15, a halo of
    10): the planner compares a candidate with every one sized before it, not only the last."""
    assert (largest_span(30, 14, 10), largest_span(30, 15, 10)) == (30, 25)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), t=st.integers(1, 600))
def test_split_even_is_a_balanced_partition(n, t):
    parts = split_even(n, t)
    assert len(parts) == (-(-n // t) if n else 0)
    pos = 0
    for a, b in parts:
        assert a == pos and b > a and b - a <= t
        pos = b
    assert pos == n
    if parts:
        lengths = [b - a for a, b in parts]
        assert max(lengths) - min(lengths) <= 1


def test_plan_counts_steps_and_store(kl):
    plan = kll.exact_geometry(kl, (2, 4, 11, 13), (16, 16))
    # ch_mult (1, 2, 4), 2 blocks per level: 3 levels x 2 blocks x 2 segments + 2 upsamples + out.
    assert len(plan.segments) == 3 * 2 * 2 + 2 + 1
    assert [s.kind for s in plan.segments[:5]] == ["conv1", "conv2", "conv1", "conv2", "upsample"]
    assert plan.out_hw == (44, 52) and plan.out_channels == 3
    # Full-res segments (44 x 52) use 3 x 4 tiles of <= 16 px; the latent-res ones a single tile.
    assert plan.tiles_per_segment[0] == 1 and plan.tiles_per_segment[-1] == 12
    assert plan.total_steps == 2 + 2 * sum(plan.tiles_per_segment)
    # One row of tiles (every activation in one band): nothing can be released before its segment ends,
    # so the worst point is the first block at full res: x (16 ch) + h (8) + shortcut(x) (8), batch 2.
    n = 44 * 52
    assert kll.exact_geometry(kl, (2, 4, 11, 13), (64, 64)).store_peak_elements == 2 * (16 + 8 + 8) * n
    assert kll.exact_geometry(kl, (2, 4, 11, 13), (64, 64), recompute=True).store_peak_elements == 2 * (16 + 8) * n
    # Three rows of tiles: x's rows are released as conv1's tiles pass.
    sched = kll.store_schedule(kl, (11, 13), (16, 16))
    assert plan.store_peak_elements == 2 * max(st.live for steps in sched for st in steps)
    assert plan.store_peak_elements < 2 * 23 * n and plan.store_peak_segment == "up.0.block.0.conv1"
    rplan = kll.exact_geometry(kl, (2, 4, 11, 13), (16, 16), recompute=True)
    assert rplan.store_peak_elements < 2 * 19 * n
    # Identity-shortcut blocks write their output over their input; channel-changing ones over the
    # shortcut(x) their conv1 wrote (so x dies with conv1).
    inplace = [s.name for s in plan.segments if s.inplace_of is not None]
    assert inplace == ["up.2.block.0.conv2", "up.2.block.1.conv2", "up.1.block.0.conv2", "up.1.block.1.conv2",
                       "up.0.block.0.conv2", "up.0.block.1.conv2"]
    assert [s.name for s in plan.segments if s.shortcut_output] == ["up.1.block.0.conv1", "up.0.block.0.conv1"]
    assert [s.kind for s in rplan.segments].count("conv12") == 2  # only the two channel-changing blocks


# --------------------------------------------------------------------------------------------------
# Structure check


def test_supports_kl_structure(kl):
    assert kll.supports_exact(kl)
    assert kll.supports_exact(kl.decoder)
    assert kll.unsupported_reason(kl) is None


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda m: setattr(m.decoder.up[1], "attn", nn.ModuleList([AttnBlock(16)])), "attention"),
        (lambda m: setattr(m.decoder, "conv_in", nn.Conv3d(4, 32, 3, padding=1)), "Conv2d"),
        (lambda m: delattr(m.decoder.mid, "attn_1"), "attn_1"),
        (lambda m: setattr(m.decoder.up[0].block[0], "norm1", nn.LayerNorm(16)), "GroupNorm"),
        (lambda m: setattr(m.decoder.up[1].upsample, "scale_factor", (1.0, 2.0, 2.0)), "scale"),
        (lambda m: delattr(m.decoder.up[2], "upsample"), "upsample"),
    ],
)
def test_unsupported_structures(mutate, expected):
    model = _model()
    mutate(model)
    assert not kll.supports_exact(model)
    assert expected in kll.unsupported_reason(model)
    with pytest.raises(ValueError, match="does not support"):
        te.decode_exact(model, torch.zeros(1, 4, 4, 4), (8, 8))


def test_up_path_attention_decoder_is_rejected():
    assert not kll.supports_exact(_model(up_attn=True))


# --------------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("tile", [(8, 8), (16, 12), (7, 30)])
def test_exact_matches_untiled(kl, ref_case, recompute, tile):
    z, ref = ref_case
    plan = kll.exact_geometry(kl, z.shape, tile, recompute)
    assert plan.tiles_per_segment[-1] >= 9  # at least 3 x 3 tiles at full res
    out = te.decode_exact(kl, z, tile, recompute=recompute)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out - ref).abs().max().item()
    assert err <= 1e-4, err
    assert psnr01(out, ref) >= 60.0


def test_band_freeing_halves_the_store(kl):
    """Tiles run row by row and a segment's input rows are released as soon as no remaining tile reads
    them (and no later segment needs them): the store peaks near max(in, out) + one band instead of
    in + out. Tracked live bytes at every unit start of a real decode (96 x 96 px, 12 rows of tiles)."""
    from vramfit.memory.measure.tracker import PeakTracker

    z = _latent((1, 4, 24, 24), seed=4)
    with torch.no_grad():
        ref = kl.decode(z)
    starts: list[int] = []
    with torch.no_grad(), PeakTracker("cpu", method="dispatch") as t:
        out = te.decode_exact(kl, z, (8, 8), should_stop=lambda: starts.append(t.current_bytes))
    n = 96 * 96
    old_in_out = (16 + 8 + 8) * n * 4  # x + h + y of the first full-res block, all whole (float32)
    store = max(starts)
    assert store <= 0.6 * old_in_out, (store, old_in_out)
    planned = kll.exact_geometry(kl, z.shape, (8, 8)).store_peak_elements * 4
    # The schedule is what runs (+ statistics partials and GroupNorm affine caches: ~1.5 % here).
    assert planned <= store <= 1.03 * planned, (store, planned)
    assert (out - ref).abs().max().item() <= 1e-4
    assert psnr01(out, ref) >= 60.0


def test_per_tile_statistics_would_not_be_exact(kl, ref_case):
    """Control: decoding tiles independently with the whole decoder is far from the reference.

    Shows that the structured latent and the tile size are hard enough for the exactness tests above
    to mean something.
    """
    z, ref = ref_case
    out = torch.empty_like(ref)
    with torch.no_grad():
        for y0, y1 in split_even(z.shape[2], 4):
            for x0, x1 in split_even(z.shape[3], 5):
                a0, a1, b0, b1 = max(0, y0 - 2), min(z.shape[2], y1 + 2), max(0, x0 - 2), min(z.shape[3], x1 + 2)
                t = kl.decode(z[:, :, a0:a1, b0:b1])
                out[:, :, 4 * y0 : 4 * y1, 4 * x0 : 4 * x1] = t[:, :, 4 * (y0 - a0) : 4 * (y1 - a0), 4 * (x0 - b0) : 4 * (x1 - b0)]
    assert psnr01(out, ref) < 40.0


@pytest.mark.parametrize(
    "kw",
    [
        {"conv_shortcut": True},
        {"tanh_out": True},
        {"give_pre_end": True},
        {"num_res_blocks": 0, "ch_mult": (1, 2)},
    ],
)
def test_exact_variants(kw):
    model = _model(seed=3, **kw)
    z = _latent((1, 4, 9, 7), seed=2)
    with torch.no_grad():
        ref = model.decode(z)
    out = te.decode_exact(model, z, (6, 5))
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-4


def test_bare_decoder_input(kl):
    z = _latent((1, 4, 10, 6), seed=4)
    with torch.no_grad():
        h = kl.post_quant_conv(z)
        ref = kl.decoder(h)
    out = te.decode_exact(kl.decoder, h, (8, 8))
    assert (out - ref).abs().max().item() <= 1e-4


def test_float64_is_exact_to_float64_noise(kl):
    model = _model(seed=5).double()
    z = _latent((1, 4, 5, 6), seed=6).double()
    with torch.no_grad():
        ref = model.decode(z)
    out = te.decode_exact(model, z, (5, 5))
    assert out.dtype == torch.float64
    assert (out - ref).abs().max().item() <= 1e-10


def test_bfloat16_tracks_untiled_bfloat16():
    model = _model(seed=7)
    z = _latent((1, 4, 8, 8), seed=8)
    with torch.no_grad():
        ref32 = model.decode(z)
        ref16 = model.bfloat16().decode(z.bfloat16()).float()
    out = te.decode_exact(model, z.bfloat16(), (8, 8)).float()
    # Both carry bfloat16 rounding; the tiled decode must not be worse than the untiled bf16 one
    # by more than rounding noise (GroupNorm applied in float32 here).
    assert psnr01(out, ref32) >= psnr01(ref16, ref32) - 3.0
    assert psnr01(out, ref16) >= 35.0


def test_host_store_and_separate_output_device(kl, ref_case):
    z, ref = ref_case
    # On a CPU-only machine every device is the CPU: this exercises the explicit-device code path and
    # the pinned-allocation fallback (pinning needs CUDA; it is attempted and falls back to pageable).
    out = te.decode_exact(kl, z, (8, 8), store_device="cpu", compute_device="cpu", out_device="cpu",
                          pin_memory=True)
    assert (out - ref).abs().max().item() <= 1e-4


# --------------------------------------------------------------------------------------------------
# Progress, stop, OOM


class FakeOOM(RuntimeError):
    pass


def test_progress_counts_to_the_announced_total(kl, ref_case):
    z, _ = ref_case
    calls: list[tuple[int, int]] = []
    te.decode_exact(kl, z, (8, 8), progress=lambda d, t: calls.append((d, t)))
    total = z.shape[0] * kll.kl_layout(kl).steps(z.shape[-2:], (8, 8))  # the planner's figure (Plan.units)
    assert calls[0] == (0, total)
    assert [d for d, _ in calls] == list(range(total + 1))
    assert all(t == total for _, t in calls)


def test_should_stop_propagates_between_tiles(kl, ref_case):
    z, _ = ref_case

    class Interrupted(Exception):
        pass

    steps: list[int] = []
    n_calls = 0

    def stop():
        nonlocal n_calls
        n_calls += 1
        if n_calls == 7:
            raise Interrupted

    # Even when every Exception counts as OOM (ComfyUI's OOM_EXCEPTION off CUDA), a stop is a stop.
    with pytest.raises(Interrupted):
        te.decode_exact(kl, z, (8, 8), should_stop=stop, fault_hook=steps.append, oom_exceptions=(Exception,))
    # 2 mid steps + 4 tiles ran before the 7th check; nothing after it.
    assert steps == [0, 1, 2, 3]


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("fail_at", [0, 5, 30, 61])
def test_oom_resume_equals_uninterrupted(kl, ref_case, fail_at, recompute):
    z, _ = ref_case
    tile = (16, 16)
    clean = te.decode_exact(kl, z, tile, recompute=recompute)
    seen: list[int] = []
    cleaned: list[int] = []

    def hook(k: int) -> None:
        seen.append(k)
        if k == fail_at:
            raise FakeOOM("injected")

    progress: list[tuple[int, int]] = []
    out = te.decode_exact(
        kl, z, tile, recompute=recompute, fault_hook=hook, oom_exceptions=(FakeOOM,),
        on_oom=lambda: cleaned.append(1), progress=lambda d, t: progress.append((d, t)),
    )
    assert fail_at in seen and cleaned == [1]
    assert seen == list(range(len(seen)))  # every tile attempt counted once
    err = (out - clean).abs().max().item()
    assert err <= 1e-5, err
    done = [d for d, _ in progress]
    assert done == sorted(done) and progress[-1][0] == progress[-1][1]
    # Resuming ran more, smaller tiles than the uninterrupted plan but never repeated finished work:
    plan_small = kll.exact_geometry(kl, z.shape, (8, 8), recompute)
    assert len(seen) <= plan_small.total_steps - plan_small.mid_steps + 1


@pytest.mark.parametrize("which", ["inplace_conv2", "conv12", "upsample", "out"])
def test_oom_inside_each_segment_kind(kl, ref_case, which):
    """Fail on the 3rd tile of the last full-resolution segment of a kind (the in-place residual write
    included: tiles already written over their own input must not be recomputed)."""
    z, _ = ref_case
    tile = (16, 16)
    recompute = which == "conv12"
    plan = kll.exact_geometry(kl, z.shape, tile, recompute)
    kind = "conv2" if which == "inplace_conv2" else which
    idx = max(i for i, s in enumerate(plan.segments)
              if s.kind == kind and (which != "inplace_conv2" or s.inplace_of is not None))
    assert plan.tiles_per_segment[idx] >= 3
    fail_at = 2 * sum(plan.tiles_per_segment[:idx]) + 2
    clean = te.decode_exact(kl, z, tile, recompute=recompute)

    def hook(k: int) -> None:
        if k == fail_at:
            raise FakeOOM

    out = te.decode_exact(kl, z, tile, recompute=recompute, fault_hook=hook, oom_exceptions=(FakeOOM,))
    assert (out - clean).abs().max().item() <= 1e-5


def test_repeated_oom_down_to_min_tile_raises(kl):
    z = _latent((1, 4, 6, 6), seed=9)

    def always(k: int) -> None:
        raise FakeOOM("always")

    with pytest.raises(FakeOOM):
        te.decode_exact(kl, z, (16, 16), fault_hook=always, oom_exceptions=(FakeOOM,), min_tile=4)


def test_oom_outside_tiles_is_not_swallowed(kl):
    """An OOM in the whole-latent mid block cannot be helped by smaller tiles: it propagates."""
    z = _latent((1, 4, 6, 6), seed=9)
    model = _model()

    def boom(*_):
        raise FakeOOM("mid")

    model.decoder.mid.attn_1.register_forward_pre_hook(boom)
    with pytest.raises(FakeOOM):
        te.decode_exact(model, z, (8, 8), oom_exceptions=(FakeOOM,))


def test_oom_while_allocating_a_store_propagates(kl, monkeypatch):
    """Smaller tiles cannot make a full-size store fit: the caller must re-plan (e.g. host store)."""
    z = _latent((1, 4, 6, 6), seed=9)
    calls = []
    real_alloc = te._ExactRun._alloc

    def alloc(self, shape, device):
        calls.append(shape)
        if len(calls) == 4:
            raise FakeOOM("store")
        return real_alloc(self, shape, device)

    monkeypatch.setattr(te._ExactRun, "_alloc", alloc)
    shrank = []
    with pytest.raises(FakeOOM):
        te.decode_exact(kl, z, (8, 8), oom_exceptions=(FakeOOM,), on_oom=lambda: shrank.append(1))
    assert len(calls) == 4 and shrank == []


def test_estimate_is_consistent_with_plan(kl):
    est = dp.estimate_exact_peak(kl, (1, 4, 32, 32), (32, 32), 2, store_on_device=False)
    plan = kll.exact_geometry(kl, (1, 4, 32, 32), (32, 32))
    assert est["store"] == plan.store_peak_elements * 2 and est["host"] == est["store"]
    assert est["device"] == max(est["tile"], est["mid"])
    on_dev = dp.estimate_exact_peak(kl, (1, 4, 32, 32), (32, 32), 2, store_on_device=True)
    assert on_dev["device"] == est["device"] + est["store"] and on_dev["host"] == 0
    # Smaller tiles need less per-tile memory.
    assert dp.estimate_exact_peak(kl, (1, 4, 32, 32), (16, 16), 2, False)["tile"] < est["tile"]


# --------------------------------------------------------------------------------------------------
# Reach of the KL structure (memory/measure/reach.py)


def test_structural_and_traced_reach_agree(kl):
    from vramfit.memory.measure import reach as rc

    s = rc.structural_reach(kl)
    # ch_mult (1, 2, 4), 2 resnet blocks per level: 4 + 1/2 + 4/2 + 1/4 + 4/4 + conv_out 1/4 = 8.
    assert s.up_path == pytest.approx(8.0)
    assert s.pre_up == pytest.approx(5.0)  # conv_in 1 + block_1 2 + block_2 2
    assert s.global_ops == ("mid.attn_1",)
    z = _latent((1, 4, 6, 6))
    t = rc.traced_reach(kl, lambda: kl.decode(z), (6, 6), up_path_from="decoder.mid.block_2")
    assert t.up_path == pytest.approx(s.up_path) and t.pre_up == pytest.approx(s.pre_up)
    assert "decoder.mid.attn_1" in t.global_ops
    # A 3x3 conv_shortcut runs in parallel with conv1+conv2: structure takes the max, tracing sums.
    cs = _model(conv_shortcut=True)
    assert rc.structural_reach(cs).up_path == pytest.approx(8.0)
    assert rc.traced_reach(cs, lambda: cs.decode(z), (6, 6)).total > rc.structural_reach(cs).total


def test_up_path_impulse_response_matches_structural_reach(kl):
    """Perturb one pixel of the mid block's output; with GroupNorm statistics frozen, the image changes
    exactly within the structural reach of the up path."""
    from vramfit.memory.measure import reach as rc

    z = _latent((1, 4, 21, 21), seed=11)
    pos = (10, 10)
    impulse = torch.zeros(1, 32, 21, 21)
    impulse[0, :, pos[0], pos[1]] = 1.0
    add = {"on": False}
    handle = kl.decoder.mid.block_2.register_forward_hook(lambda m, i, o: o + impulse if add["on"] else o)
    freezer = rc.GroupNormFreezer(kl.decoder)
    try:
        with torch.no_grad():
            with freezer.record():
                kl.decode(z)
            with freezer.replay():
                base = kl.decode(z)
                add["on"] = True
                pert = kl.decode(z)
    finally:
        handle.remove()
    delta = pert - base
    assert rc.impulse_extent(delta, pos, 4) == pytest.approx(rc.structural_reach(kl).up_path)


# --------------------------------------------------------------------------------------------------
# GroupNorm statistics merge (_StatAcc)


def _sequential_chan(acc: te._StatAcc) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous finalize: Chan's pairwise update, one tile at a time (reference for accuracy)."""
    n = [0.0] * acc.batch
    mean = torch.zeros(acc.batch, acc.groups, dtype=torch.float64)
    m2 = torch.zeros_like(mean)
    for b, cnt, t_mean, t_m2 in acc.parts:
        tot = n[b] + cnt
        delta = t_mean - mean[b]
        mean[b] += delta * (cnt / tot)
        m2[b] += t_m2 + delta * delta * (n[b] * cnt / tot)
        n[b] = tot
    count = torch.tensor(n, dtype=torch.float64).clamp_min(1.0).unsqueeze(1)
    return mean, torch.rsqrt(m2 / count + acc.eps)


def _record_tiles(acc: te._StatAcc, x: torch.Tensor, tiles: list[tuple[int, int]], seed: int) -> None:
    """Every batch item of ``x`` cut into a different irregular grid, recorded interleaved and shuffled."""
    parts = []
    for b in range(x.shape[0]):
        th, tw = tiles[b % len(tiles)]
        for y0, y1 in split_even(x.shape[2], th):
            for x0, x1 in split_even(x.shape[3], tw):
                parts.append((b, x[b : b + 1, :, y0:y1, x0:x1]))
    order = torch.randperm(len(parts), generator=torch.Generator().manual_seed(seed)).tolist()
    for i in order:
        b, core = parts[i]
        acc.record(b, acc.tile_stats(core))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_statistics_merge_equals_a_direct_computation(dtype):
    """Per (item, group) mean and 1/std from many irregular tiles equal ``var_mean`` of the whole
    activation in float64, also with a large mean over a small spread (cancellation-prone), and are at
    least as accurate as the tile-by-tile Chan merge."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 61, 47, generator=g, dtype=torch.float64)
    x[0] = x[0] * 0.01 + 1000.0
    x[1] = x[1] * 5.0 - 3.0
    x[2, :, :20] += 50.0  # regions with different statistics
    x = x.to(dtype)
    norm = nn.GroupNorm(GROUPS, 8, eps=1e-6)
    acc = te._StatAcc(4, norm, torch.device("cpu"))  # item 3 gets no tiles
    _record_tiles(acc, x, [(3, 4), (7, 5), (13, 2)], seed=1)
    assert len(acc.parts) > 300
    mean, rstd = acc.finalize()
    assert mean.shape == rstd.shape == (4, GROUPS) and mean.dtype == rstd.dtype == torch.float64

    # Reference: two passes over the whole activation in float64, the mean refined once.
    xd = x.double().view(3, GROUPS, -1)
    ref_mean = xd.mean(2, keepdim=True)
    ref_mean = ref_mean + (xd - ref_mean).mean(2, keepdim=True)
    ref_rstd = torch.rsqrt((xd - ref_mean).pow(2).mean(2) + norm.eps)
    ref_mean = ref_mean.squeeze(2)
    # float32 tiles are reduced in float32 (then merged in float64): item 0 (1000 +- 0.01) loses ~2e-5.
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert torch.allclose(mean[:3], ref_mean, rtol=tol, atol=0)
    assert torch.allclose(rstd[:3], ref_rstd, rtol=tol, atol=0)
    assert torch.equal(mean[3], torch.zeros(GROUPS))  # no tiles: zero mean, 1/sqrt(eps), as before
    assert torch.allclose(rstd[3], torch.full((GROUPS,), norm.eps ** -0.5, dtype=torch.float64))

    old_mean, old_rstd = _sequential_chan(acc)
    new_err = ((rstd[:3] - ref_rstd).abs() / ref_rstd).max().item()
    old_err = ((old_rstd[:3] - ref_rstd).abs() / ref_rstd).max().item()
    assert new_err <= max(old_err * 1.5, 1e-15), (new_err, old_err)
    assert torch.allclose(mean, old_mean, rtol=1e-12, atol=0)


def test_statistics_merge_is_a_fixed_number_of_ops():
    """The merge runs a few tensor ops whatever the number of tiles (no per-tile kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for tile in (16, 2):
        acc = te._StatAcc(2, nn.GroupNorm(GROUPS, 8), torch.device("cpu"))
        _record_tiles(acc, torch.randn(2, 8, 32, 32), [(tile, tile)], seed=0)
        with Count() as c:
            acc.finalize()
        counts.append((len(acc.parts), c.ops))
    (few, ops_few), (many, ops_many) = counts
    assert many >= 50 * few and ops_many == ops_few, counts
