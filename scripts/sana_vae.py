"""Sana's DC-AE the way the Sana workflows load it: a stand-in for ComfyUI_ExtraModels' ``ExtraVAELoader``.

ComfyUI has no DC-AE. The Sana workflows load it with ComfyUI_ExtraModels' ``ExtraVAELoader``
(lawrence-cj/ComfyUI_ExtraModels ``VAE/nodes.py`` and ``VAE/loader.py`` @ 08cff2c6, recorded in
``scripts/workflow_declarations.json``), which returns its ``EXVAE``: a ``comfy.sd.VAE`` subclass that skips
``VAE.__init__``, moves its weights itself and overrides ``decode``. :func:`load_dcae` builds an object with
the same contract around diffusers' ``AutoencoderDC`` (the architecture, :data:`DCAE_SANA_CONFIG`; the fixture
file is ``scripts/fixtures``' ``dcae_sana``, :mod:`scripts.fixtures.image`):

* attributes ``latent_dim`` (the latent *channels*, 32, as EXVAE sets it), ``latent_scale`` (32),
  ``device`` / ``offload_device`` (ComfyUI's VAE devices), ``vae_dtype``, ``first_stage_model``, no
  ``patcher`` (ComfyUI's model management never sees it);
* ``first_stage_model.decode(z)`` returns a tensor on [-1, 1] (ExtraModels' own DC-AE class does);
* ``decode(samples)``: weights to the device, batches sized from free memory, ``clamp((x + 1) / 2)``,
  weights back to the offload device; returns (B, H, W, 3) float32 on the CPU;
* ``first_stage_model.encode(x)`` returns the latent tensor (ExtraModels' DC-AE class does);
* ``encode(pixels)``: weights to the device, batches sized from free memory, ``(2 x - 1)`` in the VAE's dtype,
  no crop (sides must be multiples of 32), weights back; returns (B, 32, H / 32, W / 32) float32 on the CPU.

EXVAE's fallbacks after an out-of-memory error (three offset tiled passes) are not reproduced: the decodes
here never need it, and a test that reached it would fail loudly rather than pass on another path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("vramfit.sana_vae")

LATENT_SCALE = 32
DECODE_BYTES_PER_LATENT_PX = 2562 * 64 * 1.7
"""EXVAE's own estimate of a decode's memory per latent pixel (bytes), used to size its batches."""
ENCODE_BYTES_PER_PX = 2078 * 1.7
"""EXVAE's own estimate of an encode's memory per image pixel (bytes)."""

# dc-ae-f32c32-sana-1.0 (ComfyUI_ExtraModels VAE/conf.py "dcae-f32c32-sana-1.0-diffusers", as recorded in
# scripts/workflow_declarations.json), in diffusers' AutoencoderDC argument names.
DCAE_SANA_CONFIG = {
    "in_channels": 3,
    "latent_channels": 32,
    "attention_head_dim": 32,
    "encoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "decoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "encoder_layers_per_block": [2, 2, 2, 3, 3, 3],
    "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
    "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "upsample_block_type": "interpolate",
    "downsample_block_type": "Conv",
    "decoder_norm_types": "rms_norm",
    "decoder_act_fns": "silu",
    "scaling_factor": 0.41407,
}


def _dcae_class() -> type:
    from diffusers import AutoencoderDC

    class DCAE(AutoencoderDC):
        """``AutoencoderDC`` whose ``encode`` and ``decode`` return tensors (as ExtraModels' DC-AE class)."""

        def encode(self, x: torch.Tensor, return_dict: bool = False) -> torch.Tensor:  # type: ignore[override]
            return super().encode(x, return_dict=False)[0]

        def decode(self, z: torch.Tensor, return_dict: bool = False) -> torch.Tensor:  # type: ignore[override]
            return super().decode(z, return_dict=False)[0]

    return DCAE


def load_dcae(path: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """Load a ``dc-ae-f32c32-sana-1.0`` safetensors file as ExtraModels' ``ExtraVAELoader`` does."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    class SanaDCAE(comfy.sd.VAE):
        """ComfyUI_ExtraModels' ``EXVAE`` contract for an ``AutoencoderDC`` (see the module docstring)."""

        def __init__(self, model: torch.nn.Module, dtype: torch.dtype):  # no VAE.__init__, as EXVAE
            self.latent_dim = int(DCAE_SANA_CONFIG["latent_channels"])
            self.latent_scale = LATENT_SCALE
            self.device = mm.vae_device()
            self.offload_device = mm.vae_offload_device()
            self.vae_dtype = dtype
            self.first_stage_model = model.eval().to(dtype).to(self.offload_device)

        def decode(self, samples_in: torch.Tensor) -> torch.Tensor:
            self.first_stage_model = self.first_stage_model.to(self.device)
            try:
                per_item = DECODE_BYTES_PER_LATENT_PX * samples_in.shape[2] * samples_in.shape[3]
                mm.free_memory(per_item, self.device)
                batch = max(1, int(mm.get_free_memory(self.device) / per_item))
                b, _, h, w = samples_in.shape
                out = torch.empty((b, 3, h * self.latent_scale, w * self.latent_scale), device="cpu")
                for i in range(0, b, batch):
                    z = samples_in[i : i + batch].to(self.vae_dtype).to(self.device)
                    x = self.first_stage_model.decode(z).cpu().float()
                    out[i : i + batch] = torch.clamp((x + 1.0) / 2.0, min=0.0, max=1.0)
            finally:
                self.first_stage_model = self.first_stage_model.to(self.offload_device)
            return out.movedim(1, -1)

        def encode(self, pixel_samples: torch.Tensor) -> torch.Tensor:
            self.first_stage_model = self.first_stage_model.to(self.device)
            try:
                pixels = pixel_samples.movedim(-1, 1)
                b, _, h, w = pixels.shape
                per_item = ENCODE_BYTES_PER_PX * h * w
                mm.free_memory(per_item, self.device)
                batch = max(1, int(mm.get_free_memory(self.device) / per_item))
                r = self.latent_scale
                out = torch.empty((b, self.latent_dim, h // r, w // r), device="cpu")
                for i in range(0, b, batch):
                    x = (2.0 * pixels[i : i + batch] - 1.0).to(self.vae_dtype).to(self.device)
                    out[i : i + batch] = self.first_stage_model.encode(x).cpu().float()
            finally:
                self.first_stage_model = self.first_stage_model.to(self.offload_device)
            return out

    with torch.device("meta"):  # the file's tensors are assigned below: no random init of 312M weights
        model = _dcae_class()(**DCAE_SANA_CONFIG)
    sd = comfy.utils.load_torch_file(str(path))
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{path}: not a dc-ae-f32c32-sana-1.0 file (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return SanaDCAE(model, dtype)
