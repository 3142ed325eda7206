"""Random-weight VAEs with the real ComfyUI architectures, and structured latents, for tests and demos.

The models are built from ComfyUI's own classes with the exact configuration ``comfy.sd.VAE`` picks
when it detects them, so ComfyUI's ``VAELoader`` loads the files with no missing or leftover keys and
builds the same ``first_stage_model`` it would for the real releases:

* ``kl_f8``          SD1.x/SDXL ``AutoencoderKL`` (4 latent channels, 8x spatial), float16.
* ``wan21``          Wan 2.1 ``comfy.ldm.wan.vae.WanVAE`` (16 channels, 8x spatial, 4x temporal), bfloat16.
* ``wan22``          Wan 2.2 ``comfy.ldm.wan.vae2_2.WanVAE`` (48 channels, 16x spatial, 4x temporal), bfloat16.
* ``hunyuan_video``  HunyuanVideo 3-D ``AutoencoderKL`` (16 channels, 8x spatial, 4x temporal), bfloat16.
* ``flux``           FLUX.1 ``ae.safetensors``: ``AutoencodingEngine`` with the KL encoder/decoder at 16 latent
                     channels and no quant convs (ComfyUI's ``VAELoader`` picks that branch from the keys), float32.
* ``flux2``          FLUX.2 ``flux2-vae``: ``AutoencoderKL`` with ``batch_norm_latent`` (z 32, quant convs, a
                     BatchNorm over the 2x2-patchified latent: 128 channels, 16x spatial), keyed as BFL's
                     file (``encoder.quant_conv``, ``decoder.post_quant_conv``, ``bn.running_mean`` /
                     ``bn.running_var``), bfloat16.
* ``mochi``          Genmo Mochi ``comfy.ldm.genmo.vae.model.VideoVAE`` (12 channels, 8x spatial, 6x temporal:
                     T latent frames decode to 6*T-5), keyed ``encoder.*`` / ``decoder.*`` (both halves in one
                     file, as ComfyUI's ``VideoVAE`` state dict), bfloat16.
* ``cogvideox``      CogVideoX ``comfy.ldm.cogvideo.vae.AutoencoderKLCogVideoX`` (16 channels, 8x spatial, 4x
                     temporal), bfloat16. ComfyUI 0.33.0+ only: on an older host (0.3.75) the kind is
                     unavailable (:func:`available`); ``make_models`` skips it by default.
* ``<kind>_narrow``  narrow twins of ``wan22``, ``hunyuan_image``, ``mochi``, ``hunyuan_video15``, ``mage`` and
                     the three ``ltx_video`` versions:
                     the same host classes with a quarter (Mochi: half) of the channels (:data:`NARROW_KINDS`), for the
                     exactness and coverage tests; ComfyUI's loader builds them under :func:`narrow_host`.
* ``mage``           Mage-VAE ``comfy.ldm.mage_flow.vae.MageVAE`` (128 channels, 16x spatial; a one-step diffusion
                     decoder: a GroupNorm/window-attention CoD decoder, DiCo blocks at latent resolution, a per-patch
                     MLP), keyed as the released file (``student.dconv_encoder.*``, ``pipeline.*``), bfloat16.
                     ComfyUI 0.33.0+ only.
* ``cosmos``         Cosmos's tokenizer ``comfy.ldm.cosmos.vae.CausalContinuousVideoTokenizer`` (16 channels, 8x
                     spatial, 8x temporal: causal factorized convolutions, per-frame GroupNorm, attention per
                     frame and causal over time, a Haar unpatcher), bfloat16; its narrow twin in
                     :data:`NARROW_KINDS`.
* ``dcae_sana``      Sana's DC-AE (``dc-ae-f32c32-sana-1.0``: 32 channels, 32x spatial), diffusers'
                     ``AutoencoderDC``, bfloat16; not a ComfyUI model: ComfyUI_ExtraModels' ``ExtraVAELoader``
                     loads it into its own ``VAE`` subclass, which ``scripts/sana_vae.py`` mirrors.

``comfy.ops.disable_weight_init`` layers skip weight initialisation (their ``reset_parameters`` is a
no-op), so every layer is re-initialised with the ``reset_parameters`` of the ``torch.nn`` class it
derives from, under a fixed seed; Wan's ``RMS_norm`` gets its constructor values (gamma 1). The
temporal taps of causal 3-D convolutions are then reweighted towards the current frame (same total
variance), so each latent frame drives its own output frames as in a trained video VAE (with plain
default init, the first latent frame dominates every output frame). The weights are random and the
decoded images are not meaningful, but the compute graph, the key names, the shapes, the memory
footprint and the run time are the real ones.

Usage (repo root, the host's python)::

    python -m scripts.fixtures [--vae-dir DIR] [--seed N] [--kinds kl_f8 wan21 ...] [--force]

``make_models`` needs ComfyUI importable (``comfy`` on ``sys.path``); the CLI puts ``COMFYUI_PATH``
(environment, else ``<repo>/.cache/host.env``) on ``sys.path`` itself. ``structured_latent`` and
``write_latent_file`` need only torch and safetensors.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import math
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Mapping

import safetensors
import safetensors.torch
import torch

log = logging.getLogger("vramfit.fixtures")

GENERATOR_VERSION = "vramfit-fixtures/2"
"""Stored in each file's metadata; bump it when the weights a seed produces change."""

KINDS = (
    "kl_f8",
    "wan21",
    "wan22",
    "hunyuan_video",
    "flux",
    "flux2",
    "hunyuan_image",
    "mochi",
    "cogvideox",
    "dcae_sana",
    "hunyuan_video15",
    "cosmos",
    "ltx_video",
    "ltx_video_v0",
    "ltx_video_v1",
    "hunyuan_image_refiner",
    "seedvr2",
    "mage",
)
"""The full-size kinds; the narrow twins (:data:`NARROW_KINDS`) are appended below."""

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The ddconfigs below are copied from comfy/sd.py (ComfyUI v0.3.75, class VAE.__init__): the loader
# rebuilds the model from the state dict's keys with exactly these values.
_KL_DDCONFIG = {
    "double_z": True,
    "z_channels": 4,
    "resolution": 256,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 128,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [],
    "dropout": 0.0,
}
# dc-ae-f32c32-sana-1.0 (ComfyUI_ExtraModels VAE/conf.py "dcae-f32c32-sana-1.0-diffusers", as recorded in
# scripts/workflow_declarations.json), in diffusers' AutoencoderDC argument names.
DCAE_SANA_CONFIG = {
    "in_channels": 3,
    "latent_channels": 32,
    "attention_head_dim": 32,
    "encoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "decoder_block_types": ["ResBlock"] * 3 + ["EfficientViTBlock"] * 3,
    "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "encoder_layers_per_block": [2, 2, 2, 3, 3, 3],
    "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
    "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
    "upsample_block_type": "interpolate",
    "downsample_block_type": "Conv",
    "decoder_norm_types": "rms_norm",
    "decoder_act_fns": "silu",
    "scaling_factor": 0.41407,
}
# Hunyuan Image 2.1's VAE (comfy/sd.py: a 64-channel 2-D ``decoder.conv_in``), same on 0.3.75 and 0.33.0.
_HUNYUAN_IMAGE_DDCONFIG = {
    "block_out_channels": [128, 256, 512, 512, 1024, 1024],
    "in_channels": 3,
    "out_channels": 3,
    "num_res_blocks": 2,
    "ffactor_spatial": 32,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
    "z_channels": 64,
}
# HunyuanVideo 1.5's VAE (comfy/sd.py: a 32-channel ``decoder.conv_in.conv.weight``), same on 0.3.75 and 0.33.0.
_HUNYUAN_VIDEO15_DDCONFIG = {
    "block_out_channels": [128, 256, 512, 1024, 1024],
    "in_channels": 3,
    "out_channels": 3,
    "num_res_blocks": 2,
    "ffactor_spatial": 16,
    "ffactor_temporal": 4,
    "downsample_match_channel": True,
    "upsample_match_channel": True,
    "z_channels": 32,
}
# Hunyuan Image 2.1's refiner VAE (comfy/sd.py: a 32-channel 5-D ``decoder.conv_in.weight``, ``not_video``): the
# ``vae_refiner`` classes with ``refiner_vae`` False (zero-padded Conv3d, GroupNorm over the clip), same on both hosts.
_HUNYUAN_REFINER_DDCONFIG = dict(_HUNYUAN_VIDEO15_DDCONFIG, refiner_vae=False)
# Cosmos's tokenizer (comfy/sd.py: "decoder.unpatcher3d.wavelets" in the state dict), same on 0.3.75 and 0.33.0.
_COSMOS_DDCONFIG = {
    "z_channels": 16,
    "latent_channels": 16,
    "z_factor": 1,
    "resolution": 1024,
    "in_channels": 3,
    "out_channels": 3,
    "channels": 128,
    "channels_mult": [2, 4, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [32],
    "dropout": 0.0,
    "patch_size": 4,
    "num_groups": 1,
    "temporal_compression": 8,
    "spacial_compression": 8,
}
_WAN_DDCONFIG = {
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
}


@dataclasses.dataclass(frozen=True)
class FixtureSpec:
    """One fixture model and the facts ComfyUI's loader must detect from its file."""

    kind: str
    filename: str
    dtype: torch.dtype
    """dtype of the saved tensors (as the real releases)."""
    latent_channels: int
    latent_dim: int
    """2 = image latents (B,C,H,W); 3 = video latents (B,C,T,H,W)."""
    spatial_ratio: int
    temporal_ratio: int
    """1 for image VAEs; r for the video VAEs: T latent frames decode to r*T-(r-1) frames (4; Mochi 6)."""
    model_class: str
    """Class name of ``vae.first_stage_model`` that ComfyUI builds on load."""
    module: str
    """Module of ``model_class``."""
    params: int | tuple[int, ...]
    """Parameter count (encoder + decoder, as in the real release); a tuple: the counts of the hosts' classes
    when they differ."""
    example_latent: tuple[int, ...]
    """A small latent shape that decodes in a few seconds at most on a 2-core CPU (fp32)."""
    example_output: tuple[int, ...]
    """``VAE.decode`` output shape for ``example_latent``: (B,H,W,3) or (B,T,H,W,3)."""
    description: str = ""
    min_comfyui: str | None = None
    """First ComfyUI release with ``module``; None: every supported host. A kind with a version is
    optional: available only where ``module`` imports (:func:`available`), skipped by ``make_models``'
    default kinds elsewhere."""
    full: str | None = None
    """A narrow twin: the full-size kind whose host classes, key names, kernels, strides, norms and attention
    placement it has, with :data:`NARROW` times fewer channels in every block (latent channels unchanged);
    built and loaded under :func:`narrow_host` (see :data:`NARROW_KINDS`)."""

    def config(self) -> dict:
        """Constructor kwargs of ``model_class``, identical to what ``comfy.sd.VAE`` uses (a narrow twin: its
        full kind's; :func:`narrow_host` narrows the blocks)."""
        if self.full is not None:
            return FIXTURES[self.full].config()
        if self.kind == "kl_f8":
            return {"ddconfig": dict(_KL_DDCONFIG), "embed_dim": 4}
        if self.kind == "hunyuan_video":
            dd = dict(_KL_DDCONFIG, z_channels=16, conv3d=True, time_compress=4)
            return {"ddconfig": dd, "embed_dim": 16}
        if self.kind == "wan21":
            return dict(_WAN_DDCONFIG, dim=96, z_dim=16)
        if self.kind == "wan22":
            return dict(_WAN_DDCONFIG, dim=160, z_dim=48)
        if self.kind == "flux":
            dd = dict(_KL_DDCONFIG, z_channels=16)
            module = "comfy.ldm.modules.diffusionmodules.model"
            return {
                "regularizer_config": {"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                "encoder_config": {"target": f"{module}.Encoder", "params": dd},
                "decoder_config": {"target": f"{module}.Decoder", "params": dd},
            }
        if self.kind == "flux2":
            # diffusers' AutoencoderKLFlux2 / BFL's flux2 AutoEncoder: the SD KL encoder/decoder at z 32,
            # quant convs (64 -> 64, 32 -> 32) and a BatchNorm (eps 1e-4) over the 2x2-patchified latent.
            return {"ddconfig": dict(_KL_DDCONFIG, z_channels=32, batch_norm_latent=True), "embed_dim": 32}
        if self.kind == "hunyuan_image":
            dd = dict(_HUNYUAN_IMAGE_DDCONFIG)
            module = "comfy.ldm.hunyuan_video.vae"
            return {
                "regularizer_config": {"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                "encoder_config": {"target": f"{module}.Encoder", "params": dd},
                "decoder_config": {"target": f"{module}.Decoder", "params": dd},
            }
        if self.kind == "mochi":
            return {}  # comfy/sd.py: VideoVAE(), its constructor holds the one configuration
        if self.kind == "cogvideox":
            # comfy/sd.py (0.33.0): latent_channels from encoder.conv_out.conv.weight.shape[0] // 2, no more
            return {"latent_channels": 16}
        if self.kind == "dcae_sana":
            return dict(DCAE_SANA_CONFIG)
        if self.kind == "ltx_video":
            return {"version": 2}  # comfy/sd.py: conv1 1024 wide + encoder.down_blocks.1.conv.conv.bias -> 2
        if self.kind == "ltx_video_v0":
            return {"version": 0}  # comfy/sd.py: decoder.up_blocks.0.res_blocks.0.conv1 512 wide -> 0
        if self.kind == "ltx_video_v1":
            return {"version": 1}  # comfy/sd.py: conv1 1024 wide, no encoder.down_blocks.1.conv.conv.bias -> 1
        if self.kind == "seedvr2":
            return {}  # comfy/sd.py: VideoAutoencoderKLWrapper(), its constructor holds the one configuration
        if self.kind == "mage":
            return {}  # comfy/sd.py: MageVAE(), its constructors hold the one configuration
        if self.kind == "hunyuan_image_refiner":
            module = "comfy.ldm.hunyuan_video.vae_refiner"
            return {
                "regularizer_config": {"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
                "encoder_config": {"target": f"{module}.Encoder", "params": dict(_HUNYUAN_REFINER_DDCONFIG)},
                "decoder_config": {"target": f"{module}.Decoder", "params": dict(_HUNYUAN_REFINER_DDCONFIG)},
            }
        if self.kind == "cosmos":
            return dict(_COSMOS_DDCONFIG)
        if self.kind == "hunyuan_video15":
            module = "comfy.ldm.hunyuan_video.vae_refiner"
            return {
                "regularizer_config": {"target": "comfy.ldm.models.autoencoder.EmptyRegularizer"},
                "encoder_config": {"target": f"{module}.Encoder", "params": dict(_HUNYUAN_VIDEO15_DDCONFIG)},
                "decoder_config": {"target": f"{module}.Decoder", "params": dict(_HUNYUAN_VIDEO15_DDCONFIG)},
            }
        raise KeyError(self.kind)

    def param_counts(self) -> tuple[int, ...]:
        """The parameter counts a host's class may have (:attr:`params` as a tuple)."""
        return self.params if isinstance(self.params, tuple) else (self.params,)

    def file_key(self, key: str) -> str:
        """The key of the model's state-dict entry ``key`` in the released file (BFL's FLUX.2 file nests
        the quant convs in the encoder and decoder; ComfyUI's loader moves them back)."""
        for model_prefix, file_prefix in _FILE_PREFIXES.get(self.full or self.kind, ()):
            if key.startswith(model_prefix):
                return file_prefix + key[len(model_prefix):]
        return key

    def model_key(self, key: str) -> str:
        """Inverse of :meth:`file_key`."""
        for model_prefix, file_prefix in _FILE_PREFIXES.get(self.full or self.kind, ()):
            if key.startswith(file_prefix):
                return model_prefix + key[len(file_prefix):]
        return key


_FILE_PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "flux2": (("quant_conv.", "encoder.quant_conv."), ("post_quant_conv.", "decoder.post_quant_conv.")),
    # comfy/sd.py (0.33.0) detects Mage-VAE by student.dconv_encoder.proj_out.weight and strips these prefixes
    "mage": (("dconv_encoder.", "student.dconv_encoder."), ("decoder_model.", "pipeline.")),
}


def _spec(kind: str, dtype: torch.dtype, **kw) -> FixtureSpec:
    return FixtureSpec(kind=kind, filename=f"vramfit_fixture_{kind}.safetensors", dtype=dtype, **kw)


_LTX = "comfy.ldm.lightricks.vae.causal_video_autoencoder"


def _ltx_spec(kind: str, **kw) -> FixtureSpec:
    """An LTX-Video VAE: the versions ``comfy/sd.py`` tells apart by their keys share everything but the weights."""
    return _spec(kind, torch.bfloat16, latent_channels=128, latent_dim=3, spatial_ratio=32, temporal_ratio=8,
                 model_class="VideoVAE", module="comfy.ldm.lightricks.vae.causal_video_autoencoder",
                 example_latent=(1, 128, 2, 2, 2), example_output=(1, 9, 64, 64, 3), **kw)


FIXTURES: dict[str, FixtureSpec] = {
    "kl_f8": _spec(
        "kl_f8",
        torch.float16,
        latent_channels=4,
        latent_dim=2,
        spatial_ratio=8,
        temporal_ratio=1,
        model_class="AutoencoderKL",
        module="comfy.ldm.models.autoencoder",
        params=83_653_863,
        example_latent=(1, 4, 8, 8),
        example_output=(1, 64, 64, 3),
        description="SD1.x/SDXL KL-f8 VAE",
    ),
    "wan21": _spec(
        "wan21",
        torch.bfloat16,
        latent_channels=16,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=4,
        model_class="WanVAE",
        module="comfy.ldm.wan.vae",
        params=126_892_531,
        example_latent=(1, 16, 3, 4, 4),
        example_output=(1, 9, 32, 32, 3),
        description="Wan 2.1 VAE (dim 96, z 16)",
    ),
    "wan22": _spec(
        "wan22",
        torch.bfloat16,
        latent_channels=48,
        latent_dim=3,
        spatial_ratio=16,
        temporal_ratio=4,
        model_class="WanVAE",
        module="comfy.ldm.wan.vae2_2",
        params=704_688_668,
        example_latent=(1, 48, 2, 2, 2),
        example_output=(1, 5, 32, 32, 3),
        description="Wan 2.2 VAE (dim 160, decoder dim 256, z 48)",
    ),
    "hunyuan_video": _spec(
        "hunyuan_video",
        torch.bfloat16,
        latent_channels=16,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=4,
        model_class="AutoencoderKL",
        module="comfy.ldm.models.autoencoder",
        params=246_478_803,
        example_latent=(1, 16, 2, 4, 4),
        example_output=(1, 5, 32, 32, 3),
        description="HunyuanVideo 3-D KL VAE (z 16, time_compress 4)",
    ),
    "flux": _spec(
        "flux",
        torch.float32,
        latent_channels=16,
        latent_dim=2,
        spatial_ratio=8,
        temporal_ratio=1,
        model_class="AutoencodingEngine",
        module="comfy.ldm.models.autoencoder",
        params=83_819_683,
        example_latent=(1, 16, 8, 8),
        example_output=(1, 64, 64, 3),
        description="FLUX.1 VAE (KL, z 16, no quant convs)",
    ),
    "flux2": _spec(
        "flux2",
        torch.bfloat16,
        latent_channels=128,
        latent_dim=2,
        spatial_ratio=16,
        temporal_ratio=1,
        model_class="AutoencoderKL",
        module="comfy.ldm.models.autoencoder",
        params=84_046_372,
        example_latent=(1, 128, 4, 4),
        example_output=(1, 64, 64, 3),
        description="FLUX.2 VAE (KL, z 32, quant convs, BatchNorm'd 2x2-patchified latent: 128 ch, 16x)",
    ),
    "hunyuan_image": _spec(
        "hunyuan_image",
        torch.bfloat16,
        latent_channels=64,
        latent_dim=2,
        spatial_ratio=32,
        temporal_ratio=1,
        model_class="AutoencodingEngine",
        module="comfy.ldm.models.autoencoder",
        params=405_575_491,
        example_latent=(1, 64, 2, 2),
        example_output=(1, 64, 64, 3),
        description="Hunyuan Image 2.1 VAE (z 64, 32x; pixel-shuffle resampling, GroupNorm, mid attention)",
    ),
    "mochi": _spec(
        "mochi",
        torch.bfloat16,
        latent_channels=12,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=6,
        model_class="VideoVAE",
        module="comfy.ldm.genmo.vae.model",
        params=459_748_611,
        example_latent=(1, 12, 3, 4, 4),
        example_output=(1, 13, 32, 32, 3),
        description="Genmo Mochi VAE (z 12, 8x, 6x temporal; causal PConv3d, depth-to-space-time upsampling)",
    ),
    "cogvideox": _spec(
        "cogvideox",
        torch.bfloat16,
        latent_channels=16,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=4,
        model_class="AutoencoderKLCogVideoX",
        module="comfy.ldm.cogvideo.vae",
        params=215_583_907,
        example_latent=(1, 16, 3, 4, 4),
        example_output=(1, 9, 32, 32, 3),
        description="CogVideoX VAE (z 16, 8x, 4x temporal; causal conv, spatially conditioned norms)",
        min_comfyui="0.33.0",
    ),
    "dcae_sana": _spec(
        "dcae_sana",
        torch.bfloat16,
        latent_channels=32,
        latent_dim=2,
        spatial_ratio=32,
        temporal_ratio=1,
        model_class="AutoencoderDC",
        module="diffusers",
        params=312_250_275,
        example_latent=(1, 32, 2, 2),
        example_output=(1, 64, 64, 3),
        description="Sana DC-AE f32c32 (diffusers AutoencoderDC)",
    ),
    "hunyuan_video15": _spec(
        "hunyuan_video15",
        torch.float16,
        latent_channels=32,
        latent_dim=3,
        spatial_ratio=16,
        temporal_ratio=4,
        model_class="AutoencodingEngine",
        module="comfy.ldm.models.autoencoder",
        # 0.33 builds the mid blocks' ResnetBlocks with an (unused) 512-wide temb_proj: 2,101,248 more
        params=(1_260_634_115, 1_262_735_363),
        example_latent=(1, 32, 3, 2, 2),
        example_output=(1, 9, 32, 32, 3),
        description="HunyuanVideo 1.5 VAE (z 32, 16x, 4x temporal; causal convs with carried frames, RMS norms, "
                    "mid attention over the clip)",
    ),
    "cosmos": _spec(
        "cosmos",
        torch.bfloat16,
        latent_channels=16,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=8,
        model_class="CausalContinuousVideoTokenizer",
        module="comfy.ldm.cosmos.vae",
        params=105_654_208,
        example_latent=(1, 16, 2, 2, 2),
        example_output=(1, 9, 16, 16, 3),
        description="Cosmos tokenizer CV8x8x8 (z 16, 8x, 8x temporal; causal factorized convs, per-frame GroupNorm "
                    "and attention, causal temporal attention, Haar unpatcher)",
    ),
    "ltx_video": _ltx_spec(
        "ltx_video",
        # 0.3.75's per-channel statistics hold 3 more 128-wide buffers than 0.33's
        params=(1_246_914_162, 1_246_913_778),
        description="LTX-Video 0.9.5+ VAE (z 128, 32x, 8x temporal; pixel norms, timestep-conditioned decoder, "
                    "symmetric in time)",
    ),
    "ltx_video_v0": _ltx_spec(
        "ltx_video_v0",
        params=(419_194_289, 419_193_905),
        description="LTX-Video 0.9.0 VAE (z 128, 32x, 8x temporal; pixel norms and channel LayerNorms, no timestep "
                    "conditioning, symmetric in time)",
    ),
    "ltx_video_v1": _ltx_spec(
        "ltx_video_v1",
        params=(934_977_074, 934_976_690),
        description="LTX-Video 0.9.1 VAE (z 128, 32x, 8x temporal; pixel norms, timestep-conditioned decoder that "
                    "injects fresh noise in its blocks)",
    ),
    "hunyuan_image_refiner": _spec(
        "hunyuan_image_refiner",
        torch.bfloat16,
        latent_channels=32,
        latent_dim=3,
        spatial_ratio=16,
        temporal_ratio=4,
        model_class="AutoencodingEngine",
        module="comfy.ldm.models.autoencoder",
        # 0.33 builds the mid blocks' ResnetBlocks with an (unused) 512-wide temb_proj: 2,101,248 more
        params=(1_260_674_947, 1_262_776_195),
        # a 2-frame latent decodes to 8 frames (the host keeps only the last of a 1-frame latent's 4: one image)
        example_latent=(1, 32, 2, 2, 2),
        example_output=(1, 8, 32, 32, 3),
        description="Hunyuan Image 2.1's refiner VAE (z 32, 16x; vae_refiner with refiner_vae False: zero-padded "
                    "3-D convs, GroupNorm over the clip, mid attention, pixel-shuffle up in space and time; "
                    "not_video: a one-frame latent is one image)",
    ),
    "seedvr2": _spec(
        "seedvr2",
        torch.float16,
        latent_channels=16,
        latent_dim=3,
        spatial_ratio=8,
        temporal_ratio=4,
        model_class="VideoAutoencoderKLWrapper",
        module="comfy.ldm.seedvr.vae",
        params=250_648_227,
        example_latent=(1, 16, 3, 4, 4),
        example_output=(1, 9, 32, 32, 3),
        description="SeedVR2 VAE (z 16, 8x, 4x temporal; causal convs carried across time slices, GroupNorm and "
                    "mid attention per frame)",
        min_comfyui="0.33.0",
    ),
    "mage": _spec(
        "mage",
        torch.bfloat16,
        latent_channels=128,
        latent_dim=2,
        spatial_ratio=16,
        temporal_ratio=1,
        model_class="MageVAE",
        module="comfy.ldm.mage_flow.vae",
        params=138_052_035,
        example_latent=(1, 128, 2, 2),
        example_output=(1, 32, 32, 3),
        description="Mage-VAE (z 128, 16x; one-step diffusion decoder: GroupNorm ResBlocks and attention in 32-px "
                    "windows, DiCo blocks with channel attention over the whole map, a per-patch MLP)",
        min_comfyui="0.33.0",
    ),
}

NARROW = 4
"""Channel divisor of the narrow twins (Mochi's: 2, its encoder's 64 channels hold 32 GroupNorm groups)."""
_NARROW_DIVISOR = {"mochi": 2}

# ``{full kind: (module, names of the host's constructors called narrower, keyword, parameter count(s))}``;
# the counts as (ComfyUI 0.3.75, 0.33.0) where the hosts' classes differ, measured.
_NARROW_BUILD: dict[str, tuple[str, tuple[str, ...], str, int | tuple[int, ...]]] = {
    "wan22": ("comfy.ldm.wan.vae2_2", ("WanVAE",), "dim", 44_654_660),
    "hunyuan_image": ("comfy.ldm.hunyuan_video.vae", ("Encoder", "Decoder"), "block_out_channels", 25_710_643),
    "mochi": ("comfy.ldm.genmo.vae.model", ("Encoder", "Decoder"), "base_channels", 114_971_267),
    "cosmos": ("comfy.ldm.cosmos.vae", ("CausalContinuousVideoTokenizer",), "channels", 6_877_312),
    "hunyuan_video15": ("comfy.ldm.hunyuan_video.vae_refiner", ("Encoder", "Decoder"), "block_out_channels",
                        (79_310_387, 79_835_699)),
    "ltx_video": (_LTX, ("Encoder", "Decoder"), "base_channels", (80_396_802, 80_396_418)),
    "ltx_video_v0": (_LTX, ("Encoder", "Decoder"), "base_channels", (26_936_273, 26_935_889)),
    "ltx_video_v1": (_LTX, ("Encoder", "Decoder"), "base_channels", (59_903_474, 59_903_090)),
    "hunyuan_image_refiner": ("comfy.ldm.hunyuan_video.vae_refiner", ("Encoder", "Decoder"), "block_out_channels",
                              (79_320_595, 79_845_907)),
    "seedvr2": ("comfy.ldm.seedvr.vae", ("Encoder3D", "Decoder3D"), "block_out_channels", 15_807_939),
    "mage": ("comfy.ldm.mage_flow.vae", ("DConvEncoder", "DConvDenoiser"), "hidden_size", 10_284_291),
}
NARROW_KINDS = {full: f"{full}_narrow" for full in _NARROW_BUILD}
"""``{full-size kind: its narrow twin}``: the families whose full-size test decodes would take GBs and minutes (the
1.2-billion-parameter HunyuanVideo 1.5 and LTX-Video 0.9.5+, the other LTX-Video versions, Hunyuan Image 2.1, Wan
2.2, Mochi). ComfyUI's loader builds them with fixed widths (``comfy/sd.py``: Hunyuan's ``block_out_channels``, Wan
2.2's ``dim``, Mochi's constructor, LTX-Video's ``base_channels`` and its version told by a block's width), so a
narrow twin is built and loaded under :func:`narrow_host`."""
for _full, (_mod, _names, _kw, _params) in _NARROW_BUILD.items():
    FIXTURES[NARROW_KINDS[_full]] = dataclasses.replace(
        FIXTURES[_full], kind=NARROW_KINDS[_full], filename=f"vramfit_fixture_{NARROW_KINDS[_full]}.safetensors",
        params=_params, full=_full,
        description=f"{FIXTURES[_full].description}, 1/{_NARROW_DIVISOR.get(_full, NARROW)} of the channels "
                    "(narrow twin)")
del _full, _mod, _names, _kw, _params
KINDS = (*KINDS, *NARROW_KINDS.values())
COMFY_KINDS = tuple(k for k in KINDS if k != "dcae_sana")
"""The kinds ComfyUI's own ``VAELoader`` loads (``dcae_sana`` loads through ``scripts/sana_vae.py``)."""


def narrow(kind: str) -> str:
    """The narrow twin of ``kind`` (``kind`` itself when it has none)."""
    return NARROW_KINDS.get(kind, kind)


def narrow_divisor(kind: str) -> int:
    """How many times fewer channels the narrow twin ``kind`` has than its full kind (1 for a full kind)."""
    full = FIXTURES[kind].full
    return 1 if full is None else _NARROW_DIVISOR.get(full, NARROW)


def _narrower(value, div: int):
    return [c // div for c in value] if isinstance(value, (list, tuple)) else value // div


@contextlib.contextmanager
def narrow_host(kind: str) -> Iterator[None]:
    """Inside the block, ComfyUI builds ``kind``'s blocks with 1/:func:`narrow_divisor` of the channels (a no-op for
    a kind without :attr:`FixtureSpec.full`): the host's own constructors of the family's module (:data:`_NARROW_BUILD`)
    called with narrower widths (Hunyuan's ``block_out_channels``, LTX-Video's and Mochi's ``base_channels``, Wan
    2.2's ``dim`` and ``dec_dim``, Mage-VAE's ``hidden_size`` and ``head_size``); LTX-Video's ``VideoVAE`` is also told the version ``comfy/sd.py`` reads from the
    full-width block. Same classes, key names, kernels, strides, norms and attention placement as the full-size
    model, the latent channels unchanged. Use it around ``VAELoader().load_vae`` of a narrow file
    (:func:`load_vae`, :meth:`FixtureFolder.load`)."""
    spec = FIXTURES[kind]
    if spec.full is None:
        yield
        return
    name, ctors, keyword, _ = _NARROW_BUILD[spec.full]
    div = narrow_divisor(kind)
    mod = _import_comfy_module(name)
    orig = {c: getattr(mod, c) for c in ctors}
    defaults = {"base_channels": {"Encoder": 64, "Decoder": 128} if spec.full == "mochi" else 128,
                "dim": 160, "hidden_size": 384}

    def narrower(ctor: str):
        cls = orig[ctor]

        def build(*a, **kw):
            if spec.full == "mochi":  # VideoVAE() passes its widths by keyword
                kw[keyword] //= div
            elif keyword in kw:
                kw[keyword] = _narrower(kw[keyword], div)
            else:  # LTX-Video's VideoVAE leaves base_channels at the default
                kw[keyword] = defaults[keyword] // div
            if spec.full == "wan22":
                kw["dec_dim"] = kw.get("dec_dim", 256) // div
            if ctor == "DConvEncoder":  # Mage-VAE's encoder head
                kw["head_size"] = kw.get("head_size", 768) // div
            return cls(*a, **kw)

        return build

    patched = {c: narrower(c) for c in ctors}
    if name == _LTX:
        fixed = spec.config()["version"]
        video_vae = mod.VideoVAE

        def ltx_vae(version=0, config=None):  # comfy/sd.py reads 0 from the narrow block's width
            return video_vae(version=fixed, config=config)

        orig["VideoVAE"], patched["VideoVAE"] = video_vae, ltx_vae
    for c, v in patched.items():
        setattr(mod, c, v)
    try:
        yield
    finally:
        for c, v in orig.items():
            setattr(mod, c, v)


_META_KIND = "vramfit_fixture_kind"
_META_SEED = "vramfit_fixture_seed"
_META_VERSION = "vramfit_fixture_generator"


# --------------------------------------------------------------------------------------------------
# ComfyUI import


def _import_comfy_module(name: str):
    """Import a ``comfy`` module; on a machine without an accelerator, first select ComfyUI's CPU mode.

    ``comfy.model_management`` probes CUDA at import time and fails on a CPU-only torch unless
    ``--cpu`` was given. When it is not imported yet and torch sees no GPU, set ``args.cpu``, exactly
    as ``main.py --cpu`` would. A host that already imported it is left alone.
    """
    if "comfy.model_management" not in sys.modules:
        try:
            cli_args = importlib.import_module("comfy.cli_args")
        except ImportError as e:
            raise ImportError(
                "ComfyUI is not importable: put COMFYUI_PATH (the folder holding comfy/) on sys.path"
            ) from e
        mps = getattr(torch.backends, "mps", None)
        xpu = getattr(torch, "xpu", None)
        has_accel = (
            torch.cuda.is_available()
            or (mps is not None and mps.is_available())
            or (xpu is not None and xpu.is_available())
        )
        if not has_accel and not cli_args.args.cpu:
            log.info("no GPU visible to torch: importing ComfyUI in --cpu mode")
            cli_args.args.cpu = True
    return importlib.import_module(name)


def available(kind: str) -> bool:
    """Whether the running host has ``kind``'s module (always, for a kind without ``min_comfyui``).

    Imports the module (ComfyUI must be importable). Only a missing ``module`` or package of it makes a
    kind unavailable; any other import error propagates.
    """
    spec = FIXTURES[kind]
    if spec.min_comfyui is None:
        return True
    try:
        _import_comfy_module(spec.module)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing.startswith("comfy.") and f"{spec.module}.".startswith(f"{missing}."):
            return False
        raise
    return True


def build_model(kind: str, device: str | torch.device = "meta") -> torch.nn.Module:
    """The bare module for ``kind`` (ComfyUI's class; diffusers' for ``dcae_sana``), weights uninitialised,
    on ``meta`` by default."""
    spec = FIXTURES[kind]
    mod = _import_comfy_module(spec.module)
    if (spec.full or kind) == "cosmos" and torch.device(device).type == "meta":
        with narrow_host(kind), _eager_weights():  # its patchers read a value (.item()) while built: CPU, then meta
            return getattr(mod, spec.model_class)(**spec.config()).to(device).eval()
    with torch.device(device), narrow_host(kind), _eager_weights():
        model = getattr(mod, spec.model_class)(**spec.config())
    return model.eval()


@contextlib.contextmanager
def _eager_weights() -> Iterator[None]:
    """Every layer gets its weights when built. With dynamic VRAM on (ComfyUI >= 0.33 on CUDA:
    ``comfy.memory_management.aimdo_enabled``) ``comfy.ops``' Linear and Embedding defer theirs to the state
    dict's load, so a model built then has no such keys: on an H100 (2026-11-27) HunyuanVideo 1.5's file lacked
    its mid blocks' ``temb_proj`` and LTX-Video's 24.4 M parameters. The flag is off while the fixture is built."""
    mm = sys.modules.get("comfy.memory_management")
    if mm is None or not getattr(mm, "aimdo_enabled", False):
        yield
        return
    mm.aimdo_enabled = False
    try:
        yield
    finally:
        mm.aimdo_enabled = True


# --------------------------------------------------------------------------------------------------
# Weight initialisation


def _torch_reset(module: torch.nn.Module) -> bool:
    """Call the ``reset_parameters`` of the first ``torch.nn`` class in the module's MRO. True if found."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.nn.") and "reset_parameters" in cls.__dict__:
            cls.reset_parameters(module)
            return True
    return False


def _init_custom(module: torch.nn.Module) -> bool:
    """Parameters of non-torch modules, set to their own constructors' values: Wan's ``RMS_norm``
    (gamma 1, bias 0) and diffusers' ``RMSNorm`` (weight 1, bias 0); LTX-Video's (:func:`_init_ltx`)."""
    if _init_ltx(module) or _init_cosmos(module):
        return True
    scale = {"RMS_norm": "gamma", "RMSNorm": "weight"}.get(type(module).__name__)
    if scale is None:
        return False
    with torch.no_grad():
        if getattr(module, scale, None) is not None:
            getattr(module, scale).fill_(1.0)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()
    return True


def _init_ltx(module: torch.nn.Module) -> bool:
    """LTX-Video's own tensors: the per-channel latent statistics (``processor``: stds log-uniform on
    [e^-1, e], means N(0, 0.5^2), as a trained VAE's), the decoder's timestep multiplier (its constructor's
    1000) and the scale-shift tables (``randn / sqrt(channels)``, the resnet blocks' constructor init)."""
    name = type(module).__name__
    if not type(module).__module__.endswith("causal_video_autoencoder") or name not in (
            "processor", "Decoder", "ResnetBlock3D"):
        return False
    with torch.no_grad():
        for key, t in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if key in ("std-of-means", "mean-of-stds"):
                t.copy_(torch.exp(2 * torch.rand_like(t) - 1))
            elif key == "timestep_scale_multiplier":
                t.fill_(1000.0)
            elif "scale_shift_table" in key:
                t.copy_(torch.randn_like(t) / t.shape[-1] ** 0.5)
            else:
                t.copy_(0.5 * torch.randn_like(t))
    return True


def _init_cosmos(module: torch.nn.Module) -> bool:
    """Cosmos's own tensors: the tokenizer's per-frame latent statistics (means N(0, 0.5^2), stds log-uniform on
    [e^-1, e], as :func:`_init_ltx`'s), and its (un)patchers' fixed Haar filters (buffers not in the file, rebuilt
    as their constructor makes them)."""
    name = type(module).__name__
    if not type(module).__module__.startswith("comfy.ldm.cosmos"):
        return False
    with torch.no_grad():
        if name == "CausalContinuousVideoTokenizer":
            module.latent_mean.copy_(0.5 * torch.randn_like(module.latent_mean))
            module.latent_std.copy_(torch.exp(2 * torch.rand_like(module.latent_std) - 1))
            return True
        if name in ("Patcher3D", "UnPatcher3D", "Patcher", "UnPatcher"):
            wavelets = sys.modules[type(module).__module__]._WAVELETS[module.patch_method]
            module.wavelets.copy_(wavelets)
            module._arange.copy_(torch.arange(wavelets.shape[0]))
            return True
    return False


CURRENT_FRAME_SHARE = 0.9
"""Share of a causal temporal kernel's weight variance on the current frame (see ``_emphasise_current_frame``)."""


def _temporal_shares(kt: int) -> list[float]:
    """Variance shares of the temporal taps, oldest first: 0.9 on the last (current) tap, the rest
    decaying 4x per frame back (kt=3: 0.02, 0.08, 0.9)."""
    if kt == 1:
        return [1.0]
    back = [0.25**k for k in range(kt - 1, 0, -1)]
    total = sum(back)
    return [(1.0 - CURRENT_FRAME_SHARE) * b / total for b in back] + [CURRENT_FRAME_SHARE]


def _emphasise_current_frame(module: torch.nn.Module) -> None:
    """Reweight the temporal taps of a stride-1 causal ``Conv3d`` towards the current frame.

    With torch's default init all temporal taps carry the same variance, and across the ~20 causal
    3-D convolutions of a video decoder each latent frame's own contribution to its output frames
    fades to a few percent: the output is driven by the first latent frame (measured: replacing
    latent frame 1 of a Wan 2.1 latent changed its own output frames by 0.01 against 0.2 for frame
    0). Trained video VAEs (often inflated from 2-D weights) are dominated by the current frame. The
    taps are scaled by sqrt(kt * share), which keeps the kernel's total variance (the torch init
    scale) and keeps temporal mixing (caches still matter) while each frame drives its own outputs.
    The ComfyUI video VAEs here pad time causally in front (Wan's and CogVideoX's ``CausalConv3d``,
    Mochi's ``PConv3d``, HunyuanVideo's), so the last tap is the current frame. A convolution that pads
    time symmetrically (a ``PConv3d`` with ``causal=False``, a ``Conv3d`` with temporal ``padding``) is
    centred on the current frame and left as initialised. LTX-Video's ``CausalConv3d`` pads time per call (its
    decoder symmetrically: ``causal_decoder`` False), so its decoder's taps are reweighted as if causal: the
    output then leans on the next frame, which changes nothing the tests measure.
    """
    kt = module.weight.shape[2]
    if kt == 1 or module.stride[0] != 1:
        return
    if getattr(module, "causal", True) is False or isinstance(module.padding, str) or module.padding[0] != 0:
        return
    scale = torch.tensor([math.sqrt(kt * s) for s in _temporal_shares(kt)], dtype=module.weight.dtype)
    with torch.no_grad():
        module.weight.mul_(scale.view(1, 1, kt, 1, 1))


def _trained_statistics(module: torch.nn.modules.batchnorm._BatchNorm) -> None:
    """Running statistics of a trained BatchNorm instead of the constructor's (mean 0, variance 1): FLUX.2's
    decode starts with ``z * sqrt(var + eps) + mean``, so both must matter. Means N(0, 0.5^2), variances
    log-uniform on [e^-1, e] (positive), and a trained model's batch count."""
    with torch.no_grad():
        if module.running_mean is not None:
            module.running_mean.copy_(0.5 * torch.randn_like(module.running_mean))
        if module.running_var is not None:
            module.running_var.copy_(torch.exp(2 * torch.rand_like(module.running_var) - 1))
        if module.num_batches_tracked is not None:
            module.num_batches_tracked.fill_(100_000)


def _materialise(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Allocate, initialise (fp32, CPU) and cast to ``dtype`` one module at a time (low peak memory).

    Uses the global RNG: call inside ``torch.random.fork_rng`` after ``torch.manual_seed``.
    """
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if not own:
            continue
        module.to_empty(device="cpu", recurse=False)
        module.float()
        for t in module.parameters(recurse=False):
            t.requires_grad_(False)
        if not (_torch_reset(module) or _init_custom(module)):
            raise TypeError(f"don't know how to initialise {name or '<root>'} ({type(module).__qualname__})")
        if isinstance(module, torch.nn.Conv3d):
            _emphasise_current_frame(module)
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            _trained_statistics(module)
        for p_name, t in list(module.named_parameters(recurse=False)) + list(
            module.named_buffers(recurse=False)
        ):
            if not torch.isfinite(t).all():
                raise ValueError(f"non-finite values after init in {name}.{p_name}")
        module.to(dtype)
    for module in model.modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                raise TypeError(f"tensor attribute {type(module).__qualname__}.{attr} left on meta")


FILE_ONLY_KEYS: dict[str, tuple[str, ...]] = {
    "cosmos": ("encoder.patcher3d.wavelets", "encoder.patcher3d._arange", "decoder.unpatcher3d.wavelets",
               "decoder.unpatcher3d._arange"),
}
"""Tensors a released file holds beyond the model's state dict (its loader leaves them over): Cosmos's patchers'
Haar filters, by which ``comfy/sd.py`` tells the family (``decoder.unpatcher3d.wavelets``; ComfyUI registers them
non-persistent)."""


def build_state_dict(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random weights for ``kind`` in the saved dtype (CPU), keyed as the real files."""
    spec = FIXTURES[kind]
    model = build_model(kind, device="meta")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _materialise(model, spec.dtype)
    sd = {spec.file_key(k): v.detach().contiguous() for k, v in model.state_dict().items()}
    buffers = dict(model.named_buffers())
    sd.update({k: buffers[k].detach().contiguous() for k in FILE_ONLY_KEYS.get(spec.full or kind, ())})
    if (spec.full or kind) == "cosmos":  # torch's init gives pixels of std ~0.8 (40 % clipped); a trained VAE's ~0.2
        for k in ("decoder.conv_out.1.conv3d.weight", "decoder.conv_out.1.conv3d.bias"):
            sd[k] = (sd[k].float() * 0.3).to(spec.dtype)
    return sd


# --------------------------------------------------------------------------------------------------
# Files


def _read_meta(path: pathlib.Path) -> dict[str, str] | None:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception:  # a corrupt or partial file is simply rebuilt
        return None


def _is_current(path: pathlib.Path, kind: str, seed: int) -> bool:
    if not path.is_file():
        return False
    meta = _read_meta(path)
    return (
        meta is not None
        and meta.get(_META_KIND) == kind
        and meta.get(_META_SEED) == str(seed)
        and meta.get(_META_VERSION) == GENERATOR_VERSION
    )


@contextlib.contextmanager
def _atomic_target(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """Yield a temporary path next to ``path``; rename it over ``path`` on success, remove it on error.

    The temporary name does not end in ``.safetensors``/``.latent``, so ComfyUI never lists it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # safetensors creates files 0600
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


WORKFLOW_KINDS = ("kl_f8", "wan21")
"""The kinds the shipped CPU workflows name by file: made with the folder and never deleted to make room."""

DISK_MARGIN = 1 << 30
"""Bytes left free on the fixture folder's disk after a file is written (logs, temp files, the outputs)."""


def make_room(vae_dir: pathlib.Path, need: int, keep: Iterable[pathlib.Path] = ()) -> list[pathlib.Path]:
    """Free ``need`` + :data:`DISK_MARGIN` bytes on ``vae_dir``'s disk by deleting other fixture files.

    Only this module's own files (:attr:`FixtureSpec.filename`) are deleted, largest first, never those in
    ``keep`` or of :data:`WORKFLOW_KINDS`; they are rebuilt from their seed when next asked for (:class:`FixtureFolder`). Returns the
    deleted paths. Raises ``OSError`` naming the folder, the need and the free space if that is not enough.
    """
    vae_dir = pathlib.Path(vae_dir)
    vae_dir.mkdir(parents=True, exist_ok=True)
    keep = {pathlib.Path(k).name for k in keep} | {FIXTURES[k].filename for k in WORKFLOW_KINDS}
    ours = [vae_dir / FIXTURES[k].filename for k in KINDS]
    spare = sorted(
        (p for p in ours if p.name not in keep and p.is_file()), key=lambda p: p.stat().st_size, reverse=True
    )
    deleted: list[pathlib.Path] = []
    while shutil.disk_usage(vae_dir).free < need + DISK_MARGIN and spare:
        victim = spare.pop(0)
        log.info("%s: deleted to make room (rebuilt from its seed when next used)", victim)
        victim.unlink(missing_ok=True)
        deleted.append(victim)
    free = shutil.disk_usage(vae_dir).free
    if free < need + DISK_MARGIN:
        raise OSError(
            f"fixture models: {vae_dir} has {free / 2**30:.1f} GiB free; the next file needs "
            f"{need / 2**30:.1f} GiB plus {DISK_MARGIN / 2**30:.0f} GiB to spare: free some disk and rerun"
        )
    return deleted


def make_models(
    vae_dir: pathlib.Path,
    seed: int = 0,
    kinds: Iterable[str] | None = None,
    force: bool = False,
) -> dict[str, pathlib.Path]:
    """Write ``FIXTURES[kind].filename`` into ``vae_dir`` for each kind; return ``{kind: path}``.

    Deterministic by ``seed``. A file whose metadata already names the same kind, seed and generator
    version is kept (only its header is read) unless ``force``. Files are written atomically.

    ``kinds`` None: every kind the running host has (:func:`available`; the others are logged and left
    out of the result). An explicitly requested kind the host lacks raises ``RuntimeError``.
    """
    vae_dir = pathlib.Path(vae_dir)
    explicit = kinds is not None
    kinds = tuple(kinds) if explicit else KINDS
    unknown = [k for k in kinds if k not in FIXTURES]
    if unknown:
        raise ValueError(f"unknown fixture kinds {unknown}; known: {KINDS}")
    missing = [k for k in kinds if not available(k)]
    if missing and explicit:
        raise RuntimeError(
            "this ComfyUI host lacks the modules of fixture kinds "
            + ", ".join(f"{k} ({FIXTURES[k].module}, ComfyUI >= {FIXTURES[k].min_comfyui})" for k in missing)
        )
    for kind in missing:
        spec = FIXTURES[kind]
        log.info("%s: skipped, this host has no %s (ComfyUI >= %s)", kind, spec.module, spec.min_comfyui)
    kinds = tuple(k for k in kinds if k not in missing)
    seed = int(seed)
    out: dict[str, pathlib.Path] = {}
    for kind in kinds:
        spec = FIXTURES[kind]
        path = vae_dir / spec.filename
        out[kind] = path
        if not force and _is_current(path, kind, seed):
            log.info("%s: up to date (%s)", kind, path)
            continue
        t0 = time.perf_counter()
        sd = build_state_dict(kind, seed)
        t_build = time.perf_counter() - t0
        extra = FILE_ONLY_KEYS.get(spec.full or kind, ())
        n_params = sum(v.numel() for k, v in sd.items() if k not in extra)
        if n_params not in spec.param_counts():
            raise AssertionError(f"{kind}: {n_params} parameters, expected {spec.params}")
        make_room(vae_dir, sum(v.numel() * v.element_size() for v in sd.values()), keep=out.values())
        metadata = {
            _META_KIND: kind,
            _META_SEED: str(seed),
            _META_VERSION: GENERATOR_VERSION,
            "vramfit_fixture_model_class": f"{spec.module}.{spec.model_class}",
            "vramfit_fixture_note": "random weights (torch default init), real architecture; for tests only",
        }
        with _atomic_target(path) as tmp:
            safetensors.torch.save_file(sd, str(tmp), metadata=metadata)
        del sd
        log.info(
            "%s: wrote %s (%.2fM params, %s, %.1f MiB, built in %.1f s, total %.1f s)",
            kind,
            path,
            n_params / 1e6,
            str(spec.dtype).removeprefix("torch."),
            path.stat().st_size / 2**20,
            t_build,
            time.perf_counter() - t0,
        )
    return out


def load_vae(nodes: object, kind: str, vae_dir: pathlib.Path, dtype: torch.dtype = torch.float32) -> object:
    """The fixture VAE of ``kind`` (made in ``vae_dir`` if needed) as its users load it: ComfyUI's ``VAELoader``
    (``nodes``: ComfyUI's node module); Sana's DC-AE as ComfyUI_ExtraModels' ``ExtraVAELoader`` does
    (``scripts/sana_vae.py``), in ``dtype``."""
    path = make_models(vae_dir, seed=0, kinds=[kind])[kind]
    if kind == "dcae_sana":
        from scripts.sana_vae import load_dcae

        return load_dcae(str(path), dtype)
    with narrow_host(kind):
        return nodes.VAELoader().load_vae(path.name)[0]


class FixtureFolder(Mapping[str, str]):
    """``{kind: filename}`` of the fixture VAEs in ``vae_dir``, each file made (or checked) on first use.

    The keys are the kinds the running host has (:func:`available`), so ``kind in folder`` builds nothing;
    :data:`WORKFLOW_KINDS` are made at once.
    A file is made when looked up, and looked up again on every access: one deleted by :func:`make_room`
    to fit another on a small disk comes back, so only the files in use need to fit at once.
    """

    def __init__(self, vae_dir: pathlib.Path, seed: int = 0):
        self.vae_dir = pathlib.Path(vae_dir)
        self.seed = seed
        make_models(self.vae_dir, seed=seed, kinds=WORKFLOW_KINDS)

    def __getitem__(self, kind: str) -> str:
        if kind not in self:
            raise KeyError(kind)
        return make_models(self.vae_dir, seed=self.seed, kinds=[kind])[kind].name

    def __iter__(self) -> Iterator[str]:
        return (k for k in KINDS if available(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, kind: object) -> bool:
        return kind in FIXTURES and available(kind)

    def load(self, nodes: object, kind: str) -> object:
        """``VAELoader().load_vae`` (``nodes``: ComfyUI's node module) of the fixture file of ``kind``, a narrow
        twin under :func:`narrow_host`."""
        name = self[kind]
        with narrow_host(kind):
            return nodes.VAELoader().load_vae(name)[0]


def write_latent_file(path: str | os.PathLike, samples: torch.Tensor) -> pathlib.Path:
    """Write ``samples`` as a ``.latent`` file, the format of ComfyUI's ``SaveLatent``/``LoadLatent``.

    Keys ``latent_tensor`` and ``latent_format_version_0`` (an empty tensor: without it ``LoadLatent``
    multiplies by 1/0.18215 for legacy files). Written atomically.
    """
    path = pathlib.Path(path)
    tensors = {
        "latent_tensor": samples.detach().to("cpu").contiguous(),
        "latent_format_version_0": torch.tensor([]),
    }
    with _atomic_target(path) as tmp:
        safetensors.torch.save_file(tensors, str(tmp), metadata={"prompt": ""})
    return path


# --------------------------------------------------------------------------------------------------
# Structured latents


def _uniform(gen: torch.Generator, lo: float, hi: float, *shape: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(shape or (1,), generator=gen)


def _structured_item(c: int, t: int, h: int, w: int, gen: torch.Generator) -> torch.Tensor:
    """One (C,T,H,W) latent: smooth fields + a few moving regions with own statistics + smooth noise."""
    yy = ((torch.arange(h, dtype=torch.float32) + 0.5) / h).view(1, h, 1)
    xx = ((torch.arange(w, dtype=torch.float32) + 0.5) / w).view(1, 1, w)
    tt = torch.arange(t, dtype=torch.float32).view(t, 1, 1)

    # Per-channel mean + linear gradient + a few low-frequency travelling sinusoids.
    base = 0.5 * torch.randn(c, 1, 1, 1, generator=gen)
    gy, gx = (0.6 * torch.randn(2, c, 1, 1, 1, generator=gen)).unbind(0)
    field = base + gy * (yy - 0.5) + gx * (xx - 0.5)
    for _ in range(3):
        fy, fx = _uniform(gen, -2.0, 2.0, 2).tolist()
        speed = _uniform(gen, -0.5, 0.5).item()  # radians per frame
        amp = 0.35 * torch.randn(c, 1, 1, 1, generator=gen)
        phase = _uniform(gen, 0.0, 2 * math.pi, c, 1, 1, 1)
        arg = 2 * math.pi * (fy * yy + fx * xx) + speed * tt
        field = field + amp * torch.sin(arg.unsqueeze(0) + phase)

    # Regions (ellipses / rectangles) drifting smoothly, painted in order over the background.
    offset = torch.zeros(c, t, h, w)
    std = torch.full((1, t, h, w), 0.45)
    for _ in range(4):
        cy, cx = _uniform(gen, 0.25, 0.75, 2).tolist()
        ry, rx = _uniform(gen, 0.12, 0.3, 2).tolist()
        ay, ax = _uniform(gen, -0.15, 0.15, 2).tolist()
        omega = _uniform(gen, 0.15, 0.4).item()
        phi = _uniform(gen, 0.0, 2 * math.pi).item()
        ellipse = bool(torch.rand(1, generator=gen).item() < 0.5)
        mean_r = torch.randn(c, 1, 1, 1, generator=gen)
        std_r = math.exp(_uniform(gen, -1.3, 0.9).item())
        py = cy + ay * torch.sin(omega * tt + phi)
        px = cx + ax * torch.cos(omega * tt + phi)
        dy = (yy - py) / ry
        dx = (xx - px) / rx
        dist = torch.sqrt(dy**2 + dx**2) if ellipse else torch.maximum(dy.abs(), dx.abs())
        radius_px = max(min(ry * h, rx * w), 1.0)
        mask = torch.sigmoid((1.0 - dist) * radius_px / 0.6).unsqueeze(0)  # ~1 px soft edge
        offset = offset * (1 - mask) + mean_r * mask
        std = std * (1 - mask) + std_r * mask

    # Noise, spatially white, temporally smooth (AR(1), unit variance) so frame differences are small.
    rho = 0.85
    frames = [torch.randn(c, h, w, generator=gen)]
    for _ in range(t - 1):
        frames.append(rho * frames[-1] + math.sqrt(1 - rho**2) * torch.randn(c, h, w, generator=gen))
    noise = torch.stack(frames, dim=1)

    x = field + offset + std * noise
    if x.numel() > 1:
        x = x / x.std().clamp_min(1e-6)
    return x


def structured_latent(
    shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A latent with structure: (B,C,H,W) or (B,C,T,H,W), overall std 1, deterministic by ``seed``.

    Each batch item has its own per-channel means, low-frequency gradients and sinusoids, and four
    rectangular or elliptic regions with their own per-channel means and noise levels (std ratio up to
    ~9x between regions). In 5-D the regions drift and the sinusoids travel smoothly over time and
    the noise is temporally correlated, so frame-to-frame differences are small but meaningful.
    Any sizes work (odd, 1). The global RNG is not used.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (4, 5) or min(shape) < 1:
        raise ValueError(f"expected a (B,C,H,W) or (B,C,T,H,W) shape of positive sizes, got {shape}")
    b, c = shape[:2]
    t = shape[2] if len(shape) == 5 else 1
    h, w = shape[-2:]
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) % (2**63))
    out = torch.stack([_structured_item(c, t, h, w, gen) for _ in range(b)])
    if len(shape) == 4:
        out = out[:, :, 0]
    return out.to(dtype).contiguous()


# --------------------------------------------------------------------------------------------------
# CLI


def _read_env_file(path: pathlib.Path) -> dict[str, str]:
    env: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                env[key.strip()] = value.strip()
    return env


def comfyui_path() -> pathlib.Path | None:
    """``$COMFYUI_PATH``, else ``COMFYUI_PATH`` from ``<cache>/host.env`` (written by setup_host.sh)."""
    value = os.environ.get("COMFYUI_PATH")
    if not value:
        cache = pathlib.Path(os.environ.get("VRAMFIT_CACHE") or REPO_ROOT / ".cache")
        value = _read_env_file(cache / "host.env").get("COMFYUI_PATH")
    return pathlib.Path(value) if value else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.fixtures",
        description="Write random-weight VAEs with the real ComfyUI architectures (safetensors).",
    )
    parser.add_argument("--vae-dir", type=pathlib.Path, help="default: <COMFYUI_PATH>/models/vae")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=KINDS,
        default=None,
        metavar="KIND",
        help=f"subset of {', '.join(KINDS)} (default: all the host has)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the files are current")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[vramfit-fixtures] %(message)s")

    comfy_root = comfyui_path()
    if comfy_root is not None and str(comfy_root) not in sys.path:
        sys.path.insert(0, str(comfy_root))
    vae_dir = args.vae_dir
    if vae_dir is None:
        if comfy_root is None:
            parser.error(
                "no --vae-dir and no COMFYUI_PATH (env or .cache/host.env): run scripts/setup_host.sh"
            )
        vae_dir = comfy_root / "models" / "vae"
    paths = make_models(vae_dir, seed=args.seed, kinds=args.kinds, force=args.force)
    for kind, path in paths.items():
        log.info("%-14s %s", kind, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
