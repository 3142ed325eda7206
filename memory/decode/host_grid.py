"""Video decode of a VAE that tiles internally (ComfyUI 0.33's ``handles_tiling``; MiniMax H3's video VAE): the
host's own grid (0.33.0's raw-edge grid or the newer neighbour-blended one) reproduced one tile, or one row group,
at a time (:mod:`..executors.host_grid`), after the same offload and budget steps as every decode, with its
first-use self-check against the host's own result and its report. Chosen by ``decode/video.video_engine`` when
:func:`..plan.host_grid.host_grid_of` recognises the model. Nothing here imports ComfyUI."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..executors import host_grid as hg
from ..executors.host_grid import decode_host_grid
from ..plan.host_grid import plan_host_grid
from ..plan.types import Plan
from ..plan.video import VideoJob, model_key
from ..report import fmt_bytes
from ..run_context import RunContext
from .env import DecodeEnv
from .first_use import FirstUse
from .own_executor import OwnExecutor, own_path
from .self_check import CheckStore, Verdict, checked
from .video_flow import run_flow

log = logging.getLogger("vramfit.memory.decode.host_grid")

__all__ = ["CHECK_FRAMES", "EXACT_TEXT", "check_host_grid", "decode_host_grid_video"]

CHECK_FRAMES = (12, 8, 1)
"""Latent frames of the self-check's latents: two clips of the host's grid (the first clip's kept tail cross-faded
into the second, the second's flushed), in 2x2 tiles (on the newer grid once a tile per decoder call, once a row
per call); two clips, the second padded, and one frame (``decode``'s single-frame case), each in one small tile."""
EXACT_TEXT = "exact (the host's own tiled result reproduced)"


def _grid_key(job: VideoJob) -> str:
    m = job.vae.first_stage_model
    grid = "/".join(str(getattr(m, f, "-")) for f in ("tiling", "tile_size", "tile_overlap_min", "clip_length",
                                                      "token_drop"))
    return f"host-grid/{model_key(job)}/{grid}/{hg.grid_kind(m)}/{hg.EXECUTOR_VERSION}"


def check_host_grid(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                    first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the grid executor for this model on this host: the latents of :data:`CHECK_FRAMES` (the first
    one latent px larger than the host's tile each way: 2x2 tiles; the others 1x1 latent px), decoded by the host's
    ``first_stage_model.decode`` and by the executor (on the newer grid: a tile per decoder call and a row per
    call). Cached per structure (code fingerprint, grid fields and kind, executor version, dtype, device type); an
    inconclusive check is never cached."""
    model = job.vae.first_stage_model
    c = int(job.z.shape[1])
    side = (int(model.tile_size) // int(model.vae_ratio) + 1) if model.tiling else 2
    gen = torch.Generator().manual_seed(0)
    zs = [torch.randn((1, c, t, s, s), generator=gen).to(job.device, job.dtype)
          for t, s in zip(CHECK_FRAMES, (side, 1, 1), strict=True)]

    def host() -> torch.Tensor:
        return torch.cat([model.decode(z).float().flatten() for z in zs])

    def grid(batch: int) -> torch.Tensor:
        outs = []
        for z in zs:
            shape = tuple(int(v) for v in model.decode_output_shape(tuple(z.shape)))
            out = torch.empty(shape, dtype=torch.float32, device=job.device)
            outs.append(decode_host_grid(model, z, out=out, compute_device=job.device, dtype=job.dtype,
                                         row_batch=batch).flatten())
        return torch.cat(outs)

    what = "2 clips x 2x2 tiles; a padded clip; one frame"
    configs = [(f"{what} ({hg.grid_kind(model)}, a tile per call)", lambda: grid(1))]
    if hg.grid_kind(model) == hg.BLENDED and model.tiling:
        configs.append((f"{what} ({hg.BLENDED}, a row per call)", lambda: grid(hg.ROW_BATCH_MAX)))
    return checked(_grid_key(job), store, model, host, configs, job.dtype, prepare, first_use)


def _run(job: VideoJob, p: Plan, view: torch.Tensor, env: DecodeEnv, ctx: RunContext) -> None:
    decode_host_grid(job.vae.first_stage_model, job.z, out=view, compute_device=job.device, dtype=job.dtype,
                     store_device=job.out_device, row_batch=p.config.batch, **ctx.kwargs())


def _geometry(job: VideoJob) -> tuple[int, int, int]:
    model = job.vae.first_stage_model
    _, _, _, h, w = (int(v) for v in job.z.shape)
    frames = int(model.decode_output_shape((1, *job.z.shape[1:]))[2])
    return frames, h * int(model.vae_ratio), w * int(model.vae_ratio)


def _notes(job: VideoJob) -> list[tuple[str, str]]:
    """The model's own hint, shown: what its ``memory_used_decode`` says the host's decode of this latent takes
    (what ComfyUI reserves before calling it); the plan sizes the executor's decoder call on fake tensors."""
    est = getattr(job.vae, "memory_used_decode", None)
    if not callable(est):
        return []
    try:
        need = int(est(tuple(job.z.shape), job.dtype))
    except Exception:  # noqa: BLE001 - a hint only
        return []
    return [("model estimate", f"{fmt_bytes(need)} for the host's own decode of this latent (the model's "
                               "memory_used_decode, what ComfyUI reserves for it)")]


HOST_GRID = OwnExecutor(
    path="host_grid",
    name="grid executor",
    exact_text=f"{EXACT_TEXT}: this VAE tiles internally; its grid decoded a tile (or a row group) at a time",
    check=lambda job, env, prep, first: check_host_grid(job, env.checks, prep, first),
    plan=plan_host_grid,
    geometry=_geometry,
    run=_run,
    over_text="one tile of the host's grid; another grid would change the result",
    time_text=lambda st: f"{st.get('chunks', '?')} clips" + (f" x {st['tiles']} tiles" if st.get("tiles") else ""),
    shape_text=lambda st: f"{st.get('units', '?')} grid tiles",
    oom_text=lambda n: f"{n} decoder call(s) made again after an out-of-memory error (finished tiles kept)",
    notes=_notes,
)
"""MiniMax H3's grid as an executor of its own (:mod:`.own_executor`)."""


def decode_host_grid_video(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                           t_start: float | None = None, allow_approximate: bool = False) -> Any:
    """``decode_video`` for a model with its own grid (:func:`.video_flow.run_flow` with
    :func:`.own_executor.own_path` of :data:`HOST_GRID`).
    Returns a :class:`.video_out.VideoDecodeResult`; ``allow_approximate`` unused (the executor is exact, else the
    host's decode)."""
    return run_flow(job, env, own_path(HOST_GRID), budget_mb=budget_mb, unload_others=unload_others, t_start=t_start)
