"""Decode geometry: what one decoder pass computes, and the geometry features cost models use.

Conventions (all sizes in *latent* units unless a name says ``out``/``px``):

* image latents are ``(B, C, H, W)``; video latents are ``(B, C, T, H, W)``;
* output pixels = latent px x ``spatial_ratio``;
* video output frames of a pass: a chunk that contains latent frame 0 yields ``1 + r (T - 1)`` frames
  (the first latent frame decodes to one frame), any later chunk ``r T`` (``r`` = ``temporal_ratio``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class VaeGeometry:
    """How a VAE maps latents to pixels, and what its tiles need.

    ``halo``: latent px of context a tile needs on each inner side so that cropping it reproduces the
    untiled decode (planner default; an executor may ask for another). ``align``: tile cores are
    rounded up to a multiple of this many latent px where possible.
    """

    family: str
    spatial_ratio: int
    temporal_ratio: int = 1
    halo: int = 8
    align: int = 1

    @property
    def is_video(self) -> bool:
        return self.temporal_ratio > 1

    def out_frames(self, latent_frames: int) -> int:
        """Output frames of a whole clip of ``latent_frames`` latent frames (1 for an image)."""
        if latent_frames <= 0:
            return 1
        if self.temporal_ratio <= 1:
            return latent_frames
        return 1 + self.temporal_ratio * (latent_frames - 1)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One decoder pass: ``batch`` latents of ``latent_h x latent_w`` (halo included) and, for
    video, ``latent_frames`` latent frames (``0`` = image latent).

    ``job_*`` describe the whole decode the pass belongs to (``0`` = same as the pass); executors that
    keep a full output buffer or per-tile caches pay for the job size, not the pass size.
    """

    latent_h: int
    latent_w: int
    batch: int = 1
    latent_frames: int = 0
    first_chunk: bool = True
    spatial_ratio: int = 8
    temporal_ratio: int = 1
    job_batch: int = 0
    job_latent_h: int = 0
    job_latent_w: int = 0
    job_latent_frames: int = -1

    def __post_init__(self) -> None:
        for name in ("latent_h", "latent_w", "batch", "spatial_ratio", "temporal_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"Geometry.{name} must be >= 1, got {getattr(self, name)}")
        if self.latent_frames < 0:
            raise ValueError(f"Geometry.latent_frames must be >= 0, got {self.latent_frames}")

    # -- pass ----------------------------------------------------------------------------------
    @property
    def is_video(self) -> bool:
        return self.latent_frames > 0

    @property
    def out_h(self) -> int:
        return self.latent_h * self.spatial_ratio

    @property
    def out_w(self) -> int:
        return self.latent_w * self.spatial_ratio

    @property
    def out_frames(self) -> int:
        return decoded_frames(self.latent_frames, self.temporal_ratio, self.first_chunk)

    @property
    def frames_per_step(self) -> int:
        """Output frames one latent frame yields at most in this pass (1, or the temporal ratio)."""
        if not self.is_video:
            return 1
        if self.latent_frames == 1 and self.first_chunk:
            return 1
        return self.temporal_ratio

    # -- job -----------------------------------------------------------------------------------
    @property
    def job(self) -> tuple[int, int, int, int]:
        """``(batch, latent_h, latent_w, latent_frames)`` of the whole decode."""
        return (
            self.job_batch or self.batch,
            self.job_latent_h or self.latent_h,
            self.job_latent_w or self.latent_w,
            self.latent_frames if self.job_latent_frames < 0 else self.job_latent_frames,
        )

    def features(self, names: Sequence[str]) -> list[float]:
        return [float(FEATURES[n].fn(self)) for n in names]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Geometry:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def describe(self) -> str:
        text = f"{self.batch}x {self.latent_h}x{self.latent_w} latent -> {self.out_h}x{self.out_w} px"
        if self.is_video:
            text += f", {self.latent_frames} latent frames -> {self.out_frames} frames"
            if not self.first_chunk:
                text += " (later chunk)"
        return text


def decoded_frames(latent_frames: int, temporal_ratio: int, first_chunk: bool) -> int:
    """Output frames of ``latent_frames`` decoded in one pass: a first chunk starts with latent frame 0, which
    yields one frame (``1 + r (T - 1)``); a later chunk yields ``r T``; at least 1."""
    if latent_frames <= 0:
        return 1
    if temporal_ratio <= 1:
        return latent_frames
    if first_chunk:
        return 1 + temporal_ratio * (latent_frames - 1)
    return temporal_ratio * latent_frames


def for_latent(shape: Sequence[int], vae: VaeGeometry) -> Geometry:
    """The geometry of decoding a whole latent of ``shape`` in one pass."""
    if len(shape) == 4:
        b, _, h, w = shape
        t = 0
    elif len(shape) == 5:
        b, _, t, h, w = shape
    else:
        raise ValueError(f"latent shape must be (B,C,H,W) or (B,C,T,H,W), got {tuple(shape)}")
    return Geometry(
        latent_h=int(h),
        latent_w=int(w),
        batch=int(b),
        latent_frames=int(t),
        spatial_ratio=vae.spatial_ratio,
        temporal_ratio=vae.temporal_ratio,
    )


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    doc: str
    fn: Callable[[Geometry], float]


def _job_px(g: Geometry) -> float:
    b, h, w, _ = g.job
    return b * h * w * g.spatial_ratio**2


def _job_px_frames(g: Geometry) -> float:
    b, h, w, t = g.job
    return b * h * w * g.spatial_ratio**2 * decoded_frames(t, g.temporal_ratio, True)


_FEATURE_LIST = [
    Feature("const", "1 (fixed cost of a pass)", lambda g: 1.0),
    Feature(
        "px", "output pixels of one frame of the pass, times batch", lambda g: g.batch * g.out_h * g.out_w
    ),
    Feature(
        "px_step",
        "px x output frames one latent frame yields (1, or the temporal ratio): the working set of a "
        "causal video decoder that steps one latent frame at a time",
        lambda g: g.batch * g.out_h * g.out_w * g.frames_per_step,
    ),
    Feature(
        "px_frames",
        "px x output frames of the pass: output pixel-frames computed in the pass",
        lambda g: g.batch * g.out_h * g.out_w * g.out_frames,
    ),
    Feature(
        "px_cache2",
        "px x min(2, output frames before the pass's last temporal step): a causal video decoder that "
        "keeps its last 2 frames per convolution as a cache (Wan's CACHE_T = 2)",
        lambda g: (
            g.batch * g.out_h * g.out_w * min(2, max(0, g.out_frames - g.frames_per_step))
            if g.is_video
            else 0.0
        ),
    ),
    Feature(
        "px_later",
        "px when the pass decodes latent frames after the first, else 0: a causal video decoder whose caches and "
        "steady-state working set exist only then, whatever the number of frames per call (ComfyUI 0.33's Wan "
        "2.1: no caches for one latent frame, two latent frames per call after it)",
        lambda g: g.batch * g.out_h * g.out_w if g.latent_frames > 1 or (g.is_video and not g.first_chunk) else 0.0,
    ),
    Feature(
        "tokens_sq",
        "batch x (latent_h x latent_w)^2: a materialised attention matrix over one latent frame",
        lambda g: g.batch * float(g.latent_h * g.latent_w) ** 2,
    ),
    Feature(
        "latent",
        "latent px of the pass (x latent frames): input-sized buffers",
        lambda g: g.batch * g.latent_h * g.latent_w * max(1, g.latent_frames),
    ),
    Feature("job_px", "output pixels of one frame of the whole decode (per-tile caches)", _job_px),
    Feature(
        "job_px_frames", "output pixel-frames of the whole decode (a full output buffer)", _job_px_frames
    ),
]

FEATURES: dict[str, Feature] = {f.name: f for f in _FEATURE_LIST}
