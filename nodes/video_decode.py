"""Temporal-Chunk Video Decode (VRAM Fit): decodes a video latent within a memory budget.

This file is the ComfyUI adapter: the schema, input validation and the wiring of ComfyUI's callables
(cancel, cache flush, OOM type, progress bar, free memory, offload, weight loading, the persisted peak
cache under ComfyUI's user folder) into the engine the route chooses (``memory.decode.video.video_engine``):
``decode_chunked`` plans (Wan: exact chunked + tile-major decode, meta-sized peaks), decodes and writes the report;
other video VAEs take the approximate overlap-blend path (see its docstring and docs/VIDEO_DECODE.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from comfy_api.v0_0_2 import io

from ..memory.decode import image as image_engine
from ..memory.decode.env import DecodeEnv
from ..memory.decode.guard import HostResult
from ..memory.decode.video import REPORT_NODE, VideoDecodeResult, VideoJob
from . import _comfy, _decode_node
from ._route import job_for

log = logging.getLogger("vramfit.nodes.video_decode")

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"
DISPLAY_NAME = "Temporal-Chunk Video Decode (VRAM Fit)"

_FAULT_HOOK: Callable[[str, int], None] | None = None
"""Test hook (``DecodeEnv.fault_hook``): called as ``("step", s)`` at every step of the executor (raise an
OOM there to test resumes). Read when a decode starts."""
MEASURE_CPU_TENSORS = True
"""As ``tiled_vae_decode.MEASURE_CPU_TENSORS``: on CPU the live tensor bytes (the figure the budget bounds),
False: the process RSS high-water mark."""

DecodeResult = VideoDecodeResult


def _error(message: str) -> _comfy.NodeInputError:
    return _comfy.NodeInputError(REPORT_NODE, message)


def _widgets(frames_per_chunk: int, tile_size: int) -> None:
    """The node's own inputs (VAE Decode has none of them): a bad value is the user's input error."""
    if frames_per_chunk < 0:
        raise _error(f"frames_per_chunk {frames_per_chunk}: use 0 (auto) or >= 1 latent frames")
    if tile_size < 0:
        raise _error(f"tile_size {tile_size}: use 0 (auto) or a tile side in output pixels")


def _checked(vae: Any, samples: Any, frames_per_chunk: int, tile_size: int
             ) -> tuple[VideoJob | image_engine.ImageJob, Callable[..., Any], str]:
    """``(job, decode, note)``: the engine the VAE needs (:func:`._route.job_for`: an image VAE's latents and the
    one-frame latents of a 3-D image VAE go to Tiled VAE Decode's engine, so that every latent VAE Decode takes
    decodes here too)."""
    _widgets(frames_per_chunk, tile_size)
    return job_for(REPORT_NODE, vae, samples, "video stream", tile_size=tile_size, frames_per_chunk=frames_per_chunk)


def _validate(vae: Any, samples: Any, frames_per_chunk: int, tile_size: int) -> VideoJob | image_engine.ImageJob:
    """The job of :func:`_checked`."""
    return _checked(vae, samples, frames_per_chunk, tile_size)[0]


def noted(result: Any, node: str, note: str) -> Any:
    """``result`` with its report titled for ``node`` and, when the latent was reshaped, a row saying how."""
    result.report.node = node
    if note:
        result.report.insert_after("vae", "input", note)
    return result


def comfy_env(node_id: str | None = None) -> DecodeEnv:
    """ComfyUI's callables for ``decode_video`` (and the test hooks of this module, read now)."""
    return _decode_node.comfy_env(node_id, _FAULT_HOOK, MEASURE_CPU_TENSORS)


def decode(
    vae: Any,
    samples: dict,
    frames_per_chunk: int = 0,
    tile_size: int = 0,
    budget_mb: int = 0,
    unload_others: bool = True,
    node_id: str | None = None,
    allow_approximate: bool = False,
) -> VideoDecodeResult | image_engine.DecodeResult | HostResult:
    """Everything the node does; returns frames ``(B*T, H, W, 3)`` on [0, 1] (as VAEDecode) and the report.
    ``allow_approximate``: an overlap-blend that measures under 30 dB may run (else the host's own decode). When the
    pack's own path fails: VAE Decode's result (:func:`._decode_node.guarded`)."""
    t0 = time.perf_counter()
    env = comfy_env(node_id)

    def own() -> VideoDecodeResult | image_engine.DecodeResult:
        job, run, note = _checked(vae, samples, int(frames_per_chunk), int(tile_size))
        result = run(job, env, budget_mb=int(budget_mb), unload_others=bool(unload_others), t_start=t0,
                     allow_approximate=bool(allow_approximate))
        return noted(result, REPORT_NODE, note)

    _widgets(int(frames_per_chunk), int(tile_size))
    return _decode_node.guarded(REPORT_NODE, env, own, lambda: _comfy.core_node("VAEDecode").decode(vae, samples)[0],
                                vae=vae, budget_mb=int(budget_mb))


# --------------------------------------------------------------------------------------------------
# Node


class TemporalChunkVideoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=_comfy.CATEGORY,
            description=(
                "Decodes a video latent within a memory budget, a few latent frames at a time. Wan 2.1/2.2, "
                "HunyuanVideo 1.5, Mochi, CogVideoX and Cosmos decode exactly (causal context carried across chunks: same "
                "frames as VAE Decode, no blinking at chunk borders), LTX-Video exactly in spatial tiles of "
                "the whole clip; other video VAEs take their own decode when it fits, else overlapping chunks "
                "(approximate, their measured dB in the report) when they measure at least 30 dB against VAE "
                "Decode or allow_approximate is on, else their own decode (exact, flagged over the budget)."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The video latent to decode (5-D: batch, channels, frames, "
                                "height, width). Image latents: use Tiled VAE Decode (VRAM Fit)."),
                io.Vae.Input("vae", tooltip="The video VAE used for decoding (Wan 2.1/2.2, HunyuanVideo 1.5, "
                             "Mochi, CogVideoX and Cosmos exact in chunks, LTX-Video and SeedVR2 in tiles; others "
                             "exact only when their whole decode fits, else approximate)."),
                io.Int.Input("frames_per_chunk", default=0, min=0, max=4096, step=1,
                             tooltip="Latent frames decoded per step after the first (each gives 4 video "
                             "frames; 6 for Mochi, 8 for Cosmos; HunyuanVideo 1.5 takes at least 2; CogVideoX counts video "
                             "frames, a multiple of its own 4; SeedVR2 keeps its own time slices). 0 = auto: the "
                             "fastest chunk whose predicted peak fits the budget."),
                io.Int.Input("tile_size", default=0, min=0, max=16384, step=8,
                             tooltip="Spatial tile side in output pixels (Wan, HunyuanVideo 1.5, LTX-Video, "
                             "SeedVR2; exact with any size). 0 = auto: whole frames when they fit the budget, else the largest "
                             "tiles that do."),
                *_decode_node.budget_inputs(),
                io.Boolean.Input("allow_approximate", default=False, optional=True,
                                 tooltip="Off (default): a video VAE without exact chunks whose overlapping chunks "
                                 "measure under 30 dB against VAE Decode (checked once per VAE) is decoded whole "
                                 "by the host (exact, flagged when over the budget). On: such chunks may run "
                                 "(approximate; the report states the measured dB)."),
            ],
            outputs=[
                io.Image.Output("IMAGE", display_name="IMAGE", tooltip="The decoded frames as one image batch (same shape, "
                                "order and range as VAE Decode: batch x frames flattened)."),
                _decode_node.report_output("The plan report: exact or approximate, budget, "
                                 "chunk size, tiles, cache placement, predicted and measured peak, time."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, frames_per_chunk=0, tile_size=0, budget_mb=0, unload_others=True,
                allow_approximate=False) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = decode(vae, samples, frames_per_chunk, tile_size, budget_mb, unload_others, node_id,
                        allow_approximate)
        return _decode_node.output(result, log)
