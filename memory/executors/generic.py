"""Single-pass tiled decode for any VAE: latent tiles with a halo, cropped, written into one buffer.

For decoders the exact path (``kl_exact``) does not support (image VAEs of third-party packs such
as DC-AE, up-path attention, ...). Each latent tile (its core plus ``halo`` latent px on every side
that is not an image border) is decoded by the caller's ``decode_fn`` and only the core's pixels are
written into a preallocated output buffer, so every output pixel is computed once (ComfyUI's
``VAEDecodeTiled`` decodes everything three times and averages).

Exact when the decoder is *local*: with ``halo >= reach`` (``memory/reach.py``) of a decoder
without global operations, each core pixel sees exactly the inputs it sees in a whole-image decode.
Decoders with GroupNorm (statistics over the whole image) or attention are global, so tiles differ
from the whole-image decode (KL-f8 measured in docs/TILED_DECODE.md: ~18-30 dB depending on halo);
for those the exact path is the right one.

``feather`` (latent px, <= halo and <= half the smallest core): cross-fades adjacent tiles over
``2 * feather`` latent px centred on their common border with complementary linear ramps (a
partition of unity, also across T-junctions after an OOM re-split). Pixels in those bands are
computed twice; the rest once. A feathered pixel lies up to ``feather`` px outside its tile's core,
so it has ``halo - feather`` px of context there: for a local decoder to stay exact use
``halo >= reach + feather``.

Tiles are processed per batch item; ``tile`` and ``halo`` are in latent px. 4-D ``(B, C, h, w)`` and
5-D ``(B, C, t, h, w)`` latents are tiled over their last two dims (the whole time axis per tile).
Progress, stop, fault injection and OOM resume behave as in ``kl_exact`` (resume = skip finished
tiles; the pending ones are re-split with half the tile); finished tiles are never recomputed, so a
resumed decode equals an uninterrupted one with the same halo wherever the decoder is local.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..oom import OomEvent, OomResume, oom_types
from ..run_context import ProgressFn
from ..tiles import Rect, grid, pair, split_even

log = logging.getLogger("vramfit.memory.executors.generic")

__all__ = ["decode_generic", "decode_generic_into"]


def _ramp(n: int, start_pad: int, end_pad: int, band: int, device: torch.device) -> torch.Tensor:
    """Weights along one axis of a written region of ``n`` px whose first ``start_pad`` / last ``end_pad``
    px lie beyond the core; the ramp spans ``2 * band`` px centred on each core border (1 elsewhere)."""
    pos = torch.arange(n, dtype=torch.float32, device=device) + 0.5
    w = torch.ones(n, dtype=torch.float32, device=device)
    if band > 0 and start_pad > 0:
        w = torch.minimum(w, (pos / (2 * band)).clamp(0, 1))
    if band > 0 and end_pad > 0:
        w = torch.minimum(w, ((n - pos) / (2 * band)).clamp(0, 1))
    return w


class _GenericRun:
    def __init__(
        self,
        decode_fn,
        z,
        tile,
        halo,
        scale,
        out_device,
        out_dtype,
        feather,
        progress,
        should_stop,
        fault_hook,
        oom,
        on_oom,
        min_tile,
    ) -> None:
        self.decode_fn = decode_fn
        self.z = z
        self.tile = pair(tile)
        self.halo = pair(halo, "halo", 0)
        self.scale = None if scale is None else pair(scale, "scale", 0)
        self.out_device = out_device
        self.out_dtype = out_dtype
        self.feather = feather
        self.progress = progress
        self.fault_hook = fault_hook
        self.driver = OomResume(oom, should_stop=should_stop, on_oom=on_oom)
        self.min_tile = max(1, int(min_tile))
        self.h, self.w = int(z.shape[-2]), int(z.shape[-1])
        self.pending: collections.deque[Rect] = collections.deque(
            r for b in range(int(z.shape[0])) for r in grid(b, self.h, self.w, self.tile)
        )
        # Feather band per axis, fixed for the whole decode (the ramps of neighbouring tiles must
        # match): <= halo and <= half the shortest core, so at most two tiles overlap anywhere.
        cores_y = [b - a for a, b in split_even(self.h, self.tile[0])]
        cores_x = [b - a for a, b in split_even(self.w, self.tile[1])]
        self.band = (
            min(feather, self.halo[0], min(cores_y) // 2) if len(cores_y) > 1 else 0,
            min(feather, self.halo[1], min(cores_x) // 2) if len(cores_x) > 1 else 0,
        )
        self.out: torch.Tensor | None = None
        self.done = 0
        self.step = 0
        self.shrinks = 0

    def _report(self) -> None:
        if self.progress is not None:
            self.progress(self.done, self.done + len(self.pending))

    def _run_tile(self, r: Rect) -> None:
        b, y0, y1, x0, x1 = r.b, r.y0, r.y1, r.x0, r.x1
        hy, hx = self.halo
        a0, a1 = max(0, y0 - hy), min(self.h, y1 + hy)
        c0, c1 = max(0, x0 - hx), min(self.w, x1 + hx)
        step = self.step
        self.step += 1
        latent = self.z[b : b + 1, ..., a0:a1, c0:c1]
        if self.fault_hook is not None:
            self.fault_hook(step)
        img = self.decode_fn(latent)
        sy, sx = self._scale_of(img, a1 - a0, c1 - c0)
        if self.out is None:
            shape = (int(self.z.shape[0]), *img.shape[1:-2], self.h * sy, self.w * sx)
            dtype = self.out_dtype or (torch.float32 if any(self.band) else img.dtype)
            self.out = torch.zeros(shape, dtype=dtype, device=self.out_device)
        fy, fx = self.band
        # Region written: the core, extended by the feather band on every internal side.
        wy0, wy1 = (max(0, y0 - fy) if y0 > 0 else 0), (min(self.h, y1 + fy) if y1 < self.h else self.h)
        wx0, wx1 = (max(0, x0 - fx) if x0 > 0 else 0), (min(self.w, x1 + fx) if x1 < self.w else self.w)
        part = img[..., (wy0 - a0) * sy : (wy1 - a0) * sy, (wx0 - c0) * sx : (wx1 - c0) * sx]
        dst = self.out[b : b + 1, ..., wy0 * sy : wy1 * sy, wx0 * sx : wx1 * sx]
        if fy == 0 and fx == 0:
            dst.copy_(part)
            return
        wy = _ramp(part.shape[-2], (y0 - wy0) * sy, (wy1 - y1) * sy, fy * sy, part.device)
        wx = _ramp(part.shape[-1], (x0 - wx0) * sx, (wx1 - x1) * sx, fx * sx, part.device)
        weighted = part.to(torch.float32) * (wy[:, None] * wx[None, :])
        dst.add_(weighted.to(device=dst.device, dtype=dst.dtype))

    def _scale_of(self, img: torch.Tensor, lh: int, lw: int) -> tuple[int, int]:
        if self.scale is not None:
            sy, sx = self.scale
        else:
            sy, sx = img.shape[-2] // lh, img.shape[-1] // lw
            self.scale = (sy, sx)
        if img.shape[-2] != lh * sy or img.shape[-1] != lw * sx:
            raise ValueError(
                f"decode_fn returned {tuple(img.shape)} for a {lh}x{lw} latent tile: not {sy}x{sx} per latent px"
            )
        return sy, sx

    def _loop(self) -> None:
        while self.pending:
            self.driver.check_stop()
            self._run_tile(self.pending[0])
            self.pending.popleft()
            self.done += 1
            self._report()

    def _shrink(self) -> bool:
        th, tw = self.tile
        # Cores stay >= 2 * band after re-splitting (pieces of split_even are > tile / 2).
        floor_y, floor_x = max(self.min_tile, 4 * self.band[0]), max(self.min_tile, 4 * self.band[1])
        new = (max(min(th, floor_y), th // 2), max(min(tw, floor_x), tw // 2))
        if new == self.tile:
            return False
        self.tile = new
        self.shrinks += 1
        rects: collections.deque[Rect] = collections.deque()
        for r in self.pending:
            rects.extend(grid(r.b, r.h, r.w, new, r.y0, r.x0))
        self.pending = rects
        return True

    def _can_shrink(self) -> bool:
        th, tw = self.tile
        return th > max(self.min_tile, 4 * self.band[0]) or tw > max(self.min_tile, 4 * self.band[1])

    def _resume(self, event: OomEvent) -> None:
        old = self.tile
        self._shrink()
        log.warning("tiled decode: out of memory (%s) at tile %s; resuming with tile %s", event.type_name, old,
                    self.tile)
        self._report()

    def run(self) -> torch.Tensor:
        self._report()
        self.driver.run(self._loop, can_recover=lambda e: self._can_shrink(), recover=self._resume)
        assert self.out is not None
        return self.out


def decode_generic(
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    tile: int | tuple[int, int],
    halo: int | tuple[int, int],
    *,
    scale: int | tuple[int, int] | None = None,
    out_device: torch.device | str | None = None,
    out_dtype: torch.dtype | None = None,
    feather: int = 0,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = 1,
) -> torch.Tensor:
    """Decode ``z`` tile by tile with ``decode_fn``; returns the assembled output ``(B, C, ..., H, W)``.

    ``decode_fn(latent_tile) -> image_tile``: latent tile ``(1, C, [t,] h, w)`` (a view of ``z``; move
    or cast it inside ``decode_fn``) to ``(1, C_out, [T,] h*sy, w*sx)``. ``tile``/``halo``/``feather``: latent
    px. ``scale``: output px per latent px (inferred from the first tile when None). ``out_device``:
    where the output buffer lives (default ``z.device``; pass ComfyUI's intermediate device);
    ``out_dtype``: its dtype (default: the decoder's, float32 with ``feather``). ``progress(done,
    total)``, ``should_stop()``, ``fault_hook(k)``, ``oom_exceptions``, ``on_oom()``: as in
    :func:`.kl_exact.decode_exact`.
    """
    if z.ndim not in (4, 5):
        raise ValueError(f"expected a (B, C, h, w) or (B, C, t, h, w) latent, got {tuple(z.shape)}")
    run = _GenericRun(
        decode_fn,
        z,
        tile,
        halo,
        scale,
        torch.device(out_device) if out_device is not None else z.device,
        out_dtype,
        max(0, int(feather)),
        progress,
        should_stop,
        fault_hook,
        oom_types(oom_exceptions),
        on_oom,
        min_tile,
    )
    with torch.no_grad():
        out = run.run()
    if run.shrinks:
        log.info("tiled decode finished with tile %s after %d OOM shrink(s)", run.tile, run.shrinks)
    return out


def decode_generic_into(out: torch.Tensor, decode_fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                        tile: int | tuple[int, int], halo: int | tuple[int, int],
                        process: Callable[[torch.Tensor], torch.Tensor] | None, **kw: Any) -> None:
    """One item of an image decode: :func:`decode_generic` in float32, ``process``ed (the host's output processing;
    None: none) into ``out``, its row of the output (1, H, W, C). The keywords as :func:`decode_generic`'s."""
    img = decode_generic(decode_fn, z, tile, halo, out_dtype=torch.float32, **kw)
    out.copy_((img if process is None else process(img)).movedim(1, -1))
