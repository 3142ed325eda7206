"""Exact, single-pass tiled decode (and encode) of GroupNorm KL VAEs (layer-synchronous tiling).

Decode: the mid block runs once per item on the whole latent; the up path runs segment by segment (cut at
every GroupNorm, :mod:`..vae.kl_layout`), tile by tile, from full-size activations kept in row bands. Every
GroupNorm uses the global statistics merged from the previous segment's tile cores, so the result equals
the untiled decode up to float rounding. Encode is the same walk the other way: ``conv_in`` and the down path
in segments and tiles, then the whole tail (mid block, output convolution, the host's own regularizer) once
per item on the latent-resolution map. An OOM inside a tile halves the tile and resumes (finished tiles are
kept). The statistics' merge is :mod:`.kl_stats`, the row-band store :mod:`.kl_store`. Design:
docs/TILED_DECODE.md, docs/ENCODE.md. Duck-typed: no ComfyUI import.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..oom import OomEvent, OomResume, oom_types
from ..run_context import NormParamsFn, ProgressFn
from ..tiles import Rect, grid, pair, tile_count
from ..vae.kl_layout import (
    BoundLayout,
    SegmentInfo,
    band_rows,
    block_shortcut,
    dying_inputs,
    kl_layout,
    read_span,
    whole_output,
)
from ..vae.kl_structure import hunyuan_image
from ..vae.swap import swapped
from .kl_memo import TileMemo
from .kl_stats import _default_norm_params, _StatAcc
from .kl_store import _Bands

log = logging.getLogger("vramfit.memory.executors.kl_exact")

EXECUTOR_VERSION = "v1"
"""Version of this executor's allocation pattern (this module, its store :mod:`.kl_store` and statistics
:mod:`.kl_stats`), part of every exact cost-model key (shipped and cached) and self-check verdict.
Bump it when a change alters what the executor holds at its peak, then re-ship ``memory/cost/data/exact``
(``bench/tiled_decode.py --write-defaults``); edits that do not (comments, error handling) keep the key."""

__all__ = ["EXECUTOR_VERSION", "MIN_TILE", "decode_exact", "decode_exact_into",
           "encode_exact", "run_exact"]


MIN_TILE = 8
"""Smallest tile side (px) the OOM fallback shrinks to."""


# --------------------------------------------------------------------------------------------------
# The executor


@dataclasses.dataclass(frozen=True)
class _Seg:
    info: SegmentInfo
    module: Any
    """What the segment calls (:attr:`SegmentInfo.module`): its resnet block, upsample, or the decoder."""


class _ExactRun:
    def __init__(
        self,
        bound: BoundLayout,
        z: torch.Tensor,
        tile: tuple[int, int],
        store_device: torch.device,
        compute_device: torch.device,
        out_device: torch.device,
        recompute: bool,
        progress: ProgressFn | None,
        should_stop: Callable[[], None] | None,
        fault_hook: Callable[[int], None] | None,
        oom_exceptions: tuple[type[BaseException], ...],
        on_oom: Callable[[], None] | None,
        min_tile: int,
        pin_memory: bool | None,
        norm_params: NormParamsFn | None,
        memo: TileMemo | None = None,
    ) -> None:
        self.model = bound.model
        self.memo = memo
        """A sizing run's repeated tiles (:mod:`.kl_memo`; None: every tile runs)."""
        self.layout = layout = bound.layout
        self.dec, seg_modules, self.consumer = bound.dec, bound.segments, bound.consumer
        self.consumer_path = dict(layout.consumer)
        self.segs = [_Seg(info, m) for info, m in zip(layout.segments, seg_modules, strict=True)]
        self.z = z
        self.tile = tile
        self.store_device = store_device
        self.compute = compute_device
        self.out_device = out_device
        self.recompute = recompute
        self.progress = progress
        self.fault_hook = fault_hook
        self.driver = OomResume(oom_exceptions, should_stop=should_stop, on_oom=on_oom)
        self.min_tile = max(1, int(min_tile))
        self.norm_params = norm_params or _default_norm_params
        if pin_memory is None:
            pin_memory = store_device.type == "cpu" and compute_device.type == "cuda"
        self.pin = bool(pin_memory)
        self.dtype = z.dtype
        self.batch = int(z.shape[0])
        self.encode = layout.direction == "encode"
        if self.encode:  # z: the pixels, the source of ``in``; the latent: the tail's map / pre_scale
            down = layout.ratio
            self.latent_hw = (int(z.shape[2]) // down, int(z.shape[3]) // down)
        else:
            self.latent_hw = (int(z.shape[-2]), int(z.shape[-1]))
        self.last_frame = layout.dims == 3 and not self.encode and int(z.shape[2]) == 1
        """A one-frame latent on the 3-D decoder: only the last decoded frame is the image (the host's rule)."""
        self.out: torch.Tensor | None = None
        self.stat_device = compute_device if compute_device.type not in ("mps",) else torch.device("cpu")

        self.last_use = self.layout.last_use
        self.stores: dict[str, _Bands] = {}
        self.acc: dict[str, _StatAcc] = {}
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.affine_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.mid_name = "mid"
        self.mid_done = 0
        """Items done in the whole part (decode: the mid block; encode: the tail)."""
        self.mid_finished = False
        if self.encode:
            c, h, w = (int(v) for v in z.shape[1:])
            self.stores["x"] = _Bands(self, c, h, w, [(0, h)], compute_device, True, base=z)
        self.seg_index = 0
        self.pending: collections.deque[Rect] | None = None
        self.step = 0
        self.done_units = 0
        self._in_tile = False
        self.shrinks = 0

    # -- shapes ------------------------------------------------------------------------------
    def _shape(self, name: str) -> tuple[int, int, int]:
        t = self.stores.get(name)
        if t is not None:
            return t.c, t.h, t.w
        raise KeyError(name)

    def _out_hw(self, seg: _Seg) -> tuple[int, int]:
        _, h, w = self._shape(seg.info.inputs[0])
        return h * seg.info.scale // seg.info.stride, w * seg.info.scale // seg.info.stride

    def _remaining_units(self) -> int:
        units = (0 if self.mid_finished else 1) if self.layout.video else self.batch - self.mid_done
        if self.pending is not None:
            units += len(self.pending)
        start = self.seg_index + (1 if self.pending is not None else 0)
        for s in self.segs[start:]:
            per = 1 if s.info.whole_batch else self.batch
            units += per * tile_count(*self.layout.segment_hw(s.info, self.latent_hw), self.tile)
        return units

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done_units, self.done_units + self._remaining_units())

    def _check_stop(self) -> None:
        self.driver.check_stop()

    # -- store ---------------------------------------------------------------------------------
    def _alloc(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if self.pin and device.type == "cpu":
            try:
                return torch.empty(shape, dtype=self.dtype, device=device, pin_memory=True)
            except RuntimeError as e:  # pinning can fail (limits); plain host memory still works
                log.warning("pinned host store of %s failed (%s); using pageable memory", shape, e)
                self.pin = False
        return torch.empty(shape, dtype=self.dtype, device=device)

    def _load(self, name: str, b: int, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        return self.stores[name].read(b, y0, y1, x0, x1, self.compute)

    def _write(self, name: str, r: Rect, core: torch.Tensor) -> None:
        self.stores[name].write(r, core)

    def _sync(self) -> None:
        if self.compute.type == "cuda" and self.store_device.type != "cuda":
            torch.cuda.synchronize(self.compute)

    # -- group norm ------------------------------------------------------------------------------
    def _stat_item(self, name: str, b: int) -> int:
        """The statistics row of item ``b`` for the GroupNorm consuming ``name`` (0 for all items when its
        statistics span the batch: SVD's ``time_stack`` norms)."""
        return 0 if self.consumer_path.get(name) in self.layout.batch_norms else b

    def _gn(self, name: str, b: int, x: torch.Tensor) -> torch.Tensor:
        b = self._stat_item(name, b)
        key = (name, b)
        cached = self.affine_cache.get(key)
        if cached is None:
            norm = self.consumer[name]
            mean, rstd = self.stats[name]  # float64 on the statistics device
            c = int(x.shape[1])
            g = mean.shape[1]
            mean_c = mean[b].repeat_interleave(c // g)
            rstd_c = rstd[b].repeat_interleave(c // g)
            w, bias = self.norm_params(norm, x)
            scale = rstd_c if w is None else rstd_c * w.to(mean.device, torch.float64)
            shift = -mean_c * scale
            if bias is not None:
                shift = shift + bias.to(mean.device, torch.float64)
            # Cast before moving: MPS has no float64.
            work = torch.float64 if x.dtype == torch.float64 else torch.float32
            ones = (1,) * (x.ndim - 2)
            scale = scale.to(work).to(x.device).view(1, c, *ones)
            shift = shift.to(work).to(x.device).view(1, c, *ones)
            cached = (scale, shift)
            self.affine_cache[key] = cached
        scale, shift = cached
        if x.dtype == scale.dtype:
            return torch.addcmul(shift, x, scale)
        # Half precision: normalise in float32 (as GroupNorm kernels do internally), store in x's dtype.
        y = x.to(scale.dtype)
        y.mul_(scale).add_(shift)
        return y.to(x.dtype)

    # -- mid -------------------------------------------------------------------------------------
    def _run_mid_item(self, b: int) -> torch.Tensor:
        z = self._decoder_input(self.z[b : b + 1].to(self.compute))
        mid = self.dec.mid
        h = self.dec.conv_in(z)
        if self.layout.in_repeats:
            h = h + z.repeat_interleave(self.layout.in_repeats, 1)
        del z
        h = mid.block_1(h)
        h = mid.attn_1(h)
        h = mid.block_2(h)
        return h

    def _decoder_input(self, z: torch.Tensor) -> torch.Tensor:
        """What the decoder receives from ``model.decode``: FLUX.2's latent batch-norm and pixel shuffle, then
        ``post_quant_conv``, where the model has them."""
        bn = getattr(self.model, "bn", None)
        if bn is not None:
            s = torch.sqrt(bn.running_var.to(z).view(1, -1, 1, 1) + bn.eps)
            m = bn.running_mean.to(z).view(1, -1, 1, 1)
            z = F.pixel_shuffle(z * s + m, 2)
        pqc = getattr(self.model, "post_quant_conv", None)
        if pqc is not None and self.dec is not self.model:
            z = pqc(z)
        return z

    def _mid_phase(self) -> None:
        if self.mid_finished:
            return
        if self.layout.video:
            self._mid_video()
            return
        while self.mid_done < self.batch:
            self._check_stop()
            b = self.mid_done
            h = self._run_mid_item(b)
            c, *lead, mh, mw = (int(v) for v in h.shape[1:])
            if self.mid_name not in self.stores:
                self.stores[self.mid_name] = _Bands(self, c, mh, mw, [(0, mh)], self.store_device, not self.segs,
                                                    lead=tuple(lead))
                self.acc[self.mid_name] = _StatAcc(self.batch, self.consumer[self.mid_name], self.stat_device)
            acc = self.acc[self.mid_name]
            stats = acc.tile_stats(h)
            store = self.stores[self.mid_name]
            store.ensure(b, 0, mh)
            store.write(Rect(b, 0, mh, 0, mw), h)
            del h
            acc.record(b, stats)
            self.mid_done += 1
            self.done_units += 1
            self._report()
        self._sync()
        self.stats[self.mid_name] = self.acc.pop(self.mid_name).finalize()
        self.mid_finished = True

    def _mid_video(self) -> None:
        """A decoder that mixes its batch as one video (SVD): ``conv_in`` and the mid block once on every item
        together, as the host calls them (its resnet blocks take ``temb``; their time mixing spans the batch)."""
        self._check_stop()
        mid = self.dec.mid
        h = self.dec.conv_in(self._decoder_input(self.z.to(self.compute)))
        h = mid.block_1(h, None)
        h = mid.attn_1(h)
        h = mid.block_2(h, None)
        c, mh, mw = (int(v) for v in h.shape[1:])
        store = self.stores[self.mid_name] = _Bands(self, c, mh, mw, [(0, mh)], self.store_device, not self.segs)
        acc = _StatAcc(self.batch, self.consumer[self.mid_name], self.stat_device)
        for b in range(self.batch):
            store.ensure(b, 0, mh)
            store.write(Rect(b, 0, mh, 0, mw), h[b : b + 1])
            acc.record(self._stat_item(self.mid_name, b), acc.tile_stats(h[b : b + 1]))
        del h
        self.mid_done = self.batch
        self.done_units += 1
        self._report()
        self._sync()
        self.stats[self.mid_name] = acc.finalize()
        self.mid_finished = True

    def _tail_phase(self) -> None:
        """Encode: per item, the down path's output (one latent-resolution map) through the mid block and the
        output convolution, then the host's own rest of ``encode`` (:func:`_encode_tail`)."""
        if self.mid_finished:
            return
        last = self.segs[-1].info.output
        store = self.stores[last]
        while self.mid_done < self.batch:
            self._check_stop()
            b = self.mid_done
            z = _encode_tail(self.model, self.dec, store.read(b, 0, store.h, 0, store.w, self.compute))
            if self.out is None:
                self.out = torch.empty((self.batch, *z.shape[1:]), dtype=z.dtype, device=self.out_device)
            self.out[b : b + 1].copy_(z)
            del z
            self.mid_done += 1
            self.done_units += 1
            self._report()
        self.stores.pop(last, None)
        self.mid_finished = True

    # -- segments --------------------------------------------------------------------------------
    def _lead_out(self, info: SegmentInfo) -> tuple[int, ...]:
        """Frames of a segment's output (3-D decoder), as ``_Bands.lead``."""
        lead = self.stores[info.inputs[0]].lead
        if not lead:
            return ()
        if info.kind == "out" and self.last_frame:
            return (1,)
        return (lead[0] * info.tscale,)

    def _start_segment(self, seg: _Seg) -> None:
        info = seg.info
        h, w = self._out_hw(seg)
        k = self.segs.index(seg)
        rows = band_rows(h, self.tile[0])
        lead = self._lead_out(info)
        if info.inplace_of is not None:
            self.stores[info.output] = self.stores[info.inplace_of]
        elif info.store_output and info.output not in self.stores:
            dev = self.out_device if info.output == "image" else self.store_device
            self.stores[info.output] = _Bands(self, info.out_channels, h, w, rows, dev,
                                              whole_output(info, k, len(self.segs)), lead=lead)
        if info.shortcut_output is not None and info.shortcut_output not in self.stores:
            self.stores[info.shortcut_output] = _Bands(self, info.out_channels, h, w, rows, self.store_device, False,
                                                       lead=lead)
        norm = self.consumer.get(info.output)
        if norm is not None and info.output not in self.acc:
            self.acc[info.output] = _StatAcc(self.batch, norm, self.stat_device)
        items = range(1) if info.whole_batch else range(self.batch)  # whole-batch tiles: b 0 stands for all
        self.pending = collections.deque(r for b in items for r in grid(b, h, w, self.tile))

    def _finish_segment(self, k: int, seg: _Seg) -> None:
        info = seg.info
        self._sync()
        if info.output in self.acc:
            self.stats[info.output] = self.acc.pop(info.output).finalize()
        for name in info.inputs:
            if self.last_use.get(name) == k:
                self.stores.pop(name, None)
                self.stats.pop(name, None)
                for key in [key for key in self.affine_cache if key[0] == name]:
                    del self.affine_cache[key]
        self.pending = None
        self.seg_index = k + 1

    def _segments_phase(self) -> None:
        while self.seg_index < len(self.segs):
            k = self.seg_index
            seg = self.segs[k]
            if self.pending is None:
                self._start_segment(seg)
            assert self.pending is not None
            info = seg.info
            dying = dying_inputs(info, k, self.last_use)
            while self.pending:
                r = self.pending[0]
                items = range(self.batch) if info.whole_batch else (r.b,)
                # The output bands this tile writes are allocated before the unit starts (an OOM here is
                # a store allocation, not a tile OOM: it propagates).
                for b in items:
                    if info.store_output:
                        self.stores[info.output].ensure(b, r.y0, r.y1)
                    if info.shortcut_output is not None:
                        self.stores[info.shortcut_output].ensure(b, r.y0, r.y1)
                self._check_stop()
                acc = self.acc.get(info.output)
                if self.memo is None:
                    stats = self._unit(seg, r, items, acc)
                else:  # a sizing run: a repeated kind of tile is counted, not run
                    stats = self.memo.unit(self.memo.key(self, seg, r), self._unit, seg, r, items, acc)
                if acc is not None and stats is not None:
                    for b, st in zip(items, stats, strict=True):
                        acc.record(self._stat_item(info.output, b), st)
                self.pending.popleft()
                if dying:
                    self._release(info, dying, r)
                self.done_units += 1
                self._report()
            self._finish_segment(k, seg)

    def _unit(self, seg: _Seg, r: Rect, items: Any, acc: _StatAcc | None
              ) -> list[tuple[float, torch.Tensor, torch.Tensor]] | None:
        """One tile: its core, its statistics and its writes to the store; returns the statistics."""
        info = seg.info
        self._in_tile = True  # an OOM from here to the write is a tile OOM: shrink and resume
        core, extra = self._run_tile(seg, r)
        parts = [core[i : i + 1] for i in range(len(items))] if info.whole_batch else [core]
        stats = [acc.tile_stats(t) for t in parts] if acc is not None else None
        # Nothing below allocates: once the core is written (possibly over its own input, for
        # an in-place residual), the tile is recorded as done.
        for i, b in enumerate(items):
            rb = dataclasses.replace(r, b=b)
            if info.store_output:
                self._write(info.output, rb, parts[i])
            if extra is not None:
                self._write(info.shortcut_output, rb, extra)  # type: ignore[arg-type]
        del core, extra, parts  # nothing else holds the tile's core: freed before the next tile
        self._in_tile = False
        return stats

    def _release(self, info: SegmentInfo, dying: tuple[str, ...], done: Rect) -> None:
        """After a tile: when the next pending tile starts another row (or item), release the bands of the
        dying inputs that no pending tile of this item reads any more."""
        assert self.pending is not None
        nxt = self.pending[0] if self.pending else None
        if nxt is not None and nxt.b == done.b and nxt.y0 == done.y0:
            return
        for b in range(self.batch) if info.whole_batch else (done.b,):
            for name in dying:
                store = self.stores[name]
                low = min((read_span(info, name, p.y0, p.y1, store.h)[0] for p in self.pending
                           if info.whole_batch or p.b == b), default=1 << 62)
                store.release_below(b, low)

    def _region(self, name: str, r: Rect, halo: int) -> tuple[int, int, int, int]:
        _, h, w = self._shape(name)
        return max(0, r.y0 - halo), min(h, r.y1 + halo), max(0, r.x0 - halo), min(w, r.x1 + halo)

    def _read_region(self, info: SegmentInfo, name: str, r: Rect) -> tuple[int, int, int, int]:
        """What a tile of ``info`` with core ``r`` reads of input ``name`` (:func:`.kl_layout.read_span`)."""
        _, h, w = self._shape(name)
        return (*read_span(info, name, r.y0, r.y1, h), *read_span(info, name, r.x0, r.x1, w))

    @staticmethod
    def _crop(t: torch.Tensor, oy: int, ox: int, r: Rect) -> torch.Tensor:
        return t[..., r.y0 - oy : r.y1 - oy, r.x0 - ox : r.x1 - ox]

    def _run_tile(self, seg: _Seg, r: Rect) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = self.step
        self.step += 1
        info = seg.info
        kind = info.kind
        act = F.silu
        if kind == "conv1":
            blk = seg.module
            (xn,) = info.inputs
            y0, y1, x0, x1 = self._read_region(info, xn, r)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = self._crop(blk.conv1(t), y0, x0, r)
            # shortcut(x) at the core, computed as the block's conv2 tile would (same load, same module),
            # after conv1 so it does not add to the normalisation and convolution phases.
            extra = self._shortcut_core(blk, xn, r) if info.shortcut_output is not None else None
            return t, extra
        if kind == "conv2":
            blk = seg.module
            hn, xn = info.inputs
            y0, y1, x0, x1 = self._read_region(info, hn, r)
            t = self._load(hn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(hn, r.b, t), inplace=True)
            t = blk.dropout(t) if getattr(blk, "dropout", None) is not None else t
            t = self._crop(blk.conv2(t), y0, x0, r)
            # The residual is written over in place: x (identity shortcut) or shortcut(x) from conv1.
            return t + self._load(xn, r.b, r.y0, r.y1, r.x0, r.x1), None
        if kind == "conv12":
            blk = seg.module
            (xn,) = info.inputs
            h_name = self._h_of(seg)
            y0, y1, x0, x1 = self._read_region(info, xn, r)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = blk.conv1(t)
            t = act(self._gn(h_name, r.b, t), inplace=True)
            t = blk.dropout(t) if getattr(blk, "dropout", None) is not None else t
            t = self._crop(blk.conv2(t), y0, x0, r)
            return t + self._shortcut_core(blk, xn, r), None
        if kind == "in":  # the encoder's conv_in, on the pixels (no norm before it)
            (xn,) = info.inputs
            y0, y1, x0, x1 = self._read_region(info, xn, r)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            return self._crop(self.dec.conv_in(t), y0, x0, r), None
        if kind == "downsample":  # its own forward: the zero row/column past the map's end, as the host pads
            (xn,) = info.inputs
            ly0, ly1, lx0, lx1 = self._read_region(info, xn, r)
            t = self._load(xn, r.b, ly0, ly1, lx0, lx1)
            self._hook(step)
            t = seg.module(t)
            return (self._crop(t, ly0 // 2, lx0 // 2, r) if info.halo else t), None
        if kind == "upsample":
            (xn,) = info.inputs
            ly0, ly1, lx0, lx1 = self._read_region(info, xn, r)
            t = self._load(xn, r.b, ly0, ly1, lx0, lx1)
            self._hook(step)
            t = seg.module(t)
            return self._crop(t, 2 * ly0, 2 * lx0, r), None
        if kind in ("tmix1", "tmix2"):  # SVD's time_stack over every item's (frame's) core, no spatial halo
            ts = seg.module.time_stack
            layers = ts.in_layers if kind == "tmix1" else ts.out_layers
            xn = info.inputs[0]
            t = self._load_all(xn, r)
            self._hook(step)
            t = act(self._gn(xn, 0, t), inplace=True)  # statistics over all frames: one row
            if kind == "tmix2":
                t = layers[2](t)  # dropout
            t = layers[-1](t.movedim(0, 1).unsqueeze(0)).squeeze(0).movedim(1, 0)  # (T, C, h, w) <-> (1, C, T, h, w)
            if kind == "tmix1":
                return t, None
            x = self._load_all(info.inputs[1], r)
            alpha = seg.module.get_alpha(bs=1).to(x.device)
            # VideoResBlock.forward: x = time_stack(x) = skip(x) + h; alpha * x + (1 - alpha) * x_mix
            return alpha * (ts.skip_connection(x) + t) + (1.0 - alpha) * x, None
        if kind == "out":
            dec = seg.module
            (xn,) = info.inputs
            y0, y1, x0, x1 = self._read_region(info, xn, r)
            if info.whole_batch:  # SVD: conv_out mixes the frames (AE3DConv): every item's region at once
                t = torch.cat([self._load(xn, b, y0, y1, x0, x1) for b in range(self.batch)])
                self._hook(step)
                t = torch.cat([self._gn(xn, b, t[b : b + 1]) for b in range(self.batch)])
                t = self._crop(dec.conv_out(act(t, inplace=True)), y0, x0, r)
                return (torch.tanh(t) if getattr(dec, "tanh_out", False) else t), None
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = self._crop(dec.conv_out(t), y0, x0, r)
            if self.last_frame:
                t = t[:, :, -1:]
            if getattr(dec, "tanh_out", False):
                t = torch.tanh(t)
            return t, None
        raise AssertionError(kind)

    def _load_all(self, name: str, r: Rect) -> torch.Tensor:
        """Core ``r`` of ``name`` for every batch item, stacked (the frames of a video decoder's batch)."""
        return torch.cat([self._load(name, b, r.y0, r.y1, r.x0, r.x1) for b in range(self.batch)])

    def _h_of(self, seg: _Seg) -> str:
        """Name of the stats-only ``h`` activation of a ``conv12`` segment (written by its conv1)."""
        k = self.segs.index(seg)
        return self.segs[k - 1].info.output

    def _shortcut_core(self, blk: Any, xn: str, r: Rect) -> torch.Tensor:
        sc, halo = block_shortcut(blk)
        y0, y1, x0, x1 = self._region(xn, r, halo)
        x = self._load(xn, r.b, y0, y1, x0, x1)
        if sc is None:
            return x
        return self._crop(sc(x), y0, x0, r)

    def _hook(self, step: int) -> None:
        if self.fault_hook is not None:
            self.fault_hook(step)

    # -- driver ----------------------------------------------------------------------------------
    def _shrink(self) -> bool:
        th, tw = self.tile
        nth, ntw = max(self.min_tile, th // 2), max(self.min_tile, tw // 2)
        if (nth, ntw) == (th, tw):
            return False
        self.tile = (nth, ntw)
        self.shrinks += 1
        if self.pending is not None:
            new: collections.deque[Rect] = collections.deque()
            for r in self.pending:
                new.extend(grid(r.b, r.h, r.w, self.tile, r.y0, r.x0))
            self.pending = new
        return True

    def _can_shrink(self) -> bool:
        """Only an OOM inside a tile is helped by smaller tiles (not one in the whole-latent mid block
        or while allocating a full-size store: those propagate to the caller, who can re-plan, e.g.
        with the store in host memory)."""
        th, tw = self.tile
        return self._in_tile and max(th, tw) > self.min_tile

    def _attempt(self) -> None:
        if self.encode:
            self._segments_phase()
            self._tail_phase()
        else:
            self._mid_phase()
            self._segments_phase()

    def _resume(self, event: OomEvent) -> None:
        old = self.tile
        self._shrink()
        self._in_tile = False
        log.warning(
            "exact tiled %s: out of memory (%s) at tile %s in %s; resuming with tile %s",
            self.layout.direction,
            event.type_name,
            old,
            self.segs[self.seg_index].info.name if self.seg_index < len(self.segs) else "?",
            self.tile,
        )
        self._report()

    def run(self) -> torch.Tensor:
        self._report()
        self.driver.run(self._attempt, can_recover=lambda e: self._can_shrink(), recover=self._resume)
        self._sync()
        if self.encode:
            assert self.out is not None
            return self.out
        last = self.segs[-1].info.output if self.segs else self.mid_name
        return self.stores.pop(last).tensor()


class _Tail(torch.nn.Module):
    """Stands in for ``model.encoder`` while the host's own ``encode`` runs on the down path's output: the
    encoder's mid block, ``norm_out`` and ``conv_out`` (as ``Encoder.forward`` ends), after which the host's
    ``encode`` does what it does after its encoder (``quant_conv``, the regularizer, FLUX.2's latent
    batch-norm). Hunyuan Image 2.1's: its own ``Encoder.forward`` with ``conv_in`` and ``down`` swapped out (its
    end adds a channel-mean shortcut of the mid block's output)."""

    def __init__(self, enc: Any) -> None:
        super().__init__()
        self.__dict__["enc"] = enc  # not a registered child: the host's module tree is left as it is

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        enc = self.enc
        if hunyuan_image(enc):  # the walk checked its structure
            with swapped((enc, "conv_in", torch.nn.Identity()), (enc, "down", torch.nn.ModuleList())):
                return enc(h)
        h = enc.mid.block_1(h, None)
        h = enc.mid.attn_1(h)
        h = enc.mid.block_2(h, None)
        return enc.conv_out(F.silu(enc.norm_out(h)))


def _encode_tail(model: Any, enc: Any, h: torch.Tensor) -> torch.Tensor:
    """``model.encode`` of one item whose encoder ran up to its mid block (``h``): the host's own code after
    the encoder, with :class:`_Tail` in the encoder's place for the call."""
    model.encoder = _Tail(enc)
    try:
        return model.encode(h)
    finally:
        model.encoder = enc


def run_exact(
    bound: BoundLayout,
    x: torch.Tensor,
    tile: int | tuple[int, int] | None,
    *,
    store_device: torch.device | str | None = None,
    compute_device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = MIN_TILE,
    pin_memory: bool | None = None,
    norm_params: NormParamsFn | None = None,
    size_only: bool | Callable[[], None] = False,
) -> torch.Tensor:
    """:func:`decode_exact` / :func:`encode_exact` through a layout bound to its model
    (:meth:`..vae.kl_layout.KlLayout.bind`, walked once by the caller: its direction and ``recompute`` variant are
    the run's); the other keywords are theirs."""
    layout = bound.layout
    direction, recompute = layout.direction, layout.recompute
    what = "latent" if direction == "decode" else "image"
    squeeze = False
    if layout.dims == 3 and x.ndim == 4:  # images of a 3-D decoder: one-frame latents, as VAE Encode makes them
        x, squeeze = x.unsqueeze(2), True
    elif x.ndim != layout.dims + 2:
        shape = "(B, C, h, w)" if layout.dims == 2 else "(B, C, h, w) or (B, C, T, h, w)"
        raise ValueError(f"expected a {shape} {what}, got shape {tuple(x.shape)}")
    if direction == "encode":
        down = layout.ratio
        if x.shape[2] % down or x.shape[3] % down:
            raise ValueError(f"exact tiled encode: the image's sides {tuple(x.shape[2:])} must be multiples "
                             f"of {down} (VAE Encode crops them so)")
    compute = torch.device(compute_device) if compute_device is not None else x.device
    store = torch.device(store_device) if store_device is not None else compute
    out = torch.device(out_device) if out_device is not None else store
    run = _ExactRun(bound, x, pair(tile), store, compute, out, recompute, progress,
                    should_stop, fault_hook, oom_types(oom_exceptions), on_oom, min_tile, pin_memory,
                    norm_params, TileMemo(size_only if callable(size_only) else None) if size_only else None)
    with torch.no_grad():
        result = run.run()
    if run.shrinks:
        log.info("exact tiled %s finished with tile %s after %d OOM shrink(s)", direction, run.tile,
                 run.shrinks)
    return result.squeeze(2) if squeeze else result


def decode_exact(model: Any, z: torch.Tensor, tile: int | tuple[int, int] | None, *, recompute: bool = False,
                 **kw: Any) -> torch.Tensor:
    """Decode ``z`` exactly, tile by tile; returns what ``model.decode(z)`` returns (range [-1, 1]).

    ``model``: a ``first_stage_model`` (``post_quant_conv`` and Flux-2 latent batch-norm are applied
    when present) or a bare ``Decoder`` (``z`` is then the decoder's input). ``z``: (B, C, h, w) in the
    dtype the decoder runs in, on the compute device (or anywhere; each item is moved there).
    ``tile``: core size (px) per tile at each activation's own resolution (fewer tiles at lower levels);
    None decodes each activation in one tile. ``store_device``: where the full activations live
    (default: the compute device); a host store is pinned when computing on CUDA unless
    ``pin_memory=False``. ``out_device``: where the image is assembled (default: ``store_device``).
    ``recompute``: do not store ``conv1`` outputs; recompute them in the second half of each resnet
    block (2 stored activations instead of 3, ~1.5x the resnet conv work). ``progress(done, total)``
    after each unit (``total`` may grow after an OOM shrink). ``should_stop()`` before each unit; its
    exception propagates. ``fault_hook(k)`` inside tile step ``k`` (0-based, counting every tile
    attempt; tests raise an OOM there). ``oom_exceptions``: what counts as out-of-memory (through
    :func:`oom_types`: default ``torch.OutOfMemoryError``; a bare ``Exception`` is dropped). ``on_oom()``
    after an OOM, before resuming with half the tile.
    ``norm_params(norm, x) -> (weight, bias)``: GroupNorm affine parameters as float32 on ``x``'s
    device (default: the module's ``weight``/``bias``; pass ComfyUI's casting for patched weights).
    ``size_only``: the walk runs in a :class:`..measure.sizing.MetaSizer` to be sized, nothing else: each kind of
    tile runs once, its repeats are counted from it (:mod:`.kl_memo`; the same peak, a fraction of the ops); a
    callable is called after every tile (it may raise to end the sizing: a planner's peak over its budget).
    """
    return run_exact(kl_layout(model, recompute).require().bind(model), z, tile, **kw)


def decode_exact_into(out: torch.Tensor, walker: BoundLayout, z: torch.Tensor, config: Any,
                      process: Callable[[torch.Tensor], torch.Tensor], *, compute_device: torch.device,
                      **kw: Any) -> None:
    """One pass of an image decode: the items ``z`` through ``walker`` (the job's bound layout of the plan's
    ``recompute`` variant) with the plan's ``config`` (its ``tile`` and ``store_on_device``), ``process``ed (the host's
    output processing) into ``out``, their rows of the output (N, H, W, C). The other keywords as
    :func:`decode_exact`'s."""
    store = compute_device if config.store_on_device else torch.device("cpu")
    img = run_exact(walker, z, config.tile, store_device=store, compute_device=compute_device, **kw)
    out.copy_(process(img.float()).movedim(1, -1))


def encode_exact(model: Any, x: torch.Tensor, tile: int | tuple[int, int] | None, *, recompute: bool = False,
                 **kw: Any) -> torch.Tensor:
    """Encode ``x`` exactly, tile by tile; returns what ``model.encode(x)`` returns (the host's regularizer:
    the posterior mean for ComfyUI's KL VAEs). ``model``: a ``first_stage_model`` with an SD/FLUX ``Encoder``;
    ``x``: (B, 3, H, W) processed pixels (``vae.process_input``, on [-1, 1]) in the dtype the encoder runs in,
    sides multiples of the VAE's downscale ratio. ``conv_in`` and the down path run in segments and tiles
    (``tile``: core px at each activation's own resolution) with shared GroupNorm statistics; the mid block,
    the output convolution and the host's own rest of ``encode`` run once per item on the latent-resolution
    map. The other keywords as :func:`decode_exact`; an OOM in the tail propagates (the caller re-plans)."""
    return run_exact(kl_layout(model, recompute, "encode").require().bind(model), x, tile, **kw)
