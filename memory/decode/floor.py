"""The fidelity floor of approximate paths (issue 36 item 3): no approximate path that measures under
:data:`.self_check.FIDELITY_FLOOR_DB` against the host's own decode runs without the user asking for it.

One idea, both decode nodes:

* an approximate path is measured once per structure (:func:`.self_check.checked` with ``floor_db``: cached as the
  exactness verdicts are, a failure per file, an inconclusive measure never) on a small random latent, against the
  host's own decode of that latent (the video overlap-blend: :func:`.video.check_blend`; the image's generic halo
  tiles: :func:`check_generic`);
* :func:`floor_choice` turns the verdict into the report's words: the measured dB when the path runs, or why it
  was not taken; under the floor without ``allow_approximate`` the host's own decode runs instead (exact, flagged
  when over the budget) and an out-of-memory error there is :func:`host_oom_error` (naming the node, the measure
  and ``allow_approximate``).

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ..executors import generic as tg
from ..plan.grid import scaled
from ..plan.image import ImageJob, ImageModels, plan_untiled, splits_batch
from ..plan.types import Plan
from .env import unaliased
from .first_use import FirstUse
from .self_check import BATCH_CHECK_ITEMS, FIDELITY_FLOOR_DB, CheckStore, Verdict, check_key, checked

__all__ = ["GENERIC_CHECK_MAX", "GENERIC_CHECK_TILE", "approximate_text", "batch_text", "check_batch_split",
           "check_generic", "describe_host", "floor_choice", "generic_fn", "generic_or_host", "host_oom_error",
           "is_floor_host", "seeded"]

ALLOW = "allow_approximate"
"""The nodes' optional input that lets an approximate path under the floor run."""


def seeded(device: torch.device, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` from one random state (a decode that draws noise draws the same in every run of a check)."""
    def go() -> torch.Tensor:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(0)
            return fn()
    return go


def floor_choice(v: Verdict, allow: bool, what: str) -> tuple[str, str]:
    """``(fidelity, refused)`` for an approximate path whose fidelity check gave ``v``: ``fidelity`` the report's
    words when the path runs (it measured at least the floor, or ``allow`` is on), else ``refused``: why it is not
    taken (the host's own decode runs instead). ``what``: the path as a subject with its verb ("the overlap-blend
    that fits")."""
    measured = v.conclusive and v.psnr is not None
    if v.ok:
        return v.describe(), ""
    if allow:
        if measured:
            return f"{v.describe()}; taken because {ALLOW} is on", ""
        return f"fidelity not measured ({v.detail}); taken because {ALLOW} is on", ""
    if measured:
        return "", f"{what} {v.describe()}: not taken without {ALLOW}"
    return "", f"{what}: its fidelity could not be measured ({v.detail or v.describe()}): not taken without {ALLOW}"


class HostOomError(RuntimeError):
    """The host's own decode, taken over the budget for a stated reason, ran out of memory: the user's call (free
    memory, or allow approximate output), never a failure of the pack's machinery (:mod:`.guard` passes it on)."""


def host_oom_error(node: str, exc: BaseException, refused: str, over: bool = True) -> HostOomError:
    """The error when the host's own decode, taken (``over``: over the budget) because of ``refused``, runs out of
    memory: it names ``allow_approximate`` only where the floor was the reason."""
    ask = (f"Set {ALLOW} to true to accept approximate output, or free memory" if ALLOW in refused
           else "Free memory or decode a smaller latent")
    why = "it ran over the budget" if over else "it was taken"
    return HostOomError(f"{node}: the host's own decode ran out of memory ({type(exc).__name__}); {why} because "
                        f"{refused}. {ask}")


# --------------------------------------------------------------------------------------------------
# The image side: generic halo tiles


GENERIC_CHECK_TILE = 16
"""Most latent px a side of the generic tiles' fidelity check's tiles (the planned tile, capped here)."""
GENERIC_CHECK_MAX = 64
"""Most latent px a side of the generic tiles' fidelity check's latent (the host decodes it whole)."""


def generic_fn(job: ImageJob) -> Callable[[torch.Tensor], torch.Tensor]:
    """The decode of one latent tile (NCHW out, float32, on the output device) the generic tiles run: the host's
    ``first_stage_model.decode`` (core contract) or the VAE's own ``decode``."""
    if job.core:
        model = job.vae.first_stage_model

        def fn(t: torch.Tensor) -> torch.Tensor:
            return unaliased(model.decode(t.to(job.dtype).to(job.device)).to(job.out_device).float(), t)
        return fn

    def own(t: torch.Tensor) -> torch.Tensor:
        return job.vae.decode(t).movedim(-1, 1).to(job.out_device).float()
    return own


def check_generic(job: ImageJob, store: CheckStore, tile_hw: tuple[int, int], halo: int, feather: int,
                  prepare: Callable[[], None] | None = None, first_use: FirstUse | None = None) -> Verdict:
    """Fidelity of the generic halo tiles for this decoder on this host: tiles of ``min(tile, GENERIC_CHECK_TILE)``
    latent px a side with the plan's ``halo`` and ``feather``, over a random latent of two tiles plus twice the halo
    a side (so no tile's context holds the whole latent: at least 2x2 tiles, more with a wide halo), no larger than
    the job's own latent (the decode's own geometry then) nor :data:`GENERIC_CHECK_MAX` px, against the host's
    untiled decode of that latent, both on ``[0, 1]`` as the node outputs them, by PSNR
    (:func:`.self_check.verify` with ``floor_db`` :data:`.self_check.FIDELITY_FLOOR_DB`). Cached per structure,
    tile, halo and feather as the exactness verdicts are (a failure per file, an inconclusive check never)."""
    model = job.vae.first_stage_model
    th, tw = (max(1, min(int(t), GENERIC_CHECK_TILE)) for t in tile_hw)
    contract = "core" if job.core else type(job.vae).__name__
    key = check_key("generic-fidelity", model, contract, f"t{th}x{tw}", f"h{halo}", f"f{feather}", dtype=job.dtype,
                    device=job.device)
    h, w = (min(2 * t + 2 * int(halo), max(2 * t, int(side)), GENERIC_CHECK_MAX)
            for t, side in ((th, job.z.shape[2]), (tw, job.z.shape[3])))
    z = torch.randn((1, job.channels, h, w), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)
    fn = generic_fn(job)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return job.vae.process_output(x).float() if job.core else x

    def tiled() -> torch.Tensor:
        return unit(tg.decode_generic(fn, z, (th, tw), halo, scale=job.ratio, out_device=job.out_device,
                                      out_dtype=torch.float32, feather=feather))

    grid = f"{-(-h // th)}x{-(-w // tw)}"
    configs = [(f"{grid} tiles of {th}x{tw} latent px, halo {halo}, on a {h}x{w} latent", seeded(job.device, tiled))]
    return checked(key, store, model, seeded(job.device, lambda: unit(fn(z))), configs, job.dtype, prepare,
                   first_use, "measuring the approximate tiles' fidelity against the host's own result",
                   FIDELITY_FLOOR_DB)


def check_batch_split(job: ImageJob, store: CheckStore, latent_hw: tuple[int, int],
                      prepare: Callable[[], None] | None = None, first_use: FirstUse | None = None) -> Verdict:
    """Fidelity of decoding a batch's items in separate passes, for a decoder that mixes its batch
    (:attr:`..plan.image.ImageJob.batch_reason`): a random batch of :data:`.self_check.BATCH_CHECK_ITEMS` latents of
    ``latent_hw`` decoded whole by the host and one item per pass, both on ``[0, 1]``, by PSNR (cached as
    :func:`check_generic`'s)."""
    model = job.vae.first_stage_model
    contract = "core" if job.core else type(job.vae).__name__
    key = check_key("batch-fidelity", model, contract, f"{latent_hw[0]}x{latent_hw[1]}", dtype=job.dtype,
                    device=job.device)
    n = BATCH_CHECK_ITEMS
    z = torch.randn((n, job.channels, *latent_hw), generator=torch.Generator().manual_seed(0))
    z = z.to(job.device, job.dtype)

    def decode(x: torch.Tensor) -> torch.Tensor:
        return job.vae.process_output(unaliased(job.vae.first_stage_model.decode(x).float(), x)).float() if job.core \
            else job.vae.decode(x).float()

    def one_per_pass() -> torch.Tensor:
        return torch.cat([decode(z[i : i + 1]) for i in range(n)])

    return checked(key, store, model, seeded(job.device, lambda: decode(z)),
                   [(f"1 of {n} items per pass", seeded(job.device, one_per_pass))], job.dtype, prepare, first_use,
                   "measuring the fidelity of a batch split into passes against the host's own result",
                   FIDELITY_FLOOR_DB)


def batch_text(p: Plan) -> str:
    """The measure of a coupled batch split into passes, for the report ("" when ``p`` does not split one)."""
    text = p.stats.get("batch_fidelity", "") if isinstance(p.stats, dict) else ""
    return f"; {text}" if text else ""


def is_floor_host(p: Plan) -> bool:
    """``p`` is the host's own decode taken instead of approximate tiles (:func:`generic_or_host`): its ``reason``
    says why; an out-of-memory error there has no smaller plan (:func:`host_oom_error`)."""
    return p.path == "untiled" and bool(p.reason)


def _host_plan(job: ImageJob, models: ImageModels, available: int, ratio: float, refused: str) -> Plan:
    """The host's own untiled decode (the whole batch in one pass for a decoder that mixes its batch): as many items
    per pass as fit ``available``, else one per pass (or the whole batch), flagged over the budget."""
    whole = bool(job.batch_reason)
    p = scaled(lambda b: plan_untiled(job, models.full, b, whole_batch=whole), available, ratio)
    if p is None:
        one = job if whole else dataclasses.replace(job, z=job.z[:1])
        p = plan_untiled(one, models.full, 1 << 62, whole_batch=whole)
        assert p is not None
        p = dataclasses.replace(p, planned=int(p.planned * max(1.0, ratio)), over_budget=True)
    return dataclasses.replace(p, reason=refused)


def generic_or_host(job: ImageJob, p: Plan, models: ImageModels, store: CheckStore, available: int, allow: bool,
                    ratio: float = 1.0, prepare: Callable[[], None] | None = None,
                    first_use: FirstUse | None = None, batch_hw: tuple[int, int] = (4, 4)) -> Plan:
    """The plan ``p`` as it may run: unchanged unless it is approximate. Generic tiles are measured first
    (:func:`check_generic`; their measure in ``reason``), a coupled batch split into passes too
    (:func:`check_batch_split` on ``batch_hw`` latent px; its measure in ``stats["batch_fidelity"]``); kept when
    they reach the floor or ``allow`` is on; else the host's own decode (exact, the whole batch in one pass for a
    coupled one; flagged when over ``available``; :func:`is_floor_host`), its ``reason`` saying why the plan was
    not taken. One tile holding the whole latent is the host's own decode: that, not measured. ``ratio``: the
    untiled path's measured over predicted peak."""
    refused = ""
    if p.path == "generic":
        g = p.config
        if g.rows * g.cols == 1:
            refused = "one tile holds the whole latent: it is the host's own decode"
        else:
            v = check_generic(job, store, (g.tile_h, g.tile_w), p.halo, p.feather, prepare, first_use)
            fid, refused = floor_choice(v, allow, "the approximate tiles that fit")
            if not refused:
                p = dataclasses.replace(p, reason=fid)
    if not refused and job.batch_reason and splits_batch(job, p):
        v = check_batch_split(job, store, batch_hw, prepare, first_use)
        fid, refused = floor_choice(v, allow, "the batch's items decoded in separate passes")
        if not refused:
            return dataclasses.replace(p, stats={**p.stats, "batch_fidelity": fid})
    return _host_plan(job, models, available, ratio, refused) if refused else p


def approximate_text(p: Plan, job: ImageJob) -> str:
    """The generic tiles' measure for the report's path row ("" when ``p`` was not measured)."""
    return p.reason if p.path == "generic" and p.reason and p.reason != job.exact_reason else ""


def describe_host(p: Plan, job: ImageJob) -> str:
    """The report's words for the host's decode taken by the floor (:func:`is_floor_host`); a ``tile_size`` the
    user set is not applied there, and the words say so."""
    over = "over the budget, " if p.over_budget else ""
    tile = (f"; tile_size {job.tile_size} not applied: {ALLOW} runs those tiles" if job.tile_size
            and ALLOW in p.reason else "")
    return f"{over}taken because {p.reason}{tile}"
