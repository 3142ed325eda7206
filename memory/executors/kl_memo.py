"""The exact KL walk's repeated tiles in a sizing run (:class:`TileMemo`): a meta-sized walk counts each tile's own
peak once per kind of tile and adds it again, without running the tile, for every later tile of the same kind.

A sizing run (:class:`..measure.sizing.MetaSizer`) computes nothing: every op only makes its output's shape, so
what a tile allocates follows from the shapes it reads and how it reads them. Two tiles of one segment are of one
kind when their cores have the same size and every read has the same size and the same band structure (one band:
a view of the store; several: assembled into a new tensor; the pixels: a view), with the GroupNorm affine terms of
their item already cached (the first tile of an item caches them: it runs). Such a tile allocates the same
tensors in the same order, so its own peak above the live bytes at its start, and the statistics it leaves
(:meth:`.kl_stats._StatAcc.record`), are those of the first tile of its kind. A repeat therefore raises each
counter's peak to its live bytes plus that own peak (:func:`..measure.tracker.raise_peaks`) and leaves statistics
of the same shapes; the store's bands are allocated and released around it as the walk does (no tile writes or
frees a band). The sized peak equals the full run's to the byte (tests/host/test_encode_planning.py); a 392x520
KL encode in tiles of 32 px: 183 kinds of 1,534 tiles, sized in 3.5 s instead of 11 s (docs/ENCODE.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..measure.tracker import active_counters, own_peaks, raise_peaks
from ..tiles import Rect
from ..vae.kl_layout import bands_in, block_shortcut

__all__ = ["TileMemo"]

Stats = list[tuple[float, torch.Tensor, torch.Tensor]] | None


class TileMemo:
    """The kinds of tile met so far in one sizing run: key -> (counters' devices, own peaks, statistics' form)."""

    def __init__(self, after: Callable[[], None] | None = None) -> None:
        self.seen: dict[tuple, tuple[list[str], list[int], list[tuple[float, Any, Any]] | None]] = {}
        self.repeats = 0
        """Tiles counted from their kind's first tile instead of run."""
        self.after = after
        """Called after every tile (a planner's sizing raises there once the peak so far is over its budget)."""

    def key(self, run: Any, seg: Any, r: Rect) -> tuple | None:
        """The kind of tile ``r`` of segment ``seg`` in the walk ``run`` (:class:`.kl_exact._ExactRun`); None: run
        it (a tile that holds every item, a kind not listed, an item whose affine terms are not cached yet)."""
        info = seg.info
        reads = _reads(run, seg, r)
        if info.whole_batch or reads is None:
            return None
        if any((n, run._stat_item(n, r.b)) not in run.affine_cache for n in _norms(run, seg)):
            return None
        form = []
        for name, (y0, y1, x0, x1) in reads:
            store = run.stores[name]
            bands = 0 if store.base is not None else len(bands_in(store.rows, y0, y1, store.starts))
            form.append((name, y1 - y0, x1 - x0, bands))
        return (run.seg_index, r.y1 - r.y0, r.x1 - r.x0, tuple(form))

    def unit(self, key: tuple | None, fn: Callable[..., Stats], *args: Any) -> Stats:
        """``fn(*args)`` (one tile: run, statistics, writes), or for a repeat of a known kind its counted effect;
        then :attr:`after`."""
        stats = self._unit(key, fn, *args)
        if self.after is not None:
            self.after()
        return stats

    def _unit(self, key: tuple | None, fn: Callable[..., Stats], *args: Any) -> Stats:
        if key is None:
            return fn(*args)
        counters = active_counters()
        devices = [c.device_type for c in counters]
        found = self.seen.get(key)
        if found is not None and found[0] == devices:
            _, own, form = found
            raise_peaks(counters, own)
            self.repeats += 1
            if form is None:
                return None
            return [(n, torch.empty(m[0], dtype=m[1], device=m[2]), torch.empty(v[0], dtype=v[1], device=v[2]))
                    for n, m, v in form]
        with own_peaks(counters) as own:
            stats = fn(*args)
        form = None if stats is None else [
            (n, (tuple(m.shape), m.dtype, m.device), (tuple(v.shape), v.dtype, v.device)) for n, m, v in stats]
        self.seen[key] = (devices, list(own), form)
        return stats


def _norms(run: Any, seg: Any) -> tuple[str, ...]:
    """The activations whose GroupNorm affine terms a tile of ``seg`` applies (:meth:`.kl_exact._ExactRun._gn`)."""
    info = seg.info
    if info.kind in ("conv1", "conv2", "out"):
        return (info.inputs[0],)
    if info.kind == "conv12":
        return (info.inputs[0], run._h_of(seg))
    return ()


def _reads(run: Any, seg: Any, r: Rect) -> list[tuple[str, tuple[int, int, int, int]]] | None:
    """Every store read of a tile of ``seg`` with core ``r``, as :meth:`.kl_exact._ExactRun._run_tile` makes them;
    None for the kinds not listed here (SVD's time mixing)."""
    info = seg.info
    kind = info.kind
    x = info.inputs[0]
    if kind in ("in", "downsample", "upsample", "out"):
        return [(x, run._read_region(info, x, r))]
    if kind == "conv1":
        reads = [(x, run._read_region(info, x, r))]
        if info.shortcut_output is not None:
            reads.append((x, run._region(x, r, block_shortcut(seg.module)[1])))
        return reads
    if kind == "conv2":
        return [(x, run._read_region(info, x, r)), (info.inputs[1], (r.y0, r.y1, r.x0, r.x1))]
    if kind == "conv12":
        return [(x, run._read_region(info, x, r)), (x, run._region(x, r, block_shortcut(seg.module)[1]))]
    return None
