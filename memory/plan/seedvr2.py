"""Planning SeedVR2's exact decode (:mod:`..executors.seedvr2`): the tile side and where whole-frame activations
and carried frames wait, chosen from peaks sized on fake tensors like every video path (:func:`.video.meta_peak`,
persisted in the :class:`.video.PeakStore`). The time slices are the host's (they are part of its result), so the
lever is the tile: whole frames first (fewest calls), then tiles of 512 .. 32 px at every activation's own
resolution; on an accelerator, whole frames and 512-px tiles with the store on the device, then every tile with the
store (whole-frame activations and carried frames) in host memory, which leaves less on the device than any
device-store tile (and sizing many small tiles of a 4K frame on fake tensors takes minutes). The first that fits the
budget is the plan; none fits: the smallest, flagged over budget. Entered from ``decode/seedvr2``
(``decode/video.video_engine`` chooses it when :func:`..vae.seedvr2_layout.seedvr2_of` recognises the model).

The rewritten upstream model gives hints of its own (:class:`..vae.seedvr2_layout.Hints`), and the plan row says how
each was used: its decode estimate (``comfy_memory_used_decode``), when the model marks it reliable
(``comfy_decode_estimate_is_reliable``) and no tile size is asked for, picks the host's own decode where that
estimate fits the budget (VAE Decode's own result, no walk needed); its preferred tile for the budget
(``preferred_decode_tile``, latent px) joins the tile candidates. Where the host would int8-pack carried frames
(its ``CausalMemoryCache`` on a CUDA device: a rounding tiles do not reproduce), the host's own decode with that
reason. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from ..budget import host_refused_text
from ..executors import seedvr2 as sx
from ..report import fmt_bytes
from ..vae.seedvr2_layout import SeedVR2Layout, seedvr2_layout
from .types import Chunking, Plan
from .video import HOST_DECODE, PeakStore, VideoJob, meta_sizes, model_key, out_bytes

log = logging.getLogger("vramfit.memory.plan.seedvr2")

__all__ = ["SIZED_FRAMES", "TILES", "SeedVR2Config", "candidates", "packed_tails", "plan_seedvr2", "preferred_tile",
           "seedvr2_host_bytes", "seedvr2_peak"]

TILES = (None, 512, 256, 128, 64, 32)
"""Tile sides (px at every activation's own resolution; None: whole frames) in the order the plan tries them."""
SIZED_FRAMES = 3
"""Latent frames the peak is sized at: the host's first slice (2 frames) and one carried slice (the later slices
repeat it: same shapes, the carried frames of every convolution already held)."""


@dataclasses.dataclass(frozen=True)
class SeedVR2Config:
    tile: tuple[int, int] | None
    store: str
    """``device`` (the compute device) or ``host`` (CPU memory, on an accelerator)."""
    slices: int
    grid: tuple[int, int] = (1, 1)
    """Tiles of the output-resolution segments."""

    def describe(self) -> str:
        tiles = "whole frames" if self.tile is None else (
            f"{self.grid[0]}x{self.grid[1]} tiles of {self.tile[0]} px at full resolution (the same px at every "
            "level)")
        return (f"the host's {self.slices} time slice(s) with carried causal frames; per slice the mid block once "
                f"on the whole latent, the up path in {tiles}, per-frame GroupNorm statistics shared; "
                f"store on {self.store}")


def preferred_tile(job: VideoJob, budget: int | None) -> int | None:
    """The model's own preferred tile side for ``budget`` free bytes, in px (``preferred_decode_tile`` gives latent
    px), or None (no hint, no budget, or the hint failed)."""
    hint = seedvr2_layout(job.vae.first_stage_model).hints.tile
    if hint is None or budget is None:
        return None
    try:
        return int(hint(int(budget), job.dtype)) * 8
    except Exception as e:  # noqa: BLE001 - a hint, never a reason to fail
        log.warning("SeedVR2 preferred_decode_tile failed (%s: %s)", type(e).__name__, e)
        return None


def candidates(job: VideoJob, pref: int | None = None) -> list[SeedVR2Config]:
    """The plan's candidates in the order tried; ``pref``: the model's preferred tile side in px
    (:func:`preferred_tile`), which joins the tile sides."""
    lay = seedvr2_layout(job.vae.first_stage_model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    r = 8
    pref = pref if job.tile_size <= 0 else None
    sides = sorted({*(s for s in TILES if s is not None), *([pref] if pref else [])}, reverse=True)
    tiles = [(job.tile_size, job.tile_size)] if job.tile_size > 0 else [None, *((s, s) for s in sides)]
    if job.device.type == "cpu":
        pairs = [(tile, "device") for tile in tiles]
    else:  # the store in host memory holds less on the device than any device-store tile: small tiles host-side only
        pairs = [(tile, "device") for tile in tiles[:2]] + [(tile, "host") for tile in tiles]
    out = []
    for tile, store in pairs:
        if tile is not None and tile[0] >= max(h, w) * r and job.tile_size <= 0:
            continue  # one tile of the whole frame: the whole-frame candidate
        g = (1, 1) if tile is None else (-(-h * r // tile[0]), -(-w * r // tile[1]))
        out.append(SeedVR2Config(tile, store, len(lay.slices(t)), g))
    return out


def seedvr2_peak(job: VideoJob, cfg: SeedVR2Config, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of the executor on one batch item of :data:`SIZED_FRAMES` latent frames (fewer when the
    latent has fewer) without its output (persisted in ``peaks``)."""
    return _sizes(job, cfg, peaks)[0]


def seedvr2_host_bytes(job: VideoJob, cfg: SeedVR2Config, peaks: PeakStore) -> int:
    """Meta-sized peak bytes a store in host memory holds (whole-frame activations and carried frames of one
    batch item; the later time slices repeat the sized one), 0 for a store on the device (persisted)."""
    return _sizes(job, cfg, peaks)[1] if cfg.store == "host" and job.device.type != "cpu" else 0


def _sizes(job: VideoJob, cfg: SeedVR2Config, peaks: PeakStore) -> tuple[int, int]:
    model = job.vae.first_stage_model
    _, c, t, h, w = (int(v) for v in job.z.shape)
    tm = min(t, SIZED_FRAMES)
    tile = "whole" if cfg.tile is None else f"{cfg.tile[0]}x{cfg.tile[1]}"
    key = f"{model_key(job)}/1x{c}x{tm}x{h}x{w}/seedvr2-{sx.EXECUTOR_VERSION}/{tile}/{cfg.store}"
    lay = seedvr2_layout(model)
    frames = lay.frames(tm)
    store = "cpu" if cfg.store == "host" else job.device
    host = cfg.store == "host" and job.device.type != "cpu"
    got: list[tuple[int, int]] = []

    def run() -> None:
        out = torch.empty((1, 3, frames, h * 8, w * 8), dtype=torch.float32, device=job.out_device)
        sx.decode_seedvr2(model, torch.empty((1, c, tm, h, w), dtype=job.dtype, device=job.device), cfg.tile,
                          out=out, compute_device=job.device, dtype=job.dtype, store_device=store, sizing=True)

    def sized() -> tuple[int, int]:  # one sizing gives both figures
        if not got:
            peak, ram = meta_sizes(job, run, track_host=host)
            out_b = frames * 3 * h * w * 64 * 4
            got.append((max(0, peak - (out_b if job.out_device.type == job.device.type else 0)),
                        max(0, ram - (out_b if job.out_device.type == "cpu" else 0))))
        return got[0]

    peak = peaks.get_or_make(key, lambda: sized()[0])
    ram = peaks.get_or_make(f"{key}/host-ram", lambda: sized()[1]) if host else 0
    return peak, ram


def packed_tails(job: VideoJob, lay: SeedVR2Layout) -> str | None:
    """Why the walk cannot reproduce this decode on this device, or None: the host's cache object int8-packs a
    carried tail (its ``_packable``, asked of fake tensors of every causal convolution's whole-frame two-frame tail,
    channels-last where its fast path would make them so). Only tensors on an accelerator are packed."""
    packable = getattr(lay.cache_type, "_packable", None)
    if packable is None or job.device.type == "cpu":
        return None
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, _, _, h, w = (int(v) for v in job.z.shape)
    dec = job.vae.first_stage_model.decoder
    shapes = {(int(c.in_channels), h, w) for c in [dec.conv_in, *dec.mid_block.modules()]
              if hasattr(c, "temporal_padding") and c.kernel_size[0] > c.stride[0]}
    # every segment's causal convolution runs at its output's resolution (an upsampler's after its pixel shuffle)
    sizes = sx.seg_sizes(lay, h, w)
    shapes |= {(int(seg.conv.in_channels), sh, sw) for seg, (sh, sw) in zip(lay.segments, sizes, strict=True)}
    eligible = getattr(sys.modules.get(type(dec.conv_in).__module__), "_ck_eligible", None)
    try:
        cache = lay.cache_type()
        with FakeTensorMode():
            for c, sh, sw in sorted(shapes, key=lambda s: s[0] * s[1] * s[2], reverse=True):
                tail = torch.empty((1, c, 2, sh, sw), dtype=job.dtype, device=job.device)
                if eligible is None or eligible(tail):
                    tail = tail.contiguous(memory_format=torch.channels_last_3d)
                if packable(cache, tail):
                    return (f"the host int8-packs carried frames of this size (its CausalMemoryCache: a {c}-channel "
                            f"{sw}x{sh} tail, {fmt_bytes(tail.numel() * tail.element_size())}), a rounding tiles do "
                            "not reproduce")
    except Exception as e:  # noqa: BLE001 - not knowing is not proof: the host's own result
        return f"whether the host int8-packs carried frames could not be told ({type(e).__name__}: {e})"
    return None


def _estimate(job: VideoJob, lay: SeedVR2Layout) -> int | None:
    """The model's own estimate of its decode (``comfy_memory_used_decode``) when it marks it reliable, else None."""
    if not (lay.hints.reliable and lay.hints.estimate is not None):
        return None
    try:
        return int(lay.hints.estimate(tuple(int(v) for v in job.z.shape), job.dtype))
    except Exception as e:  # noqa: BLE001 - a hint, never a reason to fail
        log.warning("SeedVR2 comfy_memory_used_decode failed (%s: %s)", type(e).__name__, e)
        return None


def _host(job: VideoJob, planned: int, budget: int, description: str, reason: str) -> Plan:
    """The host's own decode, its peak the model's own estimate plus the output (``stats["sized"]`` says so)."""
    t = int(job.z.shape[2])
    return Plan("host", Chunking(max(1, t - 1)), description, planned, reason=reason,
                over_budget=bool(planned) and planned > budget,
                stats={"sized": "the model's own estimate, comfy_memory_used_decode, + the output"})


def plan_seedvr2(job: VideoJob, budget: int, peaks: PeakStore) -> Plan:
    """The host's own decode where the model's reliable estimate fits ``budget`` (or where the walk cannot reproduce
    it, :func:`packed_tails`); else the first candidate (:func:`candidates`) whose peak plus the node's output buffer
    fits ``budget``, else the last one sized, over budget. The walk's plan is not ``exact`` until its self-check
    passed (the video flow's check step sets it: ``decode/own_executor.own_path``)."""
    model = job.vae.first_stage_model
    lay = seedvr2_layout(model)
    b, _, t, h, w = (int(v) for v in job.z.shape)
    buf = out_bytes(job, lay.frames(t), h * 8, w * 8)
    est = _estimate(job, lay)
    packed = packed_tails(job, lay)
    if packed is not None:
        planned = est + buf if est is not None else 0
        return _host(job, planned, budget, HOST_DECODE + _hint_text(lay, est, budget, None, None), packed)
    if est is not None and job.tile_size <= 0 and est + buf <= budget:
        why = (f"its own estimate of its decode, {fmt_bytes(est)} (comfy_memory_used_decode, reliable by "
               "comfy_decode_estimate_is_reliable), fits the budget")
        return _host(job, est + buf, budget, HOST_DECODE + _hint_text(lay, est, budget, None, None), why)
    chosen, planned, refused = None, 0, 0
    pref = preferred_tile(job, budget) if job.tile_size <= 0 else None  # asked once: the model's call may free pins
    cands = candidates(job, pref)
    for cfg in cands:
        try:
            peak = seedvr2_peak(job, cfg, peaks)
            ram = seedvr2_host_bytes(job, cfg, peaks) if job.host_room is not None else 0
        except Exception as e:  # noqa: BLE001 - an op without a fake kernel: run unpredicted
            log.warning("meta sizing of the SeedVR2 executor failed (%s: %s)", type(e).__name__, e)
            chosen, planned = cfg, 0
            break
        if job.host_room is not None and ram > job.host_room:  # the host's RAM cannot hold it: its device twin
            refused = max(refused, ram)
            twin = dataclasses.replace(cfg, store="device")
            if twin not in cands:
                cands.append(twin)
            continue
        chosen, planned = cfg, peak + buf
        if planned <= budget:
            break
    assert chosen is not None, "no SeedVR2 candidate (a store on the device is always one)"
    units = sx.units(lay, t, h, w, chosen.tile)
    note = host_refused_text(refused, job.host_room) if refused and chosen.store != "host" else ""
    hints = _hint_text(lay, est, budget, pref, chosen, max(h, w) * 8, job.tile_size)
    return Plan("seedvr2", chosen, chosen.describe() + note + hints, planned, exact=False,
                over_budget=bool(planned) and planned > budget, units=units)


def _hint_text(lay: SeedVR2Layout, est: int | None, budget: int, pref: int | None, chosen: SeedVR2Config | None,
               frame: int = 0, tile_size: int = 0) -> str:
    """How the plan used the model's own hints ("" for a model without them, as 0.33.0's)."""
    if not lay.hints.names():
        return ""
    parts = []
    if lay.hints.estimate is not None and not lay.hints.reliable:
        parts.append("its decode estimate (comfy_memory_used_decode) not used: the model does not mark it reliable")
    elif est is None and lay.hints.estimate is not None:
        parts.append("its decode estimate (comfy_memory_used_decode) failed: not used")
    elif est is not None and chosen is None:
        parts.append(f"its decode estimate {fmt_bytes(est)} (comfy_memory_used_decode, reliable)")
    elif est is not None:
        why = "a tile size was asked for" if tile_size > 0 else "over the budget"
        parts.append(f"its decode estimate {fmt_bytes(est)} (comfy_memory_used_decode, reliable): {why}, so the walk")
    if lay.hints.tile is not None and chosen is None:
        parts.append("its preferred tile (preferred_decode_tile) not needed: no tiles")
    elif lay.hints.tile is not None:
        if tile_size > 0:
            parts.append("its preferred tile (preferred_decode_tile) not asked: a tile size was given")
        elif pref is None:
            parts.append("its preferred tile (preferred_decode_tile) not known")
        elif pref >= frame:
            parts.append(f"its preferred tile at this budget, {pref} px (preferred_decode_tile), covers the frame: "
                         "not a candidate")
        else:
            took = "taken" if chosen.tile == (pref, pref) else "a candidate, not taken"
            parts.append(f"its preferred tile at this budget, {pref} px (preferred_decode_tile): {took}")
    return "; the model's hints: " + "; ".join(parts) if parts else ""
