"""Exact temporal-chunk decode of Wan 2.1 / 2.2 (:func:`decode_wan_chunked`): latent frame 0 alone, then
chunks of ``k`` latent frames with the causal caches carried across, optionally in spatial tiles (tile-major:
the global part of the decoder on whole frames into a store, then each tile over time with its own caches).
The decoder's structure comes from ``memory/vae/wan_layout.py``; design and measurements: docs/VIDEO_DECODE.md.
Nothing here imports ComfyUI: models are duck-typed, ComfyUI callables are passed in."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..oom import OomEvent, oom_types
from ..run_context import ProgressFn
from ..tiles import chunk_ranges, spans
from ..vae.wan_layout import (
    CACHE_T,
    CacheProtocol,
    SplitInfo,
    WanLayout,
    cache_protocol,
    is_causal,
    time_upsamples,
    views_more,
    wan_layout,
)
from .blend import stop_driver

log = logging.getLogger("vramfit.memory.executors.wan")

EXECUTOR_VERSION = "v4"
"""Version of the chunked executor's allocation pattern, part of every persisted video peak's key: bump it
when a change alters what the executor holds at its peak (the persisted peaks are then re-sized). v2: the
"per_call" caches are compacted under ``torch.inference_mode`` too (v1 peaks sized there held whole
activations). v3: after a temporal upsample the rest of the decoder runs on ``CACHE_T``-frame slices, as
the host's ``Decoder3d.run_up`` does (v2 ran a chunk's 4 k frames through the full-resolution layers at
once). v4: a one-frame clip runs without causal caches (nothing reads them), as the host's 4-D decode."""

__all__ = ["EXECUTOR_VERSION", "decode_wan_chunked", "output_pieces"]

MIN_TILE = 2
"""Smallest tile core (latent px) the OOM fallback shrinks to."""


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``rearrange(x, "b (c r q) f h w -> b c f (h q) (w r)", q=p, r=p)`` (Wan 2.2's ``unpatchify``)."""
    if p == 1:
        return x
    b, cpp, f, h, w = x.shape
    c = cpp // (p * p)
    return x.reshape(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c, f, h * p, w * p)


def output_pieces(decoder: Any, frames: int, upto: int | None = None) -> int:
    """Pieces in which a chunk's ``frames`` frames leave ``decoder.upsamples[:upto]`` (default: the head's output;
    one output or store copy each): ``CACHE_T``-frame slices after a temporal upsample, else one piece."""
    if frames <= CACHE_T or not any(time_upsamples(decoder)[:upto]):
        return 1
    return -(-int(frames) // CACHE_T)


# --------------------------------------------------------------------------------------------------
# Wan executor


@dataclasses.dataclass(frozen=True)
class _Tile:
    """A tile: its core ``[c0, c1)`` and its halo-extended region ``[e0, e1)`` per axis (latent px)."""

    c0y: int
    c1y: int
    e0y: int
    e1y: int
    c0x: int
    c1x: int
    e0x: int
    e1x: int

    @property
    def core(self) -> tuple[int, int]:
        return (self.c1y - self.c0y, self.c1x - self.c0x)

    @property
    def ext(self) -> tuple[int, int]:
        return (self.e1y - self.e0y, self.e1x - self.e0x)


@dataclasses.dataclass
class _Item:
    """One tile's remaining work: the tile, its own causal caches (ComfyUI's full-length list; the tiled
    part's entries cover the tile's extended region) and the next latent frame to decode."""

    tile: _Tile
    cache: list
    pos: int
    inline: bool
    """Runs the global part itself, chunk by chunk (the one whole-frame tile: no store)."""


@dataclasses.dataclass
class _Store:
    """The global part's output for latent frames ``[pos, T)``: ``(B, C, frames, H s, W s)``."""

    x: torch.Tensor
    pos: int
    f0: int
    """Store frame index of latent frame ``pos`` (frames before it are not held)."""


class _WanRun:
    def __init__(
        self,
        model: Any,
        layout: WanLayout,
        si: SplitInfo,
        protocol: CacheProtocol,
        z: torch.Tensor,
        k: int,
        tile: tuple[int, int] | None,
        grid: tuple[list, list],
        halo: int,
        out: torch.Tensor,
        compute: torch.device,
        dtype: torch.dtype,
        store_device: torch.device,
        rollback: bool,
        progress: ProgressFn | None,
        should_stop: Callable[[], Any] | None,
        fault_hook: Callable[[int], None] | None,
        oom_exceptions: tuple[type[BaseException], ...],
        on_oom: Callable[[], None] | None,
        min_tile: int,
        pin: bool,
        split_hook: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        sizing: bool = False,
        phase_hook: Callable[[str], None] | None = None,
    ) -> None:
        self.model = model
        self.dec = model.decoder
        self.lay = layout
        self.z = z
        self.B, _, self.T, self.H, self.W = (int(v) for v in z.shape)
        self.k = max(1, int(k))
        self.tile = tile  # None = whole frame
        self.grid = grid  # the tiles' spans down and across (:func:`..tiles.spans`)
        self.halo = int(halo)
        self.si, self.split, self.protocol = si, si.split, protocol
        self.n_global = si.first_slot
        self.out_start, self.store_start = layout.frame_starts(self.T, si.split)  # per latent frame, end included
        self.out = out
        self.compute = compute
        self.dtype = dtype
        self.store_device = store_device
        self.rollback = bool(rollback)
        self.progress = progress
        self.fault_hook = fault_hook
        self.driver = stop_driver(oom_exceptions, should_stop, on_oom)
        self.min_tile = max(1, int(min_tile))
        self.pin = pin
        self.split_hook = split_hook
        self.sizing = bool(sizing)
        self.phase_hook = phase_hook
        self.store: _Store | None = None
        self.queue: list[_Item] = []
        self.global_left = 0  # phase-1 chunks still to run (progress)
        self.step = 0  # tile-chunk attempts (fault_hook index)
        self.done = 0  # finished units: tile-chunks and phase-1 chunks (progress)
        self.units = 0  # finished tile-chunks
        self.global_chunks = 0
        self.tiles_done = 0
        self.shrinks = 0
        self.restarts = 0
        self.calls = 0  # decoder calls: phase-1 chunks and tile-chunks (whole frames: one per chunk)
        self.moves: dict[str, list[int]] = {}  # route -> [copies, bytes] (:meth:`_moved`)
        # A one-frame clip: no later frame reads a causal cache, so none is kept (the host's layers run without
        # their cache list, as its 4-D decode runs them: the first chunk's numbers); the slots are still counted.
        self.cacheless = self.T == 1
        self.slots_of = {id(layer): sum(s.name.startswith(f"{part}.{j}.") for s in layout.slots)
                         for part in ("middle", "upsamples") for j, layer in enumerate(getattr(self.dec, part))}
        self.slot_frames = [s.frames for s in layout.slots]
        # Wan 2.1's ``Resample("upsample3d")``: the host's ``Decoder3d.run_up`` runs what follows it on
        # ``CACHE_T``-frame slices of its output; the executor does the same (exact for any cache protocol: a
        # call of >= CACHE_T frames leaves complete entries), so no layer after it sees more than 2 frames.
        self.slice_tiled_input = any(layout.time_up[:si.split])

    # -- plan ----------------------------------------------------------------------------------
    def _make_tile(self, c0y: int, c1y: int, c0x: int, c1x: int) -> _Tile:
        h = self.halo
        return _Tile(c0y, c1y, max(0, c0y - h), min(self.H, c1y + h), c0x, c1x, max(0, c0x - h), min(self.W, c1x + h))

    def chunks_from(self, pos: int) -> list[tuple[int, int]]:
        """Chunks still to decode from latent frame ``pos`` with the current chunk size."""
        if pos <= 0:
            return chunk_ranges(self.T, self.k)
        return [(p, min(self.T, p + self.k)) for p in range(pos, self.T, self.k)]

    def _moved(self, route: str, t: torch.Tensor) -> None:
        """Count one copy the executor makes between the compute device and where a tensor lives (``route``:
        ``latent`` in, ``output`` out, ``store_write``, ``store_read`` from a store on another device,
        ``park`` of an OOM-split tile's cache window): what crosses between host and device on an accelerator
        with ComfyUI's placement (latent and output on the host). Bytes: ``t``'s, as copied."""
        c = self.moves.setdefault(route, [0, 0])
        c[0] += 1
        c[1] += int(t.numel()) * t.element_size()

    def _report(self) -> None:
        if self.progress is not None:
            left = self.global_left + sum(len(self.chunks_from(it.pos)) for it in self.queue)
            self.progress(self.done, self.done + left)

    # -- decoder pieces (ComfyUI's modules, ComfyUI's cache protocol) --------------------------
    def _cached_conv(self, conv: Any, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
        """``Decoder3d.forward``'s inline caching around ``conv1`` and the head conv (none for a one-frame clip)."""
        if self.cacheless:
            idx[0] += 1
            return conv(x)
        i = idx[0]
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        prev = cache[i]
        if cache_x.shape[2] < 2 and prev is not None:
            cache_x = torch.cat([prev[:, :, -1:, :, :].to(cache_x.device), cache_x], dim=2)
        x = conv(x, prev)
        del prev
        cache[i] = cache_x
        idx[0] += 1
        return x

    def history(self, cache: list, n: int, first: bool, last: bool = False) -> list | None:
        """What a chunk of ``n`` later latent frames needs to restore the caches' history on hosts that do not
        carry it (:class:`CacheProtocol`): references to the entries of the slots whose input gets fewer than
        ``CACHE_T`` frames (``n * frames < 2``: latent-scale slots of one-frame chunks), taken before the
        chunk replaces them. None when nothing needs restoring: also for the ``last`` chunk of the clip (the
        history serves the next chunk only; keeping it would hold the old entries beside the new ones)."""
        if first or last or not self.protocol.restores:
            return None
        need = [i for i, f in enumerate(self.slot_frames) if n * f < CACHE_T]
        if not need:
            return None
        hist: list = [None] * len(cache)
        for i in need:
            hist[i] = cache[i]
        return hist

    def _settle(self, cache: list, a: int, b: int, hist: list | None) -> None:
        """After a host layer filled cache slots ``[a, b)``: a one-frame entry gets the previous entry's last
        frame prepended (the "carry" protocol: the conv's input at the last two frames; after ``'Rep'`` the
        conv's zero padding is that history already), and an entry that is a view of a larger activation is
        copied (so the activation can be freed). No-op on "carry" hosts."""
        if not (self.protocol.restores or self.protocol.compacts):
            return
        for i in range(a, b):
            e = cache[i]
            if not isinstance(e, torch.Tensor):
                continue
            prev = hist[i] if hist is not None else None
            if e.shape[2] < CACHE_T and isinstance(prev, torch.Tensor):
                cache[i] = torch.cat([prev[:, :, -1:].to(e.device), e], dim=2)
            elif self.protocol.compacts and views_more(e):
                cache[i] = e.clone()

    def _layer(self, layer: Any, x: torch.Tensor, cache: list, idx: list[int], hist: list | None,
               first: bool | None = None) -> torch.Tensor:
        """One host layer with ComfyUI's cache protocol (``first``: Wan 2.2's ``first_chunk``), then
        :meth:`_settle` of the slots it used."""
        if self.cacheless:  # the host layer without its cache (a one-frame clip), its slots counted
            idx[0] += self.slots_of[id(layer)]
            return layer(x) if first is None else layer(x, first_chunk=first)
        a = idx[0]
        x = layer(x, cache, idx) if first is None else layer(x, cache, idx, first)
        self._settle(cache, a, idx[0], hist)
        return x

    def _up(self, j: int, x: torch.Tensor, cache: list, idx: list[int], first: bool, hist: list | None) -> torch.Tensor:
        return self._layer(self.dec.upsamples[j], x, cache, idx, hist, first if self.lay.first_chunk[j] else None)

    def _ups(self, j: int, end: int, ref: list, cache: list, idx: list[int], first: bool, hist: list | None,
             emit: Callable[[list, int], None]) -> None:
        """``upsamples[j:end]`` on ``ref[0]`` (taken out of ``ref``, so the caller holds no reference), as the
        host's ``Decoder3d.run_up``: after a temporal upsample whose output has more than ``CACHE_T`` frames,
        the layers after it run on its ``CACHE_T``-frame slices in turn, each from the same cache index.
        ``emit([piece], slot)`` gets each output piece in frame order (and may drop the reference) with the
        next cache slot."""
        x = ref[0]
        ref[0] = None
        while j < end:
            x = self._up(j, x, cache, idx, first, hist)
            j += 1
            if self.lay.time_up[j - 1] and x.shape[2] > CACHE_T:
                start, stop = idx[0], idx[0]
                for f in range(0, int(x.shape[2]), CACHE_T):
                    sub = [start]
                    self._ups(j, end, [x[:, :, f : f + CACHE_T]], cache, sub, first, hist, emit)
                    stop = sub[0]
                del x
                idx[0] = stop
                return
        piece = [x]
        del x
        emit(piece, idx[0])

    def global_part(self, zc: torch.Tensor, cache: list, first: bool, hist: list | None,
                    emit: Callable[[list], None]) -> None:
        """The decoder up to the split on latent frames ``zc``; ``emit([piece])`` gets its output in frame
        order, in one piece or in ``CACHE_T``-frame slices after a temporal upsample (see :meth:`_ups`)."""
        idx = [0]
        x = self.model.conv2(zc)
        x = self._cached_conv(self.dec.conv1, x, cache, idx)
        for j, layer in enumerate(self.dec.middle):
            x = self._layer(layer, x, cache, idx, hist) if self.lay.mid_cached[j] else layer(x)
        s = self.si.scale

        def checked(piece: list, slot: int) -> None:
            if slot != self.n_global:
                raise RuntimeError(f"global part used {slot} cache slots, layout says {self.n_global}")
            if piece[0].shape[-2] != self.H * s or piece[0].shape[-1] != self.W * s:
                raise RuntimeError(f"global part output {tuple(piece[0].shape)} is not {s}x {self.H}x{self.W}")
            emit(piece)

        ref = [x]
        del x
        self._ups(0, self.split, ref, cache, idx, first, hist, checked)

    def tiled_part(self, ref: list, cache: list, first: bool, hist: list | None,
                   emit: Callable[[torch.Tensor], None]) -> None:
        """The decoder from the split to the head on ``ref[0]`` (taken out of ``ref``); ``emit(y)`` gets the
        head's output in frame order. An input of more than ``CACHE_T`` frames that follows a temporal
        upsample runs in ``CACHE_T``-frame slices (as the host's ``run_up`` feeds these layers)."""
        x = ref[0]
        ref[0] = None
        n_up = len(self.dec.upsamples)

        def head(piece: list, slot: int) -> None:
            y = piece[0]
            piece[0] = None
            idx = [slot]
            for layer in self.dec.head:
                y = self._cached_conv(layer, y, cache, idx) if is_causal(layer) else layer(y)
            if idx[0] != len(self.lay.slots):
                raise RuntimeError(f"decoder used {idx[0]} cache slots, layout says {len(self.lay.slots)}")
            emit(y)

        if self.slice_tiled_input and x.shape[2] > CACHE_T:
            pieces = [x[:, :, f : f + CACHE_T] for f in range(0, int(x.shape[2]), CACHE_T)]
        else:
            pieces = [x]
        del x
        for i in range(len(pieces)):
            sub = [pieces[i]]
            pieces[i] = None
            self._ups(self.split, n_up, sub, cache, [self.n_global], first, hist, head)

    # -- phase 1: the global part on whole frames, into the store ------------------------------
    def build_store(self, cache: list, pos: int) -> None:
        """Run the global part over latent frames ``[pos, T)`` from the global cache entries of ``cache``
        (whole frames, low resolution) and keep its output for every frame in the store.

        Chunks of ``k`` with snapshot/commit of the global cache (an OOM halves ``k`` and resumes); with
        ``rollback`` off and ``pos = 0`` the cache is used in place and an OOM starts phase 1 again."""
        self.store = None
        si = self.si
        f0 = self.store_start[pos]
        shape = (self.B, si.channels, self.store_start[self.T] - f0, self.H * si.scale, self.W * si.scale)
        buf = torch.empty(shape, dtype=self.dtype, device=self.store_device, pin_memory=self.pin)
        fresh = [None] * self.lay.n_cache
        cache = list(cache[: self.n_global]) + fresh[self.n_global :]
        in_place = not self.rollback and pos == 0
        p, n = pos, 1
        self.global_left = len(self.chunks_from(p))
        self._report()

        def attempt() -> list:
            nonlocal n
            n = 1 if p == 0 else min(self.k, self.T - p)
            self.driver.check_stop()
            hist = self.history(cache, n, p == 0, p + n >= self.T)
            work = cache if in_place else list(cache)
            zc = self.z[:, :, p : p + n]
            self._moved("latent", zc)
            zc = zc.to(device=self.compute, dtype=self.dtype)
            self.calls += 1
            at = [self.store_start[p] - f0]

            def store(piece: list) -> None:
                x = piece[0]
                piece[0] = None
                if self.split_hook is not None:
                    x = self.split_hook(x, p)
                buf[:, :, at[0] : at[0] + x.shape[2]].copy_(x, non_blocking=self.pin)
                self._moved("store_write", x)
                at[0] += int(x.shape[2])

            self.global_part(zc, work, p == 0, hist, store)
            return work

        def recover(event: OomEvent) -> None:
            nonlocal cache, p
            if in_place:
                cache, p = list(fresh), pos
                self.restarts += 1
            self.k = max(1, n // 2)
            self.shrinks += 1
            log.warning("video decode: out of memory in the global part; resuming with k = %d", self.k)
            self.global_left = len(self.chunks_from(p))
            self._report()

        while p < self.T:
            cache = self.driver.run(attempt, can_recover=lambda e: n > 1, recover=recover)
            p += n
            self.global_chunks += 1
            self.global_left -= 1
            self.done += 1
            self._report()
        if self.pin and self.compute.type == "cuda":
            torch.cuda.synchronize(self.compute)  # the non-blocking copies into pinned memory have landed
        self.store = _Store(buf, pos, f0)

    # -- phase 2: one tile over time -----------------------------------------------------------
    def chunk(self, item: _Item, s0: int, s1: int) -> list:
        """Decode latent frames ``[s0, s1)`` of one tile, write its core frames into ``out``; return the
        tile's next cache (``item.cache`` is left as it was unless ``rollback`` is off)."""
        first = s0 == 0
        tl = item.tile
        hist = self.history(item.cache, s1 - s0, first, s1 >= self.T)
        work = list(item.cache) if self.rollback else item.cache
        S, p = self.lay.decoder_ratio, self.lay.patch
        oy, ox = (tl.c0y - tl.e0y) * S, (tl.c0x - tl.e0x) * S
        sp = S * p
        t = [self.out_start[s0]]
        t_end = self.out_start[s1]

        def write(y: torch.Tensor) -> None:
            core = y[:, :, :, oy : oy + (tl.c1y - tl.c0y) * S, ox : ox + (tl.c1x - tl.c0x) * S]
            del y
            core = _unpatchify(core, p)
            t0, nt = t[0], int(core.shape[2])
            if t0 + nt > self.out.shape[2]:
                raise RuntimeError(f"chunk [{s0}, {s1}) yielded frames up to {t0 + nt}: beyond {self.out.shape[2]}")
            core = core.to(self.out.device, self.out.dtype)
            self._moved("output", core)
            self.out[:, :, t0 : t0 + nt, tl.c0y * sp : tl.c1y * sp, tl.c0x * sp : tl.c1x * sp] = core
            del core
            t[0] += nt

        def tiled(piece: list) -> None:
            if self.split_hook is not None:
                piece = [self.split_hook(piece.pop(), s0)]
            self.tiled_part(piece, work, first, hist, write)

        self.calls += 1
        if item.inline:
            zc = self.z[:, :, s0:s1]
            self._moved("latent", zc)
            zc = zc.to(device=self.compute, dtype=self.dtype)
            self.global_part(zc, work, first, hist, tiled)
            del zc
        else:
            st = self.store
            assert st is not None and st.pos <= s0
            s = self.si.scale
            a, b = self.store_start[s0] - st.f0, self.store_start[s1] - st.f0
            x = st.x[:, :, a:b, tl.e0y * s : tl.e1y * s, tl.e0x * s : tl.e1x * s]
            if x.device != self.compute:
                self._moved("store_read", x)
                x = x.to(self.compute, non_blocking=self.pin)
            ref = [x]
            del x
            self.tiled_part(ref, work, first, hist, write)
        if t[0] != t_end:
            raise RuntimeError(f"chunk [{s0}, {s1}) yielded frames up to {t[0]}, expected {t_end}")
        return work

    def _to_compute(self, e: Any) -> Any:
        if isinstance(e, torch.Tensor) and e.device != self.compute:
            return e.to(self.compute)
        return e

    def run_item(self, item: _Item) -> list[_Item]:
        """Run one tile over all its remaining chunks. Returns ``[]`` when done, or the sub-tiles that
        replace it after an OOM at one latent frame per chunk."""
        item.cache = [self._to_compute(e) for e in item.cache]
        s0, n = item.pos, 1
        split = False

        def attempt() -> list | None:
            nonlocal s0, n
            if split:
                return None
            s0 = item.pos
            n = 1 if s0 == 0 else min(self.k, self.T - s0)
            self.driver.check_stop()
            self.step += 1
            if self.fault_hook is not None:
                self.fault_hook(self.step - 1)
            return self.chunk(item, s0, s0 + n)

        def recover(event: OomEvent) -> None:
            # Out of the except block (OomResume): its traceback held the failed chunk's tensors.
            nonlocal split
            if not self.rollback:  # the tile's cache was consumed in place: this tile starts again
                item.cache = [None] * self.lay.n_cache
                item.pos = 0
                self.restarts += int(s0 > 0)
            if n > 1:
                self.k = max(1, n // 2)
                self.shrinks += 1
                log.warning("video decode: out of memory; resuming with %d latent frames per chunk", self.k)
                self._report()
            else:
                split = True

        def can_recover(e: BaseException) -> bool:
            return n > 1 or max(item.tile.core) > self.min_tile

        while item.pos < self.T:
            nxt = self.driver.run(attempt, can_recover=can_recover, recover=recover)
            if nxt is None:
                return self.split_item(item)
            item.cache, nxt = nxt, None
            item.pos += n
            self.units += 1
            self.done += 1
            self._report()
        self.tiles_done += 1
        return []

    def split_item(self, item: _Item) -> list[_Item]:
        """Halve a tile's core along its longer side. The halves resume from the tile's committed frame with
        windows of its committed cache: a half's core + halo lies inside the tile's core + halo, and the
        tile's cache is exact there except within each layer's partial reach of the tile's own border,
        which is within the same distance of the half's border (what the half computes wrongly anyway)."""
        tl = item.tile
        ch, cw = tl.core
        if ch >= cw:
            m = tl.c0y + (ch + 1) // 2
            cores = [(tl.c0y, m, tl.c0x, tl.c1x), (m, tl.c1y, tl.c0x, tl.c1x)]
        else:
            m = tl.c0x + (cw + 1) // 2
            cores = [(tl.c0y, tl.c1y, tl.c0x, m), (tl.c0y, tl.c1y, m, tl.c1x)]
        subs = [self._make_tile(*c) for c in cores]
        if item.inline:  # whole frame so far: phase 1 for the rest, from the committed global cache
            self.build_store(item.cache, item.pos)
        items = []
        for j, sub in enumerate(subs):
            cache: list = [None] * self.n_global
            for e in item.cache[self.n_global :]:
                cache.append(self._sub_window(e, tl, sub, park=j > 0))
            items.append(_Item(sub, cache, item.pos, False))
        item.cache = []
        self.tile = subs[0].core
        self.shrinks += 1
        log.warning("video decode: out of memory at one latent frame; resuming tile with %dx%d latent px halves",
                    *self.tile)
        return items

    def _sub_window(self, e: Any, parent: _Tile, sub: _Tile, park: bool) -> Any:
        """The window of ``sub``'s extended region in a parent tile's cache entry (a view for the tile
        that runs next, a copy on the store device for the ones that wait)."""
        if not isinstance(e, torch.Tensor):
            return e
        eh, ew = parent.ext
        s = e.shape[-2] // eh
        if e.shape[-2] != s * eh or e.shape[-1] != s * ew:
            raise RuntimeError(f"cache entry {tuple(e.shape)} is not a multiple of the tile {eh}x{ew}")
        y0, x0 = (sub.e0y - parent.e0y) * s, (sub.e0x - parent.e0x) * s
        w = e[:, :, :, y0 : y0 + sub.ext[0] * s, x0 : x0 + sub.ext[1] * s]
        if not park:
            return w
        self._moved("park", w)
        return w.to(self.store_device, copy=True)

    @staticmethod
    def peak_tiles(ys: list[tuple[int, int, int, int]], xs: list[tuple[int, int, int, int]]) -> list[_Tile]:
        """The tiles that set the peak of phase 2: per axis, the spans ``ys``, ``xs`` whose (core, extended) lengths
        no other span reaches in both (one tile's caches are alive at a time, and every tensor of a tile grows with
        its extents), crossed."""

        def maximal(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
            lens = [(b - a, e1 - e0) for a, b, e0, e1 in spans]
            keep, seen = [], set()
            for sp, (c, e) in zip(spans, lens, strict=True):
                if (c, e) in seen or any(c2 >= c and e2 >= e and (c2, e2) != (c, e) for c2, e2 in lens):
                    continue
                seen.add((c, e))
                keep.append(sp)
            return keep

        return [_Tile(*y, *x) for y in maximal(ys) for x in maximal(xs)]

    def run(self) -> torch.Tensor:
        ys, xs = self.grid
        tiles = [_Tile(*y, *x) for y in ys for x in xs]
        fresh = [None] * self.lay.n_cache
        if len(tiles) == 1:
            self.queue = [_Item(tiles[0], list(fresh), 0, True)]
            self._report()
        else:
            if self.sizing:
                tiles = self.peak_tiles(ys, xs)
            self.queue = [_Item(t, list(fresh), 0, False) for t in tiles]
            self.build_store(fresh, 0)
            if self.phase_hook is not None:
                self.phase_hook("store")
        while self.queue:
            subs = self.run_item(self.queue[0])
            self.queue[0:1] = subs
        self.store = None
        return self.out


def decode_wan_chunked(
    model: Any,
    z: torch.Tensor,
    frames_per_chunk: int = 1,
    tile: int | Sequence[int] | None = None,
    *,
    halo: int | None = None,
    split: int | None = None,
    out: torch.Tensor | None = None,
    out_device: torch.device | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    compute_device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    store_device: torch.device | str | None = None,
    rollback: bool = True,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = MIN_TILE,
    pin_memory: bool | None = None,
    stats: dict | None = None,
    split_hook: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    sizing: bool = False,
    phase_hook: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Decode a Wan 2.1/2.2 latent exactly (or a variant of the layout: Qwen-Image 2.1's VAE, one-frame clips),
    tile by tile, each tile over time in chunks; returns what ``model.decode(z)`` returns: ``(B, C, 1 + 4 (T - 1),
    H, W)`` in [-1, 1] (``out_dtype``; ``C`` the layout's ``out_channels``: 3, Qwen-Image 2.1's 4).

    ``model``: the ``first_stage_model`` (``comfy.ldm.wan.vae.WanVAE`` or ``vae2_2.WanVAE``), already on
    ``compute_device``. ``z``: ``(B, C, T, h, w)`` latent (anywhere; chunks are moved to
    ``compute_device`` (default ``z.device``) and cast to ``dtype`` (default ``z.dtype``): pass
    ``vae.vae_dtype``). ``frames_per_chunk``: latent frames per chunk after frame 0 (decoded alone);
    ``<= 0`` = all the rest at once. ``tile``: tile core ``(h, w)`` (or one int) in latent px, or None
    for whole frames. ``halo``: latent px around each tile (default: the tiled part's convolutional
    reach, rounded up; smaller is inexact). ``split``: index into ``decoder.upsamples`` where the tiled
    part starts (default :attr:`WanLayout.default_split`). ``out``: preallocated output (else one is
    allocated on ``out_device``, default the compute device).

    Order: with one tile (whole frames) the whole decoder runs chunk by chunk (ComfyUI's flow, batched in
    time). With several tiles, phase 1 runs the global part over all latent frames (whole frames, low
    resolution) into a store on ``store_device`` (default the compute device; ``"cpu"`` on CUDA: pinned
    host memory, each tile-chunk copies its window in); phase 2 runs each tile over all chunks with only
    its own causal caches, so one tile's caches are alive at a time.

    ``rollback`` (default): a tile's committed cache is kept during a chunk (2x one tile's cache), so an
    OOM resumes that tile from its last chunk; ``False``: ComfyUI's in-place protocol (1x), and an OOM
    starts that tile again from frame 0. Finished tiles are never decoded again.

    ``progress(done, total)`` after each tile-chunk and phase-1 chunk (``total`` grows after a re-plan).
    ``should_stop()`` before each: its exception propagates; a truthy return raises ``InterruptedError``.
    ``fault_hook(step)`` at the start of each tile-chunk attempt (tests raise an OOM there).
    ``oom_exceptions`` (default ``torch.OutOfMemoryError``; a bare ``Exception``, ComfyUI's
    ``OOM_EXCEPTION`` without CUDA, is ignored): after the ``except`` block is left, ``on_oom()`` is
    called and the chunk size is halved; at one latent frame the tile is split in two halves that resume
    from its committed cache (phase 1 at one frame: the OOM propagates, as it does when a tile's core is
    already ``min_tile``). ``stats``: a dict filled with what happened (units = tile-chunks, steps =
    attempts, tiles, global_chunks, shrinks, restarts, final frames_per_chunk and tile, halo, split,
    reach, store; calls = decoder calls, one per phase-1 chunk and tile-chunk; moves = ``{route: (copies,
    bytes)}`` of the copies between the compute device and the latent, the output, a store (``store_read``
    only from a store on another device) and parked OOM windows: :func:`..plan.video.traffic` predicts them).
    ``split_hook(x, latent_start)``: sees (and may replace) the global part's output of each chunk, in
    ``CACHE_T``-frame slices after a temporal upsample (impulse experiments, fault injection in phase 1).
    ``sizing`` (meta sizing only, :class:`.sizing.MetaSizer`): with several tiles, phase 2 runs only the
    tiles that set its peak (per axis the spans whose core and extended lengths are not both reached by
    another span): the same peak as the full run, most tiles' work skipped; the output is incomplete.
    ``phase_hook("store")``: called when phase 1 has built the store (several tiles only), before any tile
    runs (the planner reads phase 1's own peak there, which no tile size changes).
    """
    lay, protocol = wan_layout(model), cache_protocol(model)
    if z.ndim != 5:
        raise ValueError(f"expected a (B, C, T, h, w) latent, got shape {tuple(z.shape)}")
    if z.shape[1] != lay.latent_channels:
        raise ValueError(f"latent has {z.shape[1]} channels, the VAE expects {lay.latent_channels}")
    split = lay.default_split if split is None else int(split)
    if not 0 <= split <= len(lay.splits) - 1:
        raise ValueError(f"split must be in [0, {len(lay.splits) - 1}], got {split}")
    si = lay.split_info(split)
    if tile is not None:
        tile = (int(tile), int(tile)) if isinstance(tile, int) else (int(tile[0]), int(tile[1]))
        if min(tile) < 1:
            raise ValueError(f"tile must be >= 1 latent px, got {tile}")
        if lay.tiled_global_ops and split == 0:
            raise ValueError(f"the up path holds global ops {lay.tiled_global_ops}: cannot tile exactly")
    halo = si.halo if halo is None else int(halo)
    if halo < 0:
        raise ValueError("halo must be >= 0")
    compute = torch.device(compute_device) if compute_device is not None else z.device
    store_dev = torch.device(store_device) if store_device is not None else compute
    B, _, T, h, w = (int(v) for v in z.shape)
    th, tw = tile if tile is not None else (h, w)
    grid = spans(h, th, halo), spans(w, tw, halo)
    shape = (B, lay.out_channels, lay.out_frames(T), h * lay.spatial_ratio, w * lay.spatial_ratio)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=torch.device(out_device) if out_device else compute)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    pin = (
        pin_memory
        if pin_memory is not None
        else (
            store_dev.type == "cpu"
            and compute.type == "cuda"
            and torch.cuda.is_available()
            and not _is_fake(z)
        )
    )
    run = _WanRun(
        model,
        lay,
        si,
        protocol,
        z,
        frames_per_chunk if frames_per_chunk > 0 else max(1, T - 1),
        tile,
        grid,
        halo,
        out,
        compute,
        dtype or z.dtype,
        store_dev,
        rollback,
        progress,
        should_stop,
        fault_hook,
        oom_types(oom_exceptions),
        on_oom,
        min_tile,
        pin,
        split_hook,
        sizing,
        phase_hook,
    )
    with torch.no_grad():
        result = run.run()
    if stats is not None:
        stats.update(
            exact=run.protocol.name != "unknown",
            protocol=run.protocol.name,
            chunks=run.units,
            units=run.units,
            steps=run.step,
            tiles=run.tiles_done,
            global_chunks=run.global_chunks,
            shrinks=run.shrinks,
            restarts=run.restarts,
            frames_per_chunk=run.k,
            tile=run.tile,
            halo=halo,
            split=split,
            reach=si.reach,
            rollback=run.rollback,
            store=None if run.global_chunks == 0 else ("host" if store_dev != compute else "device"),
            calls=run.calls,
            moves={route: tuple(v) for route, v in run.moves.items()},
        )
    if run.shrinks:
        log.info(
            "Wan chunked decode finished after %d OOM re-plan(s): k=%d tile=%s", run.shrinks, run.k, run.tile
        )
    return result


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (meta sizing): no real pinned memory, no synchronisation."""
    return type(t).__name__ == "FakeTensor"
