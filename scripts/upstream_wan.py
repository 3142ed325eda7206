"""Qwen-Image 2.1's VAE, its TAESD and a Wan 2.2 VAE built as the newest upstream ``comfy/sd.py`` builds them, as
narrow random-weight models (test harness only; the pack never imports this).

Call the builders inside :func:`scripts.upstream.newest` (the newest ``comfy/ldm/wan/vae2_2.py`` loaded over a ComfyUI
0.33.0 host): the models are that module's classes with the released files' key names. The newest ``sd.py`` itself
does not import over 0.33.0, so :func:`vae_from_state_dict` mirrors its ``VAE.__init__`` for these branches: 0.33.0's
``comfy.sd.VAE(sd={})`` sets every default attribute (and stops, finding no model), then the branch's attributes and
model are set as the newest file sets them, then the end of ``__init__`` (dtype, devices, patcher, state-dict load).
``decode``/``encode`` are 0.33.0's ``VAE`` methods, which already honour ``output_channels`` and ``pad_channel_value``.

What each builder mirrors (``comfy/sd.py`` at Comfy-Org ``033046cc``, ``vae2_2.py`` at ``32671a67``, ``vae.py`` at
``dcbf1c1``; ``tests/upstream/MANIFEST.json``):

* :func:`qwen21_vae`: sd.py lines 837-850 (``decoder.middle.0.residual.0.gamma``, the Wan 2.2 layout and a 5-D
  ``decoder.head.2.weight`` of temporal kernel 1): ``vae2_2.WanVAE(dim, dec_dim, z_dim=64, dim_mult=[1, 2, 4, 8, 8],
  temperal_downsample=[F, T, T, T], image_channels=4, patch_size=1, temporal_kernel=1)``, 16x, RGBA,
  ``pad_channel_value`` 1.0, ``latent_dim`` 2 (the default). ``dim`` / ``dec_dim`` are read from the file, as the
  branch reads them, so a narrow file gives a narrow model of the same structure.
* :func:`qwen21_taesd`: sd.py lines 553-563 (``taesd_decoder.1.weight`` with 64 latent channels):
  ``comfy.taesd.taesd.TAESD(latent_channels=64)``, 16x, RGBA. No newer ``taesd.py`` than 0.33.0's is stored
  (tests/upstream/README.md), so the module is 0.33.0's: an 8x RGB decoder under attributes that say 16x RGBA,
  which is what the newest ``sd.py`` builds over that file.
* :func:`wan22_vae`: sd.py lines 851-862 (Wan 2.2 layout): ``vae2_2.WanVAE(dim=160, z_dim=48, ...)`` with a quarter
  of the widths (``dim`` 40, ``dec_dim`` 64, as ``scripts.fixtures.narrow.narrow_host`` narrows it), video geometry
  (``latent_dim`` 3, 4x time); used here with 4-D latents (the newest ``vae2_2`` decodes one uncached frame).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from scripts.fixtures.weights import _init_custom, _torch_reset
from scripts.upstream import quiet

__all__ = ["qwen21_state_dict", "qwen21_taesd", "qwen21_vae", "taesd_state_dict", "vae_from_state_dict",
           "wan22_state_dict", "wan22_vae"]

QWEN21_DIMS = {"dim": 8, "dec_dim": 8}
"""Narrow widths of the Qwen-Image 2.1 twin (the released file's are larger; the branch reads them from the file)."""
WAN22_NARROW = {"dim": 40, "dec_dim": 64}
"""Wan 2.2's widths (160, 256) over 4, as ``scripts.fixtures.narrow.narrow_host`` builds its narrow twin."""


def _qwen21_config(dim: int, dec_dim: int, image_channels: int = 4) -> dict[str, Any]:
    """sd.py line 846's ``ddconfig`` (``z_dim`` 64)."""
    return {"dim": dim, "dec_dim": dec_dim, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8], "num_res_blocks": 2,
            "attn_scales": [], "temperal_downsample": [False, True, True, True], "dropout": 0.0,
            "image_channels": image_channels, "patch_size": 1, "temporal_kernel": 1}


def _wan22_config(dim: int, dec_dim: int) -> dict[str, Any]:
    """sd.py line 859's ``ddconfig`` with the narrow ``dim`` and a ``dec_dim`` (the default 256, narrowed)."""
    return {"dim": dim, "dec_dim": dec_dim, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
            "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}


def _initialised(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s state dict after every layer got its torch initialiser (``comfy.ops`` layers skip theirs), Wan's
    ``RMS_norm`` gamma 1, TAESD's ``vae_scale`` 1 and ``vae_shift`` 0 (their constructor's values); float32."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, module in model.named_modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if not own or _torch_reset(module) or _init_custom(module):
                continue
            if type(module).__name__ == "TAESD":
                module.vae_scale.fill_(1.0)
                module.vae_shift.fill_(0.0)
                continue
            raise TypeError(f"don't know how to initialise {name or '<root>'} ({type(module).__qualname__})")
    return {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}


def qwen21_state_dict(seed: int = 0, dim: int = QWEN21_DIMS["dim"], dec_dim: int = QWEN21_DIMS["dec_dim"]
                      ) -> dict[str, torch.Tensor]:
    """Random weights of a narrow Qwen-Image 2.1 VAE, keyed as the released file (the newest ``vae2_2``)."""
    import comfy.ldm.wan.vae2_2 as vae2_2

    return _initialised(vae2_2.WanVAE(**_qwen21_config(dim, dec_dim)), seed)


def wan22_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the narrow Wan 2.2 VAE (the newest ``vae2_2``)."""
    import comfy.ldm.wan.vae2_2 as vae2_2

    return _initialised(vae2_2.WanVAE(**_wan22_config(**WAN22_NARROW)), seed)


def taesd_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of a 64-channel TAESD (Qwen-Image 2.1's), keyed as the released file."""
    import comfy.taesd.taesd as taesd

    return _initialised(taesd.TAESD(latent_channels=64), seed)


def _branch(vae: Any, sd: dict[str, torch.Tensor]) -> None:
    """The newest sd.py's branches for these files (lines 553-563, 837-862), setting ``vae``'s model and
    attributes as they do. Raises ``ValueError`` for any other file."""
    import comfy.ldm.wan.vae2_2 as vae2_2
    import comfy.model_management as mm
    import comfy.taesd.taesd as taesd

    if "taesd_decoder.1.weight" in sd:  # lines 553-563
        vae.latent_channels = sd["taesd_decoder.1.weight"].shape[1]
        vae.first_stage_model = taesd.TAESD(latent_channels=vae.latent_channels)
        if vae.latent_channels == 64:  # Qwen Image 2.1 TAESD: 16x, RGBA
            vae.downscale_ratio = 16
            vae.upscale_ratio = 16
            vae.output_channels = 4
            vae.pad_channel_value = 1.0
        return
    if "decoder.middle.0.residual.0.gamma" not in sd:
        raise ValueError("not a Wan-layout or TAESD file")
    wan22_layout = "decoder.upsamples.0.upsamples.0.residual.2.weight" in sd
    head = sd.get("decoder.head.2.weight", None)
    if wan22_layout and head is not None and head.ndim == 5 and head.shape[2] == 1:  # lines 840-850
        vae.upscale_ratio = 16
        vae.downscale_ratio = 16
        vae.latent_channels = 64
        vae.output_channels = sd["decoder.head.2.weight"].shape[0]
        vae.pad_channel_value = 1.0
        cfg = _qwen21_config(sd["encoder.conv1.weight"].shape[0], sd["decoder.head.0.gamma"].shape[0],
                             vae.output_channels)
        vae.first_stage_model = vae2_2.WanVAE(**cfg)
        vae.working_dtypes = [torch.bfloat16, torch.float16, torch.float32]
        vae.memory_used_encode = lambda shape, dtype: 600 * shape[2] * shape[3] * mm.dtype_size(dtype)
        vae.memory_used_decode = lambda shape, dtype: 900 * shape[2] * shape[3] * (16 * 16) * mm.dtype_size(dtype)
        return
    if not wan22_layout:
        raise ValueError("a Wan 2.1 file: load it with 0.33.0's VAELoader")
    # lines 851-862 (the narrow widths from the file, as scripts.fixtures.narrow.narrow_host builds Wan 2.2's twin)
    vae.upscale_ratio = (lambda a: max(0, a * 4 - 3), 16, 16)
    vae.upscale_index_formula = (4, 16, 16)
    vae.downscale_ratio = (lambda a: max(0, math.floor((a + 3) / 4)), 16, 16)
    vae.downscale_index_formula = (4, 16, 16)
    vae.latent_dim = 3
    vae.latent_channels = 48
    cfg = _wan22_config(sd["encoder.conv1.weight"].shape[0], sd["decoder.head.0.gamma"].shape[0])
    vae.first_stage_model = vae2_2.WanVAE(**cfg)
    vae.working_dtypes = [torch.bfloat16, torch.float16, torch.float32]
    vae.memory_used_encode = lambda shape, dtype: 3300 * shape[3] * shape[4] * mm.dtype_size(dtype)
    vae.memory_used_decode = lambda shape, dtype: 8000 * shape[3] * shape[4] * (16 * 16) * mm.dtype_size(dtype)


def vae_from_state_dict(sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Any:
    """A ``comfy.sd.VAE`` as the newest sd.py builds it from ``sd`` (:func:`_branch`), then the end of its
    ``__init__`` (lines 1102-1131: eval, device and dtype, ``CoreModelPatcher``, the state dict loaded; 0.33.0's
    patcher takes no ``fast_disk``)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    with quiet():
        vae = comfy.sd.VAE(sd={})  # every default attribute of VAE.__init__; no model
    _branch(vae, sd)
    vae.first_stage_model = vae.first_stage_model.eval()
    vae.device = mm.vae_device()
    offload_device = mm.vae_offload_device()
    vae.vae_dtype = dtype
    vae.first_stage_model.to(dtype)
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(vae.first_stage_model)
    vae.output_device = mm.intermediate_device()
    mp = comfy.model_patcher.ModelPatcher if vae.disable_offload else comfy.model_patcher.CoreModelPatcher
    vae.patcher = mp(vae.first_stage_model, load_device=vae.device, offload_device=offload_device)
    missing, unexpected = vae.first_stage_model.load_state_dict(sd, strict=False, assign=vae.patcher.is_dynamic())
    if missing or unexpected:
        raise ValueError(f"state dict does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if not vae.patcher.is_dynamic():
        vae.first_stage_model.to(dtype)
    vae.model_size()
    return vae


def qwen21_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The narrow Qwen-Image 2.1 VAE (inside :func:`scripts.upstream.newest`)."""
    return vae_from_state_dict(qwen21_state_dict(seed), dtype)


def qwen21_taesd(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """Qwen-Image 2.1's TAESD (64 channels; 0.33.0's ``taesd.py``: see the module docstring)."""
    return vae_from_state_dict(taesd_state_dict(seed), dtype)


def wan22_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """The narrow Wan 2.2 VAE on the newest ``vae2_2`` (inside :func:`scripts.upstream.newest`)."""
    return vae_from_state_dict(wan22_state_dict(seed), dtype)
