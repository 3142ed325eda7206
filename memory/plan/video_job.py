"""The video job: what a video decode decodes (:class:`VideoJob`), its output geometry as the host's decode gives it,
and the keys and store of its meta-sized peaks (:class:`PeakStore`); the planners of :mod:`.video`, :mod:`.host_grid`
and :mod:`.seedvr2` share them. Nothing here imports ComfyUI."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..cost.phases import dtype_name
from ..executors import wan as vc
from ..measure.sizing import MetaSizer
from ..store import Store
from ..vae.carry_layout import CarryLayout
from ..vae.wan_layout import CacheProtocol, WanLayout

__all__ = ["REPORT_NODE", "PeakStore", "VideoJob", "blend_fn", "blend_ratios", "chunk_frames", "executor_digest",
           "host_fn", "meta_peak", "meta_sizes", "model_key", "out_bytes"]

REPORT_NODE = "Temporal-Chunk Video Decode"


class PeakStore(Store[int]):
    """Meta-sized peaks by key (:func:`peak_key`): in memory, and in a JSON file when ``path`` is given (the
    node passes one under ComfyUI's user folder). A plan keeps what it sizes and writes the file once."""

    section = "peaks"
    schema = 1
    what = "video peak"

    def decode(self, value: Any) -> int:
        return int(value)


def meta_peak(job: VideoJob, run: Callable[[], Any]) -> int:
    """Peak bytes of ``run()`` on fake tensors with the job's model, dtype and device, under
    ``torch.inference_mode`` as ComfyUI runs nodes (what ``run`` returns is dropped at once)."""
    return meta_sizes(job, run)[0]


def meta_sizes(job: VideoJob, run: Callable[[], Any], track_host: bool = False) -> tuple[int, int]:
    """:func:`meta_peak` and, with ``track_host``, the peak bytes ``run()`` keeps in host memory (0 otherwise)."""
    with torch.inference_mode(), MetaSizer([job.vae.first_stage_model], job.dtype, job.device,
                                           track_host=track_host) as sizer:
        run()
    return int(sizer.peak_bytes), int(sizer.host_peak_bytes)


def executor_digest() -> str:
    """The chunked executor's version (``executors.wan.EXECUTOR_VERSION``), part of every persisted peak's key."""
    return vc.EXECUTOR_VERSION


# --------------------------------------------------------------------------------------------------
# The job


@dataclasses.dataclass(frozen=True)
class VideoJob:
    vae: Any
    z: torch.Tensor
    layout: WanLayout | None
    """The Wan decoder's layout (walked once, by ``make_job``); None: another video VAE (overlap-blend)."""
    family: str
    dtype: torch.dtype
    device: torch.device
    out_device: torch.device
    fingerprint: str
    """The decoder's code fingerprint (:func:`.self_check.code_fingerprint`), part of every peak's key."""
    frames_per_chunk: int = 0
    """The user's latent frames per chunk (0: auto)."""
    tile_size: int = 0
    """The user's tile side in output px (0: auto; Wan only)."""
    verdict: Any = None
    """The chunked executor's self-check on this host (a :class:`.self_check.Verdict`; None: not checked)."""
    carry: CarryLayout | None = None
    """A causal decoder without a host cache (:mod:`..vae.carry_layout`): exact carried-context chunks."""
    carry_why: str = ""
    """Why there are no carried-context chunks (``carry`` None; "" for Wan), for the report."""
    blend_why: str = ""
    """Why no overlap-blend can serve this decoder (:func:`..vae.carry_layout.blend_refusal`; "" when one may)."""
    host_room: int | None = None
    """Bytes a store in host memory may take (:func:`..budget.host_room`, set after the offload; None: unbounded)."""
    protocol: CacheProtocol | None = None
    """The host's cache protocol of a Wan decoder (:func:`..vae.wan_layout.cache_protocol`, probed once by
    ``make_job``); None: another video VAE."""
    one_frame: bool = False
    """``z`` holds the 2-D latents of an image VAE with a Wan-layout decoder (Qwen-Image 2.1's VAE), each a
    one-frame clip: the host decodes them as 4-D latents (:func:`host_fn`), the reference of every check."""

    @property
    def wan(self) -> bool:
        return self.layout is not None

    @property
    def out_channels(self) -> int:
        """Channels of the decoded frames: the Wan layout's (4 for Qwen-Image 2.1's RGBA), else the VAE's
        ``output_channels`` (3)."""
        return self.layout.out_channels if self.layout is not None else int(getattr(self.vae, "output_channels", 3))


def out_bytes(job: VideoJob, frames: int, h: int, w: int) -> int:
    """The float32 output buffer (``job.out_channels``), when it lives on the compute device's type."""
    if job.out_device.type != job.device.type:
        return 0
    return int(job.z.shape[0]) * frames * h * w * job.out_channels * 4


def model_key(job: VideoJob, fingerprint: str | None = None) -> str:
    """What a sized peak depends on besides the decode's own inputs: the model class, its code fingerprint
    (``fingerprint``, default :attr:`VideoJob.fingerprint`), the host's cache protocol, the executor's
    version, dtype and device type."""
    model = job.vae.first_stage_model
    cls = type(model)
    proto = job.protocol.name if job.protocol is not None else "-"
    return (f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__qualname__}/{fingerprint or job.fingerprint}/{proto}"
            f"/video-{executor_digest()}/{dtype_name(job.dtype)}/{job.device.type}")


def blend_ratios(vae: Any) -> tuple[Callable[[int], Any] | int | float, Callable[[int], Any] | int | None, int]:
    """``(frames, index_formula, spatial)`` of ``vae.upscale_ratio`` for :func:`.blend.decode_overlap_blend`:
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


def host_fn(job: VideoJob) -> Callable[[torch.Tensor], torch.Tensor]:
    """The host's own decode of a 5-D latent as VAE Decode runs it: ``first_stage_model.decode``; for
    :attr:`VideoJob.one_frame` jobs its decode of the 4-D latent, the time axis added back."""
    model = job.vae.first_stage_model
    if job.one_frame:
        return lambda z: model.decode(z[:, :, 0]).unsqueeze(2)
    return model.decode


def blend_fn(job: VideoJob) -> Callable[[torch.Tensor], torch.Tensor]:
    """One chunk's decode as ``VAE.decode`` feeds it (the VAE's dtype and device), float32 frames."""
    model = job.vae.first_stage_model

    def fn(a: torch.Tensor) -> torch.Tensor:
        return model.decode(a.to(job.dtype).to(job.device)).float()

    return fn


_CHUNK_FRAMES: dict[tuple[str, int, int, int], int] = {}


def chunk_frames(job: VideoJob, length: int) -> int:
    """Frames the host's decode gives for ``length`` latent frames (meta-sized once per decoder and size)."""
    _, c, _, h, w = (int(v) for v in job.z.shape)
    key = (model_key(job), int(length), h, w)
    if key not in _CHUNK_FRAMES:
        with torch.inference_mode(), MetaSizer([job.vae.first_stage_model], job.dtype, job.device):
            out = blend_fn(job)(torch.empty((1, c, int(length), h, w), dtype=job.dtype, device=job.device))
            _CHUNK_FRAMES[key] = int(out.shape[2])
            del out
    return _CHUNK_FRAMES[key]
