"""The host's own tile grid, one tile at a time: VAEs that tile internally (ComfyUI 0.33's ``handles_tiling``;
MiniMax H3's video VAE) decoded as their own ``decode`` does, in bounded memory.

The host's decode (``decode`` -> ``decode_temporal`` -> ``_adaptive_decode`` -> ``tiled_decode``) decodes each
temporal clip into a whole-clip canvas on the device (every spatial tile, cross-faded with the raw edges of its
upper and left neighbours), then cross-fades the clip's first frames with the kept tail of the previous clip and
finalises them into the output. Every step after a tile's decode is element-wise, so the same values come out
when each tile's region is carried through all of it at once: decode one tile (``_decode_pixels``), cross-fade
it with its neighbours' kept raw edges (the host's ``blend``, same operands, same order), crop it as the host
does, then for each part of the clip cross-fade the region with the previous clip's kept tail (``blend`` again),
finalise it (``_finalize_pixels``) and write it into the output, or keep it raw as the next clip's tail. Nothing
of the whole clip sits on the device: one tile's decode, a row of raw tile edges and the region of the kept tail
(both kept on ``store_device``). Same operations on the same operands: the host's result to the bit, proven per
structure by the first-use self-check (``decode/host_grid.check_host_grid``).

The executor calls the host's methods (``split_tiles``, ``blend``, ``_decode_pixels``, ``_finalize_pixels``,
``_decode_temporal_chunks``, ``decode_output_shape``) and reads its grid fields; the only arithmetic of its own
is the latent's de-normalisation (``z * latents_std + latents_mean``, as ``decode`` begins). Progress per tile,
Cancel before every tile, an out-of-memory error in a tile's decode: release and decode that tile again (the
finished tiles are in the output already; the grid is the host's, so it cannot shrink). Nothing here imports
ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..oom import OomEvent, oom_types
from .blend import stop_driver

log = logging.getLogger("vramfit.memory.executors.host_grid")

__all__ = ["EXECUTOR_VERSION", "MAX_TILE_RETRIES", "Clip", "Part", "decode_host_grid", "schedule", "spatial_grid"]

EXECUTOR_VERSION = "1"
MAX_TILE_RETRIES = 2
"""Decodes of one tile after an out-of-memory error in it (after releasing cached memory) before giving up."""

ProgressFn = Callable[[int, int], None]
Span = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


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


def _decode_tile(model: Any, ztile: torch.Tensor, driver: Any, fault_hook: Callable[[int], None] | None,
                 count: dict) -> torch.Tensor:
    """One tile's raw decode (the host's ``_decode_pixels``): Cancel first; after an out-of-memory error, release
    and decode it again (at most :data:`MAX_TILE_RETRIES` times)."""
    tries = 0

    def attempt() -> torch.Tensor:
        driver.check_stop()
        count["steps"] += 1
        if fault_hook is not None:
            fault_hook(count["steps"] - 1)
        return model._decode_pixels(ztile)

    def recover(event: OomEvent) -> None:
        nonlocal tries
        tries += 1
        count["restarts"] += 1
        log.warning("host-grid decode: out of memory in a tile (%s); decoding it again", event.message)

    return driver.run(attempt, can_recover=lambda e: tries < MAX_TILE_RETRIES, recover=recover)


def decode_host_grid(
    model: Any,
    z: torch.Tensor,
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
    stats: dict | None = None,
) -> torch.Tensor:
    """Decode the normalised latent ``z`` ``(B, C, T, h, w)`` into ``out`` ``(B, 3, frames, H, W)`` (float32, as
    ``model.decode`` returns it: finalised to [0, 1]), one of the host's tiles at a time (module docstring).
    ``store_device``: where the raw tile edges and the kept clip tail wait (default: ``out``'s device).
    ``progress(done, total)`` per tile; ``should_stop()`` before each; ``fault_hook(step)`` inside each tile's
    decode attempt (tests raise an out-of-memory error there)."""
    dev = torch.device(compute_device)
    store = torch.device(store_device) if store_device is not None else out.device
    b, _, t, h, w = (int(v) for v in z.shape)
    rows, cols = spatial_grid(model, h, w)
    clips = schedule(model, t)
    r = int(model.vae_ratio)
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    total = b * len(clips) * len(rows[0]) * len(cols[0])
    done = 0
    count = {"steps": 0, "restarts": 0}

    for item in range(b):
        zi = z[item : item + 1].to(device=dev, dtype=dtype)
        zi = zi * model.latents_std.view(1, -1, 1, 1, 1).to(zi) + model.latents_mean.view(1, -1, 1, 1, 1).to(zi)
        if len(clips) > 1 or clips[0].z1 > t:
            pad = clips[-1].z1 - t
            if pad > 0:
                zi = torch.cat([zi, zi[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        o = out[item : item + 1]
        kept_prev: torch.Tensor | None = None
        for clip in clips:
            zc = zi[:, :, clip.z0 : clip.z1]
            keep = next((p for p in clip.parts if p.keep), None)
            kept_next = None
            row_tails: list[torch.Tensor] = []
            out_y = 0
            for i, (y0, yl) in enumerate(zip(rows[0], rows[1], strict=True)):
                new_tails: list[torch.Tensor] = []
                left_tail = None
                out_x = 0
                th = 0
                for j, (x0, xl) in enumerate(zip(cols[0], cols[1], strict=True)):
                    ztile = zc[..., y0 // r : (y0 + yl) // r, x0 // r : (x0 + xl) // r]
                    tile = _decode_tile(model, ztile, driver, fault_hook, count)
                    # The host's tiled_decode: raw edges kept before blending, blended with the raw edges of the
                    # upper and the left neighbour, then cropped.
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
                    ys, xs = slice(out_y, out_y + th), slice(out_x, out_x + tw)
                    if keep is not None and kept_next is None:
                        kept_next = torch.empty((*tile.shape[:2], max(0, keep.stop - keep.start), h * r, w * r),
                                                dtype=tile.dtype, device=store)
                    # decode_temporal on this region: the clip's parts
                    for p in clip.parts:
                        seg = tile[:, :, p.start : p.stop]
                        if p.keep:
                            kept_next[..., ys, xs].copy_(seg)
                            continue
                        if p.blend:
                            seg = model.blend(kept_prev[..., ys, xs].to(dev), seg, model.frame_overlap, dim=-3)
                        if p.count > 0:
                            fin = model._finalize_pixels(seg)
                            o[:, :, p.pos : p.pos + p.count, ys, xs].copy_(fin[:, :, : p.count])
                            del fin
                        del seg
                    if clip.flush > 0:
                        fin = model._finalize_pixels(kept_next[..., ys, xs].to(dev))
                        o[:, :, clip.flush_pos : clip.flush_pos + clip.flush, ys, xs].copy_(fin[:, :, : clip.flush])
                        del fin
                    del tile
                    out_x += tw
                    done += 1
                    if progress is not None:
                        progress(done, total)
                row_tails = new_tails
                out_y += th
            kept_prev = kept_next if keep is not None else None
            del zc
    if stats is not None:
        stats.update(exact=True, chunks=len(clips) * b, tiles=len(rows[0]) * len(cols[0]), steps=count["steps"],
                     restarts=count["restarts"], units=total)
    return out
