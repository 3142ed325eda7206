"""GroupNorm statistics of the exact KL walk, merged from its tiles: per (batch item, group) mean and rstd of one
activation from per-tile partials (:class:`_StatAcc`, Chan's parallel merge), and a GroupNorm's affine
parameters as the walk applies them (:func:`_default_norm_params`).

The KL walker (:mod:`.kl_exact`) and SeedVR2's (:mod:`.seedvr2`, one "item" per frame) normalise every tile
with these global statistics, so a tiled GroupNorm equals the untiled one up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch


class _StatAcc:
    """Per (batch item, group) statistics of one activation, from per-tile partials.

    Each tile contributes (count, mean, M2) per group, reduced in float32 (float64 for float64
    activations) and kept in float64 on the statistics device; :meth:`finalize` merges them with Chan's
    parallel formula. Recording a tile is a list append, so it cannot fail half-way (a tile whose
    write already happened is never recorded twice).
    """

    def __init__(self, batch: int, norm: Any, device: torch.device) -> None:
        self.batch = batch
        self.groups = int(norm.num_groups)
        self.eps = float(norm.eps)
        self.device = device
        self.parts: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []

    def tile_stats(self, core: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
        """(count, mean, M2) of one (1, C, h, w) tile per group ((1, C, T, h, w): all its frames)."""
        g = self.groups
        c = int(core.shape[1])
        rest = tuple(int(v) for v in core.shape[2:])
        grouped = core.view(g, c // g, *rest)  # a view even of a cropped (strided) tile
        if grouped.dtype not in (torch.float32, torch.float64):
            grouped = grouped.float()
        var, mean = torch.var_mean(grouped, dim=tuple(range(1, grouped.ndim)), correction=0)
        cnt = c // g
        for v in rest:
            cnt *= v
        return float(cnt), mean.to(self.device, torch.float64), var.to(self.device, torch.float64) * cnt

    def record(self, b: int, stats: tuple[float, torch.Tensor, torch.Tensor]) -> None:
        self.parts.append((b, *stats))

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, rstd) float64 of shape (B, G): all tiles merged at once, in float64.

        Per batch item, with tile counts ``n_i``, means ``m_i`` and ``M2_i``: ``n = sum n_i``,
        ``mean = sum n_i m_i / n`` and ``M2 = sum M2_i + sum n_i (m_i - mean)^2``: the parallel-variance
        (Chan) merge of all tiles in one step, its between-tile term taken about the final mean (the
        two-pass form, at least as accurate as merging tile by tile). A few tensor ops whatever the
        number of tiles."""
        mean = torch.zeros(self.batch, self.groups, dtype=torch.float64, device=self.device)
        m2 = torch.zeros_like(mean)
        n = torch.zeros(self.batch, 1, dtype=torch.float64, device=self.device)
        if self.parts:
            idx = torch.tensor([p[0] for p in self.parts], dtype=torch.long, device=self.device)
            cnt = torch.tensor([p[1] for p in self.parts], dtype=torch.float64, device=self.device).unsqueeze(1)
            t_mean = torch.stack([p[2] for p in self.parts])  # (P, G) float64
            t_m2 = torch.stack([p[3] for p in self.parts])
            n.index_add_(0, idx, cnt)
            mean.index_add_(0, idx, t_mean * cnt)
            mean /= n.clamp_min(1.0)
            delta = t_mean - mean[idx]
            m2.index_add_(0, idx, t_m2 + delta * delta * cnt)
        return mean, torch.rsqrt(m2 / n.clamp_min(1.0) + self.eps)


def _default_norm_params(norm: Any, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    w = getattr(norm, "weight", None)
    bias = getattr(norm, "bias", None)
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = None if w is None else w.detach().to(device=x.device, dtype=dtype)
    bias = None if bias is None else bias.detach().to(device=x.device, dtype=dtype)
    return w, bias
