"""The host's own tile grid (VAEs that tile internally: ComfyUI 0.33's ``VAE.handles_tiling``), as a plan.

MiniMax H3's video VAE (``comfy.ldm.minimax.vae.MiniMaxH3VideoVAE``) decodes in a fixed grid of its own:
temporal clips of ``tokens_chunk_size + token_overlap`` latent frames, each spatially in ``tile_size`` px tiles
(``split_tiles``), overlaps cross-faded by its ``blend``. Its result, not an untiled decode, is the reference (its
untiled decode is worse: docs/VIDEO_DECODE.md). :func:`host_grid_of` recognises such a model by the methods the
executor (:mod:`..executors.host_grid`) calls; :func:`schedule` lays out the host's temporal chunking (which clip
frames are written where, which are kept to blend into the next clip); :func:`plan_host_grid` sizes the
executor on fake tensors. The grid is the host's, so the plan cannot shrink it: a budget below one tile's peak
is reported over budget. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from ..executors import host_grid as hg
from ..measure.sizing import MetaSizer
from .types import Plan
from .video import PeakStore, VideoJob, model_key, out_bytes

log = logging.getLogger("vramfit.memory.plan.host_grid")

__all__ = ["HOST_GRID_METHODS", "GridConfig", "grid_peak", "host_grid_of", "plan_host_grid"]

HOST_GRID_METHODS = ("split_tiles", "blend", "_decode_pixels", "_finalize_pixels", "_decode_temporal_chunks",
                     "decode_output_shape")
"""The host model's methods the executor calls (a model missing one is not reproduced)."""
HOST_GRID_FIELDS = ("tile_size", "tiling", "vae_ratio", "vae_ratio_t", "tokens_chunk_size", "token_overlap",
                    "token_drop", "frame_pre_padding", "frame_overlap", "latents_mean", "latents_std")
SIZE_FRAMES = 13
"""Latent frames the executor is sized at (three clips of the host's grid: the steady state; longer latents
hold no more at once)."""


def host_grid_of(model: Any) -> str | None:
    """The family name when ``model`` decodes in a grid of its own that the executor reproduces by calling the
    host's methods (MiniMax H3's video VAE), else None. Duck-typed: no class name or version is checked."""
    if model is None:
        return None
    if not all(callable(getattr(model, m, None)) for m in HOST_GRID_METHODS):
        return None
    if not all(hasattr(model, f) for f in HOST_GRID_FIELDS):
        return None
    return "MiniMax H3 video grid"


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """The host's grid for one latent: spatial tiles (output px starts, lengths, overlaps) and clips."""

    rows: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    cols: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    clips: tuple[hg.Clip, ...]

    @property
    def tiles(self) -> int:
        return len(self.rows[0]) * len(self.cols[0])

    def describe(self) -> str:
        r, c = len(self.rows[0]), len(self.cols[0])
        return (f"the host's own grid: {len(self.clips)} clip(s) x {r}x{c} tiles of "
                f"{max(self.rows[1])}x{max(self.cols[1])} px, one tile decoded at a time, blended into the "
                "output as it finishes")


def grid_config(model: Any, z_shape: tuple[int, ...]) -> GridConfig:
    _, _, t, h, w = (int(v) for v in z_shape)
    rows, cols = hg.spatial_grid(model, h, w)
    return GridConfig(rows, cols, tuple(hg.schedule(model, t)))


def grid_peak(job: VideoJob, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of :func:`..executors.host_grid.decode_host_grid` for this latent (at most
    :data:`SIZE_FRAMES` latent frames), without the output buffer; persisted in ``peaks``."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    ts = min(t, SIZE_FRAMES)
    key = f"{model_key(job)}/{b}x{c}x{ts}x{h}x{w}/host-grid-{hg.EXECUTOR_VERSION}"
    peak = peaks.get(key)
    if peak is not None:
        return peak
    model = job.vae.first_stage_model
    frames = int(model.decode_output_shape((1, c, ts, h, w))[2])
    r = int(model.vae_ratio)
    with torch.inference_mode(), MetaSizer([model], job.dtype, job.device) as sizer:
        zf = torch.empty((b, c, ts, h, w), dtype=job.dtype, device=job.device)
        out = torch.empty((b, 3, frames, h * r, w * r), dtype=torch.float32, device=job.device)
        hg.decode_host_grid(model, zf, out=out, compute_device=job.device, dtype=job.dtype, store_device=job.device)
        del out, zf
    peak = max(0, int(sizer.peak_bytes) - b * 3 * frames * h * r * w * r * 4)
    peaks.put(key, peak)
    return peak


def plan_host_grid(job: VideoJob, budget: int, peaks: PeakStore, reason: str, exact: bool) -> Plan:
    """The one plan of a model with its own grid: the executor, its meta-sized peak plus the node's output buffer
    (when it lives on the compute device's type). Over the budget it still runs, flagged: another grid would not
    give the host's result. ``reason``/``exact``: the self-check's verdict."""
    model = job.vae.first_stage_model
    cfg = grid_config(model, tuple(job.z.shape))
    b, _, _, h, w = (int(v) for v in job.z.shape)
    frames = int(model.decode_output_shape((1, *job.z.shape[1:]))[2])
    r = int(model.vae_ratio)
    try:
        peak = grid_peak(job, peaks)
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: run unpredicted
        log.warning("meta sizing of the host-grid executor failed (%s: %s)", type(e).__name__, e)
        peak = 0
    planned = peak + out_bytes(job, frames, h * r, w * r) if peak else 0
    p = Plan("host_grid", cfg, cfg.describe(), planned, exact=exact, reason=reason,
             over_budget=bool(planned) and planned > budget, units=cfg.tiles * len(cfg.clips))
    return p
