"""Planning an encode (Tiled VAE Encode, Temporal-Chunk Video Encode): the host's own encode when it fits,
else exact tiles with the largest tile whose peak fits: the KL walker (:func:`..executors.kl_exact.encode_exact`)
for KL images, the prefix/suffix split (:func:`..executors.split_encode.encode_split_tiled`) for videos and DC-AE.

Peaks are meta-sized (fake tensors, live-tensor bytes) for one batch item and kept in the video planner's
:class:`.video.PeakStore` (the nodes persist it), so a shape is sized once per machine. An encoder the walker
does not support takes the host's own ``VAE.encode`` (exact by identity; not budget-planned). Design:
docs/ENCODE.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..budget import host_refused_text
from ..executors import kl_exact as te
from ..executors import split_encode as se
from ..measure.sizing import MetaSizer
from ..report import fmt_bytes
from ..tiles import largest_span
from ..vae.encode_split import EncodeSplit, held_blocks
from ..vae.kl_layout import BoundLayout, KlLayout, kl_layout
from .grid import ImpossibleBudgetError, scaled
from .image import ATTENTION_MIN
from .types import Plan
from .video import PeakStore

__all__ = [
    "ENCODE_TILES", "EncodeJob", "ExactEncode", "attention_bytes", "encode_peak", "encode_ratio", "latent_channels",
    "lower_bound", "plan", "tile_extent",
]

ENCODE_TILES = (1024, 768, 512, 384, 256, 192, 128, 96, 64, 48, 32)
"""Tile sides (px at each activation's own resolution) the auto plan tries below the whole image."""

log = logging.getLogger("vramfit.memory.plan.encode")

AttentionFn = Callable[[int], contextlib.AbstractContextManager[Any]]
"""``attention(max_bytes)``: within it, the mid block's split attention (ComfyUI's CPU path) slices its scores
to ``max_bytes`` instead of by the free memory of the moment (the nodes pass ``bounded_vae_attention``)."""


def attention_bytes(budget: int) -> int:
    """The score-slice budget of the mid block's attention under ``budget``: a quarter of it, rounded down to a
    power of two (so the sized peaks' keys repeat across runs), at least :data:`ATTENTION_MIN`."""
    quarter = max(ATTENTION_MIN, budget // 4)
    return 1 << (quarter.bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class ExactEncode:
    """The exact walker's parameters: tile side (px) and where the full-size activations live."""

    tile: int
    store: str
    """``device`` or ``host`` (CUDA only)."""

    def grid(self, hw: tuple[int, int]) -> tuple[int, int]:
        """Tiles along each side of an ``hw`` px image (the Wan split's balanced latent-px cores count the same:
        both sides and the tile are whole latent px)."""
        return -(-hw[0] // self.tile), -(-hw[1] // self.tile)

    def describe(self, hw: tuple[int, int]) -> str:
        ny, nx = self.grid(hw)
        return f"tiles of {self.tile} px ({ny * nx} at full resolution), store on the {self.store}"


@dataclasses.dataclass
class EncodeJob:
    """One Tiled VAE Encode: ComfyUI's VAE, its processed pixels and the user's settings."""

    vae: Any
    x: torch.Tensor
    """(B, 3, H, W) pixels after the host's crop and ``process_input``, in the VAE's dtype (any device); a video:
    (1, 3, T, H, W)."""
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device
    fingerprint: str
    tile_size: int = 0
    """The user's tile side in px (0: auto)."""
    exact_reason: str | None = None
    """Why the exact walker cannot encode with this VAE (None: it can)."""
    verdict: Any = None
    """The walker's self-check on this host (:class:`..decode.self_check.Verdict`; None: not checked)."""
    pixels: Any = None
    """The node's IMAGE (B, H, W, C) as given, for the ``host`` path (``VAE.encode`` crops and processes
    it)."""
    split: EncodeSplit | None = None
    """The encoder's prefix/suffix description (:mod:`..vae.encode_split`; None: the KL walker's job)."""
    halo: int = 0
    """Prefix px the split's tiles extend their cores by (the prefix's traced reach)."""
    latent_ratio: int = 0
    """Image px per latent px of a split job (0: the KL layout's)."""
    prefix_ratio: int = 0
    """Image px per px of the split's prefix output: the tiles' unit (the latent ratio but for DC-AE)."""
    host_room: int | None = None
    """Bytes a store in host memory may take (:func:`..budget.host_room`, set after the offload; None: unbounded)."""
    walker: BoundLayout | None = None
    """The exact walker's layout of the encoder, bound to it (walked once, in ``make_job``; None for a split or a
    host job)."""

    @property
    def video(self) -> bool:
        return self.x.ndim == 5

    @property
    def layout(self) -> KlLayout:
        return kl_layout(self.vae.first_stage_model, direction="encode")

    @property
    def ratio(self) -> int:
        """Image px per latent px."""
        return self.latent_ratio or self.layout.ratio

    @property
    def finer(self) -> int:
        """Prefix px per latent px of a split job (1 but for DC-AE, whose prefix ends at 1/8 of a 32x encoder)."""
        return self.ratio // self.prefix_ratio if self.prefix_ratio else 1

    @property
    def hw(self) -> tuple[int, int]:
        return int(self.x.shape[-2]), int(self.x.shape[-1])

    @property
    def tile_step(self) -> int:
        """Tiles are multiples of this many px: whole prefix px for the split, any px for the KL walker."""
        return self.prefix_ratio if self.split is not None else 1

    @property
    def min_tile(self) -> int:
        """The smallest tile (px) the OOM fallback shrinks to."""
        return se.MIN_TILE * self.prefix_ratio if self.split is not None else te.MIN_TILE

    @property
    def executor_version(self) -> str:
        """The version of this job's executor, part of the keys of its sized peaks and self-check verdicts."""
        if self.split is not None:
            return f"{self.split.name}-{se.EXECUTOR_VERSION}"
        return te.EXECUTOR_VERSION

    def run_tiles(self, x: torch.Tensor, tile: int, **kw: Any) -> torch.Tensor:
        """The exact tiled executor of this job's kind on ``x`` with tiles of ``tile`` px."""
        if self.walker is not None:
            return te.run_exact(self.walker, x, tile, **kw)
        assert self.split is not None
        kw.pop("norm_params", None)
        r = self.prefix_ratio
        return se.encode_split_tiled(self.vae.first_stage_model, x, tile // r, r, self.split, halo=self.halo, **kw)


def _key(job: EncodeJob, what: str) -> str:
    model = job.vae.first_stage_model
    cls = type(model)
    shape = "x".join(str(int(v)) for v in job.x.shape[1:])
    return (
        f"encode/{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}/{job.fingerprint}/exact-"
        f"{job.executor_version}/{str(job.dtype).removeprefix('torch.')}/{job.device.type}"
        f"/1x{shape}/{what}"
    )


def encode_peak(job: EncodeJob, cfg: ExactEncode | None, peaks: PeakStore, attn: int,
                attention: AttentionFn | None = None, first_use: Any = None, limit: int | None = None) -> int:
    """Meta-sized peak bytes of one item's encode, its pixels on the device included: the encoder's own
    ``first_stage_model.encode`` (``cfg`` None) or the exact walker with ``cfg``, the mid block's attention
    sliced to ``attn`` bytes (``attention``); kept in ``peaks``. A sizing (a shape not in ``peaks``) is
    ``first_use`` work (:data:`SIZING`). ``limit``: the walker's sizing stops once its peak so far passes it,
    and the bytes returned are then that peak so far: a lower bound above the limit (kept as such: a plan under
    the same or a lower limit sizes nothing; :func:`sized_exactly` tells the two apart)."""
    return _encode_sizes(job, cfg, peaks, attn, attention, False, first_use, limit)[0]


def sized_exactly(job: EncodeJob, cfg: ExactEncode | None, peaks: PeakStore, attn: int) -> bool:
    """Whether ``peaks`` holds the whole sizing of this plan (not only a lower bound from a stopped one)."""
    return peaks.get(_peak_key(job, cfg, attn)) is not None


def _peak_key(job: EncodeJob, cfg: ExactEncode | None, attn: int) -> str:
    return _key(job, f"{'untiled' if cfg is None else f't{cfg.tile}-{cfg.store}'}/attn{attn >> 20}")


class _OverLimit(Exception):
    """A stopped sizing: its peak so far passed the planner's limit."""


SIZING = ("sizing the plans of this image shape", "image shape")
"""The first-use phase (:meth:`..decode.first_use.FirstUse.run`'s ``what`` and ``per``) of a shape's meta sizing."""


def encode_host_bytes(job: EncodeJob, cfg: ExactEncode, peaks: PeakStore, attn: int,
                      attention: AttentionFn | None = None, first_use: Any = None) -> int:
    """Meta-sized peak bytes one item's store in host memory holds (``cfg.store == "host"`` on an accelerator; else
    0); a video sized on fewer frames (:func:`_sizing_shape`) scaled to its own in proportion (kept in ``peaks``)."""
    if cfg.store != "host" or job.device.type == "cpu":
        return 0
    ram = _encode_sizes(job, cfg, peaks, attn, attention, True, first_use)[1]
    shape, _ = _sizing_shape(job, cfg)
    return ram * int(job.x.shape[2]) // int(shape[2]) if job.video else ram


def _encode_sizes(job: EncodeJob, cfg: ExactEncode | None, peaks: PeakStore, attn: int,
                  attention: AttentionFn | None, host: bool, first_use: Any = None,
                  limit: int | None = None) -> tuple[int, int]:
    key = _peak_key(job, cfg, attn)
    found, ram = peaks.get(key), peaks.get(f"{key}/host-ram") if host else 0
    if found is not None and ram is not None:
        return found, ram
    limit = None if host or cfg is None else limit  # the host-RAM figure and the encoder's own forward: whole
    above = peaks.get(f"{key}/above") if limit is not None else None
    if above is not None and above > limit:
        return above, 0

    def size() -> tuple[int, int]:
        return _size(job, cfg, peaks, attn, attention, host, key, limit)

    return size() if first_use is None else first_use.run(SIZING[0], size, SIZING[1])


def _size(job: EncodeJob, cfg: ExactEncode | None, peaks: PeakStore, attn: int, attention: AttentionFn | None,
          host: bool, key: str, limit: int | None = None) -> tuple[int, int]:
    """Meta-size one item's encode (:func:`_encode_sizes`): the exact walkers count their repeated tiles once
    (``size_only``: :mod:`..executors.kl_memo`, :func:`..executors.split_encode.encode_split_tiled`) and, with a
    ``limit``, stop after the tile that passes it."""
    model = job.vae.first_stage_model
    bound = attention(attn) if attention is not None else contextlib.nullcontext()
    shape, extra = _sizing_shape(job, cfg)
    sizer = MetaSizer([model], job.dtype, job.device, track_host=host)

    def over() -> None:
        if limit is not None and sizer.peak_so_far + extra > limit:
            raise _OverLimit

    try:
        with torch.inference_mode(), bound, sizer:
            x = torch.empty(shape, dtype=job.dtype, device=job.device)
            if cfg is None:
                out = model.encode(x)
            else:
                store = job.device if cfg.store == "device" else torch.device("cpu")
                out = job.run_tiles(x, cfg.tile, compute_device=job.device, store_device=store,
                                    out_device=job.device, size_only=over if limit is not None else True)
            del out, x
    except _OverLimit:
        above = int(sizer.peak_bytes) + extra
        peaks.put(f"{key}/above", above)
        return above, 0
    peak, ram = int(sizer.peak_bytes) + extra, int(sizer.host_peak_bytes)
    peaks.put(key, peak)
    if host:
        peaks.put(f"{key}/host-ram", ram)
    return peak, ram


SIZING_FRAMES = 9
"""Frames a video's encode is meta-sized on (1 + 2 chunks of 4: the host's chunk loop at its steady state); the
latent frames beyond add :func:`_sizing_shape`'s bytes per frame."""


def _sizing_shape(job: EncodeJob, cfg: ExactEncode | None) -> tuple[tuple[int, ...], int]:
    """The input shape to meta-size and the bytes to add for the frames it leaves out (Wan only: its chunk loop
    peaks within a few frames; images and the other video families are sized whole): their pixels, and per latent
    frame three latent-sized copies in ``encode`` (the chunks, their concatenation, ``conv1``'s output); on the
    tiled path also two of the prefix's features (the host's concatenation and the tile's result, at most the
    whole frame's) and the store's (on the device)."""
    shape = (1, *job.x.shape[1:])
    if not job.video or not (job.split is not None and job.split.wan) or shape[2] <= SIZING_FRAMES:
        return shape, 0  # images, and the other video families: sized whole
    model = job.vae.first_stage_model
    h, w = job.hw[0] // job.ratio, job.hw[1] // job.ratio
    per = 3 * int(model.conv1.weight.shape[0]) * h * w  # conv1: 2 x z_dim channels
    if cfg is not None:
        mid = int(next(model.encoder.middle.parameters()).shape[0]) * h * w  # the prefix's output channels
        per += mid * (3 if cfg.store == "device" else 2)
    more = (shape[2] - 1) // 4 - (SIZING_FRAMES - 1) // 4
    pixels = (shape[2] - SIZING_FRAMES) * shape[1] * shape[3] * shape[4]
    return (*shape[:2], SIZING_FRAMES, *shape[3:]), (more * per + pixels) * job.dtype.itemsize


def host_estimate(job: EncodeJob) -> int | None:
    """ComfyUI's own figure for one item's encode (``VAE.memory_used_encode``, what ``VAEEncode`` frees before
    it encodes: 2.9x the CUDA peak measured for the KL encoder at 2048², 2.1x for Wan 2.1 at 480p); None where
    the VAE has none. Where it fits, the encoder's own forward is planned without sizing (sizing costs about as
    much as a fast GPU encode)."""
    fn = getattr(job.vae, "memory_used_encode", None)
    try:
        return int(fn((1, *job.x.shape[1:]), job.dtype)) if fn is not None else None
    except Exception:  # a host's estimate that raises (0.33's _no_encode): size instead
        return None


def _untiled_text(job: EncodeJob) -> str:
    what = "the whole clip (the host's own chunk loop)" if job.video else "one image at a time"
    return f"the encoder's own forward, {what}"


def candidates(job: EncodeJob) -> list[ExactEncode]:
    """Exact-walker configurations, fastest first: the user's tile or every tile of :data:`ENCODE_TILES`
    below the image's longer side (and the whole image); on an accelerator each tile also with a host store
    (the device then holds a tile's work alone), tried before the next smaller tile (sizing a small tile at
    8K takes minutes; a device store cannot go below the floor). On CPU the floor is the two full-resolution activations of the
    first level's resnet blocks (x and h, both read whole for their GroupNorm statistics): 0.67x the untiled
    encode's peak, measured at 512^2 (docs/ENCODE.md)."""
    side = max(job.hw)
    tiles = [int(job.tile_size)] if job.tile_size else [side] + [
        t for t in ENCODE_TILES if t < side and t % job.tile_step == 0 and t >= job.min_tile
    ]
    stores = ("device",) if job.device.type == "cpu" else ("device", "host")
    return [ExactEncode(t, s) for t in tiles for s in stores]


def tile_extent(job: EncodeJob, cfg: ExactEncode) -> tuple[int, int]:
    """The largest tile a candidate runs, each side, what a smaller tile must shrink for a smaller peak: the KL
    walker's largest balanced tile (px); the split's largest tile with its halo (prefix px: on a frame not much
    larger than the halo, every tile the prefix runs is about the whole frame, whatever the core)."""
    r, halo = (job.prefix_ratio, job.halo) if job.split is not None else (1, 0)
    return largest_span(job.hw[0] // r, cfg.tile // r, halo), largest_span(job.hw[1] // r, cfg.tile // r, halo)


def latent_channels(vae: Any) -> int:
    """Latent channels: ComfyUI's ``latent_channels``; a VAE that skips ``VAE.__init__`` (ExtraModels' EXVAE)
    counts them in ``latent_dim``."""
    found = getattr(vae, "latent_channels", None)
    if found is None and getattr(vae, "latent_dim", 0) > 3:
        found = vae.latent_dim
    return int(found or 16)


def encode_ratio(vae: Any) -> int:
    """Image px per latent px: ComfyUI's ``spacial_compression_encode()``, else ``latent_scale`` (EXVAE)."""
    if getattr(vae, "downscale_ratio", None) is not None:
        return int(vae.spacial_compression_encode())
    return int(vae.latent_scale)


def latent_frames(vae: Any, frames: int) -> int:
    """Latent frames of a ``frames``-frame video: the host's own formula (``VAE.downscale_ratio``'s first
    entry), else Wan's 1 + 4k."""
    f = getattr(vae, "downscale_ratio", None)
    if isinstance(f, tuple) and callable(f[0]):
        return int(f[0](frames))
    return (frames - 1) // 4 + 1


def temporal_ratio(vae: Any) -> int:
    """Frames per latent frame of a video VAE (Wan and HunyuanVideo 1.5: 4, LTX-Video: 8), from
    :func:`latent_frames`."""
    return 8192 // max(1, latent_frames(vae, 8193) - 1)


def _out_bytes(job: EncodeJob) -> int:
    """The float32 latent output when it lives on the compute device's type."""
    if job.out_device.type != job.device.type:
        return 0
    down = job.ratio
    b, (h, w) = int(job.x.shape[0]), job.hw
    frames = latent_frames(job.vae, int(job.x.shape[2])) if job.video else 1
    return b * frames * latent_channels(job.vae) * (h // down) * (w // down) * 4


def lower_bound(job: EncodeJob) -> tuple[int, str]:
    """Bytes every plan of one item's encode needs (the latent output included), from the shapes alone, before any
    sizing; and what they hold. On CPU (the store on the device): the pixels and, at the end of some segment of
    the exact walk, every full-size activation a later segment still reads (each GroupNorm's input is whole
    before any tile reads it: after the first resnet block's ``conv1`` of an SD encoder, its input and ``h``).
    The encoder's own forward holds them too (the block's input stays alive for its residual while ``conv1``
    makes ``h``), so no plan fits below. A split job: the pixels and what the prefix's residual blocks hold on the
    smallest candidate's largest tile (:func:`_split_bound`; the latent alone where its family describes none). On
    an accelerator (a store in host memory): the output alone (a bound that refuses nothing in practice). Sized
    peaks are this or more (tests/host/test_encode_planning.py, tests/host/test_split_encode_sizing.py)."""
    extra = _out_bytes(job)
    if job.exact_reason is not None:
        return 0, "nothing: the host's own encode is not budget-planned"
    pixels = math.prod(int(v) for v in job.x.shape[1:]) * job.dtype.itemsize
    if job.split is None and job.device.type == "cpu":
        return _walker_bound(job, extra, pixels)
    if job.split is None:
        return extra, "the latent"
    return _split_bound(job, extra, pixels)


def _walker_bound(job: EncodeJob, extra: int, pixels: int) -> tuple[int, str]:
    """:func:`lower_bound` of the KL walker's job on CPU: the latent ``extra``, the ``pixels`` and the full-size
    activations held at the end of the segment that holds most."""
    layout = job.layout
    latent = (job.hw[0] // job.ratio, job.hw[1] // job.ratio)
    sizes: dict[str, tuple[int, int]] = {}  # activation -> (elements, segment that makes it)
    best, where = 0, ""
    for k, info in enumerate(layout.segments):
        h, w = layout.segment_hw(info, latent)
        for name in (info.output if info.store_output else None, info.shortcut_output):
            if name is not None:
                sizes[name] = (info.out_channels * h * w, k)
        held = sum(n for name, (n, made) in sizes.items() if made <= k and layout.last_use.get(name, k + 1) > k)
        if held > best:
            best, where = held, info.name
    what = f"the pixels and the full-size activations the exact tiles hold after {where}"
    return extra + pixels + best * job.dtype.itemsize, what


def _split_bound(job: EncodeJob, extra: int, pixels: int) -> tuple[int, str]:
    """:func:`lower_bound` of a split job: the latent ``extra``, the ``pixels`` and what the prefix's residual blocks
    hold at once (traced once per model: :func:`..vae.encode_split.held_blocks`) on the largest tile of the
    candidate whose largest tile is smallest (the encoder's own forward runs them on the whole frame). The latent
    alone where the family describes no residual block or the trace fails."""
    r, tiles = job.prefix_ratio, {c.tile // job.prefix_ratio for c in candidates(job)}
    try:
        blocks = held_blocks(job.vae.first_stage_model, job.split, r, int(job.x.shape[1]), job.dtype, job.device,
                             int(job.x.shape[2]) if job.video else 0)
    except Exception as e:  # noqa: BLE001 - a trace that fails: no bound before sizing, the sizing decides
        log.warning("no lower bound before sizing for the %s encoder: %s", job.split.name, e)
        blocks = ()
    if not blocks:
        return extra, "the latent"
    h, w = min(((largest_span(job.hw[0] // r, t, job.halo) * r, largest_span(job.hw[1] // r, t, job.halo) * r)
                for t in tiles), key=lambda e: e[0] * e[1])  # the smallest candidate's largest tile (tile_extent)
    held = max((2 * b.c_in + min(b.c_in, b.c_out)) * b.frames * (h // b.scale) * (w // b.scale) for b in blocks)
    return extra + pixels + held * job.dtype.itemsize, (
        f"the pixels and what a residual block of the encoder's local part holds at once on a tile of {h}x{w} px: "
        "its input, its convolution's input and output")


def plan(
    job: EncodeJob,
    budget: int,
    peaks: PeakStore | None = None,
    ratio: Callable[[str], float] | None = None,
    attention: AttentionFn | None = None,
    first_use: Any = None,
) -> Plan:
    """The fastest plan within ``budget`` bytes: the encoder's own forward (one item at a time) when it fits
    and no tile is set, else the exact walker's largest tile that fits. An encoder the walker does not
    support takes the host's ``VAE.encode`` (path ``host``, not budget-planned). ``ratio(path)``: the
    measured over predicted peak learned for a path on this machine (:mod:`..cost.observed`). Raises
    :class:`.grid.ImpossibleBudgetError` when nothing fits and no tile is set; with a user tile, that plan,
    ``over_budget``. ``attention``: bounds the mid block's split attention to a quarter of the budget, in the
    sizing and (through the plan's ``stats["attention"]``) in the run. A budget below :func:`lower_bound` is
    refused before any sizing; each sizing is ``first_use`` work (:data:`SIZING`)."""
    peaks = PeakStore() if peaks is None else peaks
    r = ratio or (lambda path: 1.0)
    extra = _out_bytes(job)
    if job.exact_reason is not None:
        return Plan(
            "host",
            None,
            "the host's own encode (VAE.encode, as VAE Encode)",
            0,
            reason=f"the exact walker does not support this encoder: {job.exact_reason}",
        )

    def untiled(b: int) -> Plan | None:
        attn = attention_bytes(b)
        need = extra + encode_peak(job, None, peaks, attn, attention, first_use)
        if need > b:
            return None
        return Plan("untiled", None, _untiled_text(job), need,
                    stats={"attention": attn})

    if not job.tile_size:
        est = host_estimate(job)
        if est is not None and extra + est <= budget / r("encode-untiled"):  # fits by the host's own figure
            return Plan("untiled", None, _untiled_text(job), extra + est,
                        stats={"attention": attention_bytes(budget), "sizing": "ComfyUI's estimate"})
        least, what = lower_bound(job)
        if least > budget / max(1.0, min(r("encode-untiled"), r("encode-exact"))):
            raise ImpossibleBudgetError(
                f"no plan fits the budget of {fmt_bytes(budget)}: every plan needs at least {fmt_bytes(least)} "
                f"({what}; a lower bound, found before any sizing); raise budget_mb or free memory", budget, least)
        found = scaled(untiled, budget, r("encode-untiled"))
        if found is not None:
            return found

    refused: list[int] = []

    def describe(cfg: ExactEncode) -> str:
        if not refused or cfg.store == "host":
            return cfg.describe(job.hw)
        return cfg.describe(job.hw) + host_refused_text(max(refused), job.host_room)

    def exact(b: int) -> Plan:
        sized = []
        attn = attention_bytes(b)
        try:
            tried: dict[str, list[tuple[int, int]]] = {}  # per store: the largest tiles of the candidates sized
            for cfg in candidates(job):
                seen = tried.setdefault(cfg.store, [])
                n = tile_extent(job, cfg)
                if not job.tile_size and any(all(a >= b for a, b in zip(n, e, strict=True)) for e in seen):
                    continue  # its largest tile no smaller than a sized candidate's: no smaller peak
                if job.host_room is not None and cfg.store == "host":
                    ram = encode_host_bytes(job, cfg, peaks, attn, attention, first_use)
                    if ram > job.host_room:  # the host's RAM cannot hold this store
                        refused.append(ram)
                        continue
                limit = None if job.tile_size else b - extra  # a user tile's need is reported whole
                need = extra + encode_peak(job, cfg, peaks, attn, attention, first_use, limit)
                sized.append((need, cfg))
                seen.append(n)
                if need <= b:
                    return Plan("exact", cfg, describe(cfg), need, stats={"attention": attn})
        finally:
            peaks.flush()
        need, cfg = min(sized, key=lambda e: e[0])
        if job.tile_size:
            return Plan("exact", cfg, describe(cfg), need, over_budget=True, stats={"attention": attn})
        needs = "needs" if sized_exactly(job, cfg, peaks, attn) else "needs at least"
        raise ImpossibleBudgetError(
            f"no plan fits the budget of {fmt_bytes(b)}: the smallest ({cfg.describe(job.hw)}) {needs} "
            f"{fmt_bytes(need)}; raise budget_mb or free memory",
            b,
            need,
        )

    return scaled(exact, budget, r("encode-exact"))


def smaller(job: EncodeJob, p: Plan, peaks: PeakStore | None = None,
            attention: AttentionFn | None = None) -> Plan | None:
    """After an out-of-memory error outside a tile: the exact walker with half the tile (on an accelerator,
    first the same tile with a host store when the host's RAM holds it: sized with ``peaks`` and ``attention`` as
    :func:`plan`); None when nothing is smaller."""
    if p.path == "untiled":
        cfg = ExactEncode(max(job.hw), "device")
    elif p.path == "exact":
        cfg = p.config
        if cfg.store == "device" and job.device.type != "cpu" and (
                job.host_room is None or encode_host_bytes(job, ExactEncode(cfg.tile, "host"), peaks or PeakStore(),
                                                           int(p.stats.get("attention") or 0), attention)
                <= job.host_room):
            cfg = ExactEncode(cfg.tile, "host")
        elif cfg.tile > job.min_tile:
            half = cfg.tile // 2 // job.tile_step * job.tile_step
            cfg = ExactEncode(max(job.min_tile, half), cfg.store)
        else:
            return None
    else:
        return None
    return Plan("exact", cfg, cfg.describe(job.hw), 0, reason="re-planned after an out-of-memory error",
                stats=dict(p.stats))
