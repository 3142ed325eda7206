"""The host's own tile grid (VAEs that tile internally: ComfyUI 0.33's ``VAE.handles_tiling``), as a plan.

MiniMax H3's video VAE (``comfy.ldm.minimax.vae.MiniMaxH3VideoVAE``) decodes in a fixed grid of its own:
temporal clips of ``tokens_chunk_size + token_overlap`` latent frames, each spatially in ``tile_size`` px tiles
(``split_tiles``), overlaps cross-faded by its ``blend``: against the raw edges of its neighbours (0.33.0) or against
its neighbours as already blended, a row's tiles a few per decoder call (newer upstream; ``executors.host_grid``'s
``grid_kind`` tells them apart by structure). Its result, not an untiled decode, is the reference (its untiled
decode is worse: docs/VIDEO_DECODE.md). :func:`host_grid_of` recognises such a model by the methods the executor
(:mod:`..executors.host_grid`) calls; :func:`grid_peak` predicts its peak (one decoder call sized on fake tensors,
what it holds beside that counted); :func:`plan_host_grid` makes the plan: the grid is the host's, so the only
lever is how many of a row's tiles one decoder call takes on the newer grid (the most that fit, up to the host's
own cap); a budget below one tile's peak is reported over budget. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..executors import host_grid as hg
from .types import Plan
from .video import PeakStore, VideoJob, meta_peak, model_key, out_bytes

log = logging.getLogger("vramfit.memory.plan.host_grid")

__all__ = ["HOST_GRID_METHODS", "GridConfig", "grid_config", "grid_peak", "host_grid_of", "plan_host_grid",
           "row_batches", "tile_decode_peak"]

HOST_GRID_METHODS = ("split_tiles", "blend", "_decode_pixels", "_finalize_pixels", "_decode_temporal_chunks",
                     "decode_output_shape")
"""The host model's methods the executor calls (a model missing one is not reproduced); the newer grid's
``_decode_tile_row`` besides (:func:`..executors.host_grid.grid_kind`)."""
HOST_GRID_FIELDS = ("tile_size", "tiling", "vae_ratio", "vae_ratio_t", "tokens_chunk_size", "token_overlap",
                    "token_drop", "frame_pre_padding", "frame_overlap", "latents_mean", "latents_std")


def host_grid_of(model: Any) -> str | None:
    """What decodes ``model`` when it decodes in a grid of its own that the executor reproduces by calling the
    host's methods (MiniMax H3's video VAE: ``the host's own video grid (<grid kind>)``), else None. Duck-typed:
    no class name or version is checked; a model of neither grid (:func:`..executors.host_grid.grid_kind`) is
    None (the host's own decode)."""
    if model is None:
        return None
    if not all(callable(getattr(model, m, None)) for m in HOST_GRID_METHODS):
        return None
    if not all(hasattr(model, f) for f in HOST_GRID_FIELDS):
        return None
    kind = hg.grid_kind(model)
    return None if kind is None else f"the host's own video grid ({kind})"


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """The host's grid for one latent: spatial tiles (output px starts, lengths, overlaps), clips, the grid's
    kind and the tiles one decoder call takes (``batch``, the newer grid's row groups; 1 on 0.33.0's)."""

    rows: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    cols: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    clips: tuple[hg.Clip, ...]
    kind: str = hg.RAW
    batch: int = 1

    @property
    def tiles(self) -> int:
        return len(self.rows[0]) * len(self.cols[0])

    def describe(self) -> str:
        r, c = len(self.rows[0]), len(self.cols[0])
        per_call = ("one tile decoded at a time" if self.batch == 1 else
                    f"{self.batch} of a row's tiles per decoder call (the host's _decode_tile_row)")
        return (f"the host's own {self.kind}: {len(self.clips)} clip(s) x {r}x{c} tiles of "
                f"{max(self.rows[1])}x{max(self.cols[1])} px, {per_call}, blended into the output as they finish")


def grid_config(model: Any, z_shape: tuple[int, ...], batch: int = 1) -> GridConfig:
    _, _, t, h, w = (int(v) for v in z_shape)
    rows, cols = hg.spatial_grid(model, h, w)
    return GridConfig(rows, cols, tuple(hg.schedule(model, t)), hg.grid_kind(model) or hg.RAW, batch)


def row_batches(model: Any, z_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Tiles per decoder call the plan may take, most first: on the newer grid (its row method, tiling on) up to a
    row of tiles and the host's own cap (:data:`..executors.host_grid.ROW_BATCH_MAX`), else one."""
    if hg.grid_kind(model) != hg.BLENDED or not model.tiling:
        return (1,)
    _, cols = hg.spatial_grid(model, int(z_shape[3]), int(z_shape[4]))
    return tuple(range(min(len(cols[0]), hg.ROW_BATCH_MAX), 0, -1))


def tile_decode_peak(job: VideoJob, tokens: int, peaks: PeakStore, batch: int = 1) -> int:
    """Meta-sized peak bytes of one decoder call (the host's ``_decode_pixels``) on ``batch`` tiles of ``tokens``
    latent frames at the host's tile size, its output included; persisted in ``peaks``."""
    model = job.vae.first_stage_model
    c = int(job.z.shape[1])
    r = int(model.vae_ratio)
    th = min(int(model.tile_size) // r, int(job.z.shape[3])) if model.tiling else int(job.z.shape[3])
    tw = min(int(model.tile_size) // r, int(job.z.shape[4])) if model.tiling else int(job.z.shape[4])
    key = f"{model_key(job)}/{batch}x{c}x{tokens}x{th}x{tw}/host-grid-tile-{hg.EXECUTOR_VERSION}"

    def run() -> Any:
        group = [torch.empty((1, c, tokens, th, tw), dtype=job.dtype, device=job.device) for _ in range(batch)]
        return model._decode_pixels(torch.cat(group) if batch > 1 else group[0])

    return peaks.get_or_make(key, lambda: meta_peak(job, run))


def grid_peak(job: VideoJob, peaks: PeakStore, batch: int = 1) -> int:
    """Predicted peak bytes of :func:`..executors.host_grid.decode_host_grid` without the output buffer: one
    decoder call of ``batch`` tiles at the longest clip (meta-sized, :func:`tile_decode_peak`; sizing the whole grid
    on fake tensors takes minutes for the real model at 4K) plus what the executor holds beside it, counted: the
    blends' and the finalisation's temporaries of one tile (four raw tiles and two float32 ones), the latent, and
    the row edges (raw tails or the blended strip) and kept clip tail when they wait on the compute device's type."""
    model = job.vae.first_stage_model
    b, c, t, h, w = (int(v) for v in job.z.shape)
    clips = hg.schedule(model, t)
    tokens = max(cl.z1 - cl.z0 for cl in clips)
    frames = max(cl.frames for cl in clips)
    r = int(model.vae_ratio)
    rows, cols = hg.spatial_grid(model, h, w)
    size = torch.empty((), dtype=job.dtype).element_size()
    tile_px = max(rows[1]) * max(cols[1])
    raw = 3 * frames * tile_px * size
    extra = 4 * raw + 2 * 3 * frames * tile_px * 4
    z_bytes = c * (max(t, clips[-1].z1)) * h * w * size * 2
    store = 0
    if job.out_device.type == job.device.type:
        keep = max((p.stop - p.start for cl in clips for p in cl.parts if p.keep), default=0)
        ov = max(rows[2], default=0)
        store = 2 * 3 * keep * h * w * r * r * size + 3 * frames * ov * w * r * size
    return tile_decode_peak(job, tokens, peaks, batch) + extra + z_bytes + store


def plan_host_grid(job: VideoJob, budget: int, peaks: PeakStore) -> Plan:
    """The plan of a model with its own grid: the executor with the most tiles per decoder call
    (:func:`row_batches`) whose meta-sized peak plus the node's output buffer (when it lives on the compute device's
    type) fits ``budget``. With none fitting it runs one tile per call anyway, flagged: another grid would not give
    the host's result. Not ``exact`` until the executor's self-check passed (the video flow's check step sets it:
    ``decode/own_executor.own_path``)."""
    model = job.vae.first_stage_model
    b, _, _, h, w = (int(v) for v in job.z.shape)
    frames = int(model.decode_output_shape((1, *job.z.shape[1:]))[2])
    r = int(model.vae_ratio)
    out = out_bytes(job, frames, h * r, w * r)
    batch, planned = 1, 0
    for g in row_batches(model, tuple(job.z.shape)):
        try:
            peak = grid_peak(job, peaks, g)
        except Exception as e:  # noqa: BLE001 - an op without a fake kernel: run unpredicted, a tile per call
            log.warning("meta sizing of the host-grid executor failed (%s: %s)", type(e).__name__, e)
            batch, planned = 1, 0
            break
        batch, planned = g, peak + out
        if planned <= budget:
            break
    cfg = grid_config(model, tuple(job.z.shape), batch)
    return Plan("host_grid", cfg, cfg.describe(), planned, exact=False,
                over_budget=bool(planned) and planned > budget, units=cfg.tiles * len(cfg.clips))
