"""Image decode within a memory budget: path choice, planning, OOM re-plans, the per-image loop, output
assembly and the plan report. The engine of the Tiled VAE Decode node (``nodes/tiled_vae_decode.py``
validates the inputs and passes ComfyUI's callables in a :class:`DecodeEnv`).

Paths (chosen per run, reported in the plan report):

* **untiled**: the VAE's own decode (``first_stage_model.decode`` + ``process_output``, batched as the
  budget allows) when its predicted peak fits: it is the reference result and the fastest.
* **exact tiles** (GroupNorm KL decoders: SD1.x/SD2/SDXL/SD3/Flux and any decoder of that structure,
  ComfyUI's own decode contract): :func:`..executors.kl_exact.decode_exact`: mid block on the whole latent,
  exact shared GroupNorm statistics, 1-px halos per segment; equal to the untiled decode up to float
  rounding. Tile size, recomputation and store placement come from :mod:`..plan.exact`.
* **approximate tiles** (any other VAE, third-party ``comfy.sd.VAE`` subclasses included):
  :func:`..executors.generic.decode_generic`: latent tiles with a halo derived from the decoder's
  convolutional reach, cropped (feathered inside the halo for decoders with global ops).

Every plan, the first and each re-plan after an out-of-memory error, is verified before it runs (:class:`_Verify`):
exact or split tiles only after their structure's self-check passed on this host, a batch in separate passes only
after its items proved independent, approximate tiles only above the fidelity floor; a failed verdict re-plans.

Batch items are decoded within the budget and written into one output buffer on the output device
(ComfyUI's intermediate device) as they finish. Cancel is checked between units; an out-of-memory
error inside a tile shrinks the tile and resumes (executors); one outside a tile (mid block, store
allocation, an untiled pass) re-plans smaller (:func:`fallback`) and retries the unfinished items,
outside the ``except`` block (:class:`..oom.OomResume`); finished items are kept.

The VAE is duck-typed as ComfyUI's ``comfy.sd.VAE``: ``first_stage_model`` (with ``decode``),
``vae_dtype``, ``device``, ``process_output`` (for the core contract), optionally ``decode`` (own
contract), ``patcher`` (``model_size()``, ``loaded_size()``), ``latent_channels``, ``upscale_ratio`` /
``latent_scale``. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..cost import exact as dp
from ..cost.observed import observed_key, ratio_text
from ..executors import generic as tg
from ..executors import kl_exact as te
from ..executors.split import decode_split, decode_split_into
from ..measure.reach import default_halo
from ..plan import plan
from ..plan.image import (
    ImageJob,
    ImageModels,
    fallback,
    full_cost_model,
    ideal_bytes,
    image_models,
    make_job,
    splits_batch,
)
from ..plan.split import prefix_tile, suffix_reach, tile_px
from ..plan.types import Plan
from ..report import (
    Report,
    flag_measured_overrun,
    fmt_seconds,
    measured_text,
    peak_verdict,
    predicted_text,
    summary_line,
)
from ..run_context import NormParamsFn, ProgressFn
from ..vae.split_layout import split_layout
from . import flow
from .env import DecodeEnv, Measured, load_weights, unaliased
from .execute import Progress, pass_context, pass_driver, run_passes
from .first_use import FirstUse, first_use_tag
from .floor import (
    approximate_text,
    batch_text,
    describe_host,
    generic_fn,
    generic_or_host,
    host_oom_error,
    is_floor_host,
)
from .flow import Flow, Ran, Work
from .self_check import BATCH_CHECK_ITEMS, CheckStore, Verdict, check_batch, check_key, checked

log = logging.getLogger("vramfit.memory.decode.image")

__all__ = ["DecodeEnv", "DecodeResult", "ImageJob", "check_batch_items", "check_exact", "check_split", "decode_image",
           "make_job"]

REPORT_NODE = "Tiled VAE Decode"
MAX_RETRIES = 3
"""Re-plans after an out-of-memory error outside a tile, per decode."""


CHECK_LATENT_HW = (4, 6)
"""Latent px of the exact walker's self-check: 32x48 px, tiles of :data:`CHECK_TILE` px."""
CHECK_TILE = 16
"""Several tiles at the two finest levels (2x3 at full resolution), so merged statistics and halos are used."""


def check_exact(job: ImageJob, store: CheckStore, norm_params: NormParamsFn | None = None,
                prepare: Callable[[], None] | None = None, first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the exact tiled walker for this decoder on this host (:func:`.self_check.verify`): a
    tiny random latent (:data:`CHECK_LATENT_HW`) decoded by ``first_stage_model.decode`` and by
    :func:`..executors.kl_exact.decode_exact` in tiles of :data:`CHECK_TILE` px. Keyed by the decoder's code
    fingerprint, the walker's version, dtype and device type. ``prepare()`` runs first when the check runs
    (the node loads the weights)."""
    model = job.vae.first_stage_model
    key = check_key("kl-exact", model, f"exact-{dp.executor_digest()}", dtype=job.dtype, device=job.device)
    items = BATCH_CHECK_ITEMS if job.whole_batch else 1  # a video decoder's batch: its time mixing checked too
    z = torch.randn((items, job.channels, *CHECK_LATENT_HW), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)

    def tiled() -> torch.Tensor:
        return te.run_exact(job.walkers[False], z, CHECK_TILE, compute_device=job.device, norm_params=norm_params)

    configs = [(f"tiles of {CHECK_TILE} px", tiled)]
    return checked(key, store, model, lambda: model.decode(z), configs, job.dtype, prepare, first_use)


CHECK_SPLIT_TILE = 8
"""Suffix tiles of the split path's self-check, in px of the prefix's output, for a prefix at 4x the latent's
resolution (2x3 tiles for DC-AE); :func:`check_split_tile` scales it to other prefixes."""
CHECK_PREFIX_TILE = 2
"""Latent px of the prefix's tiles in the split path's self-check: 2x3 tiles of the check's latent at every level
(DC-AE's linear attention summed over them)."""


def check_split_tile(scale: int) -> int:
    """The self-check's suffix tile for a prefix output at ``scale`` px per latent px: 2x3 tiles of the check's
    latent whatever the scale (Mage-VAE's prefix stays at latent resolution: tiles of 2 px)."""
    return max(1, CHECK_SPLIT_TILE * scale // 4)


def check_split(job: ImageJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                first_use: FirstUse | None = None) -> Verdict:
    """Self-check of the split path for this decoder on this host: a tiny random latent
    (:data:`CHECK_LATENT_HW`) through the VAE's own decode (``first_stage_model.decode``; for a VAE that
    overrides ``VAE.decode``, that decode, against ComfyUI's output processing of ours) and through
    :func:`..executors.split.decode_split` in tiles of :func:`check_split_tile` px with the traced halo; a prefix
    that runs in tiles (:attr:`..vae.split_layout.SplitLayout.prefix_units`) also in tiles of
    :data:`CHECK_PREFIX_TILE` latent px."""
    model = job.vae.first_stage_model
    layout = split_layout(model)
    tiled_prefix = bool(layout.prefix_units)
    key = check_key(f"split/{layout.family}", model, dtype=job.dtype, device=job.device,
                    suffix="/prefix-tiles" if tiled_prefix else "")
    z = torch.randn((1, job.channels, *CHECK_LATENT_HW), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)
    scale, _, reach = suffix_reach(layout, model, job.channels, job.dtype, job.device)
    halo, tile = default_halo(reach), check_split_tile(scale)

    def tiled() -> torch.Tensor:
        out = decode_split(layout, z, tile, halo)
        return out if job.core else _process(out).movedim(1, -1)

    def reference() -> torch.Tensor:
        return model.decode(z).float() if job.core else job.vae.decode(z).float()

    def prefix_tiled() -> torch.Tensor:
        out = decode_split(layout, z, tile, halo, prefix_tile=CHECK_PREFIX_TILE)
        return out if job.core else _process(out).movedim(1, -1)

    configs = [(f"suffix tiles of {tile} px", tiled)]
    if tiled_prefix:
        configs.append((f"prefix in tiles of {CHECK_PREFIX_TILE} latent px, suffix tiles of {tile} px", prefix_tiled))
    return checked(key, store, model, reference, configs, job.dtype, prepare, first_use)


def check_batch_items(job: ImageJob, store: CheckStore, prepare: Callable[[], None] | None = None,
                      first_use: FirstUse | None = None) -> Verdict:
    """Self-check that this decoder treats the items of its batch independently on this host
    (:func:`.self_check.check_batch`): a tiny random batch of :data:`.self_check.BATCH_CHECK_ITEMS` latents
    (:data:`CHECK_LATENT_HW`) decoded whole by the VAE's own decode and one item per pass. Every path but the
    untiled one with the whole batch decodes items in separate passes: for a decoder that fails this (SVD's
    temporal decoder mixes its batch as one video's frames), only that one is its result."""
    model = job.vae.first_stage_model
    key = check_key("batch", model, dtype=job.dtype, device=job.device)
    shape = (BATCH_CHECK_ITEMS, job.channels, *CHECK_LATENT_HW)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(job.device, job.dtype)

    def decode(x: torch.Tensor) -> torch.Tensor:
        return model.decode(x).float() if job.core else job.vae.decode(x).float()

    return check_batch(key, store, model, decode, z, job.dtype, prepare, first_use)


def batch_reason(job: ImageJob, verdict: Verdict) -> str:
    """Why a split batch is not exact, from the batch self-check's failed ``verdict`` ("" when it passed)."""
    if verdict.ok:
        return ""
    hint = f"; {job.batch_hint}" if job.batch_hint else ""
    if not verdict.conclusive or verdict.max_diff == float("inf"):  # no finite comparison: nothing shown
        return (f"whether this decoder treats the items of its batch independently is unverified{hint} (batch "
                f"{verdict.describe()})")
    return (f"this decoder mixes the items of its batch{hint}: decoding them in separate passes changes the "
            f"result (batch {verdict.describe()})")


def _process(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's ``VAE.process_output`` (for VAEs that skip ``VAE.__init__``, as ExtraModels' EXVAE)."""
    return torch.clamp((x + 1.0) / 2.0, min=0.0, max=1.0)


# --------------------------------------------------------------------------------------------------
# Execution


class _Run:
    """The passes of one decode: every batch item into one output buffer."""

    def __init__(self, job: ImageJob, env: DecodeEnv) -> None:
        self.job = job
        self.env = env
        self.out = torch.empty((int(job.z.shape[0]), *job.out_hw, job.out_channels), dtype=torch.float32,
                               device=job.out_device)
        """The images (B, H, W, C) on [0, 1]; each pass writes its items' rows."""
        self.oom_events: list[str] = []
        self.passes = 0
        self.driver = pass_driver(env, MAX_RETRIES)
        """Re-plans outside a tile; its ``check_stop`` is the executors' ``should_stop``, so a cancel
        propagates through every level."""
        self.ctx = pass_context(env, self.driver, self.oom_events, "decode")
        """What every tiled pass's executor takes (its progress is the pass's)."""
        self.tile_fn = generic_fn(job)
        """The generic tiles' decode of one latent tile."""

    def start_pass(self) -> None:
        self.passes += 1
        if self.env.fault_hook is not None:
            self.env.fault_hook("pass", self.passes - 1)

    def untiled_pass(self, a: int, b: int) -> None:
        job = self.job
        self.driver.check_stop()
        self.start_pass()
        if job.core:
            z = job.z[a:b].to(job.dtype).to(job.device)
            out = unaliased(job.vae.first_stage_model.decode(z).to(job.out_device).float(), job.z)
            del z
            images = job.vae.process_output(out).movedim(1, -1)
        else:
            images = job.vae.decode(job.z[a:b]).to(job.out_device).float()
            if images.ndim == 5:
                images = images.reshape(-1, *images.shape[-3:])
        self.out[a : a + images.shape[0]].copy_(images)


def _extent(job: ImageJob, p: Plan, start: int) -> tuple[int, int]:
    """The pass of ``p`` from item ``start``: its stop and the progress units planned after it."""
    b_total = int(job.z.shape[0])
    if p.path == "untiled":
        stop = min(b_total, start + p.config.images_per_pass)
        return stop, b_total - stop
    if p.path == "exact" and job.whole_batch:  # the whole batch is one decode (a video decoder's frames)
        return b_total, 0
    return start + 1, (b_total - start - 1) * p.units


def _one_pass(run: _Run, verify: _Verify, p: Plan, start: int, stop: int, cb: ProgressFn) -> None:
    """Items ``start`` .. ``stop`` - 1 on plan ``p`` (untiled, or through its executor; its models as ``verify``
    leaves them) into the output buffer."""
    job, models = run.job, verify.models
    if p.path == "untiled":
        cb(0, stop - start)
        run.untiled_pass(start, stop)
        cb(stop - start, stop - start)
        return
    run.start_pass()
    out, z = run.out[start:stop], job.z[start:stop]
    kw = run.ctx.with_progress(cb).kwargs(stats=False)
    if p.path == "exact":
        assert models.exact is not None
        with run.env.attention(job.vae.first_stage_model, models.exact.attention_bytes):
            te.decode_exact_into(out, job.walkers[p.config.recompute], z.to(job.dtype).to(job.device), p.config,
                                 job.vae.process_output, compute_device=job.device, out_device=job.out_device,
                                 norm_params=run.env.norm_params, **kw)
    elif p.path == "split":
        assert models.split is not None
        process = getattr(job.vae, "process_output", None) if job.core else None
        decode_split_into(out, models.split.layout, z.to(job.dtype).to(job.device), tile_px(p, models.split),
                          models.split.halo, process or _process, out_device=job.out_device,
                          prefix_tile=prefix_tile(p), **kw)
    else:
        g = p.config
        tg.decode_generic_into(out, run.tile_fn, z, (g.tile_h, g.tile_w), p.halo,
                               job.vae.process_output if job.core else None, scale=job.ratio,
                               out_device=job.out_device, feather=p.feather, **kw)


def _smaller(verify: _Verify, p: Plan) -> Plan:
    """The next smaller plan after an out-of-memory error outside a tile (:func:`..plan.image.fallback`), as it
    may run (verified)."""
    return verify(lambda job, models: fallback(job, p, models, verify.avail))


def _floor_oom(p: Plan, e: BaseException) -> BaseException | None:
    """No re-plan after the host's decode the fidelity floor took: its out-of-memory error
    (:func:`.floor.host_oom_error`)."""
    return host_oom_error(REPORT_NODE, e, p.reason, p.over_budget) if is_floor_host(p) else None


# --------------------------------------------------------------------------------------------------
# The decode


@dataclasses.dataclass
class DecodeResult:
    images: torch.Tensor
    report: Report
    plan: Plan
    budget: Any
    seconds: float
    """Decode time (the passes), without planning."""
    plan_seconds: float
    """Validation, cost models (a first-use calibration included), offload, budget and plan."""
    measured_peak: int | None
    measure_method: str
    oom_events: list[str]
    calibrations: list[str]


def decode_image(
    job: ImageJob,
    env: DecodeEnv,
    *,
    budget_mb: float = 0,
    unload_others: bool = True,
    t_start: float | None = None,
    allow_approximate: bool = False,
) -> DecodeResult:
    """Decode ``job`` within the budget through the flow of every decode (:func:`.flow.run`); returns the images
    (B, H, W, C) float32 on [0, 1] and the report.

    ``budget_mb``: 0 = free memory (``env.budget``); ``unload_others``: offload upstream models first
    (``env.offload``, VAEs with a patcher only); the tile and halo are the job's. ``t_start``:
    ``time.perf_counter()`` when planning started (validation included). Raises
    :class:`..plan.grid.ImpossibleBudgetError` (message with the budget) when no plan fits.
    ``allow_approximate``: generic tiles that measure under :data:`.self_check.FIDELITY_FLOOR_DB` may run (else the
    host's own decode runs, flagged when over the budget: :mod:`.floor`).
    """
    return flow.run(_Image(job), env, budget_mb=budget_mb, unload_others=unload_others, t_start=t_start,
                    allow_approximate=allow_approximate)


class _Image(Work):
    """The image decode as :func:`.flow.run` takes it: the full cost model and observed ratios (the cost step), the
    untiled decode's need (the offload's ask), the plan over the plan models, its verdicts (:class:`_Verify`), the
    passes (:class:`_Run`)."""

    has_cost = True

    def __init__(self, job: ImageJob) -> None:
        self.job = job

    def cost(self, f: Flow) -> None:
        job, env = self.job, f.env
        self.full = full_cost_model(job, env, lambda: load_weights(job.vae, env, 0), f.first)
        self.ratio = env.observed.ratios(job.subject.key_name, job.dtype, job.device)

    def need(self, f: Flow) -> int | None:  # what ComfyUI's own decode would need
        return int(ideal_bytes(self.job, self.full) * self.ratio("untiled"))

    def out_bytes(self) -> int:
        return int(self.job.z.shape[0]) * self.job.out_hw[0] * self.job.out_hw[1] * self.job.out_channels * 4

    def plan(self, f: Flow) -> Plan:
        f.env.at("cost")  # the plan models at this budget (a first-use calibration among them)
        self.verdicts = _Verify(self.job, f.env, self.full, f.available, self.ratio, f.first, f.allow_approximate)
        f.env.at("plan")
        return plan(self.job, f.available, self.verdicts.models, self.ratio)

    def verify(self, p: Plan, f: Flow) -> Plan:
        avail, ratio = f.available, self.ratio
        p = self.verdicts.check(p, lambda j, models: plan(j, avail, models, ratio))
        self.job = self.verdicts.job
        return p

    def bar_total(self, p: Plan) -> int:
        return int(self.job.z.shape[0]) * p.units

    def output(self, p: Plan, f: Flow) -> None:
        self.passes = _Run(self.job, f.env)

    def run(self, p: Plan, bar: ProgressFn | None, f: Flow) -> Ran:
        run, job = self.passes, self.job
        p = run_passes(int(job.z.shape[0]), p, run.driver, Progress(bar, self.bar_total(p)),
                       functools.partial(_extent, job), functools.partial(_one_pass, run, self.verdicts),
                       functools.partial(_smaller, self.verdicts), _floor_oom, run.oom_events, REPORT_NODE)
        self.job = self.verdicts.job  # as a re-plan's verdicts left it (a batch or structure reason)
        return Ran(p, bool(run.oom_events))

    def observed_key(self, p: Plan) -> str:
        return observed_key(p.path, self.job.subject.key_name, self.job.dtype, self.job.device)

    def finish(self, ran: Ran, f: Flow, seconds: float, plan_seconds: float, m: Measured) -> DecodeResult:
        v, run, p = self.verdicts, self.passes, ran.plan
        calibrated = v.models.exact.calibrated if v.models.exact is not None else []
        report = _report(self.job, p, v.models, f.budget, f.offload, seconds, plan_seconds, m, run, f.first,
                         v.checks.get(p.path), v.batch)
        return DecodeResult(run.out, report, p, f.budget, seconds, plan_seconds, m.peak, m.method, run.oom_events,
                            calibrated)


class _Verify:
    """The verify step: what a plan relies on is proven on this host before it runs, for the first plan and for
    each re-plan after an out-of-memory error. Exact or split tiles: that structure's self-check
    (:func:`check_exact`, :func:`check_split`); a batch in separate passes: its items' independence
    (:func:`check_batch_items`); approximate tiles: the fidelity floor (:func:`.floor.generic_or_host`). A failed
    verdict re-plans without what failed (the job's reason says why). The host's own untiled decode of the whole
    batch relies on nothing: no check runs for it. Holds the job and its plan models as the verdicts leave them."""

    def __init__(self, job: ImageJob, env: DecodeEnv, full: Any, avail: int, ratio: Callable[[str], float],
                 first: FirstUse, allow: bool) -> None:
        self.job, self.env, self.full, self.avail, self.ratio, self.first, self.allow = \
            job, env, full, avail, ratio, first, allow
        self.models = image_models(job, env, full, avail, first)
        self.checks: dict[str, Verdict] = {}
        """The structure verdicts, by the path they prove (``exact``, ``split``)."""
        self.batch: Verdict | None = None
        self.load = lambda: load_weights(job.vae, env, 0)

    def __call__(self, make: Callable[[ImageJob, ImageModels], Plan]) -> Plan:
        """``make(job, models)``'s plan as it may run: re-made after each failed verdict."""
        return self.check(make(self.job, self.models), make)

    def check(self, p: Plan, make: Callable[[ImageJob, ImageModels], Plan]) -> Plan:
        """``p`` as it may run: ``make(job, models)`` again after each failed verdict."""
        stage, env = self.env.stage, self.env
        env.at("check")
        while True:
            job = self.job
            if p.path in ("exact", "split") and p.path not in self.checks:
                job = self._structure(p.path)
            elif splits_batch(job, p) and self.batch is None:
                self.batch = check_batch_items(job, env.checks, self.load, self.first)
                if not self.batch.ok:
                    job = dataclasses.replace(job, batch_reason=batch_reason(job, self.batch))
            else:
                break
            if job is not self.job:
                self.job = job
                env.at("plan")
                p = make(job, self.models)
                env.at("check")
        p = generic_or_host(self.job, p, self.models, env.checks, self.avail, self.allow, self.ratio("untiled"),
                            self.load, self.first, CHECK_LATENT_HW)
        env.at(stage)
        return p

    def _structure(self, path: str) -> ImageJob:
        """The self-check of ``path``'s structure; when it fails, the job without that path and its plan models."""
        job, env = self.job, self.env
        if path == "exact":
            v = self.checks[path] = check_exact(job, env.checks, env.norm_params, self.load, self.first)
            if not v.ok:
                job = dataclasses.replace(job, exact_reason=f"the exact tiled walker's {v.describe()}")
        else:
            v = self.checks[path] = check_split(job, env.checks, self.load, self.first)
            if not v.ok:
                job = dataclasses.replace(job, split_reason=f"the split path's {v.describe()}")
        if not v.ok:
            stage = env.stage
            env.at("cost")
            self.models = image_models(job, env, self.full, self.avail, self.first)
            env.at(stage)
        return job


# --------------------------------------------------------------------------------------------------
# Report


def _report(job: ImageJob, plan: Plan, models: ImageModels, budget: Any, offload_text: str, seconds: float,
            plan_seconds: float, m: Any, run: _Run, first: FirstUse, verdict: Verdict | None,
            batch_verdict: Verdict | None = None) -> Report:
    b = int(job.z.shape[0])
    h, w = job.out_hw
    r = Report(REPORT_NODE, str(job.device))
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); latent {tuple(job.z.shape)} -> "
                 f"{b} x {h}x{w} px")
    split = not plan.exact and plan.path != "generic"  # exact executor, but the batch split is not
    if plan.path == "untiled":
        whose = "ComfyUI's own decode" if job.core else f"{type(job.vae).__name__}'s own decode"
        if is_floor_host(plan):
            path = (f"exact: untiled, {whose} (identical to VAE Decode; {describe_host(plan, job)}; no exact tiles "
                    f"because: {_not_exact(job)})")
        elif split:
            path = (f"approximate: untiled, {whose}, {plan.config.images_per_pass} of {b} images per pass "
                    f"(not exact because: {job.batch_reason}; the whole batch does not fit the budget{batch_text(plan)})")
        elif job.batch_reason:
            path = (f"exact: untiled, {whose} of the whole batch in one pass (it fits the budget; identical to VAE "
                    "Decode; this decoder's items must be decoded together)")
        else:
            path = f"exact: untiled, {whose} (it fits the budget; identical to VAE Decode)"
    elif plan.path == "exact":
        path = ("layer-synchronous tiles, shared GroupNorm statistics, mid block on the whole latent "
                "(equal to the untiled decode up to float rounding")
        if job.whole_batch:
            path = (f"{path}; the whole batch as one video: the frames' time mixing over every tile's region of all "
                    "frames")
        path = f"approximate: {path} of each image; not exact because: {job.batch_reason}{batch_text(plan)})" if split \
            else f"exact: {path})"
    elif plan.path == "split":
        path = (f"global prefix once, local suffix in tiles with a halo of its reach ({plan.reason}; "
                "equal to the untiled decode up to float rounding")
        path = f"approximate: {path} of each image; not exact because: {job.batch_reason}{batch_text(plan)})" if split \
            else f"exact: {path})"
    else:
        fid = approximate_text(plan, job)
        path = (f"approximate: generic tiles with halo and crop ({f'{fid}; ' if fid else ''}not exact because: "
                f"{_not_exact(job)})")
    r.add("path", path)
    if job.exact_reason is not None and job.split_reason is not None and plan.path == "untiled":
        r.add("structure", f"not described for exact tiles: {_not_exact(job)}")
    if batch_verdict is not None and batch_verdict.ok:
        r.add("batch", f"items decode independently: batch {batch_verdict.describe()}")
    if verdict is not None and verdict.ok:
        which = "split path" if plan.path == "split" or job.exact_reason is not None else "exact tiled walker"
        r.add("check", f"{which}: {verdict.describe()}")
    r.add("budget", budget.describe())
    r.add("offload", offload_text)
    plan_text = plan.description
    if plan.path == "exact" and job.whole_batch:
        plan_text += f", the {b} image{'s' if b != 1 else ''} of the batch in one pass (its time mixing spans them)"
    elif plan.path == "exact":
        plan_text += f", {b} image{'s' if b != 1 else ''} one after another"
    r.add("plan", plan_text)
    if models.reach:
        r.add("halo", models.reach)
    over = f" - OVER BUDGET ({_over_why(plan)})" if plan.over_budget else ""
    where = f", at {plan.config.peak.segment}" if plan.path == "exact" else ""
    r.add("predicted", predicted_text(plan.planned, int(budget.available), plan.tracked, where=where, over=over,
                                      note=ratio_text(plan.ratio)))
    r.add("measured", measured_text(m.peak, m.method))
    flag_measured_overrun(r, m.peak, m.method, int(budget.available), log)
    r.add("time", f"{fmt_seconds(seconds)} decoding ({run.passes} pass{'es' if run.passes != 1 else ''}), "
                  f"{fmt_seconds(plan_seconds)} planning")
    if first.done:
        r.add("first use", first.describe())
    if run.oom_events:
        r.add("oom", "\n".join(run.oom_events))
    r.summary = summary_line(_summary(job, plan, budget, seconds, m, run), first_use_tag(first))
    return r


def _not_exact(job: ImageJob) -> str:
    """Why ``job`` has no exact tiles (the walker's reason; a failed split check's; the batch's coupling)."""
    failed = (job.split_reason or "").startswith("the split path's")
    why = f"{job.exact_reason}; {job.split_reason}" if failed else str(job.exact_reason)
    return f"{why}; {job.batch_reason}" if job.batch_reason else why


def _summary(job: ImageJob, plan: Plan, budget: Any, seconds: float, m: Any, run: _Run) -> str:
    """The verdict: ``exact · 2x3 tiles · RSS peak 310.0 MiB of 512.0 MiB tensor budget · 15.10 s``."""
    b = int(job.z.shape[0])
    if plan.path == "untiled":
        shape = "untiled"
    elif plan.path == "exact":
        c = plan.config
        h, w = job.out_hw
        shape = "1 tile" if c.whole else f"{-(-h // c.tile)}x{-(-w // c.tile)} tiles"
    else:
        shape = f"{plan.config.rows}x{plan.config.cols} tiles"
    if b > 1:
        shape += f" x {b} images"
    oom = len(run.oom_events)
    return summary_line(
        "exact" if plan.exact and plan.path in ("untiled", "exact", "split") else "approximate",
        shape,
        peak_verdict(m.peak, m.method, int(budget.available), plan.planned),
        f"planned over budget ({_over_why(plan)})" if plan.over_budget and (m.peak or 0) <= budget.available else "",
        fmt_seconds(seconds),
        f"{oom} out-of-memory re-plan{'s' if oom != 1 else ''}" if oom else "",
    )


def _over_why(plan: Plan) -> str:
    """Why a plan runs over the budget: the user's tile, or the fidelity floor (:func:`.floor.is_floor_host`)."""
    return "approximate tiles under the fidelity floor not taken" if is_floor_host(plan) else "user tile"
