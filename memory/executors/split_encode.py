"""Exact tiled encode of encoders described as a local prefix and a whole suffix (:func:`encode_split_tiled`; the
descriptions: :mod:`..vae.encode_split`: the video families and Sana's DC-AE).

The prefix (everything the encoder does before its first global module: causal convolutions, norms over
channels, strided or space-to-depth downsampling) runs in spatial tiles extended by its traced reach, each tile
through **the host's own** ``model.encode`` with the suffix swapped out, so the host's own temporal loop (chunk
sizes, causal caches) runs each tile (an image encoder's the same way, without frames). The tiles' cores land in a
store at the prefix's resolution; the suffix then runs once on it through the host's own code. Exact by
construction wherever the split is (the first-use self-check proves it per host). Nothing here imports ComfyUI.
Design: docs/ENCODE.md section 5."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..oom import oom_types
from ..run_context import ProgressFn
from ..tiles import spans
from ..vae.encode_split import EncodeSplit, split_reach
from .blend import stop_driver

__all__ = ["EXECUTOR_VERSION", "MIN_TILE", "encode_split_tiled", "split_halo"]

EXECUTOR_VERSION = "v2"
"""Part of the self-check's key: bump it when a change here could change the result (the stored verdicts are
then re-checked)."""
MIN_TILE = 4
"""Smallest tile core (prefix px) the OOM fallback splits to and the planner tries: with a reach of 10 latent
px, smaller cores hardly shrink a tile's extended area."""


def split_halo(model: Any, split: EncodeSplit, ratio: int, channels: int, dtype: torch.dtype,
               device: torch.device | str, video: bool = True) -> int:
    """Prefix px (``ratio`` image px each) a tile's core is extended by: the prefix's traced reach, rounded up.
    Raises ValueError when a global module runs in the prefix (the description does not fit this encoder)."""
    r = split_reach(model, split, ratio, channels, dtype, torch.device(device), video)
    if r.global_ops:
        raise ValueError(f"the {split.name} encoder's prefix runs global modules: {', '.join(r.global_ops)}")
    return r.halo


def encode_split_tiled(
    model: Any,
    x: torch.Tensor,
    tile: int,
    ratio: int,
    split: EncodeSplit,
    *,
    compute_device: torch.device | str | None = None,
    store_device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: Any = None,
    on_oom: Callable[[], None] | None = None,
    halo: int | None = None,
    size_only: bool | Callable[[], None] = False,
) -> torch.Tensor:
    """Encode processed pixels ``x`` (1, C, T, H, W, or an image's 1, C, H, W; sides multiples of ``ratio``, the
    image px per px of the prefix's output) exactly: ``split``'s prefix in tiles of ``tile`` prefix px (cores)
    extended by ``halo`` (default :func:`split_halo`), its suffix on the prefix's whole output; returns what
    ``model.encode(x)`` returns. An out-of-memory error inside a tile splits that tile into quarters and goes on
    (finished tiles are kept); ``on_oom`` runs after each. ``fault_hook(k)``: called inside the k-th tile attempt
    (tests). ``size_only``: the run is a :class:`..measure.sizing.MetaSizer`'s, to be sized, nothing else: a tile
    whose extended area and core are the shape of one run after the store was made is skipped (on fake tensors a
    run's allocations depend on its shapes alone: the same peak, a fraction of the ops); a callable is called after
    every tile (it may raise to end the sizing: a planner's peak over its budget)."""
    dev = torch.device(compute_device) if compute_device is not None else x.device
    store_dev = torch.device(store_device) if store_device is not None else dev
    out_dev = torch.device(out_device) if out_device is not None else dev
    h, w = int(x.shape[-2]) // ratio, int(x.shape[-1]) // ratio
    if halo is None:
        halo = split_halo(model, split, ratio, int(x.shape[1]), x.dtype, dev, x.ndim == 5)
    queue = [(a, b, c, d) for a, b, _, _ in spans(h, tile, 0) for c, d, _, _ in spans(w, tile, 0)]
    total, done_area, attempts = h * w, 0, 0
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    store: torch.Tensor | None = None
    sized: set[tuple[int, int, int, int]] = set()  # size_only: the shapes (extended area, core) run with the store

    def attempt(rect: tuple[int, int, int, int]) -> torch.Tensor:
        nonlocal attempts
        a, b, c, d = rect
        ea, eb, ec, ed = max(0, a - halo), min(h, b + halo), max(0, c - halo), min(w, d + halo)
        attempts += 1
        if fault_hook is not None:
            fault_hook(attempts)
        px = x[..., ea * ratio : eb * ratio, ec * ratio : ed * ratio].to(dev)
        feats = split.prefix(model, px)
        return feats[..., a - ea : b - ea, c - ec : d - ec].to(store_dev)

    while queue:
        driver.check_stop()
        rect = queue.pop(0)
        a, b, c, d = rect
        if size_only:
            shape = (min(h, b + halo) - max(0, a - halo), min(w, d + halo) - max(0, c - halo), b - a, d - c)
            if shape in sized:
                _sized_tile(size_only)
                continue
            if store is not None:
                sized.add(shape)
        big = max(b - a, d - c) > MIN_TILE
        try:  # an OOM in a tile larger than MIN_TILE: on_oom, then _Split (the smallest re-raises as it came)
            core = driver.run(lambda rect=rect: attempt(rect), can_recover=lambda e, big=big: big, recover=_split)
        except _Split:
            queue[:0] = _quarters(rect)
            continue
        if store is None:
            store = torch.empty((*core.shape[:-2], h, w), dtype=core.dtype, device=store_dev)
        store[..., a:b, c:d] = core
        del core
        done_area += (b - a) * (d - c)
        if progress is not None:
            progress(done_area, total)
        if size_only:
            _sized_tile(size_only)
    driver.check_stop()
    assert store is not None
    try:
        return split.suffix(model, store, dev).to(out_dev)
    except oom_types(oom_exceptions) as e:
        e._vramfit_tail = True  # type: ignore[attr-defined]  # after the tiles: a smaller tile would not help
        raise


def _sized_tile(size_only: bool | Callable[[], None]) -> None:
    if callable(size_only):
        size_only()


class _Split(Exception):
    """Ends :meth:`..oom.OomResume.run` after an OOM in a tile, so the tile loop puts the tile's quarters in its
    place."""


def _split(event: Any) -> None:
    raise _Split


def _quarters(rect: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """A tile's halves along each side longer than :data:`MIN_TILE`, in row-major order."""
    a, b, c, d = rect
    ys = [(a, (a + b) // 2), ((a + b) // 2, b)] if b - a > MIN_TILE else [(a, b)]
    xs = [(c, (c + d) // 2), ((c + d) // 2, d)] if d - c > MIN_TILE else [(c, d)]
    return [(ya, yb, xa, xb) for ya, yb in ys for xa, xb in xs]
