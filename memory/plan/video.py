"""Planning a video decode: the chunked Wan executor's candidates sized on fake tensors (or the host's own
decode when the executor failed its self-check), the overlap-blend chunk for other video VAEs; :func:`plan`
picks the path. Sized peaks persist in a :class:`PeakStore`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ..budget import host_refused_text
from ..executors import wan as vc
from ..executors.blend import frame_fn
from ..executors.carry import decode_carried
from ..measure.reach import default_halo
from ..measure.sizing import MetaSizer
from ..report import fmt_bytes
from ..tiles import chunk_ranges, overlap_chunks, spans
from ..vae.carry_layout import CarryLayout
from ..vae.wan_layout import WanLayout
from .grid import ImpossibleBudgetError, scaled
from .split import tail_reach
from .types import Chunking, Plan
from .video_job import (
    REPORT_NODE,
    PeakStore,
    VideoJob,
    blend_fn,
    blend_ratios,
    chunk_frames,
    executor_digest,
    host_fn,
    meta_peak,
    meta_sizes,
    model_key,
    out_bytes,
)

log = logging.getLogger("vramfit.memory.plan.video")

__all__ = ["BLEND_MAX_K", "MAX_AUTO_K", "REPORT_NODE", "PeakStore", "VideoJob", "blend_fn", "blend_ratios",
           "candidates", "chunk_frames", "decode_peak", "executor_digest", "host_decode_plan", "host_fn", "lower_bound",
           "meta_peak", "meta_sizes", "model_key", "out_bytes", "peak_key", "plan", "plan_blend", "plan_host_decode",
           "plan_wan", "size_candidate", "traffic"]

MAX_AUTO_K = 8
"""Largest chunk the auto plan considers (latent frames)."""
CALL_OVERHEAD = {"cuda": 0.3, "cpu": 0.0}
"""Relative cost of one executor call vs one latent frame of work, for the speed order of tile candidates
(GPU: fewer, larger calls assumed to pay, not yet measured for tiles; CPU: measured k = 1 fastest, see
docs/VIDEO_DECODE.md). Whole frames take 0 on every device: on an H200 (2026-11-26, Wan 2.1 bf16, 480p and
720p x 81 frames) whole frames at k = 8 took 1.22x / 1.00x the time of ComfyUI's own decode (one latent
frame per call) and 6.3x its memory (docs/BENCHMARKS.md "GPU results")."""
IMPOSSIBLE_SIZINGS = 4
"""Candidates sized (beyond those the plan sized) for the message when no plan fits."""
BLEND_MAX_K = 4
"""Largest chunk the auto plan of the overlap-blend path (other video VAEs) considers (latent frames)."""


# --------------------------------------------------------------------------------------------------
# Planning (Wan)


def describe(c: Chunking, halo: int) -> str:
    """The report's ``plan`` row of the chunked executor."""
    if c.tile is None:
        tiles = "whole frames"
    else:
        tiles = (f"tile-major: {c.grid[0]}x{c.grid[1]} tiles of {c.tile[0]}x{c.tile[1]} latent px "
                 f"(halo {halo}, split {c.split}, store on {c.store})")
    return f"k = {c.k} latent frames/chunk (frame 0 alone), {tiles}"


def clip_out_bytes(job: VideoJob) -> tuple[int, int]:
    """``(buffer, post)``: the node's output buffer for the whole clip (:func:`out_bytes`, non-Wan geometry) and the
    floor of its post-processing (``process_output`` per output frame: two float32 temporaries)."""
    b, _, _, h, w = (int(v) for v in job.z.shape)
    frames, r = output_geometry(job)
    return out_bytes(job, frames, h * r, w * r), 2 * b * job.out_channels * h * w * r * r * 4


def _t_meta(t: int, k: int) -> int:
    return min(t, 1 + 2 * k)


def peak_key(job: VideoJob, cd: Chunking, fingerprint: str | None = None) -> str:
    """Key of a sized peak: :func:`model_key`, latent shape (frames as sized) and candidate."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    tile = "whole" if cd.tile is None else f"{cd.tile[0]}x{cd.tile[1]}"
    return (f"{model_key(job, fingerprint)}/{b}x{c}x{_t_meta(t, cd.k)}x{h}x{w}"
            f"/k{cd.k}/{tile}/split{cd.split}/{'rollback' if cd.rollback else 'inplace'}"
            f"/{'host' if cd.store == 'host' else 'device'}")


def size_candidate(job: VideoJob, cd: Chunking, phases: dict | None = None) -> int:
    """Meta-sized peak bytes of ``decode_wan_chunked`` for this candidate at ``min(T, 1 + 2 k)`` latent
    frames, without the output buffer (the store's growth with ``T`` is added by :func:`decode_peak`). Sized
    under ``torch.inference_mode``, as ComfyUI runs the node (a persisted peak holds in any caller's mode:
    the executor allocates the same either way, see docs/VIDEO_DECODE.md). ``phases``: for tiles, filled with
    ``store``: the peak of phase 1 alone (the global part into the store), which no tile size changes."""
    model = job.vae.first_stage_model
    lay = job.layout
    b, c, t, h, w = (int(v) for v in job.z.shape)
    t_meta = _t_meta(t, cd.k)
    out_b = b * lay.out_channels * lay.out_frames(t_meta) * h * w * lay.spatial_ratio**2 * 4
    with torch.inference_mode(), MetaSizer([model], job.dtype, job.device) as sizer:  # as ComfyUI runs nodes
        zf = torch.empty((b, c, t_meta, h, w), dtype=job.dtype, device=job.device)

        def mark(phase: str) -> None:
            if phases is not None:
                phases[phase] = max(0, sizer.peak_so_far - out_b)

        out = vc.decode_wan_chunked(model, zf, cd.k, cd.tile, halo=None, split=cd.split, compute_device=job.device,
                                    dtype=job.dtype, store_device="cpu" if cd.store == "host" else None,
                                    out_device=job.device, rollback=cd.rollback, sizing=True, phase_hook=mark)
        del out, zf
    return max(0, int(sizer.peak_bytes) - out_b)


def _store_growth(job: VideoJob, lay: WanLayout, cd: Chunking) -> int:
    if cd.store != "device":
        return 0
    b, _, t, h, w = (int(v) for v in job.z.shape)
    item = torch.empty((), dtype=job.dtype).element_size()
    return lay.store_bytes(h, w, t, b, item, cd.split) - lay.store_bytes(h, w, _t_meta(t, cd.k), b, item, cd.split)


def lower_bound(job: VideoJob, lay: WanLayout, cd: Chunking) -> int:
    """A lower bound of :func:`decode_peak` without sizing: the latent (as sized), a device store of every
    frame and one tile's committed caches (the largest tile's extended region; whole frames: every cache),
    ``min(2, T)`` frames per cached conv (temporal upsample states left out; none for a one-frame clip, which
    runs without caches), all alive together at the end of each tile's last chunk."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    item = torch.empty((), dtype=job.dtype).element_size()
    t_meta = _t_meta(t, cd.k)
    first = 0 if cd.tile is None else lay.split_info(cd.split).first_slot
    frames = min(2, t_meta) if t > 1 else 0
    cache = _ext_area(lay, h, w, cd) * sum(s.channels * frames * s.scale**2 for s in lay.slots
                                           if s.index >= first and s.kind == "conv")
    store = 0 if cd.store != "device" else lay.store_bytes(h, w, t, b, item, cd.split)
    return int(b * c * t_meta * h * w * item + cache * b * item + store)


def decode_peak(job: VideoJob, lay: WanLayout, cd: Chunking, peaks: PeakStore, fingerprint: str,
                sized: list[int] | None = None) -> int:
    """Peak bytes of the decode (without the output buffer) for the whole clip: the stored or sized peak
    plus the store's growth with ``T``."""
    return decode_peaks(job, lay, cd, peaks, fingerprint, sized)[0]


def decode_peaks(job: VideoJob, lay: WanLayout, cd: Chunking, peaks: PeakStore, fingerprint: str,
                 sized: list[int] | None = None) -> tuple[int, int | None]:
    """``(peak, phase 1's peak)`` of :func:`decode_peak`, both for the whole clip (the store's growth with
    ``T`` added); phase 1 None for whole frames (one phase) and for a peak stored before phase 1 was kept."""
    key = peak_key(job, cd, fingerprint)
    peak, store = peaks.get(key), peaks.get(key + "/phase1") if cd.tile is not None else None
    if peak is None:
        phases: dict = {}
        peak = size_candidate(job, cd, phases)
        peaks.put(key, peak, write=False)
        store = phases.get("store")
        if store is not None:
            peaks.put(key + "/phase1", store, write=False)
        if sized is not None:
            sized.append(1)
    growth = _store_growth(job, lay, cd)
    return peak + growth, None if store is None else store + growth


def _ext_area(lay: WanLayout, h: int, w: int, cd: Chunking) -> int:
    """Latent px of the largest extended tile of ``cd`` (whole frames: the frame)."""
    if cd.tile is None:
        return h * w
    halo = lay.split_info(cd.split).halo
    return (max(e1 - e0 for *_, e0, e1 in spans(h, cd.tile[0], halo))
            * max(e1 - e0 for *_, e0, e1 in spans(w, cd.tile[1], halo)))


def scaled_bound(f: Chunking, peak: int, phase1: int | None, cd: Chunking, areas: tuple[int, int]) -> int:
    """A lower bound of ``cd``'s peak from the sized ``f`` (``peak``; ``phase1``: its phase 1 alone), 0 when
    none follows. Every tensor alive at a peak holds a fixed number of frames or a number proportional to
    ``k``, over a fixed area or one proportional to the extended tile's (``areas``: ``f``'s, ``cd``'s), so a
    peak is a max of sums of non-negative terms ``c k^i a^j`` (i, j in 0, 1): scaling ``k`` and the area down
    by ``m_k``, ``m_a`` <= 1 leaves at least ``m_k m_a`` of it; phase 1 does not depend on the tiles. Holds
    for ``cd`` of the same split and kind (tiles or whole frames), no larger ``k`` (the chunks' count changes
    with ``k``: on a tiny Wan 2.1 two-frame chunks peaked above four-frame ones,
    tests/host/test_video_chunked_tiny.py) and no less cache (rollback) or device store."""
    if (cd.tile is None) != (f.tile is None) or cd.split != f.split or cd.k > f.k:
        return 0
    if cd.rollback < f.rollback or (cd.store == "host" and f.store != "host"):
        return 0
    mk = min(1.0, cd.k / f.k)
    bound = peak * mk * min(1.0, areas[1] / areas[0])
    if phase1 is not None and cd.tile is not None:
        bound = max(bound, phase1 * mk)
    return int(bound)


def traffic(job: VideoJob, cd: Chunking) -> dict:
    """What the chunked executor's plan ``cd`` does besides computing, without running it: ``calls`` (decoder
    calls: one per phase-1 chunk and per tile-chunk; whole frames: one per chunk) and ``moves``, ``{route:
    (copies, bytes)}`` as the executor counts them (``stats["moves"]``, :meth:`.executors.wan._WanRun._moved`):
    ``latent`` (each chunk's latent frames to the compute device, ``job.z``'s dtype), ``output`` (each
    tile-chunk's core frames, float32, in :func:`.executors.wan.output_pieces`), ``store_write`` (phase 1's
    output into the store, the VAE's dtype, in pieces likewise) and, for a store on the host of an accelerator, ``store_read`` (each tile-chunk's window of the store). An OOM
    re-plan adds to these. On an accelerator with ComfyUI's placement (latent and output on the host) every
    route but a device store's crosses between host and device."""
    lay = job.layout
    b, c, t, h, w = (int(v) for v in job.z.shape)
    chunks = chunk_ranges(t, cd.k)
    zi = job.z.element_size()
    out = b * lay.out_channels * lay.out_frames(t) * h * w * lay.spatial_ratio**2 * 4
    latent = (len(chunks), b * c * t * h * w * zi)
    dec = job.vae.first_stage_model.decoder
    pieces = sum(vc.output_pieces(dec, lay.chunk_out_frames(s1 - s0, s0 == 0)) for s0, s1 in chunks)
    if cd.tile is None:
        return {"calls": len(chunks), "moves": {"latent": latent, "output": (pieces, out)}}
    si = lay.split_info(cd.split)
    ys, xs = spans(h, cd.tile[0], si.halo), spans(w, cd.tile[1], si.halo)
    tiles = len(ys) * len(xs)
    item = torch.empty((), dtype=job.dtype).element_size()
    f = si.frame_factor
    writes = sum(vc.output_pieces(dec, 1 if s0 == 0 else f * (s1 - s0), cd.split) for s0, s1 in chunks)
    moves = {"latent": latent, "store_write": (writes, lay.store_bytes(h, w, t, b, item, cd.split)),
             "output": (tiles * pieces, out)}
    if cd.store == "host" and job.device.type != "cpu":
        ext = sum(e1 - e0 for *_, e0, e1 in ys) * sum(e1 - e0 for *_, e0, e1 in xs)
        moves["store_read"] = (tiles * len(chunks),
                               b * si.channels * lay.store_frames(t, cd.split) * ext * si.scale**2 * item)
    return {"calls": len(chunks) * (tiles + 1), "moves": moves}


def _grids(h: int, w: int, tile: tuple[int, int] | None) -> list[tuple[tuple[int, int] | None, tuple[int, int]]]:
    if tile is not None:
        th, tw = min(h, tile[0]), min(w, tile[1])
        if (th, tw) == (h, w):
            return [(None, (1, 1))]
        return [((th, tw), (math.ceil(h / th), math.ceil(w / tw)))]
    out: list[tuple[tuple[int, int] | None, tuple[int, int]]] = [(None, (1, 1))]
    seen = set()
    for n in range(2, max(h, w) + 1):
        th, tw = math.ceil(h / min(n, h)), math.ceil(w / min(n, w))
        if (th, tw) in seen or (th, tw) == (h, w):
            continue
        seen.add((th, tw))
        out.append(((th, tw), (math.ceil(h / th), math.ceil(w / tw))))
    return out


def area_factor(h: int, w: int, tile: tuple[int, int] | None, halo: int) -> float:
    """Latent px the tiled part computes (cores + halos, clipped at the frame) per frame px."""
    if tile is None:
        return 1.0
    ys = sum(e1 - e0 for _, _, e0, e1 in spans(h, tile[0], halo))
    xs = sum(e1 - e0 for _, _, e0, e1 in spans(w, tile[1], halo))
    return ys * xs / (h * w)


def _split_options(lay: WanLayout, one_frame: bool = False) -> list[int]:
    """Split points for tiles: the default (scale 2, small halo) and the last one at latent scale (a store
    of 1/8 the size, larger halo); none whose tiled part holds a global op. A one-frame clip (its store is one
    frame): every split below the head's scale (a later split's halo is smaller, its whole-frame part larger)."""
    at_latent = max(s.split for s in lay.splits if s.scale == 1)
    opts = [lay.default_split] + ([at_latent] if at_latent != lay.default_split else [])
    if one_frame:
        opts = [s.split for s in lay.splits if s.scale < lay.decoder_ratio]
    return [s for s in opts if not (lay.tiled_global_ops and s == 0)]


def candidates(job: VideoJob, k_user: int, tile_user: tuple[int, int] | None, tiled: bool = True) -> list[Chunking]:
    """Every candidate in the speed order the planner tries them (fastest first; among equals the one that needs
    the least: the context spent in place, the store in host memory; :func:`plan_wan` then tries the fitting
    one's twins with the rollback cache and the device store; then the smaller k); ``tiled`` False: whole frames
    only."""
    lay = job.layout
    _, _, t, h, w = (int(v) for v in job.z.shape)
    rest = max(1, t - 1)
    ks = [min(k_user, rest)] if k_user else list(range(1, min(rest, MAX_AUTO_K) + 1))
    c_tiles = CALL_OVERHEAD.get(job.device.type, 0.3)
    hosts = (False, True) if job.device.type != "cpu" else (False,)
    cands = []
    for tile, grid in _grids(h, w, tile_user) if tiled else [(None, (1, 1))]:
        for split in [lay.default_split] if tile is None else _split_options(lay, t == 1):
            area = area_factor(h, w, tile, lay.split_info(split).halo)
            for host in (False,) if tile is None else [x for x in hosts if not x or host_store_fits(job, split)]:
                for k in ks:
                    c = 0.0 if tile is None else c_tiles
                    speed = area * (1 + c / k) * (1 + 1e-3 * k)
                    for rollback in (True,) if t == 1 else (True, False):  # one frame: no cache to keep
                        store = None if tile is None else ("host" if host else "device")
                        cands.append((speed, rollback, not host, k, Chunking(k, tile, grid, split, rollback, store)))
    cands.sort(key=lambda e: e[:4])
    return [e[4] for e in cands]


def host_store_bytes(job: VideoJob, split: int) -> int:
    """Bytes of the Wan store of the whole clip at ``split`` (what a store in host memory holds)."""
    b, _, t, h, w = (int(v) for v in job.z.shape)
    return job.layout.store_bytes(h, w, t, b, torch.empty((), dtype=job.dtype).element_size(), split)


def host_store_fits(job: VideoJob, split: int) -> bool:
    """Whether the store in host memory at ``split`` fits :attr:`VideoJob.host_room` (None: unbounded)."""
    return job.host_room is None or host_store_bytes(job, split) <= job.host_room


def host_store_note(job: VideoJob, cd: Chunking) -> str:
    """The plan row's words when the store in host memory was left out for the host's RAM (tiles on the device)."""
    if cd.tile is None or cd.store != "device" or job.device.type == "cpu" or host_store_fits(job, cd.split):
        return ""
    return host_refused_text(host_store_bytes(job, cd.split), job.host_room)


def _better_twin(p: Plan, size: Callable[[Chunking], Plan], budget: int) -> Plan:
    """``p`` (it fits) or its twin that fits with more: first the rollback cache (an OOM resumes the tile rather
    than its first chunk), then the store on the device (no copies of its windows from host memory)."""
    cd = p.config
    if not cd.rollback:
        twin = size(dataclasses.replace(cd, rollback=True))
        if twin.planned <= budget:
            p, cd = twin, twin.config
    if cd.store == "host":
        twin = size(dataclasses.replace(cd, store="device"))
        if twin.planned <= budget:
            p = twin
    return p


def plan_wan(job: VideoJob, budget: int, k_user: int, tile_user: tuple[int, int] | None,
             peaks: PeakStore | None = None, stats: dict | None = None, tiled: bool = True) -> Plan:
    """The fastest plan whose predicted peak fits ``budget``: :func:`candidates` in speed order, each skipped
    when it needs at least the memory of one that failed (:meth:`.types.Chunking.needs_more_than`) or when its
    :func:`lower_bound` exceeds the budget, else sized (:func:`decode_peak`). With a user ``k`` or tile and
    nothing fitting: the smallest plan, marked over budget; otherwise :class:`ImpossibleBudgetError`.
    ``stats``: filled with ``sized`` (candidates meta-sized now), ``bounded`` (skipped by the lower bound).
    ``tiled`` False: whole frames only."""
    peaks = PeakStore() if peaks is None else peaks
    lay = job.layout
    fingerprint = job.fingerprint
    _, _, t, h, w = (int(v) for v in job.z.shape)
    out_b = out_bytes(job, lay.out_frames(t), h * lay.spatial_ratio, w * lay.spatial_ratio)
    # process_output per output frame: two float32 temporaries of one frame
    post = 2 * int(job.z.shape[0]) * lay.out_channels * h * w * lay.spatial_ratio**2 * 4
    sized: list[int] = []
    bounded = 0

    def make(cd: Chunking, dec: int) -> Plan:
        halo = lay.split_info(cd.split).halo
        return Plan("wan", cd, describe(cd, halo) + host_store_note(job, cd), out_b + max(dec, post), halo=halo)

    found: Plan | None = None
    failed: list[Chunking] = []
    over: list[tuple[Chunking, int, int | None, int]] = []  # sized and over: (candidate, peak, phase 1, area)
    # On a host whose caches the executor restores (0.33's Wan 2.1), one-frame chunks hold the old cache
    # entries beside the new ones: k = 1 failing says nothing about larger k.
    restores = job.protocol.restores
    known: list[tuple[int, bool, Chunking]] = []  # (planned or its lower bound, exact, candidate)
    scaled = 0
    try:
        for cd in candidates(job, k_user, tile_user, tiled):
            if any(cd.needs_more_than(f) and not (restores and f.k == 1 < cd.k) for f in failed):
                continue
            area = _ext_area(lay, h, w, cd)
            low = max((out_b + scaled_bound(f, pk, p1, cd, (fa, area)) for f, pk, p1, fa in over), default=0)
            if low > budget:  # a lower bound only: the message's floor counts it, sizing it first when it is least
                scaled += 1
                known.append((low, False, cd))
                continue
            low = out_b + max(lower_bound(job, lay, cd), post)
            if low > budget:
                bounded += 1
                failed.append(cd)
                known.append((low, False, cd))
                continue
            peak, phase1 = decode_peaks(job, lay, cd, peaks, fingerprint, sized)
            p = make(cd, peak)
            if p.planned <= budget:
                found = _better_twin(p, lambda c: make(c, decode_peak(job, lay, c, peaks, fingerprint, sized)),
                                     budget)
                break
            failed.append(cd)
            known.append((p.planned, True, cd))
            over.append((cd, peak, phase1, area))
        if found is None:
            # Size lower-bounded candidates, smallest bound first, until a sized one is below every bound: the
            # smallest plan (run over budget with a user k / tile: few candidates); for the message of an
            # impossible budget at most IMPOSSIBLE_SIZINGS more.
            cap = None if (tile_user is not None or k_user) else IMPOSSIBLE_SIZINGS
            known.sort(key=lambda e: e[0])
            while not known[0][1] and (cap is None or cap > 0):
                cd = known[0][2]
                known[0] = (make(cd, decode_peak(job, lay, cd, peaks, fingerprint, sized)).planned, True, cd)
                known.sort(key=lambda e: e[0])
                cap = None if cap is None else cap - 1
            floor = known[0][0]
            cd = min((e for e in known if e[1]), key=lambda e: e[0], default=known[0])[2]
            found = make(cd, decode_peak(job, lay, cd, peaks, fingerprint, sized))
            found.over_budget = True
    finally:
        peaks.flush()
        if stats is not None:
            stats.update(sized=len(sized), bounded=bounded, scaled=scaled)
    if found.over_budget and tile_user is None and not k_user:
        raise ImpossibleBudgetError(
            f"no plan fits the budget of {fmt_bytes(budget)}: every plan needs at least {fmt_bytes(floor)}; the "
            f"smallest found ({found.description}) needs {fmt_bytes(found.planned)}; raise budget_mb or free memory",
            budget, floor)
    return found


# --------------------------------------------------------------------------------------------------
# The host's own decode (the exact fallback)


HOST_DECODE = "the host's own decode (first_stage_model.decode, as VAE Decode), one batch item at a time"


def host_plan(t: int, planned: int, reason: str, over_budget: bool = False) -> Plan:
    """The host's own decode of a ``t``-frame latent as a plan (exact by construction; ``reason``: why it is taken)."""
    return Plan("host", Chunking(max(1, t - 1)), HOST_DECODE, planned, over_budget=over_budget, reason=reason)


def host_decode_peak(job: VideoJob, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of the host's own decode of one batch item at the full clip length, its own
    output included (persisted in ``peaks``); the node's output buffer comes on top."""
    _, c, t, h, w = (int(v) for v in job.z.shape)
    four_d = "/4d" if job.one_frame else ""
    return peaks.get_or_make(f"{model_key(job)}/1x{c}x{t}x{h}x{w}/host-decode{four_d}", lambda: meta_peak(
        job, lambda: host_fn(job)(torch.empty((1, c, t, h, w), dtype=job.dtype, device=job.device))))


def plan_host_decode(job: VideoJob, budget: int, peaks: PeakStore, reason: str) -> Plan | None:
    """The host's own decode (exact by construction), if its peak (+ the output buffer) fits ``budget``; else
    None. Taken when the chunked executor failed its self-check (Wan; ``reason``: the verdict) and, for other
    video VAEs, before any overlap-blend (``reason``: it fits)."""
    t = int(job.z.shape[2])
    planned = clip_out_bytes(job)[0] + host_decode_peak(job, peaks)
    if planned > budget:
        return None
    return host_plan(t, planned, reason)


# --------------------------------------------------------------------------------------------------
# Planning (other video VAEs: overlap-blend)


def output_geometry(job: VideoJob) -> tuple[int, int]:
    """``(output frames, spatial ratio)`` of ``job``'s decode: the Wan layout's, else the frames of the host's
    own decode (:func:`chunk_frames`: CogVideoX's gives ``4 T`` for an even ``T``, its ``upscale_ratio``
    ``4 T - 3``) and the VAE's spatial ``upscale_ratio`` (:func:`blend_ratios`)."""
    t = int(job.z.shape[2])
    if job.wan:
        return job.layout.out_frames(t), job.layout.spatial_ratio
    return chunk_frames(job, t), blend_ratios(job.vae)[2]


def output_frames(job: VideoJob, t: int) -> int:
    """Frames of ``t`` latent frames by a non-Wan VAE's frame formula (``upscale_ratio``)."""
    return frame_fn(blend_ratios(job.vae)[0])(t)


def blend_chunk_peak(job: VideoJob, k: int, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of one chunk of ``min(k, T)`` latent frames (its float32 frames included),
    persisted in ``peaks``."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    kk = min(int(k), t)
    return peaks.get_or_make(f"{model_key(job)}/{b}x{c}x{kk}x{h}x{w}/blend", lambda: meta_peak(
        job, lambda: blend_fn(job)(torch.empty((b, c, kk, h, w), dtype=job.dtype, device=job.device))), write=False)


CARRY_MAX_K = 8
"""Largest chunk the auto plan of the carried-context path considers (latent frames)."""
FLAGGED_SAVING = 0.95
"""When no carried plan fits, the flagged one is the fastest whose bytes are within 1 / this of the least a plan
can hold (smaller chunks and tiles cost time; a plan that saves under 5 % is not worth it)."""


def carry_halo(model: Any, layout: CarryLayout, channels: int, dtype: torch.dtype, device: torch.device) -> int:
    """Halo (px of the chunks' input) covering the reach of a carried family's chunk, traced once per structure
    on fake tensors (:func:`.split.tail_reach`: the description's prefix, then one first chunk of 2 frames; 16 px
    so that a convolution padded by its caller rounds to its true scale)."""
    desc = layout.description

    def prefix(z: torch.Tensor) -> torch.Tensor:
        return desc.prefix(model, z) if desc.prefix is not None else z

    report = tail_reach(model, prefix, lambda x: desc.chunk(model, x, {"first": True}), (1, channels, 2, 16, 16),
                        dtype, device)[2]
    return default_halo(report)


def _job_halo(job: VideoJob) -> int:
    return carry_halo(job.vae.first_stage_model, job.carry, int(job.z.shape[1]), job.dtype, job.device)


def carry_chunk_peak(job: VideoJob, k: int, peaks: PeakStore, tile: tuple[int, int] | None = None,
                     rollback: bool = True) -> int:
    """Meta-sized peak bytes of the carried-context executor, the output buffer left out: frame 0 and one chunk
    of ``k`` latent frames, or the whole clip for a family with a prefix (run on the whole latent); ``tile``:
    spatial tiles (latent px) with :func:`carry_halo`; ``rollback`` False: the context spent in place. Persisted
    in ``peaks``."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    desc = job.carry.description
    kk = desc.fit(min(int(k), t - 1))
    sized = t if desc.prefix is not None else min(t, 1 + kk)
    halo = _job_halo(job) if tile is not None else 0
    key = (f"{model_key(job)}/{c}x{kk}x{h}x{w}/carry2" + (f"/t{t}" if desc.prefix is not None else "")
           + (f"/tile{tile[0]}x{tile[1]}+{halo}" if tile is not None else "") + ("" if rollback else "/inplace"))
    peak = peaks.get(key)
    if peak is None:
        n, r = chunk_frames(job, sized), blend_ratios(job.vae)[2]
        model = job.vae.first_stage_model
        with torch.inference_mode(), MetaSizer([model], job.dtype, job.device) as sizer:
            z = torch.empty((1, c, sized, h, w), dtype=job.dtype, device=job.device)
            out = torch.empty((1, job.out_channels, n, h * r, w * r), dtype=torch.float32, device=job.device)
            decode_carried(model, job.carry, z, kk, out=out, dtype=job.dtype, compute_device=job.device,
                           tile=tile, halo=halo, rollback=rollback, sizing=True)
            out_b = out.numel() * out.element_size()
            del out, z
        peak = int(sizer.peak_bytes) - out_b
        peaks.put(key, peak, write=False)
    return peak


def carry_floor(job: VideoJob, peaks: PeakStore) -> int:
    """Bytes every carried plan holds at least: the output buffer, plus the meta-sized peak of the description's
    prefix on the whole latent (the first thing the executor runs). Persisted in ``peaks``."""
    _, c, t, h, w = (int(v) for v in job.z.shape)
    desc = job.carry.description
    floor = clip_out_bytes(job)[0]
    if desc.prefix is None:
        return floor
    model = job.vae.first_stage_model
    return floor + peaks.get_or_make(f"{model_key(job)}/{c}x{t}x{h}x{w}/carry-prefix", lambda: meta_peak(
        job, lambda: desc.prefix(model, torch.empty((1, c, t, h, w), dtype=job.dtype, device=job.device))),
        write=False)


def carry_planned(job: VideoJob, k: int, peaks: PeakStore, tile: tuple[int, int] | None = None,
                  rollback: bool = True) -> int:
    """Planned bytes of carried chunks: the output buffer plus :func:`carry_chunk_peak`, at least the output's
    post-processing (two float32 temporaries per frame)."""
    out_b, post = clip_out_bytes(job)
    return out_b + max(carry_chunk_peak(job, k, peaks, tile, rollback), post)


def _carry_tiles(h: int, w: int) -> list[tuple[int, int]]:
    """Tile cores (latent px) the auto plan tries, largest first: 2 to 16 tiles per side, at least 2 px."""
    sides = sorted({max(2, math.ceil(max(h, w) / n)) for n in range(2, 17)}, reverse=True)
    return [(min(s, h), min(s, w)) for s in sides if s < max(h, w)]


def plan_carry(job: VideoJob, budget: int, k_user: int, peaks: PeakStore) -> Plan | None:
    """Carried-context chunks (exact): the largest ``k`` (at most :data:`CARRY_MAX_K`, or the user's) whose
    meta-sized peak plus the output buffer fits ``budget``, whole frames (each ``k`` with the context kept for
    a rollback, then spent in place); then, for a family whose chunks are spatially local, the smallest ``k`` in
    the largest tiles that fit (or the user's ``tile_size``; auto tiles at least as wide as the halo, and only
    where the halo leaves part of the frame out); when none does, flagged, the first of them in that order within
    1 / :data:`FLAGGED_SAVING` of the smallest's bytes (smaller chunks and tiles cost time). None when the
    executor cannot be meta-sized (logged: the caller blends).

    Each candidate is one meta run of the executor (for a family with a prefix, on the whole clip), so the
    search leans on the peak growing with ``k``, with the tile and with a kept context: the preferred candidate
    first (the common case: one run); then :func:`carry_floor`, under every plan (when it does not fit, the
    first whole-frame plan near it, if one is, without sizing a tile); then the smallest (when it does not fit,
    nothing does); then a bisection of whole frames and of tiles: a few runs where a linear search took up to
    ~40."""
    _, _, t, h, w = (int(v) for v in job.z.shape)
    desc = job.carry.description
    if not desc.temporal:
        ks = [t]
    elif k_user:
        ks = [desc.fit(k_user)]
    else:
        ks = sorted({desc.fit(k) for k in range(desc.min_k, min(t - 1, CARRY_MAX_K) + 1)} or {desc.min_k},
                    reverse=True)
    reason = (f"carried-context chunks: {desc.how} ({job.carry.family}; equal to the host's decode up to float "
              f"rounding)")
    alone = " (frame 0 alone)" if desc.first_alone and desc.temporal else ""
    user = max(1, int(job.tile_size) // output_geometry(job)[1]) if job.tile_size and desc.tiles else 0
    first = (min(user, h), min(user, w)) if user else None

    @functools.cache
    def tiles() -> list[tuple[int, int] | None]:
        """The user's tile, or whole frames; then (a family with tiles, auto) the tiles at least as wide as the
        halo (a tile reads at most 9x what it writes) whose halo leaves part of the frame out (the others hold
        what whole frames hold). Traced on first use."""
        if user or not desc.tiles:
            return [first]
        halo = _job_halo(job)
        return [None, *(tl for tl in _carry_tiles(h, w)
                        if max(tl) >= halo and (tl[0] + 2 * halo < h or tl[1] + 2 * halo < w))]

    modes = (True, False) if desc.temporal else (True,)
    sized: dict[tuple, Plan] = {}

    def cand(k: int, tile: tuple[int, int] | None, rollback: bool) -> Plan:
        if (k, tile, rollback) not in sized:
            halo = _job_halo(job) if tile is not None else 0
            where = "whole frames" if tile is None else f"{tile[0]}x{tile[1]} latent px tiles (halo {halo})"
            cache = "" if rollback else ", context carried in place"
            sized[k, tile, rollback] = Plan("carry", Chunking(k, tile, rollback=rollback),
                                            f"k = {k} {desc.unit}/chunk{alone}, {where}{cache}",
                                            carry_planned(job, k, peaks, tile, rollback), reason=reason, halo=halo)
        return sized[k, tile, rollback]

    def first_fit(seq: list[tuple[int, tuple[int, int] | None]], limit: float) -> Plan | None:
        """The first of ``seq`` (preference order, peaks falling) within ``limit`` bytes, kept context before in
        place."""

        def ok(i: int) -> bool:
            return cand(*seq[i], modes[-1]).planned <= limit  # cand sizes each candidate once

        if not seq or not ok(len(seq) - 1):
            return None
        lo, hi = 0, len(seq) - 1  # ok(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
        return next(p for p in (cand(*seq[lo], m) for m in modes) if p.planned <= limit)

    def search(limit: float, tiled: bool = True) -> Plan | None:
        """The first candidate within ``limit``: whole frames, then (``tiled``) tiles."""
        found = first_fit([(k, None) for k in ks] if first is None else [], limit)
        if found is None and tiled:
            found = first_fit([(ks[-1], tile) for tile in tiles() if tile is not None], limit)
        return found

    def flagged(p: Plan | None) -> Plan | None:
        if p is not None:
            p.over_budget = True
        return p

    try:
        best = cand(ks[0] if first is None else ks[-1], first, True)  # tiles take the smallest k
        if best.planned <= budget:
            return best
        floor = carry_floor(job, peaks)  # under every plan: when it does not fit, nothing does
        if floor > budget:  # the fastest plan within FLAGGED_SAVING of the floor, if whole frames hold one
            found = flagged(search(floor / FLAGGED_SAVING, tiled=False))
            if found is not None:
                return found
        smallest = cand(ks[-1], tiles()[-1], modes[-1])
        if smallest.planned > budget:  # nothing fits: the fastest plan within FLAGGED_SAVING of the smallest
            return flagged(search(smallest.planned / FLAGGED_SAVING))
        return search(budget)
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: not planned this way
        log.warning("meta sizing of carried chunks of %s failed (%s: %s)", job.family, type(e).__name__, e)
        return None
    finally:
        peaks.flush()


def off_formula(job: VideoJob, k: int) -> str | None:
    """Why chunks of ``k`` latent frames cannot be placed by the VAE's frame formula (``upscale_ratio``), or
    None: every chunk length of the plan must decode to the formula's frame count (CogVideoX's decoder gives
    ``4 l`` frames for an even ``l``, not ``4 l - 3``)."""
    t = int(job.z.shape[2])
    got, want = chunk_frames(job, t), output_frames(job, t)
    if got != want:
        return f"the clip's {t} latent frames decode to {got} frames, not the {want} of the VAE's frame formula"
    for length in sorted({b - a for a, b in overlap_chunks(t, k, 1)}):
        want = output_frames(job, length)
        got = chunk_frames(job, length)
        if got != want:
            return (f"a chunk of {length} latent frames decodes to {got} frames, not the {want} of the VAE's "
                    "frame formula")
    return None


def plan_blend(job: VideoJob, budget: int, k_user: int, peaks: PeakStore) -> Plan:
    """The largest chunk (at most :data:`BLEND_MAX_K`, or the user's ``k``) whose meta-sized peak plus the
    output buffer fits ``budget``; the smallest, marked over budget, when none does. When meta sizing
    fails: the largest chunk, not predicted (``planned`` 0). Chunk sizes whose chunks do not decode to the
    VAE's frame formula (:func:`off_formula`) are skipped; when none is left, the host's own decode (exact),
    flagged when over budget."""
    t = int(job.z.shape[2])
    out_b, post = clip_out_bytes(job)
    ks = [max(2, k_user)] if k_user else list(range(max(2, min(t, BLEND_MAX_K)), 1, -1))
    why_not = job.carry_why or ("the carried chunks failed their self-check on this host" if job.carry is not None
                                else "no exact path for this VAE")
    reason = f"overlapping temporal chunks decoded independently and cross-faded (no exact chunks: {why_not})"
    plan = None
    try:
        why = {k: off_formula(job, k) for k in ks}
        if all(why.values()):
            planned = out_b + host_decode_peak(job, peaks)
            return host_plan(t, planned, f"overlap-blend chunks do not apply ({why[ks[0]]})",
                             over_budget=planned > budget)
        ks = [k for k in ks if not why[k]]
        for k in ks:
            plan = Plan("blend", Chunking(k), f"k = {k} latent frames/chunk, overlap 1",
                        out_b + max(blend_chunk_peak(job, k, peaks), post), exact=False, reason=reason)
            if plan.planned <= budget:
                return plan
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: the chunk is not predicted
        log.warning("meta sizing of %s failed (%s: %s); chunk not predicted", job.family, type(e).__name__, e)
        return Plan("blend", Chunking(ks[0]), f"k = {ks[0]} latent frames/chunk, overlap 1", 0, exact=False,
                    reason=reason)
    finally:
        peaks.flush()
    assert plan is not None
    plan.over_budget = True
    return plan


def _host_if_sized(job: VideoJob, budget: int, peaks: PeakStore, reason: str) -> Plan | None:
    """:func:`plan_host_decode`, or None when the host's decode cannot be meta-sized (logged)."""
    try:
        return plan_host_decode(job, budget, peaks, reason)
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: no prediction, so not this plan
        log.warning("meta sizing of %s's own decode failed (%s: %s)", job.family, type(e).__name__, e)
        return None


def host_decode_plan(job: VideoJob, peaks: PeakStore, reason: str) -> Plan:
    """The host's own decode as a plan at any budget (``reason`` why it runs): its meta-sized peak, or not predicted
    (0) when its decode cannot be meta-sized (logged)."""
    return _host_if_sized(job, 1 << 62, peaks, reason) or host_plan(int(job.z.shape[2]), 0, reason)


# --------------------------------------------------------------------------------------------------
# The entry


def plan(job: VideoJob, budget: int, peaks: PeakStore | None = None,
         ratio: Callable[[str], float] | None = None) -> Plan:
    """The plan of ``job`` within ``budget`` bytes, its peaks sized on fake tensors (kept in ``peaks``). Wan:
    when the chunked executor failed its self-check (``job.verdict``) and the user set neither chunk nor tile,
    the host's own decode if it fits; else :func:`plan_wan`, exact as the verdict says (no verdict: exact by
    construction). With neither set and the host's own decode within the budget: whole-frame chunks within that
    decode's meta-sized peak (never hungrier than VAE Decode; chunks for progress, Cancel and OOM resume only
    at no more memory), else the host's decode itself (tiles would be slower). Other video VAEs: the host's
    own decode when it fits and the user set neither chunk nor (for a family with tiles) tile (exact), else
    carried-context chunks
    (:func:`plan_carry`, causal decoders that passed their check), else :func:`plan_blend`. ``ratio(path)``:
    the measured over predicted peak learned for a path on this machine (:mod:`..cost.observed`): that path
    plans against ``budget / ratio``."""
    peaks = PeakStore() if peaks is None else peaks
    r = ratio or (lambda path: 1.0)
    k_user, verdict = int(job.frames_per_chunk), job.verdict
    failed = verdict is not None and not verdict.ok
    if not job.wan:
        why = "it fits the budget"
        tiles_user = bool(job.tile_size) and job.carry is not None and job.carry.description.tiles
        forced = k_user or tiles_user
        found = None if forced else scaled(lambda b: _host_if_sized(job, b, peaks, why), budget, r("host"))
        if found is None and job.carry is not None and not failed:
            found = scaled(lambda b: plan_carry(job, b, k_user, peaks), budget, r("carry"))
        if found is None:
            found = scaled(lambda b: plan_blend(job, b, k_user, peaks), budget, r("blend"))
        return found
    tile_user = None
    if job.tile_size:
        lt = max(1, int(job.tile_size) // job.layout.spatial_ratio)
        tile_user = (lt, lt)
    if failed and not k_user and tile_user is None:
        why = f"the chunked executor's {verdict.describe()}"
        found = scaled(lambda b: plan_host_decode(job, b, peaks, why), budget, r("host"))
        if found is not None:
            return found
    stats: dict = {}
    host = None if k_user or tile_user is not None else _host_if_sized(job, 1 << 62, peaks, "")
    if host is not None and host.planned * max(1.0, r("host")) <= budget:
        # The host's own decode fits: whole-frame chunks (its speed) within its peak (progress, Cancel and OOM
        # resume at no more memory than VAE Decode's own), else that decode itself; tiles would be slower
        # (docs/VIDEO_DECODE.md "Never hungrier than VAE Decode").
        cap = host.planned
        try:
            found = scaled(lambda b: plan_wan(job, min(b, cap), k_user, tile_user, peaks, stats, tiled=False),
                           budget, r("wan"))
        except ImpossibleBudgetError:
            found = scaled(lambda b: plan_host_decode(job, b, peaks, "it fits the budget, and no chunked plan "
                                                      "holds at most its peak"), budget, r("host"))
            if found is not None:
                found.stats = stats
                return found
            found = scaled(lambda b: plan_wan(job, b, k_user, tile_user, peaks, stats), budget, r("wan"))
    else:
        found = scaled(lambda b: plan_wan(job, b, k_user, tile_user, peaks, stats), budget, r("wan"))
    found.stats = stats
    if verdict is not None:
        found.exact, found.reason = verdict.ok, verdict.describe()
    return found
