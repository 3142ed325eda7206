"""Causal video decoders without a host cache, described once per family, for the carried-context executor.

A causal decoder whose only temporal dependencies are its causal convolutions (each reads ``kt - 1`` past
frames, padded at the clip's start) and whose other operations are per frame decodes exactly in temporal
chunks when each causal convolution is given, instead of its start padding, the last ``kt - 1`` input frames
it saw in the previous chunk (:mod:`..executors.carry`). Operations that treat the clip's first frames
specially (Mochi drops the first ``st - 1`` frames after each temporal depth-to-space) do so in the first
chunk only. A :class:`Description` names those modules; the first-use self-check proves the result equal to
the host's decode. Duck-typed: no ComfyUI import.

Mochi (``comfy.ldm.genmo.vae.model``): ``PConv3d`` (causal, replicate padding), ``DepthToSpaceTime``; its
decoder has per-frame GroupNorm (``GroupNormSpatial``) and no attention. Its temporal reach is 46 latent
frames (docs/VIDEO_DECODE.md): without carried context a chunk would need the whole clip before it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["CarryLayout", "Description", "DESCRIPTIONS", "carry_layout"]

Forward = Callable[[Any, torch.Tensor, dict], torch.Tensor]
"""``forward(module, x, state)``: a module's forward in a chunk; ``state`` holds its carried context (the key
``"first"`` is True in the first chunk)."""


@dataclasses.dataclass(frozen=True)
class Description:
    """A causal family: which decoders it matches and the forwards of its modules that cross chunk borders."""

    name: str
    reason: Callable[[Any], str | None]
    """Why ``first_stage_model`` is not of this family (None: it is)."""
    forwards: Callable[[Any], dict[Any, Forward]]
    """Module -> its chunk forward, for every module that reads past frames or treats the clip's start."""


def _mochi_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if dec is None or not type(dec).__module__.endswith("genmo.vae.model"):
        return "not a Mochi decoder (comfy.ldm.genmo)"
    for m in dec.modules():
        name = type(m).__name__
        if "Attention" in name:
            return "its decoder has attention blocks (frames would not be independent)"
        if name == "PConv3d" and not (getattr(m, "causal", False) and m.padding_mode == "replicate"
                                       and tuple(m.stride)[0] == 1 and m.padding[0] == 0):
            return "a PConv3d that is not causal, stride-1 and replicate-padded in time"
    return None


def _pconv_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``PConv3d.forward`` with the previous chunk's last ``kt - 1`` input frames instead of the start
    padding."""
    ctx = int(m.kernel_size[0]) - 1
    prev = state.get("prev")
    if ctx == 0:
        xp = x
    elif prev is None:
        xp = F.pad(x, (0, 0, 0, 0, ctx, 0), mode="replicate")
    else:
        xp = torch.cat([prev, x], dim=2)
    state["prev"] = xp[:, :, xp.shape[2] - ctx :].clone() if ctx else None
    return type(m).__mro__[1].forward(m, xp)  # the host's Conv3d (its weight casting), without the padding


def _d2st_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``DepthToSpaceTime.forward``; the first ``st - 1`` frames are dropped in the first chunk only."""
    st, s = int(m.temporal_expansion), int(m.spatial_expansion)
    b, c, t, h, w = x.shape
    y = x.reshape(b, c // (st * s * s), st, s, s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    y = y.reshape(b, c // (st * s * s), t * st, h * s, w * s)
    return y[:, :, st - 1 :] if st > 1 and state.get("first", True) else y


def _mochi_forwards(model: Any) -> dict[Any, Forward]:
    out: dict[Any, Forward] = {}
    for m in model.decoder.modules():
        name = type(m).__name__
        if name == "PConv3d":
            out[m] = _pconv_forward
        elif name == "DepthToSpaceTime":
            out[m] = _d2st_forward
    return out


DESCRIPTIONS: tuple[Description, ...] = (Description("mochi", _mochi_reason, _mochi_forwards),)


@dataclasses.dataclass(frozen=True)
class CarryLayout:
    """One causal decoder for the carried-context executor; ``reason``: why not (then nothing else)."""

    reason: str | None
    family: str = ""
    forwards: dict = dataclasses.field(default_factory=dict, compare=False)

    def require(self) -> CarryLayout:
        if self.reason is not None:
            raise ValueError(f"no carried-context chunking for this decoder: {self.reason}")
        return self


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carry_layout(model: Any) -> CarryLayout:
    """The carried-context layout of ``model`` (a ``first_stage_model``), walked once per model object."""
    try:
        found = _LAYOUTS.get(model)
    except TypeError:
        found = None
    if found is None:
        reasons = []
        for d in DESCRIPTIONS:
            why = d.reason(model)
            if why is None:
                found = CarryLayout(None, d.name, d.forwards(model))
                break
            reasons.append(why)
        else:
            found = CarryLayout("; ".join(reasons))
        try:
            _LAYOUTS[model] = found
        except TypeError:
            pass
    return found
