"""Tile and chunk geometry shared by every planner and executor: balanced splits of an axis, tile
rectangles, spans with a halo, and the latent-frame chunks of the video paths. Pure integer code."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Rect", "chunk_ranges", "grid", "largest_span", "overlap_chunks", "pair", "spans", "split_even",
           "tile_count"]

WHOLE = 1 << 30
"""A tile side larger than any activation: ``pair(None)``."""


def split_even(n: int, t: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``ceil(n / t)`` near-equal ``(start, end)`` pieces, none longer than ``t``."""
    if n <= 0:
        return []
    t = max(1, int(t))
    k = -(-n // t)
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def pair(v: int | Sequence[int] | None, what: str = "tile", minimum: int = 1) -> tuple[int, int]:
    """``(h, w)`` from an int or a pair (None: :data:`WHOLE`); ValueError below ``minimum``."""
    if v is None:
        return (WHOLE, WHOLE)
    if isinstance(v, int):
        v = (v, v)
    a, b = int(v[0]), int(v[1])
    if a < minimum or b < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {tuple(v)}")
    return a, b


@dataclasses.dataclass(frozen=True)
class Rect:
    """One tile core: batch item ``b``, rows ``[y0, y1)``, columns ``[x0, x1)``."""

    b: int
    y0: int
    y1: int
    x0: int
    x1: int

    @property
    def h(self) -> int:
        return self.y1 - self.y0

    @property
    def w(self) -> int:
        return self.x1 - self.x0


def grid(b: int, h: int, w: int, tile: tuple[int, int], y0: int = 0, x0: int = 0) -> list[Rect]:
    """Balanced tile cores of an ``h x w`` region of batch item ``b`` (offset ``y0, x0``), row-major."""
    return [Rect(b, y0 + a, y0 + c, x0 + d, x0 + e) for a, c in split_even(h, tile[0]) for d, e in split_even(w, tile[1])]


def tile_count(h: int, w: int, tile: int | Sequence[int]) -> int:
    """Tiles of at most ``tile`` px (an int or ``(h, w)``) covering ``h x w`` (as many as :func:`grid` cuts)."""
    th, tw = (tile, tile) if isinstance(tile, int) else tile
    return -(-h // max(1, int(th))) * -(-w // max(1, int(tw)))


def spans(n: int, tile: int, halo: int) -> list[tuple[int, int, int, int]]:
    """Tiles of one axis of ``n`` px: ``(core0, core1, ext0, ext1)``, balanced cores of at most ``tile``
    partitioning ``[0, n)``, extended by ``halo`` on each side and clipped to ``[0, n)``."""
    return [(a, b, max(0, a - halo), min(n, b + halo)) for a, b in split_even(n, tile)]


def largest_span(n: int, tile: int, halo: int = 0) -> int:
    """The longest tile of :func:`spans` (its halo included)."""
    return max(e1 - e0 for _, _, e0, e1 in spans(n, tile, halo))


def chunk_ranges(latent_frames: int, frames_per_chunk: int) -> list[tuple[int, int]]:
    """Latent-frame ranges ``[start, stop)`` of a causal chunking: ``[0, 1)`` alone, then chunks of
    ``frames_per_chunk`` (the last may be shorter). ``frames_per_chunk <= 0``: all the rest at once."""
    t = int(latent_frames)
    if t <= 0:
        return []
    k = t if frames_per_chunk <= 0 else int(frames_per_chunk)
    out = [(0, 1)]
    pos = 1
    while pos < t:
        out.append((pos, min(t, pos + k)))
        pos = out[-1][1]
    return out


def overlap_chunks(latent_frames: int, frames_per_chunk: int, overlap: int) -> list[tuple[int, int]]:
    """Overlapping latent-frame chunks ``[start, stop)`` as ComfyUI's ``tiled_scale_multidim`` places them
    along time (positions ``0, k - o, 2 (k - o), ...``; the last one clipped to the end)."""
    t, k = int(latent_frames), max(1, int(frames_per_chunk))
    o = max(0, min(int(overlap), k - 1))
    if t <= k:
        return [(0, t)]
    out = []
    for p in range(0, t - o, k - o):
        p = max(0, min(t - o, p))
        out.append((p, min(t, p + k)))
    return out
