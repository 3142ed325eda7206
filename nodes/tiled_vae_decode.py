"""Tiled VAE Decode (VRAM Fit): decodes an image latent within a memory budget, exactly where it can.

Paths (chosen per run, reported in the plan report):

* **untiled**: ComfyUI's own decode (``first_stage_model.decode`` + ``process_output``, batched as the
  budget allows) when its predicted peak fits: it is the reference result and the fastest.
* **exact tiles** (GroupNorm KL decoders: SD1.x/SD2/SDXL/SD3/Flux and any ``comfy`` decoder of that
  structure, ComfyUI's own decode contract): ``memory.tiled_exact.decode_exact``: mid block on the
  whole latent, exact shared GroupNorm statistics, 1-px halos per segment; equal to the untiled decode
  up to float rounding. Tile size, recomputation and store placement come from
  ``memory.decode_plan`` (a cost model of the executor measured by meta sizing).
* **approximate tiles** (any other VAE, third-party ``comfy.sd.VAE`` subclasses included):
  ``memory.tiled_generic.decode_generic``: latent tiles with a halo derived from the decoder's
  convolutional reach, cropped (feathered inside the halo for decoders with global ops).

Batch items are decoded within the budget and written into one output buffer on ComfyUI's
intermediate device as they finish. Cancel is checked between tiles; an out-of-memory error inside a
tile shrinks the tile and resumes (executors), one outside a tile (mid block, store allocation, an
untiled pass) re-plans smaller and retries the unfinished items, outside the ``except`` block as
ComfyUI's own ``VAE.decode`` does.
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

from ..memory import decode_plan as dp
from ..memory import tiled_exact as te
from ..memory import tiled_generic as tg
from ..memory.calibration import calibrate_vae, cost_model_for, fit_grid, real_grid, vae_key
from ..memory.cost_model import CostModel
from ..memory.families import identify, model_name
from ..memory.geometry import Geometry, VaeGeometry
from ..memory.planner import ImpossibleBudgetError, Plan, plan_decode
from ..memory.reach import ReachReport, default_halo, traced_reach
from ..memory.report import Report, fmt_bytes, fmt_seconds
from ..memory.sizing import MetaSizer, decode_run
from ..memory.tracker import PeakTracker, rss_supported
from . import _comfy

log = logging.getLogger("vramfit.nodes.tiled_vae_decode")

NODE_ID = "VRAMFit_TiledVAEDecode"
DISPLAY_NAME = "Tiled VAE Decode (VRAM Fit)"
REPORT_NODE = "Tiled VAE Decode"
MIN_TILE_PX = 32
ATTENTION_MIN = 16 * 2**20
"""Smallest score-slice budget of the mid block's split attention."""
MAX_RETRIES = 3
"""Re-plans after an out-of-memory error outside a tile, per batch item."""

_FAULT_HOOK: Callable[[str, int], None] | None = None
"""Test hook: called as ``("tile", k)`` inside every tile attempt of the executors (after the tile's
inputs are loaded) and ``("pass", i)`` before every pass of the node (an untiled group or one item of
a tiled path); raise an out-of-memory exception there to exercise the recovery paths."""
MEASURE_CPU_TENSORS = False
"""Debug/tests: on CPU, count live tensor bytes of the decode with ``PeakTracker`` (dispatch mode, a
Python hook on every op). Off by default: the report then shows the process RSS high-water mark."""


# --------------------------------------------------------------------------------------------------
# Inputs


@dataclasses.dataclass(frozen=True)
class _Job:
    vae: Any
    z: torch.Tensor
    channels: int
    ratio: int
    out_hw: tuple[int, int]
    core: bool
    """ComfyUI's own decode contract (``first_stage_model.decode`` + ``process_output``)."""
    exact_reason: str | None
    """None when the exact executor supports the decoder (and the contract), else why not."""
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device


def _error(message: str) -> _comfy.NodeInputError:
    return _comfy.NodeInputError(REPORT_NODE, message)


def _spatial_ratio(vae: Any, channels: int) -> int:
    up = getattr(vae, "upscale_ratio", None)
    if isinstance(up, int) and up > 0:
        return up
    scale = getattr(vae, "latent_scale", None)  # ComfyUI_ExtraModels' EXVAE
    if isinstance(scale, (int, float)) and scale >= 1 and float(scale).is_integer():
        return int(scale)
    model = vae.first_stage_model
    with MetaSizer([model], getattr(vae, "vae_dtype", torch.float32), getattr(vae, "device", "cpu")):
        z = torch.empty((1, channels, 8, 8), dtype=getattr(vae, "vae_dtype", torch.float32), device=vae.device)
        out = model.decode(z)
        ratio = int(out.shape[-1]) // 8
    if ratio < 1:
        raise _error(f"cannot infer the VAE's spatial ratio (decode of an 8x8 latent gave {tuple(out.shape)})")
    return ratio


def _validate(vae: Any, samples: Any, tile_size: int, halo: int) -> _Job:
    if vae is None or getattr(vae, "first_stage_model", None) is None:
        raise _error("the VAE is invalid (None); if it comes from a checkpoint loader, the checkpoint has no VAE")
    z = samples.get("samples") if isinstance(samples, dict) else None
    if not isinstance(z, torch.Tensor):
        raise _error(f"samples must be a LATENT with a 'samples' tensor, got {type(samples).__name__}")
    shape = tuple(z.shape)
    video_hint = "use the Temporal-Chunk Video Decode (VRAM Fit) node for video latents"
    if z.ndim == 5:
        raise _error(f"latent {shape} is a 5-D video latent (B, C, T, H, W); this node decodes images: {video_hint}")
    if z.ndim != 4:
        raise _error(f"latent {shape} is not a 4-D image latent (B, C, H, W)")
    if min(shape) < 1:
        raise _error(f"latent {shape} is empty")
    core_attrs = hasattr(vae, "latent_channels")
    if core_attrs and int(getattr(vae, "latent_dim", 2)) != 2:
        kind = "a video" if int(vae.latent_dim) == 3 else "an audio/1-D"
        raise _error(f"this is {kind} VAE (latent_dim {vae.latent_dim}); latent {shape}: {video_hint}")
    channels = int(shape[1])
    if core_attrs and int(vae.latent_channels) != channels:
        raise _error(
            f"latent {shape} has {channels} channels but the VAE expects {vae.latent_channels}: wrong VAE for "
            f"this latent (a video latent flattened to 4-D? {video_hint})"
        )
    if tile_size < 0 or (tile_size and (tile_size % 8 or tile_size < MIN_TILE_PX)):
        raise _error(f"tile_size {tile_size}: use 0 (auto) or a multiple of 8 of at least {MIN_TILE_PX} px")
    if halo < -1:
        raise _error(f"halo {halo}: use -1 (auto: the decoder's convolutional reach) or >= 0 latent px")
    if hasattr(vae, "throw_exception_if_invalid"):
        vae.throw_exception_if_invalid()
    core = _comfy.has_core_decode(vae)
    model = vae.first_stage_model
    reason = te.unsupported_reason(model)
    if reason is None and not core:
        reason = f"{type(vae).__name__} overrides VAE.decode (its own post-processing is kept)"
    ratio = _spatial_ratio(vae, channels)
    dtype = getattr(vae, "vae_dtype", torch.float32)
    return _Job(
        vae=vae,
        z=z,
        channels=channels,
        ratio=ratio,
        out_hw=(int(shape[2]) * ratio, int(shape[3]) * ratio),
        core=core,
        exact_reason=reason,
        family=identify(vae) or model_name(vae),
        dtype=dtype,
        device=torch.device(vae.device),
        out_device=torch.device(_comfy.intermediate_device()),
    )


# --------------------------------------------------------------------------------------------------
# Cost models and reach


def _full_cost_model(job: _Job) -> CostModel:
    """Cost model of the untiled decode: shipped/cached for known families, else meta-calibrated once."""
    vae = job.vae
    store = _comfy.cost_model_store()
    if identify(vae) is not None:
        return cost_model_for(vae, store, executor="full", device=job.device, dtype=job.dtype)
    geo = VaeGeometry(job.family, job.ratio)
    model = vae.first_stage_model
    run = decode_run(model.decode, job.channels, job.dtype, job.device)

    def fit() -> CostModel:
        try:
            return calibrate_vae(vae, executor="full", run=run, mode="meta", geometries=fit_grid(geo),
                                 device=job.device, dtype=job.dtype)
        except Exception as e:  # noqa: BLE001 - an op without a fake kernel: calibrate with real decodes
            log.warning("meta sizing failed for %s (%s: %s); calibrating with real decodes", job.family,
                        type(e).__name__, e)
        if hasattr(vae, "patcher"):
            _comfy.load_vae_weights(vae, 0)
        return calibrate_vae(vae, executor="full", run=run, mode="real", geometries=real_grid(geo),
                             device=job.device, dtype=job.dtype)

    return store.get_or_calibrate(vae_key(vae, "full", job.device, job.dtype), fit)


_REACH: dict[str, tuple[ReachReport, bool]] = {}


def _reach(job: _Job) -> tuple[ReachReport, bool]:
    """Convolutional reach of the decoder (traced on fake tensors) and whether it has global ops."""
    model = job.vae.first_stage_model
    key = f"{job.family}/{type(model).__module__}.{type(model).__qualname__}/{job.channels}"
    if key not in _REACH:
        with MetaSizer([model], job.dtype, job.device):
            z = torch.empty((1, job.channels, 8, 8), dtype=job.dtype, device=job.device)
            report = traced_reach(model, lambda: model.decode(z), (8, 8))
        norms = any(isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) for m in model.modules())
        _REACH[key] = (report, report.has_global_ops or norms)
    return _REACH[key]


# --------------------------------------------------------------------------------------------------
# Progress over all passes


class _Progress:
    """One progress bar for the whole node: each pass's executor progress is offset by the units already
    done, and the total is what is done + the current pass's total + the passes still planned."""

    def __init__(self, node_id: str | None, total: int) -> None:
        self.done = 0
        self.total = max(1, int(total))
        self.bar = _comfy.progress_callback(self.total, node_id)
        self._base = 0
        self._rest = 0

    def start_pass(self, rest: int) -> Callable[[int, int], None]:
        """Callback for the next pass; ``rest``: units planned after it."""
        self._base, self._rest = self.done, int(rest)

        def cb(done: int, total: int) -> None:
            self.total = max(1, self._base + int(total) + self._rest)
            self.done = self._base + int(done)
            self.bar(self.done, self.total)

        return cb


# --------------------------------------------------------------------------------------------------
# Plans


@dataclasses.dataclass
class _Plan:
    path: str  # "untiled" | "exact" | "generic"
    description: str
    planned: int
    tracked: int
    full: Plan | None = None
    exact: dp.ExactChoice | None = None
    generic: Plan | None = None
    halo: int = 0
    feather: int = 0
    over_budget: bool = False


def _buffer_bytes(job: _Job) -> int:
    """The output buffer (B, H, W, C) float32 counts when it lives on the decode device's type."""
    b = int(job.z.shape[0])
    return b * job.out_hw[0] * job.out_hw[1] * 3 * 4 if job.out_device.type == job.device.type else 0


def _item_image_bytes(job: _Job) -> int:
    """One decoded image (1, 3, H, W) plus ``process_output``'s temporaries (float32)."""
    if job.out_device.type != job.device.type:
        return 0
    n = job.out_hw[0] * job.out_hw[1] * 3
    return n * (torch.empty((), dtype=job.dtype).element_size() + 12)


def _plan_untiled(job: _Job, full: CostModel, budget: int) -> _Plan | None:
    geo = VaeGeometry(job.family, job.ratio)
    extra = _buffer_bytes(job)
    try:
        p = plan_decode(tuple(job.z.shape), geo, budget - extra, full, allow_tiling=False)
    except ImpossibleBudgetError:
        return None
    g = Geometry(int(job.z.shape[2]), int(job.z.shape[3]), batch=p.images_per_pass, spatial_ratio=job.ratio)
    tracked = extra + full.predict_tracked(g)
    return _Plan("untiled", p.describe(), extra + p.predicted_peak, tracked, full=p)


class _ExactPlanner:
    """Lazily calibrated exact cost models + the mid phase of this latent, for ``choose_exact``."""

    def __init__(self, job: _Job, overhead: float, attention_bytes: int) -> None:
        self.job = job
        self.overhead = overhead
        self.attention_bytes = int(attention_bytes)
        """Score slices of the mid block's split attention (CPU path): ``_comfy.bounded_vae_attention``."""
        self.model = job.vae.first_stage_model
        self.latent_hw = (int(job.z.shape[2]), int(job.z.shape[3]))
        self._mid: dict[bool, int] = {}
        self.calibrated: list[str] = []

    def cost_model(self, recompute: bool, on_device: bool) -> dp.ExactCostModel:
        job = self.job
        key = dp.exact_key(self.model, job.dtype, job.device, recompute, on_device)

        def fit() -> dp.ExactCostModel:
            m = dp.calibrate_exact(self.model, job.channels, job.dtype, job.device, recompute=recompute,
                                   store_on_device=on_device)
            self.calibrated.append(f"{'recompute' if recompute else 'store'}/{'device' if on_device else 'host'} "
                                   f"{m.calibration_seconds:.1f} s")
            return m

        return _comfy.exact_cost_store().get_or_calibrate(key, fit)

    def mid(self, on_device: bool) -> int:
        if on_device not in self._mid:
            job = self.job
            try:
                with _comfy.bounded_vae_attention(self.model, self.attention_bytes):
                    self._mid[on_device] = dp.measure_mid_peak(self.model, self.latent_hw, job.channels,
                                                               job.dtype, job.device, on_device)
            except Exception as e:  # noqa: BLE001 - no fake kernel for some op: analytic, conservative
                log.warning("meta sizing of the mid block failed (%s: %s); using the analytic estimate",
                            type(e).__name__, e)
                est = te.estimate_exact_peak(self.model, (1, job.channels, *self.latent_hw), (8, 8),
                                             torch.empty((), dtype=job.dtype).element_size(), on_device)
                self._mid[on_device] = int(est["mid"])
        return self._mid[on_device]

    def predict(self, recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
        return self.cost_model(recompute, on_device).predict(self.model, self.latent_hw, tile, self.mid(on_device))

    def choose(self, budget: int, tile: int | None, exclude_whole: bool = False) -> dp.ExactChoice:
        job = self.job
        max_side = max(job.out_hw)
        return dp.choose_exact(
            self.predict,
            max_side,
            budget,
            allow_whole=not exclude_whole,
            overhead=self.overhead,
            extra_bytes=_buffer_bytes(job),
            post_bytes=_item_image_bytes(job),
            host_store=job.device.type != "cpu",
            tile=tile,
            what=f"latent {tuple(job.z.shape)}",
        )


def _plan_exact(planner: _ExactPlanner, budget: int, tile: int | None, exclude_whole: bool = False) -> _Plan:
    c = planner.choose(budget, tile, exclude_whole)
    return _Plan("exact", c.describe(), c.planned, c.tracked, exact=c, over_budget=not c.fits)


def _plan_generic(job: _Job, full: CostModel, budget: int, tile: int | None, halo: int, feather: int) -> _Plan:
    geo = VaeGeometry(job.family, job.ratio, halo=halo)
    extra = _buffer_bytes(job) + _item_image_bytes(job)
    shape = (1, *job.z.shape[1:])
    if tile is not None:
        t = max(1, tile // job.ratio)
        try:
            p = plan_decode(shape, geo, max(0, budget - extra), full, halo=halo, min_tile=1, max_tile=t,
                            split_batch=False)
            over = False
        except ImpossibleBudgetError as e:
            p = e.smallest
            over = True
    else:
        p = plan_decode(shape, geo, max(0, budget - extra), full, halo=halo, min_tile=8, split_batch=False)
        over = False
    g = Geometry(min(shape[2], p.tile_h + 2 * p.halo), min(shape[3], p.tile_w + 2 * p.halo), spatial_ratio=job.ratio)
    desc = p.describe() + (f", feather {feather} latent px" if feather and p.tiled else "")
    return _Plan("generic", desc, extra + p.predicted_peak, extra + full.predict_tracked(g), generic=p, halo=halo,
                 feather=feather if p.tiled else 0, over_budget=over)


# --------------------------------------------------------------------------------------------------
# Execution


def _tile_hook() -> Callable[[int], None] | None:
    hook = _FAULT_HOOK
    if hook is None:
        return None

    def fh(k: int) -> None:
        hook("tile", k)

    return fh


def _pass_hook(i: int) -> None:
    if _FAULT_HOOK is not None:
        _FAULT_HOOK("pass", i)


class _Run:
    def __init__(self, job: _Job, progress: _Progress) -> None:
        self.job = job
        self.progress = progress
        self.out: torch.Tensor | None = None
        self.oom_events: list[str] = []
        self.passes = 0

    def write(self, start: int, images: torch.Tensor) -> None:
        """``images``: (n, H, W, C) on [0, 1]; the output buffer is allocated by the first pass."""
        if self.out is None:
            b = int(self.job.z.shape[0])
            self.out = torch.empty((b, *images.shape[1:]), dtype=torch.float32, device=self.job.out_device)
        self.out[start : start + images.shape[0]].copy_(images)

    def latent(self, a: int, b: int) -> torch.Tensor:
        """As ComfyUI's ``VAE.decode`` feeds the decoder: in the VAE's dtype, on its device."""
        return self.job.z[a:b].to(self.job.dtype).to(self.job.device)

    def untiled_pass(self, a: int, b: int) -> None:
        job = self.job
        _comfy.should_stop()
        self.passes += 1
        _pass_hook(self.passes - 1)
        if job.core:
            z = self.latent(a, b)
            out = job.vae.first_stage_model.decode(z).to(job.out_device).float()
            del z
            images = job.vae.process_output(out).movedim(1, -1)
        else:
            images = job.vae.decode(job.z[a:b]).to(job.out_device).float()
            if images.ndim == 5:
                images = images.reshape(-1, *images.shape[-3:])
        self.write(a, images)

    def exact_item(self, b: int, c: dp.ExactChoice, cb: Callable[[int, int], None], attention_bytes: int) -> None:
        job = self.job
        self.passes += 1
        _pass_hook(self.passes - 1)
        store = job.device if c.store_on_device else torch.device("cpu")
        with _comfy.bounded_vae_attention(job.vae.first_stage_model, attention_bytes):
            img = self._decode_exact(b, c, store, cb)
        images = job.vae.process_output(img.float()).movedim(1, -1)
        del img
        self.write(b, images)

    def _decode_exact(self, b: int, c: dp.ExactChoice, store: torch.device,
                      cb: Callable[[int, int], None]) -> torch.Tensor:
        job = self.job
        return te.decode_exact(
            job.vae.first_stage_model,
            self.latent(b, b + 1),
            c.tile,
            store_device=store,
            compute_device=job.device,
            out_device=job.out_device,
            recompute=c.recompute,
            progress=cb,
            should_stop=_comfy.should_stop,
            fault_hook=_tile_hook(),
            oom_exceptions=_comfy.oom_exceptions(),
            on_oom=self._tile_oom,
            norm_params=_comfy.group_norm_params,
        )

    def generic_item(self, b: int, p: _Plan, cb: Callable[[int, int], None]) -> None:
        job = self.job
        self.passes += 1
        _pass_hook(self.passes - 1)
        g = p.generic
        assert g is not None
        if job.core:
            model = job.vae.first_stage_model

            def fn(t: torch.Tensor) -> torch.Tensor:
                return model.decode(t.to(job.dtype).to(job.device)).to(job.out_device).float()
        else:

            def fn(t: torch.Tensor) -> torch.Tensor:
                return job.vae.decode(t).movedim(-1, 1).to(job.out_device).float()

        img = tg.decode_generic(
            fn,
            job.z[b : b + 1],
            (g.tile_h, g.tile_w),
            p.halo,
            scale=job.ratio,
            out_device=job.out_device,
            out_dtype=torch.float32,
            feather=p.feather,
            progress=cb,
            should_stop=_comfy.should_stop,
            fault_hook=_tile_hook(),
            oom_exceptions=_comfy.oom_exceptions(),
            on_oom=self._tile_oom,
        )
        images = job.vae.process_output(img) if job.core else img
        self.write(b, images.movedim(1, -1))

    def _tile_oom(self) -> None:
        self.oom_events.append("out of memory inside a tile: tile halved, decode resumed")
        _comfy.on_oom()


def _units_of(job: _Job, p: _Plan) -> int:
    """Progress units of one batch item under plan ``p``."""
    if p.path == "exact":
        assert p.exact is not None
        return te.count_exact_steps(job.vae.first_stage_model, (1, *job.z.shape[1:]), p.exact.tile, p.exact.recompute)
    if p.path == "generic":
        assert p.generic is not None
        return tg.count_generic_steps((1, *job.z.shape[1:]), (p.generic.tile_h, p.generic.tile_w))
    return 1


def _fallback(job: _Job, p: _Plan, planner: _ExactPlanner | None, full: CostModel, budget: int,
              reach: tuple[int, int]) -> _Plan:
    """A smaller plan after an out-of-memory error outside a tile."""
    if p.path == "untiled":
        smaller = min(budget, p.planned // 2)
        if planner is not None:
            try:
                return _plan_exact(planner, smaller, None, exclude_whole=True)
            except ImpossibleBudgetError:
                return _plan_exact(planner, smaller, dp.MIN_AUTO_TILE)
        try:
            return _plan_generic(job, full, smaller, None, *reach)
        except ImpossibleBudgetError:
            return _plan_generic(job, full, smaller, 8 * job.ratio, *reach)
    if p.path == "exact":
        assert p.exact is not None and planner is not None
        c = p.exact
        if not c.recompute:
            nxt = (True, c.store_on_device, c.tile)
        elif c.store_on_device and job.device.type != "cpu":
            nxt = (False, False, c.tile)
        else:
            nxt = (c.recompute, c.store_on_device, max(te.MIN_TILE, c.tile // 2))
        rec, on_dev, tile = nxt
        pk = planner.predict(rec, on_dev, tile)
        choice = dataclasses.replace(c, tile=tile, recompute=rec, store_on_device=on_dev, peak=pk,
                                     whole=tile >= max(job.out_hw))
        return _Plan("exact", choice.describe(), p.planned, p.tracked, exact=choice, over_budget=p.over_budget)
    g = p.generic
    assert g is not None
    return _plan_generic(job, full, budget // 2, max(8 * job.ratio, g.tile_h * job.ratio // 2), p.halo, p.feather)


# --------------------------------------------------------------------------------------------------
# The decode


@dataclasses.dataclass
class DecodeResult:
    images: torch.Tensor
    report: Report
    plan: _Plan
    budget: Any
    seconds: float
    """Decode time (the passes), without planning."""
    plan_seconds: float
    """Validation, cost models (a first-use calibration included), offload, budget and plan."""
    measured_peak: int | None
    measure_method: str
    oom_events: list[str]
    calibrations: list[str]


def decode(
    vae: Any,
    samples: dict,
    tile_size: int = 0,
    halo: int = -1,
    budget_mb: int = 0,
    unload_others: bool = True,
    node_id: str | None = None,
) -> DecodeResult:
    """Everything the node does; returns the images (B, H, W, C) on [0, 1] and the report."""
    t_plan = time.perf_counter()
    job = _validate(vae, samples, int(tile_size), int(halo))
    vae = job.vae
    full = _full_cost_model(job)
    overhead = float(full.overhead)
    user_tile = int(tile_size) or None

    # Generic path parameters: halo from the decoder's convolutional reach, feather for global decoders.
    reach_text = ""
    g_halo, g_feather = 0, 0
    if job.exact_reason is not None:
        report_reach, global_ops = _reach(job)
        g_halo = default_halo(report_reach) if halo < 0 else int(halo)
        g_feather = g_halo // 2 if global_ops else 0
        reach_text = f"{report_reach.describe()}; halo {g_halo} latent px{' (auto)' if halo < 0 else ''}"

    # Offload upstream models for the fastest plan's need (what ComfyUI's own decode would need).
    offload_text = "off (unload_others disabled)"
    if unload_others and hasattr(vae, "patcher"):
        ideal = _buffer_bytes(job) + full.predict(
            Geometry(int(job.z.shape[2]), int(job.z.shape[3]), batch=1, spatial_ratio=job.ratio)
        )
        need = ideal if not budget_mb else min(ideal, int(budget_mb) * 2**20)
        weights = 0
        patcher = getattr(vae, "patcher", None)
        if patcher is not None:
            weights = max(0, int(patcher.model_size()) - int(patcher.loaded_size()))
        offload_text = _comfy.offload_others(vae, need + weights, "needed").describe()
    elif unload_others:
        offload_text = "skipped (this VAE has no ComfyUI model patcher)"

    budget = _comfy.vae_budget(vae, budget_mb)
    avail = int(budget.available)
    # The mid block's split attention (CPU) gets at most a quarter of the budget for its score slices.
    planner = _ExactPlanner(job, overhead, max(ATTENTION_MIN, avail // 4)) if job.exact_reason is None else None
    reach_pair = (g_halo, g_feather)
    try:
        plan = None if user_tile else _plan_untiled(job, full, avail)
        if plan is None:
            if planner is not None:
                plan = _plan_exact(planner, avail, user_tile)
            else:
                plan = _plan_generic(job, full, avail, user_tile, g_halo, g_feather)
    except ImpossibleBudgetError as e:
        raise _error(f"{e} (budget: {budget.describe()})") from e

    if hasattr(vae, "patcher"):
        _comfy.load_vae_weights(vae, plan.planned)

    plan_seconds = time.perf_counter() - t_plan
    b_total = int(job.z.shape[0])
    progress = _Progress(node_id, b_total * (_units_of(job, plan) if plan.path != "untiled" else 1))
    run = _Run(job, progress)
    method, tracker = _tracker(job)
    t0 = time.perf_counter()
    # ComfyUI runs nodes under inference_mode; direct callers (tests, scripts) may not: no autograd graph.
    with torch.no_grad(), tracker if tracker is not None else contextlib.nullcontext():
        plan = _execute(run, job, plan, planner, full, avail, reach_pair)
    assert run.out is not None
    seconds = time.perf_counter() - t0
    measured = int(tracker.peak_bytes) if tracker is not None else None

    calibrated = planner.calibrated if planner is not None else []
    report = _report(job, plan, budget, offload_text, reach_text, seconds, plan_seconds, measured, method, run,
                     calibrated)
    return DecodeResult(run.out, report, plan, budget, seconds, plan_seconds, measured, method, run.oom_events,
                        calibrated)


def _tracker(job: _Job) -> tuple[str, PeakTracker | None]:
    if job.device.type == "cuda":
        return "CUDA max_memory_allocated", PeakTracker(job.device, method="cuda")
    if job.device.type == "cpu":
        if MEASURE_CPU_TENSORS:
            return "live tensor bytes (PeakTracker dispatch)", PeakTracker(job.device, method="dispatch")
        if rss_supported():
            return "process RSS high-water mark", PeakTracker(job.device, method="rss")
    return "not measured on this device", None


def _execute(run: _Run, job: _Job, plan: _Plan, planner: _ExactPlanner | None, full: CostModel, budget: int,
             reach: tuple[int, int]) -> _Plan:
    """Decode every batch item (untiled groups or tiled items) into the output buffer. Out of memory
    outside a tile: re-plan smaller and retry the unfinished items, outside the ``except`` block (the
    failed pass's frames and tensors are released first). Returns the plan that finished."""
    b_total = int(job.z.shape[0])
    start = 0
    retries = 0
    oom_types = _comfy.oom_exceptions()
    while start < b_total:
        if plan.path == "untiled":
            assert plan.full is not None
            stop = min(b_total, start + plan.full.images_per_pass)
            rest = b_total - stop
        else:
            stop = start + 1
            rest = (b_total - stop) * _units_of(job, plan)
        cb = run.progress.start_pass(rest)
        oom = False
        what = ""
        try:
            if plan.path == "untiled":
                cb(0, stop - start)
                run.untiled_pass(start, stop)
                cb(stop - start, stop - start)
            elif plan.path == "exact":
                assert plan.exact is not None
                assert planner is not None
                run.exact_item(start, plan.exact, cb, planner.attention_bytes)
            else:
                run.generic_item(start, plan, cb)
        except oom_types as e:
            if retries >= MAX_RETRIES:
                raise
            oom = True
            what = f"{type(e).__name__} in the {plan.path} pass of item(s) {start}..{stop - 1}"
        if oom:
            _comfy.on_oom()
            retries += 1
            old = plan.description
            plan = _fallback(job, plan, planner, full, budget, reach)
            run.oom_events.append(f"{what}: re-planned ({old} -> {plan.description}); retrying")
            log.warning("Tiled VAE Decode: %s", run.oom_events[-1])
            continue
        start = stop
    return plan


# --------------------------------------------------------------------------------------------------
# Report


def _report(job: _Job, plan: _Plan, budget: Any, offload_text: str, reach_text: str, seconds: float,
            plan_seconds: float, measured: int | None, method: str, run: _Run, calibrated: list[str]) -> Report:
    b = int(job.z.shape[0])
    h, w = job.out_hw
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)} -> "
                 f"{b} x {h}x{w} px")
    if plan.path == "untiled":
        whose = "ComfyUI's own decode" if job.core else f"{type(job.vae).__name__}'s own decode"
        path = f"exact: untiled, {whose} (it fits the budget; identical to VAE Decode)"
    elif plan.path == "exact":
        path = ("exact: layer-synchronous tiles, shared GroupNorm statistics, mid block on the whole latent "
                "(equal to the untiled decode up to float rounding)")
    else:
        path = f"approximate: generic tiles with halo and crop (not exact because: {job.exact_reason})"
    r.add("path", path)
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    plan_text = plan.description
    if plan.path == "exact":
        plan_text += f", {b} image{'s' if b != 1 else ''} one after another"
    r.add("plan", plan_text)
    if reach_text:
        r.add("halo", reach_text)
    pct = plan.planned / budget.available if budget.available else math.inf
    over = " - OVER BUDGET (user tile)" if plan.over_budget else ""
    where = f", at {plan.exact.peak.segment}" if plan.exact is not None else ""
    r.add("predicted", f"peak {fmt_bytes(plan.planned)} ({pct:.0%} of budget){over}; tensor-level "
                       f"{fmt_bytes(plan.tracked)}{where}")
    r.add("measured", f"peak {fmt_bytes(measured)} ({method})" if measured is not None else method)
    r.add("time", f"{fmt_seconds(seconds)} decoding ({run.passes} pass{'es' if run.passes != 1 else ''}), "
                  f"{fmt_seconds(plan_seconds)} planning")
    if calibrated:
        r.add("calibrated", "exact cost model (meta sizing): " + ", ".join(calibrated))
    if run.oom_events:
        r.add("oom", "\n".join(run.oom_events))
    return r


# --------------------------------------------------------------------------------------------------
# Node


class TiledVAEDecode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=NODE_ID,
            display_name=DISPLAY_NAME,
            category=_comfy.CATEGORY,
            description=(
                "Decodes an image latent within a memory budget. GroupNorm KL VAEs (SD1.x/SD2/SDXL/SD3/Flux) "
                "decode exactly (same image as VAE Decode, no seams) in tiles sized from free memory; other "
                "VAEs use single-pass tiles with a halo from the decoder's reach (approximate)."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The image latent to decode (4-D; video latents: use the "
                                "Temporal-Chunk Video Decode node)."),
                io.Vae.Input("vae", tooltip="The VAE used for decoding."),
                io.Int.Input("tile_size", default=0, min=0, max=16384, step=8,
                             tooltip="Tile side in output pixels (at every decoder level). 0 = auto: the largest "
                             "tile whose predicted peak fits the budget (untiled when the whole decode fits)."),
                io.Int.Input("halo", default=-1, min=-1, max=256, step=1,
                             tooltip="Approximate path only: latent pixels of context around each tile. -1 = "
                             "auto, the decoder's convolutional reach computed from its modules. The exact "
                             "path needs no halo setting."),
                io.Int.Input("budget_mb", default=0, min=0, max=1 << 22, step=64,
                             tooltip="Memory the decode may use on the VAE's device, in MB. 0 = the free memory "
                             "ComfyUI reports, minus a safety reserve."),
                io.Boolean.Input("unload_others", default=True,
                                 tooltip="Offload other models (diffusion model, text encoders) from the VAE's "
                                 "device first, as far as this decode needs the room."),
            ],
            outputs=[
                io.Image.Output(display_name="IMAGE", tooltip="The decoded images (same shape, dtype and range "
                                "as VAE Decode)."),
                io.String.Output(display_name="report", tooltip="The plan report: path (exact or approximate), "
                                 "budget, offload, tiles, predicted and measured peak, time."),
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, tile_size=0, halo=-1, budget_mb=0, unload_others=True) -> io.NodeOutput:
        node_id = cls.hidden.unique_id if cls.hidden is not None else None
        result = decode(vae, samples, tile_size, halo, budget_mb, unload_others, node_id)
        text = result.report.text()
        log.info("%s", text)
        return io.NodeOutput(result.images, text, ui=ui.PreviewText(text))
