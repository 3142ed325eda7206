"""Video decode within a memory budget: planning (Wan), offload, the decode, the plan report. The engine of
the Temporal-Chunk Video Decode node (``nodes/video_decode.py`` validates the inputs and passes ComfyUI's
callables in a :class:`VideoEnv`).

* **Wan 2.1 / 2.2** (exact): :func:`.video_chunked.decode_wan_chunked`: frame 0 alone, then chunks of ``k``
  latent frames with the causal caches carried, optional spatial tiles (tile-major); equal to ComfyUI's
  ``VAEDecode`` up to float rounding. ``k``, the tile grid, the split, the store placement and the cache
  mode are planned by :func:`plan_wan` from meta-sized peaks of the executor itself. Reported exact only
  after the executor passed its self-check on this host (:func:`check_chunked`, once per decoder and host);
  otherwise the auto plan takes the host's own decode when it fits (exact by construction), and any other
  plan is reported APPROXIMATE with the verdict.
* **Other video VAEs** (approximate): :func:`.video_chunked.decode_overlap_blend`: overlapping temporal
  chunks decoded independently and cross-faded; reported as approximate. :func:`plan_blend` takes the
  largest chunk (at most :data:`BLEND_MAX_K` latent frames) whose meta-sized peak fits the budget.

Planning (Wan). Candidates (whole frames or a tile grid x split x store placement x ``k`` x cache mode) are
sorted by an estimated speed; the first whose predicted peak fits the budget wins. A candidate's peak is
the executor's own peak on fake tensors (:class:`.sizing.MetaSizer`: exact live-tensor bytes) with the
fewest latent frames that show it (``min(T, 1 + 2 k)``: frame 0 and two chunks reach the steady state of
the caches), phase 2 run only on the tiles that set its peak (``decode_wan_chunked(sizing=True)``), plus
the analytic growth of a device store with ``T``. Before sizing, a candidate is skipped when

* it needs at least the memory of one that already failed (same kind, no smaller ``k`` / tile / cache /
  store), or
* a lower bound of its peak already exceeds the budget: the latent, a device store of every frame and one
  tile's committed causal caches (two frames per cached conv, whole frames: every cache) are alive together
  at the end of each tile (:func:`lower_bound`).

Sized peaks are kept in a :class:`PeakStore` (the node's is a JSON file under ComfyUI's user folder, so a
second run plans without sizing) keyed by the model class, its code fingerprint (structure, module code,
ComfyUI/torch sources), the detected cache protocol, a digest of ``video_chunked.py``'s source (a change of
the executor invalidates every entry), dtype, device type, shape and candidate (:func:`peak_key`).

The output is one buffer on the output device in VAEDecode's layout ``(B*T, H, W, 3)``; the executor writes
into a ``(B, 3, T, H, W)`` view of it and ``vae.process_output`` runs frame by frame in place.

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..budget import Budget, compute_budget
from ..cost.phases import dtype_name
from ..executors import wan as vc
from ..measure.sizing import MetaSizer
from ..measure.tracker import decode_tracker
from ..plan.grid import ImpossibleBudgetError
from ..report import Report, flag_measured_overrun, fmt_bytes, fmt_seconds
from ..store import JsonStore
from ..vae.families import identify, model_name
from .self_check import CheckStore, Verdict, code_fingerprint, memory_store, verify

log = logging.getLogger("vramfit.memory.video_decode")

__all__ = [
    "BLEND_MAX_K",
    "MAX_AUTO_K",
    "PeakStore",
    "VideoDecodeResult",
    "VideoEnv",
    "VideoJob",
    "VideoPlan",
    "blend_ratios",
    "check_chunked",
    "decode_video",
    "lower_bound",
    "make_job",
    "peak_key",
    "plan_blend",
    "plan_wan",
]

REPORT_NODE = "Temporal-Chunk Video Decode"
MAX_AUTO_K = 8
"""Largest chunk the auto plan considers (latent frames)."""
CALL_OVERHEAD = {"cuda": 0.3, "cpu": 0.0}
"""Relative cost of one executor call vs one latent frame of work, for the speed order of candidates
(GPU: fewer, larger calls pay; CPU: measured k = 1 fastest, see docs/VIDEO_DECODE.md)."""
IMPOSSIBLE_SIZINGS = 4
BLEND_MAX_K = 4
"""Largest chunk the auto plan of the overlap-blend path (other video VAEs) considers (latent frames)."""
"""Candidates sized (beyond those the plan sized) for the message when no plan fits."""

ProgressFn = Callable[[int, int], None]


def _default_budget(vae: Any, budget_mb: float) -> Budget:
    return compute_budget(torch.device(vae.device), user_budget_mb=budget_mb if budget_mb > 0 else None)


# --------------------------------------------------------------------------------------------------
# Persisted peaks


class PeakStore(JsonStore):
    """Meta-sized peaks by key (:func:`peak_key`): in memory, and in a JSON file when ``path`` is given (the
    node passes one under ComfyUI's user folder). :meth:`flush` writes the file (once per plan)."""

    section = "peaks"

    @staticmethod
    def coerce(value: Any) -> int:
        return int(value)


def executor_digest() -> str:
    """The chunked executor's version (``video_chunked.EXECUTOR_VERSION``), part of every persisted peak's key."""
    return vc.EXECUTOR_VERSION


# --------------------------------------------------------------------------------------------------
# Environment and job


@dataclasses.dataclass
class VideoEnv:
    """What the decode takes from its host (ComfyUI), as plain callables; the defaults run standalone.

    The node passes ComfyUI's: ``should_stop`` = ``throw_exception_if_processing_interrupted``, ``on_oom`` =
    ``soft_empty_cache``, ``oom_exceptions`` = ``(OOM_EXCEPTION,)``, ``progress_bar(total)`` = a
    ``comfy.utils.ProgressBar`` callback, ``budget(vae, budget_mb)`` from ComfyUI's free memory,
    ``offload(vae, bytes | None)`` unloading upstream models (None: all; returns an object with
    ``describe()``), ``load_weights(vae, bytes)`` = ``load_models_gpu``, ``peaks`` persisted under ComfyUI's
    user folder.
    """

    should_stop: Callable[[], Any] | None = None
    on_oom: Callable[[], None] | None = None
    oom_exceptions: tuple[type[BaseException], ...] | None = None
    progress_bar: Callable[[int], ProgressFn] | None = None
    budget: Callable[[Any, float], Budget] = _default_budget
    offload: Callable[[Any, int | None], Any] | None = None
    load_weights: Callable[[Any, int], None] | None = None
    peaks: PeakStore = dataclasses.field(default_factory=PeakStore)
    checks: CheckStore = dataclasses.field(default_factory=memory_store)
    """Self-check verdicts (:mod:`.self_check`; the node's persist under ComfyUI's user folder)."""
    fault_hook: Callable[[int], None] | None = None
    """Tests: the executor's ``fault_hook(step)`` (raise an OOM there to test resumes)."""
    measure_cpu_tensors: bool = False
    """On CPU count live tensor bytes (PeakTracker dispatch) instead of the RSS high-water mark."""


@dataclasses.dataclass(frozen=True)
class VideoJob:
    vae: Any
    z: torch.Tensor
    wan: bool
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device


def make_job(vae: Any, z: torch.Tensor, out_device: torch.device | str) -> VideoJob:
    """A validated video latent ``z`` (5-D) and its VAE (duck-typed ``comfy.sd.VAE``)."""
    return VideoJob(
        vae=vae,
        z=z,
        wan=vc.is_wan_vae(vae.first_stage_model),
        family=identify(vae) or model_name(vae),
        dtype=getattr(vae, "vae_dtype", torch.float32),
        device=torch.device(vae.device),
        out_device=torch.device(out_device),
    )


# --------------------------------------------------------------------------------------------------
# Planning (Wan)


@dataclasses.dataclass
class VideoPlan:
    k: int
    tile: tuple[int, int] | None
    """Tile core in latent px (None: whole frames)."""
    grid: tuple[int, int]
    rollback: bool
    """Keep a tile's committed cache during a chunk (OOM resumes from its last chunk; 2x one tile's cache);
    False: ComfyUI's in-place protocol (1x; an OOM decodes that tile again from frame 0)."""
    halo: int
    split: int
    store: str | None
    """Where the global part's output of every frame lives with tiles: "device" or "host" (None: whole
    frames, no store)."""
    planned: int
    """Predicted peak bytes on the compute device (decode + output buffer when it lives there)."""
    exact: bool = True
    over_budget: bool = False
    host_decode: bool = False
    """The host's own ``first_stage_model.decode`` (what VAEDecode runs), one batch item at a time: the
    exact path when the chunked executor failed its self-check on this host."""
    reason: str = ""
    """Why the output is not (or is) exact, for the report: the self-check's verdict."""

    def describe(self) -> str:
        if self.host_decode:
            return "the host's own decode (first_stage_model.decode, as VAE Decode), one batch item at a time"
        if self.tile is None:
            tiles = "whole frames"
        else:
            tiles = (f"tile-major: {self.grid[0]}x{self.grid[1]} tiles of {self.tile[0]}x{self.tile[1]} latent px "
                     f"(halo {self.halo}, split {self.split}, store on {self.store})")
        return f"k = {self.k} latent frames/chunk (frame 0 alone), {tiles}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    speed: float
    k: int
    tile: tuple[int, int] | None
    grid: tuple[int, int]
    split: int
    rollback: bool
    host: bool

    def order(self) -> tuple:
        return (self.speed, not self.rollback, self.host, self.k)

    def needs_more_than(self, f: Candidate) -> bool:
        """Surely needs at least the failed ``f``'s memory: same kind, no smaller in k, tile, cache, store."""
        if (self.tile is None) != (f.tile is None) or self.split != f.split:
            return False
        tile_ok = self.tile is None or (self.tile[0] >= f.tile[0] and self.tile[1] >= f.tile[1])  # type: ignore[index]
        return (tile_ok and self.k >= f.k and self.rollback >= f.rollback and (not self.host or f.host))


def out_bytes(job: VideoJob, frames: int, h: int, w: int) -> int:
    """The float32 output buffer, when it lives on the compute device's type."""
    if job.out_device.type != job.device.type:
        return 0
    return int(job.z.shape[0]) * frames * h * w * 3 * 4


def _t_meta(t: int, k: int) -> int:
    return min(t, 1 + 2 * k)


def _model_key(job: VideoJob, fingerprint: str | None = None) -> str:
    """What a sized peak depends on besides the decode's own inputs: the model class, its code fingerprint
    (:func:`.self_check.code_fingerprint`: structure, module code, ComfyUI/torch sources), the host's cache
    protocol, the executor's source, dtype and device type."""
    model = job.vae.first_stage_model
    cls = type(model)
    proto = vc.cache_protocol(model).name if job.wan else "-"
    return (f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}/{fingerprint or code_fingerprint(model)}/{proto}"
            f"/video-{executor_digest()}/{dtype_name(job.dtype)}/{job.device.type}")


def peak_key(job: VideoJob, cd: Candidate, fingerprint: str | None = None) -> str:
    """Key of a sized peak: :func:`_model_key`, latent shape (frames as sized) and candidate."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    tile = "whole" if cd.tile is None else f"{cd.tile[0]}x{cd.tile[1]}"
    return (f"{_model_key(job, fingerprint)}/{b}x{c}x{_t_meta(t, cd.k)}x{h}x{w}"
            f"/k{cd.k}/{tile}/split{cd.split}/{'rollback' if cd.rollback else 'inplace'}"
            f"/{'host' if cd.host else 'device'}")


def size_candidate(job: VideoJob, cd: Candidate) -> int:
    """Meta-sized peak bytes of ``decode_wan_chunked`` for this candidate at ``min(T, 1 + 2 k)`` latent
    frames, without the output buffer (the store's growth with ``T`` is added by :func:`decode_peak`)."""
    model = job.vae.first_stage_model
    lay = vc.wan_layout(model)
    b, c, t, h, w = (int(v) for v in job.z.shape)
    t_meta = _t_meta(t, cd.k)
    with MetaSizer([model], job.dtype, job.device) as sizer:
        zf = torch.empty((b, c, t_meta, h, w), dtype=job.dtype, device=job.device)
        out = vc.decode_wan_chunked(model, zf, cd.k, cd.tile, halo=None, split=cd.split, compute_device=job.device,
                                    dtype=job.dtype, store_device="cpu" if cd.host else None,
                                    out_device=job.device, rollback=cd.rollback, sizing=True)
        del out, zf
    out_b = b * 3 * lay.out_frames(t_meta) * h * w * lay.spatial_ratio**2 * 4
    return max(0, int(sizer.peak_bytes) - out_b)


def _store_growth(job: VideoJob, lay: vc.WanLayout, cd: Candidate) -> int:
    if cd.tile is None or cd.host:
        return 0
    b, _, t, h, w = (int(v) for v in job.z.shape)
    item = torch.empty((), dtype=job.dtype).element_size()
    return lay.store_bytes(h, w, t, b, item, cd.split) - lay.store_bytes(h, w, _t_meta(t, cd.k), b, item, cd.split)


def lower_bound(job: VideoJob, lay: vc.WanLayout, cd: Candidate) -> int:
    """A lower bound of :func:`decode_peak` without sizing: the latent (as sized), a device store of every
    frame and one tile's committed caches (the largest tile's extended region; whole frames: every cache),
    ``min(2, T)`` frames per cached conv (temporal upsample states left out), all alive together at the end
    of each tile's last chunk."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    item = torch.empty((), dtype=job.dtype).element_size()
    t_meta = _t_meta(t, cd.k)
    if cd.tile is None:
        first, eh, ew = 0, h, w
    else:
        si = lay.split_info(cd.split)
        first = si.first_slot
        eh = max(e1 - e0 for _, _, e0, e1 in vc.tile_spans(h, cd.tile[0], si.halo))
        ew = max(e1 - e0 for _, _, e0, e1 in vc.tile_spans(w, cd.tile[1], si.halo))
    frames = min(2, t_meta)
    cache = sum(s.channels * frames * eh * s.scale * ew * s.scale for s in lay.slots
                if s.index >= first and s.kind == "conv")
    store = 0 if cd.tile is None or cd.host else lay.store_bytes(h, w, t, b, item, cd.split)
    return int(b * c * t_meta * h * w * item + cache * b * item + store)


def decode_peak(job: VideoJob, lay: vc.WanLayout, cd: Candidate, peaks: PeakStore, fingerprint: str,
                sized: list[int] | None = None) -> int:
    """Peak bytes of the decode (without the output buffer) for the whole clip: the stored or sized peak
    plus the store's growth with ``T``."""
    key = peak_key(job, cd, fingerprint)
    peak = peaks.get(key)
    if peak is None:
        peak = size_candidate(job, cd)
        peaks.put(key, peak)
        if sized is not None:
            sized.append(1)
    return peak + _store_growth(job, lay, cd)


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
    ys = sum(e1 - e0 for _, _, e0, e1 in vc.tile_spans(h, tile[0], halo))
    xs = sum(e1 - e0 for _, _, e0, e1 in vc.tile_spans(w, tile[1], halo))
    return ys * xs / (h * w)


def _split_options(lay: vc.WanLayout) -> list[int]:
    """Split points for tiles: the default (scale 2, small halo) and the last one at latent scale (a store
    of 1/8 the size, larger halo); none whose tiled part holds a global op."""
    at_latent = max(s.split for s in lay.splits if s.scale == 1)
    opts = [lay.default_split] + ([at_latent] if at_latent != lay.default_split else [])
    return [s for s in opts if not (lay.tiled_global_ops and s == 0)]


def candidates(job: VideoJob, k_user: int, tile_user: tuple[int, int] | None) -> list[Candidate]:
    """Every candidate in the speed order the planner tries them."""
    lay = vc.wan_layout(job.vae.first_stage_model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    rest = max(1, t - 1)
    ks = [min(k_user, rest)] if k_user else list(range(1, min(rest, MAX_AUTO_K) + 1))
    c = CALL_OVERHEAD.get(job.device.type, 0.3)
    hosts = (False, True) if job.device.type != "cpu" else (False,)
    cands = []
    for tile, grid in _grids(h, w, tile_user):
        for split in [lay.default_split] if tile is None else _split_options(lay):
            area = area_factor(h, w, tile, lay.split_info(split).halo)
            for host in (False,) if tile is None else hosts:
                for k in ks:
                    speed = area * (1 + c / k) * (1 + 1e-3 * k) * (1.02 if host else 1.0)
                    for rollback in (True, False):
                        cands.append(Candidate(speed, k, tile, grid, split, rollback, host))
    cands.sort(key=Candidate.order)
    return cands


def plan_wan(job: VideoJob, budget: int, k_user: int, tile_user: tuple[int, int] | None,
             peaks: PeakStore | None = None, stats: dict | None = None) -> VideoPlan:
    """The fastest plan whose predicted peak fits ``budget`` (module docstring). With a user ``k`` or tile
    and nothing fitting: the smallest plan, marked over budget; otherwise :class:`ImpossibleBudgetError`.
    ``stats``: filled with ``sized`` (candidates meta-sized now), ``bounded`` (skipped by the lower bound)."""
    peaks = PeakStore() if peaks is None else peaks
    model = job.vae.first_stage_model
    lay = vc.wan_layout(model)
    fingerprint = code_fingerprint(model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    out_b = out_bytes(job, lay.out_frames(t), h * lay.spatial_ratio, w * lay.spatial_ratio)
    # process_output per output frame: two float32 temporaries of one frame
    post = 2 * int(job.z.shape[0]) * 3 * h * w * lay.spatial_ratio**2 * 4
    sized: list[int] = []
    bounded = 0

    def make(cd: Candidate, dec: int) -> VideoPlan:
        store = None if cd.tile is None else ("host" if cd.host else "device")
        return VideoPlan(cd.k, cd.tile, cd.grid, cd.rollback, lay.split_info(cd.split).halo, cd.split, store,
                         out_b + max(dec, post))

    found: VideoPlan | None = None
    failed: list[Candidate] = []
    known: list[tuple[int, bool, Candidate]] = []  # (planned or its lower bound, exact, candidate)
    try:
        for cd in candidates(job, k_user, tile_user):
            if any(cd.needs_more_than(f) for f in failed):
                continue
            low = out_b + max(lower_bound(job, lay, cd), post)
            if low > budget:
                bounded += 1
                failed.append(cd)
                known.append((low, False, cd))
                continue
            p = make(cd, decode_peak(job, lay, cd, peaks, fingerprint, sized))
            if p.planned <= budget:
                found = p
                break
            failed.append(cd)
            known.append((p.planned, True, cd))
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
            stats.update(sized=len(sized), bounded=bounded)
    if found.over_budget and tile_user is None and not k_user:
        raise ImpossibleBudgetError(
            f"no plan fits the budget of {fmt_bytes(budget)}: every plan needs at least {fmt_bytes(floor)}; the "
            f"smallest found ({found.describe()}) needs {fmt_bytes(found.planned)}; raise budget_mb or free memory",
            budget, floor)
    return found


# --------------------------------------------------------------------------------------------------
# Self-check and the exact fallback

CHECK_LATENT = (3, 1, 2)
"""``(T, h, w)`` of the self-check's latent: frame 0 + two one-frame chunks (a host that drops the caches'
history between one-frame calls shows from the second), 1x2 latent px (two tiles)."""


def check_chunked(job: VideoJob, store: CheckStore, prepare: Callable[[], None] | None = None) -> Verdict:
    """Self-check of the chunked executor for this decoder on this host (:func:`.self_check.verify`): a tiny
    random latent (:data:`CHECK_LATENT`) decoded by ``first_stage_model.decode`` and by the executor with
    k = 1 in 1x2 tiles with in-place caches (one-frame chunks: the caches' history restored; phase 1, the
    store, per-tile caches; the split before the head keeps the tiles' extra work small) and k = 2 on whole
    frames (chunks of several frames, the one-tile path). Keyed by the decoder's code fingerprint, the
    detected cache protocol, the executor's source, dtype and device type. ``prepare()`` runs first when the
    check runs (the node loads the weights)."""
    model = job.vae.first_stage_model
    lay = vc.wan_layout(model)
    last = len(lay.splits) - 1
    key = f"wan-chunked/{_model_key(job)}"
    z = torch.randn((1, lay.latent_channels, *CHECK_LATENT), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)

    def run(k: int, tile: tuple[int, int] | None, **kw: Any) -> Callable[[], torch.Tensor]:
        return lambda: vc.decode_wan_chunked(model, z, k, tile, compute_device=job.device, dtype=job.dtype, **kw)

    configs = [
        (f"k = 1, 1x2 tiles at split {last}, in-place caches", run(1, (1, 1), split=last, rollback=False)),
        ("k = 2, whole frames", run(2, None)),
    ]
    if store.get(key) is None and prepare is not None:
        prepare()
    return verify(key, store, lambda: model.decode(z), configs, job.dtype)


def host_decode_peak(job: VideoJob, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of the host's own decode of one batch item at the full clip length, its own
    output included (persisted in ``peaks``); the node's output buffer comes on top."""
    _, c, t, h, w = (int(v) for v in job.z.shape)
    key = f"{_model_key(job)}/1x{c}x{t}x{h}x{w}/host-decode"
    peak = peaks.get(key)
    if peak is None:
        model = job.vae.first_stage_model
        with MetaSizer([model], job.dtype, job.device) as sizer:
            out = model.decode(torch.empty((1, c, t, h, w), dtype=job.dtype, device=job.device))
            del out
        peak = int(sizer.peak_bytes)
        peaks.put(key, peak)
        peaks.flush()
    return peak


def plan_host_decode(job: VideoJob, budget: int, peaks: PeakStore, verdict: Verdict) -> VideoPlan | None:
    """The exact fallback when the chunked executor failed its self-check: the host's own decode, if its
    peak (+ the output buffer) fits ``budget``; else None."""
    lay = vc.wan_layout(job.vae.first_stage_model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    planned = out_bytes(job, lay.out_frames(t), h * lay.spatial_ratio, w * lay.spatial_ratio)
    planned += host_decode_peak(job, peaks)
    if planned > budget:
        return None
    return VideoPlan(max(1, t - 1), None, (1, 1), True, 0, 0, None, planned, host_decode=True,
                     reason=f"the chunked executor's {verdict.describe()}")


# --------------------------------------------------------------------------------------------------
# Planning (other video VAEs: overlap-blend)


def blend_ratios(vae: Any) -> tuple[Callable[[int], Any] | int | float, Callable[[int], Any] | int | None, int]:
    """``(frames, index_formula, spatial)`` of ``vae.upscale_ratio`` for :func:`.video_chunked.decode_overlap_blend`:
    a ComfyUI video VAE's ``(frames of l latent frames, h, w)`` tuple, or an int (spatial only: one output
    frame per latent frame). Raises ValueError naming the value when it is neither."""
    up = getattr(vae, "upscale_ratio", None)
    if isinstance(up, (tuple, list)) and len(up) >= 2:
        frames, spatial = up[0], up[1]
        idx = getattr(vae, "upscale_index_formula", None)
        index = idx[0] if isinstance(idx, (tuple, list)) and idx else None
    else:
        frames, spatial, index = 1, up, None
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    ok_frames = callable(frames) or number(frames)
    ok_spatial = number(spatial) and spatial >= 1 and float(spatial).is_integer()
    if not (ok_frames and ok_spatial):
        raise ValueError(f"{REPORT_NODE}: cannot use the VAE's upscale_ratio {up!r} ({type(vae).__name__}): "
                         "expected (frames of a latent chunk, h ratio, w ratio) or an int spatial ratio")
    return frames, index, int(spatial)


def _blend_fn(job: VideoJob) -> Callable[[torch.Tensor], torch.Tensor]:
    """One chunk's decode as ``VAE.decode`` feeds it (the VAE's dtype and device), float32 frames."""
    model = job.vae.first_stage_model

    def fn(a: torch.Tensor) -> torch.Tensor:
        return model.decode(a.to(job.dtype).to(job.device)).float()

    return fn


def blend_chunk_peak(job: VideoJob, k: int, peaks: PeakStore) -> int:
    """Meta-sized peak bytes of one chunk of ``min(k, T)`` latent frames (its float32 frames included),
    persisted in ``peaks``."""
    b, c, t, h, w = (int(v) for v in job.z.shape)
    kk = min(int(k), t)
    key = f"{_model_key(job)}/{b}x{c}x{kk}x{h}x{w}/blend"
    peak = peaks.get(key)
    if peak is None:
        with MetaSizer([job.vae.first_stage_model], job.dtype, job.device) as sizer:
            out = _blend_fn(job)(torch.empty((b, c, kk, h, w), dtype=job.dtype, device=job.device))
            del out
        peak = int(sizer.peak_bytes)
        peaks.put(key, peak)
    return peak


def plan_blend(job: VideoJob, budget: int, k_user: int, peaks: PeakStore) -> VideoPlan:
    """The largest chunk (at most :data:`BLEND_MAX_K`, or the user's ``k``) whose meta-sized peak plus the
    output buffer fits ``budget``; the smallest, marked over budget, when none does. When meta sizing
    fails: the largest chunk, not predicted (``planned`` 0)."""
    frames_of, _, r = blend_ratios(job.vae)
    b, _, t, h, w = (int(v) for v in job.z.shape)
    frames = int(round(frames_of(t))) if callable(frames_of) else int(round(frames_of * t))
    out_b = out_bytes(job, frames, h * r, w * r)
    post = 2 * b * 3 * h * w * r * r * 4  # process_output per output frame: two float32 temporaries
    ks = [max(2, k_user)] if k_user else list(range(max(2, min(t, BLEND_MAX_K)), 1, -1))
    reason = "overlapping temporal chunks decoded independently and cross-faded (not a causal Wan VAE)"
    plan = None
    try:
        for k in ks:
            plan = VideoPlan(k, None, (1, 1), True, 0, 0, None, out_b + max(blend_chunk_peak(job, k, peaks), post),
                             exact=False, reason=reason)
            if plan.planned <= budget:
                return plan
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: the chunk is not predicted
        log.warning("meta sizing of %s failed (%s: %s); chunk not predicted", job.family, type(e).__name__, e)
        return VideoPlan(ks[0], None, (1, 1), True, 0, 0, None, 0, exact=False, reason=reason)
    finally:
        peaks.flush()
    assert plan is not None
    plan.over_budget = True
    return plan


# --------------------------------------------------------------------------------------------------
# Decode


@dataclasses.dataclass
class VideoDecodeResult:
    images: torch.Tensor
    report: Report
    plan: VideoPlan
    budget: Any
    seconds: float
    measured_peak: int | None
    measure_method: str
    stats: dict
    plan_seconds: float
    plan_stats: dict = dataclasses.field(default_factory=dict)


def _host_decode(job: VideoJob, view: torch.Tensor, bar: ProgressFn | None, env: VideoEnv, stats: dict) -> None:
    """The host's own ``first_stage_model.decode`` per batch item (as ``VAE.decode`` feeds it: the VAE's
    dtype and device), written into the output view."""
    model = job.vae.first_stage_model
    b = int(job.z.shape[0])
    for i in range(b):
        if env.should_stop is not None:
            env.should_stop()
        if bar is not None:
            bar(i, b)
        out = model.decode(job.z[i : i + 1].to(job.dtype).to(job.device))
        view[i : i + 1].copy_(out)
        del out
    if bar is not None:
        bar(b, b)
    stats.update(exact=True, chunks=b, units=b, protocol=vc.cache_protocol(model).name)


def _post(vae: Any, view: torch.Tensor) -> None:
    """``vae.process_output`` frame by frame, in place in the output buffer (same values as on the whole)."""
    for f in range(view.shape[2]):
        sl = view[:, :, f : f + 1]
        sl.copy_(vae.process_output(sl))


def decode_video(
    job: VideoJob,
    env: VideoEnv,
    *,
    frames_per_chunk: int = 0,
    tile_size: int = 0,
    budget_mb: float = 0,
    unload_others: bool = True,
    t_start: float | None = None,
) -> VideoDecodeResult:
    """Decode ``job`` within the budget; returns frames ``(B*T, H, W, 3)`` on [0, 1] (as VAEDecode) and the
    report. ``frames_per_chunk`` / ``tile_size`` (output px): 0 = auto; ``budget_mb``: 0 = free memory
    (``env.budget``); ``unload_others``: offload upstream models first (``env.offload``, VAEs with a
    patcher). ``t_start``: ``time.perf_counter()`` when planning started. Raises
    :class:`.planner.ImpossibleBudgetError` when no plan fits."""
    vae, z = job.vae, job.z
    b, _, t, h, w = (int(v) for v in z.shape)
    model = vae.first_stage_model
    k_user = int(frames_per_chunk)

    t0 = time.perf_counter() if t_start is None else t_start  # planning time, offload included
    lay = vc.wan_layout(model) if job.wan else None
    tile_user = None
    if lay is not None and tile_size:
        lt = max(1, int(tile_size) // lay.spatial_ratio)
        tile_user = (lt, lt)
    plan_stats: dict = {}

    offload_text = "off (unload_others disabled)"
    if unload_others and hasattr(vae, "patcher") and env.offload is not None:
        # The fastest plan's peak (sized once, kept for the plan below), at most the budget, as the image path.
        if job.wan:
            ideal: int | None = plan_wan(job, 1 << 62, k_user, tile_user, env.peaks).planned
        else:
            ideal = plan_blend(job, 1 << 62, k_user, env.peaks).planned or None  # 0: not predicted
        need = int(budget_mb * 2**20) if budget_mb else None
        if ideal is not None:
            need = ideal if need is None else min(ideal, need)
        if need is not None:
            patcher = vae.patcher
            need += max(0, int(patcher.model_size()) - int(patcher.loaded_size()))
        offload_text = env.offload(vae, need).describe()
    elif unload_others and hasattr(vae, "patcher"):
        offload_text = "skipped (no offload callable)"
    elif unload_others:
        offload_text = "skipped (this VAE has no ComfyUI model patcher)"
    budget = env.budget(vae, budget_mb)

    stats: dict = {}
    if lay is not None:
        r = lay.spatial_ratio
        frames, oh, ow = lay.out_frames(t), h * r, w * r
        load = (lambda: env.load_weights(vae, 0)) if hasattr(vae, "patcher") and env.load_weights else None
        verdict = check_chunked(job, env.checks, load)
        plan = None
        if not verdict.ok and not k_user and tile_user is None:  # auto: the host's decode when it fits
            plan = plan_host_decode(job, int(budget.available), env.peaks, verdict)
        if plan is None:
            plan = plan_wan(job, int(budget.available), k_user, tile_user, env.peaks, plan_stats)
            plan.exact, plan.reason = verdict.ok, verdict.describe()
    else:
        frames_of, index_formula, r = blend_ratios(vae)
        frames = int(round(frames_of(t))) if callable(frames_of) else int(round(frames_of * t))
        oh, ow = h * r, w * r
        plan = plan_blend(job, int(budget.available), k_user, env.peaks)
    plan_seconds = time.perf_counter() - t0

    if hasattr(vae, "patcher") and env.load_weights is not None:
        env.load_weights(vae, plan.planned)

    buf = torch.empty((b * frames, oh, ow, 3), dtype=torch.float32, device=job.out_device)
    view = buf.view(b, frames, oh, ow, 3).permute(0, 4, 1, 2, 3)  # (B, 3, T, H, W) view
    bar = env.progress_bar(1) if env.progress_bar is not None else None
    method, tracker = decode_tracker(job.device, env.measure_cpu_tensors)
    t1 = time.perf_counter()
    with torch.no_grad(), tracker if tracker is not None else contextlib.nullcontext():
        if plan.host_decode:
            _host_decode(job, view, bar, env, stats)
        elif job.wan:
            vc.decode_wan_chunked(
                model, z, plan.k, plan.tile, halo=plan.halo, split=plan.split, out=view,
                compute_device=job.device, dtype=job.dtype, store_device="cpu" if plan.store == "host" else None,
                rollback=plan.rollback, progress=bar, should_stop=env.should_stop, fault_hook=env.fault_hook,
                oom_exceptions=env.oom_exceptions, on_oom=env.on_oom, stats=stats)
        else:  # accumulated in the output buffer itself (the plan counts one output)
            vc.decode_overlap_blend(
                _blend_fn(job), z, plan.k, 1, upscale_ratio=frames_of, index_formula=index_formula, out=view,
                progress=bar, should_stop=env.should_stop, oom_exceptions=env.oom_exceptions, on_oom=env.on_oom,
                stats=stats)
        _post(vae, view)
    seconds = time.perf_counter() - t1
    measured = int(tracker.peak_bytes) if tracker is not None else None
    report = _report(job, plan, budget, offload_text, stats, seconds, plan_seconds, measured, method)
    return VideoDecodeResult(buf, report, plan, budget, seconds, measured, method, stats, plan_seconds, plan_stats)


def _report(job: VideoJob, plan: VideoPlan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, measured: int | None, method: str) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.host_decode:
        r.add("path", f"exact: the host's own decode, as VAE Decode ({plan.reason})")
    elif job.wan and plan.exact:
        r.add("path", "exact: causal caches carried across chunks (same frames as VAE Decode)")
    elif job.wan:
        r.add("path", f"APPROXIMATE: the chunked executor does not reproduce this host's decoder ({plan.reason})")
    else:
        r.add("path", f"APPROXIMATE: {plan.reason}")
    if job.wan:
        proto = vc.cache_protocol(job.vae.first_stage_model)
        how = "carried by the host's blocks" if not proto.restores else "restored by the executor"
        r.add("check", f"cache protocol {proto.name} (history {how}); "
                       f"{plan.reason if not plan.host_decode else 'chunked executor not used'}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.describe() if job.wan else f"k = {plan.k} latent frames/chunk, overlap 1")
    if job.wan and not plan.host_decode:
        scope = "whole frame" if plan.tile is None else "one tile at a time (tile-major)"
        if plan.rollback:
            cache = f"{job.device}, {scope}, committed + next (an OOM resumes from the last chunk)"
        else:
            cache = f"{job.device}, {scope}, in place as ComfyUI (1x; an OOM decodes that tile again from frame 0)"
        if plan.store is not None:
            cache += f"; global part of every frame stored on the {plan.store}"
        r.add("cache", cache)
    if job.wan or plan.planned:
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        why = "user setting" if job.wan else f"chunks of {plan.k} latent frames"
        over = f" - OVER BUDGET ({why})" if plan.over_budget else ""
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, meta sizing){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload and self-check included)")
    else:
        r.add("predicted", "not predicted (meta sizing of the decoder failed; see the log)")
    r.add("measured", f"peak {fmt_bytes(measured)} ({method})" if measured is not None else method)
    flag_measured_overrun(r, measured, method, int(budget.available), log)
    r.add("time", f"{fmt_seconds(seconds)} ({stats.get('chunks', '?')} chunks)")
    if stats.get("shrinks") or stats.get("restarts"):
        r.add("oom", f"{stats.get('shrinks', 0)} re-plan(s), {stats.get('restarts', 0)} restart(s): finished with "
                     f"k = {stats.get('frames_per_chunk')}, tile {stats.get('tile')}")
    return r
