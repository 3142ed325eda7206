"""Temporal-Chunk Video Encode (VRAM Fit): encodes video frames within a memory budget, exactly (same latent as
VAE Encode).

The ComfyUI adapter of the video side of ``memory.decode.encode``: the frames take the host's own crop and
input processing (as ``VAE.encode``), then Wan 2.1/2.2 encode in spatial tiles whose local part runs through the
host's own causal chunk loop (:mod:`..memory.executors.wan_encode`); other VAEs take their own encode. The work
is :func:`.tiled_vae_encode.encode` with this node's name. Design: docs/ENCODE.md section 5.
"""

from __future__ import annotations

import logging

from comfy_api.v0_0_2 import io, ui

from ..memory.decode.encode import VIDEO_REPORT_NODE
from . import _comfy, _decode_node
from .tiled_vae_encode import encode

log = logging.getLogger("vramfit.nodes.video_encode")

NODE_ID = "VRAMFit_TemporalChunkVideoEncode"
DISPLAY_NAME = "Temporal-Chunk Video Encode (VRAM Fit)"


class TemporalChunkVideoEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=_comfy.CATEGORY,
            description=(
                "Encodes video frames within a memory budget. Wan 2.1/2.2 encode exactly (same latent as VAE "
                "Encode, proven once per host by a self-check): the frames go through the encoder's own causal "
                "chunk loop in spatial tiles extended by the encoder's reach, its middle (per-frame attention) "
                "on whole latent frames. Other VAEs take their own encode."
            ),
            inputs=[
                io.Image.Input("pixels", tooltip="The video frames to encode, as one image batch (as VAE Encode "
                               "takes them; Wan uses 1 + 4k frames, later frames are dropped as VAE Encode does)."),
                io.Vae.Input("vae", tooltip="The video VAE used for encoding (Wan 2.1/2.2 exact in tiles)."),
                io.Int.Input(
                    "tile_size",
                    default=0,
                    min=0,
                    max=16384,
                    step=8,
                    tooltip="Spatial tile side in input pixels (a multiple of the VAE's 8 or 16 px). 0 = auto: "
                    "the encoder's own forward when it fits the budget, else the largest tiles that do.",
                ),
                *_decode_node.budget_inputs(),
            ],
            outputs=[
                io.Latent.Output("LATENT", display_name="LATENT", tooltip="The video latent (same as VAE Encode)."),
                _decode_node.report_output(
                    "The plan report: path, budget, offload, tiles, predicted and measured peak, time."
                ),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, pixels, vae, tile_size=0, budget_mb=0, unload_others=True) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = encode(vae, pixels, tile_size, budget_mb, unload_others, node_id, VIDEO_REPORT_NODE)
        text = result.report.text()
        log.info("%s", text)
        return io.NodeOutput({"samples": result.latent}, text, ui=ui.PreviewText(text))
