"""SeedVR2's video VAE decoder (``comfy.ldm.seedvr.vae.VideoAutoencoderKLWrapper``) walked once into a description
for the exact executor (:mod:`..executors.seedvr2`).

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
1-px halo at its own resolution and carrying its causal convolution's last input frames across slices.

Two variants, told by the module's structure (never a version or a class name): ComfyUI 0.33.0's (``forward``:
``nn.SiLU`` modules on the resnets and the decoder, upsamplers called as modules, ``use_slicing``) and the rewritten
upstream file (``run``: SiLU folded into ``causal_norm_wrapper(..., silu=True)``, upsamplers' ``run(source, state,
cache)`` on a 1-list, a ``CausalMemoryCache`` object, the tail run a frame at a time inside the host's decoder -
exact, per frame - and the model's own memory hints, :class:`Hints`). A decoder whose structure differs gets a
:attr:`SeedVR2Layout.reason` and is not described. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Hints", "Segment", "SeedVR2Layout", "hints_of", "seedvr2_layout", "seedvr2_of"]

FAMILY = "SeedVR2 video VAE"

_MODEL_ATTRS = ("decoder", "slicing_decode", "slicing_latent_min_size", "_decode")
_DECODER_ATTRS = ("conv_in", "mid_block", "up_blocks", "conv_norm_out", "conv_out")
_RESNET_ATTRS = ("norm1", "conv1", "norm2", "conv2", "conv_shortcut")
_UP_ATTRS = ("upscale_conv", "conv", "temporal_up", "spatial_ratio")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One step of the up path, run tile by tile: ``kind`` ``res1`` (``conv1(act(norm1(x)))``), ``res2``
    (``conv2(act(norm2(h))) + shortcut(x)``), ``up`` (the upsampler's own forward or ``run``) or ``out``
    (``conv_out(act(conv_norm_out(x)))``). ``conv``: its causal convolution (the one whose last input frames are
    carried); ``norm``: the GroupNorm on its input (None for ``up``); ``stats``: its output feeds a GroupNorm, so
    its per-frame statistics are gathered; ``scale``: output px per input px; ``act``: the activation after the norm;
    ``residual_scale``: a resnet's ``output_scale_factor`` (``res2``)."""

    kind: str
    module: Any
    conv: Any
    norm: Any
    stats: bool
    scale: int
    name: str
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    residual_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class Hints:
    """What the model itself says about its memory (the rewritten upstream file; absent in 0.33.0's):
    ``estimate(shape, dtype)`` its decode's peak bytes (``comfy_memory_used_decode``), ``reliable`` its
    ``comfy_decode_estimate_is_reliable``, ``tile(free_bytes, dtype)`` the largest square tile, in latent px, its own
    tiled decode fits in (``preferred_decode_tile``). Any may be None."""

    estimate: Callable[[tuple, torch.dtype], int] | None = None
    reliable: bool = False
    tile: Callable[[int, torch.dtype], int] | None = None

    def names(self) -> list[str]:
        return [n for n, v in (("comfy_memory_used_decode", self.estimate),
                               ("comfy_decode_estimate_is_reliable", self.reliable or None),
                               ("preferred_decode_tile", self.tile)) if v is not None]


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
    variant: str = "forward"
    """``forward`` (0.33.0's module calls) or ``run`` (the rewritten file: blocks' ``run``, SiLU in the norm)."""
    cache_type: Callable[[], Any] = dict
    """The host's carried-cache object for the prefix (its ``CausalMemoryCache`` where it has one, else a dict)."""
    hints: Hints = Hints()
    tail: int = 0
    """Index of the last temporal upsampler's segment (``len(segments)``: none). From it on every operation is per
    frame or a causal convolution, so the walk runs it a frame at a time (its input frame by input frame, the rest
    output frame by output frame), as the rewritten host decoder does: exact, one frame's activations at a time."""

    def tail_in(self, n: int, first: bool) -> int:
        """Frames at the tail's input for a slice of ``n`` latent frames (``first``: the clip's first slice, whose
        first frame each temporal upsampler does not double)."""
        for s in self.segments[: self.tail]:
            if s.kind == "up" and getattr(s.module, "temporal_up", False):
                n = 2 * n - int(first)
        return n

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

    def mid(self, dec: Any, h: torch.Tensor, state: Any, cache: Any) -> torch.Tensor:
        """The mid block on the whole latent slice (0.33.0's takes a ``temb`` before the keywords, the rewritten one
        none: both take these keywords)."""
        return dec.mid_block(h, memory_state=state, memory_cache=cache)

    def up(self, seg: Segment, x: torch.Tensor, state: Any, cache: Any) -> torch.Tensor:
        """The upsampler of ``seg`` on ``x``: its module call, or its ``run`` on a 1-list it empties."""
        if self.variant == "run":
            return seg.module.run([x], state, cache)
        return seg.module(x, memory_state=state, memory_cache=cache)


def seedvr2_of(model: Any) -> str | None:
    """The family name when ``model`` has SeedVR2's decoder structure and the host's time slicing, else None."""
    if model is None or not all(hasattr(model, a) for a in _MODEL_ATTRS):
        return None
    dec = getattr(model, "decoder", None)
    if dec is None or not all(hasattr(dec, a) for a in _DECODER_ATTRS):
        return None
    return FAMILY


def _host_module(dec: Any) -> Any:
    return sys.modules.get(type(dec.conv_in).__module__)


def _own_forward(module: Any) -> bool:
    """Whether ``module``'s class defines a forward of its own (``nn.Module``'s raises)."""
    return type(module).forward is not torch.nn.Module.forward


def _folded_silu(mod: Any) -> bool:
    """The host's ``causal_norm_wrapper`` applies SiLU itself (the rewritten file's ``silu`` parameter)."""
    wrapper = getattr(mod, "causal_norm_wrapper", None)
    try:
        return wrapper is not None and "silu" in inspect.signature(wrapper).parameters
    except (TypeError, ValueError):
        return False


def _takes_state(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "memory_state" in params and "memory_cache" in params


def _variant(model: Any) -> tuple[str | None, str]:
    """``(why not, variant)`` of ``model``'s decoder."""
    if seedvr2_of(model) is None:
        return "not SeedVR2's decoder (no Decoder3D with conv_in, mid_block, up_blocks, conv_out and time slicing)", ""
    dec = model.decoder
    mod = _host_module(dec)
    if mod is None or not hasattr(mod, "MemoryState"):
        return "the host module has no MemoryState", ""
    mid = dec.mid_block
    if not hasattr(mid, "resnets") or not hasattr(mid, "attentions"):
        return "the mid block has no resnets/attentions", ""
    if not _takes_state(mid.forward):
        return "the mid block's forward takes no memory_state/memory_cache", ""
    resnets = [(f"up_blocks.{i}.resnets.{j}", r) for i, blk in enumerate(dec.up_blocks)
               for j, r in enumerate(getattr(blk, "resnets", ()))]
    ups = [(f"up_blocks.{i}", u) for i, blk in enumerate(dec.up_blocks) for u in getattr(blk, "upsamplers", None) or ()]
    variant = "forward" if hasattr(dec, "conv_act") and all(hasattr(r, "nonlinearity") for _, r in resnets) else "run"
    if variant == "run" and not _folded_silu(mod):
        return "no activation found (no conv_act/nonlinearity modules, no SiLU in causal_norm_wrapper)", ""
    for name, r in resnets:
        missing = [a for a in _RESNET_ATTRS if not hasattr(r, a)]
        if missing:
            return f"{name} lacks {', '.join(missing)}", ""
        if getattr(r, "time_emb_proj", None) is not None:
            return f"{name} is time-conditioned", ""
    for name, u in ups:
        if not all(hasattr(u, a) for a in _UP_ATTRS):
            return f"{name}'s upsampler is not an Upsample3D", ""
        if variant == "run" and (_own_forward(u) or not callable(getattr(u, "run", None))):
            return f"{name}'s upsampler has neither the module call nor run(source, state, cache) of its decoder", ""
        if variant == "forward" and not _own_forward(u):
            return f"{name}'s upsampler has no forward", ""
    return None, variant


def hints_of(model: Any) -> Hints:
    """The model's own memory hints (:class:`Hints`): what the rewritten upstream file provides, found by name."""
    est = getattr(model, "comfy_memory_used_decode", None)
    tile = getattr(model, "preferred_decode_tile", None)
    est = est if callable(est) and len(_params(est)) >= 2 else None  # 0.33.0's takes the shape alone: no dtype
    return Hints(est, bool(getattr(model, "comfy_decode_estimate_is_reliable", False)) and est is not None,
                 tile if callable(tile) else None)


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def seedvr2_layout(model: Any) -> SeedVR2Layout:
    """The description of ``model``'s decoder (module docstring); ``reason`` set when it does not fit."""
    why, variant = _variant(model)
    if why is not None:
        return SeedVR2Layout(why)
    dec = model.decoder
    mod = _host_module(dec)
    segs: list[Segment] = []
    blocks = list(dec.up_blocks)
    for i, blk in enumerate(blocks):
        ups = list(getattr(blk, "upsamplers", None) or ())
        res = list(blk.resnets)
        for j, r in enumerate(res):
            act = r.nonlinearity if variant == "forward" else F.silu
            segs.append(Segment("res1", r, r.conv1, r.norm1, True, 1, f"up_blocks.{i}.resnets.{j}.conv1", act))
            # its output feeds the next resnet's norm1 or conv_norm_out, not an upsampler (no norm there)
            feeds_norm = j < len(res) - 1 or not ups
            segs.append(Segment("res2", r, r.conv2, r.norm2, feeds_norm, 1, f"up_blocks.{i}.resnets.{j}.conv2", act,
                                float(getattr(r, "output_scale_factor", 1.0))))
        for k, u in enumerate(ups):
            segs.append(Segment("up", u, u.conv, None, True, int(u.spatial_ratio), f"up_blocks.{i}.upsamplers.{k}"))
    segs.append(Segment("out", dec, dec.conv_out, dec.conv_norm_out, False, 1, "conv_out",
                        dec.conv_act if variant == "forward" else F.silu))
    first = blocks[0].resnets[0].norm1 if blocks and list(blocks[0].resnets) else dec.conv_norm_out
    cache = getattr(mod, "CausalMemoryCache", None) if variant == "run" else None
    temporal = [i for i, s in enumerate(segs) if s.kind == "up" and getattr(s.module, "temporal_up", False)]
    return SeedVR2Layout(None, tuple(segs), int(model.slicing_latent_min_size),
                         bool(getattr(model, "use_slicing", True)), mod.MemoryState, first, variant,
                         cache if callable(cache) else dict, hints_of(model), temporal[-1] if temporal else len(segs))
