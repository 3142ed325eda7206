"""Overlap-blend video decode for VAEs without an exact chunked executor (HunyuanVideo, LTX, Mochi, Cosmos):
overlapping temporal chunks decoded independently by a caller-given ``decode_fn`` (causal state restarts),
placed with ComfyUI's frame formulas and cross-faded as ``comfy.utils.tiled_scale_multidim`` does along time,
accumulated into one output. Not exact. Nothing here imports ComfyUI."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..oom import OomEvent, OomResume, oom_types
from ..run_context import ProgressFn
from ..tiles import overlap_chunks

log = logging.getLogger("vramfit.memory.executors.blend")

__all__ = ["decode_overlap_blend", "frame_fn", "stop_driver"]


def stop_driver(
    oom: tuple[type[BaseException], ...], should_stop: Callable[[], Any] | None, on_oom: Callable[[], None] | None
) -> OomResume:
    """The OOM-resume driver of the video executors; ``should_stop``'s exception propagates, a truthy return
    raises ``InterruptedError`` (through :meth:`.OomResume.check_stop`: never taken for an out-of-memory error)."""

    def stop() -> None:
        if should_stop is not None and should_stop():
            raise InterruptedError("video decode stopped by should_stop()")

    return OomResume(oom, should_stop=stop, on_oom=on_oom)


def frame_fn(f: Callable[[int], Any] | int | float) -> Callable[[int], int]:
    """Frames of ``l`` latent frames by a ComfyUI frame formula (a callable or a ratio), as an int."""
    if callable(f):
        return lambda a: int(round(f(a)))
    return lambda a: int(round(f * a))


def decode_overlap_blend(
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    frames_per_chunk: int,
    overlap: int = 1,
    *,
    upscale_ratio: Callable[[int], Any] | int,
    index_formula: Callable[[int], Any] | int | None = None,
    out: torch.Tensor | None = None,
    out_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Decode ``z`` ``(B, C, T, h, w)`` in overlapping temporal chunks, cross-faded (approximate).

    ``decode_fn(latent_chunk) -> frames (B, C', t, H, W)`` decodes one chunk on its own (the node
    passes ``first_stage_model.decode`` with ComfyUI's dtype/device handling, or a spatially tiled
    decode). ``upscale_ratio``: output frames of a chunk of ``l`` latent frames (callable, e.g. the
    first entry of ``vae.upscale_ratio``: ``lambda a: max(0, 4 a - 3)``, or a number);
    ``index_formula``: output index of latent index ``p`` (the first entry of
    ``vae.upscale_index_formula``, e.g. ``4``: frame ``4 p``; default: ``upscale_ratio``). Chunks of
    ``frames_per_chunk`` latent frames overlap by ``overlap`` (at least 1, as ComfyUI's ``decode_tiled``:
    a chunk starting at latent ``p`` begins at frame ``4 p``, so without overlap the 3 frames before
    it are missing; at most ``frames_per_chunk - 1``);
    each chunk's frames are weighted by ComfyUI's linear feather over ``upscale_ratio(overlap)`` frames
    at both ends and accumulated into one output plus a per-frame weight vector, normalised at the
    end: the same result as ``comfy.utils.tiled_scale_multidim`` along time (with one spatial tile),
    without its second full-size weight tensor.
    ``frames_per_chunk`` is at least 2. On OOM (``oom_exceptions``, default ``torch.OutOfMemoryError``;
    a bare ``Exception`` is ignored) in a chunk, nothing of it was
    accumulated: ``on_oom()``, halve the chunk (not below 2; the overlap shrinks with it) and continue
    from that chunk's start; at 2 the OOM propagates. ``progress(done, total)``
    per chunk; ``should_stop()`` before each; ``fault_hook(step)`` before each decode_fn call.
    """
    if z.ndim != 5:
        raise ValueError(f"expected a (B, C, T, h, w) latent, got shape {tuple(z.shape)}")
    up = frame_fn(upscale_ratio)
    pos_fn = frame_fn(index_formula if index_formula is not None else upscale_ratio)
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    T = int(z.shape[2])
    k = max(2, int(frames_per_chunk))  # a chunk must reach past the overlap
    o = max(1, int(overlap))  # as ComfyUI's decode_tiled: with 0, frames between chunks stay uncovered
    t_out = up(T)
    wsum = None
    step = 0
    done = 0
    shrinks = 0
    chunks: list[tuple[int, int]] = []

    def plan_from(p: int) -> list[tuple[int, int]]:
        oo = min(o, k - 1)
        rest = overlap_chunks(T - p, k, oo) if p < T else []
        return [(p + a, p + b) for a, b in rest]

    todo = plan_from(0)
    a, b = 0, 0

    def attempt() -> torch.Tensor:
        nonlocal a, b, step
        a, b = todo[0]
        driver.check_stop()
        step += 1
        if fault_hook is not None:
            fault_hook(step - 1)
        return decode_fn(z[:, :, a:b])

    def recover(event: OomEvent) -> None:
        nonlocal k, shrinks, todo
        k = max(2, k // 2)
        shrinks += 1
        log.warning("overlap-blend decode: out of memory; resuming with %d latent frames per chunk", k)
        # Re-plan from this chunk's start (already-accumulated chunks end at or after it).
        todo = plan_from(a)

    with torch.no_grad():
        while todo:
            frames = driver.run(attempt, can_recover=lambda e: k > 2, recover=recover)
            if out is None:
                out = torch.zeros(
                    (frames.shape[0], frames.shape[1], t_out, *frames.shape[3:]),
                    dtype=torch.float32,
                    device=torch.device(out_device) if out_device is not None else frames.device,
                )
            if wsum is None:
                out.zero_()
                wsum = torch.zeros(t_out, dtype=torch.float64)
            n = frames.shape[2]
            o0 = pos_fn(a)
            if n != up(b - a) or o0 + n > t_out:
                raise RuntimeError(
                    f"decode_fn gave {n} frames for latent [{a}, {b}) at {o0}; out has {t_out}"
                )
            # ComfyUI's mask: a linear ramp (t + 1) / feather over ``feather = upscale_ratio(overlap)``
            # frames at both ends of every chunk (frames covered by one chunk only normalise it away).
            oo = min(o, k - 1)
            feather = up(oo) if oo > 0 else 0
            wt = torch.ones(n, dtype=torch.float64)
            if 0 < feather < n:
                for i in range(feather):
                    f = (i + 1) / feather
                    wt[i] *= f
                    wt[n - 1 - i] *= f
            for i in range(n):
                out[:, :, o0 + i].add_(frames[:, :, i].to(out.device, out.dtype), alpha=float(wt[i]))
            wsum[o0 : o0 + n] += wt
            del frames
            chunks.append((a, b))
            todo.pop(0)
            done += 1
            if progress is not None:
                progress(done, done + len(todo))
    if out is None or wsum is None:
        raise ValueError("empty latent")
    if bool((wsum <= 0).any()):
        raise RuntimeError("some output frames were not covered by any chunk")
    out.div_(wsum.to(out.device, out.dtype).view(1, 1, -1, *([1] * (out.ndim - 3))))
    if stats is not None:
        stats.update(
            exact=False,
            chunks=len(chunks),
            ranges=chunks,
            steps=step,
            shrinks=shrinks,
            frames_per_chunk=k,
            overlap=min(o, k - 1),
        )
    return out
