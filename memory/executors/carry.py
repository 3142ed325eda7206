"""Exact temporal chunks of a causal video decoder without a host cache (:mod:`..vae.carry_layout`): chunks of
latent frames ``[1, k, k, ...]`` decoded by the host's own ``first_stage_model.decode``, with the described
modules' forwards swapped (for this call only) for ones that read the previous chunk's last input frames
instead of the clip's start padding. Every frame then sees the inputs it sees in the whole decode: equal to it
up to float rounding. Whole frames (per-frame norms over space: no spatial tiles).

An OOM inside a chunk restores the carried context saved at its start, halves ``k`` and resumes there
(finished frames are kept); at ``k = 1`` it propagates. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..oom import OomEvent, oom_types
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
    progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Decode ``z`` ``(B, C, T, h, w)`` into ``out`` ``(B, 3, frames, H, W)`` (any dtype/device), one batch
    item at a time, in chunks of 1 then ``k`` latent frames; returns ``out``. ``progress(done, total)`` per
    chunk; ``should_stop()`` before each; ``fault_hook(step)`` inside each chunk attempt (tests)."""
    layout.require()
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    b_total, t = int(z.shape[0]), int(z.shape[2])
    dev = torch.device(compute_device)
    run = {"k": max(1, int(k)), "step": 0, "shrinks": 0, "chunks": 0, "pos": 0, "stop": 0}
    for b in range(b_total):
        states: dict = {"first": True}
        run["pos"], frame = 0, 0
        while run["pos"] < t:
            saved = _copy(states)

            def attempt(b: int = b, states: dict = states) -> torch.Tensor:
                pos = run["pos"]
                run["stop"] = stop = 1 if pos == 0 else min(t, pos + run["k"])
                driver.check_stop()
                run["step"] += 1
                with torch.no_grad(), carried(layout, states):
                    if fault_hook is not None:
                        fault_hook(run["step"] - 1)
                    return model.decode(z[b : b + 1, :, pos:stop].to(dtype).to(dev))

            def recover(event: OomEvent, saved: dict = saved, states: dict = states) -> None:
                states.clear()
                states.update(_copy(saved))
                run["k"] = max(1, run["k"] // 2)
                run["shrinks"] += 1
                log.warning("carried chunks: out of memory (%s); resuming with %d latent frames per chunk",
                            event.type_name, run["k"])

            frames = driver.run(attempt, can_recover=lambda e: run["stop"] - run["pos"] > 1, recover=recover)
            n = int(frames.shape[2])
            if n == 0 or frame + n > out.shape[2]:
                raise RuntimeError(f"chunk [{run['pos']}, {run['stop']}) decoded to {n} frames at frame "
                                   f"{frame}; the output has {out.shape[2]}")
            out[b : b + 1, :, frame : frame + n].copy_(frames)
            del frames
            frame += n
            states["first"] = False
            run["chunks"] += 1
            run["pos"] = run["stop"]
            if progress is not None:
                progress(b * t + run["pos"], b_total * t)
        if frame != out.shape[2]:
            raise RuntimeError(f"carried chunks gave {frame} frames; the output has {out.shape[2]}")
    if stats is not None:
        stats.update(exact=True, chunks=run["chunks"], units=run["chunks"], frames_per_chunk=run["k"],
                     tile=None, shrinks=run["shrinks"])
    return out


def _copy(states: dict) -> dict:
    """A snapshot of the carried context (each module's dict copied; its tensors are replaced, never
    changed)."""
    return {key: dict(v) if isinstance(v, dict) else v for key, v in states.items()}
