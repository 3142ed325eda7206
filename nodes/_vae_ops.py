"""ComfyUI-specific numerics the exact KL walker is given: GroupNorm affines through ComfyUI's weight
casting, and the VAE mid block's split attention bounded by a byte budget. Imported only inside ComfyUI."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["bounded_vae_attention", "group_norm_params"]


def group_norm_params(norm: Any, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A GroupNorm's affine weight/bias as float32 (float64 for float64 ``x``) on ``x``'s device, through
    ComfyUI's weight casting (``comfy.ops``: low-VRAM offloaded weights, weight patches) when it applies."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if getattr(norm, "weight", None) is None:
        bias = getattr(norm, "bias", None)
        return None, None if bias is None else bias.detach().to(x.device, dtype)
    casts = bool(getattr(norm, "comfy_cast_weights", False)) or bool(getattr(norm, "weight_function", None)) or bool(
        getattr(norm, "bias_function", None)
    )
    if casts:
        return _cast_norm_params(norm, x, dtype)
    b = getattr(norm, "bias", None)
    return norm.weight.detach().to(x.device, dtype), None if b is None else b.detach().to(x.device, dtype)


def _cast_norm_params(norm: Any, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``comfy.ops.cast_bias_weight`` for a parameter read outside the layer's forward: copies, then
    releases the cast. With dynamic VRAM the cast may return a view of an aimdo page (or of a shared
    cast buffer) that is only valid until ``uncast_bias_weight`` unpins it, so the values are copied
    first; hosts whose ``cast_bias_weight`` has no ``offloadable`` parameter get the plain call."""
    import comfy.ops

    uncast = getattr(comfy.ops, "uncast_bias_weight", None)
    if uncast is None or "offloadable" not in inspect.signature(comfy.ops.cast_bias_weight).parameters:
        w, b = comfy.ops.cast_bias_weight(norm, x, dtype=dtype, device=x.device)
        return w.to(dtype, copy=True), None if b is None else b.to(dtype, copy=True)
    w, b, stream = comfy.ops.cast_bias_weight(norm, x, dtype=dtype, device=x.device, offloadable=True)
    try:
        return w.to(dtype, copy=True), None if b is None else b.to(dtype, copy=True)
    finally:
        uncast(norm, w, b, stream)


def _bounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """ComfyUI's ``normal_attention`` + ``slice_attention`` (same reshapes, same ops per slice), with
    query-row slices sized from ``max_bytes`` instead of the free memory of the moment. Every slice holds
    complete rows of the score matrix, so each softmax is the untiled one; with one slice the calls are
    the very calls ComfyUI makes."""
    orig = q.shape
    b, c = orig[0], orig[1]
    q = q.reshape(b, c, -1).permute(0, 2, 1)  # b, hw, c
    k = k.reshape(b, c, -1)  # b, c, hw
    v = v.reshape(b, c, -1)
    n = int(q.shape[1])
    scale = int(q.shape[-1]) ** (-0.5)
    modifier = 3 if q.element_size() == 2 else 2.5  # ComfyUI's estimate of the live score copies
    per_row = b * int(k.shape[2]) * q.element_size() * modifier
    rows = max(1, min(n, int(max_bytes // max(1, per_row))))
    r1 = torch.zeros_like(k, device=q.device)
    for i in range(0, n, rows):
        s1 = torch.bmm(q[:, i : i + rows], k) * scale
        s2 = torch.nn.functional.softmax(s1, dim=2).permute(0, 2, 1)
        del s1
        r1[:, :, i : i + rows] = torch.bmm(v, s2)
        del s2
    return r1.reshape(orig)


@contextlib.contextmanager
def bounded_vae_attention(model: Any, max_bytes: int) -> Iterator[int]:
    """Within the block, the VAE attention blocks of ``model`` that use ComfyUI's split attention
    (``normal_attention``: the CPU path, and GPUs without PyTorch/xformers attention) slice their score
    matrix to at most ``max_bytes`` (ComfyUI's own estimate) instead of by the free memory of the moment.
    Memory-efficient kernels (PyTorch SDPA, xformers) are left alone. Yields how many blocks changed."""
    from comfy.ldm.modules.diffusionmodules import model as dm

    original = dm.normal_attention
    swapped = [m for m in model.modules() if getattr(m, "optimized_attention", None) is original]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _bounded_attention(q, k, v, max_bytes)

    for m in swapped:
        m.optimized_attention = attention
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            m.optimized_attention = original
