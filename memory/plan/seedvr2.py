"""Planning SeedVR2's exact decode (:mod:`..executors.seedvr2`): the tile side and where whole-frame activations
and carried frames wait, chosen from peaks sized on fake tensors like every video path (:func:`.video.meta_peak`,
persisted in the :class:`.video.PeakStore`). The time slices are the host's (they are part of its result), so the
lever is the tile: whole frames first (fewest calls), then tiles of 512 .. 32 px at every activation's own
resolution; on an accelerator, whole frames and 512-px tiles with the store on the device, then every tile with the
store (whole-frame activations and carried frames) in host memory, which leaves less on the device than any
device-store tile (and sizing many small tiles of a 4K frame on fake tensors takes minutes). The first that fits the
budget is the plan; none fits: the smallest, flagged over budget. Entered from ``decode/seedvr2`` (``decode/video.decode_video``
dispatches there when :func:`..vae.seedvr2_layout.seedvr2_of` recognises the model). Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..budget import host_refused_text
from ..executors import seedvr2 as sx
from ..vae.seedvr2_layout import seedvr2_layout
from .types import Plan
from .video import PeakStore, VideoJob, meta_sizes, model_key, out_bytes

log = logging.getLogger("vramfit.memory.plan.seedvr2")

__all__ = ["SIZED_FRAMES", "TILES", "SeedVR2Config", "candidates", "plan_seedvr2", "seedvr2_host_bytes", "seedvr2_peak"]

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


def candidates(job: VideoJob) -> list[SeedVR2Config]:
    lay = seedvr2_layout(job.vae.first_stage_model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    r = 8
    tiles = [(job.tile_size, job.tile_size)] if job.tile_size > 0 else [
        None if s is None else (s, s) for s in TILES]
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


def plan_seedvr2(job: VideoJob, budget: int, peaks: PeakStore, reason: str, exact: bool) -> Plan:
    """The first candidate (:func:`candidates`) whose peak plus the node's output buffer fits ``budget``, else the
    last one sized, over budget. ``reason``/``exact``: the self-check's verdict."""
    model = job.vae.first_stage_model
    lay = seedvr2_layout(model)
    b, _, t, h, w = (int(v) for v in job.z.shape)
    buf = out_bytes(job, lay.frames(t), h * 8, w * 8)
    chosen, planned, refused = None, 0, 0
    cands = candidates(job)
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
    return Plan("seedvr2", chosen, chosen.describe() + note, planned, exact=exact, reason=reason,
                over_budget=bool(planned) and planned > budget, units=units)
