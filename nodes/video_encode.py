"""Temporal-Chunk Video Encode (VRAM Fit): encodes video frames within a memory budget, exactly (same latent as
VAE Encode).

The ComfyUI adapter of the video side of ``memory.decode.encode``: the frames take the host's own crop and
input processing (as ``VAE.encode``), then Wan 2.1/2.2, LTX-Video and HunyuanVideo 1.5 encode in spatial tiles
whose local part runs through the host's own causal chunk loop (:mod:`..memory.executors.split_encode`, the
families described in :mod:`..memory.vae.encode_split`); other VAEs take their own encode. The work is
:func:`.tiled_vae_encode.encode` with this node's name. Design: docs/ENCODE.md section 5.
"""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from ..memory.decode.encode import VIDEO_REPORT_NODE
from .tiled_vae_encode import encode, encode_schema, node_output

NODE_ID = "VRAMFit_TemporalChunkVideoEncode"
DISPLAY_NAME = "Temporal-Chunk Video Encode (VRAM Fit)"


class TemporalChunkVideoEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return encode_schema(
            NODE_ID,
            DISPLAY_NAME,
            "Encodes video frames within a memory budget. Wan 2.1/2.2, LTX-Video and HunyuanVideo 1.5 encode "
            "exactly (same latent as VAE Encode, proven once per host by a self-check): the frames go through the "
            "encoder's own causal chunk loop in spatial tiles extended by the encoder's reach, its attention (if "
            "any) on the whole latent. Other VAEs take their own encode.",
            pixels="The video frames to encode, as one image batch (as VAE Encode takes them; Wan and HunyuanVideo "
            "1.5 use 1 + 4k frames, LTX-Video 1 + 8k: later frames are dropped as VAE Encode does).",
            vae="The video VAE used for encoding (Wan 2.1/2.2, LTX-Video, HunyuanVideo 1.5: exact in tiles).",
            tile="Spatial tile side in input pixels (a multiple of the VAE's 8, 16 or 32 px). 0 = auto: the "
            "encoder's own forward when it fits the budget, else the largest tiles that do.",
            latent="The video latent (same as VAE Encode).",
        )

    @classmethod
    def execute(cls, pixels, vae, tile_size=0, budget_mb=0, unload_others=True) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = encode(vae, pixels, tile_size, budget_mb, unload_others, node_id, VIDEO_REPORT_NODE)
        return node_output({"samples": result.latent}, result)
