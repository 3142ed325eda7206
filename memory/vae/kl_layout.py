"""Layout of a GroupNorm KL decoder (SD1.x/SD2/SDXL, SD3/Flux, Flux 2, Hunyuan Image 2.1) for the exact tiled
executor.

The decoder is walked once per model object (:func:`kl_layout`, cached): the structure check
(:mod:`.kl_structure`), the up path cut into *segments* at every GroupNorm, and the pure-integer geometry
that the executor (:mod:`..executors.kl_exact`) runs and the cost model (:mod:`..cost.exact`) predicts: row
bands of the store, the rows a tile reads, the live store per row of tiles (:func:`store_schedule`), step
counts (:func:`exact_geometry`). Duck-typed: no ComfyUI import.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..tiles import pair, split_even, tile_count
from .kl_structure import (
    _downsamples,
    _encoder_reason,
    _is_pixel_shuffle_down,
    _is_pixel_shuffle_up,
    _structure_reason,
    conv_dims,
    find_decoder,
    hunyuan_image,
    in_shortcut_repeats,
    stage_order,
    time_mixing,
    time_scale,
    whole_clip_3d,
)

log = logging.getLogger("vramfit.memory.vae.kl_layout")

__all__ = [
    "BAND_TAIL",
    "ExactGeometry",
    "KlLayout",
    "RowStep",
    "SegmentInfo",
    "axis_extents",
    "conv_dims",
    "find_decoder",
    "hunyuan_image",
    "kl_layout",
    "exact_geometry",
    "store_schedule",
    "supports_exact",
    "unsupported_reason",
    "whole_clip_3d",
]


# --------------------------------------------------------------------------------------------------
# Structure check (the checks themselves: :mod:`.kl_structure`)


def unsupported_reason(model: Any) -> str | None:
    """Why the exact executor cannot run ``model`` (a ``first_stage_model`` or a ``Decoder``), or None."""
    return kl_layout(model).reason


def supports_exact(model: Any) -> bool:
    """True when ``model`` (``first_stage_model`` or its ``Decoder``) has the KL 2-D GroupNorm structure."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.debug("exact tiled decode not supported: %s", reason)
    return reason is None


# --------------------------------------------------------------------------------------------------
# Segments


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """One segment of the decoder's up path (kinds ``conv1``, ``conv2``, ``conv12``, ``upsample``, ``out``) or
    of the encoder's down path (``in``, ``conv1``, ``conv2``, ``conv12``, ``downsample``)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    output: str
    store_output: bool
    in_channels: int
    out_channels: int
    scale: int
    """Output resolution / input resolution (2 for ``upsample``, else 1)."""
    level_scale: int
    """Output resolution / mid-block resolution."""
    halo: int
    """Context px read around the tile's region, at the resolution its convolutions run at (for
    ``upsample``: the 2x output resolution; the low-res input region is derived from it)."""
    residual_channels: int = 0
    """Channels of the resnet block's input ``x`` read for the shortcut (``conv2``/``conv12``)."""
    inplace_of: str | None = None
    """``conv2`` of a block with an identity shortcut writes ``x + conv2(...)`` over ``x`` itself: each
    tile reads ``x`` only at its own core, so no other tile needs the overwritten values."""
    residual_halo: int = 0
    """Halo of the shortcut's read of ``x`` in a ``conv12`` tile (1 for a 3x3 ``conv_shortcut``, else 0)."""
    shortcut_output: str | None = None
    """``conv1`` of a channel-changing block (without ``recompute``) also writes ``shortcut(x)`` at its
    cores under this name, so ``x`` dies with this segment; the block's ``conv2`` then adds ``conv2(...)``
    over it in place."""
    module: str = ""
    """Path from the decoder (encoder) to the module the segment calls (:func:`module_at`): its resnet block
    (``up.i.block.j``), upsample (``up.i.upsample``) or downsample (``down.i.downsample``); ``""``: the
    decoder itself (``out``) or the encoder itself (``in``)."""
    stride: int = 1
    """Input px per output px (2 for an encoder's ``downsample``: output ``[a, b)`` reads input rows
    ``[2a, 2b + 1)``, the module's own asymmetric zero pad supplying the row past a map's last one; with
    ``halo`` 2, Hunyuan Image 2.1's conv-then-space-to-depth, ``[2a - 2, 2b + 2)``: whole 2x2 cells around the
    conv's 1-px reach)."""
    frames: int = 1
    """Frames of the output for a one-frame latent (a 3-D decoder: every tile holds all frames; 1 for 2-D)."""
    tscale: int = 1
    """Output frames per input frame (2 for the refiner's temporal upsample)."""
    whole_batch: bool = False
    """Each tile holds this region of every batch item (a decoder that mixes its batch as one video's frames:
    SVD's ``time_stack`` segments ``tmix1``/``tmix2`` and its ``out``, whose conv mixes time)."""


def module_at(dec: Any, path: str) -> Any:
    """The submodule of ``dec`` at a dotted ``path`` (integer parts index lists); ``""``: ``dec``."""
    m = dec
    for part in path.split(".") if path else ():
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


def block_shortcut(blk: Any) -> tuple[Any, int]:
    """(shortcut module of a resnet block, or None for the identity; its halo)."""
    if blk.conv1.in_channels == blk.conv2.out_channels:
        return None, 0
    if getattr(blk, "use_conv_shortcut", False):
        return blk.conv_shortcut, 1
    return blk.nin_shortcut, 0


class _Builder:
    """Segments in execution order and the path of the GroupNorm consuming each activation, built by the
    decoder's and the encoder's walks (:func:`_build_segments`, :func:`_build_encoder_segments`)."""

    def __init__(self, cur: str, recompute: bool, level_scale: int) -> None:
        self.segs: list[SegmentInfo] = []
        self.consumer: dict[str, str] = {}
        self.cur = cur
        self.n = 0
        self.scale = level_scale
        self.frames = 1
        self.recompute = recompute
        self.batch_norms: set[str] = set()

    def add(self, name: str, kind: str, inputs: tuple[str, ...], output: str, stored: bool, cin: int,
            cout: int, halo: int, module: str, *, up: int = 1, residual: int = 0,
            inplace_of: str | None = None, shortcut_output: str | None = None, residual_halo: int = 0,
            stride: int = 1, tscale: int = 1, whole_batch: bool = False) -> None:
        self.segs.append(SegmentInfo(name, kind, inputs, output, stored, cin, cout, up, self.scale, halo,
                                     residual, inplace_of, residual_halo, shortcut_output, module, stride,
                                     self.frames, tscale, whole_batch))

    def block(self, blk: Any, prefix: str) -> None:
        """The segments of one resnet block reading ``self.cur``; ``self.cur`` becomes its output."""
        cur, n = self.cur, self.n
        cin, cout = int(blk.conv1.in_channels), int(blk.conv2.out_channels)
        self.consumer[cur] = f"{prefix}.norm1"
        h_name, y_name = f"h{n}", f"a{n + 1}"
        self.consumer[h_name] = f"{prefix}.norm2"
        self.n += 1
        sc, sc_halo = block_shortcut(blk)
        if sc is None:
            # Stores: x (overwritten by y in place) + h: two activations, no recomputation.
            self.add(f"{prefix}.conv1", "conv1", (cur,), h_name, True, cin, cout, 1, prefix)
            self.add(f"{prefix}.conv2", "conv2", (h_name, cur), y_name, True, cout, cout, 1, prefix,
                     residual=cin, inplace_of=cur)
        elif self.recompute:
            # conv1 runs once for norm2's statistics only; conv12 recomputes it with a 2-px halo.
            # Stores: x + y.
            self.add(f"{prefix}.conv1", "conv1", (cur,), h_name, False, cin, cout, 1, prefix)
            self.add(f"{prefix}.conv12", "conv12", (cur,), y_name, True, cin, cout, 2, prefix, residual=cin,
                     residual_halo=sc_halo)
        else:
            # conv1 also writes s = shortcut(x) at its cores, so x dies with it (its rows are freed
            # as conv1's tiles pass); conv2 writes y = s + conv2(...) over s. Stores: x -> h + s -> y.
            s_name = f"s{n}"
            self.add(f"{prefix}.conv1", "conv1", (cur,), h_name, True, cin, cout, 1, prefix, residual=cin,
                     shortcut_output=s_name)
            self.add(f"{prefix}.conv2", "conv2", (h_name, s_name), y_name, True, cout, cout, 1, prefix,
                     residual=cout, inplace_of=s_name)
        self.cur = y_name
        if getattr(blk, "time_stack", None) is not None:
            # SVD: time_stack over all frames (tiles of every item), blended with y: written over y in place.
            g_name, m_name = f"g{n}", f"m{n}"
            self.consumer[y_name] = f"{prefix}.time_stack.in_layers.0"
            self.consumer[g_name] = f"{prefix}.time_stack.out_layers.0"
            self.batch_norms.update((f"{prefix}.time_stack.in_layers.0", f"{prefix}.time_stack.out_layers.0"))
            self.add(f"{prefix}.tmix1", "tmix1", (y_name,), g_name, True, cout, cout, 0, prefix, whole_batch=True)
            self.add(f"{prefix}.tmix2", "tmix2", (g_name, y_name), m_name, True, cout, cout, 0, prefix,
                     residual=cout, inplace_of=y_name, whole_batch=True)
            self.cur = m_name


def _build_segments(dec: Any, recompute: bool) -> tuple[list[SegmentInfo], dict[str, str], frozenset[str]]:
    """The decoder's segments in execution order and the path of the GroupNorm consuming each activation."""
    b = _Builder("mid", recompute, 1)
    dims = conv_dims(dec)
    for i, has_upsample in stage_order(dec):
        blocks = dec.up[i].block
        for j in range(len(blocks)):
            b.block(blocks[j], f"up.{i}.block.{j}")
        if has_upsample:
            upsample = dec.up[i].upsample
            c = int(blocks[len(blocks) - 1].conv2.out_channels)
            b.scale *= 2
            ts = time_scale(upsample) if dims == 3 else 1
            if _is_pixel_shuffle_up(upsample, dims):
                # Its 3x3 conv runs at the low resolution: 1 low-res px of context = 2 output px.
                halo, c_out = 2, int(upsample.conv.out_channels) // (4 * ts)
            else:
                halo, c_out = (1 if getattr(upsample, "with_conv", False) else 0), c
            b.frames *= ts
            b.add(f"up.{i}.upsample", "upsample", (b.cur,), f"u{i}", True, c, c_out, halo, f"up.{i}.upsample",
                  up=2, tscale=ts)
            b.cur = f"u{i}"
    if not getattr(dec, "give_pre_end", False):
        b.consumer[b.cur] = "norm_out"
        c_in, c_out = int(dec.conv_out.in_channels), int(dec.conv_out.out_channels)
        if dims == 3:  # a one-frame latent keeps the last decoded frame only (the refiner's forward)
            b.frames = 1
        b.add("out", "out", (b.cur,), "image", True, c_in, c_out, 1, "", whole_batch=time_mixing(dec))
    return b.segs, b.consumer, frozenset(b.batch_norms)


def _build_encoder_segments(enc: Any, recompute: bool) -> tuple[list[SegmentInfo], dict[str, str]]:
    """The encoder's segments (``conv_in`` and the down path; the mid block and the output convolution run
    whole, in the tail) and the GroupNorm consuming each activation but the last (the tail's own)."""
    downs = _downsamples(enc)
    b = _Builder("x", recompute, 2 ** sum(downs))
    ch = int(enc.conv_in.out_channels)
    b.add("in", "in", ("x",), "a0", True, int(enc.conv_in.in_channels), ch, 1, "")
    b.cur = "a0"
    for i, has_down in enumerate(downs):
        blocks = enc.down[i].block
        for j in range(len(blocks)):
            b.block(blocks[j], f"down.{i}.block.{j}")
        if has_down:
            c = int(blocks[len(blocks) - 1].conv2.out_channels)
            down = enc.down[i].downsample
            shuffle = _is_pixel_shuffle_down(down)
            c_out, halo = (int(down.conv.out_channels) * 4, 2) if shuffle else (c, 0)
            b.scale //= 2
            b.add(f"down.{i}.downsample", "downsample", (b.cur,), f"d{i}", True, c, c_out, halo,
                  f"down.{i}.downsample", stride=2)
            b.cur = f"d{i}"
    b.consumer.pop(b.cur, None)
    return b.segs, b.consumer


# --------------------------------------------------------------------------------------------------
# Row bands and reads


def read_span(info: SegmentInfo, name: str, a: int, b: int, n_in: int) -> tuple[int, int]:
    """Px ``[a', b')`` along one axis of input ``name`` (``n_in`` px) that a tile of segment ``info`` with
    core ``[a, b)`` reads: core + halo, clipped (for ``upsample``: the low-resolution px). An input the
    segment writes over in place is read at the core only."""
    halo = 0 if name == info.inplace_of else info.halo
    if info.kind == "upsample":
        return max(0, (a - halo) // 2), min(n_in, (b - 1 + halo) // 2 + 1)
    if info.kind == "downsample" and halo:  # conv at the input resolution, then whole 2x2 cells (Hunyuan Image)
        return max(0, 2 * a - halo), min(n_in, 2 * b + halo)
    if info.kind == "downsample":
        return 2 * a, min(n_in, 2 * b + 1)
    return max(0, a - halo), min(n_in, b + halo)


def bands_in(rows: Sequence[tuple[int, int]], a: int, b: int, starts: Sequence[int] | None = None) -> range:
    """Indices of the bands ``rows`` (sorted, contiguous; ``starts``: their first rows) that intersect
    rows ``[a, b)``."""
    if starts is None:
        starts = [r[0] for r in rows]
    return range(max(0, bisect.bisect_right(starts, a) - 1), bisect.bisect_left(starts, b))


BAND_TAIL = 2
"""Rows at the bottom of each band kept as a band of their own: the halo the next row of tiles reads
(at most 2 px at the same resolution, 1 low-resolution row for an upsample), so the rest of a band is
released as soon as its own row of tiles is done."""


def band_rows(h: int, tile_h: int) -> list[tuple[int, int]]:
    """Bands of an activation of ``h`` rows written by tiles ``tile_h`` px high: every tile row, its
    bottom ``BAND_TAIL`` rows split off (except the last row's)."""
    rows = split_even(h, tile_h)
    out: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(rows):
        if i + 1 < len(rows) and b - a > BAND_TAIL:
            out += [(a, b - BAND_TAIL), (b - BAND_TAIL, b)]
        else:
            out.append((a, b))
    return out


def dying_inputs(info: SegmentInfo, k: int, last_use: Mapping[str, int]) -> tuple[str, ...]:
    """Inputs whose rows segment ``k`` releases as its tiles pass (last read here, not written over)."""
    return tuple(n for n in info.inputs if last_use.get(n) == k and n != info.inplace_of)


def whole_output(info: SegmentInfo, k: int, n_segments: int) -> bool:
    """The returned activation (the image, or the last one with ``give_pre_end``) is one tensor."""
    return info.output == "image" or k == n_segments - 1


def axis_extents(info: SegmentInfo, n_out: int, tile: int) -> list[tuple[int, int, int]]:
    """``(start, core length, input extent)`` of every tile along one axis of segment ``info``'s output
    (``n_out`` px); input extent: px of the segment's first input read (:func:`read_span`)."""
    n_in = n_out // 2 if info.kind == "upsample" else n_out * info.stride
    out = []
    for a, b in split_even(n_out, tile):
        lo, hi = read_span(info, info.inputs[0], a, b, n_in)
        out.append((a, b - a, hi - lo))
    return out


@dataclasses.dataclass(frozen=True)
class RowStep:
    """One row of tiles of one segment, one batch item, as the executor runs it (no OOM shrink)."""

    live: int
    """Store elements alive while the row runs: its output bands allocated, the input bands that rows
    above released already gone."""
    core_rows: int
    in_rows: int
    """Rows of the segment's first input read (core + halo, clipped; low-resolution rows for ``upsample``)."""
    copies: int
    """How many of a tile's reads (halo input, in-place residual, ``conv12``'s shortcut) span two or more
    bands, so are assembled into a new tensor (a read inside one band is a view of the store when the
    store is on the compute device)."""


def _reads(info: SegmentInfo, y0: int, y1: int, n_in: int) -> list[tuple[str, int, int]]:
    """``(input, first row, end row)`` of every read of a tile of ``info`` with core rows ``[y0, y1)``."""
    x = info.inputs[0]
    reads = [(x, *read_span(info, x, y0, y1, n_in))]
    if info.kind == "conv2":
        reads.append((info.inputs[1], y0, y1))
    elif info.kind == "conv12":
        reads.append((x, max(0, y0 - info.residual_halo), min(n_in, y1 + info.residual_halo)))
    return reads


class _SimEntry:
    """Bands of one simulated activation; ``live[0]`` is the running total of all live elements."""

    def __init__(self, c: int, w: int, rows: list[tuple[int, int]], alive: bool, live: list[int]) -> None:
        self.c, self.w, self.rows, self.live = c, w, rows, live
        self.starts = [r[0] for r in rows]
        self.released = 0  # bands below this index are released (the simulation runs in raster order)
        self.alive = [alive] * len(rows)
        if alive:
            live[0] += c * w * sum(r1 - r0 for r0, r1 in rows)

    def set(self, j: int, alive: bool) -> None:
        if self.alive[j] != alive:
            self.alive[j] = alive
            r0, r1 = self.rows[j]
            self.live[0] += (1 if alive else -1) * self.c * (r1 - r0) * self.w


# --------------------------------------------------------------------------------------------------
# The layout


@dataclasses.dataclass(frozen=True)
class KlLayout:
    """One KL decoder (or encoder) as the exact executor runs it (one ``recompute`` variant); ``reason``: why
    it is not supported (then nothing else is filled in)."""

    reason: str | None
    recompute: bool = False
    direction: str = "decode"
    """``decode``: the whole part (mid block) first, then the segments; ``encode``: the segments, then the
    whole tail (mid block, output convolution and the host's own regularizer) on the latent-resolution map."""
    pre_scale: int = 1
    """Mid-block resolution / latent resolution (2 for Flux-2 style latent batch-norm + pixel shuffle)."""
    dims: int = 2
    """3: a decoder of 3-D convolutions over a ``(B, C, T, h, w)`` latent (:func:`whole_clip_3d`): every tile holds
    all frames, and a one-frame latent keeps only the last decoded frame. The store schedule and the cost
    model's geometry are those of a one-frame latent (:attr:`SegmentInfo.frames`), the case the image decode
    plans (a clip of several frames decodes exactly, unplanned)."""
    video: bool = False
    """The decoder mixes its batch as one video's frames (:func:`time_mixing`, SVD): the whole batch is one decode,
    the mid block runs once on it, and the :attr:`SegmentInfo.whole_batch` segments tile every item together."""
    batch_norms: frozenset[str] = frozenset()
    """GroupNorms whose statistics span the whole batch (SVD's ``time_stack`` norms over all frames)."""
    in_repeats: int = 0
    """Channel repeats of the latent added to ``conv_in``'s output (:func:`in_shortcut_repeats`); 0: none."""
    mid_channels: int = 0
    levels: int = 0
    """Resolutions of the up path (upsamples + 1)."""
    tanh_out: bool = False
    segments: tuple[SegmentInfo, ...] = ()
    consumer: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Activation -> path (:func:`module_at`) of the GroupNorm that reads it."""
    last_use: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Activation -> index of the last segment reading it."""

    def require(self) -> KlLayout:
        if self.reason is not None:
            raise ValueError(f"exact tiled {self.direction} does not support this model: {self.reason}")
        return self

    @property
    def ratio(self) -> int:
        """Image px per latent px: ``2^(levels - 1)`` times :attr:`pre_scale`."""
        return 2 ** (max(1, self.levels) - 1) * self.pre_scale

    def mid_hw(self, latent_hw: Sequence[int]) -> tuple[int, int]:
        return int(latent_hw[0]) * self.pre_scale, int(latent_hw[1]) * self.pre_scale

    def segment_hw(self, info: SegmentInfo, latent_hw: Sequence[int]) -> tuple[int, int]:
        """Output size of segment ``info`` for a latent of ``latent_hw``."""
        mh, mw = self.mid_hw(latent_hw)
        return mh * info.level_scale, mw * info.level_scale

    def tile_counts(self, latent_hw: Sequence[int], tile: int | tuple[int, int]) -> tuple[int, ...]:
        """Tiles of every segment, one batch item."""
        return tuple(tile_count(*self.segment_hw(s, latent_hw), tile) for s in self.segments)

    def steps(self, latent_hw: Sequence[int], tile: int | tuple[int, int]) -> int:
        """Progress units of one batch item's uninterrupted decode: the mid block, then every tile."""
        return 1 + sum(self.tile_counts(latent_hw, tile))

    def bind(self, model: Any) -> BoundLayout:
        """This layout in ``model``: its decoder (encoder) and the modules the layout names, each segment's and each
        consumer's."""
        dec = find_decoder(model) if self.direction == "decode" else model.encoder
        return BoundLayout(self, model, dec, [module_at(dec, info.module) for info in self.segments],
                           {name: module_at(dec, path) for name, path in self.consumer.items()})

    def schedule(self, latent_hw: Sequence[int], tile: tuple[int, int]) -> list[list[RowStep]]:
        """Per segment, per row of tiles: the live store and the reads of one batch item (see
        :func:`store_schedule`; decode only: an encode's cost model is not built yet)."""
        if self.direction != "decode":
            raise NotImplementedError("the store schedule of an exact encode (its cost model) is not built")
        return self._schedule(self.mid_hw(latent_hw), tile)

    def units(self, latent_hw: Sequence[int], tile: tuple[int, int]) -> Iterator[tuple[int, int, int, int, int]]:
        """``(segment index, in_px, core_px, copies, live store elements)`` of every tile unit of one batch
        item, in execution order (rows of tiles, left to right)."""
        for k, (info, steps) in enumerate(zip(self.segments, self.schedule(latent_hw, tile), strict=True)):
            cols = axis_extents(info, self.segment_hw(info, latent_hw)[1], tile[1])
            for st in steps:
                for _, cw, iw in cols:
                    yield k, st.in_rows * iw, st.core_rows * cw, st.copies, st.live

    def _schedule(self, mid_hw: Sequence[int], tile: tuple[int, int]) -> list[list[RowStep]]:
        segs = self.segments
        mh, mw = int(mid_hw[0]), int(mid_hw[1])
        live = [0]
        entries: dict[str, _SimEntry] = {"mid": _SimEntry(self.mid_channels, mw, [(0, mh)], True, live)}
        hw: dict[str, tuple[int, int]] = {"mid": (mh, mw)}
        out: list[list[RowStep]] = []
        for k, info in enumerate(segs):
            hi, wi = hw[info.inputs[0]]
            ho, wo = hi * info.scale, wi * info.scale
            hw[info.output] = (ho, wo)
            tile_rows = split_even(ho, tile[0])
            bands = band_rows(ho, tile[0])
            fresh: list[_SimEntry] = []
            if info.inplace_of is not None:
                entries[info.output] = entries[info.inplace_of]
            elif info.store_output:
                e = _SimEntry(info.out_channels * info.frames, wo, bands, whole_output(info, k, len(segs)), live)
                entries[info.output] = e
                fresh.append(e)
            if info.shortcut_output is not None:
                hw[info.shortcut_output] = (ho, wo)
                e = _SimEntry(info.out_channels * info.frames, wo, bands, False, live)
                entries[info.shortcut_output] = e
                fresh.append(e)
            dying = dying_inputs(info, k, self.last_use)
            steps = []
            for i, (y0, y1) in enumerate(tile_rows):
                for e in fresh:
                    for j in bands_in(e.rows, y0, y1, e.starts):
                        e.set(j, True)
                a, b = read_span(info, info.inputs[0], y0, y1, hi)
                copies = sum(len(bands_in(entries[n].rows, ra, rb, entries[n].starts)) > 1
                             for n, ra, rb in _reads(info, y0, y1, hi))
                steps.append(RowStep(live[0], y1 - y0, b - a, copies))
                for name in dying:
                    e = entries[name]
                    low = read_span(info, name, *tile_rows[i + 1], hi)[0] if i + 1 < len(tile_rows) else 1 << 62
                    while e.released < len(e.rows) and e.rows[e.released][1] <= low:
                        e.set(e.released, False)
                        e.released += 1
            for name in info.inputs:
                if self.last_use.get(name) == k:
                    e = entries.pop(name)
                    if all(other is not e for other in entries.values()):  # not aliased by an in-place output
                        for j in range(len(e.rows)):
                            e.set(j, False)
            out.append(steps)
        return out

    def geometry(self, latent_shape: Sequence[int], tile: tuple[int, int]) -> ExactGeometry:
        """The segments, step counts and sizes of one decode of a ``(B, C, h, w)`` latent."""
        self.require()
        b, c, lh, lw = (int(s) for s in latent_shape)
        tile = pair(tile)
        mid_hw = self.mid_hw((lh, lw))
        store_peak = self.mid_channels * mid_hw[0] * mid_hw[1]
        store_peak_seg = "mid"
        cores: list[tuple[int, int]] = []
        for info, steps in zip(self.segments, self.schedule((lh, lw), tile), strict=True):
            total = max(st.live for st in steps)
            if total > store_peak:
                store_peak, store_peak_seg = total, info.name
            h_out, w_out = self.segment_hw(info, (lh, lw))
            cores.append((max(p[1] - p[0] for p in split_even(h_out, tile[0])),
                          max(p[1] - p[0] for p in split_even(w_out, tile[1]))))
        tiles = self.tile_counts((lh, lw), tile)
        last = self.segments[-1] if self.segments else None
        out_c = last.out_channels if last else self.mid_channels
        out_hw = self.segment_hw(last, (lh, lw)) if last else mid_hw
        return ExactGeometry(
            latent_shape=(b, c, lh, lw),
            tile=tile,
            recompute=self.recompute,
            segments=self.segments,
            tiles_per_segment=tiles,
            mid_steps=b,
            total_steps=b * self.steps((lh, lw), tile),
            store_peak_elements=b * store_peak,
            store_peak_segment=store_peak_seg,
            mid_elements=self.mid_channels * mid_hw[0] * mid_hw[1],
            segment_cores=tuple(cores),
            out_channels=out_c,
            out_hw=out_hw,
        )


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class BoundLayout:
    """A :class:`KlLayout` bound to one model (:meth:`KlLayout.bind`): what the exact executor runs."""

    layout: KlLayout
    model: Any
    """The ``first_stage_model`` (or bare ``Decoder``) the layout was walked from."""
    dec: Any
    """Its decoder (encoder)."""
    segments: list[Any]
    """Each segment's module."""
    consumer: dict[str, Any]
    """Activation -> the GroupNorm module that reads it."""


def _walk(model: Any, recompute: bool, direction: str = "decode") -> KlLayout:
    if direction == "encode":
        return _walk_encoder(model, recompute)
    reason = _structure_reason(model)
    if reason is not None:
        return KlLayout(reason, recompute)
    dec = find_decoder(model)
    segs, consumer, batch_norms = _build_segments(dec, recompute)
    last_use: dict[str, int] = {}
    for k, s in enumerate(segs):
        for name in s.inputs:
            last_use[name] = k
    return KlLayout(
        reason=None,
        recompute=recompute,
        pre_scale=2 if isinstance(getattr(model, "bn", None), torch.nn.BatchNorm2d) else 1,
        dims=conv_dims(dec),
        video=time_mixing(dec),
        batch_norms=batch_norms,
        in_repeats=in_shortcut_repeats(dec),
        mid_channels=int(dec.conv_in.out_channels),
        levels=1 + sum(s.kind == "upsample" for s in segs),
        tanh_out=bool(getattr(dec, "tanh_out", False)),
        segments=tuple(segs),
        consumer=consumer,
        last_use=last_use,
    )


def _walk_encoder(model: Any, recompute: bool) -> KlLayout:
    reason = _encoder_reason(model)
    if reason is not None:
        return KlLayout(reason, recompute, "encode")
    enc = model.encoder
    segs, consumer = _build_encoder_segments(enc, recompute)
    last_use: dict[str, int] = {}
    for k, s in enumerate(segs):
        for name in s.inputs:
            last_use[name] = k
    return KlLayout(
        reason=None,
        recompute=recompute,
        direction="encode",
        pre_scale=2 if isinstance(getattr(model, "bn", None), torch.nn.BatchNorm2d) else 1,
        mid_channels=int(enc.conv_out.in_channels),
        levels=1 + sum(_downsamples(enc)),
        segments=tuple(segs),
        consumer=consumer,
        last_use=last_use,
    )


def kl_layout(model: Any, recompute: bool = False, direction: str = "decode") -> KlLayout:
    """The layout of ``model`` (``first_stage_model`` or its ``Decoder``; ``direction="encode"``: the
    ``first_stage_model``'s encoder), walked once per model object, ``recompute`` variant and direction (a
    model's structure does not change)."""
    try:
        cached = _LAYOUTS.get(model)
    except TypeError:  # not weak-referenceable or not hashable: walked every time
        return _walk(model, recompute, direction)
    if cached is None:
        cached = {}
        _LAYOUTS[model] = cached
    key = recompute if direction == "decode" else (recompute, direction)
    found = cached.get(key)
    if found is None:
        found = cached[key] = _walk(model, recompute, direction)
    return found


def store_schedule(model: Any, mid_hw: Sequence[int], tile: tuple[int, int],
                   recompute: bool = False) -> list[list[RowStep]]:
    """Per segment, per row of tiles: the store's live elements and the reads of one batch item of
    ``decode_exact`` (``mid_hw``: resolution of the mid block's output), mirroring the executor's band
    allocation and release (output bands are the segment's tile rows, allocated when a row starts; an
    input's bands are released once no remaining tile of the segment reads them and no later segment
    needs the activation)."""
    return kl_layout(model, recompute).require()._schedule(mid_hw, pair(tile))


# --------------------------------------------------------------------------------------------------
# Plan


@dataclasses.dataclass(frozen=True)
class ExactGeometry:
    """Geometry of one exact decode: segments, steps, store and per-tile sizes (elements)."""

    latent_shape: tuple[int, int, int, int]
    tile: tuple[int, int]
    recompute: bool
    segments: tuple[SegmentInfo, ...]
    tiles_per_segment: tuple[int, ...]
    """Per batch item."""
    mid_steps: int
    total_steps: int
    store_peak_elements: int
    """Largest sum of store elements alive at once (row bands, see :func:`store_schedule`), per batch item
    times the batch: an upper bound for the whole batch."""
    store_peak_segment: str
    mid_elements: int
    """Largest activation of the whole-latent mid block for one batch item (mid res x channels)."""
    segment_cores: tuple[tuple[int, int], ...]
    """Largest tile core (h, w) of each segment (px at the segment's output resolution)."""
    out_channels: int
    out_hw: tuple[int, int]



def exact_geometry(model: Any, latent_shape: Sequence[int], tile: tuple[int, int], recompute: bool = False) -> ExactGeometry:
    """The segments, step counts and sizes of ``decode_exact(model, z, tile, recompute=...)``."""
    return kl_layout(model, recompute).geometry(latent_shape, tile)
