"""Encoders as a local prefix and a whole suffix, described once per family, for the split encode executor
(:mod:`..executors.split_encode`): the video families and Sana's DC-AE.

An encoder whose operations are spatially local up to some module (causal convolutions, norms over channels,
strided or space-to-depth downsampling) and global only after it (attention over a frame or the clip) encodes
exactly when the prefix runs in spatial tiles extended by its reach and the suffix once on the prefix's whole
output, at latent resolution (DC-AE: at the resolution where its attention stages begin). Each family runs **the
host's own code** for both parts: the prefix is the host's ``model.encode`` with the suffix swapped out (its own
chunk loop in time, its own causal caches), the suffix the host's own forward with the prefix swapped out. The reach is traced on fake tensors
(:func:`..measure.reach.traced_encoder_reach`), which also proves that nothing global runs in the prefix; the
first-use self-check proves the result equal to the host's encode. Duck-typed: no ComfyUI import.

* Wan 2.1 / 2.2 (``comfy.ldm.wan.vae`` / ``vae2_2``): prefix ``conv1`` + ``downsamples`` (RMS norms, causal
  convolutions, 2.2's patchify and average shortcuts); suffix ``middle`` (attention per frame), ``head`` and the
  model's ``conv1``, on whole latent frames, frame 0 then 2 at a time with the host's caches carried.
* LTX-Video (``comfy.ldm.lightricks.vae.causal_video_autoencoder``, 0.9.0 to 0.9.5+): the whole encoder is local
  (pixel norms, causal convolutions, space-to-depth): the prefix is the host's whole ``encode``, no suffix.
* HunyuanVideo 1.5 (``comfy.ldm.hunyuan_video.vae_refiner``, ``refiner_vae``): prefix ``conv_in`` + ``down``
  (RMS norms, causal convolutions that carry 2 frames between the host's chunks of 8, space-to-depth); suffix the
  mid block (attention over every latent voxel of the clip), the channel-mean shortcut, ``norm_out``,
  ``conv_out`` and the posterior mean.
* Sana's DC-AE (diffusers ``autoencoder_dc``, ComfyUI_ExtraModels' ``VAE/models/dcae.py``; an image encoder):
  prefix ``conv_in`` and the ResBlock stages (RMS norms over channels, strided convolutions, space-to-depth shortcuts),
  ending at 1/8 resolution for f32c32; suffix the EfficientViT stages (global linear attention), ``conv_out`` and
  its channel-mean shortcut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..measure.reach import EncoderReach, traced_encoder_reach
from ..measure.sizing import MetaSizer
from .describe import first_fit
from .split_layout import is_dcae, is_global
from .swap import swapped

__all__ = ["DESCRIPTIONS", "EncodeSplit", "Held", "SUFFIX_FRAMES", "encode_split", "held_blocks", "prefix_ratio",
           "split_reach"]

SUFFIX_FRAMES = 2
"""Latent frames per Wan suffix call after frame 0. At least 2: 0.33's per-call caches keep the last two frames
of a call's input only when it has two (a 1-frame call after frame 0 would lose one frame of history)."""


@dataclasses.dataclass(frozen=True)
class EncodeSplit:
    """One family's encoder as a local prefix and a whole suffix."""

    name: str
    reason: Callable[[Any], str | None]
    """``reason(model)``: why this description does not fit ``model`` (a ``first_stage_model``); None: it does.
    A reason starting with ``"not "`` means another family's class."""
    prefix: Callable[[Any, torch.Tensor], torch.Tensor]
    """``prefix(model, x)``: the prefix's output on pixels ``x`` (1, C, T, H, W), all latent frames; an image
    encoder's on (1, C, H, W)."""
    suffix: Callable[[Any, torch.Tensor, Any], torch.Tensor]
    """``suffix(model, feats, device)``: what ``model.encode`` returns, from the prefix's whole output."""
    how: str
    """The split in words, for the report."""
    wan: bool = False
    """Wan's chunk loop: sized on a few frames, the rest added per latent frame (:mod:`..plan.encode`)."""
    finer: Callable[[Any], int] | None = None
    """``finer(model)``: prefix px per latent px (DC-AE: 4, its prefix ends at 1/8 of a 32x encoder); None: 1,
    the prefix ends at latent resolution."""
    residual: Callable[[Any], bool] | None = None
    """``residual(module)``: whether a module of the prefix is a residual block that holds what :class:`Held`
    counts (the planner's lower bound before any sizing); None: not described (the bound is then the latent)."""


@dataclasses.dataclass(frozen=True)
class Held:
    """A residual block of the prefix as traced (:func:`held_blocks`). It keeps its input for the residual while
    a convolution makes a tensor of its output's width from another of its input's size (its norm's output, or
    the padded one): every run of it holds at least ``2 * c_in + min(c_in, c_out)`` channels of its input's size
    at once, whatever the host's code frees around it."""

    c_in: int
    c_out: int
    frames: int
    """The most frames one call of it took (the host's chunk; 1 for an image)."""
    scale: int
    """Image px per px of its input."""


class _Pass(torch.nn.Module):
    """Stands in for a causal convolution: returns its input (the cache arguments are ignored)."""

    def forward(self, x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return x


class _Feed(torch.nn.Module):
    """Stands in for a suffix's first module before it: returns ``x`` whatever it is given."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.__dict__["x"] = x  # not a registered buffer: the host's module tree is left as it is

    def forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        return self.x


class _Captured(Exception):
    def __init__(self, x: torch.Tensor) -> None:
        super().__init__("prefix captured")
        self.x = x


class _Capture(torch.nn.Module):
    """Stands in for the suffix's first module in the prefix: ends the host's forward with its input."""

    def forward(self, x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        raise _Captured(x)


def _until(run: Callable[[], Any]) -> torch.Tensor:
    """What :class:`_Capture` caught while ``run()`` ran."""
    try:
        run()
    except _Captured as c:
        return c.x
    raise RuntimeError("the encoder returned without reaching its suffix")


def _module(model: Any, prefix: str) -> str | None:
    mod = type(model).__module__
    enc = getattr(model, "encoder", None)
    if not mod.startswith(prefix) and not type(enc).__module__.startswith(prefix):
        return f"not a {prefix} encoder"
    return None


def _parts(obj: Any, names: tuple[str, ...], where: str) -> str | None:
    for name in names:
        if not isinstance(getattr(obj, name, None), torch.nn.Module):
            return f"{where} has no {name}"
    return None


# ------------------------------------------------------------------------------------------------ Wan


def _wan_reason(model: Any) -> str | None:
    if not type(model).__module__.startswith("comfy.ldm.wan."):
        return f"not a Wan VAE ({type(model).__name__})"
    return _parts(model.encoder, ("conv1", "downsamples", "middle", "head"), "its encoder") or _parts(
        model, ("conv1",), "the model")


class _First:
    """Stands in for ``model.conv1(out)`` in the host's ``mu, log_var = self.conv1(out).chunk(2, dim=1)``: its
    ``chunk`` gives ``out`` itself as ``mu``."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def chunk(self, n: int, dim: int = 0) -> tuple[torch.Tensor, None]:
        return self.x, None


class _Keep(torch.nn.Module):
    """Stands in for ``model.conv1`` in the prefix: hands the encoder's output through ``chunk``."""

    def forward(self, x: torch.Tensor) -> _First:
        return _First(x)


def _wan_prefix(model: Any, x: torch.Tensor) -> torch.Tensor:
    enc = model.encoder
    with swapped((enc, "middle", torch.nn.Sequential()), (enc, "head", torch.nn.Sequential()),
                  (model, "conv1", _Keep())):
        return model.encode(x)


def _wan_suffix(model: Any, feats: torch.Tensor, device: Any) -> torch.Tensor:
    """Latent frame 0, then :data:`SUFFIX_FRAMES` at a time, through the host's ``encoder.forward`` (caches
    carried) with the prefix swapped out, then ``model.conv1``'s mean. An image encoder's 4-D features (Qwen-Image
    2.1's VAE: a Wan 2.2 layout with time kernel 1) are one frame."""
    if feats.ndim == 4:
        return _wan_suffix(model, feats.unsqueeze(2), device).squeeze(2)
    enc = model.encoder
    n_cache = sum(1 for _ in enc.modules()) + 1  # more slots than any encoder uses
    cache: list[Any] = [None] * n_cache
    final = "final" in inspect.signature(enc.forward).parameters
    t, f = int(feats.shape[2]), SUFFIX_FRAMES
    bounds = [0, 1, *range(1 + f, t, f), t] if t > 1 else [0, 1]
    outs = []
    with swapped((enc, "conv1", _Pass()), (enc, "downsamples", torch.nn.Sequential())):
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            kw = {"final": b == t} if final else {}
            outs.append(enc(feats[:, :, a:b].to(device), feat_cache=cache, feat_idx=[0], **kw))
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return model.conv1(out).chunk(2, dim=1)[0]


# ------------------------------------------------------------------------------------------------ LTX-Video


def _ltx_reason(model: Any) -> str | None:
    return _module(model, "comfy.ldm.lightricks.vae.") or _parts(
        model.encoder, ("conv_in", "down_blocks", "conv_out"), "its encoder")


def _ltx_prefix(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model.encode(x)


def _ltx_suffix(model: Any, feats: torch.Tensor, device: Any) -> torch.Tensor:
    return feats.to(device)


# ------------------------------------------------------------------------------------------------ HunyuanVideo 1.5


def _hv15_reason(model: Any) -> str | None:
    why = _module(model, "comfy.ldm.hunyuan_video.vae_refiner")
    if why is not None:
        return why
    enc = model.encoder
    if not getattr(enc, "refiner_vae", False):
        return "its encoder normalizes with GroupNorm over the clip (refiner_vae False: Hunyuan Image's refiner)"
    return _parts(enc, ("conv_in", "down", "mid", "norm_out", "conv_out"), "its encoder") or _parts(
        enc.mid, ("block_1", "attn_1", "block_2"), "its mid block")


def _hv15_prefix(model: Any, x: torch.Tensor) -> torch.Tensor:
    with swapped((model.encoder.mid, "block_1", _Capture())):
        return _until(lambda: model.encode(x))


def _hv15_suffix(model: Any, feats: torch.Tensor, device: Any) -> torch.Tensor:
    """The host's ``model.encode`` of a 1-frame stand-in input whose ``conv_in`` gives the prefix's output
    (``down`` empty): one chunk, then the mid block and the rest as the host runs them."""
    enc = model.encoder
    stand_in = torch.zeros((1, 1, 1, 1, 1), dtype=feats.dtype, device=device)  # one frame: one chunk
    with swapped((enc, "conv_in", _Feed(feats.to(device))), (enc, "down", torch.nn.ModuleList())):
        return model.encode(stand_in)


# ------------------------------------------------------------------------------------------------ DC-AE (Sana)


def _dcae_cut(enc: Any) -> int:
    """Index of the encoder's first stage with a global module (``len(down_blocks)``: none)."""
    for i, stage in enumerate(enc.down_blocks):
        if any(is_global(m) for m in stage.modules()):
            return i
    return len(enc.down_blocks)


def _dcae_reason(model: Any) -> str | None:
    enc = getattr(model, "encoder", None)
    if not is_dcae(enc):
        return "not a DC-AE encoder (diffusers autoencoder_dc, ComfyUI_ExtraModels' dcae)"
    why = _parts(enc, ("conv_in", "down_blocks", "conv_out"), "its encoder")
    if why is not None:
        return why
    if getattr(model, "use_tiling", False):
        return "the VAE's own tiled encode is enabled (its encode is not the encoder's forward)"
    if _dcae_cut(enc) == 0:
        return "its first stage has a global module (nothing local to tile)"
    return None


def _dcae_finer(model: Any) -> int:
    """Prefix px per latent px: 2 per downsampling block (``DCDownBlock2d``) after the cut."""
    enc = model.encoder
    later = list(enc.down_blocks)[_dcae_cut(enc):]
    return 2 ** sum(type(m).__name__ == "DCDownBlock2d" for stage in later for m in stage.modules())


def _dcae_prefix(model: Any, x: torch.Tensor) -> torch.Tensor:
    enc = model.encoder
    k = _dcae_cut(enc)
    if k == len(enc.down_blocks):
        return model.encode(x)  # nothing global: the whole encode is the prefix
    with swapped((enc.down_blocks, str(k), _Capture())):
        return _until(lambda: model.encode(x))


def _dcae_suffix(model: Any, feats: torch.Tensor, device: Any) -> torch.Tensor:
    """The host's ``model.encode`` of a 1-px stand-in whose ``conv_in`` gives the prefix's output and whose local
    stages are empty: the attention stages, ``conv_out`` and its shortcut as the host runs them."""
    enc = model.encoder
    k = _dcae_cut(enc)
    if k == len(enc.down_blocks):
        return feats.to(device)
    stand_in = torch.zeros((1, 1, 1, 1), dtype=feats.dtype, device=device)
    local = [(enc.down_blocks, str(i), torch.nn.Sequential()) for i in range(k)]
    with swapped((enc, "conv_in", _Feed(feats.to(device))), *local):
        return model.encode(stand_in)


def _named(*names: str, module: str | tuple[str, ...] = "") -> Callable[[Any], bool]:
    """A ``residual`` predicate: a module whose class is one of ``names``, from a module path starting with
    ``module`` (or one of them)."""
    return lambda m: type(m).__name__ in names and type(m).__module__.startswith(module)


DESCRIPTIONS: tuple[EncodeSplit, ...] = (
    EncodeSplit("wan", _wan_reason, _wan_prefix, _wan_suffix,
                "the encoder's local part (conv1, downsamples) in spatial tiles through its own causal chunk loop, "
                "its middle (per-frame attention) and head on whole latent frames", wan=True,
                residual=_named("ResidualBlock", module="comfy.ldm.wan.")),
    EncodeSplit("ltx_video", _ltx_reason, _ltx_prefix, _ltx_suffix,
                "the whole encoder (local: pixel norms, causal convolutions) in spatial tiles through its own "
                "chunk loop", residual=_named("ResnetBlock3D", module="comfy.ldm.lightricks.")),
    EncodeSplit("hunyuan_video15", _hv15_reason, _hv15_prefix, _hv15_suffix,
                "the encoder's local part (conv_in, down) in spatial tiles through its own causal chunks, its mid "
                "block (attention over the clip) and output on the whole latent",
                residual=_named("HunyuanRefinerResnetBlock", "ResnetBlock",  # 0.33: the generic block, carried
                                module=("comfy.ldm.hunyuan_video.", "comfy.ldm.modules.diffusionmodules.model"))),
    EncodeSplit("dc-ae", _dcae_reason, _dcae_prefix, _dcae_suffix,
                "the encoder's local part (conv_in, the ResBlock stages) in tiles, its EfficientViT stages (global "
                "linear attention) and output on the whole image", finer=_dcae_finer,
                residual=_named("ResBlock", module="diffusers.")),
)

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def encode_split(model: Any) -> tuple[EncodeSplit | None, str | None]:
    """(the description of ``model``'s encoder, None) or (None, why none fits), once per model object."""
    try:
        found = _FOUND.get(model)
    except TypeError:
        found = None
    if found is None:
        found = first_fit(DESCRIPTIONS, model, "split description")
        with contextlib.suppress(TypeError):
            _FOUND[model] = found
    return found


def prefix_ratio(model: Any, split: EncodeSplit, latent_ratio: int) -> int:
    """Image px per px of the prefix's output (the tiles' unit): the latent ratio over ``split.finer``."""
    finer = split.finer(model) if split.finer is not None else 1
    if finer < 1 or latent_ratio % finer:
        raise ValueError(f"the {split.name} prefix's scale (1/{finer} latent px) does not divide {latent_ratio} px")
    return latent_ratio // finer


_REACH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
TRACE_LATENT = 8
"""Prefix px (h, w) of the traced run: a convolution padded by its caller then rounds to its true scale."""


def split_reach(model: Any, split: EncodeSplit, ratio: int, channels: int, dtype: torch.dtype,
                device: torch.device, video: bool = True) -> EncoderReach:
    """The prefix's reach (px of its output, ``ratio`` image px each) and the global modules it ran, traced once
    per model object on a fake input of :data:`TRACE_LATENT` prefix px (a video: one frame). Raises ValueError
    when the prefix's output is not ``ratio`` times smaller (the description does not fit the encoder)."""
    per, key = _per_model(_REACH, model), (ratio, channels, str(dtype), str(device), video)
    if key not in per:
        n = TRACE_LATENT * ratio
        out: list[tuple[int, ...]] = []
        with torch.inference_mode(), MetaSizer([model], dtype, device):
            x = torch.empty((1, channels, 1, n, n) if video else (1, channels, n, n), dtype=dtype, device=device)
            found = traced_encoder_reach(
                model, lambda: out.append(tuple(split.prefix(model, x).shape[-2:])), TRACE_LATENT, is_global)
        if out and out[0] != (TRACE_LATENT, TRACE_LATENT):
            raise ValueError(f"the {split.name} prefix gives {out[0]} px for {n} px, not 1/{ratio}")
        per[key] = found
    return per[key]


def _per_model(store: weakref.WeakKeyDictionary, model: Any) -> dict:
    """The traces kept for ``model`` (a fresh dict at every call for a model that cannot be weakly referenced)."""
    try:
        return store.setdefault(model, {})
    except TypeError:
        return {}


_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
HOLD_FRAMES = 9
"""Frames (at most) of :func:`held_blocks`' traced run: the hosts' chunk loops reach a whole chunk within them
(Wan: 1 + 4 or 1 + 2 + 2, HunyuanVideo 1.5: 1 + 8; LTX-Video takes 1 + 8k frames at once)."""


def held_blocks(model: Any, split: EncodeSplit, ratio: int, channels: int, dtype: torch.dtype,
                device: torch.device, frames: int = 0) -> tuple[Held, ...]:
    """The prefix's residual blocks (``split.residual``) as one run of it met them, traced once per model object on
    a fake input of :data:`TRACE_LATENT` prefix px (``ratio`` image px each) and ``min(frames, HOLD_FRAMES)``
    frames (0: an image): what each one holds at once on any tile (:class:`Held`), for the planner's lower bound
    before any sizing. Empty where the family describes no residual block."""
    if split.residual is None:
        return ()
    f = min(int(frames), HOLD_FRAMES)
    per, key = _per_model(_HELD, model), (ratio, channels, str(dtype), str(device), f)
    if key not in per:
        n = TRACE_LATENT * ratio
        seen: dict[int, Held] = {}

        def hook(module: Any, args: Any, out: Any) -> None:
            x = args[0] if args else None
            if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor) or n % int(x.shape[-1]):
                return
            t = int(x.shape[2]) if x.ndim == 5 else 1
            was = seen.get(id(module))
            seen[id(module)] = Held(int(x.shape[1]), int(out.shape[1]), max(t, was.frames if was else 0),
                                    n // int(x.shape[-1]))

        handles = [m.register_forward_hook(hook) for m in model.modules() if split.residual(m)]
        try:
            with torch.inference_mode(), MetaSizer([model], dtype, device):
                x = torch.empty((1, channels, f, n, n) if f else (1, channels, n, n), dtype=dtype, device=device)
                split.prefix(model, x)
        finally:
            for h in handles:
                h.remove()
        per[key] = tuple(seen.values())
    return per[key]
