"""Exact, single-pass tiled decode for GroupNorm KL decoders (SD1.x/SD2/SDXL 4 ch, SD3/Flux 16 ch).

Why the usual tiled decode is not exact
---------------------------------------
A KL decoder normalises every activation with GroupNorm, whose statistics (mean and variance per
batch item and channel group) are taken over the *whole* image, and its mid block holds a global
self-attention. Decoding tiles independently gives every tile its own statistics and its own
attention context, so tiles come out with visibly different brightness and contrast (ComfyUI's
``VAEDecodeTiled`` hides that by decoding three times with shifted grids and averaging).

The scheme here (layer-synchronous tiling)
------------------------------------------
1. ``post_quant_conv`` (and the latent batch-norm of Flux 2 style models) + ``conv_in`` + the mid
   block (``block_1``, the global ``attn_1``, ``block_2``) run once per batch item on the whole
   latent: the latent is small, and the attention sees everything, exactly as in the untiled decode.
2. The up path is cut into *segments* at every GroupNorm. A segment reads full-size activations
   from a *store* and writes one new full-size activation:

   ============ ============================================ =========================== ========
   kind         computes                                     reads (halo, input px)       writes
   ============ ============================================ =========================== ========
   ``conv1``    ``conv1(silu(norm1(x)))``; channel-changing  ``x`` (1)                    ``h`` (+ ``s``)
                blocks also ``s = shortcut(x)`` at the core
   ``conv2``    ``s + conv2(silu(norm2(h)))`` (``s = x``     ``h`` (1), ``s`` (core)      ``y`` [#]_
                for an identity shortcut)
   ``conv12``   both halves (``recompute=True``, channel-    ``x`` (2)                    ``y``
                changing blocks: ``h`` is never stored,
                ``conv1`` runs twice)
   ``upsample`` ``upsample.conv(nearest_x2(y))``             ``y`` (1)                    2x res
   ``out``      ``conv_out(silu(norm_out(y)))`` [tanh]       ``y`` (1)                    image
   ============ ============================================ =========================== ========

   .. [#] over ``s`` (``x`` itself when the shortcut is the identity): each tile reads it only at its
      own core, so no other tile needs the overwritten values (in-place residual). Computing
      ``shortcut(x)`` in ``conv1`` (from the same loaded values, same module) lets ``x`` die there.

   A segment runs tile by tile. Each tile reads its region of the input store plus only the halo its
   own convolutions need, computes, and writes its *core* into the output store. The GroupNorm at the
   segment's input uses statistics that were accumulated, tile by tile, from the cores written by
   the previous segment: the cores partition the image exactly, so the statistics are the global
   ones (per-tile ``var_mean`` in float32, merged with Chan's parallel formula in float64).
   GroupNorm is applied as ``x * scale + shift`` per channel with those statistics and the module's
   own affine weight and bias. Every convolution is the decoder's own module (``block.conv1(t)``
   etc.), so ComfyUI's ``comfy.ops`` weight casting and offloading still apply.
3. Result: every output pixel is computed once, from the same inputs as in the untiled decode. The
   only differences are float rounding (order of the statistics reduction, the convolution
   algorithm picked for a tile shape), i.e. float noise, not seams.

Geometry
--------
``tile = (th, tw)``: the largest *core* a tile writes, in pixels of the activation being written,
at that activation's own resolution. At full resolution that is output pixels per tile; the
lower-resolution levels use the same pixel size, so they need fewer tiles (a 2048^2 image with
``tile=(512, 512)``: 16 tiles per full-res segment, 4 at half res, 1 at quarter res). Tiles are
balanced (``ceil(n / t)`` near-equal pieces). A decode is ``B`` mid steps plus, per segment,
``B x tiles(segment)`` tile steps; :func:`plan_exact` lists them.

Memory
------
* Store (``store_device``): every activation is kept in *row bands* (the writing segment's tile
  rows, each with its bottom ``BAND_TAIL`` rows as a band of their own). Tiles run in raster order; an
  output band is allocated when its row of tiles starts, and after each row an input's bands that no
  remaining tile of the segment reads (core + halo) are released, unless a later segment still reads
  that activation (liveness per activation: ``x`` of a resnet block lives until the block's last read
  of it; the in-place residual is never released). A segment therefore holds about max(in, out) + one
  row of tiles instead of in + out. With the SD decoder at output ``H x W`` and ``n`` rows of tiles
  the worst point is the first full-resolution block's ``conv1`` (``x`` 256 ch -> ``h`` + ``s``
  128 + 128 ch) or the upsample before it: ``~256 (n + 1) / n * H * W`` elements (one row of tiles:
  ``(256 + 128 + 128) * H * W``, nothing can be released). :func:`store_schedule` gives the live
  elements of every row of tiles; ``recompute=True`` saves little more (``x`` -> ``y`` 128 ch).
* Compute device: the model, the whole-latent mid block for one batch item, and one tile's
  intermediates (input tile with halo, its normalised float32 copy, the conv outputs). A tile read
  inside one band is a view of the store when the store is on the compute device; a read spanning
  bands (any tile with a halo once a segment has several rows of tiles) is assembled into a new tensor.
* Transfers when the store is on the host: every segment reads its inputs once (+ halo) and writes
  its output once.

Out of memory mid-decode
------------------------
An exception of one of ``oom_exceptions`` (default: ``torch.OutOfMemoryError``, which is CUDA's
``torch.cuda.OutOfMemoryError``; a bare ``Exception`` is dropped, :func:`oom_types`) raised inside a tile is caught, the ``except`` block is left first
(so the failed frame and its tensors are released, as ComfyUI's own ``VAE.decode`` does), ``on_oom``
is called (e.g. ``comfy.model_management.soft_empty_cache``), the tile size is halved, and the
decode resumes: finished segments are kept, and in the current segment the tiles already written
and the statistics recorded for them are kept; only the pending tiles are re-split. A tile counts as
done once its core is written (the last step that can fail), so a tile written over its own input
(in-place residual) is never recomputed. The result equals an uninterrupted run up to float
rounding: the same values enter every statistic, only the grouping of the float64 merge and the
convolution algorithm chosen for the new tile shape can differ. Tests assert max abs diff <= 1e-5 on
[-1, 1] float32 outputs; measured < 1e-6. An OOM outside a tile (whole-latent mid block, allocation
of a store or of a store band, done before its tile starts) is not helped by smaller tiles and
propagates. After an OOM shrink the pending tiles are no longer in strict raster order; band release
only ever uses what the pending tiles still read, so it stays correct (it may release a little later).

``memory/`` never imports ComfyUI: the model is duck-typed (:func:`supports_exact`).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..oom import OomEvent, OomResume

log = logging.getLogger("vramfit.memory.tiled_exact")

EXECUTOR_VERSION = "v1"
"""Version of this executor's allocation pattern, part of every exact cost-model key (shipped and cached).
Bump it when a change alters what the executor holds at its peak, then re-ship ``memory/cost/data/exact``
(``bench/tiled_decode.py --write-defaults``); edits that do not (comments, error handling) keep the key."""

__all__ = [
    "ExactPlan",
    "RowStep",
    "SegmentInfo",
    "count_exact_steps",
    "decode_exact",
    "default_oom_exceptions",
    "estimate_exact_peak",
    "find_decoder",
    "oom_types",
    "plan_exact",
    "split_even",
    "store_schedule",
    "supports_exact",
    "tile_bytes",
    "unsupported_reason",
]

ProgressFn = Callable[[int, int], None]
NormParamsFn = Callable[[Any, torch.Tensor], "tuple[torch.Tensor | None, torch.Tensor | None]"]

MIN_TILE = 8
"""Smallest tile side (px) the OOM fallback shrinks to."""


def default_oom_exceptions() -> tuple[type[BaseException], ...]:
    """``torch.OutOfMemoryError`` (alias of ``torch.cuda.OutOfMemoryError``) where torch has it."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom,) if oom is not None else ()


def oom_types(given: Sequence[type[BaseException]] | None) -> tuple[type[BaseException], ...]:
    """The exception types every executor treats as out-of-memory: ``given`` without a bare
    ``Exception``/``BaseException`` (ComfyUI's ``OOM_EXCEPTION`` without CUDA; catching it would turn a bug
    or a cancel into re-plans), :func:`default_oom_exceptions` when ``given`` is None or held nothing else."""
    if given is None:
        return default_oom_exceptions()
    given = tuple(given)
    kept = tuple(t for t in given if t not in (Exception, BaseException))
    if len(kept) == len(given):
        return kept
    log.debug("ignoring Exception/BaseException as an out-of-memory type")
    return kept or default_oom_exceptions()


# --------------------------------------------------------------------------------------------------
# Geometry


def split_even(n: int, t: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``ceil(n / t)`` near-equal ``(start, end)`` pieces, none longer than ``t``."""
    if n <= 0:
        return []
    t = max(1, int(t))
    k = -(-n // t)
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


@dataclasses.dataclass(frozen=True)
class _Rect:
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


def _grid(b: int, h: int, w: int, tile: tuple[int, int], y0: int = 0, x0: int = 0) -> list[_Rect]:
    return [
        _Rect(b, y0 + a, y0 + c, x0 + d, x0 + e)
        for a, c in split_even(h, tile[0])
        for d, e in split_even(w, tile[1])
    ]


def _tiles_of(h: int, w: int, tile: tuple[int, int]) -> int:
    return -(-h // max(1, tile[0])) * -(-w // max(1, tile[1]))


# --------------------------------------------------------------------------------------------------
# Structure check (duck-typed; no ComfyUI import)


def find_decoder(model: Any) -> Any:
    """The ``Decoder`` of ``first_stage_model`` (``model.decoder``) or ``model`` itself if it is one."""
    dec = getattr(model, "decoder", None)
    return dec if dec is not None else model


def _is_conv2d(m: Any, kernel: int | None = None) -> bool:
    if not isinstance(m, torch.nn.Conv2d):
        return False
    if kernel is not None and tuple(m.kernel_size) != (kernel, kernel):
        return False
    k = m.kernel_size[0]
    return (
        tuple(m.stride) == (1, 1)
        and tuple(m.dilation) == (1, 1)
        and m.groups == 1
        and m.padding_mode == "zeros"
        and tuple(m.padding) == (k // 2, k // 2)
        and m.kernel_size[0] == m.kernel_size[1]
    )


def _is_gn(m: Any) -> bool:
    return isinstance(m, torch.nn.GroupNorm)


def _resnet_reason(blk: Any, where: str) -> str | None:
    for name in ("norm1", "conv1", "norm2", "conv2"):
        if getattr(blk, name, None) is None:
            return f"{where}: no {name}"
    if not (_is_gn(blk.norm1) and _is_gn(blk.norm2)):
        return f"{where}: norm1/norm2 are not GroupNorm"
    if not (_is_conv2d(blk.conv1, 3) and _is_conv2d(blk.conv2, 3)):
        return f"{where}: conv1/conv2 are not 3x3 stride-1 Conv2d"
    if getattr(blk, "temb_proj", None) is not None:
        return f"{where}: has a timestep projection"
    cin = blk.conv1.in_channels
    cout = blk.conv2.out_channels
    if cin != cout:
        sc = getattr(blk, "nin_shortcut", None)
        if getattr(blk, "use_conv_shortcut", False):
            sc = getattr(blk, "conv_shortcut", None)
            if not _is_conv2d(sc, 3):
                return f"{where}: conv_shortcut is not a 3x3 Conv2d"
        elif not _is_conv2d(sc, 1):
            return f"{where}: nin_shortcut is not a 1x1 Conv2d"
    return None


def unsupported_reason(model: Any) -> str | None:
    """Why :func:`decode_exact` cannot run ``model`` (a ``first_stage_model`` or a ``Decoder``), or None."""
    if getattr(model, "bn", None) is not None and not isinstance(
        getattr(model, "bn", None), torch.nn.BatchNorm2d
    ):
        return "latent batch-norm of an unknown kind"
    dec = find_decoder(model)
    if dec is None:
        return "no decoder"
    for name in ("conv_in", "mid", "up", "norm_out", "conv_out"):
        if getattr(dec, name, None) is None:
            return f"decoder has no {name}"
    if not (_is_conv2d(dec.conv_in, 3) and _is_conv2d(dec.conv_out, 3)):
        return "conv_in/conv_out are not 3x3 Conv2d (3-D or video decoder)"
    if not _is_gn(dec.norm_out):
        return "norm_out is not GroupNorm"
    mid = dec.mid
    for name in ("block_1", "attn_1", "block_2"):
        if getattr(mid, name, None) is None:
            return f"mid has no {name}"
    if not callable(mid.block_1) or not callable(mid.attn_1) or not callable(mid.block_2):
        return "mid blocks are not callable"
    up = dec.up
    try:
        levels = len(up)
    except TypeError:
        return "decoder.up is not a list"
    if levels == 0:
        return "decoder.up is empty"
    for i in range(levels):
        level = up[i]
        blocks = getattr(level, "block", None)
        if blocks is None or len(blocks) == 0:
            return f"up[{i}] has no blocks"
        if len(getattr(level, "attn", ())) > 0:
            return f"up[{i}] has attention in the up path"
        for j in range(len(blocks)):
            reason = _resnet_reason(blocks[j], f"up[{i}].block[{j}]")
            if reason:
                return reason
        if i > 0:
            upsample = getattr(level, "upsample", None)
            if upsample is None:
                return f"up[{i}] has no upsample"
            sf = getattr(upsample, "scale_factor", None)
            if isinstance(sf, (tuple, list)):
                if len(sf) != 2 or any(float(s) != 2.0 for s in sf):
                    return f"up[{i}].upsample scale {sf} is not 2x2"
            elif sf is None or float(sf) != 2.0:
                return f"up[{i}].upsample scale {sf} is not 2"
            if getattr(upsample, "with_conv", False) and not _is_conv2d(getattr(upsample, "conv", None), 3):
                return f"up[{i}].upsample.conv is not a 3x3 Conv2d"
    if not isinstance(getattr(dec, "give_pre_end", False), bool) or not isinstance(
        getattr(dec, "tanh_out", False), bool
    ):
        return "give_pre_end/tanh_out are not booleans"
    return None


def supports_exact(model: Any) -> bool:
    """True when ``model`` (``first_stage_model`` or its ``Decoder``) has the KL 2-D GroupNorm structure."""
    reason = unsupported_reason(model)
    if reason is not None:
        log.debug("exact tiled decode not supported: %s", reason)
    return reason is None


# --------------------------------------------------------------------------------------------------
# Plan


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """One segment of the up path (see the module docstring for the kinds)."""

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
    """Output resolution / latent resolution."""
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


@dataclasses.dataclass(frozen=True)
class ExactPlan:
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
    """Largest activation of the whole-latent mid block for one batch item (latent res x channels)."""
    segment_cores: tuple[tuple[int, int], ...]
    """Largest tile core (h, w) of each segment (px at the segment's output resolution)."""
    out_channels: int
    out_hw: tuple[int, int]

    def tile_bytes(self, dtype_bytes: int, inputs_copied: bool = True) -> int:
        """Largest per-tile working set on the compute device over all segments (see :func:`tile_bytes`)."""
        return max(
            (tile_bytes(info, core, dtype_bytes, inputs_copied) for info, core in zip(
                self.segments, self.segment_cores, strict=True)),
            default=0,
        )


@dataclasses.dataclass
class _Seg:
    info: SegmentInfo
    block: Any = None
    module: Any = None


def _block_channels(blk: Any) -> tuple[int, int]:
    return int(blk.conv1.in_channels), int(blk.conv2.out_channels)


def _shortcut(blk: Any) -> tuple[Any, int]:
    """(shortcut module or None, its halo)."""
    if blk.conv1.in_channels == blk.conv2.out_channels:
        return None, 0
    if getattr(blk, "use_conv_shortcut", False):
        return blk.conv_shortcut, 1
    return blk.nin_shortcut, 0


def _build_segments(dec: Any, recompute: bool) -> tuple[list[_Seg], dict[str, Any], str]:
    """Segments in execution order, the GroupNorm consuming each activation, the mid output's name."""
    segs: list[_Seg] = []
    consumer: dict[str, Any] = {}
    cur = "mid"
    n = 0
    scale = 1

    def add(name: str, kind: str, inputs: tuple[str, ...], output: str, stored: bool, cin: int, cout: int,
            halo: int, *, block: Any = None, module: Any = None, up: int = 1, residual: int = 0,
            inplace_of: str | None = None, shortcut_output: str | None = None, residual_halo: int = 0) -> None:
        info = SegmentInfo(name, kind, inputs, output, stored, cin, cout, up, scale, halo, residual, inplace_of,
                           residual_halo, shortcut_output)
        segs.append(_Seg(info, block=block, module=module))

    for i in reversed(range(len(dec.up))):
        blocks = dec.up[i].block
        for j in range(len(blocks)):
            blk = blocks[j]
            cin, cout = _block_channels(blk)
            consumer[cur] = blk.norm1
            h_name, y_name = f"h{n}", f"a{n + 1}"
            consumer[h_name] = blk.norm2
            n += 1
            prefix = f"up.{i}.block.{j}"
            identity = _shortcut(blk)[0] is None
            if identity:
                # Stores: x (overwritten by y in place) + h: two activations, no recomputation.
                add(f"{prefix}.conv1", "conv1", (cur,), h_name, True, cin, cout, 1, block=blk)
                add(f"{prefix}.conv2", "conv2", (h_name, cur), y_name, True, cout, cout, 1, block=blk,
                    residual=cin, inplace_of=cur)
            elif recompute:
                # conv1 runs once for norm2's statistics only; conv12 recomputes it with a 2-px halo.
                # Stores: x + y.
                add(f"{prefix}.conv1", "conv1", (cur,), h_name, False, cin, cout, 1, block=blk)
                add(f"{prefix}.conv12", "conv12", (cur,), y_name, True, cin, cout, 2, block=blk, residual=cin,
                    residual_halo=_shortcut(blk)[1])
            else:
                # conv1 also writes s = shortcut(x) at its cores, so x dies with it (its rows are freed
                # as conv1's tiles pass); conv2 writes y = s + conv2(...) over s. Stores: x -> h + s -> y.
                s_name = f"s{n}"
                add(f"{prefix}.conv1", "conv1", (cur,), h_name, True, cin, cout, 1, block=blk, residual=cin,
                    shortcut_output=s_name)
                add(f"{prefix}.conv2", "conv2", (h_name, s_name), y_name, True, cout, cout, 1, block=blk,
                    residual=cout, inplace_of=s_name)
            cur = y_name
        if i > 0:
            upsample = dec.up[i].upsample
            c = _block_channels(blocks[len(blocks) - 1])[1]
            scale *= 2
            halo = 1 if getattr(upsample, "with_conv", False) else 0
            add(f"up.{i}.upsample", "upsample", (cur,), f"u{i}", True, c, c, halo, module=upsample, up=2)
            cur = f"u{i}"
    if not getattr(dec, "give_pre_end", False):
        consumer[cur] = dec.norm_out
        c_in, c_out = int(dec.conv_out.in_channels), int(dec.conv_out.out_channels)
        add("out", "out", (cur,), "image", True, c_in, c_out, 1, module=dec)
    return segs, consumer, "mid"


def _read_rows(info: SegmentInfo, name: str, y0: int, y1: int, n_in: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of input ``name`` (``n_in`` rows) that a tile of segment ``info`` with core rows
    ``[y0, y1)`` reads: core + halo, clipped (for ``upsample``: the low-resolution rows). An input the
    segment writes over in place is read at the core only."""
    halo = 0 if name == info.inplace_of else info.halo
    if info.kind == "upsample":
        return max(0, (y0 - halo) // 2), min(n_in, (y1 - 1 + halo) // 2 + 1)
    return max(0, y0 - halo), min(n_in, y1 + halo)


def _bands_in(rows: Sequence[tuple[int, int]], a: int, b: int, starts: Sequence[int] | None = None) -> range:
    """Indices of the bands ``rows`` (sorted, contiguous; ``starts``: their first rows) that intersect
    rows ``[a, b)``."""
    if starts is None:
        starts = [r[0] for r in rows]
    return range(max(0, bisect.bisect_right(starts, a) - 1), bisect.bisect_left(starts, b))


BAND_TAIL = 2
"""Rows at the bottom of each band kept as a band of their own: the halo the next row of tiles reads
(at most 2 px at the same resolution, 1 low-resolution row for an upsample), so the rest of a band is
released as soon as its own row of tiles is done."""


def _band_rows(h: int, tile_h: int) -> list[tuple[int, int]]:
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


def _dying(info: SegmentInfo, k: int, last_use: dict[str, int]) -> tuple[str, ...]:
    """Inputs whose rows segment ``k`` releases as its tiles pass (last read here, not written over)."""
    return tuple(n for n in info.inputs if last_use.get(n) == k and n != info.inplace_of)


def _whole_output(info: SegmentInfo, k: int, n_segments: int) -> bool:
    """The returned activation (the image, or the last one with ``give_pre_end``) is one tensor."""
    return info.output == "image" or k == n_segments - 1


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
    reads = [(x, *_read_rows(info, x, y0, y1, n_in))]
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


def store_schedule(
    model: Any, mid_hw: Sequence[int], tile: tuple[int, int], recompute: bool = False
) -> list[list[RowStep]]:
    """Per segment, per row of tiles: the store's live elements and the reads of one batch item of
    ``decode_exact`` (``mid_hw``: resolution of the mid block's output), mirroring the executor's band
    allocation and release (output bands are the segment's tile rows, allocated when a row starts; an
    input's bands are released once no remaining tile of the segment reads them and no later segment
    needs the activation)."""
    dec = find_decoder(model)
    tile = _norm_tile(tile)
    segs, _, _ = _build_segments(dec, recompute)
    mh, mw = int(mid_hw[0]), int(mid_hw[1])
    live = [0]
    entries: dict[str, _SimEntry] = {"mid": _SimEntry(int(dec.conv_in.out_channels), mw, [(0, mh)], True, live)}
    hw: dict[str, tuple[int, int]] = {"mid": (mh, mw)}
    last_use: dict[str, int] = {}
    for k, s in enumerate(segs):
        for name in s.info.inputs:
            last_use[name] = k
    out: list[list[RowStep]] = []
    for k, s in enumerate(segs):
        info = s.info
        hi, wi = hw[info.inputs[0]]
        ho, wo = hi * info.scale, wi * info.scale
        hw[info.output] = (ho, wo)
        tile_rows = split_even(ho, tile[0])
        bands = _band_rows(ho, tile[0])
        fresh: list[_SimEntry] = []
        if info.inplace_of is not None:
            entries[info.output] = entries[info.inplace_of]
        elif info.store_output:
            e = _SimEntry(info.out_channels, wo, bands, _whole_output(info, k, len(segs)), live)
            entries[info.output] = e
            fresh.append(e)
        if info.shortcut_output is not None:
            hw[info.shortcut_output] = (ho, wo)
            e = _SimEntry(info.out_channels, wo, bands, False, live)
            entries[info.shortcut_output] = e
            fresh.append(e)
        dying = _dying(info, k, last_use)
        steps = []
        for i, (y0, y1) in enumerate(tile_rows):
            for e in fresh:
                for j in _bands_in(e.rows, y0, y1, e.starts):
                    e.set(j, True)
            a, b = _read_rows(info, info.inputs[0], y0, y1, hi)
            copies = sum(len(_bands_in(entries[n].rows, ra, rb, entries[n].starts)) > 1
                         for n, ra, rb in _reads(info, y0, y1, hi))
            steps.append(RowStep(live[0], y1 - y0, b - a, copies))
            for name in dying:
                e = entries[name]
                low = _read_rows(info, name, *tile_rows[i + 1], hi)[0] if i + 1 < len(tile_rows) else 1 << 62
                while e.released < len(e.rows) and e.rows[e.released][1] <= low:
                    e.set(e.released, False)
                    e.released += 1
        for name in info.inputs:
            if last_use.get(name) == k:
                e = entries.pop(name)
                if all(other is not e for other in entries.values()):  # not aliased by an in-place output
                    for j in range(len(e.rows)):
                        e.set(j, False)
        out.append(steps)
    return out


def _plan(dec: Any, latent_shape: Sequence[int], tile: tuple[int, int], recompute: bool) -> ExactPlan:
    b, _, lh, lw = (int(s) for s in latent_shape)
    segs, _, _ = _build_segments(dec, recompute)
    mid_c = int(dec.conv_in.out_channels)
    shapes: dict[str, tuple[int, int, int]] = {"mid": (mid_c, lh, lw)}
    tiles: list[int] = []
    store_peak = mid_c * lh * lw
    store_peak_seg = "mid"
    cores: list[tuple[int, int]] = []
    schedule = store_schedule(dec, (lh, lw), tile, recompute)
    for s, steps in zip(segs, schedule, strict=True):
        info = s.info
        c_in, h_in, w_in = shapes[info.inputs[0]]
        h_out, w_out = h_in * info.scale, w_in * info.scale
        shapes[info.output] = (info.out_channels, h_out, w_out)
        tiles.append(_tiles_of(h_out, w_out, tile))
        total = max(st.live for st in steps)
        if total > store_peak:
            store_peak, store_peak_seg = total, info.name
        cores.append((max(p[1] - p[0] for p in split_even(h_out, tile[0])),
                      max(p[1] - p[0] for p in split_even(w_out, tile[1]))))
    last = segs[-1].info if segs else None
    out_c, out_h, out_w = shapes[last.output] if last else shapes["mid"]
    steps_total = b + b * sum(tiles)
    return ExactPlan(
        latent_shape=(b, int(latent_shape[1]), lh, lw),
        tile=(int(tile[0]), int(tile[1])),
        recompute=recompute,
        segments=tuple(s.info for s in segs),
        tiles_per_segment=tuple(tiles),
        mid_steps=b,
        total_steps=steps_total,
        store_peak_elements=b * store_peak,
        store_peak_segment=store_peak_seg,
        mid_elements=mid_c * lh * lw,
        segment_cores=tuple(cores),
        out_channels=out_c,
        out_hw=(out_h, out_w),
    )


def tile_bytes(info: SegmentInfo, core: tuple[int, int], dtype_bytes: int, inputs_copied: bool = True) -> int:
    """Peak bytes one tile of segment ``info`` with core ``(h, w)`` holds on the compute device.

    Phase by phase (``d`` = activation bytes, GroupNorm works in float32 ``f = 4``, or in float64 for
    float64 activations): the input tile with halo (only when ``inputs_copied``: the store lives
    elsewhere), its normalised copy (float32 temp + cast back for half types), each convolution's
    input and output with halo, the shortcut path, and the float32 copy of the core that the
    statistics of the next GroupNorm reduce (half types only).
    """
    d = int(dtype_bytes)
    f = 8 if d == 8 else 4
    th, tw = core
    cin, cout = info.in_channels, info.out_channels
    load = d if inputs_copied else 0
    half = d < f

    def gn(c: int, px: int) -> int:  # input alive while its normalised copy is made
        return c * px * (load + f + (d if half else 0))

    stats = cout * th * tw * f if half else 0
    if info.kind == "upsample":
        lo = (th // 2 + 2) * (tw // 2 + 2)
        hi = (th + 4) * (tw + 4)
        # The loaded tile stays referenced until the module returns: load + upsampled + conv output.
        return cin * lo * load + cin * hi * d + cout * hi * d + stats
    h = info.halo
    px = (th + 2 * h) * (tw + 2 * h)
    p1 = (th + 2) * (tw + 2)
    core_px = th * tw
    if info.kind in ("conv1", "out"):
        # conv1 of a channel-changing block also keeps shortcut(x) (core; a 3x3 conv_shortcut: the region).
        sc = 0 if info.shortcut_output is None else cout * px * d
        return max(gn(cin, px), cin * px * d + cout * px * d, cout * px * d + stats) + sc
    cres = info.residual_channels or cin
    shortcut_in = cres * core_px * load if info.kind == "conv2" else 0
    shortcut = shortcut_in + cout * core_px * d * 2  # shortcut output and the sum
    if info.kind == "conv2":
        return max(gn(cout, px), cout * px * d * 2, cout * px * d + shortcut + stats)
    # conv12: conv1 on the 2-px halo, then conv2 on its output.
    return max(
        gn(cin, px),
        cin * px * d + cout * px * d,
        gn(cout, px) - cout * px * load + cout * px * d,
        cout * px * d * 2,
        cout * px * d + cres * p1 * load + shortcut + stats,
    )


def plan_exact(
    model: Any, latent_shape: Sequence[int], tile: tuple[int, int], recompute: bool = False
) -> ExactPlan:
    """The segments, step counts and sizes of ``decode_exact(model, z, tile, recompute=...)``."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"exact tiled decode does not support this model: {reason}")
    return _plan(find_decoder(model), latent_shape, _norm_tile(tile), recompute)


def count_exact_steps(
    model: Any, latent_shape: Sequence[int], tile: tuple[int, int], recompute: bool = False
) -> int:
    """Progress units of one uninterrupted decode (mid steps + tile steps)."""
    return plan_exact(model, latent_shape, tile, recompute).total_steps


def estimate_exact_peak(
    model: Any,
    latent_shape: Sequence[int],
    tile: tuple[int, int],
    dtype_bytes: int,
    store_on_device: bool,
    recompute: bool = False,
    attention_scores: bool = True,
) -> dict[str, int]:
    """Analytic bytes of one exact decode: a conservative starting point (calibrate by measurement).

    Returns ``store`` (all stores at their peak), ``tile`` (one tile's working set, :func:`tile_bytes`;
    measured on CPU it is 0.9-1.6x of this), ``mid`` (the whole-latent mid block of one item: 8
    activations, plus the ``N x N`` attention scores twice when ``attention_scores``, i.e. when the
    attention kernel materialises them as the CPU math path does; flash / memory-efficient kernels do
    not), ``device`` (what the compute device needs on top of the model weights: the larger of tile and
    mid, plus the store when ``store_on_device``) and ``host`` (the store when it is not on the device).
    Convolution workspaces (cuDNN) are not included.
    """
    plan = plan_exact(model, latent_shape, tile, recompute)
    store = plan.store_peak_elements * dtype_bytes
    tile_b = plan.tile_bytes(dtype_bytes, inputs_copied=not store_on_device)
    work_bytes = max(dtype_bytes, 4)
    n = plan.latent_shape[2] * plan.latent_shape[3]
    mid = 8 * plan.mid_elements * work_bytes + (2 * n * n * work_bytes if attention_scores else 0)
    work = max(tile_b, mid)
    return {
        "store": store,
        "tile": tile_b,
        "mid": mid,
        "device": work + (store if store_on_device else 0),
        "host": 0 if store_on_device else store,
    }


def _norm_tile(tile: int | Sequence[int] | None) -> tuple[int, int]:
    if tile is None:
        return (1 << 30, 1 << 30)
    if isinstance(tile, int):
        tile = (tile, tile)
    th, tw = int(tile[0]), int(tile[1])
    if th < 1 or tw < 1:
        raise ValueError(f"tile must be positive, got {tile}")
    return th, tw


# --------------------------------------------------------------------------------------------------
# Statistics


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
        """(count, mean, M2) of one (1, C, h, w) tile per group."""
        g = self.groups
        c, h, w = int(core.shape[1]), int(core.shape[2]), int(core.shape[3])
        grouped = core.view(g, c // g, h, w)  # a view even of a cropped (strided) tile
        if grouped.dtype not in (torch.float32, torch.float64):
            grouped = grouped.float()
        var, mean = torch.var_mean(grouped, dim=(1, 2, 3), correction=0)
        cnt = (c // g) * h * w
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


# --------------------------------------------------------------------------------------------------
# The executor


class _Bands:
    """One activation in the store: per batch item, row bands (``rows``: the tile rows of the segment that
    writes it), each allocated when a row of tiles first writes it and released once no remaining tile
    reads it. ``whole``: one ``(B, C, H, W)`` tensor allocated at once and never released (the returned
    image)."""

    def __init__(self, run: _ExactRun, c: int, h: int, w: int, rows: list[tuple[int, int]],
                 device: torch.device, whole: bool) -> None:
        self.run = run
        self.c, self.h, self.w = c, h, w
        self.rows = rows
        self.starts = [r[0] for r in rows]
        self.device = device
        self.base = run._alloc((run.batch, c, h, w), device) if whole else None
        self.bands: list[list[torch.Tensor | None]] = [[None] * len(rows) for _ in range(run.batch)]

    def ensure(self, b: int, y0: int, y1: int) -> None:
        if self.base is not None:
            return
        for i in _bands_in(self.rows, y0, y1, self.starts):
            if self.bands[b][i] is None:
                r0, r1 = self.rows[i]
                self.bands[b][i] = self.run._alloc((1, self.c, r1 - r0, self.w), self.device)

    def _band(self, b: int, i: int) -> torch.Tensor:
        t = self.bands[b][i]
        if t is None:
            raise RuntimeError(f"exact tiled decode: band {self.rows[i]} of item {b} read after its release")
        return t

    def read(self, b: int, y0: int, y1: int, x0: int, x1: int, device: torch.device) -> torch.Tensor:
        if self.base is not None:
            return self.base[b : b + 1, :, y0:y1, x0:x1].to(device, non_blocking=True)
        idx = _bands_in(self.rows, y0, y1, self.starts)
        if len(idx) == 1:
            r0 = self.rows[idx[0]][0]
            return self._band(b, idx[0])[:, :, y0 - r0 : y1 - r0, x0:x1].to(device, non_blocking=True)
        out = torch.empty((1, self.c, y1 - y0, x1 - x0), dtype=self.run.dtype, device=device)
        for i in idx:
            r0, r1 = self.rows[i]
            a, e = max(y0, r0), min(y1, r1)
            out[:, :, a - y0 : e - y0].copy_(self._band(b, i)[:, :, a - r0 : e - r0, x0:x1], non_blocking=True)
        return out

    def write(self, r: _Rect, core: torch.Tensor) -> None:
        if self.base is not None:
            self.base[r.b : r.b + 1, :, r.y0 : r.y1, r.x0 : r.x1].copy_(core, non_blocking=True)
            return
        for i in _bands_in(self.rows, r.y0, r.y1, self.starts):
            r0, r1 = self.rows[i]
            a, e = max(r.y0, r0), min(r.y1, r1)
            self._band(r.b, i)[:, :, a - r0 : e - r0, r.x0 : r.x1].copy_(core[:, :, a - r.y0 : e - r.y0],
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
        return torch.cat([torch.cat([self._band(b, i) for i in range(len(self.rows))], dim=2)
                          for b in range(len(self.bands))])


class _ExactRun:
    def __init__(
        self,
        model: Any,
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
    ) -> None:
        self.model = model
        self.dec = find_decoder(model)
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
        self.stat_device = compute_device if compute_device.type not in ("mps",) else torch.device("cpu")

        self.segs, self.consumer, mid_name = _build_segments(self.dec, recompute)
        self.last_use: dict[str, int] = {}
        for k, s in enumerate(self.segs):
            for name in s.info.inputs:
                self.last_use[name] = k
        self.stores: dict[str, _Bands] = {}
        self.acc: dict[str, _StatAcc] = {}
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.affine_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.mid_name = mid_name
        self.mid_done = 0
        self.mid_finished = False
        self.seg_index = 0
        self.pending: collections.deque[_Rect] | None = None
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
        return h * seg.info.scale, w * seg.info.scale

    def _remaining_units(self) -> int:
        units = self.batch - self.mid_done
        if self.pending is not None:
            units += len(self.pending)
        # Geometry of the remaining segments from the mid output size.
        lh, lw = int(self.z.shape[2]), int(self.z.shape[3])
        start = self.seg_index + (1 if self.pending is not None else 0)
        for s in self.segs[start:]:
            scale = s.info.level_scale
            units += self.batch * _tiles_of(lh * scale, lw * scale, self.tile)
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

    def _write(self, name: str, r: _Rect, core: torch.Tensor) -> None:
        self.stores[name].write(r, core)

    def _sync(self) -> None:
        if self.compute.type == "cuda" and self.store_device.type != "cuda":
            torch.cuda.synchronize(self.compute)

    # -- group norm ------------------------------------------------------------------------------
    def _gn(self, name: str, b: int, x: torch.Tensor) -> torch.Tensor:
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
            scale = scale.to(work).to(x.device).view(1, c, 1, 1)
            shift = shift.to(work).to(x.device).view(1, c, 1, 1)
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
        z = self.z[b : b + 1].to(self.compute)
        bn = getattr(self.model, "bn", None)
        if bn is not None:
            s = torch.sqrt(bn.running_var.to(z).view(1, -1, 1, 1) + bn.eps)
            m = bn.running_mean.to(z).view(1, -1, 1, 1)
            z = F.pixel_shuffle(z * s + m, 2)
        pqc = getattr(self.model, "post_quant_conv", None)
        if pqc is not None and self.dec is not self.model:
            z = pqc(z)
        mid = self.dec.mid
        h = self.dec.conv_in(z)
        del z
        h = mid.block_1(h)
        h = mid.attn_1(h)
        h = mid.block_2(h)
        return h

    def _mid_phase(self) -> None:
        if self.mid_finished:
            return
        while self.mid_done < self.batch:
            self._check_stop()
            b = self.mid_done
            h = self._run_mid_item(b)
            c, mh, mw = (int(v) for v in h.shape[1:])
            if self.mid_name not in self.stores:
                self.stores[self.mid_name] = _Bands(self, c, mh, mw, [(0, mh)], self.store_device, not self.segs)
                self.acc[self.mid_name] = _StatAcc(self.batch, self.consumer[self.mid_name], self.stat_device)
            acc = self.acc[self.mid_name]
            stats = acc.tile_stats(h)
            store = self.stores[self.mid_name]
            store.ensure(b, 0, mh)
            store.write(_Rect(b, 0, mh, 0, mw), h)
            del h
            acc.record(b, stats)
            self.mid_done += 1
            self.done_units += 1
            self._report()
        self._sync()
        self.stats[self.mid_name] = self.acc.pop(self.mid_name).finalize()
        self.mid_finished = True

    # -- segments --------------------------------------------------------------------------------
    def _start_segment(self, seg: _Seg) -> None:
        info = seg.info
        h, w = self._out_hw(seg)
        k = self.segs.index(seg)
        rows = _band_rows(h, self.tile[0])
        if info.inplace_of is not None:
            self.stores[info.output] = self.stores[info.inplace_of]
        elif info.store_output and info.output not in self.stores:
            dev = self.out_device if info.output == "image" else self.store_device
            self.stores[info.output] = _Bands(self, info.out_channels, h, w, rows, dev,
                                              _whole_output(info, k, len(self.segs)))
        if info.shortcut_output is not None and info.shortcut_output not in self.stores:
            self.stores[info.shortcut_output] = _Bands(self, info.out_channels, h, w, rows, self.store_device, False)
        norm = self.consumer.get(info.output)
        if norm is not None and info.output not in self.acc:
            self.acc[info.output] = _StatAcc(self.batch, norm, self.stat_device)
        self.pending = collections.deque(r for b in range(self.batch) for r in _grid(b, h, w, self.tile))

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
            dying = _dying(info, k, self.last_use)
            while self.pending:
                r = self.pending[0]
                # The output bands this tile writes are allocated before the unit starts (an OOM here is
                # a store allocation, not a tile OOM: it propagates).
                if info.store_output:
                    self.stores[info.output].ensure(r.b, r.y0, r.y1)
                if info.shortcut_output is not None:
                    self.stores[info.shortcut_output].ensure(r.b, r.y0, r.y1)
                self._check_stop()
                self._in_tile = True  # an OOM from here to the write is a tile OOM: shrink and resume
                core, extra = self._run_tile(seg, r)
                acc = self.acc.get(info.output)
                stats = acc.tile_stats(core) if acc is not None else None
                # Nothing below allocates: once the core is written (possibly over its own input, for
                # an in-place residual), the tile is recorded as done.
                if info.store_output:
                    self._write(info.output, r, core)
                if extra is not None:
                    self._write(info.shortcut_output, r, extra)  # type: ignore[arg-type]
                del core, extra
                self._in_tile = False
                if acc is not None and stats is not None:
                    acc.record(r.b, stats)
                self.pending.popleft()
                if dying:
                    self._release(info, dying, r)
                self.done_units += 1
                self._report()
            self._finish_segment(k, seg)

    def _release(self, info: SegmentInfo, dying: tuple[str, ...], done: _Rect) -> None:
        """After a tile: when the next pending tile starts another row (or item), release the bands of the
        dying inputs that no pending tile of this item reads any more."""
        assert self.pending is not None
        nxt = self.pending[0] if self.pending else None
        if nxt is not None and nxt.b == done.b and nxt.y0 == done.y0:
            return
        b = done.b
        for name in dying:
            store = self.stores[name]
            low = min((_read_rows(info, name, p.y0, p.y1, store.h)[0] for p in self.pending if p.b == b),
                      default=1 << 62)
            store.release_below(b, low)

    def _region(self, name: str, r: _Rect, halo: int) -> tuple[int, int, int, int]:
        _, h, w = self._shape(name)
        return max(0, r.y0 - halo), min(h, r.y1 + halo), max(0, r.x0 - halo), min(w, r.x1 + halo)

    @staticmethod
    def _crop(t: torch.Tensor, oy: int, ox: int, r: _Rect) -> torch.Tensor:
        return t[:, :, r.y0 - oy : r.y1 - oy, r.x0 - ox : r.x1 - ox]

    def _run_tile(self, seg: _Seg, r: _Rect) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = self.step
        self.step += 1
        info = seg.info
        kind = info.kind
        act = F.silu
        if kind == "conv1":
            blk = seg.block
            (xn,) = info.inputs
            y0, y1, x0, x1 = self._region(xn, r, 1)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = self._crop(blk.conv1(t), y0, x0, r)
            # shortcut(x) at the core, computed as the block's conv2 tile would (same load, same module),
            # after conv1 so it does not add to the normalisation and convolution phases.
            extra = self._shortcut_core(blk, xn, r) if info.shortcut_output is not None else None
            return t, extra
        if kind == "conv2":
            blk = seg.block
            hn, xn = info.inputs
            y0, y1, x0, x1 = self._region(hn, r, 1)
            t = self._load(hn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(hn, r.b, t), inplace=True)
            t = blk.dropout(t) if getattr(blk, "dropout", None) is not None else t
            t = self._crop(blk.conv2(t), y0, x0, r)
            # The residual is written over in place: x (identity shortcut) or shortcut(x) from conv1.
            return t + self._load(xn, r.b, r.y0, r.y1, r.x0, r.x1), None
        if kind == "conv12":
            blk = seg.block
            (xn,) = info.inputs
            h_name = self._h_of(seg)
            y0, y1, x0, x1 = self._region(xn, r, 2)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = blk.conv1(t)
            t = act(self._gn(h_name, r.b, t), inplace=True)
            t = blk.dropout(t) if getattr(blk, "dropout", None) is not None else t
            t = self._crop(blk.conv2(t), y0, x0, r)
            return t + self._shortcut_core(blk, xn, r), None
        if kind == "upsample":
            (xn,) = info.inputs
            _, lh, lw = self._shape(xn)
            halo = info.halo
            ly0 = max(0, (r.y0 - halo) // 2)
            ly1 = min(lh, (r.y1 - 1 + halo) // 2 + 1)
            lx0 = max(0, (r.x0 - halo) // 2)
            lx1 = min(lw, (r.x1 - 1 + halo) // 2 + 1)
            t = self._load(xn, r.b, ly0, ly1, lx0, lx1)
            self._hook(step)
            t = seg.module(t)
            return self._crop(t, 2 * ly0, 2 * lx0, r), None
        if kind == "out":
            dec = seg.module
            (xn,) = info.inputs
            y0, y1, x0, x1 = self._region(xn, r, 1)
            t = self._load(xn, r.b, y0, y1, x0, x1)
            self._hook(step)
            t = act(self._gn(xn, r.b, t), inplace=True)
            t = self._crop(dec.conv_out(t), y0, x0, r)
            if getattr(dec, "tanh_out", False):
                t = torch.tanh(t)
            return t, None
        raise AssertionError(kind)

    def _h_of(self, seg: _Seg) -> str:
        """Name of the stats-only ``h`` activation of a ``conv12`` segment (written by its conv1)."""
        k = self.segs.index(seg)
        return self.segs[k - 1].info.output

    def _shortcut_core(self, blk: Any, xn: str, r: _Rect) -> torch.Tensor:
        sc, halo = _shortcut(blk)
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
            new: collections.deque[_Rect] = collections.deque()
            for r in self.pending:
                new.extend(_grid(r.b, r.h, r.w, self.tile, r.y0, r.x0))
            self.pending = new
        return True

    def _can_shrink(self) -> bool:
        """Only an OOM inside a tile is helped by smaller tiles (not one in the whole-latent mid block
        or while allocating a full-size store: those propagate to the caller, who can re-plan, e.g.
        with the store in host memory)."""
        th, tw = self.tile
        return self._in_tile and max(th, tw) > self.min_tile

    def _attempt(self) -> None:
        self._mid_phase()
        self._segments_phase()

    def _resume(self, event: OomEvent) -> None:
        old = self.tile
        self._shrink()
        self._in_tile = False
        log.warning(
            "exact tiled decode: out of memory (%s) at tile %s in %s; resuming with tile %s",
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
        last = self.segs[-1].info.output if self.segs else self.mid_name
        return self.stores.pop(last).tensor()


def decode_exact(
    model: Any,
    z: torch.Tensor,
    tile: int | tuple[int, int] | None,
    *,
    store_device: torch.device | str | None = None,
    compute_device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    recompute: bool = False,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = MIN_TILE,
    pin_memory: bool | None = None,
    norm_params: NormParamsFn | None = None,
) -> torch.Tensor:
    """Decode ``z`` exactly, tile by tile; returns what ``model.decode(z)`` returns (range [-1, 1]).

    ``model``: a ``first_stage_model`` (``post_quant_conv`` and Flux-2 latent batch-norm are applied
    when present) or a bare ``Decoder`` (``z`` is then the decoder's input). ``z``: (B, C, h, w) in the
    dtype the decoder runs in, on the compute device (or anywhere; each item is moved there).
    ``tile``: core size (px) per tile at each activation's own resolution (see the module docstring);
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
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"exact tiled decode does not support this model: {reason}")
    if z.ndim != 4:
        raise ValueError(f"expected a (B, C, h, w) latent, got shape {tuple(z.shape)}")
    compute = torch.device(compute_device) if compute_device is not None else z.device
    store = torch.device(store_device) if store_device is not None else compute
    out = torch.device(out_device) if out_device is not None else store
    run = _ExactRun(
        model,
        z,
        _norm_tile(tile),
        store,
        compute,
        out,
        recompute,
        progress,
        should_stop,
        fault_hook,
        oom_types(oom_exceptions),
        on_oom,
        min_tile,
        pin_memory,
        norm_params,
    )
    with torch.no_grad():
        result = run.run()
    if run.shrinks:
        log.info("exact tiled decode finished with tile %s after %d OOM shrink(s)", run.tile, run.shrinks)
    return result
