"""Exact tiled decode of SeedVR2's video VAE (:mod:`..vae.seedvr2_layout`): the host's time slices, each decoded
layer-synchronously in spatial tiles.

Per batch item and per host time slice (``slicing_decode``'s, with its ``MemoryState``):

* the prefix (``conv_in`` and the mid block, its per-frame attention included) runs once on the whole latent slice
  through the host's own modules, its causal convolutions' ``memory_cache`` carried from slice to slice as the
  host carries it;
* the up path runs segment by segment (cut at every GroupNorm), tile by tile: each tile reads its input with a 1-px
  halo (at that activation's resolution) from the whole-frame activation kept in the store, normalises it with the
  per-frame statistics merged from the previous segment's tile cores (the KL walker's statistics,
  :class:`.kl_exact._StatAcc`, one "item" per frame), and runs the host's causal convolution on it with the tile's
  region of that convolution's carried last input frames (the carried-context idea of :mod:`.carry`); the
  convolution's new last frames (what the host would keep in its ``memory_cache``) are written back, core by core,
  into a whole-frame carry for the next slice;
* from the last temporal upsampler on (:attr:`..vae.seedvr2_layout.SeedVR2Layout.tail`: per-frame norms, causal
  convolutions) the segments run a frame at a time, the upsampler input frame by input frame and the rest output frame
  by output frame, the causal frames carried between them as between slices (a slice decoded alone starts its carry
  there): the rewritten host decoder's frame-chunked tail, so only one frame's full-resolution activations wait;
* the output convolution's tile cores go straight into the output.

Every operation is the host's (its convolution modules with their own padding and caching code, its upsamplers,
its activation), except the GroupNorm, applied with shared statistics; the host's wrapper runs its own ``decode``
around the walk (``latent / scale + shift``, 0.33.0's crop to even sides: the walk replaces ``slicing_decode`` for
the call). Both variants of the description (0.33.0's module calls, the rewritten file's blocks' ``run`` and its
``CausalMemoryCache`` for the prefix) run the same walk. Equal to the host's ``decode`` with its tiling off up to
float rounding, proven per structure by the first-use self-check (``decode/seedvr2.check_seedvr2``). Progress per tile, Cancel before every tile, an
out-of-memory error in a tile: release, halve the tile and go on (finished tiles kept). Nothing here imports
ComfyUI."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..oom import OomEvent, oom_types
from ..run_context import NormParamsFn, ProgressFn
from ..tiles import Rect, grid, tile_count
from ..vae.seedvr2_layout import SeedVR2Layout, Segment, seedvr2_layout
from .blend import stop_driver
from .kl_exact import _default_norm_params, _StatAcc

log = logging.getLogger("vramfit.memory.executors.seedvr2")

__all__ = ["EXECUTOR_VERSION", "MIN_TILE", "decode_seedvr2", "seg_sizes", "units"]

EXECUTOR_VERSION = "2"
MIN_TILE = 8
"""Smallest tile side (px) an out-of-memory error shrinks to."""



def seg_sizes(lay: SeedVR2Layout, h: int, w: int) -> list[tuple[int, int]]:
    """Output size of every segment for a latent of ``h x w``."""
    out = []
    for s in lay.segments:
        h, w = h * s.scale, w * s.scale
        out.append((h, w))
    return out


def _reads(seg: Segment, src: torch.Tensor, r: Rect) -> tuple[int, int, int, int]:
    """``(y0, y1, x0, x1)``: the rows and columns of ``src`` (the segment's input) tile ``r`` of its output reads
    (its 1-px halo at the output's resolution, clipped at the frame)."""
    hin, win, s = int(src.shape[3]), int(src.shape[4]), seg.scale
    return (max(0, (r.y0 - 1) // s), min(hin, -(-(r.y1 + 1) // s)),
            max(0, (r.x0 - 1) // s), min(win, -(-(r.x1 + 1) // s)))


def _shape(seg: Segment, src: torch.Tensor, r: Rect) -> tuple[int, int, int, int]:
    """What a tile's work depends on: its core and the region of ``src`` it reads."""
    y0, y1, x0, x1 = _reads(seg, src, r)
    return r.h, r.w, y1 - y0, x1 - x0


def _layout(v: torch.Tensor) -> tuple:
    """What :func:`_like` needs to make a tensor holding the memory ``v`` holds (a view keeps its whole storage)."""
    return v.untyped_storage().nbytes(), tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device


def _like(nbytes: int, shape: tuple, stride: tuple, offset: int, dtype: torch.dtype, device: torch.device
          ) -> torch.Tensor:
    """A tensor of ``shape`` viewing a new storage of ``nbytes`` (sizing: a skipped tile's output, as large)."""
    base = torch.empty(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


def units(lay: SeedVR2Layout, t: int, h: int, w: int, tile: tuple[int, int] | None) -> int:
    """Progress units of one batch item: per slice, the prefix and every segment's tiles (the tail's per frame)."""
    n = [1 if tile is None else tile_count(sh, sw, tile) for sh, sw in seg_sizes(lay, h, w)]
    total = 0
    for s0, s1, name in lay.slices(t):
        first = name != "ACTIVE"
        total += 1 + sum(n[: lay.tail])
        if lay.tail < len(n):
            for f in range(lay.tail_in(s1 - s0, first)):
                total += n[lay.tail] + (1 if first and f == 0 else 2) * sum(n[lay.tail + 1 :])
    return total


class _Run:
    def __init__(self, model: Any, lay: SeedVR2Layout, tile: tuple[int, int] | None, dev: torch.device,
                 store: torch.device, dtype: torch.dtype, norm_params: NormParamsFn | None, driver: Any,
                 progress: ProgressFn | None, total: int, fault_hook: Callable[[int], None] | None,
                 min_tile: int, sizing: bool = False) -> None:
        self.model, self.lay, self.tile = model, lay, tile
        self.sizing = sizing
        self.dev, self.store, self.dtype = dev, store, dtype
        self.norm_params = norm_params or _default_norm_params
        self.driver = driver
        self.progress, self.total, self.done = progress, total, 0
        self.fault_hook = fault_hook
        self.min_tile = min_tile
        self.steps = self.restarts = self.shrinks = 0
        self.stat_device = dev if dev.type != "mps" else torch.device("cpu")

    # -- statistics ------------------------------------------------------------------------------
    def _stats(self, norm: Any, frames: int) -> _StatAcc:
        return _StatAcc(frames, norm, self.stat_device)

    @staticmethod
    def _record(acc: _StatAcc, core: torch.Tensor) -> None:
        parts = [acc.tile_stats(core[:, :, f]) for f in range(int(core.shape[2]))]
        for f, p in enumerate(parts):  # appended only once every frame's statistics exist
            acc.record(f, p)

    def _norm(self, norm: Any, stats: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """GroupNorm of ``x`` (1, C, T, h, w) with per-frame statistics ``(mean, rstd)`` (T, G) float64."""
        mean, rstd = stats
        c, g = int(x.shape[1]), int(mean.shape[1])
        w, bias = self.norm_params(norm, x)
        mean_c = mean.repeat_interleave(c // g, dim=1)
        scale = rstd.repeat_interleave(c // g, dim=1)
        if w is not None:
            scale = scale * w.to(mean.device, torch.float64)
        shift = -mean_c * scale
        if bias is not None:
            shift = shift + bias.to(mean.device, torch.float64)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        t = int(x.shape[2])
        scale = scale.to(work).to(x.device).t().reshape(1, c, t, 1, 1)
        shift = shift.to(work).to(x.device).t().reshape(1, c, t, 1, 1)
        if x.dtype == work:
            return torch.addcmul(shift, x, scale)
        y = x.to(work)
        y.mul_(scale).add_(shift)
        return y.to(x.dtype)

    # -- one tile ----------------------------------------------------------------------------------
    def _tile(self, seg: Segment, state: Any, active: bool, src: torch.Tensor, x: torch.Tensor | None,
              stats: Any, mem: torch.Tensor | None, r: Rect) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One tile's core (1, C, T, r.h, r.w) and its region of the convolution's new carried frames (the core
        part, or None when nothing is carried)."""
        s = seg.scale
        y0, y1, x0, x1 = _reads(seg, src, r)
        t = src[:, :, :, y0:y1, x0:x1].to(self.dev, self.dtype)
        if self.fault_hook is not None:
            self.fault_hook(self.steps - 1)
        cache: dict = {}
        if active and mem is not None:
            cache[seg.conv] = mem[:, :, :, s * y0 : s * y1, s * x0 : s * x1].to(self.dev)
        m = seg.module
        if seg.kind == "up":
            t = self.lay.up(seg, t, state, cache)
        else:
            t = self._norm(seg.norm, stats, t)
            t = seg.act(t)
            t = seg.conv(t, memory_state=state, memory_cache=cache)
        oy, ox = r.y0 - s * y0, r.x0 - s * x0
        core = t[:, :, :, oy : oy + r.h, ox : ox + r.w]
        if seg.kind == "res2":
            xc = x[:, :, :, r.y0 : r.y1, r.x0 : r.x1].to(self.dev, self.dtype)
            if m.conv_shortcut is not None:
                xc = m.conv_shortcut(xc, memory_state=state, memory_cache={})
            core = xc + core if seg.residual_scale == 1.0 else (xc + core) / seg.residual_scale
        new = cache.get(seg.conv)
        if new is not None:
            new = new[:, :, :, oy : oy + r.h, ox : ox + r.w]
        return core, new

    def _step(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, max(self.total, self.done))

    def _shrink(self, pending: collections.deque) -> bool:
        if self.tile is None:
            return False
        th, tw = self.tile
        nt = (max(self.min_tile, th // 2), max(self.min_tile, tw // 2))
        if nt == self.tile:
            return False
        self.tile = nt
        self.shrinks += 1
        new: collections.deque = collections.deque()
        for r in pending:
            new.extend(grid(r.b, r.h, r.w, nt, r.y0, r.x0))
        self.total += len(new) - len(pending)
        pending.clear()
        pending.extend(new)
        return True

    # -- one segment over its tiles --------------------------------------------------------------
    def segment(self, seg: Segment, state: Any, active: bool, src: torch.Tensor, x: torch.Tensor | None,
                stats: Any, carry: dict, out: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        h, w = int(src.shape[3]) * seg.scale, int(src.shape[4]) * seg.scale
        tile = self.tile if self.tile is not None else (h, w)
        pending = collections.deque(grid(0, h, w, (min(tile[0], h), min(tile[1], w))))
        seen: dict = {}  # sizing: a tile's shape -> the layouts (:func:`_layout`) of the core and new frames it gave
        last = {_shape(seg, src, r): i for i, r in enumerate(pending)} if self.sizing else {}
        index = -1
        dst = None
        acc = None
        new_mem: torch.Tensor | None = None
        mem = carry.get(seg.conv)
        while pending:
            r = pending[0]
            holder: dict = {}

            def attempt(r: Rect = r, holder: dict = holder) -> None:
                self.driver.check_stop()
                self.steps += 1
                holder["v"] = self._tile(seg, state, active, src, x, stats, mem, r)

            def recover(event: OomEvent) -> None:
                self.restarts += 1
                old = self.tile
                self._shrink(pending)
                log.warning("SeedVR2 exact decode: out of memory in %s (%s); tile %s -> %s", seg.name,
                            event.message, old, self.tile)

            index += 1
            shape = _shape(seg, src, r)
            if self.sizing and shape in seen and index != last[shape]:  # a tile sized before: what outlives it
                holder["v"] = tuple(None if v is None else _like(*v) for v in seen[shape])
            else:
                self.driver.run(attempt, can_recover=lambda e: self._can_shrink(), recover=recover)
            if pending[0] != r:  # shrunk: the head is a smaller tile now
                continue
            core, new = holder.pop("v")
            if self.sizing:
                seen.setdefault(shape, tuple(None if v is None else _layout(v) for v in (core, new)))
            tf = int(core.shape[2])
            if seg.kind == "out":
                assert out is not None
                out[:, :, :tf, r.y0 : r.y1, r.x0 : r.x1].copy_(core)
            else:
                if dst is None:
                    dst = torch.empty((1, int(core.shape[1]), tf, h, w), dtype=self.dtype, device=self.store)
                    if seg.stats:
                        acc = self._stats(self.lay.segments[self._next_norm(seg)].norm, tf)
                parts = [acc.tile_stats(core[:, :, f]) for f in range(tf)] if acc is not None else None
                dst[:, :, :, r.y0 : r.y1, r.x0 : r.x1].copy_(core)
                if parts is not None:
                    for f, p in enumerate(parts):
                        acc.record(f, p)
            if new is not None:
                if new_mem is None:
                    new_mem = torch.empty((1, int(new.shape[1]), int(new.shape[2]), h, w), dtype=new.dtype,
                                          device=self.store)
                new_mem[:, :, :, r.y0 : r.y1, r.x0 : r.x1].copy_(new)
            del core, new
            pending.popleft()
            self._step()
        if new_mem is not None:
            carry[seg.conv] = new_mem
        elif not active:
            carry.pop(seg.conv, None)
        return dst, (acc.finalize() if acc is not None else None)

    def _can_shrink(self) -> bool:
        return self.tile is not None and max(self.tile) > self.min_tile

    def _next_norm(self, seg: Segment) -> int:
        k = self.lay.segments.index(seg)
        return next(i for i in range(k + 1, len(self.lay.segments)) if self.lay.segments[i].norm is not None)

    # -- one slice -------------------------------------------------------------------------------
    def slice(self, zs: torch.Tensor, state: Any, active: bool, prefix_cache: Any, carry: dict,
              out: torch.Tensor) -> int:
        """Decode one time slice ``zs`` (1, C, t, h, w) into ``out`` (from its first frame on); returns the frames
        written."""
        dec = self.model.decoder
        self.driver.check_stop()
        z = zs.to(self.dev, self.dtype)
        h = dec.conv_in(z, memory_state=state, memory_cache=prefix_cache)
        h = self.lay.mid(dec, h, state, prefix_cache)
        up_dtype = next(iter(dec.up_blocks.parameters())).dtype
        h = h.to(up_dtype)
        del z
        acc = self._stats(self.lay.first_norm, int(h.shape[2]))
        self._record(acc, h)
        main = h.to(self.store)
        del h
        stats = acc.finalize()
        self._step()
        lay = self.lay
        main, stats, written = self._run(lay.segments[: lay.tail], main, stats, state, active, carry, out)
        if lay.tail == len(lay.segments):
            return written
        # the tail a frame at a time, the first frame in the slice's state (a slice decoded alone starts its carry
        # here, as the host's frame-chunked tail does), every later one carried
        up, rest = lay.segments[lay.tail], lay.segments[lay.tail + 1 :]
        first = lay.state("INITIALIZING") if state == lay.state("DISABLED") else state
        active_state = lay.state("ACTIVE")
        n_in = int(main.shape[2])
        for f in range(min(n_in, 2) if self.sizing else n_in):  # sizing: later frames repeat the second's shapes
            st, act = (first, active) if f == 0 else (active_state, True)
            ups, ustats = self.segment(up, st, act, main[:, :, f : f + 1], None, None, carry, None)
            n_out = int(ups.shape[2])
            for g in range(min(n_out, 2) if self.sizing else n_out):
                sg, ag = (st, act) if g == 0 else (active_state, True)
                gstats = (ustats[0][g : g + 1], ustats[1][g : g + 1])
                written += self._run(rest, ups[:, :, g : g + 1], gstats, sg, ag, carry, out[:, :, written:])[2]
            del ups
        return written

    def _run(self, segs: Any, main: torch.Tensor, stats: Any, state: Any, active: bool, carry: dict,
             out: torch.Tensor) -> tuple[torch.Tensor, Any, int]:
        """The segments ``segs`` on the whole-frame activation ``main`` (its per-frame ``stats``): ``(output,
        its statistics, frames written to out)``."""
        block_in = main
        hmid = None
        hstats = None
        written = 0
        for seg in segs:
            if seg.kind == "res1":
                block_in = main
                hmid, hstats = self.segment(seg, state, active, main, None, stats, carry, None)
            elif seg.kind == "res2":
                main, stats = self.segment(seg, state, active, hmid, block_in, hstats, carry, None)
                hmid = block_in = None
            elif seg.kind == "up":
                main, stats = self.segment(seg, state, active, main, None, None, carry, None)
            else:
                frames = int(main.shape[2])
                self.segment(seg, state, active, main, None, stats, carry, out[:, :, :frames])
                written = frames
        return main, stats, written


def decode_seedvr2(
    model: Any,
    z: torch.Tensor,
    tile: tuple[int, int] | None,
    *,
    out: torch.Tensor,
    compute_device: torch.device | str,
    dtype: torch.dtype,
    store_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    norm_params: NormParamsFn | None = None,
    stats: dict | None = None,
    min_tile: int = MIN_TILE,
    sizing: bool = False,
) -> torch.Tensor:
    """Decode the latent ``z`` ``(B, 16, T, h, w)`` (as ``VAE Decode`` hands it to ``model.decode``) into ``out``
    ``(B, 3, frames, 8h, 8w)``: what ``model.decode(z)`` returns (range [-1, 1]), computed as the module docstring
    says. ``tile``: tile core ``(h, w)`` in px at every activation's own resolution (None: whole frames, one tile
    per segment); ``store_device``: where whole-frame activations and carried frames wait (default: the compute
    device). ``progress(done, total)`` per tile; ``should_stop()`` before each; ``fault_hook(step)`` inside each
    tile attempt (tests raise an out-of-memory error there); ``norm_params(norm, x)``: GroupNorm weight and bias as
    float32 on ``x``'s device (ComfyUI's casting). ``sizing`` (meta sizing only, :class:`..measure.sizing.MetaSizer`):
    each segment computes the first and the last tile of each shape (the last with every earlier tile's statistics
    alive, as in the full run); the others of that shape only allocate what outlives a tile (its output and carried
    frames, copied into the whole-frame buffers, and its statistics): the same peak, to the byte, most of the
    fake-tensor work skipped; the output is incomplete."""
    lay = seedvr2_layout(model)
    if lay.reason is not None:
        raise ValueError(f"SeedVR2 exact decode: {lay.reason}")
    dev = torch.device(compute_device)
    store = torch.device(store_device) if store_device is not None else dev
    b, _, t, h, w = (int(v) for v in z.shape)
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    run = _Run(model, lay, tile, dev, store, dtype, norm_params, driver, progress, b * units(lay, t, h, w, tile),
               fault_hook, min_tile, sizing)
    slices = lay.slices(t)

    def walk(latent: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:  # the host's output_buffer: not given
        for item in range(b):
            prefix_cache = lay.cache_type()
            carry: dict = {}
            f0 = 0
            try:
                for s0, s1, name in slices:
                    state = lay.state(name)
                    f0 += run.slice(latent[item : item + 1, :, s0:s1], state, name == "ACTIVE", prefix_cache, carry,
                                    out[item : item + 1, :, f0:])
            finally:
                if callable(getattr(prefix_cache, "free", None)):
                    prefix_cache.free()
            del prefix_cache, carry
        return out

    # The host's own decode around the walk: its latent scaling and checks before, its crop after; the walk stands
    # in for slicing_decode (an instance attribute for the call: the class's method is left alone).
    model.__dict__["slicing_decode"] = walk
    try:
        with torch.no_grad():
            model.decode(z.to(dev, dtype))
    finally:
        model.__dict__.pop("slicing_decode", None)
    if stats is not None:
        stats.update(exact=True, chunks=b * len(slices), tiles=run.tile, steps=run.steps, restarts=run.restarts,
                     units=run.done, shrinks=run.shrinks)
    return out
