"""An encode from job to report (Tiled VAE Encode, Temporal-Chunk Video Encode) through the flow of every decode
(:func:`.flow.run`): its plan, the self-check of the tiles a plan takes, the passes with out-of-memory re-plans
(:func:`.execute.run_passes`), its report. The image decode's twin for the other direction; the planning is
:mod:`..plan.encode`, the executors
:func:`..executors.kl_exact.encode_exact` (images) and :func:`..executors.split_encode.encode_split_tiled` (videos:
Wan, LTX-Video, HunyuanVideo 1.5). Design: docs/ENCODE.md."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from ..cost.observed import observed_key, ratio_text
from ..executors import split_encode as se
from ..oom import OomResume
from ..plan.encode import EncodeJob, encode_ratio, latent_frames, plan, smaller, temporal_ratio
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
from ..tiles import spans
from ..vae.encode_split import encode_split, prefix_ratio
from ..vae.families import identify, model_name
from ..vae.kl_layout import kl_layout
from . import flow
from .env import DecodeEnv, Measured, load_weights
from .execute import Progress, pass_context, pass_driver, run_passes
from .first_use import FirstUse, first_use_tag
from .flow import Flow, Ran, Work
from .self_check import ENCODE_METHODS, CheckStore, Verdict, check_key, checked, code_fingerprint

log = logging.getLogger("vramfit.memory.decode.encode")

__all__ = ["REPORT_NODE", "EncodeResult", "check_encode", "encode_image", "make_job"]

REPORT_NODE = "Tiled VAE Encode"
VIDEO_REPORT_NODE = "Temporal-Chunk Video Encode"
CHECK_HW = (64, 96)
"""Pixels of the walker's self-check: 4x6 tiles of :data:`CHECK_TILE` px at full resolution."""
CHECK_TILE = 16
CHECK_VIDEO = (13, 1, 32)
"""Frames and latent px (h, w) of a video split's self-check (an image split's: h; w in prefix px, rounded up to
whole latent px), in tiles of :data:`CHECK_VIDEO_TILE` latent px:
Wan's 4 latent frames (suffix calls [0, 1), [1, 3), [3, 4): the last reads the caches a 2-frame call left), 1x6
tiles (``split_even(32, 6)``), the fourth ([16, 21)) reading [6, 31): no image edge on either side at the
encoder's reach of 10 latent px (one latent row: no interior tile vertically; the halo is the same on both axes).
A wider reach takes three wider tiles (:func:`_check_geometry`)."""
CHECK_FRAMES = 9
"""Frames of the other video families' self-check: LTX-Video's 1 + 8 (0.3.75 refuses other counts), HunyuanVideo
1.5's first frame and one chunk of 8 (its carried frames cross the chunks' border)."""
CHECK_VIDEO_TILE = 6
MAX_REPLANS = 6


def _check_geometry(halo: int) -> tuple[int, int]:
    """(latent px across, tile core in latent px) of the video self-check: :data:`CHECK_VIDEO`'s width in tiles
    of :data:`CHECK_VIDEO_TILE` where one of them reads no image edge on either side at ``halo``, else three tiles
    of ``halo + 1`` (the middle one reads no edge): a reach the halo misses shows in the check."""
    w = CHECK_VIDEO[2]
    if any(a > halo and b + halo < w for a, b, _, _ in spans(w, CHECK_VIDEO_TILE, 0)):
        return w, CHECK_VIDEO_TILE
    return 3 * (halo + 1), halo + 1


def make_job(
    vae: Any, x: torch.Tensor, out_device: torch.device | str, tile_size: int = 0, pixels: Any = None
) -> EncodeJob:
    """The job of ``x`` (the host's cropped, processed pixels (B, 3, H, W) in the VAE's dtype) on ``vae``;
    ``pixels``: the node's IMAGE as given (the host's own encode takes it, for encoders the walker cannot
    run). A KL encoder's image takes the exact walker, a video ``x`` (1, 3, T, H, W) or a DC-AE image its family's
    prefix/suffix split (:mod:`..vae.encode_split`); others the host's encode."""
    model = vae.first_stage_model
    dtype, device = getattr(vae, "vae_dtype", x.dtype), torch.device(getattr(vae, "device", x.device))
    split, halo, down, finer, walker = None, 0, 1, 0, None
    if x.ndim == 4:
        layout = kl_layout(model, direction="encode")
        reason, down = layout.reason, layout.ratio
        if reason is None:
            walker = layout.bind(model)
        else:  # not a KL encoder: a split description (DC-AE), else the walker's reason
            split, _ = encode_split(model)
            reason = reason if split is None else None
    else:
        split, reason = encode_split(model)
    if split is not None:
        try:
            down = encode_ratio(vae)
            finer = prefix_ratio(model, split, down)
            halo = se.split_halo(model, split, finer, int(x.shape[1]), dtype, device, x.ndim == 5)
        except Exception as e:  # noqa: BLE001 - a prefix that runs a global module, or a trace that fails
            split, reason = None, f"its reach could not be bounded: {e}"
            log.warning("%s: %s", VIDEO_REPORT_NODE if x.ndim == 5 else REPORT_NODE, reason)
    if reason is None and (x.shape[-2] % down or x.shape[-1] % down):
        reason = f"the image's sides {tuple(x.shape[-2:])} are not multiples of {down}"
    return EncodeJob(
        vae,
        x,
        identify(vae) or model_name(vae),
        dtype,
        device,
        torch.device(out_device),
        code_fingerprint(model, ENCODE_METHODS),
        int(tile_size),
        reason,
        pixels=pixels,
        split=split if reason is None else None,
        halo=halo,
        latent_ratio=down if split is not None else 0,
        prefix_ratio=finer,
        walker=walker if reason is None else None,
    )


def check_encode(
    job: EncodeJob,
    store: CheckStore,
    norm_params: NormParamsFn | None = None,
    prepare_fn: Any = None,
    first_use: FirstUse | None = None,
) -> Verdict:
    """Self-check of the exact tiles' encode for this encoder on this host: a tiny random image
    (:data:`CHECK_HW`) through ``first_stage_model.encode`` and through
    :func:`..executors.kl_exact.encode_exact` in tiles of :data:`CHECK_TILE` px; a split job (:data:`CHECK_VIDEO`:
    a video's frames, an image's one latent row) through :func:`..executors.split_encode.encode_split_tiled` in
    tiles of :data:`CHECK_VIDEO_TILE` prefix px (:func:`_check_geometry`)."""
    model = job.vae.first_stage_model
    kind = f"{job.split.name}-encode" if job.split else "kl-exact-encode"
    key = check_key(kind, model, f"exact-{job.executor_version}", dtype=job.dtype, device=job.device,
                    fingerprint=job.fingerprint)
    g = torch.Generator().manual_seed(0)
    if job.split is not None:
        r, fine = job.prefix_ratio, job.finer  # image px per prefix px, prefix px per latent px
        (t, h, _), (w, core) = CHECK_VIDEO, _check_geometry(job.halo)
        hw = (h * job.ratio, -(-w // fine) * fine * r)  # whole latent px
        frames = (t if job.split.wan else CHECK_FRAMES,) if job.video else ()
        shape: tuple[int, ...] = (1, int(job.x.shape[1]), *frames, *hw)
        tile, name = core * r, f"tiles of {core} latent px" if fine == 1 else f"tiles of {core * r} px"
    else:
        shape, tile, name = (1, int(job.x.shape[1]), *CHECK_HW), CHECK_TILE, f"tiles of {CHECK_TILE} px"
    x = (torch.rand(shape, generator=g) * 2 - 1).to(job.device, job.dtype)

    def tiled() -> torch.Tensor:
        return job.run_tiles(x, tile, compute_device=job.device, norm_params=norm_params)

    configs = [(name, tiled)]
    return checked(key, store, model, lambda: model.encode(x), configs, job.dtype, prepare_fn, first_use)


@dataclasses.dataclass
class EncodeResult:
    latent: torch.Tensor
    report: Report
    plan: Plan
    budget: Any
    seconds: float
    measured_peak: int | None
    measure_method: str
    oom_events: list[str]


PASS_UNITS = 1000
"""Progress units of one image: each pass's executor progress scaled to it (one bar over the batch and re-plans)."""


class _Passes:
    """The run step's parts for :func:`.execute.run_passes`: one image per pass (the host's own encode: the whole
    batch in one), each finished latent kept across re-plans; after an out-of-memory error outside a tile, the next
    smaller plan (:func:`..plan.encode.smaller`, found while the error is handled) as the verify step leaves it."""

    def __init__(self, job: EncodeJob, env: DecodeEnv, driver: OomResume, events: list[str],
                 verify: Callable[[EncodeJob, Plan], tuple[EncodeJob, Plan]]) -> None:
        self.job, self.env, self.driver, self.events, self.verify = job, env, driver, events, verify
        self.n = int(job.x.shape[0])
        self.done: list[torch.Tensor] = []
        self._next: dict[int, Plan | None] = {}
        self.ctx = pass_context(env, driver, events, "encode")

    def extent(self, p: Plan, start: int) -> tuple[int, int]:
        if p.path == "host":
            return self.n, 0
        return start + 1, (self.n - start - 1) * PASS_UNITS

    def one_pass(self, p: Plan, start: int, stop: int, cb: ProgressFn) -> None:
        job, env = self.job, self.env
        hook = env.fault_hook
        self.driver.check_stop()
        if p.path == "host":  # VAEEncode's own call (0.3.75's node keeps RGB itself; 0.33's crop does)
            cb(0, self.n * PASS_UNITS)
            self.done[:] = [job.vae.encode(job.pixels[..., : getattr(job.vae, "output_channels", 3)])]
            cb(self.n * PASS_UNITS, self.n * PASS_UNITS)
            return
        model = job.vae.first_stage_model
        x = job.x[start:stop]
        with env.attention(model, int(p.stats.get("attention", 0)) or (1 << 62)):
            if p.path == "untiled":
                if hook is not None:
                    hook("pass", start)
                self.done.append(model.encode(x.to(job.device)).to(job.out_device))
                cb(PASS_UNITS, PASS_UNITS)
                return
            store = job.device if p.config.store == "device" else torch.device("cpu")
            ctx = self.ctx.with_progress(lambda d, t: cb(PASS_UNITS * d // max(1, t), PASS_UNITS))
            self.done.append(job.run_tiles(x, p.config.tile, compute_device=job.device, store_device=store,
                                           out_device=job.out_device, norm_params=env.norm_params,
                                           **ctx.kwargs(stats=False)))

    def final(self, p: Plan, e: BaseException) -> BaseException | None:
        """``e`` itself when no smaller plan follows ``p``: an OOM after the tiles (no tile helps), the host's encode,
        the smallest tile."""
        if getattr(e, "_vramfit_tail", False) or p.path == "host":
            return e
        if id(p) not in self._next:
            model = self.job.vae.first_stage_model
            self._next[id(p)] = smaller(self.job, p, self.env.peaks, lambda b: self.env.attention(model, b))
        return e if self._next[id(p)] is None else None

    def smaller(self, p: Plan) -> Plan:
        nxt = self._next.pop(id(p))
        assert nxt is not None
        self.job, nxt = self.verify(self.job, nxt)
        return nxt


class _Encode(Work):
    """The encode as :func:`.flow.run` takes it: its observed ratios (the cost step), its plan (the offload's need: the
    fastest), the exact tiles' self-check, the passes (:class:`_Passes`)."""

    words, budget_words, has_cost = "encode", "encoding", True

    def __init__(self, job: EncodeJob) -> None:
        self.job = job
        self.done: list[torch.Tensor] = []
        """The latents of the finished passes."""
        self.events: list[str] = []

    def cost(self, f: Flow) -> None:
        job = self.job
        self.ratio = f.env.observed.ratios(job.family, job.dtype, job.device)

    def _plan(self, j: EncodeJob, budget: int, f: Flow) -> Plan:
        model, env = j.vae.first_stage_model, f.env
        return plan(j, budget, env.peaks, self.ratio, lambda b: env.attention(model, b), f.first)

    def need(self, f: Flow) -> int | None:
        return self._plan(self.job, 1 << 62, f).planned or None

    def plan(self, f: Flow) -> Plan:
        return self._plan(self.job, f.available, f)

    def verify(self, p: Plan, f: Flow) -> Plan:
        self.job, p = self._verify(self.job, p, f)
        return p

    def _verify(self, j: EncodeJob, p: Plan, f: Flow) -> tuple[EncodeJob, Plan]:
        """Exact tiles run only once their self-check (:func:`check_encode`) passed on this host, for the first plan
        and each re-plan after an out-of-memory error; a failed check re-plans without them (the host's own encode).
        The encoder's own forward and the host's encode rely on nothing: no check runs for them."""
        env = f.env
        stage = env.stage
        env.at("check")
        if p.path == "exact" and j.verdict is None:
            verdict = check_encode(j, env.checks, env.norm_params, lambda: load_weights(j.vae, env, 0), f.first)
            j = dataclasses.replace(j, verdict=verdict)
            if not verdict.ok:
                j = dataclasses.replace(j, exact_reason=f"the exact tiled walker's {verdict.describe()}")
                env.at("plan")
                p = self._plan(j, f.available, f)
        env.at(stage)
        return j, p

    def bar_total(self, p: Plan) -> int:
        return int(self.job.x.shape[0]) * PASS_UNITS

    def run(self, p: Plan, bar: ProgressFn | None, f: Flow) -> Ran:
        env, n = f.env, int(self.job.x.shape[0])
        driver = pass_driver(env, MAX_REPLANS)
        passes = _Passes(self.job, env, driver, self.events, lambda j, q: self._verify(j, q, f))
        p = run_passes(n, p, driver, Progress(bar, n * PASS_UNITS), passes.extent, passes.one_pass, passes.smaller,
                       passes.final, self.events, _report_node(self.job))
        self.done, self.job = passes.done, passes.job
        return Ran(p, bool(self.events))

    def observed_key(self, p: Plan) -> str | None:
        job = self.job
        return None if p.path == "host" else observed_key("encode-" + p.path, job.family, job.dtype, job.device)

    def finish(self, ran: Ran, f: Flow, seconds: float, plan_seconds: float, m: Measured) -> EncodeResult:
        out = torch.cat(self.done)  # after the measured window, as the host's encode returns its latent
        report = _report(self.job, ran.plan, f.budget, f.offload, seconds, plan_seconds, m, f.first, self.events)
        return EncodeResult(out, report, ran.plan, f.budget, seconds, m.peak, m.method, self.events)


def encode_image(
    job: EncodeJob,
    env: DecodeEnv,
    *,
    budget_mb: float = 0,
    unload_others: bool = True,
    t_start: float | None = None,
) -> EncodeResult:
    """Encode ``job`` within the budget through the flow of every decode (:func:`.flow.run`); returns the latent
    (B, C, h, w) as ``first_stage_model.encode`` gives it, on ``job.out_device`` (the ``host`` path: as
    ``VAE.encode`` returns it), and the report. Raises :class:`..plan.grid.ImpossibleBudgetError` when no plan
    fits."""
    return flow.run(_Encode(job), env, budget_mb=budget_mb, unload_others=unload_others, t_start=t_start)


def _report_node(job: EncodeJob) -> str:
    """The node the engine's report and log lines name (the nodes retitle the report with their own)."""
    return VIDEO_REPORT_NODE if job.video else REPORT_NODE


def _report(
    job: EncodeJob,
    p: Plan,
    budget: Any,
    offload: str,
    seconds: float,
    plan_seconds: float,
    m: Any,
    first: FirstUse,
    oom_events: list[str],
) -> Report:
    b, (h, w) = int(job.x.shape[0]), job.hw
    r = Report(_report_node(job), str(job.device))
    frames = f"{b} x "
    if job.video:
        t = int(job.x.shape[2])
        k = temporal_ratio(job.vae)
        used = 1 + (latent_frames(job.vae, t) - 1) * k if job.exact_reason is None else t  # as VAE Encode trims
        frames = f"{t} frames{f' ({used} encoded, as VAE Encode)' if used != t else ''} of "
    r.add("vae", f"{job.family} ({str(job.dtype).removeprefix('torch.')}); {frames}{h}x{w} px")
    if p.path == "untiled":
        sliced = ", its mid block's split attention sliced to the budget" if job.split is None else ""
        path = f"exact: the encoder's own forward (it fits the budget){sliced} (equal to VAE Encode up to float rounding)"
    elif p.path == "exact" and job.split is not None:
        reach = f"{job.halo} latent px" if job.finer == 1 else f"{job.halo * job.prefix_ratio} px"
        path = f"exact: {job.split.how}, tiles extended by its reach of {reach} (equal to VAE Encode up to float " \
               "rounding)"
    elif p.path == "exact":
        path = (
            "exact: layer-synchronous tiles, shared GroupNorm statistics, mid block on the whole latent "
            "(equal to VAE Encode up to float rounding)"
        )
    else:
        path = f"exact: {p.description} ({p.reason})"
    r.add("path", path)
    if job.verdict is not None and job.verdict.ok:
        r.add("check", f"exact tiles: {job.verdict.describe()}")
    r.add("budget", budget.describe("encoding"))
    r.add("offload", offload)
    r.add("plan", p.description)
    if p.planned:
        over = " - OVER BUDGET (user tile)" if p.over_budget else ""
        r.add("predicted", predicted_text(p.planned, int(budget.available), how=p.stats.get("sizing", "meta sizing"),
                                          over=over, note=ratio_text(p.ratio)))
    r.add("measured", measured_text(m.peak, m.method))
    flag_measured_overrun(r, m.peak, m.method, int(budget.available), log)
    r.add(
        "time", f"{fmt_seconds(seconds)} encoding, {fmt_seconds(plan_seconds)} planning (self-check included)"
    )
    if first.done:
        r.add("first use", first.describe())
    if oom_events:
        r.add("oom", "\n".join(oom_events))
    if p.path == "exact":
        shape = "{}x{} tiles".format(*p.config.grid(job.hw))
    else:
        shape = "untiled" if p.path == "untiled" else "host encode"
    if b > 1:
        shape += f" x {b} images"
    r.summary = summary_line(
        summary_line(
            "exact",
            shape,
            peak_verdict(m.peak, m.method, int(budget.available), p.planned or None),
            fmt_seconds(seconds),
        ),
        first_use_tag(first),
    )
    return r
