"""Tiled VAE Decode (VRAM Fit): decodes an image latent within a memory budget, exactly where it can.

This file is the ComfyUI adapter: the schema, input validation and the wiring of ComfyUI's callables
(cancel, cache flush, OOM type, progress bar, free memory, offload, weight loading, cost-model caches,
bounded mid-block attention, GroupNorm weight casting) into ``memory.decode.image.decode_image``, which
chooses the path (untiled / exact tiles / approximate tiles), plans, re-plans after out-of-memory
errors, decodes the batch and writes the report (see its docstring and docs/TILED_DECODE.md). Single
frames of a video VAE (a 4-D latent on Wan, Qwen-Image...) go to the video engine
(``memory.decode.video.video_engine``); those of a 3-D image VAE (Hunyuan Image 2.1's refiner) are images
(``memory.vae.one_frame``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from comfy_api.v0_0_2 import io

from ..memory.decode.env import DecodeEnv
from ..memory.decode.guard import HostResult
from ..memory.decode.image import REPORT_NODE, DecodeResult, ImageJob
from ..memory.decode.video import VideoDecodeResult, VideoJob
from . import _comfy, _decode_node, video_decode
from ._route import job_for

log = logging.getLogger("vramfit.nodes.tiled_vae_decode")

NODE_ID = "VRAMFit_TiledVAEDecode"
DISPLAY_NAME = "Tiled VAE Decode (VRAM Fit)"
MIN_TILE_PX = 32

_FAULT_HOOK: Callable[[str, int], None] | None = None
"""Test hook (``DecodeEnv.fault_hook``): called as ``("tile", k)`` inside every tile attempt of the
executors and ``("pass", i)`` before every pass; raise an out-of-memory exception there to exercise the
recovery paths. Read when a decode starts."""
MEASURE_CPU_TENSORS = True
"""``DecodeEnv.measure_cpu_tensors``: on CPU, the report's measured peak is the live tensor bytes
(``PeakTracker`` dispatch mode: the figure the budget bounds; its hook on every op cost 1-2.5 % of the decode,
measured in docs/BENCHMARKS.md). False: the process RSS high-water mark (2-4x the tensor peak, not comparable
with the budget)."""

def _error(message: str) -> _comfy.NodeInputError:
    return _comfy.NodeInputError(REPORT_NODE, message)


def _widgets(tile_size: int, halo: int) -> None:
    """The node's own inputs (VAE Decode has none of them): a bad value is the user's input error."""
    if tile_size < 0 or (tile_size and (tile_size % 8 or tile_size < MIN_TILE_PX)):
        raise _error(f"tile_size {tile_size}: use 0 (auto) or a multiple of 8 of at least {MIN_TILE_PX} px")
    if halo < -1:
        raise _error(f"halo {halo}: use -1 (auto: the decoder's convolutional reach) or >= 0 latent px")


def _checked(vae: Any, samples: Any, tile_size: int, halo: int
             ) -> tuple[ImageJob | VideoJob, Callable[..., Any], str]:
    """``(job, decode, note)``: the engine the VAE needs (:func:`._route.job_for`: a video latent goes to the video
    engine, as Temporal-Chunk Video Decode decodes it, so that every latent VAE Decode takes decodes here too)."""
    _widgets(tile_size, halo)
    return job_for(REPORT_NODE, vae, samples, "first stream", tile_size=tile_size, halo=halo)


def _validate(vae: Any, samples: Any, tile_size: int, halo: int) -> ImageJob | VideoJob:
    """The job of :func:`_checked`."""
    return _checked(vae, samples, tile_size, halo)[0]


def comfy_env(node_id: str | None = None) -> DecodeEnv:
    """ComfyUI's callables for ``decode_image`` (and the test hooks of this module, read now)."""
    return _decode_node.comfy_env(node_id, _FAULT_HOOK, MEASURE_CPU_TENSORS)


def decode(
    vae: Any,
    samples: dict,
    tile_size: int = 0,
    halo: int = -1,
    budget_mb: int = 0,
    unload_others: bool = True,
    node_id: str | None = None,
    allow_approximate: bool = False,
) -> DecodeResult | VideoDecodeResult | HostResult:
    """Everything the node does; returns the images (B, H, W, C) on [0, 1] and the report (single frames of a
    video VAE: the video engine's result). ``allow_approximate``: approximate tiles (or chunks) that measure under
    30 dB against VAE Decode may run (else the host's own decode). When the pack's own path fails: VAE Decode's
    result (:func:`._decode_node.guarded`)."""
    t0 = time.perf_counter()
    env = comfy_env(node_id)

    def own() -> DecodeResult | VideoDecodeResult:
        job, run, note = _checked(vae, samples, int(tile_size), int(halo))
        result = run(job, env, budget_mb=int(budget_mb), unload_others=bool(unload_others), t_start=t0,
                     allow_approximate=bool(allow_approximate))
        return video_decode.noted(result, REPORT_NODE, note)

    _widgets(int(tile_size), int(halo))
    return _decode_node.guarded(REPORT_NODE, env, own, lambda: _comfy.core_node("VAEDecode").decode(vae, samples)[0],
                                vae=vae, budget_mb=int(budget_mb))


# --------------------------------------------------------------------------------------------------
# Node


class TiledVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=_comfy.CATEGORY,
            description=(
                "Decodes an image latent within a memory budget. GroupNorm KL VAEs (SD1.x/SD2/SDXL/SD3, "
                "FLUX.1/FLUX.2, Hunyuan Image 2.1) and Sana's DC-AE decode exactly (same image as VAE Decode, "
                "no seams, proven once per host by a self-check) in tiles sized from free memory; other VAEs use "
                "single-pass tiles with a halo from the decoder's reach (approximate, their measured dB in the "
                "report) when they measure at least 30 dB against VAE Decode or allow_approximate is on, else "
                "their own decode (exact, flagged over the budget)."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The image latent to decode (4-D; video latents: use the "
                                "Temporal-Chunk Video Decode node)."),
                io.Vae.Input("vae", tooltip="The VAE used for decoding."),
                io.Int.Input("tile_size", default=0, min=0, max=16384, step=8,
                             tooltip="Tile side in output pixels (at every decoder level). 0 = auto: the largest "
                             "tile whose predicted peak fits the budget (untiled when the whole decode fits)."),
                io.Int.Input("halo", default=-1, min=-1, max=256, step=1,
                             tooltip="Approximate path only: latent pixels of context around each tile. -1 = "
                             "auto, the decoder's convolutional reach computed from its modules. The exact "
                             "paths need no halo setting (they ignore it)."),
                *_decode_node.budget_inputs(),
                io.Boolean.Input("allow_approximate", default=False, optional=True,
                                 tooltip="Off (default): a VAE without exact tiles whose approximate tiles measure "
                                 "under 30 dB against VAE Decode (checked once per VAE and tile size) is decoded "
                                 "whole by the host (exact, flagged when over the budget; a set tile_size is then "
                                 "not applied). On: such tiles run (approximate; the report states the measured "
                                 "dB)."),
            ],
            outputs=[
                io.Image.Output("IMAGE", display_name="IMAGE", tooltip="The decoded images (same shape, dtype and range "
                                "as VAE Decode)."),
                _decode_node.report_output("The plan report: path (exact or approximate), "
                                 "budget, offload, tiles, predicted and measured peak, time."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, tile_size=0, halo=-1, budget_mb=0, unload_others=True,
                allow_approximate=False) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = decode(vae, samples, tile_size, halo, budget_mb, unload_others, node_id, allow_approximate)
        return _decode_node.output(result, log)
