"""What every video decode path writes its frames with: the result, the host's own decode into the output buffer
(the exact fallback of every path) and the post-processing of that buffer in place. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..plan.types import Plan
from ..plan.video_job import VideoJob, host_fn
from ..report import Report
from ..run_context import ProgressFn
from .env import DecodeEnv

__all__ = ["VideoDecodeResult", "buffer_bytes", "host_decode", "output_buffer", "post_process"]


@dataclasses.dataclass
class VideoDecodeResult:
    images: torch.Tensor
    report: Report
    plan: Plan
    budget: Any
    seconds: float
    measured_peak: int | None
    measure_method: str
    stats: dict
    plan_seconds: float


def buffer_bytes(job: VideoJob, frames: int, h: int, w: int) -> int:
    """Bytes of the float32 output buffer of :func:`output_buffer` (the decoded channels: RGBA for Qwen-Image
    2.1's VAE)."""
    return int(job.z.shape[0]) * frames * h * w * job.out_channels * 4


def output_buffer(job: VideoJob, frames: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, view)``: the node's float32 output ``(B * frames, h, w, C)`` on the output device, ``C`` the
    decoded channels (:attr:`..plan.video_job.VideoJob.out_channels`), and its ``(B, C, frames, h, w)`` view that
    the executors write."""
    b, c = int(job.z.shape[0]), job.out_channels
    buf = torch.empty((b * frames, h, w, c), dtype=torch.float32, device=job.out_device)
    return buf, buf.view(b, frames, h, w, c).permute(0, 4, 1, 2, 3)


def host_decode(job: VideoJob, view: torch.Tensor, bar: ProgressFn | None, env: DecodeEnv, stats: dict) -> None:
    """The host's own ``first_stage_model.decode`` per batch item (as ``VAE.decode`` feeds it: the VAE's
    dtype and device; :func:`..plan.video_job.host_fn`), written into the output view."""
    decode = host_fn(job)
    b = int(job.z.shape[0])
    for i in range(b):
        if env.should_stop is not None:
            env.should_stop()
        if bar is not None:
            bar(i, b)
        out = decode(job.z[i : i + 1].to(job.dtype).to(job.device))
        view[i : i + 1].copy_(out)
        del out
    if bar is not None:
        bar(b, b)
    stats.update(exact=True, chunks=b, units=b)
    if job.wan:
        stats["protocol"] = job.protocol.name


def post_process(vae: Any, view: torch.Tensor) -> None:
    """``vae.process_output`` frame by frame, in place in the output buffer (same values as on the whole)."""
    for f in range(view.shape[2]):
        sl = view[:, :, f : f + 1]
        sl.copy_(vae.process_output(sl))
