"""The prefix of a split decoder (:mod:`..vae.split_layout`) in tiles, exactly: Sana's DC-AE, whose prefix holds its
global linear attention (the EfficientViT stages at 1/32-1/8 of the output) and peaked at 10 GiB for a 4096^2
decode on the whole latent.

The prefix is a list of :class:`..vae.split_layout.Unit`\\ s in forward order, each run over the whole map in tiles
into a buffer of its output (so two maps at the unit's resolution are alive, plus one tile's work):

* a local unit (convolutions, upsampling, per-pixel norms) takes each tile with a halo of its reach (the sum of
  its convolutions' half kernels, px of its input) and keeps the tile's core: the same inputs as on the whole map;
* a linear attention (diffusers' ``SanaMultiscaleLinearAttention`` with its 2.0 processor) runs in two passes.
  Its output at a pixel is ``(V K^T) q / (1^T K^T q)`` with the sums ``V K^T`` over every pixel of the map, so the
  first pass adds up ``[V; 1] K^T`` tile by tile (float32, as the host computes it) and the second applies it to
  each tile's queries; the queries, keys and values of a tile need a halo of the multi-scale convolutions' reach.
  A map of at most ``attention_head_dim`` px takes the host's quadratic attention: it runs whole.

The sums differ from the host's one matmul by float32 rounding only; the first-use self-check proves the result
equal to the host's decode (``decode.image.check_split``). Nothing here imports ComfyUI or diffusers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["linear_attention_tiled", "local_tiled", "run_units"]


def _spans(n: int, tile: int) -> Iterator[tuple[int, int]]:
    for a in range(0, n, tile):
        yield a, min(n, a + tile)


def _windows(h: int, w: int, tile: int, halo: int,
             sizing: bool = False) -> Iterator[tuple[tuple[int, int, int, int], tuple[int, ...]]]:
    """Per tile: its core ``(y0, y1, x0, x1)`` and the window read ``(a0, a1, b0, b1)`` (the core plus ``halo``,
    clipped at the map). ``sizing``: one tile per (core, window) shape (fake tensors: the others repeat its
    allocations)."""
    seen = set()
    for y0, y1 in _spans(h, tile):
        for x0, x1 in _spans(w, tile):
            win = (max(0, y0 - halo), min(h, y1 + halo), max(0, x0 - halo), min(w, x1 + halo))
            shape = (y1 - y0, x1 - x0, win[1] - win[0], win[3] - win[2])
            if sizing and shape in seen:
                continue
            seen.add(shape)
            yield (y0, y1, x0, x1), win


def local_tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int, halo: int,
                should_stop: Callable[[], Any] | None = None, sizing: bool = False) -> torch.Tensor:
    """``fn(x)`` for a local ``fn`` of reach ``halo`` (px of ``x``), one tile of ``tile`` px at a time; ``fn`` may
    scale the map by an integer (an upsampling). ``sizing``: one tile per shape (:func:`_windows`)."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    out: torch.Tensor | None = None
    for (y0, y1, x0, x1), (a0, a1, b0, b1) in _windows(h, w, tile, halo, sizing):
        if should_stop is not None:
            should_stop()
        o = fn(x[..., a0:a1, b0:b1])
        s = int(o.shape[-2]) // (a1 - a0)
        if out is None:
            out = torch.empty((*o.shape[:-2], h * s, w * s), dtype=o.dtype, device=o.device)
        out[..., y0 * s : y1 * s, x0 * s : x1 * s] = o[..., (y0 - a0) * s : (y1 - a0) * s, (x0 - b0) * s : (x1 - b0) * s]
        del o
    assert out is not None
    return out


def _qkv(attn: Any, x: torch.Tensor, core: tuple[int, int, int, int]) -> torch.Tensor:
    """The processor's concatenated multi-scale queries, keys and values of window ``x``, cropped to ``core``
    (window px), in float32 as the linear path upcasts them."""
    h = x.movedim(1, -1)
    h = torch.cat([attn.to_q(h), attn.to_k(h), attn.to_v(h)], dim=3).movedim(-1, 1)
    h = torch.cat([h] + [block(h) for block in attn.to_qkv_multiscale], dim=1)
    c0, c1, d0, d1 = core
    return h[..., c0:c1, d0:d1].to(torch.float32)


def _heads(attn: Any, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = int(qkv.shape[0])
    q, k, v = qkv.reshape(b, -1, 3 * attn.attention_head_dim, qkv.shape[-2] * qkv.shape[-1]).chunk(3, dim=2)
    return attn.nonlinearity(q), attn.nonlinearity(k), v


def _reach(modules: Sequence[Any]) -> int:
    return sum(int(m.kernel_size[0]) // 2 * int(m.dilation[0]) for top in modules for m in top.modules()
               if isinstance(m, torch.nn.Conv2d))


def linear_attention_tiled(attn: Any, x: torch.Tensor, tile: int, should_stop: Callable[[], Any] | None = None,
                           sizing: bool = False) -> torch.Tensor:
    """``attn(x)`` (diffusers' ``SanaMultiscaleLinearAttention``, 2.0 processor) in two passes over tiles of
    ``tile`` px (module docstring). ``sizing``: one tile per shape (:func:`_windows`)."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if h * w <= attn.attention_head_dim:  # the host's quadratic attention: a few px, whole
        return attn(x)
    halo = _reach(attn.to_qkv_multiscale)
    sums: torch.Tensor | None = None
    for (y0, y1, x0, x1), (a0, a1, b0, b1) in _windows(h, w, tile, halo, sizing):
        if should_stop is not None:
            should_stop()
        _, k, v = _heads(attn, _qkv(attn, x[..., a0:a1, b0:b1], (y0 - a0, y1 - a0, x0 - b0, x1 - b0)))
        part = torch.matmul(F.pad(v, (0, 0, 0, 1), mode="constant", value=1), k.transpose(-1, -2))
        sums = part if sums is None else sums.add_(part)
        del k, v, part
    assert sums is not None
    out = torch.empty_like(x)
    for (y0, y1, x0, x1), (a0, a1, b0, b1) in _windows(h, w, tile, halo, sizing):
        if should_stop is not None:
            should_stop()
        q, _, _ = _heads(attn, _qkv(attn, x[..., a0:a1, b0:b1], (y0 - a0, y1 - a0, x0 - b0, x1 - b0)))
        o = torch.matmul(sums, q).to(torch.float32)
        o = (o[:, :, :-1] / (o[:, :, -1:] + attn.eps)).to(x.dtype)
        o = o.reshape(int(x.shape[0]), -1, y1 - y0, x1 - x0)
        o = attn.to_out(o.movedim(1, -1)).movedim(-1, 1)
        if attn.norm_type == "rms_norm":
            o = attn.norm_out(o.movedim(1, -1)).movedim(-1, 1)
        else:
            o = attn.norm_out(o)
        if attn.residual_connection:
            o = o + x[..., y0:y1, x0:x1]
        out[..., y0:y1, x0:x1] = o
        del q, o
    return out


def run_units(units: Sequence[Any], z: torch.Tensor, tile: int, should_stop: Callable[[], Any] | None = None,
              sizing: bool = False) -> torch.Tensor:
    """The prefix ``units`` (:class:`..vae.split_layout.Unit`) on latent ``z`` in tiles of ``tile`` latent px (at a
    unit whose input is ``s`` times the latent's resolution: ``tile * s`` px). ``sizing``: on fake tensors, one
    tile per shape (the peak is the same: every map is allocated whole)."""
    x = z
    lh = int(z.shape[-2])
    for unit in units:
        t = max(1, tile * int(x.shape[-2]) // lh)
        if unit.attention is not None:
            x = linear_attention_tiled(unit.attention, x, t, should_stop, sizing)
        else:
            x = local_tiled(unit.run, x, t, _reach(unit.modules), should_stop, sizing)
    return x
