"""Temporal-Chunk Video Decode (VRAM Fit): decodes a video latent within a memory budget.

* **Wan 2.1 / 2.2** (exact): :func:`memory.video_chunked.decode_wan_chunked`: frame 0 alone, then chunks
  of ``k`` latent frames with the causal caches carried, optional spatial tiles; equal to ComfyUI's
  ``VAEDecode`` up to float rounding. ``k`` and the tile are planned by meta sizing of the executor
  itself (fake tensors: exact byte counts, no compute), cached per (VAE class, dtype, device, shape).
* **Other video VAEs** (approximate): :func:`memory.video_chunked.decode_overlap_blend`: overlapping
  temporal chunks decoded independently and cross-faded; reported as approximate.

The output is one buffer on ComfyUI's intermediate device in VAEDecode's layout ``(B*T, H, W, 3)``;
the executor writes into a ``(B, 3, T, H, W)`` view of it and ``vae.process_output`` is applied
frame by frame in place (elementwise: identical values, no full-size temporaries).
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
from comfy_api.v0_0_2 import io, ui

from ..memory import video_chunked as vc
from ..memory.families import identify, model_name
from ..memory.report import Report, fmt_bytes, fmt_seconds
from ..memory.sizing import MetaSizer
from ..memory.tracker import PeakTracker, rss_supported
from . import _comfy

log = logging.getLogger("vramfit.nodes.video_decode")

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"
DISPLAY_NAME = "Temporal-Chunk Video Decode (VRAM Fit)"
REPORT_NODE = "Temporal-Chunk Video Decode"
MAX_AUTO_K = 8
"""Largest chunk the auto plan considers (latent frames)."""
CALL_OVERHEAD = {"cuda": 0.3, "cpu": 0.0}
"""Relative cost of one executor call vs one latent frame of work, for the speed order of candidates
(GPU: fewer, larger calls pay; CPU: measured k = 1 fastest, see docs/VIDEO_DECODE.md)."""

_FAULT_HOOK: Callable[[int], None] | None = None
"""Test hook: passed to the executor as ``fault_hook(step)`` (raise an OOM there to test resumes)."""
MEASURE_CPU_TENSORS = False
"""Debug/tests: on CPU count live tensor bytes (PeakTracker dispatch) instead of the RSS high-water."""

_SIZES: dict[tuple, int] = {}
"""Meta-sized peaks per (model class, dtype, device, batch, latent c/h/w, frames sized, k, tile, split, cache
mode, store placement)."""


def _error(message: str) -> _comfy.NodeInputError:
    return _comfy.NodeInputError(REPORT_NODE, message)


@dataclasses.dataclass(frozen=True)
class _Job:
    vae: Any
    z: torch.Tensor
    wan: bool
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device


def _validate(vae: Any, samples: Any, frames_per_chunk: int, tile_size: int) -> _Job:
    if vae is None or getattr(vae, "first_stage_model", None) is None:
        raise _error("the VAE is invalid (None); if it comes from a checkpoint loader, the checkpoint has no VAE")
    z = samples.get("samples") if isinstance(samples, dict) else None
    if not isinstance(z, torch.Tensor):
        raise _error(f"samples must be a LATENT with a 'samples' tensor, got {type(samples).__name__}")
    shape = tuple(z.shape)
    hint = "use Tiled VAE Decode (VRAM Fit) for image latents"
    if z.ndim == 4:
        raise _error(f"latent {shape} is a 4-D image latent (B, C, H, W); this node decodes video latents "
                     f"(B, C, T, H, W): {hint}")
    if z.ndim != 5:
        raise _error(f"latent {shape} is not a 5-D video latent (B, C, T, H, W)")
    if min(shape) < 1:
        raise _error(f"latent {shape} is empty")
    dim = int(getattr(vae, "latent_dim", 3))
    if dim != 3:
        raise _error(f"this VAE is not a video VAE (latent_dim {dim}); latent {shape}: {hint}")
    want = getattr(vae, "latent_channels", None)
    if want is not None and int(want) != int(shape[1]):
        raise _error(f"latent {shape} has {shape[1]} channels but the VAE expects {want}: wrong VAE for this "
                     f"latent (an image latent? {hint})")
    if frames_per_chunk < 0:
        raise _error(f"frames_per_chunk {frames_per_chunk}: use 0 (auto) or >= 1 latent frames")
    if tile_size < 0:
        raise _error(f"tile_size {tile_size}: use 0 (auto) or a tile side in output pixels")
    if hasattr(vae, "throw_exception_if_invalid"):
        vae.throw_exception_if_invalid()
    return _Job(
        vae=vae,
        z=z,
        wan=vc.is_wan_vae(vae.first_stage_model),
        family=identify(vae) or model_name(vae),
        dtype=getattr(vae, "vae_dtype", torch.float32),
        device=torch.device(vae.device),
        out_device=torch.device(_comfy.intermediate_device()),
    )


# --------------------------------------------------------------------------------------------------
# Planning (Wan)


@dataclasses.dataclass
class _Plan:
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

    def describe(self) -> str:
        if self.tile is None:
            tiles = "whole frames"
        else:
            tiles = (f"tile-major: {self.grid[0]}x{self.grid[1]} tiles of {self.tile[0]}x{self.tile[1]} latent px "
                     f"(halo {self.halo}, split {self.split}, store on {self.store})")
        return f"k = {self.k} latent frames/chunk (frame 0 alone), {tiles}"


def _out_bytes(job: _Job, frames: int, h: int, w: int) -> int:
    """The float32 output buffer, when it lives on the compute device's type."""
    if job.out_device.type != job.device.type:
        return 0
    return int(job.z.shape[0]) * frames * h * w * 3 * 4


def _meta_peak(job: _Job, k: int, tile: tuple[int, int] | None, split: int, rollback: bool, host: bool) -> int:
    """Peak bytes of ``decode_wan_chunked`` for this latent's frame size on fake tensors, without the
    output buffer. Two chunks after frame 0 reach the steady state (a tile's cache does not grow with T);
    the store (tiles, on the device) does grow with T: the difference to the sized run is added."""
    model = job.vae.first_stage_model
    b, c, t, h, w = (int(v) for v in job.z.shape)
    t_meta = min(t, 1 + 2 * k)
    key = (type(model).__module__, type(model).__qualname__, str(job.dtype), str(job.device), b, c, h, w, t_meta, k,
           tile, split, rollback, host)
    if key not in _SIZES:
        lay = vc.wan_layout(model)
        with MetaSizer([model], job.dtype, job.device) as sizer:
            zf = torch.empty((b, c, t_meta, h, w), dtype=job.dtype, device=job.device)
            out = vc.decode_wan_chunked(model, zf, k, tile, halo=None, split=split, compute_device=job.device,
                                        dtype=job.dtype, store_device="cpu" if host else None,
                                        out_device=job.device, rollback=rollback)
            del out, zf
        fr = lay.out_frames(t_meta)
        out_b = b * 3 * fr * h * w * lay.spatial_ratio**2 * 4
        _SIZES[key] = max(0, int(sizer.peak_bytes) - out_b)
    peak = _SIZES[key]
    if tile is not None and not host:
        lay = vc.wan_layout(model)
        item = torch.empty((), dtype=job.dtype).element_size()
        peak += lay.store_bytes(h, w, t, b, item, split) - lay.store_bytes(h, w, t_meta, b, item, split)
    return peak


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


def _area_factor(h: int, w: int, tile: tuple[int, int] | None, halo: int) -> float:
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


@dataclasses.dataclass(frozen=True)
class _Cand:
    speed: float
    k: int
    tile: tuple[int, int] | None
    grid: tuple[int, int]
    split: int
    rollback: bool
    host: bool

    def order(self) -> tuple:
        return (self.speed, not self.rollback, self.host, self.k)

    def needs_more_than(self, f: _Cand) -> bool:
        """Surely needs at least the failed ``f``'s memory: same kind, no smaller in k, tile, cache, store."""
        if (self.tile is None) != (f.tile is None) or self.split != f.split:
            return False
        tile_ok = self.tile is None or (self.tile[0] >= f.tile[0] and self.tile[1] >= f.tile[1])  # type: ignore[index]
        return (tile_ok and self.k >= f.k and self.rollback >= f.rollback and (not self.host or f.host))


def _plan_wan(job: _Job, budget: int, k_user: int, tile_user: tuple[int, int] | None) -> _Plan:
    """The fastest plan whose meta-sized peak fits ``budget``: candidates (k, whole frames or tile grid x
    split x store placement, cache mode) in estimated speed order; the first that fits wins. A candidate
    that needs at least the memory of one that did not fit is not sized."""
    model = job.vae.first_stage_model
    lay = vc.wan_layout(model)
    _, _, t, h, w = (int(v) for v in job.z.shape)
    rest = max(1, t - 1)
    ks = [min(k_user, rest)] if k_user else list(range(1, min(rest, MAX_AUTO_K) + 1))
    c = CALL_OVERHEAD.get(job.device.type, 0.3)
    out_b = _out_bytes(job, lay.out_frames(t), h * lay.spatial_ratio, w * lay.spatial_ratio)
    # process_output per output frame: two float32 temporaries of one frame
    post = 2 * int(job.z.shape[0]) * 3 * h * w * lay.spatial_ratio**2 * 4
    hosts = (False, True) if job.device.type != "cpu" else (False,)
    cands = []
    for tile, grid in _grids(h, w, tile_user):
        for split in [lay.default_split] if tile is None else _split_options(lay):
            area = _area_factor(h, w, tile, lay.split_info(split).halo)
            for host in (False,) if tile is None else hosts:
                for k in ks:
                    speed = area * (1 + c / k) * (1 + 1e-3 * k) * (1.02 if host else 1.0)
                    for rollback in (True, False):
                        cands.append(_Cand(speed, k, tile, grid, split, rollback, host))
    cands.sort(key=_Cand.order)
    best: _Plan | None = None
    failed: list[_Cand] = []
    for cd in cands:
        if any(cd.needs_more_than(f) for f in failed):
            continue
        dec = _meta_peak(job, cd.k, cd.tile, cd.split, cd.rollback, cd.host)
        store = None if cd.tile is None else ("host" if cd.host else "device")
        p = _Plan(cd.k, cd.tile, cd.grid, cd.rollback, lay.split_info(cd.split).halo, cd.split, store,
                  out_b + max(dec, post))
        if p.planned <= budget:
            return p
        failed.append(cd)
        if best is None or p.planned < best.planned:
            best = p
    assert best is not None
    if tile_user is not None or k_user:
        best.over_budget = True
        return best
    raise _error(f"no plan fits the budget of {fmt_bytes(budget)}: the smallest ({best.describe()}) needs "
                 f"{fmt_bytes(best.planned)}; raise budget_mb or free memory")


# --------------------------------------------------------------------------------------------------
# Decode


@dataclasses.dataclass
class DecodeResult:
    images: torch.Tensor
    report: Report
    plan: _Plan
    budget: Any
    seconds: float
    measured_peak: int | None
    measure_method: str
    stats: dict
    plan_seconds: float


def _tracker(job: _Job) -> tuple[str, PeakTracker | None]:
    if job.device.type == "cuda":
        return "CUDA max_memory_allocated", PeakTracker(job.device, method="cuda")
    if job.device.type == "cpu":
        if MEASURE_CPU_TENSORS:
            return "live tensor bytes (PeakTracker dispatch)", PeakTracker(job.device, method="dispatch")
        if rss_supported():
            return "process RSS high-water mark", PeakTracker(job.device, method="rss")
    return "not measured on this device", None


def _post(vae: Any, view: torch.Tensor) -> None:
    """``vae.process_output`` frame by frame, in place in the output buffer (same values as on the whole)."""
    for f in range(view.shape[2]):
        sl = view[:, :, f : f + 1]
        sl.copy_(vae.process_output(sl))


def decode(
    vae: Any,
    samples: dict,
    frames_per_chunk: int = 0,
    tile_size: int = 0,
    budget_mb: int = 0,
    unload_others: bool = True,
    node_id: str | None = None,
) -> DecodeResult:
    """Everything the node does; returns frames ``(B*T, H, W, 3)`` on [0, 1] (as VAEDecode) and the report."""
    job = _validate(vae, samples, int(frames_per_chunk), int(tile_size))
    vae, z = job.vae, job.z
    b, _, t, h, w = (int(v) for v in z.shape)
    model = vae.first_stage_model

    t0 = time.perf_counter()  # planning time, offload included (its need is the fastest plan's peak)
    lay = vc.wan_layout(model) if job.wan else None
    tile_user = None
    if lay is not None and tile_size:
        lt = max(1, int(tile_size) // lay.spatial_ratio)
        tile_user = (lt, lt)

    offload_text = "off (unload_others disabled)"
    if unload_others and hasattr(vae, "patcher"):
        if budget_mb:
            need: int | None = int(budget_mb) * 2**20
        elif job.wan:  # the fastest plan's peak (meta-sized once, cached for the plan below)
            need = _plan_wan(job, 1 << 62, int(frames_per_chunk), tile_user).planned
        else:
            need = None
        if need is not None:
            patcher = vae.patcher
            need += max(0, int(patcher.model_size()) - int(patcher.loaded_size()))
        offload_text = _comfy.offload_others(vae, need, "needed" if need is not None else "all").describe()
    elif unload_others:
        offload_text = "skipped (this VAE has no ComfyUI model patcher)"
    budget = _comfy.vae_budget(vae, budget_mb)

    stats: dict = {}
    if lay is not None:
        r = lay.spatial_ratio
        plan = _plan_wan(job, int(budget.available), int(frames_per_chunk), tile_user)
        frames, oh, ow = lay.out_frames(t), h * r, w * r
    else:
        ratio_t = vae.upscale_ratio[0] if isinstance(getattr(vae, "upscale_ratio", None), tuple) else 4
        frames = int(round(ratio_t(t))) if callable(ratio_t) else int(ratio_t * t)
        r = int(vae.upscale_ratio[1]) if isinstance(vae.upscale_ratio, tuple) else 8
        oh, ow = h * r, w * r
        k = max(2, int(frames_per_chunk) or min(t, 4))
        plan = _Plan(k, None, (1, 1), True, 0, 0, None, 0, exact=False)
    plan_seconds = time.perf_counter() - t0

    if hasattr(vae, "patcher"):
        _comfy.load_vae_weights(vae, plan.planned)

    buf = torch.empty((b * frames, oh, ow, 3), dtype=torch.float32, device=job.out_device)
    view = buf.view(b, frames, oh, ow, 3).permute(0, 4, 1, 2, 3)  # (B, 3, T, H, W) view
    bar = _comfy.progress_callback(1, node_id)
    method, tracker = _tracker(job)
    t1 = time.perf_counter()
    with torch.no_grad(), tracker if tracker is not None else contextlib.nullcontext():
        if job.wan:
            vc.decode_wan_chunked(
                model, z, plan.k, plan.tile, halo=plan.halo, split=plan.split, out=view,
                compute_device=job.device, dtype=job.dtype, store_device="cpu" if plan.store == "host" else None,
                rollback=plan.rollback,
                progress=bar, should_stop=_comfy.should_stop, fault_hook=_FAULT_HOOK,
                oom_exceptions=_comfy.oom_exceptions(), on_oom=_comfy.on_oom, stats=stats)
        else:
            def fn(a: torch.Tensor) -> torch.Tensor:
                return model.decode(a.to(job.dtype).to(job.device)).float()

            res = vc.decode_overlap_blend(
                fn, z, plan.k, 1, upscale_ratio=vae.upscale_ratio[0], index_formula=vae.upscale_index_formula[0],
                out_device=job.out_device, progress=bar, should_stop=_comfy.should_stop,
                oom_exceptions=_comfy.oom_exceptions(), on_oom=_comfy.on_oom, stats=stats)
            view.copy_(res)
            del res
        _post(vae, view)
    seconds = time.perf_counter() - t1
    measured = int(tracker.peak_bytes) if tracker is not None else None
    report = _report(job, plan, budget, offload_text, stats, seconds, plan_seconds, measured, method)
    return DecodeResult(buf, report, plan, budget, seconds, measured, method, stats, plan_seconds)


def _report(job: _Job, plan: _Plan, budget: Any, offload_text: str, stats: dict, seconds: float,
            plan_seconds: float, measured: int | None, method: str) -> Report:
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)}")
    if plan.exact:
        r.add("path", "exact: causal caches carried across chunks (same frames as VAE Decode)")
    else:
        r.add("path", "APPROXIMATE: overlapping temporal chunks decoded independently and cross-faded "
                      "(not a causal Wan VAE)")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    r.add("plan", plan.describe() if plan.exact else f"k = {plan.k} latent frames/chunk, overlap 1")
    if plan.exact:
        scope = "whole frame" if plan.tile is None else "one tile at a time (tile-major)"
        if plan.rollback:
            cache = f"{job.device}, {scope}, committed + next (an OOM resumes from the last chunk)"
        else:
            cache = f"{job.device}, {scope}, in place as ComfyUI (1x; an OOM decodes that tile again from frame 0)"
        if plan.store is not None:
            cache += f"; global part of every frame stored on the {plan.store}"
        r.add("cache", cache)
        avail = budget.available
        pct = plan.planned / avail if avail else math.inf
        over = " - OVER BUDGET (user setting)" if plan.over_budget else ""
        r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget, meta sizing){over}; "
                           f"planned in {fmt_seconds(plan_seconds)} (offload included)")
    r.add("measured", f"peak {fmt_bytes(measured)} ({method})" if measured is not None else method)
    r.add("time", f"{fmt_seconds(seconds)} ({stats.get('chunks', '?')} chunks)")
    if stats.get("shrinks") or stats.get("restarts"):
        r.add("oom", f"{stats.get('shrinks', 0)} re-plan(s), {stats.get('restarts', 0)} restart(s): finished with k = {stats.get('frames_per_chunk')}, tile "
                     f"{stats.get('tile')}")
    return r


# --------------------------------------------------------------------------------------------------
# Node


class TemporalChunkVideoDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=_comfy.CATEGORY,
            description=(
                "Decodes a video latent within a memory budget, a few latent frames at a time. Wan 2.1/2.2 decode "
                "exactly (causal caches carried across chunks: same frames as VAE Decode, no blinking at chunk "
                "borders); other video VAEs use overlapping chunks (approximate, said in the report)."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The video latent to decode (5-D: batch, channels, frames, "
                                "height, width). Image latents: use Tiled VAE Decode (VRAM Fit)."),
                io.Vae.Input("vae", tooltip="The video VAE used for decoding (Wan 2.1/2.2 exact; others "
                             "approximate)."),
                io.Int.Input("frames_per_chunk", default=0, min=0, max=4096, step=1,
                             tooltip="Latent frames decoded per step after the first (each gives 4 video "
                             "frames). 0 = auto: the fastest chunk whose predicted peak fits the budget."),
                io.Int.Input("tile_size", default=0, min=0, max=16384, step=8,
                             tooltip="Spatial tile side in output pixels (Wan only; exact with any size). "
                             "0 = auto: whole frames when they fit the budget, else the largest tiles that do."),
                io.Int.Input("budget_mb", default=0, min=0, max=1 << 22, step=64,
                             tooltip="Memory the decode may use on the VAE's device, in MB. 0 = the free memory "
                             "ComfyUI reports, minus a safety reserve."),
                io.Boolean.Input("unload_others", default=True,
                                 tooltip="Offload other models (diffusion model, text encoders) from the VAE's "
                                 "device first, as far as this decode needs the room."),
            ],
            outputs=[
                io.Image.Output(display_name="IMAGE", tooltip="The decoded frames as one image batch (same shape, "
                                "order and range as VAE Decode: batch x frames flattened)."),
                io.String.Output(display_name="report", tooltip="The plan report: exact or approximate, budget, "
                                 "chunk size, tiles, cache placement, predicted and measured peak, time."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, frames_per_chunk=0, tile_size=0, budget_mb=0, unload_others=True) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = decode(vae, samples, frames_per_chunk, tile_size, budget_mb, unload_others, node_id)
        text = result.report.text()
        log.info("%s", text)
        return io.NodeOutput(result.images, text, ui=ui.PreviewText(text))
