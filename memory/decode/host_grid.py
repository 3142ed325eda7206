"""Video decode of a VAE that tiles internally (ComfyUI 0.33's ``handles_tiling``; MiniMax H3's video VAE): the
host's own grid reproduced one tile at a time (:mod:`..executors.host_grid`), after the same offload and budget
steps as every decode, with its first-use self-check against the host's own result and its report. Entered from
``decode/video.decode_video`` when :func:`..plan.host_grid.host_grid_of` recognises the model. Nothing here
imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key
from ..executors.host_grid import decode_host_grid
from ..plan.host_grid import host_grid_of, plan_host_grid
from ..plan.types import Chunking, Plan
from ..plan.video import REPORT_NODE, PeakStore, VideoJob, model_key
from ..report import (
    Report,
    flag_measured_overrun,
    fmt_bytes,
    fmt_seconds,
    measured_text,
    peak_verdict,
    summary_line,
)
from .env import DecodeEnv, load_weights, measured, prepare
from .first_use import FirstUse, first_use_tag
from .self_check import CheckStore, Verdict, checked

log = logging.getLogger("vramfit.memory.decode.host_grid")

__all__ = ["CHECK_FRAMES", "EXACT_TEXT", "check_host_grid", "decode_host_grid_video"]

CHECK_FRAMES = (12, 8, 1)
"""Latent frames of the self-check's latents: two clips of the host's grid (the first clip's kept tail cross-faded
into the second, the second's flushed), in 2x2 tiles; two clips, the second padded, and one frame (``decode``'s
single-frame case), each in one small tile."""
EXACT_TEXT = "exact (the host's own tiled result reproduced)"


def _grid_key(job: VideoJob) -> str:
    m = job.vae.first_stage_model
    grid = "/".join(str(getattr(m, f, "-")) for f in ("tiling", "tile_size", "tile_overlap_min", "clip_length",
                                                      "token_drop"))
    return f"host-grid/{model_key(job)}/{grid}"


def check_host_grid(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                    first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the grid executor for this model on this host: the latents of :data:`CHECK_FRAMES` (the first
    one latent px larger than the host's tile each way: 2x2 tiles; the others 1x1 latent px), decoded by the host's
    ``first_stage_model.decode`` and by the executor. Cached per structure (code fingerprint, grid fields,
    executor version, dtype, device type); an inconclusive check is never cached."""
    model = job.vae.first_stage_model
    c = int(job.z.shape[1])
    side = (int(model.tile_size) // int(model.vae_ratio) + 1) if model.tiling else 2
    gen = torch.Generator().manual_seed(0)
    zs = [torch.randn((1, c, t, s, s), generator=gen).to(job.device, job.dtype)
          for t, s in zip(CHECK_FRAMES, (side, 1, 1), strict=True)]

    def host() -> torch.Tensor:
        return torch.cat([model.decode(z).float().flatten() for z in zs])

    def grid() -> torch.Tensor:
        outs = []
        for z in zs:
            shape = tuple(int(v) for v in model.decode_output_shape(tuple(z.shape)))
            out = torch.empty(shape, dtype=torch.float32, device=job.device)
            outs.append(decode_host_grid(model, z, out=out, compute_device=job.device, dtype=job.dtype).flatten())
        return torch.cat(outs)

    return checked(_grid_key(job), store, model, host, [("2 clips x 2x2 tiles; a padded clip; one frame", grid)], job.dtype,
                   prepare, first_use)


def decode_host_grid_video(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                           t_start: float | None = None) -> Any:
    """``decode_video`` for a model with its own grid: offload and budget (:func:`.env.prepare`), self-check,
    plan (:func:`..plan.host_grid.plan_host_grid`), the grid executor into the output buffer (or, when the
    self-check failed, the host's own decode), report. Returns a ``decode.video.VideoDecodeResult``."""
    from .video import VideoDecodeResult, _host_decode, _post  # decode/video.py enters here: no import cycle

    vae, z = job.vae, job.z
    model = vae.first_stage_model
    assert host_grid_of(model) is not None
    b, _, t, h, w = (int(v) for v in z.shape)
    t0 = time.perf_counter() if t_start is None else t_start
    first = FirstUse(env.phase)
    peaks: PeakStore = env.peaks

    def ratio(path: str) -> float:
        return env.observed.ratio(observed_key(path, job.family, job.dtype, job.device))

    prep = prepare(vae, env, lambda: plan_host_grid(job, 1 << 62, peaks, "", True).planned or None, budget_mb,
                   unload_others)
    budget = prep.budget
    verdict = check_host_grid(job, env.checks, lambda: load_weights(vae, env, 0), first)
    job = dataclasses.replace(job, verdict=verdict)
    r = ratio("host_grid")
    p = plan_host_grid(job, int(budget.available / max(1.0, r)), peaks, verdict.describe(), verdict.ok)
    p.ratio = max(1.0, r)
    p.planned = int(p.planned * p.ratio)
    if not verdict.ok:  # not proven on this host: the host's own decode (exact by construction)
        p = Plan("host", Chunking(max(1, t - 1)), "the host's own decode (first_stage_model.decode, as VAE Decode), "
                 "one batch item at a time", 0, reason=f"the grid executor's {verdict.describe()}")
    plan_seconds = time.perf_counter() - t0
    load_weights(vae, env, p.planned)

    frames = int(model.decode_output_shape((1, *z.shape[1:]))[2])
    oh, ow = h * int(model.vae_ratio), w * int(model.vae_ratio)
    buf = torch.empty((b * frames, oh, ow, 3), dtype=torch.float32, device=job.out_device)
    view = buf.view(b, frames, oh, ow, 3).permute(0, 4, 1, 2, 3)
    bar = env.progress_bar(max(1, p.units * b)) if env.progress_bar is not None else None
    hook = env.fault_hook
    stats: dict = {}
    t1 = time.perf_counter()
    with measured(env, job.device) as m:
        if p.path == "host":
            _host_decode(job, view, bar, env, stats)
        else:
            decode_host_grid(model, z, out=view, compute_device=job.device, dtype=job.dtype,
                             store_device=job.out_device, progress=bar, should_stop=env.should_stop,
                             fault_hook=(lambda s: hook("step", s)) if hook is not None else None,
                             oom_exceptions=env.oom_exceptions, on_oom=env.on_oom, stats=stats)
        _post(vae, view)
    seconds = time.perf_counter() - t1
    if p.planned and not stats.get("restarts"):
        env.observed.note(observed_key(p.path, job.family, job.dtype, job.device), m.peak, int(p.planned / p.ratio),
                          m.kind)
    report = _report(job, p, budget, prep.offload, stats, seconds, plan_seconds, m.peak, m.method, first)
    return VideoDecodeResult(buf, report, p, budget, seconds, m.peak, m.method, stats, plan_seconds)


def _report(job: VideoJob, plan: Plan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, peak: int | None, method: str, first: FirstUse) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.path == "host":
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    else:
        r.add("path", f"{EXACT_TEXT}: this VAE tiles internally; its grid decoded one tile at a time")
    r.add("check", f"grid executor: {job.verdict.describe()}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.description)
    if plan.planned:
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        over = " - OVER BUDGET (one tile of the host's grid; another grid would change the result)" \
            if plan.over_budget else ""
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, meta sizing){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload and self-check included)")
    else:
        r.add("predicted", "not predicted")
    r.add("measured", measured_text(peak, method))
    flag_measured_overrun(r, peak, method, int(budget.available), log)
    tiles = stats.get("tiles")
    r.add("time", f"{fmt_seconds(seconds)} ({stats.get('chunks', '?')} clips"
                  f"{f' x {tiles} tiles' if tiles else ''})")
    if first.done:
        r.add("first use", first.describe())
    if stats.get("restarts"):
        r.add("oom", f"{stats['restarts']} tile(s) decoded again after an out-of-memory error (finished tiles kept)")
    b = int(job.z.shape[0])
    shape = "host decode" if plan.path == "host" else f"{stats.get('units', '?')} grid tiles"
    r.summary = summary_line(
        "exact",
        shape + (f" x {b} videos" if b > 1 and plan.path == "host" else ""),
        peak_verdict(peak, method, int(budget.available), plan.planned or None),
        "planned over budget" if plan.over_budget and not (peak or 0) > budget.available else "",
        fmt_seconds(seconds),
        f"{stats['restarts']} out-of-memory retr{'ies' if stats['restarts'] != 1 else 'y'}"
        if stats.get("restarts") else "",
        first_use_tag(first),
    )
    return r
