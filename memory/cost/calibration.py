"""Calibrating cost models for a ComfyUI VAE: default geometry grids, first-use calibration, lookup.

* :func:`fit_grid` / :func:`real_grid`: the geometries calibration runs on. The meta grid spans
  64 px to 4 Kpx (every phase of the decoder's memory shows up, and meta runs cost no compute); the
  real grid stays tiny (a real CPU decode of 128^2 px is ~1 s).
* :class:`Subject`: the VAE identified once (geometry, key, host variant, device, dtype).
* :func:`calibrate_vae` fits a model for one VAE object and executor, by meta sizing (default, exact
  for the tensor-level peak) or by real decodes (``mode="real"``: what a GPU needs, where the
  allocator peak includes kernel workspaces the meta run cannot see).
* :func:`cost_model_for`: the model to plan with: the cache/shipped default for the key, else
  calibrate once and cache (``CostModelStore``).
* :func:`host_variant`: the part of the key that says how the host's decoder behaves, for families whose
  memory depends on it (Wan: ComfyUI 0.33 changed both decoders'), measured, never a version string.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from ..geometry import Geometry, VaeGeometry
from ..measure.sizing import MetaSizer, decode_run, meta_sizer_factory
from ..measure.tracker import tracker_factory
from ..vae.families import FAMILIES, geometry_of, identify, model_key_name, model_name
from .phases import CostModel, CostModelStore, ModelKey, calibrate

log = logging.getLogger("vramfit.memory.cost.calibration")

IMAGE_PHASES: tuple[tuple[str, ...], ...] = (("const", "px"), ("const", "px", "tokens_sq"))
VIDEO_PHASES: tuple[tuple[str, ...], ...] = (("const", "px", "px_step", "px_cache2", "px_frames"),)


def _g(vae: VaeGeometry, out_h: int, out_w: int, frames: int = 0, batch: int = 1) -> Geometry:
    s = vae.spatial_ratio
    return Geometry(
        latent_h=max(1, out_h // s),
        latent_w=max(1, out_w // s),
        batch=batch,
        latent_frames=frames,
        spatial_ratio=s,
        temporal_ratio=vae.temporal_ratio,
    )


def fit_grid(vae: VaeGeometry) -> list[Geometry]:
    """Geometries for a meta calibration (any size is free): 64 px to 1.5-3 Kpx, batch 2, video frames.

    Images stop at 1536^2: beyond, ComfyUI's split attention on CPU starts slicing by the free RAM
    of the moment, and the measured peak stops following the model (it drops below it).
    """
    if not vae.is_video:
        sizes = [(32, 32), (128, 128), (256, 256), (512, 512), (1024, 1024), (1280, 1280), (1536, 1536)]
        grid = [_g(vae, h, w) for h, w in sizes]
        grid += [_g(vae, 512, 1024), _g(vae, 1024, 1536), _g(vae, 256, 256, batch=2)]
        return grid
    pts = [
        (3 * vae.spatial_ratio, 1),
        (512, 1),
        (64, 2),
        (256, 2),
        (1024, 2),
        (256, 3),
        (512, 3),
        (256, 5),
        (3072, 1),
        (3072, 2),
    ]
    return [_g(vae, px, px, frames=t) for px, t in pts]


def real_grid(vae: VaeGeometry) -> list[Geometry]:
    """Geometries for a calibration by real decodes: small (seconds on a CPU) but distinct."""
    if not vae.is_video:
        return [_g(vae, 64, 64), _g(vae, 96, 96), _g(vae, 128, 128)]
    small = 4 * vae.spatial_ratio
    return [
        _g(vae, small, small, 1),
        _g(vae, small, small, 2),
        _g(vae, small, small, 3),
        _g(vae, 2 * small, 2 * small, 2),
    ]


REAL_IMAGE_PHASES: tuple[tuple[str, ...], ...] = (("const", "px"),)
REAL_VIDEO_PHASES: tuple[tuple[str, ...], ...] = (("const", "px", "px_step", "px_frames"),)


def default_phases(vae: VaeGeometry, mode: Literal["meta", "real"]) -> tuple[tuple[str, ...], ...]:
    """Feature phases for a calibration: the wide meta grid identifies every phase; a small real
    grid only the features of :attr:`.families.Family.real_phases` (as many as it has points)."""
    fam = FAMILIES.get(vae.family)
    if mode == "meta":
        return fam.phases if fam is not None else (VIDEO_PHASES if vae.is_video else IMAGE_PHASES)
    if fam is not None:
        return fam.real_phases
    return REAL_VIDEO_PHASES if vae.is_video else REAL_IMAGE_PHASES


VARIANT_LATENT = (3, 2, 2)
"""``(T, h, w)`` of the reference decode whose meta-sized peak :func:`host_variant` records."""
_VARIANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def host_variant(vae: Any, known: str | None) -> str:
    """How the host's decoder behaves, for a family whose memory depends on it (``Family.host_keyed``):
    ``"<cache protocol>-<peak KiB>k"``, the Wan cache protocol (:func:`..vae.wan_layout.cache_protocol`) and the
    live-tensor peak of the host's own decode of a reference latent (:data:`VARIANT_LATENT`, float32, fake
    CPU tensors: the same code allocates the same bytes, on any machine). Measured on ComfyUI 0.3.75 / 0.33:
    Wan 2.1 ``carry-4466k`` / ``per_call-3406k``; Wan 2.2 ``carry-18306k`` / ``carry-15442k``. A host whose
    decoder allocates otherwise gets no shipped model and is calibrated at first use. "" for other families
    (memoised per model object). ``known``: the VAE's known family or None."""
    fam = FAMILIES.get(known or "")
    if fam is None or not fam.host_keyed:
        return ""
    model = vae.first_stage_model
    if model not in _VARIANTS:
        from ..vae.wan_layout import cache_protocol, wan_layout

        channels = wan_layout(model).latent_channels  # the decoder's own (identify matched it to the family's)
        with torch.inference_mode(), MetaSizer([model], torch.float32) as sizer:  # as ComfyUI runs nodes
            out = model.decode(torch.empty((1, channels, *VARIANT_LATENT)))
            del out
        _VARIANTS[model] = f"{cache_protocol(model).name}-{sizer.peak_bytes // 1024}k"
    return _VARIANTS[model]


@dataclasses.dataclass(frozen=True)
class Subject:
    """A ComfyUI VAE as its cost models see it, identified once (:func:`subject`)."""

    vae: Any
    geometry: VaeGeometry
    """The known family's geometry, else one from the VAE's ratios."""
    key_name: str
    """The key's family: the known family, else the model class and a digest of its structure."""
    variant: str
    """:func:`host_variant`."""
    model_class: str
    channels: int
    device: torch.device
    dtype: torch.dtype


def subject(vae: Any, *, family: str | None = None, spatial_ratio: int | None = None, channels: int | None = None,
            device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Subject:
    """``vae`` for calibration and lookup. ``family``: the caller's ``identify(vae) or model_name(vae)`` (None:
    identified here); ``spatial_ratio``: the caller's inferred ratio (an unknown VAE); the rest default to the
    VAE's own attributes."""
    known = identify(vae) if family is None else (family if family in FAMILIES else None)
    return Subject(
        vae=vae,
        geometry=geometry_of(vae, known, spatial_ratio=spatial_ratio),
        key_name=known or model_key_name(vae),
        model_class=model_name(vae),
        variant=host_variant(vae, known),
        channels=int(channels if channels is not None else getattr(vae, "latent_channels", 4)),
        device=torch.device(device if device is not None else getattr(vae, "device", "cpu")),
        dtype=dtype if dtype is not None else getattr(vae, "vae_dtype", torch.float32),
    )


def vae_key(s: Subject, executor: str = "full") -> ModelKey:
    """The cost-model key: the known family (and :func:`host_variant`), else the model class and structure."""
    return ModelKey.make(s.key_name, executor, s.dtype, s.device, s.variant)


def calibrate_vae(
    s: Subject,
    *,
    executor: str = "full",
    run: Callable[[Geometry], object] | None = None,
    mode: Literal["meta", "real"] = "meta",
    geometries: Sequence[Geometry] | None = None,
    phases: Sequence[Sequence[str]] | None = None,
) -> CostModel:
    """Fit a cost model for ``s`` and ``executor``.

    ``run``: the executor's ``run(geometry)`` (default: ComfyUI's untiled
    ``first_stage_model.decode``, the ``full`` executor). ``mode="meta"`` sizes on fake tensors;
    ``"real"`` decodes under a :class:`.tracker.PeakTracker` (the weights must already be on the
    device).
    """
    geo = s.geometry
    grid = list(geometries) if geometries is not None else (fit_grid(geo) if mode == "meta" else real_grid(geo))
    ph = [tuple(p) for p in phases] if phases is not None else default_phases(geo, mode)
    model = s.vae.first_stage_model
    if run is None:
        if executor != "full":
            raise ValueError(f"executor {executor!r} needs its own run(geometry)")
        run = decode_run(model.decode, s.channels, s.dtype, s.device)
    factory = meta_sizer_factory([model], s.dtype, s.device) if mode == "meta" else tracker_factory(s.device)
    inputs = {
        "model_class": s.model_class,
        "mode": mode,
        "tracker": "meta (fake tensors, dispatch count)" if mode == "meta" else factory().method,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    return calibrate(run, grid, factory, key=vae_key(s, executor), phases=ph, source=f"{mode} calibration",
                     inputs=inputs)


def cost_model_for(
    s: Subject,
    store: CostModelStore,
    *,
    executor: str = "full",
    run: Callable[[Geometry], object] | None = None,
    before_real: Callable[[], None] | None = None,
    first_use: Any = None,
    phases: Sequence[Sequence[str]] | None = None,
) -> CostModel:
    """The cost model to plan ``s``'s decode with: cached or shipped for its key, else calibrated once now
    (meta sizing, falling back to real decodes when the decoder cannot run on fake tensors; ``before_real()``
    first, e.g. to load the weights; shown and timed as a ``first_use`` phase) and cached in ``store``.
    ``phases``: the executor's feature phases (default: the family's, :func:`default_phases`)."""
    key = vae_key(s, executor)

    def fit() -> CostModel:
        try:
            return calibrate_vae(s, executor=executor, run=run, mode="meta", phases=phases)
        except Exception as e:  # noqa: BLE001 - any op without a fake kernel: fall back to real runs
            log.warning("meta sizing failed for %s (%s: %s); calibrating with real decodes", key,
                        type(e).__name__, e)
        if before_real is not None:
            before_real()
        return calibrate_vae(s, executor=executor, run=run, mode="real", phases=phases)

    if first_use is None:
        return store.get_or_calibrate(key, fit)
    what = f"calibrating its memory model ({executor})"
    return store.get_or_calibrate(key, lambda: first_use.run(what, fit))
