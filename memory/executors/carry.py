"""Exact temporal chunks of a causal video decoder (:mod:`..vae.carry_layout`): chunks of latent frames
``[1, k, k, ...]`` (or ``[k, k, ...]``) decoded by the description's chunk function, by default the host's own
``first_stage_model.decode`` with the described modules' forwards swapped (for this call only) for ones that
read the previous chunk's last input frames instead of the clip's start padding. A described prefix (the
decoder's global part) runs first, once per video on the whole latent; the chunks then take its output. Every
frame sees the inputs it sees in the whole decode: equal to it up to float rounding. Whole frames.

An OOM inside a chunk restores the carried context saved at its start, halves ``k`` and resumes there
(finished frames are kept); in place (``rollback`` False: no saved context, the host's memory) it decodes that
tile again from its first chunk with the smaller ``k``; at the smallest ``k`` it propagates. Nothing here imports
ComfyUI.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..oom import OomEvent, oom_types
from ..tiles import spans
from ..vae.carry_layout import CarryLayout
from .blend import stop_driver

log = logging.getLogger("vramfit.memory.executors.carry")

__all__ = ["carried", "decode_carried"]


@contextlib.contextmanager
def carried(layout: CarryLayout, states: dict) -> Iterator[None]:
    """Inside: the layout's modules run their chunk forwards with ``states[module]`` (created on first use;
    ``states["first"]`` says whether this is the clip's first chunk). Restores the modules' own forwards."""
    patched = []
    try:
        for m, fwd in layout.forwards.items():
            st = states.setdefault(id(m), {})

            def run(x: torch.Tensor, m: Any = m, fwd: Any = fwd, st: dict = st) -> torch.Tensor:
                st["first"] = states["first"]
                return fwd(m, x, st)

            m.forward = run
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


def decode_carried(
    model: Any,
    layout: CarryLayout,
    z: torch.Tensor,
    k: int,
    *,
    out: torch.Tensor,
    dtype: torch.dtype,
    compute_device: torch.device | str,
    tile: tuple[int, int] | None = None,
    halo: int = 0,
    rollback: bool = True,
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    stats: dict | None = None,
    sizing: bool = False,
) -> torch.Tensor:
    """Decode ``z`` ``(B, C, T, h, w)`` into ``out`` ``(B, 3, frames, H, W)`` (any dtype/device), one batch
    item at a time, in chunks of 1 then ``k`` latent frames (``k`` from the start where the description says so;
    the whole clip where it does not chunk in time; ``k`` of the description's units, on its chunk grid, where
    its prefix changes the time axis); returns ``out``. ``tile``: spatial tiles of at most ``tile``
    (rows, cols) px of the chunks' input (the prefix's output), each extended by ``halo`` px and decoded through
    every chunk with its own carried context (a description with ``tiles``; None: whole frames). ``rollback``:
    keep the context each chunk starts from (an OOM resumes there with a smaller ``k``); False: the chunks spend
    it as the host does (less memory; an OOM decodes that tile again from its first chunk).
    ``progress(done, total)`` per chunk; ``should_stop()`` before each; ``fault_hook(step)`` inside each chunk
    attempt (tests). A description's ``draws`` (the host's random draws inside the chunks, replayed by each tile)
    are made once per batch item, after its prefix. ``sizing`` (meta sizing only: ``out`` is not a decode): one tile of each shape, and of its
    chunks the first three and the last; the executor allocates the same for every tile of one shape and every
    chunk of one length once the carried context is full (from the third), so the peak is the whole decode's in
    a fraction of the runs."""
    desc = layout.require().description
    if tile is not None and not desc.tiles:
        raise ValueError(f"{layout.family}: its chunks are not spatially local (whole frames only)")
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    b_total = int(z.shape[0])
    dev = torch.device(compute_device)
    run = {"k": 0, "step": 0, "shrinks": 0, "chunks": 0, "pos": 0, "stop": 0, "done": 0, "rollback": rollback}
    for b in range(b_total):
        src = z[b : b + 1]
        if desc.prefix is not None:
            driver.check_stop()
            with torch.no_grad():
                src = desc.prefix(model, src.to(dtype).to(dev))
        draws = desc.draws(model, src) if desc.draws is not None else None
        t, h, w = (int(v) for v in (src[0] if isinstance(src, tuple) else src).shape[2:])
        if not run["k"]:
            run["k"] = desc.fit(int(k) if desc.temporal else t)
        r = int(out.shape[-2]) // h
        th, tw = tile if tile is not None else (h, w)
        grid = [(ys, xs) for ys in spans(h, th, halo) for xs in spans(w, tw, halo)]
        units = b_total * len(grid) * t

        def tick(units: int = units) -> None:
            if progress is not None:
                progress(run["done"], units)

        shapes = set()
        for (y0, y1, ya, yb), (x0, x1, xa, xb) in grid:
            shape = (yb - ya, xb - xa, y1 - y0, x1 - x0)
            if sizing and shape in shapes:
                continue
            shapes.add(shape)
            part = _each(src, lambda s, ya=ya, yb=yb, xa=xa, xb=xb: s[..., ya:yb, xa:xb])
            crop = (slice(None), slice(None), slice(None),
                    slice((y0 - ya) * r, (y1 - ya) * r), slice((x0 - xa) * r, (x1 - xa) * r))
            dst = out[b : b + 1, :, :, y0 * r : y1 * r, x0 * r : x1 * r]
            frames_done = _chunks(model, desc, layout, part, dst, crop, t, run, driver, dtype, dev, fault_hook,
                                  tick, sizing, {"draws": draws, "at": (ya, xa)})
            if frames_done != out.shape[2] and not sizing:
                raise RuntimeError(f"carried chunks gave {frames_done} frames; the output has {out.shape[2]}")
    if stats is not None:
        tiles = None if tile is None else len(grid)
        stats.update(exact=True, chunks=run["chunks"], units=run["chunks"], frames_per_chunk=run["k"],
                     tile=tile, tiles=tiles, shrinks=run["shrinks"], rollback=rollback)
    return out


def _chunks(model: Any, desc: Any, layout: CarryLayout, src: torch.Tensor, dst: torch.Tensor, crop: tuple,
            t: int, run: dict, driver: Any, dtype: torch.dtype, dev: torch.device,
            fault_hook: Callable[[int], None] | None, tick: Callable[[], None], sizing: bool = False,
            given: dict | None = None) -> int:
    """Every chunk of one batch item's (tile's) latent frames ``src`` into ``dst``, with fresh carried
    context; returns the frames written. ``sizing``: the first three chunks and the last (see :func:`decode_carried`).
    ``given``: entries of ``states`` every chunk reads (the description's draws, the tile's origin)."""
    rollback = run["rollback"]
    states: dict = {**(given or {}), "first": True, "rollback": rollback}
    run["pos"], run["frame"], start_done, start_chunks = 0, 0, run["done"], run["chunks"]
    while run["pos"] < t:
        saved = _copy(states) if rollback else None

        def attempt() -> torch.Tensor:
            pos = run["pos"]
            run["stop"] = stop = 1 if pos == 0 and desc.first_alone else min(t, pos + run["k"])
            driver.check_stop()
            run["step"] += 1
            with torch.no_grad(), carried(layout, states):
                if fault_hook is not None:
                    fault_hook(run["step"] - 1)
                part = _each(src, lambda s: s[:, :, pos:stop].to(dtype).to(dev))
                return desc.chunk(model, part, states)[crop]

        def recover(event: OomEvent, saved: dict | None = saved) -> None:
            states.clear()
            if saved is not None:
                states.update(_copy(saved))
            else:  # in place: the chunk spent the carried context; this tile again from its first chunk
                states.update(given or {}, first=True, rollback=False)
                run["pos"], run["frame"], run["done"] = 0, 0, start_done
            run["k"] = desc.fit(run["k"] // 2)
            run["shrinks"] += 1
            log.warning("carried chunks: out of memory (%s); %s with %d %s per chunk", event.type_name,
                        "resuming" if rollback else "restarting the tile", run["k"], desc.unit)

        def can_recover(event: OomEvent) -> bool:
            smaller = run["stop"] - run["pos"] > max(1, desc.min_k) if rollback else run["k"] > desc.min_k
            return desc.temporal and smaller

        frames = driver.run(attempt, can_recover=can_recover, recover=recover)
        n, frame = int(frames.shape[2]), run["frame"]
        if sizing:
            frame = min(frame, int(dst.shape[2]) - n)
        if n == 0 or frame + n > dst.shape[2]:
            raise RuntimeError(f"chunk [{run['pos']}, {run['stop']}) decoded to {n} frames at frame "
                               f"{frame}; the output has {dst.shape[2]}")
        dst[:, :, frame : frame + n].copy_(frames)
        del frames
        run["frame"] = frame + n
        states["first"] = False
        run["chunks"] += 1
        run["done"] += int(run["stop"]) - int(run["pos"])
        run["pos"] = run["stop"]
        if sizing and run["chunks"] - start_chunks == 3:  # skip to the last chunk (k on the grid from here)
            run["pos"] = max(run["pos"], run["pos"] + (t - run["pos"] - 1) // run["k"] * run["k"])
        tick()
    return run["frame"]


def _each(src: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` of the prefix's output: a tensor, or each of a tuple of tensors."""
    return tuple(fn(s) for s in src) if isinstance(src, tuple) else fn(src)


def _copy(states: dict) -> dict:
    """A snapshot of the carried context (each module's dict copied; its tensors are replaced, never
    changed)."""
    return {key: dict(v) if isinstance(v, dict) else v for key, v in states.items()}
