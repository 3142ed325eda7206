"""Tiled VAE Encode (VRAM Fit): encodes images within a memory budget, exactly (same latent as VAE Encode).

The ComfyUI adapter: the schema, input validation, ComfyUI's own crop and input processing (as ``VAE.encode``
does them), and the wiring of ComfyUI's callables into ``memory.decode.encode.encode_image``, which checks the
exact walker once on this host, plans (the encoder's own forward when it fits, else exact tiles), re-plans
after out-of-memory errors and writes the report. Encoders the walker cannot run take the host's own
``VAE.encode``. Design: docs/ENCODE.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from comfy_api.v0_0_2 import io, ui

from ..memory.decode.encode import REPORT_NODE, EncodeResult, encode_image, make_job
from ..memory.decode.env import DecodeEnv
from ..memory.decode.guard import HostResult
from ..memory.plan.encode import encode_ratio
from . import _comfy, _decode_node

log = logging.getLogger("vramfit.nodes.tiled_vae_encode")

NODE_ID = "VRAMFit_TiledVAEEncode"
DISPLAY_NAME = "Tiled VAE Encode (VRAM Fit)"
MIN_TILE_PX = 32

_FAULT_HOOK: Callable[[str, int], None] | None = None
"""Test hook (``DecodeEnv.fault_hook``): ``("tile", k)`` inside every tile attempt, ``("pass", i)`` before
every untiled item; raise an out-of-memory exception there to exercise the recovery paths."""


def _error(message: str, node: str = REPORT_NODE) -> _comfy.NodeInputError:
    return _comfy.NodeInputError(node, message)


def _validate(vae: Any, pixels: Any, tile_size: int, node: str = REPORT_NODE) -> Any:
    """The encode job of the checked IMAGE, its pixels processed as ``VAE.encode`` processes them (a video VAE
    takes the batch as frames: (1, 3, T, H, W))."""
    if vae is None or getattr(vae, "first_stage_model", None) is None:
        raise _error(f"vae: expected a VAE (from Load VAE or a checkpoint), got {type(vae).__name__}", node)
    if not isinstance(pixels, torch.Tensor) or pixels.ndim != 4 or pixels.shape[-1] not in (3, 4):
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise _error(
            f"pixels {shape}: expected an IMAGE (B, H, W, 3), as Load Image gives (RGB; a 4th "
            "alpha channel is dropped)", node
        )
    video = getattr(vae, "latent_dim", 2) == 3 and not getattr(vae, "not_video", False)
    step = int(vae.spacial_compression_encode()) if video else 8  # a video VAE's tiles are whole latent px
    least = 2 * step if video else MIN_TILE_PX
    if tile_size < 0 or (tile_size and (tile_size % step or tile_size < least)):
        raise _error(f"tile_size {tile_size}: use 0 (auto) or a multiple of {step} of at least {least} px", node)
    if hasattr(vae, "throw_exception_if_invalid"):
        vae.throw_exception_if_invalid()
    core = _initialised(vae)
    cropped = vae.vae_encode_crop_pixels(pixels) if core else _centre_crop(pixels, encode_ratio(vae))
    if min(cropped.shape[1], cropped.shape[2]) < 1:
        raise _error(f"pixels {tuple(pixels.shape)}: smaller than one latent pixel of this VAE", node)
    x = cropped[..., : getattr(vae, "output_channels", 3)].movedim(-1, 1)  # as the host: RGB (0.33: its channels)
    if video:
        x = x.movedim(1, 0).unsqueeze(0)  # as VAE.encode: the frames of one video
    # As VAE.encode (and EXVAE's encode: 2x - 1): in float32 on the intermediate device, then the VAE's dtype.
    x = (vae.process_input(x) if core else x * 2.0 - 1.0).to(vae.vae_dtype)
    return make_job(vae, x, _comfy.intermediate_device(), tile_size=tile_size, pixels=pixels)


def _initialised(vae: Any) -> bool:
    """False for a VAE that skips ``VAE.__init__`` (ComfyUI_ExtraModels' EXVAE: Sana's DC-AE): it has none of the
    encode attributes ComfyUI's ``VAE`` sets there (``process_input``, ``downscale_ratio``, ``crop_input``)."""
    return hasattr(vae, "process_input")


def _centre_crop(pixels: torch.Tensor, ratio: int) -> torch.Tensor:
    """The centred crop of H and W to multiples of ``ratio`` that ``VAE.vae_encode_crop_pixels`` makes, for a VAE
    without it (EXVAE's own encode does not crop: it fails on such sides)."""
    h, w = (int(pixels.shape[1]) // ratio) * ratio, (int(pixels.shape[2]) // ratio) * ratio
    y, x = (int(pixels.shape[1]) - h) // 2, (int(pixels.shape[2]) - w) // 2
    return pixels[:, y : y + h, x : x + w, :]


def comfy_env(node_id: str | None = None) -> DecodeEnv:
    """ComfyUI's callables for ``encode_image`` (and this module's test hook, read now)."""
    return _decode_node.comfy_env(node_id, _FAULT_HOOK)


def _as_vae_encode(vae: Any, result: EncodeResult) -> torch.Tensor:
    """The latent as ``VAE.encode`` returns it: on the intermediate device, in the VAE's output dtype, in its
    latent format (the host path's latent already is)."""
    if result.plan.path == "host":
        return result.latent
    core = _initialised(vae) and hasattr(vae, "vae_output_dtype")  # 0.3.75 has none
    out_dtype = vae.vae_output_dtype() if core else torch.float32  # EXVAE's encode: .float()
    latent = result.latent.to(_comfy.intermediate_device()).to(out_dtype)
    fmt = getattr(vae, "format_encoded", None)
    return fmt(latent) if fmt is not None else latent


def encode(
    vae: Any,
    pixels: Any,
    tile_size: int = 0,
    budget_mb: int = 0,
    unload_others: bool = True,
    node_id: str | None = None,
    node: str = REPORT_NODE,
    host: Callable[[], Any] | None = None,
) -> EncodeResult | HostResult:
    """Everything the node does (``node``: the name errors give); the result's ``latent`` is what VAE Encode
    returns. When the pack's own path fails: ``host()`` (default: VAE Encode's latent) instead
    (:func:`._decode_node.guarded`)."""
    t0 = time.perf_counter()
    env = comfy_env(node_id)

    def own() -> EncodeResult:
        job = _validate(vae, pixels, int(tile_size), node)
        result = encode_image(job, env, budget_mb=int(budget_mb), unload_others=bool(unload_others), t_start=t0)
        result.latent = _as_vae_encode(vae, result)
        result.report.node = node  # titled by the node that ran it
        return result

    if host is None:
        host = lambda: _comfy.core_node("VAEEncode").encode(vae, pixels)[0]["samples"]  # noqa: E731
    return _decode_node.guarded(node, env, own, host, vae=vae, budget_mb=int(budget_mb), work="encode")


def encode_schema(node_id: str, display_name: str, description: str, *, pixels: str, vae: str, tile: str,
                  latent: str, extra: tuple = ()) -> io.Schema:
    """The schema the three encode nodes share: ``pixels``, ``vae``, ``extra`` inputs, ``tile_size``, the
    budget inputs; a LATENT and the report (tooltips given)."""
    return io.Schema(
        node_id=node_id,
        display_name=display_name,
        category=_comfy.CATEGORY,
        description=description,
        inputs=[
            io.Image.Input("pixels", tooltip=pixels),
            io.Vae.Input("vae", tooltip=vae),
            *extra,
            io.Int.Input("tile_size", default=0, min=0, max=16384, step=8, tooltip=tile),
            *_decode_node.budget_inputs(),
        ],
        outputs=[
            io.Latent.Output("LATENT", display_name="LATENT", tooltip=latent),
            _decode_node.report_output("The plan report: path, budget, offload, tiles, predicted and measured peak, "
                                       "time."),
        ],
        hidden=[io.Hidden.unique_id],
    )


def node_output(latent: dict, result: EncodeResult | HostResult) -> io.NodeOutput:
    """The node's outputs: the latent dict and the report (logged, and shown on the node)."""
    text = result.report.text()
    log.info("%s", text)
    return io.NodeOutput(latent, text, ui=ui.PreviewText(text))


class TiledVAEEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return encode_schema(
            NODE_ID,
            DISPLAY_NAME,
            "Encodes images within a memory budget. GroupNorm KL VAEs (SD1.x/SD2/SDXL/SD3, FLUX.1/FLUX.2) and "
            "Hunyuan Image 2.1 encode exactly (same latent as VAE Encode, proven once per host by a self-check) in "
            "tiles sized from free memory, with GroupNorm statistics shared across tiles; Sana's DC-AE exactly with "
            "its local stages in tiles and its attention stages once; video VAEs (Wan, "
            "LTX-Video, HunyuanVideo 1.5) encode as Temporal-Chunk Video Encode; other VAEs take their own encode.",
            pixels="The images to encode (as VAE Encode takes them).",
            vae="The VAE used for encoding.",
            tile="Tile side in pixels (at every encoder level). 0 = auto: the encoder's own forward when it fits "
            "the budget, else the largest tile whose predicted peak fits.",
            latent="The latent (same as VAE Encode).",
        )

    @classmethod
    def execute(cls, pixels, vae, tile_size=0, budget_mb=0, unload_others=True) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = encode(vae, pixels, tile_size, budget_mb, unload_others, node_id)
        return node_output({"samples": result.latent}, result)
