"""VRAM Fit: a ComfyUI custom-node pack that makes VAE decoding fit the VRAM a user has.

Importing this package has no side effects and needs no ComfyUI: ``memory/`` (the engine) is
plain Python + torch and can be imported and unit-tested alone. ComfyUI finds the nodes through
``comfy_entrypoint`` (the V3 extension API, ``comfy_api.v0_0_2``), which imports ``nodes/`` and
therefore ComfyUI only when ComfyUI itself calls it.
"""

from __future__ import annotations

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]

WEB_DIRECTORY = "./web"
"""The pack's frontend extension (``web/js/vramfit.js``: the reports on the nodes), served by ComfyUI's
loader from this module attribute under ``/extensions/<pack folder>/`` (the V3 API has no web entry)."""


async def comfy_entrypoint():
    """Called by ComfyUI's custom-node loader; returns the pack's ``ComfyExtension``."""
    from .nodes import VRAMFitExtension

    return VRAMFitExtension()
