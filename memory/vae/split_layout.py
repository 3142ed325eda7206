"""Decoders that are a global prefix and a local suffix, described once per family.

A decoder whose every operation after some point is local (convolutions, upsampling, per-pixel norms) decodes
exactly in tiles: run the *prefix* once on the whole latent (it works at low resolution, where the global
operations are: attention, statistic norms), then the *suffix* tile by tile with a halo of its traced reach
(:mod:`..executors.split`). The pack's only per-family code is a :class:`Description`: which decoders it
matches and the decoder's forward written as named stages. The split point is found here, from the stages'
modules: the suffix is the longest tail of stages without a global module (:func:`is_global`); the planner
traces the suffix's reach and the first-use self-check proves the result equal to the host's decode.

Adding a family: one :class:`Description` in :data:`DESCRIPTIONS` (DC-AE's is ~35 lines) plus its fixture and
tests (docs/ARCHITECTURE.md). Duck-typed: no ComfyUI or diffusers import.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .swap import swapped

__all__ = [
    "DCAE_MODULES", "DESCRIPTIONS", "Description", "SplitLayout", "Stage", "Unit", "is_dcae", "is_global",
    "is_linear_attention", "split_layout",
]

Fn = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Unit:
    """One step of a prefix stage that :mod:`..executors.prefix_tiles` runs in tiles: a local ``run`` whose reach is
    its ``modules``' convolutions', or (``attention`` set) a linear attention run in two passes."""

    run: Fn
    modules: tuple[Any, ...] = ()
    attention: Any = None


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a decoder's forward: ``run(x)`` and the modules it calls (for the split point)."""

    name: str
    run: Fn
    modules: tuple[Any, ...]
    units: tuple[Unit, ...] = ()
    """``run`` as units that run in tiles (empty: the stage runs on the whole map only)."""


@dataclasses.dataclass(frozen=True)
class Description:
    """A decoder family for the split path."""

    name: str
    reason: Callable[[Any], str | None]
    """Why ``first_stage_model`` is not of this family (None: it is)."""
    stages: Callable[[Any], list[Stage]]
    """``first_stage_model.decode`` as stages, in order (their composition must equal it: the self-check
    proves it on the running host)."""


_NORMS_OVER_SPACE = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d)
_ADAPTIVE_POOLS = (torch.nn.AdaptiveAvgPool1d, torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveAvgPool3d,
                   torch.nn.AdaptiveMaxPool1d, torch.nn.AdaptiveMaxPool2d, torch.nn.AdaptiveMaxPool3d)


def is_global(m: Any) -> bool:
    """A module whose output at one pixel may depend on every pixel: attention (by class name, as
    :func:`..measure.reach.traced_reach`), a norm with statistics that may span space (GroupNorm, LayerNorm,
    InstanceNorm) or an adaptive pool (its windows follow the input's size: Mage-VAE's channel attention pools
    the whole map). Local: per-pixel RMS norms, and a LayerNorm over one axis of fixed length, which in a
    convolutional decoder is the channel axis moved last (LTX-Video 0.9.0's ``LayerNorm``): over a spatial axis it
    would fail on a tile of another size rather than differ (and the self-check proves every exact path)."""
    name = type(m).__name__.lower()
    if isinstance(m, torch.nn.LayerNorm) and len(m.normalized_shape) == 1:
        return False
    return "attn" in name or "attention" in name or isinstance(m, _NORMS_OVER_SPACE + _ADAPTIVE_POOLS)


def _has_global(stage: Stage) -> bool:
    for top in stage.modules:
        mods = top.modules() if isinstance(top, torch.nn.Module) else ()
        if any(is_global(m) for m in mods):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class SplitLayout:
    """One decoder cut into prefix and suffix; ``reason``: why there is no split path (then nothing else)."""

    reason: str | None
    family: str = ""
    stages: tuple[Stage, ...] = ()
    split: int = 0
    """Index of the first suffix stage."""

    def require(self) -> SplitLayout:
        if self.reason is not None:
            raise ValueError(f"no prefix/suffix split for this decoder: {self.reason}")
        return self

    def prefix(self, z: torch.Tensor) -> torch.Tensor:
        """The global part, on the whole latent."""
        return _compose(self.stages[: self.split], z)

    def suffix(self, x: torch.Tensor) -> torch.Tensor:
        """The local part: any tile of the prefix's output (with a halo of its reach)."""
        return _compose(self.stages[self.split :], x)

    @property
    def prefix_units(self) -> tuple[Unit, ...]:
        """The prefix as units that run in tiles (:mod:`..executors.prefix_tiles`); empty when a prefix stage has
        none (the prefix then runs on the whole latent only)."""
        stages = self.stages[: self.split]
        if not stages or any(not s.units for s in stages):
            return ()
        return tuple(u for s in stages for u in s.units)

    def describe(self) -> str:
        pre = ", ".join(s.name for s in self.stages[: self.split]) or "nothing"
        return f"{self.family}: prefix {pre} on the whole latent; suffix {self.stages[self.split].name} .. " \
               f"{self.stages[-1].name} in tiles"


def _compose(stages: Sequence[Stage], x: torch.Tensor) -> torch.Tensor:
    for s in stages:
        x = s.run(x)
    return x


# --------------------------------------------------------------------------------------------------
# Descriptions


DCAE_MODULES = ("autoencoder_dc", "dcae")
"""Last components of the modules DC-AE's classes live in: diffusers' ``models.autoencoders.autoencoder_dc`` and
ComfyUI_ExtraModels' ``VAE/models/dcae.py`` (the Sana workflows' loader: diffusers' code, copied)."""


def is_dcae(part: Any) -> bool:
    """True when ``part`` (an encoder or decoder module) is one of DC-AE's classes (:data:`DCAE_MODULES`)."""
    return part is not None and type(part).__module__.rsplit(".", 1)[-1] in DCAE_MODULES


def _dcae_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if not is_dcae(dec):
        return "not a DC-AE decoder (diffusers autoencoder_dc, ComfyUI_ExtraModels' dcae)"
    for name in ("conv_in", "up_blocks", "norm_out", "conv_act", "conv_out"):
        if getattr(dec, name, None) is None:
            return f"DC-AE decoder has no {name}"
    if getattr(model, "use_tiling", False):
        return "the VAE's own tiled decode is enabled (its decode is not the decoder's forward)"
    return None


def is_linear_attention(m: Any) -> bool:
    """diffusers' ``SanaMultiscaleLinearAttention`` with its 2.0 processor (:mod:`..executors.prefix_tiles`
    reproduces that processor in two passes)."""
    return (type(m).__name__ == "SanaMultiscaleLinearAttention"
            and type(getattr(m, "processor", None)).__name__ == "SanaMultiscaleAttnProcessor2_0"
            and all(hasattr(m, a) for a in ("to_q", "to_k", "to_v", "to_qkv_multiscale", "to_out", "norm_out",
                                            "nonlinearity", "eps", "attention_head_dim", "norm_type",
                                            "residual_connection")))


def _dcae_units(block: Any) -> tuple[Unit, ...]:
    """An up block's children as units: an EfficientViT block (``attn`` then ``conv_out``) as its linear attention
    and its local GLUMBConv; any other child (upsampling, ResBlock) local. Empty when a child has another global
    module."""
    units: list[Unit] = []
    for child in block.children():
        attn, local = getattr(child, "attn", None), getattr(child, "conv_out", None)
        if type(child).__name__ == "EfficientViTBlock" and is_linear_attention(attn) and local is not None:
            units += [Unit(attn, attention=attn), Unit(local, (local,))]
        elif any(is_global(m) for m in child.modules()):
            return ()
        else:
            units.append(Unit(child, (child,)))
    return tuple(units)


def _dcae_stages(model: Any) -> list[Stage]:
    """diffusers ``autoencoder_dc.Decoder.forward`` (0.32-0.36): ``conv_in`` plus the channel-repeat
    shortcut, the up blocks from the deepest, then RMSNorm over channels, activation and ``conv_out``."""
    dec = model.decoder

    def conv_in(z: torch.Tensor) -> torch.Tensor:
        h = dec.conv_in(z)
        if getattr(dec, "in_shortcut", False):
            h = h + z.repeat_interleave(dec.in_shortcut_repeats, dim=1)
        return h

    def out(x: torch.Tensor) -> torch.Tensor:
        x = dec.norm_out(x.movedim(1, -1)).movedim(-1, 1)
        return dec.conv_out(dec.conv_act(x))

    n = len(dec.up_blocks)
    return ([Stage("conv_in", conv_in, (dec.conv_in,), (Unit(conv_in, (dec.conv_in,)),))]
            + [Stage(f"up_blocks.{i}", dec.up_blocks[i], (dec.up_blocks[i],), _dcae_units(dec.up_blocks[i]))
               for i in reversed(range(n))]
            + [Stage("out", out, (dec.norm_out, dec.conv_act, dec.conv_out))])


def _mage_reason(model: Any) -> str | None:
    if not type(model).__module__.endswith("mage_flow.vae"):
        return "not Mage-VAE (comfy.ldm.mage_flow.vae)"
    dm = getattr(model, "decoder_model", None)
    for name in ("t_embedder", "s_embedder", "blocks", "y_embedder", "hidden_size", "in_channels", "patch_size"):
        if getattr(dm, name, None) is None:
            return f"Mage-VAE's denoiser has no {name}"
    if getattr(dm.y_embedder, "decoder", None) is None or getattr(dm.s_embedder, "proj1", None) is None:
        return "Mage-VAE's denoiser has no y_embedder.decoder or s_embedder.proj1"
    return None


class _Given(torch.nn.Module):
    """A stand-in submodule that returns ``value`` whatever it is called with."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.value = value

    def forward(self, *_: Any) -> torch.Tensor:
        return self.value


def _mage_stages(model: Any) -> list[Stage]:
    """ComfyUI 0.33's ``MageVAE.decode``: the CoD decoder (GroupNorm ResBlocks, attention in 32-px windows) on the
    latent, then the one-step denoiser from zero noise at t=0: its patch embedding and DiCo blocks (adaptive layer
    norm by the timestep, channel attention over the whole map) at latent resolution, then a per-patch MLP that
    paints each latent px's 16x16 px. Between the stages the tensor is the blocks' state ``s`` and the CoD decoder's
    ``cond`` side by side (channels). The tail is the host's own ``forward`` on a tile, its embedding and blocks
    swapped for the prefix's ``s``; the patch embedding of the zero noise (a stride-16 convolution: the same value at
    every latent px) is taken from one zero patch."""
    dm = model.decoder_model
    hidden = int(dm.hidden_size)

    def timestep(x: torch.Tensor) -> torch.Tensor:
        return dm.t_embedder(torch.zeros(x.shape[0], device=x.device, dtype=x.dtype).view(-1), x.dtype)

    def embed(cond: torch.Tensor) -> torch.Tensor:
        ps = int(dm.patch_size)
        zero = torch.zeros((cond.shape[0], int(dm.in_channels), ps, ps), device=cond.device, dtype=cond.dtype)
        noise = dm.s_embedder.proj1(zero).expand(-1, -1, *cond.shape[-2:])
        return torch.cat([dm.s_embedder.proj2(torch.cat([noise, cond], dim=1)), cond], dim=1)

    def blocks(x: torch.Tensor) -> torch.Tensor:
        s, cond, c = x[:, :hidden], x[:, hidden:], timestep(x)
        for block in dm.blocks:
            s = block(s, c)
        return torch.cat([s, cond], dim=1)

    def tail(x: torch.Tensor) -> torch.Tensor:
        s, cond = x[:, :hidden], x[:, hidden:]
        ps = int(dm.patch_size)
        noise = torch.zeros((x.shape[0], int(dm.in_channels), x.shape[-2] * ps, x.shape[-1] * ps), device=x.device,
                            dtype=x.dtype)
        with swapped((dm, "s_embedder", _Given(s)), (dm, "blocks", torch.nn.ModuleList())):
            return dm(noise, torch.zeros(x.shape[0], device=x.device, dtype=x.dtype), cond)

    patch_tail = tuple(getattr(dm, n) for n in ("y_embedder_x", "x_embedder", "dec_net", "final_layer")
                       if getattr(dm, n, None) is not None)
    return [Stage("y_embedder.decoder", dm.y_embedder.decoder, (dm.y_embedder.decoder,)),
            Stage("s_embedder", embed, (dm.s_embedder,)),
            Stage("blocks", blocks, (dm.t_embedder, dm.blocks)),
            Stage("per-patch tail", tail, patch_tail)]


DESCRIPTIONS: tuple[Description, ...] = (
    Description("dc-ae", _dcae_reason, _dcae_stages),
    Description("mage", _mage_reason, _mage_stages),
)


# --------------------------------------------------------------------------------------------------
# The layout


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _walk(model: Any) -> SplitLayout:
    reasons = []
    for d in DESCRIPTIONS:
        why = d.reason(model)
        if why is not None:
            reasons.append(why)
            continue
        stages = tuple(d.stages(model))
        split = len(stages)
        while split > 0 and not _has_global(stages[split - 1]):
            split -= 1
        if split >= len(stages):
            return SplitLayout(f"{d.name}: its last stage has a global operation", d.name)
        return SplitLayout(None, d.name, stages, split)
    return SplitLayout("; ".join(reasons) or "no description")


def split_layout(model: Any) -> SplitLayout:
    """The split of ``model`` (a ``first_stage_model``), walked once per model object."""
    try:
        found = _LAYOUTS.get(model)
    except TypeError:  # not weak-referenceable
        return _walk(model)
    if found is None:
        found = _LAYOUTS[model] = _walk(model)
    return found
