"""The host's own tile grid, one tile (or one row) at a time: VAEs that tile internally (ComfyUI 0.33's
``handles_tiling``; MiniMax H3's video VAE) decoded as their own ``decode`` does, in bounded memory.

The host's decode (``decode`` -> ``decode_temporal`` -> ``_adaptive_decode`` -> ``tiled_decode``) decodes each
temporal clip into a whole-clip canvas on the device, then cross-fades the clip's first frames with the kept tail of
the previous clip and finalises them into the output. Two spatial grids exist, told apart by structure
(:func:`grid_kind`):

* :data:`RAW` (ComfyUI 0.33.0): one tile per decoder call (``_decode_pixels``), each cross-faded with the *raw*
  edges of its upper and left neighbours (kept before they were blended), then cropped;
* :data:`BLENDED` (upstream ``19315e86``, which adds ``_decode_tile_row(z_row, x_idx, x_len)``): a row's tiles
  decoded a few per decoder call by that method, each cross-faded with its neighbours *as already blended*: the
  bottom rows of the blended, cropped row above (a full-width strip) and the right columns of the blended left
  tile.

Every step after a tile's decode is element-wise, so the same values come out when each tile's region is carried
through all of it at once: decode one tile (or a group of one row's tiles through the host's own
``_decode_tile_row``), cross-fade it with what the host's grid cross-fades it with (the host's ``blend``, same
operands, same order), crop it as the host does, then for each part of the clip cross-fade the region with the
previous clip's kept tail (``blend`` again), finalise it (``_finalize_pixels``) and write it into the output, or
keep it raw as the next clip's tail. Nothing of the whole clip sits on the device: one tile's (or group's) decode,
one row's edges (raw tails or the blended strip) and the region of the kept tail (both kept on ``store_device``).
Same operations on the same operands: the host's result to the bit, proven per structure by the first-use
self-check (``decode/host_grid.check_host_grid``).

The executor calls the host's methods (``split_tiles``, ``blend``, ``_decode_pixels`` / ``_decode_tile_row``,
``_finalize_pixels``, ``_decode_temporal_chunks``, ``decode_output_shape``) and reads its grid fields; the only
arithmetic of its own is the latent's de-normalisation (``z * latents_std + latents_mean``, as ``decode`` begins).
Progress per tile, Cancel before every decoder call, an out-of-memory error in a decoder call: release, halve the
row group (down to one tile), then decode that tile again (at most :data:`MAX_TILE_RETRIES` times; finished tiles
are in the output already; the grid is the host's, so it cannot shrink). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..oom import OomEvent, oom_types
from ..run_context import ProgressFn
from .blend import stop_driver

log = logging.getLogger("vramfit.memory.executors.host_grid")

__all__ = ["BLENDED", "EXECUTOR_VERSION", "MAX_TILE_RETRIES", "RAW", "ROW_BATCH_MAX", "Clip", "Part",
           "decode_host_grid", "grid_kind", "schedule", "spatial_grid"]

EXECUTOR_VERSION = "2"
MAX_TILE_RETRIES = 2
"""Decodes of one tile after an out-of-memory error in it (after releasing cached memory) before giving up."""
RAW = "raw-edge grid"
"""ComfyUI 0.33.0's grid: a tile per decoder call, cross-faded with its neighbours' raw edges."""
BLENDED = "neighbour-blended grid"
"""The newer grid (upstream 19315e86): row groups per decoder call, cross-faded with already-blended neighbours."""
ROW_BATCH_MAX = 4
"""Most tiles the host's ``_decode_tile_row`` decodes in one call (its own cap; larger groups buy nothing)."""
ROW_METHOD = "_decode_tile_row"
ROW_ARGS = ("z_row", "x_idx", "x_len")
"""What the newer ``tiled_decode`` passes its ``_decode_tile_row``."""

Span = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
Region = tuple[slice, slice, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Part:
    """Frames ``[start, stop)`` of a clip's decode: written at output frame ``pos`` (``count`` frames, after
    cross-fading the previous clip's kept tail in front when ``blend``), or kept raw as the next clip's tail
    (``keep``)."""

    start: int
    stop: int
    keep: bool = False
    blend: bool = False
    pos: int = 0
    count: int = 0


@dataclasses.dataclass(frozen=True)
class Clip:
    """Latent frames ``[z0, z1)`` of the (padded) latent; the decoder gives ``frames`` frames for them."""

    z0: int
    z1: int
    frames: int
    parts: tuple[Part, ...]
    flush: int = 0
    """After this clip (the last), the kept tail's first ``flush`` frames are written at ``flush_pos``."""
    flush_pos: int = 0


def grid_kind(model: Any) -> str | None:
    """Which grid the host's ``tiled_decode`` runs, by structure: :data:`BLENDED` where the model has a
    ``_decode_tile_row`` that takes ``(z_row, x_idx, x_len)``, :data:`RAW` where it has no such method, None where it
    has one that cannot be called so (neither grid: the host's own decode). The first-use self-check proves it."""
    row = getattr(model, ROW_METHOD, None)
    if row is None:
        return RAW
    if not callable(row):
        return None
    try:
        inspect.signature(row).bind(*ROW_ARGS)
    except (TypeError, ValueError):
        return None
    return BLENDED


def spatial_grid(model: Any, h: int, w: int) -> tuple[Span, Span]:
    """``(rows, cols)``: the host's tile starts, lengths and overlaps in output px (``split_tiles``; one tile of
    the whole frame when the model's ``tiling`` is off, as ``_adaptive_decode`` does)."""
    r = int(model.vae_ratio)

    def axis(n: int) -> Span:
        if not model.tiling:
            return (0,), (n,), ()
        starts, lengths, overlaps = model.split_tiles(n)
        return tuple(int(v) for v in starts), tuple(int(v) for v in lengths), tuple(int(v) for v in overlaps)

    return axis(h * r), axis(w * r)


def schedule(model: Any, t: int) -> list[Clip]:
    """The host's temporal chunking of ``t`` latent frames (``decode``'s one-frame case, else
    ``decode_temporal``): clips, their parts and where each part's frames go in the output."""
    rt = int(model.vae_ratio_t)
    pre = int(model.frame_pre_padding)
    if t == 1:  # decode(): the last of the decoded frames
        return [Clip(0, 1, rt, (Part(rt - 1, rt, pos=0, count=1),))]
    total = int(model.decode_output_shape((1, 1, t, 1, 1))[2])
    pad, n_chunks = (int(v) for v in model._decode_temporal_chunks(t))
    tp = t + pad
    size, over = int(model.tokens_chunk_size), int(model.token_overlap)
    chunk_dec = size * rt
    split_count = int(int(model.token_drop) > 0) + 1
    clips, pos, kept = [], 0, None

    def write(n: int) -> tuple[int, int]:
        nonlocal pos
        count = min(n, max(0, total - pos)) if n > 0 else 0
        at = pos
        pos += count
        return at, count

    for i in range(n_chunks):
        z0 = i * size
        z1 = min(z0 + size + over, tp)
        frames = (z1 - z0) * rt
        parts = []
        for j in range(split_count):
            fs = j * chunk_dec
            fe = min(fs + chunk_dec, frames)
            start = fs + pre  # clip_dec[:, :, fs:fe][:, :, pre:]
            n = max(0, fe - start)
            if j == 0:
                blend = kept is not None
                kept = None
                at, count = write(n)
                parts.append(Part(start, fe, blend=blend, pos=at, count=count))
            else:
                kept = n
                parts.append(Part(start, fe, keep=True))
        flush = flush_pos = 0
        if i == n_chunks - 1 and kept is not None:
            flush_pos, flush = write(kept)
            kept = None
        clips.append(Clip(z0, z1, frames, tuple(parts), flush, flush_pos))
    return clips


class _Decoder:
    """The decoder calls of one decode: Cancel first, the fault hook, out-of-memory recovery (halve the row group,
    then decode the tile again, at most :data:`MAX_TILE_RETRIES` times)."""

    def __init__(self, model: Any, driver: Any, fault_hook: Callable[[int], None] | None, batch: int) -> None:
        self.model, self.driver, self.fault_hook = model, driver, fault_hook
        self.batch = max(1, int(batch))
        self.steps = self.restarts = 0

    def _call(self, run: Callable[[], Any]) -> Any:
        tries = 0

        def attempt() -> Any:
            self.driver.check_stop()
            self.steps += 1
            if self.fault_hook is not None:
                self.fault_hook(self.steps - 1)
            return run()

        def recover(event: OomEvent) -> None:
            nonlocal tries
            self.restarts += 1
            if self.batch > 1:
                self.batch //= 2
                what = f"decoding {self.batch} tile(s) per call from here"
            else:
                tries += 1
                what = "decoding it again"
            log.warning("host-grid decode: out of memory in a decoder call (%s); %s", event.message, what)

        return self.driver.run(attempt, can_recover=lambda e: tries < MAX_TILE_RETRIES, recover=recover)

    def tile(self, ztile: torch.Tensor) -> torch.Tensor:
        """One tile's raw decode (the host's ``_decode_pixels``)."""
        return self._call(lambda: self.model._decode_pixels(ztile))

    def row(self, z_row: torch.Tensor, starts: tuple[int, ...], lengths: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """One row's raw tiles, decoded in groups of :attr:`batch` by the host's ``_decode_tile_row``; a group is
        released as its last tile is taken (the host's own order)."""
        j = 0
        while j < len(starts):
            group = self._call(lambda j=j: list(getattr(self.model, ROW_METHOD)(
                z_row, list(starts[j : j + self.batch]), list(lengths[j : j + self.batch]))))
            j += len(group)
            group.reverse()
            while group:
                yield group.pop()


def _raw_tiles(model: Any, zc: torch.Tensor, rows: Span, cols: Span, dec: _Decoder, dev: torch.device,
               store: torch.device) -> Iterator[Region]:
    """0.33.0's ``tiled_decode``: raw edges kept before blending, blended with the raw edges of the upper and
    the left neighbour, then cropped. Yields ``(ys, xs, region)`` in the host's order."""
    r = int(model.vae_ratio)
    row_tails: list[torch.Tensor] = []
    out_y = 0
    for i, (y0, yl) in enumerate(zip(rows[0], rows[1], strict=True)):
        new_tails: list[torch.Tensor] = []
        left_tail = None
        out_x = th = 0
        for j, (x0, xl) in enumerate(zip(cols[0], cols[1], strict=True)):
            tile = dec.tile(zc[..., y0 // r : (y0 + yl) // r, x0 // r : (x0 + xl) // r])
            if i < len(rows[0]) - 1:
                new_tails.append(tile[..., -rows[2][i]:, :].to(store, copy=True))
            next_left = tile[..., :, -cols[2][j]:].clone() if j < len(cols[0]) - 1 else None
            if i > 0:
                tile = model.blend(row_tails[j].to(dev), tile, rows[2][i - 1], dim=-2)
            if j > 0:
                tile = model.blend(left_tail, tile, cols[2][j - 1], dim=-1)
            left_tail = next_left
            if i < len(rows[0]) - 1:
                tile = tile[..., : -rows[2][i], :]
            if j < len(cols[0]) - 1:
                tile = tile[..., :, : -cols[2][j]]
            th, tw = int(tile.shape[-2]), int(tile.shape[-1])
            yield slice(out_y, out_y + th), slice(out_x, out_x + tw), tile
            del tile
            out_x += tw
        row_tails = new_tails
        out_y += th


def _blended_tiles(model: Any, zc: torch.Tensor, rows: Span, cols: Span, dec: _Decoder, dev: torch.device,
                   store: torch.device) -> Iterator[Region]:
    """The newer ``tiled_decode``: a row's tiles from ``_decode_tile_row``, each blended with the strip of the
    blended row above (its columns ``[x0, x0 + length)``) and with the blended left tile's right columns, cropped,
    its bottom rows kept into the next strip. Yields ``(ys, xs, region)`` in the host's order."""
    r = int(model.vae_ratio)
    width = int(zc.shape[-1]) * r
    last_row, last_col = len(rows[0]) - 1, len(cols[0]) - 1
    strip: torch.Tensor | None = None
    out_y = 0
    for i, (y0, yl) in enumerate(zip(rows[0], rows[1], strict=True)):
        new_strip: torch.Tensor | None = None
        left_tail = None
        out_x = th = 0
        for j, tile in enumerate(dec.row(zc[..., y0 // r : (y0 + yl) // r, :], cols[0], cols[1])):
            x0, xl = cols[0][j], cols[1][j]
            if i > 0:
                tile = model.blend(strip[..., :, x0 : x0 + xl].to(dev), tile, rows[2][i - 1], dim=-2)
            if j > 0:
                tile = model.blend(left_tail, tile, cols[2][j - 1], dim=-1)
            left_tail = tile[..., :, -cols[2][j]:].clone() if j < last_col else None
            if j < last_col:
                tile = tile[..., :, : -cols[2][j]]
            if i < last_row:
                if new_strip is None:
                    new_strip = torch.empty((*tile.shape[:-2], rows[2][i], width), dtype=tile.dtype, device=store)
                new_strip[..., :, out_x : out_x + tile.shape[-1]].copy_(tile[..., -rows[2][i]:, :])
                tile = tile[..., : -rows[2][i], :]
            th, tw = int(tile.shape[-2]), int(tile.shape[-1])
            yield slice(out_y, out_y + th), slice(out_x, out_x + tw), tile
            del tile
            out_x += tw
        strip = new_strip
        out_y += th


class _ClipWriter:
    """``decode_temporal`` on one region of a clip: its parts cross-faded with the previous clip's kept tail,
    finalised and written into the output, or kept raw (on ``store``) as the next clip's tail."""

    def __init__(self, model: Any, clip: Clip, out: torch.Tensor, kept_prev: torch.Tensor | None,
                 dev: torch.device, store: torch.device, size: tuple[int, int]) -> None:
        self.model, self.clip, self.out, self.kept_prev = model, clip, out, kept_prev
        self.dev, self.store, self.size = dev, store, size
        self.keep = next((p for p in clip.parts if p.keep), None)
        self.kept_next: torch.Tensor | None = None

    def write(self, ys: slice, xs: slice, tile: torch.Tensor) -> None:
        model, clip, o = self.model, self.clip, self.out
        if self.keep is not None and self.kept_next is None:
            self.kept_next = torch.empty((*tile.shape[:2], max(0, self.keep.stop - self.keep.start), *self.size),
                                         dtype=tile.dtype, device=self.store)
        for p in clip.parts:
            seg = tile[:, :, p.start : p.stop]
            if p.keep:
                self.kept_next[..., ys, xs].copy_(seg)
                continue
            if p.blend:
                seg = model.blend(self.kept_prev[..., ys, xs].to(self.dev), seg, model.frame_overlap, dim=-3)
            if p.count > 0:
                fin = model._finalize_pixels(seg)
                o[:, :, p.pos : p.pos + p.count, ys, xs].copy_(fin[:, :, : p.count])
                del fin
            del seg
        if clip.flush > 0:
            fin = model._finalize_pixels(self.kept_next[..., ys, xs].to(self.dev))
            o[:, :, clip.flush_pos : clip.flush_pos + clip.flush, ys, xs].copy_(fin[:, :, : clip.flush])
            del fin


def decode_host_grid(
    model: Any,
    z: torch.Tensor,
    *,
    out: torch.Tensor,
    compute_device: torch.device | str,
    dtype: torch.dtype,
    store_device: torch.device | str | None = None,
    row_batch: int = 1,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Decode the normalised latent ``z`` ``(B, C, T, h, w)`` into ``out`` ``(B, 3, frames, H, W)`` (float32, as
    ``model.decode`` returns it: finalised to [0, 1]), one of the host's tiles at a time (module docstring).
    ``store_device``: where the row edges and the kept clip tail wait (default: ``out``'s device). ``row_batch``:
    tiles per decoder call on the :data:`BLENDED` grid (the :data:`RAW` grid decodes one). ``progress(done,
    total)`` per tile; ``should_stop()`` before each decoder call; ``fault_hook(step)`` inside each decoder call's
    attempt (tests raise an out-of-memory error there). Raises ValueError for a model of neither grid."""
    kind = grid_kind(model)
    if kind is None:
        raise ValueError(f"{type(model).__name__}: its {ROW_METHOD} is neither grid's; the host's own decode")
    dev = torch.device(compute_device)
    store = torch.device(store_device) if store_device is not None else out.device
    b, _, t, h, w = (int(v) for v in z.shape)
    rows, cols = spatial_grid(model, h, w)
    clips = schedule(model, t)
    r = int(model.vae_ratio)
    tiles = _blended_tiles if kind == BLENDED and model.tiling else _raw_tiles
    dec = _Decoder(model, stop_driver(oom_types(oom_exceptions), should_stop, on_oom), fault_hook,
                   row_batch if tiles is _blended_tiles else 1)
    total = b * len(clips) * len(rows[0]) * len(cols[0])
    done = 0

    for item in range(b):
        zi = z[item : item + 1].to(device=dev, dtype=dtype)
        zi = zi * model.latents_std.view(1, -1, 1, 1, 1).to(zi) + model.latents_mean.view(1, -1, 1, 1, 1).to(zi)
        if len(clips) > 1 or clips[0].z1 > t:
            pad = clips[-1].z1 - t
            if pad > 0:
                zi = torch.cat([zi, zi[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        kept_prev: torch.Tensor | None = None
        for clip in clips:
            writer = _ClipWriter(model, clip, out[item : item + 1], kept_prev, dev, store, (h * r, w * r))
            for ys, xs, tile in tiles(model, zi[:, :, clip.z0 : clip.z1], rows, cols, dec, dev, store):
                writer.write(ys, xs, tile)
                del tile
                done += 1
                if progress is not None:
                    progress(done, total)
            kept_prev = writer.kept_next if writer.keep is not None else None
            del writer
    if stats is not None:
        stats.update(exact=True, chunks=len(clips) * b, tiles=len(rows[0]) * len(cols[0]), steps=dec.steps,
                     restarts=dec.restarts, units=total, grid=kind, row_batch=dec.batch)
    return out
