"""Thin ComfyUI adapters, one file per node. Imported only by ComfyUI (see ``comfy_entrypoint``).

Node ids are permanent once shipped: every id carries the ``VRAMFit_`` prefix and never changes.
"""

from __future__ import annotations

from comfy_api.v0_0_2 import ComfyExtension, io


def node_classes() -> list[type[io.ComfyNode]]:
    """All node classes of the pack, in menu order (each node module adds itself here)."""
    classes: list[type[io.ComfyNode]] = []
    from .tiled_vae_decode import TiledVAEDecode

    classes.append(TiledVAEDecode)
    from .tiled_vae_encode import TiledVAEEncode

    classes.append(TiledVAEEncode)
    from .inpaint_encode import VAEEncodeForInpaint

    classes.append(VAEEncodeForInpaint)
    from .video_decode import TemporalChunkVideoDecode

    classes.append(TemporalChunkVideoDecode)
    from .video_encode import TemporalChunkVideoEncode

    classes.append(TemporalChunkVideoEncode)
    from .offload_manager import OffloadManager

    classes.append(OffloadManager)
    from .bf16_loader import Bf16Loader

    classes.append(Bf16Loader)
    from .vram_monitor import VRAMMonitor

    classes.append(VRAMMonitor)
    return classes


class VRAMFitExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()
