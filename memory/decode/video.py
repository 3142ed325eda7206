"""Video decode within a memory budget: the job, the engine that decodes it (identified once: :func:`video_engine`),
the self-checks of the chunked executors on this host, the chunked paths (Wan's, carried, overlap-blended) as a path
of the video flow (:data:`CHUNKED` for :func:`.video_flow.run_flow`: their plan, check, executors) and their
report. The engine of the Temporal-Chunk Video Decode node (``nodes/video_decode.py``
validates the inputs and passes ComfyUI's callables in a :class:`.env.DecodeEnv`). Design and measurements: docs/VIDEO_DECODE.md. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import ratio_text
from ..executors.blend import decode_overlap_blend
from ..executors.carry import decode_carried
from ..executors.wan import decode_wan_chunked
from ..plan import plan
from ..plan.grid import ImpossibleBudgetError
from ..plan.host_grid import host_grid_of
from ..plan.types import Plan
from ..plan.video import (
    REPORT_NODE,
    VideoJob,
    blend_fn,
    blend_ratios,
    carry_halo,
    chunk_frames,
    host_decode_plan,
    host_fn,
    model_key,
    output_geometry,
)
from ..report import (
    Report,
    flag_measured_overrun,
    fmt_bytes,
    fmt_seconds,
    measured_text,
    peak_verdict,
    summary_line,
)
from ..run_context import RunContext
from ..vae.carry_layout import blend_refusal, carry_layout
from ..vae.families import identify, model_name
from ..vae.seedvr2_layout import seedvr2_of
from ..vae.wan_layout import cache_protocol, is_wan_vae, wan_layout
from .env import DecodeEnv, load_weights
from .first_use import FirstUse, first_use_tag
from .floor import floor_choice, seeded
from .host_grid import decode_host_grid_video
from .seedvr2 import decode_seedvr2_video
from .self_check import FIDELITY_FLOOR_DB, CheckStore, Verdict, checked, code_fingerprint
from .video_flow import Checking, VideoPath, run_flow
from .video_out import VideoDecodeResult

log = logging.getLogger("vramfit.memory.decode.video")

__all__ = ["REPORT_NODE", "VideoDecodeResult", "VideoJob", "check_blend", "check_chunked", "decode_chunked",
           "decode_video", "make_job", "video_engine"]


def make_job(vae: Any, z: torch.Tensor, out_device: torch.device | str, *, frames_per_chunk: int = 0,
             tile_size: int = 0, one_frame: bool = False) -> VideoJob:
    """A validated video latent ``z`` (5-D), its VAE (duck-typed ``comfy.sd.VAE``) and the user's settings:
    ``frames_per_chunk`` (latent frames) and ``tile_size`` (output px; Wan only), 0 = auto. ``one_frame``: ``z``
    holds an image VAE's 2-D latents as one-frame clips (:attr:`VideoJob.one_frame`)."""
    model = vae.first_stage_model
    wan = is_wan_vae(model)
    carry = None if wan else carry_layout(model)
    return VideoJob(
        vae=vae,
        z=z,
        layout=wan_layout(model) if wan else None,
        protocol=cache_protocol(model) if wan else None,
        carry=carry if carry is not None and carry.reason is None else None,
        carry_why=(carry.reason or "") if carry is not None else "",
        blend_why="" if wan else blend_refusal(model) or "",
        family=identify(vae) or model_name(vae),
        dtype=getattr(vae, "vae_dtype", torch.float32),
        device=torch.device(vae.device),
        out_device=torch.device(out_device),
        fingerprint=code_fingerprint(model),
        frames_per_chunk=int(frames_per_chunk),
        tile_size=int(tile_size),
        one_frame=bool(one_frame),
    )


# --------------------------------------------------------------------------------------------------
# Self-check of the chunked executor


CHECK_LATENT = (3, 1, 2)
"""``(T, h, w)`` of the self-check's latent: frame 0 + two one-frame chunks (a host that drops the caches'
history between one-frame calls shows from the second), 1x2 latent px (two tiles)."""


def check_chunked(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                  first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the chunked executor for this decoder on this host (:func:`.self_check.verify`): a tiny
    random latent (:data:`CHECK_LATENT`) decoded by ``first_stage_model.decode`` and by the executor with
    k = 1 in 1x2 tiles with in-place caches (one-frame chunks: the caches' history restored; phase 1, the
    store, per-tile caches; the split before the head keeps the tiles' extra work small) and k = 2 on whole
    frames (chunks of several frames, the one-tile path). Keyed by the decoder's code fingerprint, the
    detected cache protocol, the executor's version, dtype and device type. ``prepare()`` runs first when the
    check runs (the node loads the weights). A one-frame job (:attr:`VideoJob.one_frame`: an image VAE's latents)
    is checked against the host's 4-D decode on a 1 x 3 (halo + 1) latent in three tiles, the middle one reading no
    image edge, at the default split and before the head."""
    model = job.vae.first_stage_model
    lay = job.layout
    last = len(lay.splits) - 1
    key = f"wan-{'one-frame' if job.one_frame else 'chunked'}/{model_key(job)}"
    core = lay.split_info().halo + 1  # a one-frame check's tile: the middle of three reads no image edge
    shape = (1, 1, 3 * core) if job.one_frame else CHECK_LATENT
    z = torch.randn((1, lay.latent_channels, *shape), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)

    def run(k: int, tile: tuple[int, int] | None, **kw: Any) -> Callable[[], torch.Tensor]:
        return lambda: decode_wan_chunked(model, z, k, tile, compute_device=job.device, dtype=job.dtype, **kw)

    if job.one_frame:  # three tiles at the default split and before the head
        configs = [(f"3 tiles at split {sp}", run(1, (1, core), split=sp)) for sp in (lay.default_split, last)]
    else:
        configs = [(f"k = 1, 1x2 tiles at split {last}, in-place caches", run(1, (1, 1), split=last, rollback=False)),
                   ("k = 2, whole frames", run(2, None))]
    return checked(key, store, model, lambda: host_fn(job)(z), configs, job.dtype, prepare, first_use)


def check_carried(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                  first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the carried-context executor for this decoder on this host: a tiny random latent
    (:data:`CHECK_LATENT`; ``2 min_k + 1`` frames for a family whose chunks hold at least ``min_k``) decoded by
    ``first_stage_model.decode`` and in chunks of the smallest ``k`` (three chunks) and one more; a family with
    spatial tiles also in 1x1-px tiles with its traced halo. Every run starts from the same random state (a
    decode that draws noise, LTX's, draws the same)."""
    model, desc = job.vae.first_stage_model, job.carry.description
    key = f"carry/{job.carry.family}/{model_key(job)}"
    c = int(job.z.shape[1])
    t, h, w = CHECK_LATENT if desc.min_k == 1 else (desc.check_t or 2 * desc.min_k + 1, *CHECK_LATENT[1:])
    if desc.tiles:
        h, w = 2, 2
    z = torch.randn((1, c, t, h, w), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)

    def run(k: int, tile: tuple[int, int] | None = None) -> Callable[[], torch.Tensor]:
        def go() -> torch.Tensor:
            r = int(blend_ratios(job.vae)[2])
            out = torch.empty((1, job.out_channels, chunk_frames(job, t), h * r, w * r), dtype=torch.float32)
            halo = carry_halo(model, job.carry, c, job.dtype, job.device) if tile is not None else 0
            return decode_carried(model, job.carry, z, k, out=out, dtype=job.dtype, compute_device=job.device,
                                  tile=tile, halo=halo)
        return seeded(job.device, go)

    k = desc.min_k
    configs = [(f"k = {k} (three chunks)" if desc.temporal else "whole clip", run(k))]
    if desc.temporal:
        configs.append((f"k = {k + desc.step}", run(k + desc.step)))
    if desc.tiles:
        configs.append((f"k = {k}, 1x1 tiles" if desc.temporal else "1x1 tiles", run(k, (1, 1))))
    return checked(key, store, model, seeded(job.device, lambda: model.decode(z).float()), configs, job.dtype, prepare,
                   first_use)


BLEND_CHECK_HW = 4
"""Most latent px per side of the blend's fidelity check (the job's own size when smaller)."""


def check_blend(job: VideoJob, store: CheckStore, k: int, prepare: Callable[[], None] | None = None,
                first_use: FirstUse | None = None) -> Verdict:
    """Fidelity of the overlap-blend at ``k`` latent frames per chunk for this decoder on this host: a small random
    latent (``2 k - 1`` latent frames: two chunks of ``k`` overlapping by one, the chunk length the plan checked
    against the VAE's frame formula; at most :data:`BLEND_CHECK_HW` latent px a side)
    decoded whole by ``first_stage_model.decode`` and by :func:`..executors.blend.decode_overlap_blend`, both
    through the VAE's ``process_output`` (``[0, 1]``, as the node's output), compared by PSNR
    (:func:`.self_check.verify` with ``floor_db`` :data:`.self_check.FIDELITY_FLOOR_DB`). Cached per structure, ``k``
    and check size as the exactness verdicts are (a failure per file, an inconclusive check never)."""
    model = job.vae.first_stage_model
    k = max(2, int(k))
    c, h, w = (int(job.z.shape[i]) for i in (1, 3, 4))
    t, h, w = 2 * k - 1, min(h, BLEND_CHECK_HW), min(w, BLEND_CHECK_HW)
    key = f"blend-fidelity/{model_key(job)}/k{k}/{t}x{h}x{w}"
    z = torch.randn((1, c, t, h, w), generator=torch.Generator().manual_seed(0)).to(job.device, job.dtype)
    frames_of, index_formula, _ = blend_ratios(job.vae)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return job.vae.process_output(x.float().clone()).float()

    def blended() -> torch.Tensor:
        return unit(decode_overlap_blend(blend_fn(job), z, k, 1, upscale_ratio=frames_of,
                                         index_formula=index_formula, out_device=job.device))

    return checked(key, store, model, seeded(job.device, lambda: unit(blend_fn(job)(z))),
                   [(f"overlap-blend, k = {k}", seeded(job.device, blended))], job.dtype, prepare, first_use,
                   "measuring the overlap-blend's fidelity against the host's own result", FIDELITY_FLOOR_DB)


def _blend_or_host(job: VideoJob, p: Plan, env: DecodeEnv, available: int, allow: bool,
                   first: FirstUse | None) -> tuple[Plan, str]:
    """The blend plan ``p`` as it may run: kept (its fidelity in its reason) when it measures at least
    :data:`.self_check.FIDELITY_FLOOR_DB` or the user allows approximate output; else the host's own decode (exact),
    flagged when over budget, its reason saying why the blend was not taken. A decoder the blend cannot serve
    (:attr:`..plan.video_job.VideoJob.blend_why`) always takes the host's decode. Returns ``(plan, refused)``:
    ``refused`` the reason the blend was not taken ("" when it runs)."""
    if job.blend_why:
        refused = f"no overlap-blend for this decoder: {job.blend_why}"
    elif int(job.z.shape[2]) <= int(p.config.k):  # one chunk holds the clip: that chunk is the host's own decode
        refused = f"one chunk of {p.config.k} latent frames holds the whole clip: it is the host's own decode"
    else:
        v = check_blend(job, env.checks, p.config.k, lambda: load_weights(job.vae, env, 0), first)
        fid, refused = floor_choice(v, allow, "the overlap-blend that fits")
        if not refused:
            return dataclasses.replace(p, reason=f"{p.reason}; {fid}"), ""
    host = host_decode_plan(job, env.peaks, refused)
    host.over_budget = host.planned > available
    return host, refused


def _verify(job: VideoJob, p: Plan, per_item: bool, ck: Checking) -> tuple[VideoJob, Plan, bool, str]:
    """The check step of the chunked paths: Wan's chunks and the carried chunks run only once their executor's
    self-check (:func:`check_chunked`, :func:`check_carried`) passed on this host; a failed check re-plans without
    them (``ck.replan``: the host's own decode when it fits, else approximate chunks said so). The host's own decode
    relies on nothing: no check runs for it. The overlap-blend's fidelity floor follows (:func:`_blend_or_host`)."""
    env = ck.env
    if p.path in ("wan", "carry") and job.verdict is None:
        check = check_chunked if p.path == "wan" else check_carried
        verdict = check(job, env.checks, lambda: load_weights(job.vae, env, 0), ck.first)
        job = dataclasses.replace(job, verdict=verdict)
        if not verdict.ok:
            env.at("plan")
            p, per_item = ck.replan(job)
            env.at("check")
        elif p.path == "wan":  # as :func:`..plan.video.plan` says a checked plan's exactness
            p = dataclasses.replace(p, exact=True, reason=verdict.describe())
    refused = ""
    if p.path == "blend":  # approximate: measured first, never taken under the floor unless the user asked
        p, refused = _blend_or_host(job, p, env, ck.available, ck.allow_approximate, ck.first)
    return job, p, per_item, refused


def _plan_batch(job: VideoJob, available: int, env: DecodeEnv, ratio: Any, out_bytes: int) -> tuple[Plan, bool]:
    """``(plan, per_item)``: the plan of the whole batch at once; when none fits a batch of several Wan clips (none
    at all, or only the user's ``frames_per_chunk`` / ``tile_size`` over the budget), the plan of one clip within what
    the batch's output buffer (``out_bytes``, held throughout) leaves, run one batch item at a time (the chunked
    executor decodes each item alone, as the host's Wan decode does: no noise, no statistic across the batch; a batch
    of Qwen-Image-Layered's layers). Not the carried families: a decoder that draws noise (LTX-Video) draws it once
    for the host's whole batch. When one clip does not fit either: the whole batch's plan, or its
    :class:`..plan.grid.ImpossibleBudgetError`."""
    b = int(job.z.shape[0])
    try:
        whole: Plan | ImpossibleBudgetError = plan(job, available, env.peaks, ratio)
    except ImpossibleBudgetError as e:
        whole = e
    if isinstance(whole, Plan) and (not whole.over_budget or b == 1 or not job.wan or whole.path != "wan"):
        return whole, False
    p = None
    if b > 1 and job.wan:
        try:
            p = plan(dataclasses.replace(job, z=job.z[:1]), available - out_bytes + out_bytes // b, env.peaks, ratio)
        except ImpossibleBudgetError:
            p = None
    if p is None or p.path != "wan" or p.over_budget:
        if isinstance(whole, Plan):
            return whole, False
        raise whole
    p.planned += out_bytes - out_bytes // b
    return dataclasses.replace(p, description=f"{p.description}; one batch item at a time"), True


def _items(b: int, per_item: bool) -> list[slice]:
    return [slice(i, i + 1) for i in range(b)] if per_item else [slice(None)]


# --------------------------------------------------------------------------------------------------
# Decode


def video_engine(job: VideoJob) -> Callable[..., VideoDecodeResult]:
    """The engine that decodes ``job``, identified once by what its VAE is (the route asks it; :func:`decode_video`
    for a caller without a route): MiniMax H3's own grid (:func:`.host_grid.decode_host_grid_video`), SeedVR2's
    exact tiles and time slices (:func:`.seedvr2.decode_seedvr2_video`), else :func:`decode_chunked`."""
    model = job.vae.first_stage_model
    if host_grid_of(model) is not None:  # tiles internally (MiniMax H3): the host's own grid
        return decode_host_grid_video
    if seedvr2_of(model) is not None:  # SeedVR2: exact tiles, the host's own time slices
        return decode_seedvr2_video
    return decode_chunked


def decode_video(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                 t_start: float | None = None, allow_approximate: bool = False) -> VideoDecodeResult:
    """Decode any video ``job`` by its engine (:func:`video_engine`), with :func:`decode_chunked`'s arguments."""
    env.at("identify")
    return video_engine(job)(job, env, budget_mb=budget_mb, unload_others=unload_others, t_start=t_start,
                             allow_approximate=allow_approximate)


def decode_chunked(job: VideoJob, env: DecodeEnv, *, budget_mb: float = 0, unload_others: bool = True,
                   t_start: float | None = None, allow_approximate: bool = False) -> VideoDecodeResult:
    """Decode ``job`` within the budget in chunks (Wan's, carried or overlap-blended) or by the host's own decode
    (:func:`.video_flow.run_flow` with :data:`CHUNKED`); returns frames ``(B*T, H, W, C)`` on [0, 1] (as VAEDecode)
    and the report. ``budget_mb``: 0 = free memory (``env.budget``); ``unload_others``: offload upstream models
    first (``env.offload``, VAEs with a patcher). ``t_start``: ``time.perf_counter()`` when planning started.
    ``allow_approximate``: an overlap-blend that measures under :data:`.self_check.FIDELITY_FLOOR_DB` on its first-use
    check may run (else the host's own decode runs, flagged when over budget). Raises
    :class:`.grid.ImpossibleBudgetError` when no plan fits."""
    return run_flow(job, env, CHUNKED, budget_mb=budget_mb, unload_others=unload_others, t_start=t_start,
                    allow_approximate=allow_approximate)


def _geometry(job: VideoJob) -> tuple[int, int, int]:
    frames, r = output_geometry(job)
    return frames, int(job.z.shape[3]) * r, int(job.z.shape[4]) * r


def _plan(job: VideoJob, available: int, env: DecodeEnv, out_bytes: int) -> tuple[Plan, bool]:
    return _plan_batch(job, available, env, env.observed.ratios(job.family, job.dtype, job.device), out_bytes)


def _run(job: VideoJob, p: Plan, per_item: bool, view: torch.Tensor, env: DecodeEnv, ctx: RunContext) -> None:
    """The chunked executors into the output view: Wan's (per batch item when the plan says so), the carried
    chunks', the overlap-blend's (accumulated in the output buffer itself: the plan counts one output)."""
    model, z, c = job.vae.first_stage_model, job.z, p.config
    if p.path == "wan":
        for i in _items(int(z.shape[0]), per_item):
            decode_wan_chunked(
                model, z[i], c.k, c.tile, halo=p.halo, split=c.split, out=view[i], compute_device=job.device,
                dtype=job.dtype, store_device="cpu" if c.store == "host" else None, rollback=c.rollback,
                **ctx.kwargs())
    elif p.path == "carry":
        decode_carried(model, job.carry, z, c.k, out=view, dtype=job.dtype, compute_device=job.device, tile=c.tile,
                       halo=p.halo, rollback=c.rollback, **ctx.kwargs())
    else:
        frames_of, index_formula, _ = blend_ratios(job.vae)
        decode_overlap_blend(blend_fn(job), z, c.k, 1, upscale_ratio=frames_of, index_formula=index_formula,
                             out=view, **ctx.kwargs(fault=False))


def _report(job: VideoJob, plan: Plan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, measured: int | None, method: str, first: FirstUse | None = None) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.path == "host":
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    elif job.one_frame and plan.exact:
        r.add("path", "exact: the mid block on the whole image, the up path in tiles with a halo of its reach (same "
                      "image as VAE Decode)")
    elif job.wan and plan.exact:
        r.add("path", "exact: causal caches carried across chunks (same frames as VAE Decode)")
    elif job.wan:
        r.add("path", f"APPROXIMATE: the chunked executor does not reproduce this host's decoder ({plan.reason})")
    elif plan.path == "carry":
        r.add("path", f"exact: {plan.reason}")
    else:
        r.add("path", f"APPROXIMATE: {plan.reason}")
    model = getattr(getattr(job, "vae", None), "first_stage_model", None)
    if model is not None and not job.wan and getattr(job, "carry", None) is None:
        r.add("structure", f"not described for exact chunks: {type(model).__module__}.{type(model).__qualname__} (the "
                           "host's own decode when it fits, else overlapping chunks measured against it)")
    if job.one_frame:
        r.add("check", plan.reason if plan.path != "host" else "chunked executor not used")
    elif job.wan:
        proto = job.protocol
        how = "carried by the host's blocks" if not proto.restores else "restored by the executor"
        r.add("check", f"cache protocol {proto.name} (history {how}); "
                       f"{plan.reason if plan.path != 'host' else 'chunked executor not used'}")
    if getattr(job, "carry", None) is not None and job.verdict is not None:
        r.add("check", f"carried chunks: {job.verdict.describe()}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.description)
    c = plan.config
    if plan.path == "wan" and int(job.z.shape[2]) == 1:
        store = "" if c.store is None else f"; the whole-frame part stored on the {c.store}"
        r.add("cache", f"none (one frame: no causal cache is read){store}")
    elif plan.path == "wan":
        scope = "whole frame" if c.tile is None else "one tile at a time (tile-major)"
        if c.rollback:
            cache = f"{job.device}, {scope}, committed + next (an OOM resumes from the last chunk)"
        else:
            cache = f"{job.device}, {scope}, in place as ComfyUI (1x; an OOM decodes that tile again from frame 0)"
        if c.store is not None:
            cache += f"; global part of every frame stored on the {c.store}"
        r.add("cache", cache)
    elif plan.path == "carry" and not c.rollback:
        r.add("cache", "carried context spent in place, as the host (1x; an OOM decodes that tile again from its "
                       "first chunk)")
    if job.wan or plan.planned:
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        why = "user setting" if job.wan else f"chunks of {c.k} latent frames"
        if plan.path == "host" and not job.wan:
            why = "the host's whole decode: no chunking applies"
        over = f" - OVER BUDGET ({why})" if plan.over_budget else ""
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, meta sizing){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload and self-check included)"
                           f"{ratio_text(plan.ratio)}")
    else:
        r.add("predicted", "not predicted (meta sizing of the decoder failed; see the log)")
    r.add("measured", measured_text(measured, method))
    flag_measured_overrun(r, measured, method, int(budget.available), log)
    r.add("time", f"{fmt_seconds(seconds)} ({stats.get('chunks', '?')} {'tiles' if job.one_frame else 'chunks'})")
    if first is not None and first.done:
        r.add("first use", first.describe())
    retries = int(stats.get("shrinks") or 0) + int(stats.get("restarts") or 0)
    if retries:
        r.add("oom", f"{stats.get('shrinks', 0)} re-plan(s), {stats.get('restarts', 0)} restart(s): finished with "
                     f"k = {stats.get('frames_per_chunk')}, tile {stats.get('tile')}")
    if plan.path == "host":
        shape = "host decode"
    else:
        n = stats.get("chunks", "?")
        tiled = plan.path in ("wan", "carry") and plan.config.tile is not None
        shape = f"{n} tile-chunks" if tiled else f"{n} chunks"
        if job.one_frame:
            shape = f"{n} tiles" if tiled else "whole image"
    b = int(job.z.shape[0])
    r.summary = summary_line(
        "exact" if plan.path in ("host", "carry") or (job.wan and plan.exact) else "approximate",
        shape + (f" x {b} videos" if b > 1 else ""),
        peak_verdict(measured, method, int(budget.available), plan.planned or None),
        "planned over budget" if plan.over_budget and not (measured or 0) > budget.available else "",
        fmt_seconds(seconds),
        f"{retries} out-of-memory retr{'ies' if retries != 1 else 'y'}" if retries else "",
        first_use_tag(first),
    )
    return r


CHUNKED = VideoPath(geometry=_geometry, plan=_plan, verify=_verify, run=_run, report=_report)
"""The chunked paths (Wan's, carried, overlap-blended) as :func:`.video_flow.run_flow` takes them."""
