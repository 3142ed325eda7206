"""SeedVR2's video VAE decoder (ComfyUI 0.33's ``comfy.ldm.seedvr.vae.VideoAutoencoderKLWrapper``) walked once into a
description for the exact executor (:mod:`..executors.seedvr2`).

What the host's ``decode`` does (``handles_tiling`` off, as VAE Decode calls it): ``latent / scale + shift``, then
``slicing_decode``: the first time slice holds latent frames ``[0, 1 + m)``, every later one ``m`` frames
(``m = slicing_latent_min_size``), each through ``Decoder3D`` with the causal convolutions' ``memory_cache`` carried
from slice to slice (``MemoryState.INITIALIZING``, then ``ACTIVE``; one slice of the whole latent, ``DISABLED``,
when it is too short to slice). Inside a slice every GroupNorm folds time into the batch (``causal_norm_wrapper``:
statistics per frame over the whole frame), the mid block's attention runs per frame on the whole latent frame, and
every other operation is a convolution (3x3 spatially) or element-wise.

So the description is: a prefix run once per slice on the whole latent (``conv_in`` and the mid block, with its
attention: the host's own modules and carried caches), then the up path as segments cut at every GroupNorm
(:class:`Segment`: a resnet block's two halves, an upsampler, the output convolution), each reading its input with a
1-px halo at its own resolution and carrying its causal convolution's last input frames across slices. Duck-typed: a
decoder whose structure differs gets a :attr:`SeedVR2Layout.reason` and is not described. Nothing here imports
ComfyUI."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

__all__ = ["Segment", "SeedVR2Layout", "seedvr2_layout", "seedvr2_of"]

FAMILY = "SeedVR2 video VAE"

_MODEL_ATTRS = ("decoder", "slicing_decode", "slicing_latent_min_size", "use_slicing", "decode_", "_decode")
_DECODER_ATTRS = ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_act", "conv_out")
_RESNET_ATTRS = ("norm1", "conv1", "norm2", "conv2", "nonlinearity", "conv_shortcut", "output_scale_factor")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One step of the up path, run tile by tile: ``kind`` ``res1`` (``conv1(silu(norm1(x)))``), ``res2``
    (``conv2(silu(norm2(h))) + shortcut(x)``), ``up`` (the upsampler's own forward) or ``out``
    (``conv_out(act(conv_norm_out(x)))``). ``conv``: its causal convolution (the one whose last input frames are
    carried); ``norm``: the GroupNorm on its input (None for ``up``); ``stats``: its output feeds a GroupNorm, so
    its per-frame statistics are gathered; ``scale``: output px per input px."""

    kind: str
    module: Any
    conv: Any
    norm: Any
    stats: bool
    scale: int
    name: str


@dataclasses.dataclass(frozen=True)
class SeedVR2Layout:
    reason: str | None
    """Why the decoder is not described (None: described)."""
    segments: tuple[Segment, ...] = ()
    slice_min: int = 1
    use_slicing: bool = True
    memory_state: Any = None
    """The host module's ``MemoryState`` enum."""
    first_norm: Any = None
    """The GroupNorm the prefix's output feeds (the first up block's first ``norm1``)."""

    def slices(self, t: int) -> list[tuple[int, int, str]]:
        """The host's time slices of ``t`` latent frames (``slicing_decode``): ``(start, stop, state name)``."""
        m = max(1, int(self.slice_min))
        if not (self.use_slicing and t - 1 > m):
            return [(0, t, "DISABLED")]
        out = [(0, 1 + m, "INITIALIZING")]
        for s in range(1 + m, t, m):
            out.append((s, min(s + m, t), "ACTIVE"))
        return out

    def state(self, name: str) -> Any:
        return getattr(self.memory_state, name)

    def frames(self, t: int) -> int:
        """Output frames of ``t`` latent frames: the first alone, 4 per later frame (per temporal upsampler: 2)."""
        ups = sum(1 for s in self.segments if s.kind == "up" and getattr(s.module, "temporal_up", False))
        return (t - 1) * (2 ** ups) + 1


def seedvr2_of(model: Any) -> str | None:
    """The family name when ``model`` has SeedVR2's decoder structure and the host's time slicing, else None."""
    if model is None or not all(hasattr(model, a) for a in _MODEL_ATTRS):
        return None
    dec = getattr(model, "decoder", None)
    if dec is None or not all(hasattr(dec, a) for a in _DECODER_ATTRS):
        return None
    return FAMILY


def _why_not(model: Any) -> str | None:
    if seedvr2_of(model) is None:
        return "not SeedVR2's decoder (no Decoder3D with conv_in, mid_block, up_blocks, conv_out and time slicing)"
    dec = model.decoder
    if sys.modules.get(type(dec.conv_in).__module__) is None or not hasattr(
            sys.modules[type(dec.conv_in).__module__], "MemoryState"):
        return "the host module has no MemoryState"
    mid = dec.mid_block
    if not hasattr(mid, "resnets") or not hasattr(mid, "attentions"):
        return "the mid block has no resnets/attentions"
    for i, blk in enumerate(dec.up_blocks):
        for j, r in enumerate(getattr(blk, "resnets", ())):
            missing = [a for a in _RESNET_ATTRS if not hasattr(r, a)]
            if missing:
                return f"up_blocks.{i}.resnets.{j} lacks {', '.join(missing)}"
            if getattr(r, "time_emb_proj", None) is not None:
                return f"up_blocks.{i}.resnets.{j} is time-conditioned"
        for u in getattr(blk, "upsamplers", None) or ():
            if not all(hasattr(u, a) for a in ("upscale_conv", "conv", "temporal_up", "spatial_up")):
                return f"up_blocks.{i}'s upsampler is not an Upsample3D"
    return None


def seedvr2_layout(model: Any) -> SeedVR2Layout:
    """The description of ``model``'s decoder (module docstring); ``reason`` set when it does not fit."""
    why = _why_not(model)
    if why is not None:
        return SeedVR2Layout(why)
    dec = model.decoder
    segs: list[Segment] = []
    blocks = list(dec.up_blocks)
    for i, blk in enumerate(blocks):
        ups = list(getattr(blk, "upsamplers", None) or ())
        res = list(blk.resnets)
        for j, r in enumerate(res):
            segs.append(Segment("res1", r, r.conv1, r.norm1, True, 1, f"up_blocks.{i}.resnets.{j}.conv1"))
            # its output feeds the next resnet's norm1 or conv_norm_out, not an upsampler (no norm there)
            feeds_norm = j < len(res) - 1 or not ups
            segs.append(Segment("res2", r, r.conv2, r.norm2, feeds_norm, 1, f"up_blocks.{i}.resnets.{j}.conv2"))
        for k, u in enumerate(ups):
            segs.append(Segment("up", u, u.conv, None, True, 2 if u.spatial_up else 1,
                                f"up_blocks.{i}.upsamplers.{k}"))
    segs.append(Segment("out", dec, dec.conv_out, dec.conv_norm_out, False, 1, "conv_out"))
    first = blocks[0].resnets[0].norm1 if blocks and list(blocks[0].resnets) else dec.conv_norm_out
    mod = sys.modules[type(dec.conv_in).__module__]
    return SeedVR2Layout(None, tuple(segs), int(model.slicing_latent_min_size), bool(model.use_slicing),
                         mod.MemoryState, first)
