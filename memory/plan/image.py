"""Planning an image decode: the job (what to decode, which paths the decoder allows, the user's settings),
the models plans come from (:class:`ImageModels`: untiled decode, exact executor, reach), :func:`plan` (the
fastest of untiled / exact tiles / approximate tiles that fits) and the smaller plan to take after an
out-of-memory error (:func:`fallback`)."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..budget import host_refused_text
from ..cost import exact as dp
from ..cost.calibration import Subject, cost_model_for, subject
from ..cost.phases import CostModel
from ..executors import kl_exact as te
from ..geometry import Geometry, VaeGeometry
from ..measure.reach import ReachReport, default_halo, traced_reach
from ..measure.sizing import MetaSizer
from ..vae.families import batch_coupling_hint, identify, model_name, structure_digest
from ..vae.kl_layout import BoundLayout, kl_layout, unsupported_reason
from ..vae.split_layout import split_layout
from . import exact as pe
from .grid import ImpossibleBudgetError, plan_tiling, scaled
from .split import SplitPlanner, plan_split, split_planner
from .types import Plan

log = logging.getLogger("vramfit.memory.plan.image")

__all__ = ["ExactPlanner", "ImageJob", "ImageModels", "decoded_geometry", "fallback", "full_cost_model", "ideal_bytes",
           "image_models", "make_job", "plan", "plan_exact", "plan_generic", "plan_untiled", "reach", "spatial_ratio", "splits_batch"]

ATTENTION_MIN = 16 * 2**20
"""Smallest score-slice budget of the mid block's split attention."""

# --------------------------------------------------------------------------------------------------
# The job


@dataclasses.dataclass(frozen=True)
class ImageJob:
    vae: Any
    z: torch.Tensor
    channels: int
    ratio: int
    out_hw: tuple[int, int]
    core: bool
    """The VAE's decode is ComfyUI's own contract (``first_stage_model.decode`` + ``process_output``)."""
    exact_reason: str | None
    """None when the exact executor supports the decoder (and the contract), else why not."""
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device
    subject: Subject
    """The VAE as its cost models see it (identified once, here)."""
    tile_size: int = 0
    """The user's tile side in output px (0: auto, untiled when it fits)."""
    halo: int = -1
    """The user's context per tile of the approximate path in latent px (-1: the decoder's reach)."""
    split_reason: str | None = "not checked"
    """None when the decoder is a global prefix and a local suffix (:mod:`..vae.split_layout`) and the exact
    walker does not apply, else why not."""
    whole_batch: bool = False
    """The exact walker decodes the whole batch in one pass (a decoder that mixes its batch as one video's frames:
    SVD's temporal decoder; :attr:`..vae.kl_layout.KlLayout.video`), so its exact path never splits the batch."""
    batch_hint: str = ""
    """A structural hint that the decoder mixes the items of its batch (:func:`..vae.families.batch_coupling_hint`,
    read once in :func:`make_job`; "" when none is seen): only a hint, the batch self-check is the proof."""
    batch_reason: str = ""
    """Not empty: the decoder's output for one item depends on the other items of its batch (SVD's temporal
    decoder), or that could not be ruled out; why (the batch self-check's verdict). Only the whole batch in one
    pass is then exact (:func:`plan`)."""
    host_room: int | None = None
    """Bytes a store in host memory may take (:func:`..budget.host_room`, set after the offload; None: unbounded)."""
    out_channels: int = 3
    """Channels of the decoded image (:func:`decoded_geometry`: 4 for Qwen-Image 2.1's RGBA VAE)."""
    walkers: tuple[BoundLayout, ...] = ()
    """The exact walker's layouts of the decoder bound to it, by ``recompute`` (``walkers[c.recompute]``: stored,
    recomputed; walked once, in :func:`make_job`; empty without exact tiles)."""


def spatial_ratio(vae: Any, channels: int) -> int:
    """Output px per latent px: ``upscale_ratio``, ``latent_scale`` (ComfyUI_ExtraModels' EXVAE), else
    a meta-sized decode of an 8x8 latent. Raises ValueError when it cannot be inferred."""
    up = getattr(vae, "upscale_ratio", None)
    if isinstance(up, int) and up > 0:
        return up
    scale = getattr(vae, "latent_scale", None)
    if isinstance(scale, (int, float)) and scale >= 1 and float(scale).is_integer():
        return int(scale)
    model = vae.first_stage_model
    with MetaSizer([model], getattr(vae, "vae_dtype", torch.float32), getattr(vae, "device", "cpu")):
        z = torch.empty((1, channels, 8, 8), dtype=getattr(vae, "vae_dtype", torch.float32), device=vae.device)
        out = model.decode(z)
        ratio = int(out.shape[-1]) // 8
    if ratio < 1:
        raise ValueError(f"cannot infer the VAE's spatial ratio (decode of an 8x8 latent gave {tuple(out.shape)})")
    return ratio


_DECODED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoded_geometry(vae: Any, channels: int) -> tuple[int, int]:
    """``(spatial ratio, channels)`` of what the decoder gives (VAE Decode returns it as it comes): a meta-sized
    decode of an 8x8 latent, once per model object; the VAE's own ``upscale_ratio`` (:func:`spatial_ratio`) and
    ``output_channels`` (3) when the decoder cannot run on fake tensors. A decoder that disagrees with what its VAE
    declares (the newest ``sd.py``'s Qwen-Image 2.1 TAESD over an older ``taesd.py``: 16x RGBA declared, 8x RGB
    decoded) is logged; its own output decides."""
    model = vae.first_stage_model
    key = (int(channels), str(getattr(vae, "vae_dtype", torch.float32)))
    try:
        per = _DECODED.setdefault(model, {})
    except TypeError:
        per = {}
    if key not in per:
        per[key] = _measured_geometry(vae, channels)
    return per[key]


def _measured_geometry(vae: Any, channels: int) -> tuple[int, int]:
    model = vae.first_stage_model
    declared = (spatial_ratio(vae, channels), int(getattr(vae, "output_channels", 3) or 3))
    dtype = getattr(vae, "vae_dtype", torch.float32)
    try:
        with torch.inference_mode(), MetaSizer([model], dtype, getattr(vae, "device", "cpu")):
            out = model.decode(torch.empty((1, channels, 8, 8), dtype=dtype, device=vae.device))
            found = (int(out.shape[-1]) // 8, int(out.shape[1]))
            del out
    except Exception as e:  # noqa: BLE001 - an op without a fake kernel: the VAE's own attributes
        log.debug("meta decode of %s failed (%s: %s); its declared geometry is used", model_name(vae),
                  type(e).__name__, e)
        return declared
    if found[0] < 1:
        return declared
    if found != declared:
        log.warning("%s decodes %d channels at %dx, its VAE declares %d channels at %dx: the decoder's own output is "
                    "what VAE Decode returns, so it is used", model_name(vae), found[1], found[0], declared[1],
                    declared[0])
    return found


def make_job(vae: Any, z: torch.Tensor, *, core: bool, out_device: torch.device | str, tile_size: int = 0,
             halo: int = -1) -> ImageJob:
    """The job of decoding the 4-D latent ``z`` (inputs already validated). ``core``: ``vae`` keeps
    ComfyUI's ``VAE.decode`` contract; ``out_device``: where the images are assembled; ``tile_size``,
    ``halo``: the user's settings (:attr:`ImageJob.tile_size`, :attr:`ImageJob.halo`)."""
    channels = int(z.shape[1])
    reason = unsupported_reason(vae.first_stage_model)
    if reason is None and not core:
        reason = f"{type(vae).__name__} overrides VAE.decode (its own post-processing is kept)"
    model = vae.first_stage_model
    split_reason = "the exact walker applies" if reason is None else split_layout(model).reason
    walkers = tuple(kl_layout(model, recompute).bind(model) for recompute in (False, True)) if reason is None else ()
    whole_batch = bool(walkers) and walkers[0].layout.video
    ratio, out_channels = decoded_geometry(vae, channels)
    family = identify(vae) or model_name(vae)
    dtype = getattr(vae, "vae_dtype", torch.float32)
    device = torch.device(vae.device)
    return ImageJob(
        vae=vae,
        z=z,
        channels=channels,
        ratio=ratio,
        out_hw=(int(z.shape[2]) * ratio, int(z.shape[3]) * ratio),
        core=core,
        exact_reason=reason,
        family=family,
        dtype=dtype,
        device=device,
        out_device=torch.device(out_device),
        subject=subject(vae, family=family, spatial_ratio=ratio, channels=channels, device=device, dtype=dtype),
        tile_size=int(tile_size),
        halo=int(halo),
        split_reason=split_reason,
        whole_batch=whole_batch,
        batch_hint=batch_coupling_hint(model),
        out_channels=out_channels,
        walkers=walkers,
    )


# --------------------------------------------------------------------------------------------------
# Cost models and reach


def full_cost_model(job: ImageJob, env: Any, load: Callable[[], None] | None = None,
                    first_use: Any = None) -> CostModel:
    """Cost model of the untiled decode: shipped/cached for its key, else calibrated once (meta sizing; real
    decodes, after ``load()`` puts the weights on the device, when the decoder cannot run on fake tensors;
    a ``first_use`` phase)."""
    return cost_model_for(job.subject, env.cost_models, before_real=load, first_use=first_use)


_REACH: dict[str, tuple[ReachReport, bool]] = {}


def reach(job: ImageJob) -> tuple[ReachReport, bool]:
    """Convolutional reach of the decoder (traced on fake tensors) and whether it has global ops."""
    model = job.vae.first_stage_model
    key = f"{job.family}/{type(model).__module__}.{type(model).__qualname__}/{structure_digest(model)}/{job.channels}"
    if key not in _REACH:
        with MetaSizer([model], job.dtype, job.device):
            z = torch.empty((1, job.channels, 8, 8), dtype=job.dtype, device=job.device)
            report = traced_reach(model, lambda: model.decode(z), (8, 8))
        norms = any(isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm)) for m in model.modules())
        _REACH[key] = (report, report.has_global_ops or norms)
    return _REACH[key]


# --------------------------------------------------------------------------------------------------
# Plans


def buffer_bytes(job: ImageJob) -> int:
    """The output buffer (B, H, W, C) float32 counts when it lives on the decode device's type."""
    b = int(job.z.shape[0])
    return b * job.out_hw[0] * job.out_hw[1] * job.out_channels * 4 if job.out_device.type == job.device.type else 0


def ideal_bytes(job: ImageJob, full: CostModel) -> int:
    """What the fastest plan needs: the untiled decode of one batch item (+ the output buffer); of the whole batch
    for a decoder whose structure says it mixes its batch (:attr:`ImageJob.batch_hint`: only that is its result, so
    the offload before the decode makes room for it)."""
    b = int(job.z.shape[0]) if job.batch_hint else 1
    g = Geometry(int(job.z.shape[2]), int(job.z.shape[3]), batch=b, spatial_ratio=job.ratio)
    return buffer_bytes(job) + full.predict(g)


def item_image_bytes(job: ImageJob) -> int:
    """One decoded image (1, C, H, W) plus ``process_output``'s temporaries (float32)."""
    if job.out_device.type != job.device.type:
        return 0
    n = job.out_hw[0] * job.out_hw[1] * job.out_channels
    return n * (torch.empty((), dtype=job.dtype).element_size() + 12)


def plan_untiled(job: ImageJob, full: CostModel, budget: int, whole_batch: bool = False) -> Plan | None:
    """The VAE's own decode, as many batch items per pass as fit (``whole_batch``: all of them in one pass);
    None when that does not fit."""
    geo = VaeGeometry(job.family, job.ratio)
    extra = buffer_bytes(job)
    try:
        p = plan_tiling(tuple(job.z.shape), geo, budget - extra, full, allow_tiling=False,
                        split_batch=not whole_batch)
    except ImpossibleBudgetError:
        return None
    g = Geometry(int(job.z.shape[2]), int(job.z.shape[3]), batch=p.images_per_pass, spatial_ratio=job.ratio)
    tracked = extra + full.predict_tracked(g)
    return Plan("untiled", p, p.describe(), extra + p.predicted_peak, tracked)


class ExactPlanner:
    """Lazily calibrated exact cost models + the mid phase of this latent, for ``choose_exact``."""

    def __init__(self, job: ImageJob, env: Any, overhead: float, attention_bytes: int,
                 first_use: Any = None) -> None:
        self.job = job
        self.env = env
        self.overhead = overhead
        self.attention_bytes = int(attention_bytes)
        """Score slices of the mid block's split attention (CPU path): ``env.attention``."""
        self.model = job.vae.first_stage_model
        self.latent_hw = (int(job.z.shape[2]), int(job.z.shape[3]))
        self._mid: dict[bool, int] = {}
        self.calibrated: list[str] = []
        self.first_use = first_use
        """A :class:`..decode.first_use.FirstUse` that shows and times calibrations (None: silent)."""
        self.host_refused = 0
        """The largest host-memory store refused for the host's RAM (bytes; 0: none), for the plan row."""

    def cost_model(self, recompute: bool, on_device: bool) -> dp.ExactCostModel:
        job = self.job
        key = dp.exact_key(self.model, job.dtype, job.device, recompute, on_device)

        def fit() -> dp.ExactCostModel:
            m = dp.calibrate_exact(self.model, job.channels, job.dtype, job.device, recompute=recompute,
                                   store_on_device=on_device)
            self.calibrated.append(f"{'recompute' if recompute else 'store'}/{'device' if on_device else 'host'} "
                                   f"{m.calibration_seconds:.1f} s")
            return m

        what = f"calibrating the memory model of exact tiles ({'recompute' if recompute else 'store'})"
        run = fit if self.first_use is None else lambda: self.first_use.run(what, fit)
        return self.env.exact_cost_models.get_or_calibrate(key, run)

    def mid(self, on_device: bool) -> int:
        if on_device not in self._mid:
            job = self.job
            try:
                with self.env.attention(self.model, self.attention_bytes):
                    self._mid[on_device] = dp.measure_mid_peak(self.model, self.latent_hw, job.channels,
                                                               job.dtype, job.device, on_device)
            except Exception as e:  # noqa: BLE001 - no fake kernel for some op: analytic, conservative
                log.warning("meta sizing of the mid block failed (%s: %s); using the analytic estimate",
                            type(e).__name__, e)
                est = dp.estimate_exact_peak(self.model, (1, job.channels, *self.latent_hw), (8, 8),
                                             torch.empty((), dtype=job.dtype).element_size(), on_device)
                self._mid[on_device] = int(est["mid"])
        return self._mid[on_device]

    def predict(self, recompute: bool, on_device: bool, tile: int) -> dp.ExactPeak:
        peak = self.cost_model(recompute, on_device).predict(self.model, self.latent_hw, tile, self.mid(on_device))
        if not self.job.whole_batch:
            return peak
        # One pass of the whole batch (a video decoder's frames): its stores, tiles (every frame of a region) and
        # mid block hold every item: the one-item figures times the batch.
        b = int(self.job.z.shape[0])
        return dataclasses.replace(peak, tracked=peak.tracked * b, store=peak.store * b, work=peak.work * b,
                                   mid=peak.mid * b)

    def host_fits(self, recompute: bool, tile: int) -> bool:
        """Whether the store in host memory at ``tile`` fits the job's :attr:`ImageJob.host_room` (the store
        holds what the device store would: its predicted bytes)."""
        room = self.job.host_room
        if room is None:
            return True
        need = self.predict(recompute, True, tile).store
        if need <= room:
            return True
        self.host_refused = max(self.host_refused, need)
        return False

    def host_note(self, c: pe.ExactChoice) -> str:
        """The plan row's words when a store in host memory was refused for the host's RAM."""
        if not self.host_refused or not c.store_on_device:
            return ""
        return host_refused_text(self.host_refused, self.job.host_room)

    def _terms(self) -> dict[str, Any]:
        """What every configuration's figures add to its predicted peak (:func:`.exact.exact_choice`)."""
        job = self.job
        items = int(job.z.shape[0]) if job.whole_batch else 1
        return {"max_side": max(job.out_hw), "overhead": self.overhead, "extra_bytes": buffer_bytes(job),
                "post_bytes": item_image_bytes(job) * items}

    def choose(self, budget: int, tile: int | None, exclude_whole: bool = False) -> pe.ExactChoice:
        """The fastest configuration that fits (:func:`.exact.choose_exact`)."""
        job = self.job
        return pe.choose_exact(self.predict, budget=budget, allow_whole=not exclude_whole,
                               host_store=job.device.type != "cpu", host_fits=self.host_fits, tile=tile, what=f"latent {tuple(job.z.shape)}",
                               **self._terms())

    def choice(self, recompute: bool, on_device: bool, tile: int, budget: int) -> pe.ExactChoice:
        """One given configuration with its figures (the out-of-memory re-plan's next step)."""
        return pe.exact_choice(self.predict(recompute, on_device, tile), tile, recompute, on_device, budget=budget,
                               **self._terms())


def _exact(c: pe.ExactChoice, planner: ExactPlanner) -> Plan:
    return Plan("exact", c, c.describe() + planner.host_note(c), c.planned, c.tracked, over_budget=not c.fits,
                units=c.peak.steps)


def plan_exact(planner: ExactPlanner, budget: int, tile: int | None, exclude_whole: bool = False) -> Plan:
    """The exact executor's fastest configuration that fits (:func:`.exact.choose_exact`)."""
    c = planner.choose(budget, tile, exclude_whole)
    return _exact(c, planner)


def plan_generic(job: ImageJob, full: CostModel, budget: int, tile: int | None, halo: int,
                 feather: int) -> Plan:
    """Approximate tiles with ``halo`` latent px of context (the largest that fit, or the user's ``tile``)."""
    geo = VaeGeometry(job.family, job.ratio, halo=halo)
    extra = buffer_bytes(job) + item_image_bytes(job)
    shape = (1, *job.z.shape[1:])
    if tile is not None:
        t = max(1, tile // job.ratio)
        try:
            p = plan_tiling(shape, geo, max(0, budget - extra), full, halo=halo, min_tile=1, max_tile=t,
                            split_batch=False)
            over = False
        except ImpossibleBudgetError as e:
            p = e.smallest
            over = True
    else:
        p = plan_tiling(shape, geo, max(0, budget - extra), full, halo=halo, min_tile=8, split_batch=False)
        over = False
    g = Geometry(min(shape[2], p.tile_h + 2 * p.halo), min(shape[3], p.tile_w + 2 * p.halo), spatial_ratio=job.ratio)
    desc = p.describe() + (f", feather {feather} latent px" if feather and p.tiled else "")
    return Plan("generic", p, desc, extra + p.predicted_peak, extra + full.predict_tracked(g), exact=False,
                reason=job.exact_reason or "", halo=halo, feather=feather if p.tiled else 0, over_budget=over,
                units=p.rows * p.cols)


@dataclasses.dataclass
class ImageModels:
    """What image plans are computed from."""

    full: CostModel
    """The untiled decode's cost model."""
    exact: ExactPlanner | None
    """The exact executor's cost models (None: the decoder has no exact path)."""
    halo: int = 0
    """Latent px of context of the approximate path (the user's, or the decoder's traced reach)."""
    feather: int = 0
    """Latent px of cross-fade inside the halo (decoders with global ops)."""
    reach: str = ""
    """The traced reach and the halo taken from it, for the report (approximate and split paths)."""
    split: SplitPlanner | None = None
    """The exact split path's planner (None: the decoder has none)."""


def image_models(job: ImageJob, env: Any, full: CostModel, budget: int, first_use: Any = None) -> ImageModels:
    """The models of ``job``'s plans: ``full`` (:func:`full_cost_model`), the exact executor's (its mid
    block's split attention, on CPU, gets a quarter of ``budget`` for its score slices) or, without an exact
    path, the decoder's reach for the approximate tiles' halo."""
    if job.exact_reason is None:
        attention = max(ATTENTION_MIN, budget // 4)
        return ImageModels(full, ExactPlanner(job, env, float(full.overhead), attention, first_use))
    if job.split_reason is None:
        sp = split_planner(job, split_layout(job.vae.first_stage_model), env, first_use)
        return ImageModels(full, None, reach=sp.describe_reach(), split=sp)
    traced, global_ops = reach(job)
    halo = default_halo(traced) if job.halo < 0 else int(job.halo)
    text = f"{traced.describe()}; halo {halo} latent px{' (auto)' if job.halo < 0 else ''}"
    return ImageModels(full, None, halo, halo // 2 if global_ops else 0, text)


def splits_batch(job: ImageJob, p: Plan) -> bool:
    """``p`` decodes ``job``'s batch in several passes (tiled paths: one item per pass)."""
    b = int(job.z.shape[0])
    if p.path == "exact" and job.whole_batch:
        return False
    return b > 1 and (p.path != "untiled" or p.config.images_per_pass < b)


def _batch_checked(job: ImageJob, p: Plan) -> Plan:
    """``p`` as the report must see it: not exact when it splits the batch of a decoder that mixes it (the
    report gives :attr:`ImageJob.batch_reason`; ``reason`` keeps the path's own)."""
    if job.batch_reason and splits_batch(job, p):
        p.exact = False
    return p


def plan(job: ImageJob, budget: int, models: ImageModels,
         ratio: Callable[[str], float] | None = None) -> Plan:
    """The fastest plan of ``job`` within ``budget`` bytes: the VAE's own decode when it fits (and no tile is
    set), else exact tiles (decoders the exact walker supports), else exact split tiles (a global prefix and a
    local suffix), else approximate tiles. ``ratio(path)``: the measured over predicted peak learned for a
    path on this machine (:mod:`..cost.observed`; default 1).

    A decoder that mixes its batch (:attr:`ImageJob.batch_reason`) is decoded whole in one pass when that fits
    (and no tile is set); otherwise the plan above, marked not exact (``exact`` False)."""
    r = ratio or (lambda path: 1.0)
    if job.batch_reason and not job.tile_size:
        whole = scaled(lambda b: plan_untiled(job, models.full, b, whole_batch=True), budget, r("untiled"))
        if whole is not None:
            return whole
    return _batch_checked(job, _plan(job, budget, models, r))


def _plan(job: ImageJob, budget: int, models: ImageModels, r: Callable[[str], float]) -> Plan:
    """:func:`plan` without the batch's coupling."""
    tile = int(job.tile_size) or None
    if tile is None and not (job.batch_reason and job.whole_batch):  # split passes would not be exact there
        found = scaled(lambda b: plan_untiled(job, models.full, b), budget, r("untiled"))
        if found is not None:
            return found
    if models.exact is not None:
        exact = models.exact
        return scaled(lambda b: plan_exact(exact, b, tile), budget, r("exact"))
    if models.split is not None:
        split, extra = models.split, buffer_bytes(job) + item_image_bytes(job)
        return scaled(lambda b: plan_split(job, split, b, tile, extra), budget, r("split"))
    return scaled(lambda b: plan_generic(job, models.full, b, tile, models.halo, models.feather), budget,
                  r("generic"))


def fallback(job: ImageJob, p: Plan, models: ImageModels, budget: int) -> Plan:
    """A smaller plan after an out-of-memory error outside a tile.

    untiled -> exact tiles smaller than the image (half the planned bytes), or generic tiles;
    exact -> recompute -> host store (accelerators) -> host store + recompute -> half the tile;
    split -> half the budget and the tile; generic -> half the budget and the tile. Not exact when it splits the
    batch of a decoder that mixes it (:func:`plan`)."""
    return _batch_checked(job, _fallback(job, p, models, budget))


def _fallback(job: ImageJob, p: Plan, models: ImageModels, budget: int) -> Plan:
    planner, full = models.exact, models.full
    if models.split is not None and p.path in ("untiled", "split"):
        extra = buffer_bytes(job) + item_image_bytes(job)
        smaller = min(budget, p.planned // 2)
        tile = max(job.ratio, p.config.tile_h * job.ratio // 2) if p.path == "split" else None
        try:
            return plan_split(job, models.split, smaller, tile, extra)
        except ImpossibleBudgetError:
            return plan_split(job, models.split, smaller, job.ratio, extra)
    if p.path == "untiled":
        smaller = min(budget, p.planned // 2)
        if planner is not None:
            try:
                return plan_exact(planner, smaller, None, exclude_whole=True)
            except ImpossibleBudgetError:
                return plan_exact(planner, smaller, pe.MIN_AUTO_TILE)
        try:
            return plan_generic(job, full, smaller, None, models.halo, models.feather)
        except ImpossibleBudgetError:
            return plan_generic(job, full, smaller, 8 * job.ratio, models.halo, models.feather)
    if p.path == "exact":
        assert planner is not None
        c = p.config
        if not c.recompute:
            nxt = (True, c.store_on_device, c.tile)
        elif c.store_on_device and job.device.type != "cpu" and planner.host_fits(False, c.tile):
            nxt = (False, False, c.tile)
        else:
            nxt = (c.recompute, c.store_on_device, max(te.MIN_TILE, c.tile // 2))
        return _exact(planner.choice(*nxt, budget), planner)
    g = p.config
    return plan_generic(job, full, budget // 2, max(8 * job.ratio, g.tile_h * job.ratio // 2), p.halo, p.feather)
