"""A 3-D image VAE seen as a 2-D one, so the image decode (planning, self-checks, the exact walker) runs it.

Hunyuan Image 2.1's refiner VAE (ComfyUI: ``comfy.ldm.hunyuan_video.vae_refiner`` with ``refiner_vae`` False,
``not_video``) decodes ``(B, C, 1, h, w)`` latents with 3-D convolutions and GroupNorms over the whole clip; its
``Decoder.forward`` decodes 4 frames of a one-frame latent and keeps the last. ComfyUI's ``VAE.decode`` returns
``(B, 1, H, W, 3)`` for it, which VAE Decode reshapes into B images. :func:`one_frame_vae` wraps such a VAE so its
``first_stage_model.decode`` takes and returns 4-D tensors (the time axis added and removed around the host's own
``decode``: the same numbers), while :func:`..vae.kl_layout.kl_layout` finds the 3-D decoder inside and the walker
runs it in spatial tiles of all frames (:mod:`..executors.kl_exact`). Everything else is the host's VAE object.

The other way round, :func:`one_frame_clip`: an image VAE (2-D latents) whose decoder is a Wan-layout causal decoder
(Qwen-Image 2.1's VAE: ``vae2_2.WanVAE`` with temporal kernel 1, ComfyUI's ``latent_dim`` 2) decodes each latent as a
one-frame clip through the chunked Wan executor (its mid attention once on the whole frame, the up path in tiles).
Duck-typed: no ComfyUI import.
"""

from __future__ import annotations

from typing import Any

import torch

from .kl_layout import find_decoder, whole_clip_3d
from .wan_layout import is_wan_vae

__all__ = ["OneFrameModel", "OneFrameVae", "one_frame_clip", "one_frame_vae"]


class OneFrameModel(torch.nn.Module):
    """``inner`` (a 3-D ``first_stage_model``) with a 4-D ``decode``: ``inner.decode(z[:, :, None])[:, :, 0]``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        cls = type(inner)
        dec = find_decoder(inner)
        self.family_name = (f"{cls.__module__}.{cls.__qualname__} with {type(dec).__module__}."
                            f"{type(dec).__qualname__} (3-D, one frame)")
        """What the report and the cost models call it (:func:`..vae.families.model_name`)."""

    @property
    def decoder(self) -> Any:
        return self.inner.decoder

    def decode(self, z: torch.Tensor, **kw: Any) -> torch.Tensor:
        return self.inner.decode(z.unsqueeze(2), **kw).squeeze(2)


class OneFrameVae:
    """The host's VAE object with :class:`OneFrameModel` as its ``first_stage_model``, a 2-D latent and an integer
    spatial ratio; every other attribute (``patcher``, ``vae_dtype``, ``device``, ``process_output``, ...) is the
    host VAE's own."""

    def __init__(self, vae: Any, model: OneFrameModel, ratio: int) -> None:
        self.__dict__.update(vae=vae, first_stage_model=model, upscale_ratio=ratio, latent_dim=2)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["vae"], name)


_WRAPPED = "_vramfit_one_frame"
"""The attribute of the host's VAE object holding its :class:`OneFrameModel`: the wrapper lives and dies with the
VAE (a cache keyed by the model would keep the model alive through the wrapper's ``inner``: a leaked VAE, and
ComfyUI's full garbage collection on every later model load)."""


def one_frame_vae(vae: Any) -> OneFrameVae | None:
    """``vae`` as a 2-D image VAE when its decoder is the 3-D decoder the walker runs
    (:func:`..vae.kl_layout.whole_clip_3d`) and its spatial ratio is known (ComfyUI's ``upscale_ratio`` tuple
    ``(time, h, w)``); else None. One :class:`OneFrameModel` per host VAE and model (its layout and checks are
    cached by object)."""
    model = getattr(vae, "first_stage_model", None)
    if model is None or int(getattr(vae, "latent_dim", 2)) != 3 or not whole_clip_3d(find_decoder(model)):
        return None
    up = getattr(vae, "upscale_ratio", None)
    ratio = up[-1] if isinstance(up, (tuple, list)) and len(up) == 3 else None
    if not isinstance(ratio, int) or ratio < 1 or up[-2] != ratio:
        return None
    wrapped = getattr(vae, "__dict__", {}).get(_WRAPPED)
    if wrapped is None or wrapped.inner is not model:  # a copy of the VAE given another model: a wrapper of its own
        wrapped = OneFrameModel(model)
        try:
            vae.__dict__[_WRAPPED] = wrapped
        except AttributeError:  # no instance dict: a wrapper per call (its checks then per call too)
            pass
    return OneFrameVae(vae, wrapped, ratio)


def one_frame_clip(vae: Any) -> bool:
    """``vae`` is an image VAE (``latent_dim`` 2) whose decoder is a Wan-layout causal decoder
    (:func:`.wan_layout.is_wan_vae`, told from its modules): its 4-D latents decode as one-frame clips."""
    model = getattr(vae, "first_stage_model", None)
    return model is not None and int(getattr(vae, "latent_dim", 2)) == 2 and is_wan_vae(model)
