"""Which engine decodes a latent, for both decode nodes: every latent VAE Decode takes decodes in either node (a
swapped template never fails where the original runs), each routed by what the VAE is, not by the node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..memory.decode import image as image_engine
from ..memory.decode import video as video_engine
from ..memory.vae.one_frame import one_frame_clip, one_frame_vae
from ..memory.vae.wan_layout import wan_layout
from . import _comfy

__all__ = ["job_for"]

IMAGE = "Tiled VAE Decode"
VIDEO = "Temporal-Chunk Video Decode"


def _noted(note: str, route: str) -> str:
    return f"{note}; {route}" if note else route


def job_for(node: str, vae: Any, samples: Any, stream: str, *, tile_size: int = 0, halo: int = -1,
            frames_per_chunk: int = 0) -> tuple[image_engine.ImageJob | video_engine.VideoJob, Callable[..., Any], str]:
    """``(job, decode, note)`` of ``node``'s decode of ``samples``: ``decode`` the engine that decodes ``job``
    (identified once: :func:`..memory.decode.video.video_engine` for a video job), ``note`` how the latent was
    reshaped or which other engine decodes it ("" when neither). The user's bad input raises the node's input
    error."""
    job, note = _job(node, vae, samples, stream, tile_size=tile_size, halo=halo, frames_per_chunk=frames_per_chunk)
    if isinstance(job, video_engine.VideoJob):
        return job, video_engine.video_engine(job), note
    return job, image_engine.decode_image, note


def _job(node: str, vae: Any, samples: Any, stream: str, *, tile_size: int, halo: int,
         frames_per_chunk: int) -> tuple[image_engine.ImageJob | video_engine.VideoJob, str]:
    """``(job, note)`` of :func:`job_for`."""
    z, label, note = _comfy.latent_tensor(node, vae, samples, stream)
    if hasattr(vae, "throw_exception_if_invalid"):
        vae.throw_exception_if_invalid()
    out = _comfy.intermediate_device()
    core = _comfy.has_core_decode(vae)
    one = one_frame_vae(vae) if z.ndim == 5 and z.shape[2] == 1 else None
    if one is not None:  # a 3-D image VAE (Hunyuan Image 2.1's refiner): its one-frame latents are images
        route = ("one-frame latents of a 3-D image VAE: decoded as images, the 3-D decoder's tiles holding all of "
                 "its frames")
        if frames_per_chunk > 1:
            route += f"; frames_per_chunk {frames_per_chunk} does not apply (one latent frame)"
        return image_engine.make_job(one, z[:, :, 0], core=core, out_device=out, tile_size=tile_size,
                                     halo=halo), _noted(note, route)
    if z.ndim == 4 and one_frame_clip(vae):  # an image VAE with a Wan-layout decoder (Qwen-Image 2.1's VAE)
        route = (f"an image VAE with a Wan-layout decoder ({wan_layout(vae.first_stage_model).variant}): each latent "
                 "decoded as a one-frame clip by the chunked Wan executor (mid attention on the whole frame, the up "
                 "path in tiles)")
        return video_engine.make_job(vae, z.unsqueeze(2), out, tile_size=tile_size, one_frame=True), _noted(note,
                                                                                                              route)
    if z.ndim == 5:  # a video VAE's latent: the video engine (exact chunks where described)
        if node != VIDEO and z.shape[2] > 1:
            note = _noted(note, f"{label} is a video latent of {z.shape[2]} frames: the video engine decodes it, as "
                                f"{VIDEO} (VRAM Fit) does (same frames as VAE Decode, flattened into one batch)")
        elif node != VIDEO:
            route = f"the video engine decodes them, as {VIDEO} (VRAM Fit) does"
            note = _noted(note, route) if note else f"single frames of a video VAE: {route}"
        return video_engine.make_job(vae, z, out, frames_per_chunk=frames_per_chunk, tile_size=tile_size), note
    if node != IMAGE:  # an image VAE's latent on the video node: the image engine, as VAE Decode decodes it
        note = _noted(note, f"{label} on an image VAE: decoded as images by {IMAGE}'s engine, as VAE Decode does")
    return image_engine.make_job(vae, z, core=core, out_device=out, tile_size=tile_size, halo=halo), note
