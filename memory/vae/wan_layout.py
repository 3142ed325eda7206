"""The structure of a Wan 2.1 / 2.2 decoder as the chunked executor and its planner use it, walked once from
the modules (duck-typed, ComfyUI's ``comfy/ldm/wan/vae.py`` and ``vae2_2.py``): cache slots, split points and
the convolutional reach of the tiled part (:func:`wan_layout`), and the host's cache protocol
(:func:`cache_protocol`). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import weakref
from typing import Any

import torch

from ..geometry import decoded_frames

log = logging.getLogger("vramfit.memory.vae.wan_layout")

__all__ = ["CACHE_T", "CacheProtocol", "CacheSlot", "SplitInfo", "WanLayout", "accepts", "cache_protocol",
           "frames_of", "is_causal", "is_wan_vae", "time_upsamples", "views_more", "wan_layout"]

CACHE_T = 2
"""Frames a causal-conv cache entry holds (``comfy.ldm.wan.vae.CACHE_T``)."""


def frames_of(latent_frames: int, factor: int) -> int:
    """Frames a causal decoder yields for latent frames ``[0, T)`` at temporal factor ``factor``: ``1 + f (T - 1)``
    (latent frame 0 yields one frame), 0 for none. Also the index of the first frame of latent frame ``T``."""
    return 0 if latent_frames <= 0 else decoded_frames(int(latent_frames), int(factor), True)


def time_upsamples(decoder: Any) -> list[bool]:
    """Per ``decoder.upsamples`` layer: a Wan 2.1 ``Resample("upsample3d")`` (a temporal upsample), after which
    the host's ``Decoder3d.run_up`` and the executor run the rest on ``CACHE_T``-frame slices."""
    return [getattr(layer, "mode", None) == "upsample3d" for layer in decoder.upsamples]


def _is_conv3d(m: Any) -> bool:
    return isinstance(m, torch.nn.Conv3d)


def is_causal(m: Any) -> bool:
    """ComfyUI's ``CausalConv3d``: a Conv3d with the causal ``_padding`` tuple."""
    return _is_conv3d(m) and hasattr(m, "_padding")


def _radius(conv: Any) -> float:
    """Spatial radius (px of the conv's input): ``dilation * (kernel - 1) / 2`` over the last two dims."""
    k = tuple(conv.kernel_size)[-2:]
    d = tuple(conv.dilation)[-2:]
    return max(di * (ki - 1) / 2 for ki, di in zip(k, d, strict=True))


def accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class CacheSlot:
    """One ``feat_cache`` entry: the input of a cached causal conv (or a temporal upsample's state)."""

    index: int
    name: str
    channels: int
    scale: int
    """Spatial scale vs the latent (1, 2, 4, 8)."""
    kind: str
    """``"conv"`` (residual/conv1/head conv) or ``"time_up"`` (temporal upsample: ``'Rep'`` after frame 0)."""
    frames: int = 1
    """Temporal factor of the slot's input vs the latent (1, 2, 4): a chunk of ``k`` later latent frames
    gives the slot ``frames * k`` input frames."""


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """What cutting the decoder before ``decoder.upsamples[split]`` means.

    The global part (conv1 + middle + ``upsamples[:split]``) runs on whole frames and produces a
    ``(B, channels, frame_factor * k, H * scale, W * scale)`` activation for a chunk of ``k`` later
    latent frames; the tiled part needs a halo of ``halo = ceil(reach)`` latent px.
    """

    split: int
    scale: int
    channels: int
    frame_factor: int
    reach: float
    first_slot: int
    """Index of the first cache slot of the tiled part (``n_global``)."""

    @property
    def halo(self) -> int:
        return int(math.ceil(self.reach - 1e-9))


@dataclasses.dataclass(frozen=True)
class WanLayout:
    """Structure of a Wan ``first_stage_model`` (2.1 or 2.2) as the chunked executor uses it."""

    version: str
    """``"2.1"`` (``Resample`` up path) or ``"2.2"`` (``Up_ResidualBlock`` up path with the ``first_chunk`` flag: Wan
    2.2, Qwen-Image 2.1)."""
    latent_channels: int
    temporal_ratio: int
    decoder_ratio: int
    """Spatial scale of the decoder's head output (8; 16 for Qwen-Image 2.1's five levels)."""
    patch: int
    """Unpatchify factor after the head (1 for 2.1, 2 for 2.2, the model's ``patch_size`` where it has one)."""
    out_channels: int
    """Channels of the decoded image (3; 4 for Qwen-Image 2.1's RGBA)."""
    slots: tuple[CacheSlot, ...]
    splits: tuple[SplitInfo, ...]
    """``splits[i]``: cutting before ``upsamples[i]`` (``i = 0 .. len(upsamples)``)."""
    default_split: int
    tiled_global_ops: tuple[str, ...]
    """Global modules (attention) after each split point would make tiling inexact; empty for Wan."""
    n_cache: int
    """Length of ComfyUI's cache list (``count_conv3d(decoder)``)."""
    temporal_kernel: int = 3
    """Time taps of the decoder's causal convolutions (3; 1 for Qwen-Image 2.1's, whose frames never mix)."""
    time_up: tuple[bool, ...] = ()
    """Per ``decoder.upsamples`` layer: a temporal upsample (:func:`time_upsamples`)."""
    first_chunk: tuple[bool, ...] = ()
    """Per ``decoder.upsamples`` layer: it takes Wan 2.2's ``first_chunk`` flag."""
    mid_cached: tuple[bool, ...] = ()
    """Per ``decoder.middle`` layer: it takes the cache list (``feat_cache``)."""

    @property
    def spatial_ratio(self) -> int:
        return self.decoder_ratio * self.patch

    @property
    def variant(self) -> str:
        """The structure in words, as detected from the modules (never from a module or class name)."""
        return (f"Wan {self.version} layout: {self.latent_channels} latent channels, temporal kernel "
                f"{self.temporal_kernel}, patch {self.patch}, {self.out_channels} image channels, "
                f"{self.spatial_ratio}x")

    def split_info(self, split: int | None = None) -> SplitInfo:
        return self.splits[self.default_split if split is None else int(split)]

    # -- geometry for the planner --------------------------------------------------------------
    def out_frames(self, latent_frames: int) -> int:
        """Output frames of a clip: ``1 + r (T - 1)`` (``r`` = 4)."""
        return frames_of(latent_frames, self.temporal_ratio)

    def chunk_out_frames(self, k: int, first: bool = False) -> int:
        """Output frames of a chunk of ``k`` latent frames (the first chunk is frame 0 alone: 1)."""
        return 1 if first else self.temporal_ratio * int(k)

    def out_frame_start(self, latent_start: int) -> int:
        """Index of the first output frame of the chunk starting at latent frame ``latent_start``."""
        return frames_of(latent_start, self.temporal_ratio)

    def frame_starts(self, latent_frames: int, split: int | None = None) -> tuple[list[int], list[int]]:
        """``(out, store)``: for latent frames ``0 .. T`` (the clip's end included), the index of each one's first
        output frame (:meth:`out_frame_start`) and of its first frame in the store of the global part cut at
        ``split`` (the split's frame factor)."""
        f = self.split_info(split).frame_factor
        ends = range(int(latent_frames) + 1)
        return [self.out_frame_start(p) for p in ends], [frames_of(p, f) for p in ends]

    def cache_bytes(
        self,
        latent_h: int,
        latent_w: int,
        batch: int = 1,
        itemsize: int = 2,
        split: int | None = None,
        part: str = "tiled",
    ) -> int:
        """Bytes of the cache entries of one region of ``latent_h x latent_w`` latent px (a tile's
        halo-extended region for ``part="tiled"``, the whole frame for ``"global"``/``"all"``), at most
        2 frames each. With ``rollback`` the committed and the next cache coexist during a chunk (x2)."""
        first = self.split_info(split).first_slot
        total = 0
        for s in self.slots:
            tiled = s.index >= first
            if part == "all" or (part == "tiled") == tiled:
                total += s.channels * CACHE_T * latent_h * s.scale * latent_w * s.scale
        return int(total) * int(batch) * int(itemsize)

    def store_frames(self, latent_frames: int, split: int | None = None, start: int = 0) -> int:
        """Frames of the global part's output (the store) for latent frames ``[start, T)``: the split's
        frame factor ``f`` gives ``1 + f (T - 1)`` frames from 0 (latent frame 0 yields one frame)."""
        f = self.split_info(split).frame_factor
        return max(0, frames_of(latent_frames, f) - frames_of(start, f))

    def store_bytes(
        self,
        latent_h: int,
        latent_w: int,
        latent_frames: int,
        batch: int = 1,
        itemsize: int = 2,
        split: int | None = None,
    ) -> int:
        """Bytes of the store: the global part's output for every latent frame, whole frames
        (``(B, channels, store_frames(T), H * scale, W * scale)``)."""
        si = self.split_info(split)
        frames = self.store_frames(latent_frames, split)
        return int(batch * si.channels * frames * latent_h * si.scale * latent_w * si.scale * itemsize)


def _walk(
    layer: Any,
    name: str,
    scale: int,
    tf: int,
    slots: list[tuple[str, int, int, str, int]],
    contrib: list[tuple[str, float]],
    global_ops: list[str],
) -> tuple[int, int, int | None]:
    """Walk one decoder layer in forward order. Returns (scale, temporal factor, output channels)."""
    residual = getattr(layer, "residual", None)
    if isinstance(residual, torch.nn.Sequential):  # ResidualBlock
        r, out_c = 0.0, None
        for j, sub in enumerate(residual):
            if _is_conv3d(sub):
                slots.append((f"{name}.residual.{j}", int(sub.in_channels), scale, "conv", tf))
                r += _radius(sub) / scale
                out_c = int(sub.out_channels)
        sc = getattr(layer, "shortcut", None)
        if _is_conv3d(sc) or isinstance(sc, torch.nn.Conv2d):
            r = max(r, _radius(sc) / scale)
        contrib.append((name, r))
        return scale, tf, out_c
    mode = getattr(layer, "mode", None)
    if isinstance(mode, str) and hasattr(layer, "resample"):  # Resample
        if mode.startswith("downsample"):
            raise ValueError(f"{name}: a downsample in a decoder is not a Wan decoder")
        out_c = None
        if mode == "upsample3d":
            slots.append((f"{name}.time_conv", int(layer.time_conv.in_channels), scale, "time_up", tf))
            tf *= 2
        subs = layer.resample if isinstance(layer.resample, torch.nn.Sequential) else [layer.resample]
        r = 0.0
        for sub in subs:
            if isinstance(sub, torch.nn.Upsample):
                sf = sub.scale_factor
                sf = sf[-1] if isinstance(sf, (tuple, list)) else sf
                scale = int(round(scale * float(sf)))
            elif isinstance(sub, (torch.nn.Conv2d, torch.nn.Conv3d)):
                r += _radius(sub) / scale
                out_c = int(sub.out_channels)
        contrib.append((name, r))
        return scale, tf, out_c
    inner = getattr(layer, "upsamples", None)
    if isinstance(inner, torch.nn.Sequential):  # Wan 2.2 Up_ResidualBlock (avg_shortcut: no conv, local)
        out_c = None
        for j, sub in enumerate(inner):
            scale, tf, c = _walk(sub, f"{name}.upsamples.{j}", scale, tf, slots, contrib, global_ops)
            out_c = c if c is not None else out_c
        return scale, tf, out_c
    lname = type(layer).__name__.lower()
    if "attn" in lname or "attention" in lname:
        global_ops.append(name)
        return scale, tf, None
    if any(isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) for m in layer.modules()):
        raise ValueError(f"{name}: unknown decoder layer {type(layer).__name__}")
    return scale, tf, None


def is_wan_vae(model: Any) -> bool:
    """True when ``model`` (a ``first_stage_model``) looks like ComfyUI's Wan 2.1/2.2 ``WanVAE``."""
    dec = getattr(model, "decoder", None)
    return (
        dec is not None
        and is_causal(getattr(model, "conv2", None))
        and all(hasattr(dec, n) for n in ("conv1", "middle", "upsamples", "head"))
        and is_causal(getattr(dec, "conv1", None))
        and accepts(dec.forward, "feat_cache")
    )


# --------------------------------------------------------------------------------------------------
# The host's cache protocol (measured on the modules, never read from a version string)

@dataclasses.dataclass(frozen=True)
class CacheProtocol:
    """How the host's cached Wan blocks update their causal-conv cache entries (:func:`cache_protocol`).

    * ``"carry"`` (ComfyUI 0.3.x; Wan 2.2's blocks everywhere): an entry keeps the last two frames of the
      conv's input across calls (a one-frame call prepends the previous entry's last frame) and is a copy,
      so any number of frames per call gives the full causal sequence.
    * ``"per_call"`` (ComfyUI 0.33, Wan 2.1): an entry holds the last (up to) two frames *of the call*, as a
      view of the block's activation. Two one-frame calls in a row lose a frame of history (the conv pads a
      zero instead); the host never makes such calls (it decodes two latent frames per call), a chunk of one
      latent frame does. The executor then restores the history itself (:attr:`restores`) and copies the
      entries that are views of larger activations (:attr:`compacts`).
    * ``"unknown"``: the probe failed or kept another number of frames: the executor restores and compacts,
      and only the self-check can tell whether that reproduces the host.
    """

    name: str
    frames_kept: int
    """Frames the probed entry holds after two one-frame calls (-1: the probe failed)."""
    views: bool
    """The probed entry is a view (of the block's activation) rather than a copy."""

    @property
    def restores(self) -> bool:
        return self.name != "carry"

    @property
    def compacts(self) -> bool:
        return self.views or self.name == "unknown"


def views_more(t: torch.Tensor) -> bool:
    """``t`` is a view into a larger storage (keeping the rest of it alive); told by the storage, so it also
    works on inference tensors, whose views carry no view metadata (``_base`` is None)."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


_PROTOCOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_protocol(model: Any) -> CacheProtocol:
    """The cache protocol of a Wan ``first_stage_model``'s blocks, measured: the decoder's first cached
    residual block runs twice on a one-frame 1x1 zero input with a fresh cache list; its first entry then
    holds 2 frames (``"carry"``) or 1 (``"per_call"``); a third call of 3 frames tells whether the entry is a
    view of the activation (its storage larger than itself). Microseconds; shapes only (works on fake and
    inference tensors alike); memoised per model object."""
    found = _PROTOCOLS.get(model)
    if found is not None:
        return found
    proto = CacheProtocol("unknown", -1, False)
    block = next((layer for layer in model.decoder.middle
                  if isinstance(getattr(layer, "residual", None), torch.nn.Sequential)
                  and accepts(layer.forward, "feat_cache")), None)
    if block is not None:
        convs = [m for m in block.residual if _is_conv3d(m)]
        p = next(block.parameters())
        x = torch.zeros((1, int(convs[0].in_channels), 1, 1, 1), dtype=p.dtype, device=p.device)
        cache: list = [None] * len(convs)
        try:
            with torch.no_grad():
                for _ in range(2):
                    block(x, cache, [0])
                kept = int(cache[0].shape[2])
                # A call of 3 frames: a view of the block's activation holds more storage than its 2 frames.
                # Told by the storage, not ``_base``: views of inference tensors (ComfyUI runs every node
                # under ``torch.inference_mode``) have no ``_base``.
                block(x.expand(-1, -1, CACHE_T + 1, -1, -1), cache, [0])
                views = views_more(cache[0])
            proto = CacheProtocol({2: "carry", 1: "per_call"}.get(kept, "unknown"), kept, views)
        except Exception as e:  # noqa: BLE001 - an unexpected block: unknown protocol, the self-check decides
            log.warning("probing the Wan cache protocol failed (%s: %s)", type(e).__name__, e)
    _PROTOCOLS[model] = proto
    log.debug("Wan cache protocol of %s: %s", type(model).__qualname__, proto)
    return proto


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wan_layout(model: Any) -> WanLayout:
    """Walk a Wan ``first_stage_model`` (once per model object): cache slots (index, channels, scale), split
    points and the convolutional reach of the tiled part for each, temporal/spatial ratios. Raises
    ``ValueError`` when the model is not a Wan VAE this executor understands."""
    found = _LAYOUTS.get(model)
    if found is None:
        found = _LAYOUTS[model] = _walk_decoder(model)
    return found


def _walk_decoder(model: Any) -> WanLayout:
    if not is_wan_vae(model):
        raise ValueError(
            f"not a Wan VAE (no decoder.conv1/middle/upsamples/head with feat_cache): {type(model)}"
        )
    dec = model.decoder
    slots: list[tuple[str, int, int, str, int]] = []
    contrib: list[tuple[str, float]] = []
    glob: list[str] = []
    slots.append(("conv1", int(dec.conv1.in_channels), 1, "conv", 1))
    channels = int(dec.conv1.out_channels)
    scale, tf = 1, 1
    for j, layer in enumerate(dec.middle):
        scale, tf, c = _walk(layer, f"middle.{j}", scale, tf, slots, contrib, glob)
        channels = c or channels
    if scale != 1:
        raise ValueError("the middle block changes the scale")
    # Cut points before each upsample layer.
    cut_state = []
    for j, layer in enumerate(dec.upsamples):
        cut_state.append((j, scale, tf, channels, len(slots), len(contrib), len(glob)))
        scale, tf, c = _walk(layer, f"upsamples.{j}", scale, tf, slots, contrib, glob)
        channels = c or channels
    cut_state.append((len(dec.upsamples), scale, tf, channels, len(slots), len(contrib), len(glob)))
    head_c = None
    for j, sub in enumerate(dec.head):
        if _is_conv3d(sub):
            slots.append((f"head.{j}", int(sub.in_channels), scale, "conv", tf))
            contrib.append((f"head.{j}", _radius(sub) / scale))
            head_c = int(sub.out_channels)
    if head_c is None:
        raise ValueError("decoder.head has no convolution")
    first_chunk = tuple(accepts(layer.forward, "first_chunk") for layer in dec.upsamples)
    wan22 = any(first_chunk)
    patch = _patch(model, head_c, wan22)
    total_reach = [sum(v for _, v in contrib[i:]) for i in range(len(contrib) + 1)]
    splits = []
    tiled_glob: tuple[str, ...] = ()
    for j, s, t, c, n_slots, n_contrib, n_glob in cut_state:
        splits.append(SplitInfo(j, s, c, t, total_reach[n_contrib], n_slots))
        if j == 0:
            tiled_glob = tuple(glob[n_glob:])
    # Default split: the last cut at scale <= 2. The global part's output there is 1/8 of one
    # full-resolution activation per output frame for Wan 2.1 and 2.2 (channels x area x frames), and
    # the tiled part's reach (halo) drops from 12.25 to 2.75 (2.1) / 5.75 (2.2) latent px.
    default = max(j for j, s, *_ in cut_state if s <= 2)
    return WanLayout(
        version="2.2" if wan22 or patch > 1 else "2.1",
        latent_channels=int(model.conv2.in_channels),
        temporal_ratio=tf,
        decoder_ratio=scale,
        patch=patch,
        out_channels=head_c // (patch * patch),
        slots=tuple(CacheSlot(i, n, c, s, k, f) for i, (n, c, s, k, f) in enumerate(slots)),
        splits=tuple(splits),
        default_split=default,
        tiled_global_ops=tiled_glob,
        n_cache=sum(1 for m in dec.modules() if _is_conv3d(m)),
        temporal_kernel=int(dec.conv1.kernel_size[0]),
        time_up=tuple(time_upsamples(dec)),
        first_chunk=first_chunk,
        mid_cached=tuple(accepts(layer.forward, "feat_cache") for layer in dec.middle),
    )


def _patch(model: Any, head_c: int, wan22: bool) -> int:
    """The unpatchify factor after the head: the model's ``patch_size`` (newer ``vae2_2``: 2 for Wan 2.2, 1 for
    Qwen-Image 2.1), else what the host's code fixes (0.33's ``vae2_2`` unpatchifies by 2, ``vae.py`` not at
    all). Raises ``ValueError`` when the head's channels do not split into ``p^2`` patches."""
    found = getattr(model, "patch_size", None)
    patch = found if isinstance(found, int) and found >= 1 else (2 if wan22 else 1)
    if head_c % (patch * patch):
        raise ValueError(f"head output channels {head_c} are not a multiple of patch {patch} squared")
    return patch
