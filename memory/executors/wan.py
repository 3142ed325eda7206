"""Temporal-chunk video decode: exact causal chunking (+ spatial tiles) for Wan, overlap-blend for the rest.

Wan 2.1 / 2.2 (exact): :func:`decode_wan_chunked`
---------------------------------------------------
The Wan decoder (``comfy/ldm/wan/vae.py``, ``vae2_2.py``) keeps every temporal dependency in the
causal-convolution caches (``feat_cache``: per cached conv, the conv's input at the last two frames,
or ``'Rep'`` for a temporal upsample that has only seen the first frame), normalises per position
(RMS over channels) and attends within a frame. ComfyUI decodes one latent frame per call and grows
the output with ``torch.cat``. Here:

* **Chunks.** Latent frame 0 is decoded alone (the decoder's first call marks each temporal upsample
  ``'Rep'`` and yields one frame; a first chunk of several frames would yield the wrong frame
  count), then chunks of ``frames_per_chunk`` latent frames with the caches carried across. A chunk
  of ``k`` later frames gives the same ``4 k`` frames as ``k`` one-frame calls (float noise).
* **One output tensor.** Frames are written into one preallocated ``(B, 3, 1 + 4 (T - 1), H, W)``
  tensor (what ``first_stage_model.decode`` returns, range [-1, 1]); nothing grows by ``torch.cat``.
* **Spatial tiles.** The decoder is cut at ``split`` (an index into ``decoder.upsamples``). The
  *global part* (``conv1``, the middle block with its per-frame attention, ``upsamples[:split]``)
  runs on the whole frame; the *tiled part* (``upsamples[split:]`` + ``head``) runs per tile on the
  tile's core plus a halo of at least its convolutional reach (walked from the modules:
  :func:`wan_layout`), and the core is cropped. Every norm is per position and nothing in the tiled
  part is global, so the cropped core equals the untiled decode (float noise).
* **Tile-major order.** With tiles, phase 1 runs the global part over all latent frames (whole frames,
  low resolution, its own whole-frame caches) into a *store* of its output for every frame
  (``store_device``: the compute device, or pinned host memory on CUDA); phase 2 runs each tile over
  all chunks of time with only that tile's own causal caches (ComfyUI's full-length list: entries
  ``< n_global`` are ``None`` and never read, the others cover the tile's extended region) and writes
  its cropped core frames. One tile's caches are alive at a time, so the cache memory scales with the
  tile, not the frame. A tile's cache rim is wrong only as deep as each layer's partial reach, in every
  frame alike (a cached conv reads earlier frames whose wrong rim is as deep as the current one's), so
  a halo >= the reach keeps the core exact over time. With one tile (whole frames) the whole decoder
  runs chunk by chunk without a store (ComfyUI's flow, batched in time).
* **Two host cache protocols** (:func:`cache_protocol`, measured on the modules). ComfyUI 0.3.x's blocks
  keep each entry's last two frames across calls ("carry"); 0.33's Wan 2.1 blocks keep only the call's
  frames, as views ("per_call"), and its own decode never makes two one-frame calls in a row. On such a
  host the executor restores the history of one-frame chunks (the previous entry's last frame) and copies
  entries that are views of larger activations, after every host layer call; on "carry" hosts it does
  nothing extra. That this reproduces the host's ``VAEDecode`` is proven per host by a self-check
  (``video_decode.check_chunked``), not assumed.
* **Snapshot / commit.** ComfyUI's code only *replaces* cache list entries, never writes into them, so
  with ``rollback`` a tile-chunk works on a shallow copy of the tile's committed list and commits by
  swapping lists (2x one tile's cache); ``rollback=False`` is ComfyUI's in-place protocol (1x; an OOM
  starts that tile again). An OOM (acted on after leaving the ``except`` block) halves the chunk; at
  one latent frame the tile splits into two halves that resume from windows of its committed cache
  (a half's core + halo lies inside the tile's core + halo, where the tile's cache is exact except
  where the half computes wrong values anyway). Finished tiles are never decoded again.

Measured figures (fidelity, time, peaks at 480p/720p) are in ``docs/VIDEO_DECODE.md``.

Other video VAEs (approximate): :func:`decode_overlap_blend`
-----------------------------------------------------------
HunyuanVideo, LTX, Mochi, Cosmos: temporal chunks of latent frames overlapping by ``overlap`` latent
frames, each decoded independently by a caller-given ``decode_fn`` (whose causal state restarts),
placed with ComfyUI's frame formulas (``upscale_ratio`` / ``upscale_index_formula``) and cross-faded
with linear weights, as ``comfy.utils.tiled_scale_multidim`` does along time, but accumulated into one
output and a per-frame weight vector. Not exact.

``memory/`` never imports ComfyUI: models are duck-typed, ComfyUI callables are passed in.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..oom import OomEvent, OomResume
from .kl_exact import default_oom_exceptions, oom_types, split_even

log = logging.getLogger("vramfit.memory.video_chunked")

EXECUTOR_VERSION = "v1"
"""Version of the chunked executor's allocation pattern, part of every persisted video peak's key: bump it
when a change alters what the executor holds at its peak (the persisted peaks are then re-sized)."""

__all__ = [
    "CacheSlot",
    "SplitInfo",
    "WanLayout",
    "chunk_ranges",
    "decode_overlap_blend",
    "decode_wan_chunked",
    "default_oom_exceptions",
    "is_wan_vae",
    "overlap_chunks",
    "tile_spans",
    "wan_layout",
]

CACHE_T = 2
"""Frames a causal-conv cache entry holds (``comfy.ldm.wan.vae.CACHE_T``)."""

MIN_TILE = 2
"""Smallest tile core (latent px) the OOM fallback shrinks to."""

ProgressFn = Callable[[int, int], None]


def _oom_types(given: Sequence[type[BaseException]] | None) -> tuple[type[BaseException], ...]:
    """The exception types treated as out-of-memory: :func:`.tiled_exact.oom_types` (a bare ``Exception``,
    ComfyUI's ``OOM_EXCEPTION`` without CUDA, is dropped), shared by every executor."""
    return oom_types(given)


def _driver(
    oom: tuple[type[BaseException], ...], should_stop: Callable[[], Any] | None, on_oom: Callable[[], None] | None
) -> OomResume:
    """The shared OOM-resume driver; ``should_stop``'s exception propagates, a truthy return raises
    ``InterruptedError`` (through :meth:`.OomResume.check_stop`: never taken for an out-of-memory error)."""

    def stop() -> None:
        if should_stop is not None and should_stop():
            raise InterruptedError("video decode stopped by should_stop()")

    return OomResume(oom, should_stop=stop, on_oom=on_oom)


# --------------------------------------------------------------------------------------------------
# Geometry helpers (pure)

def tile_spans(n: int, tile: int, halo: int) -> list[tuple[int, int, int, int]]:
    """Tiles of one axis of ``n`` latent px: ``(core0, core1, ext0, ext1)``, cores of at most ``tile``
    (balanced, partitioning ``[0, n)``), extended by ``halo`` on each side and clipped to ``[0, n)``."""
    return [(a, b, max(0, a - halo), min(n, b + halo)) for a, b in split_even(n, tile)]


def chunk_ranges(latent_frames: int, frames_per_chunk: int) -> list[tuple[int, int]]:
    """Latent-frame ranges ``[start, stop)`` of the exact Wan chunking: ``[0, 1)`` alone, then chunks of
    ``frames_per_chunk`` (the last may be shorter). ``frames_per_chunk <= 0``: all the rest at once."""
    t = int(latent_frames)
    if t <= 0:
        return []
    k = t if frames_per_chunk <= 0 else int(frames_per_chunk)
    out = [(0, 1)]
    pos = 1
    while pos < t:
        out.append((pos, min(t, pos + k)))
        pos = out[-1][1]
    return out


def overlap_chunks(latent_frames: int, frames_per_chunk: int, overlap: int) -> list[tuple[int, int]]:
    """Overlapping latent-frame chunks ``[start, stop)`` as ComfyUI's ``tiled_scale_multidim`` places them
    along time (positions ``0, k - o, 2 (k - o), ...``; the last one clipped to the end)."""
    t, k = int(latent_frames), max(1, int(frames_per_chunk))
    o = max(0, min(int(overlap), k - 1))
    if t <= k:
        return [(0, t)]
    out = []
    for p in range(0, t - o, k - o):
        p = max(0, min(t - o, p))
        out.append((p, min(t, p + k)))
    return out


# --------------------------------------------------------------------------------------------------
# Wan decoder layout (duck-typed, walked from the modules)


def _is_conv3d(m: Any) -> bool:
    return isinstance(m, torch.nn.Conv3d)


def _is_causal(m: Any) -> bool:
    """ComfyUI's ``CausalConv3d``: a Conv3d with the causal ``_padding`` tuple."""
    return _is_conv3d(m) and hasattr(m, "_padding")


def _radius(conv: Any) -> float:
    """Spatial radius (px of the conv's input): ``dilation * (kernel - 1) / 2`` over the last two dims."""
    k = tuple(conv.kernel_size)[-2:]
    d = tuple(conv.dilation)[-2:]
    return max(di * (ki - 1) / 2 for ki, di in zip(k, d, strict=True))


def _accepts(fn: Any, name: str) -> bool:
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
    """``"2.1"`` (3-channel head) or ``"2.2"`` (12-channel head + 2x2 unpatchify, ``first_chunk`` flag)."""
    latent_channels: int
    temporal_ratio: int
    decoder_ratio: int
    """Spatial scale of the decoder's head output (8)."""
    patch: int
    """Unpatchify factor after the head (1 for 2.1, 2 for 2.2)."""
    out_channels: int
    slots: tuple[CacheSlot, ...]
    splits: tuple[SplitInfo, ...]
    """``splits[i]``: cutting before ``upsamples[i]`` (``i = 0 .. len(upsamples)``)."""
    default_split: int
    tiled_global_ops: tuple[str, ...]
    """Global modules (attention) after each split point would make tiling inexact; empty for Wan."""
    n_cache: int
    """Length of ComfyUI's cache list (``count_conv3d(decoder)``)."""

    @property
    def spatial_ratio(self) -> int:
        return self.decoder_ratio * self.patch

    def split_info(self, split: int | None = None) -> SplitInfo:
        return self.splits[self.default_split if split is None else int(split)]

    # -- geometry for the planner --------------------------------------------------------------
    def out_frames(self, latent_frames: int) -> int:
        """Output frames of a clip: ``1 + r (T - 1)`` (``r`` = 4)."""
        return 0 if latent_frames <= 0 else 1 + self.temporal_ratio * (int(latent_frames) - 1)

    def chunk_out_frames(self, k: int, first: bool = False) -> int:
        """Output frames of a chunk of ``k`` latent frames (the first chunk is frame 0 alone: 1)."""
        return 1 if first else self.temporal_ratio * int(k)

    def out_frame_start(self, latent_start: int) -> int:
        """Index of the first output frame of the chunk starting at latent frame ``latent_start``."""
        return 0 if latent_start <= 0 else 1 + self.temporal_ratio * (int(latent_start) - 1)

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

        def at(p: int) -> int:
            return 0 if p <= 0 else 1 + f * (int(p) - 1)

        return max(0, at(latent_frames) - at(start))

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
        and _is_causal(getattr(model, "conv2", None))
        and all(hasattr(dec, n) for n in ("conv1", "middle", "upsamples", "head"))
        and _is_causal(getattr(dec, "conv1", None))
        and _accepts(dec.forward, "feat_cache")
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


_PROTOCOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_protocol(model: Any) -> CacheProtocol:
    """The cache protocol of a Wan ``first_stage_model``'s blocks, measured: the decoder's first cached
    residual block runs twice on a one-frame 1x1 zero input with a fresh cache list; its first entry then
    holds 2 frames (``"carry"``) or 1 (``"per_call"``). Microseconds; shapes only (works on fake tensors);
    memoised per model object."""
    found = _PROTOCOLS.get(model)
    if found is not None:
        return found
    proto = CacheProtocol("unknown", -1, False)
    block = next((layer for layer in model.decoder.middle
                  if isinstance(getattr(layer, "residual", None), torch.nn.Sequential)
                  and _accepts(layer.forward, "feat_cache")), None)
    if block is not None:
        convs = [m for m in block.residual if _is_conv3d(m)]
        p = next(block.parameters())
        x = torch.zeros((1, int(convs[0].in_channels), 1, 1, 1), dtype=p.dtype, device=p.device)
        cache: list = [None] * len(convs)
        try:
            with torch.no_grad():
                for _ in range(2):
                    block(x, cache, [0])
            entry = cache[0]
            kept = int(entry.shape[2])
            proto = CacheProtocol({2: "carry", 1: "per_call"}.get(kept, "unknown"), kept, entry._base is not None)
        except Exception as e:  # noqa: BLE001 - an unexpected block: unknown protocol, the self-check decides
            log.warning("probing the Wan cache protocol failed (%s: %s)", type(e).__name__, e)
    _PROTOCOLS[model] = proto
    log.debug("Wan cache protocol of %s: %s", type(model).__qualname__, proto)
    return proto


def _views_more(t: torch.Tensor) -> bool:
    """``t`` is a view into a larger storage (keeping the rest of it alive)."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


def wan_layout(model: Any) -> WanLayout:
    """Walk a Wan ``first_stage_model``: cache slots (index, channels, scale), split points and the
    convolutional reach of the tiled part for each, temporal/spatial ratios. Raises ``ValueError`` when
    the model is not a Wan VAE this executor understands."""
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
    if head_c % 3 != 0 or math.isqrt(head_c // 3) ** 2 != head_c // 3:
        raise ValueError(f"head output channels {head_c} are not 3 * p^2")
    patch = math.isqrt(head_c // 3)
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
    version = (
        "2.2"
        if patch > 1 or any(_accepts(layer.forward, "first_chunk") for layer in dec.upsamples)
        else "2.1"
    )
    return WanLayout(
        version=version,
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
    )


def _unpatchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """``rearrange(x, "b (c r q) f h w -> b c f (h q) (w r)", q=p, r=p)`` (Wan 2.2's ``unpatchify``)."""
    if p == 1:
        return x
    b, cpp, f, h, w = x.shape
    c = cpp // (p * p)
    return x.reshape(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(b, c, f, h * p, w * p)


# --------------------------------------------------------------------------------------------------
# Wan executor


@dataclasses.dataclass(frozen=True)
class _Tile:
    """A tile: its core ``[c0, c1)`` and its halo-extended region ``[e0, e1)`` per axis (latent px)."""

    c0y: int
    c1y: int
    e0y: int
    e1y: int
    c0x: int
    c1x: int
    e0x: int
    e1x: int

    @property
    def core(self) -> tuple[int, int]:
        return (self.c1y - self.c0y, self.c1x - self.c0x)

    @property
    def ext(self) -> tuple[int, int]:
        return (self.e1y - self.e0y, self.e1x - self.e0x)


@dataclasses.dataclass
class _Item:
    """One tile's remaining work: the tile, its own causal caches (ComfyUI's full-length list; the tiled
    part's entries cover the tile's extended region) and the next latent frame to decode."""

    tile: _Tile
    cache: list
    pos: int
    inline: bool
    """Runs the global part itself, chunk by chunk (the one whole-frame tile: no store)."""


@dataclasses.dataclass
class _Store:
    """The global part's output for latent frames ``[pos, T)``: ``(B, C, frames, H s, W s)``."""

    x: torch.Tensor
    pos: int
    f0: int
    """Store frame index of latent frame ``pos`` (frames before it are not held)."""


class _WanRun:
    def __init__(
        self,
        model: Any,
        layout: WanLayout,
        z: torch.Tensor,
        k: int,
        tile: tuple[int, int] | None,
        halo: int,
        split: int,
        out: torch.Tensor,
        compute: torch.device,
        dtype: torch.dtype,
        store_device: torch.device,
        rollback: bool,
        progress: ProgressFn | None,
        should_stop: Callable[[], Any] | None,
        fault_hook: Callable[[int], None] | None,
        oom_exceptions: tuple[type[BaseException], ...],
        on_oom: Callable[[], None] | None,
        min_tile: int,
        pin: bool,
        split_hook: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
        sizing: bool = False,
    ) -> None:
        self.model = model
        self.dec = model.decoder
        self.lay = layout
        self.z = z
        self.B, _, self.T, self.H, self.W = (int(v) for v in z.shape)
        self.k = max(1, int(k))
        self.tile = tile  # None = whole frame
        self.halo = int(halo)
        self.split = int(split)
        self.si = layout.split_info(split)
        self.n_global = self.si.first_slot
        self.out = out
        self.compute = compute
        self.dtype = dtype
        self.store_device = store_device
        self.rollback = bool(rollback)
        self.progress = progress
        self.fault_hook = fault_hook
        self.driver = _driver(oom_exceptions, should_stop, on_oom)
        self.min_tile = max(1, int(min_tile))
        self.pin = pin
        self.split_hook = split_hook
        self.sizing = bool(sizing)
        self.store: _Store | None = None
        self.queue: list[_Item] = []
        self.global_left = 0  # phase-1 chunks still to run (progress)
        self.step = 0  # tile-chunk attempts (fault_hook index)
        self.done = 0  # finished units: tile-chunks and phase-1 chunks (progress)
        self.units = 0  # finished tile-chunks
        self.global_chunks = 0
        self.tiles_done = 0
        self.shrinks = 0
        self.restarts = 0
        self.up_first = [_accepts(layer.forward, "first_chunk") for layer in self.dec.upsamples]
        self.mid_cached = [_accepts(layer.forward, "feat_cache") for layer in self.dec.middle]
        self.protocol = cache_protocol(model)
        self.slot_frames = [s.frames for s in layout.slots]

    # -- plan ----------------------------------------------------------------------------------
    def _make_tile(self, c0y: int, c1y: int, c0x: int, c1x: int) -> _Tile:
        h = self.halo
        return _Tile(c0y, c1y, max(0, c0y - h), min(self.H, c1y + h), c0x, c1x, max(0, c0x - h), min(self.W, c1x + h))

    def tiles(self) -> list[_Tile]:
        th, tw = self.tile if self.tile is not None else (self.H, self.W)
        ys = tile_spans(self.H, th, self.halo)
        xs = tile_spans(self.W, tw, self.halo)
        return [_Tile(*y, *x) for y in ys for x in xs]

    def chunks_from(self, pos: int) -> list[tuple[int, int]]:
        """Chunks still to decode from latent frame ``pos`` with the current chunk size."""
        if pos <= 0:
            return chunk_ranges(self.T, self.k)
        return [(p, min(self.T, p + self.k)) for p in range(pos, self.T, self.k)]

    def _sframe(self, pos: int) -> int:
        """Store frame index of latent frame ``pos`` (frame 0 yields one frame, later ones ``f`` each)."""
        return 0 if pos <= 0 else 1 + self.si.frame_factor * (int(pos) - 1)

    def _report(self) -> None:
        if self.progress is not None:
            left = self.global_left + sum(len(self.chunks_from(it.pos)) for it in self.queue)
            self.progress(self.done, self.done + left)

    # -- decoder pieces (ComfyUI's modules, ComfyUI's cache protocol) --------------------------
    @staticmethod
    def _cached_conv(conv: Any, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
        """``Decoder3d.forward``'s inline caching around ``conv1`` and the head conv."""
        i = idx[0]
        cache_x = x[:, :, -CACHE_T:, :, :].clone()
        prev = cache[i]
        if cache_x.shape[2] < 2 and prev is not None:
            cache_x = torch.cat([prev[:, :, -1:, :, :].to(cache_x.device), cache_x], dim=2)
        x = conv(x, prev)
        del prev
        cache[i] = cache_x
        idx[0] += 1
        return x

    def history(self, cache: list, n: int, first: bool) -> list | None:
        """What a chunk of ``n`` later latent frames needs to restore the caches' history on hosts that do not
        carry it (:class:`CacheProtocol`): references to the entries of the slots whose input gets fewer than
        ``CACHE_T`` frames (``n * frames < 2``: latent-scale slots of one-frame chunks), taken before the
        chunk replaces them. None when nothing needs restoring."""
        if first or not self.protocol.restores:
            return None
        need = [i for i, f in enumerate(self.slot_frames) if n * f < CACHE_T]
        if not need:
            return None
        hist: list = [None] * len(cache)
        for i in need:
            hist[i] = cache[i]
        return hist

    def _settle(self, cache: list, a: int, b: int, hist: list | None) -> None:
        """After a host layer filled cache slots ``[a, b)``: a one-frame entry gets the previous entry's last
        frame prepended (the "carry" protocol: the conv's input at the last two frames; after ``'Rep'`` the
        conv's zero padding is that history already), and an entry that is a view of a larger activation is
        copied (so the activation can be freed). No-op on "carry" hosts."""
        if not (self.protocol.restores or self.protocol.compacts):
            return
        for i in range(a, b):
            e = cache[i]
            if not isinstance(e, torch.Tensor):
                continue
            prev = hist[i] if hist is not None else None
            if e.shape[2] < CACHE_T and isinstance(prev, torch.Tensor):
                cache[i] = torch.cat([prev[:, :, -1:].to(e.device), e], dim=2)
            elif self.protocol.compacts and _views_more(e):
                cache[i] = e.clone()

    def _layer(self, layer: Any, x: torch.Tensor, cache: list, idx: list[int], hist: list | None,
               first: bool | None = None) -> torch.Tensor:
        """One host layer with ComfyUI's cache protocol (``first``: Wan 2.2's ``first_chunk``), then
        :meth:`_settle` of the slots it used."""
        a = idx[0]
        x = layer(x, cache, idx) if first is None else layer(x, cache, idx, first)
        self._settle(cache, a, idx[0], hist)
        return x

    def _up(self, j: int, x: torch.Tensor, cache: list, idx: list[int], first: bool, hist: list | None) -> torch.Tensor:
        return self._layer(self.dec.upsamples[j], x, cache, idx, hist, first if self.up_first[j] else None)

    def global_part(self, zc: torch.Tensor, cache: list, first: bool, hist: list | None = None) -> torch.Tensor:
        idx = [0]
        x = self.model.conv2(zc)
        x = self._cached_conv(self.dec.conv1, x, cache, idx)
        for j, layer in enumerate(self.dec.middle):
            x = self._layer(layer, x, cache, idx, hist) if self.mid_cached[j] else layer(x)
        for j in range(self.split):
            x = self._up(j, x, cache, idx, first, hist)
        if idx[0] != self.n_global:
            raise RuntimeError(f"global part used {idx[0]} cache slots, layout says {self.n_global}")
        s = self.si.scale
        if x.shape[-2] != self.H * s or x.shape[-1] != self.W * s:
            raise RuntimeError(f"global part output {tuple(x.shape)} is not {s}x {self.H}x{self.W}")
        return x

    def tiled_part(self, x: torch.Tensor, cache: list, first: bool, hist: list | None = None) -> torch.Tensor:
        idx = [self.n_global]
        for j in range(self.split, len(self.dec.upsamples)):
            x = self._up(j, x, cache, idx, first, hist)
        for layer in self.dec.head:
            x = self._cached_conv(layer, x, cache, idx) if _is_causal(layer) else layer(x)
        if idx[0] != len(self.lay.slots):
            raise RuntimeError(f"decoder used {idx[0]} cache slots, layout says {len(self.lay.slots)}")
        return x

    # -- phase 1: the global part on whole frames, into the store ------------------------------
    def build_store(self, cache: list, pos: int) -> None:
        """Run the global part over latent frames ``[pos, T)`` from the global cache entries of ``cache``
        (whole frames, low resolution) and keep its output for every frame in the store.

        Chunks of ``k`` with snapshot/commit of the global cache (an OOM halves ``k`` and resumes); with
        ``rollback`` off and ``pos = 0`` the cache is used in place and an OOM starts phase 1 again."""
        self.store = None
        si = self.si
        f0 = self._sframe(pos)
        shape = (self.B, si.channels, self._sframe(self.T) - f0, self.H * si.scale, self.W * si.scale)
        buf = torch.empty(shape, dtype=self.dtype, device=self.store_device, pin_memory=self.pin)
        fresh = [None] * self.lay.n_cache
        cache = list(cache[: self.n_global]) + fresh[self.n_global :]
        in_place = not self.rollback and pos == 0
        p, n = pos, 1
        self.global_left = len(self.chunks_from(p))
        self._report()

        def attempt() -> list:
            nonlocal n
            n = 1 if p == 0 else min(self.k, self.T - p)
            self.driver.check_stop()
            hist = self.history(cache, n, p == 0)
            work = cache if in_place else list(cache)
            zc = self.z[:, :, p : p + n].to(device=self.compute, dtype=self.dtype)
            x = self.global_part(zc, work, p == 0, hist)
            del zc, hist
            if self.split_hook is not None:
                x = self.split_hook(x, p)
            a = self._sframe(p) - f0
            buf[:, :, a : a + x.shape[2]].copy_(x, non_blocking=self.pin)
            return work

        def recover(event: OomEvent) -> None:
            nonlocal cache, p
            if in_place:
                cache, p = list(fresh), pos
                self.restarts += 1
            self.k = max(1, n // 2)
            self.shrinks += 1
            log.warning("video decode: out of memory in the global part; resuming with k = %d", self.k)
            self.global_left = len(self.chunks_from(p))
            self._report()

        while p < self.T:
            cache = self.driver.run(attempt, can_recover=lambda e: n > 1, recover=recover)
            p += n
            self.global_chunks += 1
            self.global_left -= 1
            self.done += 1
            self._report()
        if self.pin and self.compute.type == "cuda":
            torch.cuda.synchronize(self.compute)  # the non-blocking copies into pinned memory have landed
        self.store = _Store(buf, pos, f0)

    # -- phase 2: one tile over time -----------------------------------------------------------
    def chunk(self, item: _Item, s0: int, s1: int) -> list:
        """Decode latent frames ``[s0, s1)`` of one tile, write its core frames into ``out``; return the
        tile's next cache (``item.cache`` is left as it was unless ``rollback`` is off)."""
        first = s0 == 0
        tl = item.tile
        hist = self.history(item.cache, s1 - s0, first)
        work = list(item.cache) if self.rollback else item.cache
        if item.inline:
            zc = self.z[:, :, s0:s1].to(device=self.compute, dtype=self.dtype)
            x = self.global_part(zc, work, first, hist)
            del zc
            if self.split_hook is not None:
                x = self.split_hook(x, s0)
        else:
            st = self.store
            assert st is not None and st.pos <= s0
            s = self.si.scale
            a, b = self._sframe(s0) - st.f0, self._sframe(s1) - st.f0
            x = st.x[:, :, a:b, tl.e0y * s : tl.e1y * s, tl.e0x * s : tl.e1x * s]
            if x.device != self.compute:
                x = x.to(self.compute, non_blocking=self.pin)
        y = self.tiled_part(x, work, first, hist)
        del hist
        del x
        S, p = self.lay.decoder_ratio, self.lay.patch
        oy, ox = (tl.c0y - tl.e0y) * S, (tl.c0x - tl.e0x) * S
        core = y[:, :, :, oy : oy + (tl.c1y - tl.c0y) * S, ox : ox + (tl.c1x - tl.c0x) * S]
        del y
        core = _unpatchify(core, p)
        t0, nt = self.lay.out_frame_start(s0), core.shape[2]
        if t0 + nt > self.out.shape[2]:
            raise RuntimeError(f"chunk [{s0}, {s1}) yielded {nt} frames from {t0}: beyond {self.out.shape[2]}")
        sp = S * p
        self.out[:, :, t0 : t0 + nt, tl.c0y * sp : tl.c1y * sp, tl.c0x * sp : tl.c1x * sp] = core.to(
            self.out.device, self.out.dtype
        )
        return work

    def _to_compute(self, e: Any) -> Any:
        if isinstance(e, torch.Tensor) and e.device != self.compute:
            return e.to(self.compute)
        return e

    def run_item(self, item: _Item) -> list[_Item]:
        """Run one tile over all its remaining chunks. Returns ``[]`` when done, or the sub-tiles that
        replace it after an OOM at one latent frame per chunk."""
        item.cache = [self._to_compute(e) for e in item.cache]
        s0, n = item.pos, 1
        split = False

        def attempt() -> list | None:
            nonlocal s0, n
            if split:
                return None
            s0 = item.pos
            n = 1 if s0 == 0 else min(self.k, self.T - s0)
            self.driver.check_stop()
            self.step += 1
            if self.fault_hook is not None:
                self.fault_hook(self.step - 1)
            return self.chunk(item, s0, s0 + n)

        def recover(event: OomEvent) -> None:
            # Out of the except block (OomResume): its traceback held the failed chunk's tensors.
            nonlocal split
            if not self.rollback:  # the tile's cache was consumed in place: this tile starts again
                item.cache = [None] * self.lay.n_cache
                item.pos = 0
                self.restarts += int(s0 > 0)
            if n > 1:
                self.k = max(1, n // 2)
                self.shrinks += 1
                log.warning("video decode: out of memory; resuming with %d latent frames per chunk", self.k)
                self._report()
            else:
                split = True

        def can_recover(e: BaseException) -> bool:
            return n > 1 or max(item.tile.core) > self.min_tile

        while item.pos < self.T:
            nxt = self.driver.run(attempt, can_recover=can_recover, recover=recover)
            if nxt is None:
                return self.split_item(item)
            item.cache, nxt = nxt, None
            item.pos += n
            self.units += 1
            self.done += 1
            self._report()
        self.tiles_done += 1
        return []

    def split_item(self, item: _Item) -> list[_Item]:
        """Halve a tile's core along its longer side. The halves resume from the tile's committed frame with
        windows of its committed cache: a half's core + halo lies inside the tile's core + halo, and the
        tile's cache is exact there except within each layer's partial reach of the tile's own border,
        which is within the same distance of the half's border (what the half computes wrongly anyway)."""
        tl = item.tile
        ch, cw = tl.core
        if ch >= cw:
            m = tl.c0y + (ch + 1) // 2
            cores = [(tl.c0y, m, tl.c0x, tl.c1x), (m, tl.c1y, tl.c0x, tl.c1x)]
        else:
            m = tl.c0x + (cw + 1) // 2
            cores = [(tl.c0y, tl.c1y, tl.c0x, m), (tl.c0y, tl.c1y, m, tl.c1x)]
        subs = [self._make_tile(*c) for c in cores]
        if item.inline:  # whole frame so far: phase 1 for the rest, from the committed global cache
            self.build_store(item.cache, item.pos)
        items = []
        for j, sub in enumerate(subs):
            cache: list = [None] * self.n_global
            for e in item.cache[self.n_global :]:
                cache.append(self._sub_window(e, tl, sub, park=j > 0))
            items.append(_Item(sub, cache, item.pos, False))
        item.cache = []
        self.tile = subs[0].core
        self.shrinks += 1
        log.warning("video decode: out of memory at one latent frame; resuming tile with %dx%d latent px halves",
                    *self.tile)
        return items

    def _sub_window(self, e: Any, parent: _Tile, sub: _Tile, park: bool) -> Any:
        """The window of ``sub``'s extended region in a parent tile's cache entry (a view for the tile
        that runs next, a copy on the store device for the ones that wait)."""
        if not isinstance(e, torch.Tensor):
            return e
        eh, ew = parent.ext
        s = e.shape[-2] // eh
        if e.shape[-2] != s * eh or e.shape[-1] != s * ew:
            raise RuntimeError(f"cache entry {tuple(e.shape)} is not a multiple of the tile {eh}x{ew}")
        y0, x0 = (sub.e0y - parent.e0y) * s, (sub.e0x - parent.e0x) * s
        w = e[:, :, :, y0 : y0 + sub.ext[0] * s, x0 : x0 + sub.ext[1] * s]
        if not park:
            return w
        return w.to(self.store_device, copy=True)

    def peak_tiles(self) -> list[_Tile]:
        """The tiles that set the peak of phase 2: per axis, the spans whose (core, extended) lengths no other
        span reaches in both (one tile's caches are alive at a time, and every tensor of a tile grows with its
        extents), crossed."""
        th, tw = self.tile if self.tile is not None else (self.H, self.W)

        def maximal(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
            lens = [(b - a, e1 - e0) for a, b, e0, e1 in spans]
            keep, seen = [], set()
            for sp, (c, e) in zip(spans, lens, strict=True):
                if (c, e) in seen or any(c2 >= c and e2 >= e and (c2, e2) != (c, e) for c2, e2 in lens):
                    continue
                seen.add((c, e))
                keep.append(sp)
            return keep

        ys = maximal(tile_spans(self.H, th, self.halo))
        xs = maximal(tile_spans(self.W, tw, self.halo))
        return [_Tile(*y, *x) for y in ys for x in xs]

    def run(self) -> torch.Tensor:
        tiles = self.tiles()
        fresh = [None] * self.lay.n_cache
        if len(tiles) == 1:
            self.queue = [_Item(tiles[0], list(fresh), 0, True)]
            self._report()
        else:
            if self.sizing:
                tiles = self.peak_tiles()
            self.queue = [_Item(t, list(fresh), 0, False) for t in tiles]
            self.build_store(fresh, 0)
        while self.queue:
            subs = self.run_item(self.queue[0])
            self.queue[0:1] = subs
        self.store = None
        return self.out


def decode_wan_chunked(
    model: Any,
    z: torch.Tensor,
    frames_per_chunk: int = 1,
    tile: int | Sequence[int] | None = None,
    *,
    halo: int | None = None,
    split: int | None = None,
    out: torch.Tensor | None = None,
    out_device: torch.device | str | None = None,
    out_dtype: torch.dtype = torch.float32,
    compute_device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    store_device: torch.device | str | None = None,
    rollback: bool = True,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    min_tile: int = MIN_TILE,
    pin_memory: bool | None = None,
    stats: dict | None = None,
    split_hook: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    sizing: bool = False,
) -> torch.Tensor:
    """Decode a Wan 2.1/2.2 latent exactly, tile by tile, each tile over time in chunks; returns what
    ``model.decode(z)`` returns: ``(B, 3, 1 + 4 (T - 1), H, W)`` in [-1, 1] (``out_dtype``).

    ``model``: the ``first_stage_model`` (``comfy.ldm.wan.vae.WanVAE`` or ``vae2_2.WanVAE``), already on
    ``compute_device``. ``z``: ``(B, C, T, h, w)`` latent (anywhere; chunks are moved to
    ``compute_device`` (default ``z.device``) and cast to ``dtype`` (default ``z.dtype``): pass
    ``vae.vae_dtype``). ``frames_per_chunk``: latent frames per chunk after frame 0 (decoded alone);
    ``<= 0`` = all the rest at once. ``tile``: tile core ``(h, w)`` (or one int) in latent px, or None
    for whole frames. ``halo``: latent px around each tile (default: the tiled part's convolutional
    reach, rounded up; smaller is inexact). ``split``: index into ``decoder.upsamples`` where the tiled
    part starts (default :attr:`WanLayout.default_split`). ``out``: preallocated output (else one is
    allocated on ``out_device``, default the compute device).

    Order: with one tile (whole frames) the whole decoder runs chunk by chunk (ComfyUI's flow, batched in
    time). With several tiles, phase 1 runs the global part over all latent frames (whole frames, low
    resolution) into a store on ``store_device`` (default the compute device; ``"cpu"`` on CUDA: pinned
    host memory, each tile-chunk copies its window in); phase 2 runs each tile over all chunks with only
    its own causal caches, so one tile's caches are alive at a time.

    ``rollback`` (default): a tile's committed cache is kept during a chunk (2x one tile's cache), so an
    OOM resumes that tile from its last chunk; ``False``: ComfyUI's in-place protocol (1x), and an OOM
    starts that tile again from frame 0. Finished tiles are never decoded again.

    ``progress(done, total)`` after each tile-chunk and phase-1 chunk (``total`` grows after a re-plan).
    ``should_stop()`` before each: its exception propagates; a truthy return raises ``InterruptedError``.
    ``fault_hook(step)`` at the start of each tile-chunk attempt (tests raise an OOM there).
    ``oom_exceptions`` (default ``torch.OutOfMemoryError``; a bare ``Exception``, ComfyUI's
    ``OOM_EXCEPTION`` without CUDA, is ignored): after the ``except`` block is left, ``on_oom()`` is
    called and the chunk size is halved; at one latent frame the tile is split in two halves that resume
    from its committed cache (phase 1 at one frame: the OOM propagates, as it does when a tile's core is
    already ``min_tile``). ``stats``: a dict filled with what happened (units = tile-chunks, steps =
    attempts, tiles, global_chunks, shrinks, restarts, final frames_per_chunk and tile, halo, split,
    reach, store). ``split_hook(x, latent_start)``: sees (and may replace) the global part's whole-frame
    output of each chunk (impulse experiments, fault injection in phase 1).
    ``sizing`` (meta sizing only, :class:`.sizing.MetaSizer`): with several tiles, phase 2 runs only the
    tiles that set its peak (per axis the spans whose core and extended lengths are not both reached by
    another span): the same peak as the full run, most tiles' work skipped; the output is incomplete.
    """
    lay = wan_layout(model)
    if z.ndim != 5:
        raise ValueError(f"expected a (B, C, T, h, w) latent, got shape {tuple(z.shape)}")
    if z.shape[1] != lay.latent_channels:
        raise ValueError(f"latent has {z.shape[1]} channels, the VAE expects {lay.latent_channels}")
    split = lay.default_split if split is None else int(split)
    if not 0 <= split <= len(lay.splits) - 1:
        raise ValueError(f"split must be in [0, {len(lay.splits) - 1}], got {split}")
    si = lay.split_info(split)
    if tile is not None:
        tile = (int(tile), int(tile)) if isinstance(tile, int) else (int(tile[0]), int(tile[1]))
        if min(tile) < 1:
            raise ValueError(f"tile must be >= 1 latent px, got {tile}")
        if lay.tiled_global_ops and split == 0:
            raise ValueError(f"the up path holds global ops {lay.tiled_global_ops}: cannot tile exactly")
    halo = si.halo if halo is None else int(halo)
    if halo < 0:
        raise ValueError("halo must be >= 0")
    compute = torch.device(compute_device) if compute_device is not None else z.device
    store_dev = torch.device(store_device) if store_device is not None else compute
    B, _, T, h, w = (int(v) for v in z.shape)
    shape = (B, lay.out_channels, lay.out_frames(T), h * lay.spatial_ratio, w * lay.spatial_ratio)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=torch.device(out_device) if out_device else compute)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    pin = (
        pin_memory
        if pin_memory is not None
        else (
            store_dev.type == "cpu"
            and compute.type == "cuda"
            and torch.cuda.is_available()
            and not _is_fake(z)
        )
    )
    run = _WanRun(
        model,
        lay,
        z,
        frames_per_chunk if frames_per_chunk > 0 else max(1, T - 1),
        tile,
        halo,
        split,
        out,
        compute,
        dtype or z.dtype,
        store_dev,
        rollback,
        progress,
        should_stop,
        fault_hook,
        _oom_types(oom_exceptions),
        on_oom,
        min_tile,
        pin,
        split_hook,
        sizing,
    )
    with torch.no_grad():
        result = run.run()
    if stats is not None:
        stats.update(
            exact=run.protocol.name != "unknown",
            protocol=run.protocol.name,
            chunks=run.units,
            units=run.units,
            steps=run.step,
            tiles=run.tiles_done,
            global_chunks=run.global_chunks,
            shrinks=run.shrinks,
            restarts=run.restarts,
            frames_per_chunk=run.k,
            tile=run.tile,
            halo=halo,
            split=split,
            reach=si.reach,
            rollback=run.rollback,
            store=None if run.global_chunks == 0 else ("host" if store_dev != compute else "device"),
        )
    if run.shrinks:
        log.info(
            "Wan chunked decode finished after %d OOM re-plan(s): k=%d tile=%s", run.shrinks, run.k, run.tile
        )
    return result


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (meta sizing): no real pinned memory, no synchronisation."""
    return type(t).__name__ == "FakeTensor"


# --------------------------------------------------------------------------------------------------
# Overlap-blend for other video VAEs (approximate)


def _frame_fn(f: Callable[[int], Any] | int | float) -> Callable[[int], int]:
    if callable(f):
        return lambda a: int(round(f(a)))
    return lambda a: int(round(f * a))


def decode_overlap_blend(
    decode_fn: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    frames_per_chunk: int,
    overlap: int = 1,
    *,
    upscale_ratio: Callable[[int], Any] | int,
    index_formula: Callable[[int], Any] | int | None = None,
    out: torch.Tensor | None = None,
    out_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: tuple[type[BaseException], ...] | None = None,
    on_oom: Callable[[], None] | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Decode ``z`` ``(B, C, T, h, w)`` in overlapping temporal chunks, cross-faded (approximate).

    ``decode_fn(latent_chunk) -> frames (B, C', t, H, W)`` decodes one chunk on its own (the node
    passes ``first_stage_model.decode`` with ComfyUI's dtype/device handling, or a spatially tiled
    decode). ``upscale_ratio``: output frames of a chunk of ``l`` latent frames (callable, e.g. the
    first entry of ``vae.upscale_ratio``: ``lambda a: max(0, 4 a - 3)``, or a number);
    ``index_formula``: output index of latent index ``p`` (the first entry of
    ``vae.upscale_index_formula``, e.g. ``4``: frame ``4 p``; default: ``upscale_ratio``). Chunks of
    ``frames_per_chunk`` latent frames overlap by ``overlap`` (at least 1, as ComfyUI's ``decode_tiled``:
    a chunk starting at latent ``p`` begins at frame ``4 p``, so without overlap the 3 frames before
    it are missing; at most ``frames_per_chunk - 1``);
    each chunk's frames are weighted by ComfyUI's linear feather over ``upscale_ratio(overlap)`` frames
    at both ends and accumulated into one output plus a per-frame weight vector, normalised at the
    end: the same result as ``comfy.utils.tiled_scale_multidim`` along time (with one spatial tile),
    without its second full-size weight tensor.
    ``frames_per_chunk`` is at least 2. On OOM (``oom_exceptions``, default ``torch.OutOfMemoryError``;
    a bare ``Exception`` is ignored) in a chunk, nothing of it was
    accumulated: ``on_oom()``, halve the chunk (not below 2; the overlap shrinks with it) and continue
    from that chunk's start; at 2 the OOM propagates. ``progress(done, total)``
    per chunk; ``should_stop()`` before each; ``fault_hook(step)`` before each decode_fn call.
    """
    if z.ndim != 5:
        raise ValueError(f"expected a (B, C, T, h, w) latent, got shape {tuple(z.shape)}")
    up = _frame_fn(upscale_ratio)
    pos_fn = _frame_fn(index_formula if index_formula is not None else upscale_ratio)
    driver = _driver(_oom_types(oom_exceptions), should_stop, on_oom)
    T = int(z.shape[2])
    k = max(2, int(frames_per_chunk))  # a chunk must reach past the overlap
    o = max(1, int(overlap))  # as ComfyUI's decode_tiled: with 0, frames between chunks stay uncovered
    t_out = up(T)
    wsum = None
    step = 0
    done = 0
    shrinks = 0
    chunks: list[tuple[int, int]] = []

    def plan_from(p: int) -> list[tuple[int, int]]:
        oo = min(o, k - 1)
        rest = overlap_chunks(T - p, k, oo) if p < T else []
        return [(p + a, p + b) for a, b in rest]

    todo = plan_from(0)
    a, b = 0, 0

    def attempt() -> torch.Tensor:
        nonlocal a, b, step
        a, b = todo[0]
        driver.check_stop()
        step += 1
        if fault_hook is not None:
            fault_hook(step - 1)
        return decode_fn(z[:, :, a:b])

    def recover(event: OomEvent) -> None:
        nonlocal k, shrinks, todo
        k = max(2, k // 2)
        shrinks += 1
        log.warning("overlap-blend decode: out of memory; resuming with %d latent frames per chunk", k)
        # Re-plan from this chunk's start (already-accumulated chunks end at or after it).
        todo = plan_from(a)

    with torch.no_grad():
        while todo:
            frames = driver.run(attempt, can_recover=lambda e: k > 2, recover=recover)
            if out is None:
                out = torch.zeros(
                    (frames.shape[0], frames.shape[1], t_out, *frames.shape[3:]),
                    dtype=torch.float32,
                    device=torch.device(out_device) if out_device is not None else frames.device,
                )
            if wsum is None:
                out.zero_()
                wsum = torch.zeros(t_out, dtype=torch.float64)
            n = frames.shape[2]
            o0 = pos_fn(a)
            if n != up(b - a) or o0 + n > t_out:
                raise RuntimeError(
                    f"decode_fn gave {n} frames for latent [{a}, {b}) at {o0}; out has {t_out}"
                )
            # ComfyUI's mask: a linear ramp (t + 1) / feather over ``feather = upscale_ratio(overlap)``
            # frames at both ends of every chunk (frames covered by one chunk only normalise it away).
            oo = min(o, k - 1)
            feather = up(oo) if oo > 0 else 0
            wt = torch.ones(n, dtype=torch.float64)
            if 0 < feather < n:
                for i in range(feather):
                    f = (i + 1) / feather
                    wt[i] *= f
                    wt[n - 1 - i] *= f
            for i in range(n):
                out[:, :, o0 + i].add_(frames[:, :, i].to(out.device, out.dtype), alpha=float(wt[i]))
            wsum[o0 : o0 + n] += wt
            del frames
            chunks.append((a, b))
            todo.pop(0)
            done += 1
            if progress is not None:
                progress(done, done + len(todo))
    if out is None or wsum is None:
        raise ValueError("empty latent")
    if bool((wsum <= 0).any()):
        raise RuntimeError("some output frames were not covered by any chunk")
    out.div_(wsum.to(out.device, out.dtype).view(1, 1, -1, *([1] * (out.ndim - 3))))
    if stats is not None:
        stats.update(
            exact=False,
            chunks=len(chunks),
            ranges=chunks,
            steps=step,
            shrinks=shrinks,
            frames_per_chunk=k,
            overlap=min(o, k - 1),
        )
    return out
