"""VAE Encode for Inpaint (VRAM Fit): core ``VAEEncodeForInpaint`` (crop, grown mask, masked pixels set to grey,
``noise_mask``) with its encode done by Tiled VAE Encode's engine, within a memory budget and exactly.

The host's own node does the inpaint preprocessing (each host's, unchanged); it is handed a thin stand-in for the
VAE whose ``encode`` runs :func:`.tiled_vae_encode.encode` (every other attribute is the VAE's own), so the latent
equals ``VAEEncodeForInpaint``'s and the report is the engine's.
"""

from __future__ import annotations

from typing import Any

import torch
from comfy_api.v0_0_2 import io

from ..memory.plan.encode import encode_ratio
from . import _comfy
from .tiled_vae_encode import encode, encode_schema, node_output

NODE_ID = "VRAMFit_VAEEncodeForInpaint"
DISPLAY_NAME = "VAE Encode for Inpaint (VRAM Fit)"
REPORT_NODE = "VAE Encode for Inpaint"


class _EngineVAE:
    """The VAE, except that ``encode`` runs the engine (and keeps its result for the report); for a VAE that skips
    ``VAE.__init__`` (ComfyUI_ExtraModels' EXVAE: Sana's DC-AE) also the encode ratio the host's preprocessing reads
    (its ``latent_scale``), where the core node fails."""

    def __init__(self, vae: Any, **settings: Any):
        self._vae, self._settings, self.result = vae, settings, None

    def __getattr__(self, name: str) -> Any:
        if not hasattr(self._vae, "downscale_ratio"):
            if name == "downscale_ratio":  # 0.3.75's node
                return encode_ratio(self._vae)
            if name == "spacial_compression_encode":  # 0.33's
                return lambda: encode_ratio(self._vae)
        return getattr(self._vae, name)

    def encode(self, pixels: Any) -> Any:
        self.result = encode(self._vae, pixels, node=REPORT_NODE, host=lambda: self._vae.encode(pixels),
                             **self._settings)
        return self.result.latent


def encode_inpaint(vae: Any, pixels: Any, mask: Any, grow_mask_by: int = 6, tile_size: int = 0,
                   budget_mb: int = 0, unload_others: bool = True, node_id: str | None = None) -> tuple[dict, Any]:
    """``(latent dict, EncodeResult)``: what ``VAEEncodeForInpaint`` returns, its encode by the engine."""
    import nodes as comfy_nodes  # ComfyUI's own node module (the host's preprocessing)

    if vae is None or getattr(vae, "first_stage_model", None) is None:
        raise _comfy.NodeInputError(REPORT_NODE, f"vae: expected a VAE (from Load VAE or a checkpoint), got "
                                    f"{type(vae).__name__}")
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 3):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise _comfy.NodeInputError(REPORT_NODE, f"mask {shape}: expected a MASK (B, H, W), as Load Image gives")
    proxy = _EngineVAE(vae, tile_size=int(tile_size), budget_mb=int(budget_mb), unload_others=bool(unload_others),
                       node_id=node_id)
    (latent,) = comfy_nodes.VAEEncodeForInpaint().encode(proxy, pixels, mask, int(grow_mask_by))
    return latent, proxy.result


class VAEEncodeForInpaint(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return encode_schema(
            NODE_ID,
            DISPLAY_NAME,
            "VAE Encode (for Inpainting) within a memory budget: ComfyUI's own preprocessing (the grown mask, "
            "masked pixels set to grey, the noise mask), the encode by Tiled VAE Encode (exact for the KL VAEs: "
            "the same latent as the core node).",
            pixels="The image to inpaint (as VAE Encode (for Inpainting) takes it).",
            vae="The VAE used for encoding.",
            extra=(
                io.Mask.Input("mask", tooltip="Where to inpaint (1 = repaint)."),
                io.Int.Input("grow_mask_by", default=6, min=0, max=64, step=1,
                             tooltip="Grow the mask by this many pixels (as the core node) so the inpainted area "
                             "blends in latent space."),
            ),
            tile="Tile side in pixels. 0 = auto: the encoder's own forward when it fits the budget, else the "
            "largest tile whose predicted peak fits.",
            latent="The latent with its noise mask (same as VAE Encode (for Inpainting)).",
        )

    @classmethod
    def execute(cls, pixels, vae, mask, grow_mask_by=6, tile_size=0, budget_mb=0, unload_others=True
                ) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        latent, result = encode_inpaint(vae, pixels, mask, grow_mask_by, tile_size, budget_mb, unload_others,
                                        node_id)
        return node_output(latent, result)
