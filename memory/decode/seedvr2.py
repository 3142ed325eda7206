"""Video decode of SeedVR2's VAE (ComfyUI 0.33's ``handles_tiling`` model ``comfy.ldm.seedvr.vae``, and its rewritten
upstream file): exact tiles and the host's time slices (:mod:`..executors.seedvr2`), after the same offload and budget
steps as every decode, with its first-use self-check against the host's own ``decode`` (its tiling off, as VAE Decode
runs it) and its report (a ``hints`` row where the model gives its own memory hints; the plan row says how each was
used, :mod:`..plan.seedvr2`).
Chosen by ``decode/video.video_engine`` when :func:`..vae.seedvr2_layout.seedvr2_of` recognises the model.
Nothing here imports ComfyUI."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..executors.seedvr2 import EXECUTOR_VERSION, decode_seedvr2
from ..plan.seedvr2 import plan_seedvr2
from ..plan.types import Plan
from ..plan.video import VideoJob, model_key
from ..run_context import RunContext
from ..vae.seedvr2_layout import seedvr2_layout
from .env import DecodeEnv
from .first_use import FirstUse
from .own_executor import OwnExecutor, own_path
from .self_check import CheckStore, Verdict, checked
from .video_flow import run_flow

log = logging.getLogger("vramfit.memory.decode.seedvr2")

__all__ = ["CHECK_LATENT", "CHECK_TILE", "EXACT_TEXT", "check_seedvr2", "decode_seedvr2_video"]

CHECK_LATENT = (2, 4, 2, 3)
"""``(B, T, h, w)`` of the self-check's latent: two videos (the host decodes them together, the walk item by item),
three of the host's time slices (the first of two latent frames, then two carried ones), 16x24 px."""
CHECK_TILE = (4, 4)
"""The self-check's tile: 1x1 to 4x6 tiles per segment (every tile edge inside a frame at full resolution)."""
EXACT_TEXT = "exact (equal to VAE Decode: the host's decode with its own tiling off)"


def _key(job: VideoJob) -> str:
    lay = seedvr2_layout(job.vae.first_stage_model)
    return (f"seedvr2/{model_key(job)}/{EXECUTOR_VERSION}/check2/slices{lay.slice_min}-{int(lay.use_slicing)}/"
            f"{lay.variant}")


def check_seedvr2(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                  first_use: FirstUse | None = None, norm_params: Any = None) -> Verdict:
    """Self-check of the executor for this model on this host: a random latent of :data:`CHECK_LATENT` decoded by
    the host's ``first_stage_model.decode`` and by the executor in :data:`CHECK_TILE` tiles and on whole frames,
    compared on [-1, 1] as VAE Decode's output is clamped (in half precision a random model's raw outputs past 1
    carry ulps of 2 or 4). Cached per structure (code fingerprint, the host's slicing, executor version, dtype, device type); an
    inconclusive check is never cached."""
    model = job.vae.first_stage_model
    c = int(job.z.shape[1])
    b, t, h, w = CHECK_LATENT
    z = torch.randn((b, c, t, h, w), generator=torch.Generator().manual_seed(0)).to(job.device, job.dtype)
    shape = (b, 3, seedvr2_layout(model).frames(t), h * 8, w * 8)

    def run(tile: tuple[int, int] | None) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            out = torch.empty(shape, dtype=job.dtype, device=job.device)
            return decode_seedvr2(model, z, tile, out=out, compute_device=job.device, dtype=job.dtype,
                                  norm_params=norm_params).clamp_(-1.0, 1.0)
        return go

    configs = [(f"2 videos x 3 time slices, {CHECK_TILE[0]}x{CHECK_TILE[1]}-px tiles", run(CHECK_TILE)),
               ("2 videos x 3 time slices, whole frames", run(None))]
    return checked(_key(job), store, model, lambda: model.decode(z).clamp_(-1.0, 1.0), configs, job.dtype, prepare,
                   first_use)


def _run(job: VideoJob, p: Plan, view: torch.Tensor, env: DecodeEnv, ctx: RunContext) -> None:
    cfg = p.config
    decode_seedvr2(job.vae.first_stage_model, job.z, cfg.tile, out=view, compute_device=job.device, dtype=job.dtype,
                   store_device="cpu" if cfg.store == "host" else None, norm_params=env.norm_params, **ctx.kwargs())


def _geometry(job: VideoJob) -> tuple[int, int, int]:
    _, _, t, h, w = (int(v) for v in job.z.shape)
    return seedvr2_layout(job.vae.first_stage_model).frames(t), h * 8, w * 8


def _tiles(st: dict) -> str:
    tile = st.get("tiles")
    return "whole frames" if tile is None else f"tiles of {tile[0]}x{tile[1]} px"


def _notes(job: VideoJob) -> list[tuple[str, str]]:
    rows = []
    if job.frames_per_chunk:
        rows.append(("note", f"frames_per_chunk {job.frames_per_chunk} not used: SeedVR2's own time slices are part "
                             "of its result"))
    names = seedvr2_layout(job.vae.first_stage_model).hints.names()
    if names:
        rows.append(("hints", f"the model's own: {', '.join(names)}; the plan row says how the planner used each"))
    return rows


SEEDVR2 = OwnExecutor(
    path="seedvr2",
    name="exact tiled executor",
    exact_text=f"{EXACT_TEXT}: SeedVR2 in tiles with shared per-frame statistics, its time slices carried",
    check=lambda job, env, prep, first: check_seedvr2(job, env.checks, prep, first, env.norm_params),
    plan=plan_seedvr2,
    geometry=_geometry,
    run=_run,
    over_text="the smallest tile sized",
    time_text=lambda st: f"{st.get('chunks', '?')} time slices, {_tiles(st)}",
    shape_text=lambda st: f"{st.get('chunks', '?')} slices" + (
        "" if st.get("tiles") is None else f" x tiles of {st['tiles'][0]} px"),
    oom_text=lambda n: f"{n} out-of-memory error(s): tile halved and decoding went on (finished tiles kept)",
    notes=_notes,
)
"""SeedVR2's walk as an executor of its own (:mod:`.own_executor`)."""


def decode_seedvr2_video(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                         t_start: float | None = None, allow_approximate: bool = False) -> Any:
    """``decode_video`` for SeedVR2 (:func:`.video_flow.run_flow` with :func:`.own_executor.own_path` of
    :data:`SEEDVR2`). Returns a :class:`.video_out.VideoDecodeResult`; ``allow_approximate`` unused (the executor is
    exact, else the host's decode)."""
    return run_flow(job, env, own_path(SEEDVR2), budget_mb=budget_mb, unload_others=unload_others, t_start=t_start)
