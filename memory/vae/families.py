"""VAE families the pack knows, and how to recognise them on a ComfyUI ``VAE`` object.

A family fixes the geometry (spatial/temporal ratio, planner halo) and the feature phases its cost
models use (chosen by measurement, see docs/MEMORY.md). Recognition reads plain attributes of the object
ComfyUI passes (``vae.first_stage_model``, ``vae.upscale_ratio``, ``vae.latent_dim``, ``vae.latent_channels``) and
the structure of its modules (a Wan decoder's layout, :func:`wan_family`), never a module name: nothing here imports
ComfyUI.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from ..geometry import VaeGeometry
from .wan_layout import is_wan_vae, wan_layout


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    description: str
    geometry: VaeGeometry
    latent_channels: int
    phases: tuple[tuple[str, ...], ...]
    """Feature phases of the ``full`` executor's cost model (ComfyUI's untiled decode), for a
    calibration over the wide meta grid."""
    real_phases: tuple[tuple[str, ...], ...]
    """Features a calibration from a few *small real* decodes can identify (no more features than
    :func:`.calibration.real_grid` has points; the quadratic attention phase never shows there)."""
    host_keyed: bool = False
    """The decode memory depends on the host's decoder code, not only on the family (measured: ComfyUI 0.33
    changed both Wan decoders'): its cost models are keyed by :func:`.calibration.host_variant` too."""


_IMAGE_PHASES = (("const", "px"), ("const", "px", "tokens_sq"))
# Video: one phase. The per-frame attention at latent resolution would only dominate beyond ~3 Kpx
# (measured on meta up to 3072^2), and a second phase fitted on a grid where it never dominates
# only adds a spurious constant floor.
_VIDEO_PHASES = (("const", "px", "px_step", "px_cache2", "px_frames"),)
# Wan: ``px_later`` instead of ``px_step`` (for video passes px_step = px + 3 px_later, so the span is the
# same, but a non-negative fit can also express a one-frame pass far below a quarter of a later one: ComfyUI
# 0.33 decodes one latent frame without any cache). Measured on both hosts: meta fit within 1 %, 21-frame
# extrapolation within 1 % (docs/VIDEO_DECODE.md, "Cost models of the host's own decode").
_WAN_PHASES = (("const", "px", "px_later", "px_cache2", "px_frames"),)
# Four small real decodes identify four features: the steady state of the causal caches (px_later,
# px_cache2); output accumulation is negligible at small sizes. HunyuanVideo decodes the whole clip at once
# (its peak grows with every output frame).
_WAN_REAL = (("const", "px", "px_later", "px_cache2"),)
_WHOLE_CLIP_REAL = (("const", "px", "px_step", "px_frames"),)

FAMILIES: dict[str, Family] = {
    "kl": Family(
        "kl",
        "KL-f8 image VAE (SD1.x/SD2/SDXL 4 ch, SD3/Flux 16 ch): GroupNorm decoder, global mid attention",
        VaeGeometry("kl", spatial_ratio=8, temporal_ratio=1, halo=8, align=1),
        4,
        _IMAGE_PHASES,
        (("const", "px"),),
    ),
    "wan21": Family(
        "wan21",
        "Wan 2.1 video VAE: causal 3-D convs with per-frame caches, 8x spatial, 4x temporal",
        VaeGeometry("wan21", spatial_ratio=8, temporal_ratio=4, halo=8, align=1),
        16,
        _WAN_PHASES,
        _WAN_REAL,
        host_keyed=True,
    ),
    "wan22": Family(
        "wan22",
        "Wan 2.2 video VAE: causal 3-D convs, 16x spatial, 4x temporal",
        # halo: the tiled part's reach at the chunked executor's default split (5.75 latent px, walked and
        # measured: docs/VIDEO_DECODE.md); 4 was inexact.
        VaeGeometry("wan22", spatial_ratio=16, temporal_ratio=4, halo=6, align=1),
        48,
        _WAN_PHASES,
        _WAN_REAL,
        host_keyed=True,
    ),
    "hunyuan_video": Family(
        "hunyuan_video",
        "HunyuanVideo 3-D KL VAE: whole clip decoded at once, 8x spatial, 4x temporal",
        VaeGeometry("hunyuan_video", spatial_ratio=8, temporal_ratio=4, halo=8, align=1),
        16,
        _VIDEO_PHASES,
        _WHOLE_CLIP_REAL,
    ),
}


def _ratios(vae: Any) -> tuple[int, int]:
    """``(spatial, temporal)`` decode ratios of a ComfyUI VAE (temporal 1 for image VAEs)."""
    up = getattr(vae, "upscale_ratio", 8)
    if isinstance(up, (tuple, list)):
        spatial = int(up[-1])
        t = up[0]
        temporal = round(t(8192) / 8192) if callable(t) else int(t)
        return spatial, max(1, temporal)
    return int(up), 1


KL_DECODER = {
    "ch": 128,
    "widths": (128, 256, 512, 512),
    "res_blocks": 2,
    "up_attn": False,
    "mid_attn": True,
    "out_ch": 3,
    "kernel": (3, 3),
    "tanh_out": False,
}
"""The decoder the shipped ``kl`` cost models were measured on (``ch`` 128, ``ch_mult`` (1, 2, 4, 4), 2 res
blocks per level, mid attention only, RGB out, 2-D convs): SD1.x/SD2/SDXL (z 4) and SD3/FLUX (z 16) share it."""


def kl_decoder_structure(decoder: Any) -> dict[str, Any] | None:
    """What of ComfyUI's KL ``Decoder`` (``comfy.ldm.modules.diffusionmodules.model``) fixes its memory
    (:data:`KL_DECODER`'s fields plus ``z_channels``), or ``None`` if ``decoder`` does not expose it."""
    try:
        up = list(decoder.up)
        res_blocks = int(decoder.num_res_blocks)
        return {
            "ch": int(decoder.ch),
            "widths": tuple(int(level.block[-1].out_channels) for level in up),
            "res_blocks": res_blocks if all(len(level.block) == res_blocks + 1 for level in up) else None,
            "up_attn": any(len(level.attn) for level in up),
            "mid_attn": hasattr(decoder.mid, "attn_1"),
            "out_ch": int(decoder.conv_out.out_channels),
            "kernel": tuple(decoder.conv_in.kernel_size),
            "tanh_out": bool(getattr(decoder, "tanh_out", False)),
            "z_channels": int(decoder.conv_in.in_channels),
        }
    except (AttributeError, TypeError, ValueError, IndexError):
        return None


def _is_shipped_kl(decoder: Any, channels: int) -> bool:
    found = kl_decoder_structure(decoder)
    return found is not None and found == dict(KL_DECODER, z_channels=channels)


def identify(vae: Any) -> str | None:
    """The known family of a ComfyUI ``VAE`` object, or ``None``."""
    model = getattr(vae, "first_stage_model", None)
    if model is None:
        return None
    name = type(model).__name__
    spatial, temporal = _ratios(vae)
    latent_dim = int(getattr(vae, "latent_dim", 2))
    channels = int(getattr(vae, "latent_channels", 0))
    if is_wan_vae(model):
        return wan_family(model)
    if name in ("AutoencoderKL", "AutoencodingEngine"):
        decoder = getattr(model, "decoder", None)
        decoder_name = type(decoder).__name__ if decoder is not None else ""
        if (
            latent_dim == 2
            and spatial == 8
            and temporal == 1
            and channels in (4, 16)
            and decoder_name == "Decoder"
            and _is_shipped_kl(decoder, channels)  # another KL variant is calibrated, not given these models
        ):
            return "kl"
        if (
            latent_dim == 3
            and spatial == 8
            and temporal == 4
            and channels == 16
            and decoder_name == "Decoder"
        ):
            return "hunyuan_video"
    return None


WAN_FAMILIES = {"wan21": ("2.1", 16, 3, 1, 3), "wan22": ("2.2", 48, 3, 2, 3)}
"""``{family: (layout version, latent channels, image channels, patch, temporal kernel)}`` of the Wan decoders the
shipped cost models were measured on."""


def wan_family(model: Any) -> str | None:
    """``"wan21"`` / ``"wan22"`` when a Wan-layout ``first_stage_model``'s structure (:func:`.wan_layout.wan_layout`:
    layout, latent and image channels, patch, temporal kernel) is that family's, else None: a variant of the layout
    (Qwen-Image 2.1's VAE: 64 channels, temporal kernel 1, patch 1, RGBA) is its own structure, calibrated at first
    use. Never read from a module or class name."""
    try:
        lay = wan_layout(model)
    except ValueError:
        return None
    found = (lay.version, lay.latent_channels, lay.out_channels, lay.patch, lay.temporal_kernel)
    return next((name for name, want in WAN_FAMILIES.items() if found == want), None)


def model_name(vae: Any) -> str:
    """The name of an unknown VAE: its ``first_stage_model`` class (module-qualified), or the ``family_name`` a
    wrapper gives it (:class:`.one_frame.OneFrameModel`)."""
    model = getattr(vae, "first_stage_model", None)
    named = getattr(model, "family_name", None)
    if isinstance(named, str):
        return named
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}"


def model_key_name(vae: Any) -> str:
    """The cost-model key of an unknown VAE: :func:`model_name` plus a digest of its structure
    (parameter and buffer names and shapes), so two configurations of one class (e.g. a DC-AE
    f32c32 and f64c128) never share a cost model."""
    return f"{model_name(vae)}.{structure_digest(getattr(vae, 'first_stage_model', None))}"


def structure_digest(model: Any) -> str:
    """Short hash of a module's parameter and buffer names and shapes ("na" for a non-module)."""
    named = []
    for attr in ("named_parameters", "named_buffers"):
        fn = getattr(model, attr, None)
        if callable(fn):
            named.extend(f"{name}:{tuple(t.shape)}" for name, t in fn())
    if not named:
        return "na"
    return hashlib.sha256(";".join(named).encode()).hexdigest()[:10]


def vae_geometry(vae: Any, halo: int | None = None) -> VaeGeometry:
    """The :class:`VaeGeometry` of a ComfyUI VAE: the family's, or from its ratios if unknown."""
    return geometry_of(vae, identify(vae), halo=halo)


def geometry_of(vae: Any, known: str | None, *, spatial_ratio: int | None = None,
                halo: int | None = None) -> VaeGeometry:
    """:func:`vae_geometry` for a caller that has identified ``vae`` already (``known``: its family or None);
    ``spatial_ratio``: the caller's, when it inferred one (an unknown VAE without ``upscale_ratio``)."""
    if known is not None:
        g = FAMILIES[known].geometry
        return g if halo is None else dataclasses.replace(g, halo=halo)
    spatial, temporal = _ratios(vae)
    return VaeGeometry(model_name(vae), spatial_ratio or spatial, temporal, halo=8 if halo is None else halo)


TIME_MIXING_NAMES = ("mix_factor", "time_mix", "time_stack")
"""Names of the parts of a decoder that blend its batch items as frames of one video (SVD's temporal decoder:
``VideoResBlock.mix_factor`` / ``time_stack``, ``AE3DConv.time_mix_conv``, ``AttnVideoBlock.time_mix_block``)."""


def batch_coupling_hint(model: Any) -> str:
    """A cheap structural hint that ``model`` mixes the items of its batch (they are one video's frames): the
    first ``VideoDecoder`` module or part named after time mixing (:data:`TIME_MIXING_NAMES`), as text for a
    report; "" when none is seen. Only a hint: the batch self-check (``decode.image.check_batch``) is the proof,
    and decoders that mix their batch otherwise are caught by it alone."""
    modules = getattr(model, "named_modules", None)
    if not callable(modules):
        return ""
    for name, m in modules():
        where = name or type(m).__name__
        if type(m).__name__ == "VideoDecoder":
            return f"{where} is a VideoDecoder (the batch is one video's frames)"
        own = [n for n, _ in m.named_children()]
        own += [n for n, _ in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]
        for part in own:
            if part.startswith(TIME_MIXING_NAMES):
                return f"{where}.{part} mixes frames across the batch"
    return ""
