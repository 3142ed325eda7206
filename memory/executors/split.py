"""Exact tiled decode of a prefix/suffix decoder (:mod:`..vae.split_layout`): the prefix once on the whole
latent (or, with ``prefix_tile``, in tiles: :mod:`.prefix_tiles`), then the local suffix in tiles of the prefix's
output with a halo of at least its reach (:func:`.generic.decode_generic`, no feather). Each output pixel then sees
exactly the inputs it sees in the whole decode, so the result equals it up to float rounding (convolution
algorithms may differ by tile size; the tiled prefix's attention sums add up in another order).

Progress: one unit for the prefix, then one per tile. An OOM inside a suffix tile halves the tile and resumes
(finished tiles are kept); one in the prefix propagates to the caller, who re-plans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..vae.split_layout import SplitLayout
from .generic import decode_generic
from .prefix_tiles import run_units

__all__ = ["decode_split", "decode_split_into"]


def decode_split(
    layout: SplitLayout,
    z: torch.Tensor,
    tile: int | tuple[int, int],
    halo: int,
    *,
    out_device: torch.device | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], None] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = 4,
    prefix_tile: int = 0,
) -> torch.Tensor:
    """Decode one ``(1, C, h, w)`` latent ``z`` (dtype and device the decoder runs in); returns the decoder's
    output (``first_stage_model.decode``'s range) in float32 on ``out_device``. ``tile`` and ``halo``: px of
    the prefix's output (the suffix's input); ``halo`` must cover the suffix's reach for exactness.
    ``prefix_tile``: the prefix in tiles of that many latent px (:attr:`.SplitLayout.prefix_units`; 0: whole)."""
    layout.require()
    if should_stop is not None:
        should_stop()
    with torch.no_grad():
        if prefix_tile and layout.prefix_units:
            x = run_units(layout.prefix_units, z, prefix_tile, should_stop)
        else:
            x = layout.prefix(z)

    def tiles_progress(done: int, total: int) -> None:
        if progress is not None:
            progress(done + 1, total + 1)

    tiles_progress(0, 0)
    with torch.no_grad():
        return decode_generic(
            lambda t: layout.suffix(t).float(),
            x,
            tile,
            halo,
            scale=None,
            out_device=out_device or z.device,
            out_dtype=torch.float32,
            feather=0,
            progress=tiles_progress,
            should_stop=should_stop,
            fault_hook=fault_hook,
            oom_exceptions=oom_exceptions,
            on_oom=on_oom,
            min_tile=min_tile,
        )


def decode_split_into(out: torch.Tensor, layout: SplitLayout, z: torch.Tensor, tile: int | tuple[int, int], halo: int,
                      process: Callable[[torch.Tensor], torch.Tensor], **kw: Any) -> None:
    """One item of an image decode: :func:`decode_split`, ``process``ed (the host's output processing) into ``out``,
    its row of the output (1, H, W, C). The keywords as :func:`decode_split`'s."""
    img = decode_split(layout, z, tile, halo, **kw)
    out.copy_(process(img).movedim(1, -1))
