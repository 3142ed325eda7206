"""The exact KL walk's store: each full-size activation kept in row bands (:class:`_Bands`), allocated as
a row of tiles first writes it and released once no remaining tile reads it; reads across bands are assembled,
a read inside one band is a view. The walk (:mod:`.kl_exact`) owns the stores; the bands' rows and which of
them a tile touches come from the layout (:func:`..vae.kl_layout.band_rows`, :func:`..vae.kl_layout.bands_in`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..tiles import Rect
from ..vae.kl_layout import bands_in


class _Walk(Protocol):
    """What a store needs of the walk that owns it (:class:`.kl_exact._ExactRun`)."""

    batch: int
    dtype: torch.dtype

    def _alloc(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor: ...


class _Bands:
    """One activation in the store: per batch item, row bands (``rows``: the tile rows of the segment that
    writes it), each allocated when a row of tiles first writes it and released once no remaining tile
    reads it. ``whole``: one ``(B, C, H, W)`` tensor allocated at once and never released (the returned
    image). ``lead``: the sizes between channels and rows (a 3-D decoder's frames, every band holding all of
    them; () for 2-D)."""

    def __init__(self, run: _Walk, c: int, h: int, w: int, rows: list[tuple[int, int]],
                 device: torch.device, whole: bool, base: torch.Tensor | None = None,
                 lead: tuple[int, ...] = ()) -> None:
        self.run = run
        self.c, self.h, self.w = c, h, w
        self.lead = lead
        self.rows = rows
        self.starts = [r[0] for r in rows]
        self.device = device if base is None else base.device
        if base is None and whole:
            base = run._alloc((run.batch, c, *lead, h, w), device)
        self.base = base
        self.bands: list[list[torch.Tensor | None]] = [[None] * len(rows) for _ in range(run.batch)]

    def ensure(self, b: int, y0: int, y1: int) -> None:
        if self.base is not None:
            return
        for i in bands_in(self.rows, y0, y1, self.starts):
            if self.bands[b][i] is None:
                r0, r1 = self.rows[i]
                self.bands[b][i] = self.run._alloc((1, self.c, *self.lead, r1 - r0, self.w), self.device)

    def _band(self, b: int, i: int) -> torch.Tensor:
        t = self.bands[b][i]
        if t is None:
            raise RuntimeError(f"exact tiled walk: band {self.rows[i]} of item {b} read after its release")
        return t

    def read(self, b: int, y0: int, y1: int, x0: int, x1: int, device: torch.device) -> torch.Tensor:
        if self.base is not None:
            return self.base[b : b + 1, ..., y0:y1, x0:x1].to(device, non_blocking=True)
        idx = bands_in(self.rows, y0, y1, self.starts)
        if len(idx) == 1:
            r0 = self.rows[idx[0]][0]
            return self._band(b, idx[0])[..., y0 - r0 : y1 - r0, x0:x1].to(device, non_blocking=True)
        out = torch.empty((1, self.c, *self.lead, y1 - y0, x1 - x0), dtype=self.run.dtype, device=device)
        for i in idx:
            r0, r1 = self.rows[i]
            a, e = max(y0, r0), min(y1, r1)
            out[..., a - y0 : e - y0, :].copy_(self._band(b, i)[..., a - r0 : e - r0, x0:x1], non_blocking=True)
        return out

    def write(self, r: Rect, core: torch.Tensor) -> None:
        if self.base is not None:
            self.base[r.b : r.b + 1, ..., r.y0 : r.y1, r.x0 : r.x1].copy_(core, non_blocking=True)
            return
        for i in bands_in(self.rows, r.y0, r.y1, self.starts):
            r0, r1 = self.rows[i]
            a, e = max(r.y0, r0), min(r.y1, r1)
            self._band(r.b, i)[..., a - r0 : e - r0, r.x0 : r.x1].copy_(core[..., a - r.y0 : e - r.y0, :],
                                                                        non_blocking=True)

    def release_below(self, b: int, row: int) -> None:
        """Release item ``b``'s bands that end at or above ``row``."""
        if self.base is not None:
            return
        for i, (_, r1) in enumerate(self.rows):
            if r1 <= row:
                self.bands[b][i] = None

    def tensor(self) -> torch.Tensor:
        if self.base is not None:
            return self.base
        return torch.cat([torch.cat([self._band(b, i) for i in range(len(self.rows))], dim=-2)
                          for b in range(len(self.bands))])
