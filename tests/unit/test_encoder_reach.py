"""The traced reach of an encoder's local part (``measure/reach.traced_encoder_reach``) on toy encoders (no
ComfyUI): a stride-1 3x3 conv adds 1 input px over its scale, a strided one 2 (its padding may be one-sided), a
space-to-depth changes the scale with no conv stride; tiles of a toy encoder extended by the traced halo equal its
whole forward, by one less do not (a bound that every step reaches); a norm over space or an attention that runs is reported as global."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vramfit.memory.measure.reach import traced_encoder_reach
from vramfit.memory.vae.split_layout import is_global


class _Encoder(torch.nn.Module):
    """3x3 conv, strided 3x3 conv (Wan's (0, 1, 0, 1) pad), 3x3 conv, space-to-depth 2x, 3x3 conv: 4x, local."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.down = torch.nn.Conv2d(4, 4, 3, stride=2)
        self.b = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.c = torch.nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.down(F.pad(F.silu(self.a(x)), (0, 1, 0, 1))))
        return self.c(F.pixel_unshuffle(h, 2))


class _Local(torch.nn.Module):
    """3x3 conv, space-to-depth, 3x3 conv, space-to-depth, two 3x3 convs: 4x, a reach of 0.25 + 0.5 + 2 = 2.75
    latent px that every step reaches (no strided convolution: the bound is tight)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.b = torch.nn.Conv2d(16, 4, 3, padding=1)
        self.c = torch.nn.Conv2d(16, 4, 3, padding=1)
        self.d = torch.nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(F.pixel_unshuffle(F.silu(self.a(x)), 2))
        return self.d(F.silu(self.c(F.pixel_unshuffle(h, 2))))


def _reach(m: torch.nn.Module, latent: int = 8) -> float:
    x = torch.randn(1, 3, 4 * latent, 4 * latent)
    return traced_encoder_reach(m, lambda: m(x), latent, is_global)


def test_reach_counts_each_convolution_at_its_scale():
    torch.manual_seed(0)
    r = _reach(_Encoder())
    # a: 1 px at 4 px per latent px; down: 2 px at 4; b: 1 px at 2; c: 1 px at 1
    assert r.reach == 1 / 4 + 2 / 4 + 1 / 2 + 1 and r.halo == 3 and r.global_ops == ()


def test_tiles_with_the_traced_halo_equal_the_whole_forward():
    torch.manual_seed(0)
    m, h = _Local(), 24
    x = torch.randn(1, 3, 4 * h, 4 * h)
    with torch.no_grad():
        ref = m(x)
        halo = _reach(m).halo
        assert halo == 3

        def tiled(halo: int) -> torch.Tensor:
            out = torch.empty_like(ref)
            for a in range(0, h, 4):
                for c in range(0, h, 4):
                    ea, eb, ec, ed = max(0, a - halo), min(h, a + 4 + halo), max(0, c - halo), min(h, c + 4 + halo)
                    y = m(x[..., 4 * ea : 4 * eb, 4 * ec : 4 * ed])
                    out[..., a : a + 4, c : c + 4] = y[..., a - ea : a - ea + 4, c - ec : c - ec + 4]
            return out

        assert (tiled(halo) - ref).abs().max().item() <= 1e-5
        assert (tiled(halo - 1) - ref).abs().max().item() > 1e-3


def test_a_norm_over_space_is_global():
    m = _Encoder()
    m.b = torch.nn.Sequential(torch.nn.GroupNorm(2, 4), torch.nn.Conv2d(4, 4, 3, padding=1))
    assert _reach(m).global_ops == ("b.0",)
