"""What the family recognisers and executors rely on in ComfyUI's model code exists on the running host, and the
executors' calls bind to it (issue 41, item 7): an upstream rename of a module, class, attribute or method signature
fails a test named after it instead of silently sending a decode down another path.

The table (:data:`PINS`) is read from the recognisers (``memory/vae/*.py``, ``memory/plan/host_grid.py``) and the
executors (``memory/executors/*.py``): each :class:`Pin` names a family, a host module, the symbol (class, function,
attribute, method with the pack's argument shape) and where the pack relies on it (``file:function`` under
``memory/``, checked to exist). Where the pack spells the names as data, they are read from its source with ``ast``
(:func:`names_in`, :func:`constant`: ``seedvr2_layout._MODEL_ATTRS``, ``plan/host_grid.HOST_GRID_METHODS``, the
Cosmos classes ``carry_layout`` knows, the attribute tuples the ``*_reason`` functions loop over), so a new one shows
up here without editing this file; the rest is explicit.

What a check means (:func:`why_not`): the module imports; the class (function, constant) is in it; an attribute is
a class attribute, property or method, or assigned on instances in the class's own source (``self.x = ``,
``stage.block = `` of a container it builds, ``register_buffer("x")``: read with ``ast``, nothing is built); a call
binds (``inspect.signature(...).bind`` with the pack's positional count and keyword names, the instance counted);
``!X`` must be absent (the recogniser relies on its absence); ``X.__module__`` is the module itself (the recogniser
reads the class's module name). A pin with a ``fallback`` is probed by the pack with a default: missing, it skips
with what the pack does instead. A pin with a ``variant`` is one of a family's alternative structures: missing, it
skips when another variant of the family holds entirely. A family whose module is absent skips (0.3.75 has no
SeedVR2, MiniMax, CogVideoX or Mage-VAE).

``test_family_symbol_upstream``: the same pins of the modules ``scripts.upstream.newest()`` loads (Wan 2.1/2.2 and
Qwen-Image 2.1's VAE, SeedVR2, MiniMax H3, the KL ``model.py``) against those newest upstream files over 0.33.0; a
pin that does not hold there is listed in :data:`UPSTREAM_DIFFERENCES` with what the pack does about it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pathlib
import re
import textwrap
from typing import Any

import pytest

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parents[2]
MEMORY = ROOT / "memory"
SOURCE_PREFIXES = ("comfy", "diffusers")
"""Packages whose classes' source is read for instance attributes (the host's, and diffusers' for DC-AE)."""
_MISSING = object()


# ------------------------------------------------------------------------------------------ the pack's own names


@functools.cache
def _tree(path: str) -> ast.Module:
    return ast.parse((MEMORY / path).read_text(), filename=path)


def _function(path: str, name: str) -> ast.FunctionDef:
    """The function (``Class.method``: that class's method) ``name`` defined in ``memory/<path>``."""
    owner, _, name = name.rpartition(".")
    scope: ast.AST = _tree(path)
    if owner:
        scope = next((n for n in ast.walk(scope) if isinstance(n, ast.ClassDef) and n.name == owner), None)
        if scope is None:
            raise LookupError(f"memory/{path} defines no class {owner}")
    for node in ast.walk(scope):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise LookupError(f"memory/{path} defines no function {owner + '.' if owner else ''}{name}")


TABLE_ERRORS: list[str] = []
"""What the table could not read from the pack (reported by ``test_the_table_reads_the_pack``, not at collection)."""


def names_in(path: str, function: str, containing: str) -> tuple[str, ...]:
    """The first tuple/set/list of strings in ``function`` of ``memory/<path>`` that holds ``containing`` (the names a
    recogniser loops over with ``getattr``/``hasattr``); ``()`` and a :data:`TABLE_ERRORS` entry if none."""
    try:
        for node in ast.walk(_function(path, function)):
            if isinstance(node, (ast.Tuple, ast.Set, ast.List)) and node.elts and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                names = tuple(e.value for e in node.elts)
                if containing in names:
                    return names
        raise LookupError(f"memory/{path}:{function} has no tuple of names with {containing!r}")
    except (LookupError, OSError, SyntaxError) as e:
        TABLE_ERRORS.append(str(e))
        return ()


def constant(path: str, name: str, default: Any = ()) -> Any:
    """The literal value of the module-level constant ``name`` of ``memory/<path>`` (``default`` and a
    :data:`TABLE_ERRORS` entry if there is none)."""
    try:
        for node in _tree(path).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
        raise LookupError(f"memory/{path} has no constant {name}")
    except (LookupError, OSError, SyntaxError, ValueError) as e:
        TABLE_ERRORS.append(str(e))
        return default


# ------------------------------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class Pin:
    family: str
    module: str
    """The host module (``a|b``: any of them, as a recogniser that accepts several)."""
    spec: str
    """``Class``, ``Class.attr``, ``Class.a.b`` (``b`` of a container ``a`` the class builds), ``Class.method(x,
    k=...)``, ``function(x)``, ``NAME``; ``!`` first: must be absent."""
    where: str
    """``file:function`` under ``memory/`` that relies on it."""
    fallback: str = ""
    variant: str = ""
    value: Any = _MISSING

    @property
    def symbol(self) -> str:
        mods = self.module.split("|")
        module = mods[0] if len(mods) == 1 else f"{_common(mods)}.*"
        neg, spec = ("!", self.spec[1:]) if self.spec.startswith("!") else ("", self.spec)
        return f"{neg}{module}.{spec}"

    @property
    def id(self) -> str:
        return f"{self.family}-{self.symbol}"


def _common(mods: list[str]) -> str:
    parts = [m.split(".") for m in mods]
    out = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        out.append(level[0])
    return ".".join(out)


def fam(family: str, module: str, *rows: Any) -> list[Pin]:
    """A family's pins: rows ``(spec, where)`` or ``(spec, where, options)``; ``module:spec`` names another module."""
    pins = []
    for row in rows:
        spec, where, opts = (*row, {})[:3]
        mod, spec = spec.split(":", 1) if ":" in spec.split("(")[0] else (module, spec)
        pins.append(Pin(family, mod, spec, where, **opts))
    return pins


def attrs(cls: str, names: tuple[str, ...], where: str, prefix: str = "", **opts: Any) -> list[tuple]:
    return [(f"{cls}.{prefix}{n}", where, opts) if opts else (f"{cls}.{prefix}{n}", where) for n in names]


W21, W22 = "comfy.ldm.wan.vae", "comfy.ldm.wan.vae2_2"
KLM, AE = "comfy.ldm.modules.diffusionmodules.model", "comfy.ldm.models.autoencoder"
HV, VR = "comfy.ldm.hunyuan_video.vae", "comfy.ldm.hunyuan_video.vae_refiner"
LTX = "comfy.ldm.lightricks.vae.causal_video_autoencoder"
SEED, MINI = "comfy.ldm.seedvr.vae", "comfy.ldm.minimax.vae"
COSMOS = constant("vae/carry_layout.py", "_COSMOS", ("comfy.ldm.cosmos.vae",) * 4)
DCAE = "diffusers.models.autoencoders.autoencoder_dc"

WAN_LAYOUT, WAN_EXEC, ENC = "vae/wan_layout.py", "executors/wan.py", "vae/encode_split.py"
KLS, CARRY, SPLIT = "vae/kl_structure.py", "vae/carry_layout.py", "vae/split_layout.py"
SEEDL, GRID = "vae/seedvr2_layout.py", "plan/host_grid.py"


def _wan() -> list[tuple]:
    """What the Wan layout walk, the chunked executor and the split encoder rely on (both ``wan.vae`` and
    ``wan.vae2_2``)."""
    return [
        ("WanVAE.decoder", f"{WAN_LAYOUT}:is_wan_vae"),
        ("WanVAE.conv2", f"{WAN_LAYOUT}:is_wan_vae"),
        *attrs("Decoder3d", names_in(WAN_LAYOUT, "is_wan_vae", "upsamples"), f"{WAN_LAYOUT}:is_wan_vae"),
        ("Decoder3d.forward(x, feat_cache=...)", f"{WAN_LAYOUT}:is_wan_vae"),
        ("CausalConv3d._padding", f"{WAN_LAYOUT}:is_causal"),
        ("CausalConv3d.forward(x, cache_x)", f"{WAN_EXEC}:_cached_conv"),
        ("ResidualBlock.residual", f"{WAN_LAYOUT}:_walk"),
        ("ResidualBlock.shortcut", f"{WAN_LAYOUT}:_walk"),
        ("ResidualBlock.forward(x, feat_cache, feat_idx)", f"{WAN_LAYOUT}:cache_protocol"),
        ("ResidualBlock.forward(x)", f"{WAN_EXEC}:_layer"),
        ("Resample.mode", f"{WAN_LAYOUT}:_walk"),
        ("Resample.resample", f"{WAN_LAYOUT}:_walk"),
        ("Resample.time_conv", f"{WAN_LAYOUT}:_walk"),
        ("Resample.forward(x, feat_cache, feat_idx)", f"{WAN_EXEC}:_layer"),
        ("AttentionBlock", f"{WAN_LAYOUT}:_walk"),  # a global op by its class name ("attention")
        ("AttentionBlock.forward(x)", f"{WAN_EXEC}:global_part"),
        ("CACHE_T", f"{WAN_LAYOUT}:cache_protocol", {"value": constant(WAN_LAYOUT, "CACHE_T")}),
        ("WanVAE.decode(z)", "cost/calibration.py:host_variant"),
        ("WanVAE.__module__", f"{ENC}:_wan_reason"),  # startswith "comfy.ldm.wan."
        ("WanVAE.encoder", f"{ENC}:_wan_reason"),
        ("WanVAE.conv1", f"{ENC}:_wan_reason"),
        *attrs("Encoder3d", names_in(ENC, "_wan_reason", "downsamples"), f"{ENC}:_wan_reason"),
        ("Encoder3d.forward(x, feat_cache=..., feat_idx=...)", f"{ENC}:_wan_suffix"),
        ("WanVAE.encode(x)", f"{ENC}:_wan_prefix"),
    ]


GRID_CALLS = {
    "split_tiles": ("(input_len)", "executors/host_grid.py:spatial_grid"),
    "blend": ("(a, b, blend_extent, dim=...)", "executors/host_grid.py:_raw_tiles"),
    "_decode_pixels": ("(z)", "executors/host_grid.py:_Decoder.tile"),
    "_finalize_pixels": ("(part)", "executors/host_grid.py:_ClipWriter.write"),
    "_decode_temporal_chunks": ("(z_len)", "executors/host_grid.py:schedule"),
    "decode_output_shape": ("(input_shape)", "executors/host_grid.py:schedule"),
}
"""The executor's call of each of ``plan/host_grid.HOST_GRID_METHODS`` (a method missing here: existence only)."""

_KL_DECODER = names_in(KLS, "_structure_reason", "norm_out")
_KL_MID = names_in(KLS, "_structure_reason", "attn_1")
_KL_RESNET = names_in(KLS, "_resnet_reason", "norm1")
_KL_ENCODER = names_in(KLS, "_encoder_reason", "down")

PINS: list[Pin] = [
    *fam("wan21", W21, *_wan()),
    *fam("wan22", W22, *_wan(),
         ("Up_ResidualBlock.upsamples", f"{WAN_LAYOUT}:_walk"),
         ("Up_ResidualBlock.forward(x, first_chunk=...)", f"{WAN_LAYOUT}:_walk_decoder"),  # accepts(): version 2.2
         ("Up_ResidualBlock.forward(x, feat_cache, feat_idx, first_chunk)", f"{WAN_EXEC}:_layer"),
         ("WanVAE.patch_size", f"{WAN_LAYOUT}:_patch",
          {"fallback": "patch 2 for an up path with first_chunk (0.33.0's vae2_2 unpatchifies by 2)"})),
    # Qwen-Image 2.1's VAE: vae2_2.WanVAE built with image_channels 4, patch_size 1, temporal_kernel 1 (newer sd.py)
    *fam("qwen_image21", W22,
         ("WanVAE.patch_size", f"{WAN_LAYOUT}:_patch"),
         ("Up_ResidualBlock.forward(x, first_chunk=...)", f"{WAN_LAYOUT}:_walk_decoder"),
         ("comfy.sd:VAE.latent_dim", "vae/one_frame.py:one_frame_clip")),
    *fam("kl", KLM,
         (f"{AE}:AutoencoderKL", "vae/families.py:identify"),
         (f"{AE}:AutoencodingEngine", "vae/families.py:identify"),
         (f"{AE}:AutoencoderKL.decoder", "vae/families.py:identify"),
         (f"{AE}:AutoencoderKL.encoder", f"{KLS}:_encoder_reason"),
         (f"{AE}:AutoencoderKL.encode(x)", "executors/kl_exact.py:_encode_tail"),
         (f"{AE}:AutoencoderKL.post_quant_conv", "executors/kl_exact.py:_decoder_input",
          {"fallback": "the latent goes to the decoder as it is (FLUX's engine has none)"}),
         (f"{AE}:AutoencoderKL.bn", f"{KLS}:_structure_reason", {"fallback": "no latent batch-norm (FLUX.2 only)"}),
         (f"{AE}:AutoencodingEngine.regularization", f"{KLS}:_encoder_reason"),
         (f"{AE}:DiagonalGaussianRegularizer.sample", f"{KLS}:_encoder_reason"),
         ("Decoder", "vae/families.py:identify"),  # the decoder's class name
         *attrs("Decoder", _KL_DECODER, f"{KLS}:_structure_reason"),
         *attrs("Decoder", _KL_MID, f"{KLS}:_structure_reason", "mid."),
         ("Decoder.num_resolutions", f"{KLS}:hunyuan_image"),  # present: the SD KL stage order
         ("Decoder.num_res_blocks", "vae/families.py:kl_decoder_structure"),
         ("Decoder.ch", "vae/families.py:kl_decoder_structure"),
         ("Decoder.up.block", f"{KLS}:_level_reason"),
         ("Decoder.up.attn", f"{KLS}:_level_reason"),
         ("Decoder.up.upsample", f"{KLS}:_structure_reason"),
         ("Decoder.give_pre_end", f"{KLS}:_structure_reason", {"fallback": "taken as False (no early exit)"}),
         ("Decoder.tanh_out", f"{KLS}:_structure_reason", {"fallback": "taken as False (no tanh on the output)"}),
         *attrs("ResnetBlock", _KL_RESNET, f"{KLS}:_resnet_reason"),
         ("ResnetBlock.nin_shortcut", "vae/kl_layout.py:block_shortcut"),
         ("ResnetBlock.conv_shortcut", "vae/kl_layout.py:block_shortcut"),
         ("ResnetBlock.use_conv_shortcut", "vae/kl_layout.py:block_shortcut"),
         ("ResnetBlock.forward(x)", "executors/kl_exact.py:_run_mid_item"),
         ("AttnBlock.forward(x)", "executors/kl_exact.py:_run_mid_item"),
         ("Upsample.scale_factor", f"{KLS}:_structure_reason"),
         ("Upsample.with_conv", f"{KLS}:_structure_reason"),
         ("Upsample.conv", f"{KLS}:_structure_reason"),
         ("Encoder", f"{KLS}:_encoder_reason"),
         *attrs("Encoder", _KL_ENCODER, f"{KLS}:_encoder_reason"),
         ("Encoder.num_resolutions", f"{KLS}:_encoder_reason"),
         ("Encoder.down.downsample", f"{KLS}:_encoder_reason"),
         ("Downsample.with_conv", f"{KLS}:_encoder_reason"),
         ("Downsample.conv", f"{KLS}:_encoder_reason")),
    # HunyuanVideo's 3-D KL: model.py's Decoder with 3-D convolutions in AutoencoderKL (identify: by class names)
    *fam("hunyuan_video", KLM,
         ("Decoder.__init__(conv3d=..., time_compress=..., ...)", "vae/families.py:identify")),
    *fam("hunyuan_image", HV,
         *attrs("Decoder", _KL_DECODER, f"{KLS}:_structure_reason"),
         ("Decoder.block_out_channels", f"{KLS}:hunyuan_image"),
         ("!Decoder.num_resolutions", f"{KLS}:hunyuan_image"),  # absent: Hunyuan Image's stage order
         ("Decoder.z_channels", f"{KLS}:in_shortcut_repeats"),
         ("Decoder.up.upsample", f"{KLS}:stage_order"),
         ("PixelUnshuffle2D.conv", f"{KLS}:_is_pixel_shuffle_up"),
         ("PixelUnshuffle2D.scale", f"{KLS}:_is_pixel_shuffle_up"),
         ("Encoder.block_out_channels", f"{KLS}:hunyuan_image"),
         ("!Encoder.num_resolutions", f"{KLS}:hunyuan_image"),
         ("Encoder.z_channels", f"{KLS}:_encoder_reason"),
         ("Encoder.down.downsample", f"{KLS}:_downsamples"),
         ("PixelShuffle2D.conv", f"{KLS}:_is_pixel_shuffle_down"),
         ("PixelShuffle2D.ratio", f"{KLS}:_is_pixel_shuffle_down")),
    *fam("hunyuan_image_refiner", VR,
         *attrs("Decoder", _KL_DECODER, f"{KLS}:_structure_reason"),
         *attrs("Decoder", _KL_MID, f"{KLS}:_structure_reason", "mid."),
         ("Decoder.refiner_vae", f"{KLS}:whole_clip_3d"),
         ("Decoder.block_out_channels", f"{KLS}:hunyuan_image"),
         ("!Decoder.num_resolutions", f"{KLS}:hunyuan_image"),
         ("UpSmpl", f"{KLS}:_is_pixel_shuffle_up"),  # by its class name
         ("UpSmpl.conv", f"{KLS}:_is_pixel_shuffle_up"),
         ("UpSmpl.tus", f"{KLS}:_is_pixel_shuffle_up"),
         ("UpSmpl.refiner_vae", f"{KLS}:_is_pixel_shuffle_up"),
         ("comfy.sd:VAE.upscale_ratio", "vae/one_frame.py:one_frame_vae")),
    *fam("hunyuan_video15", VR,
         ("Decoder.__module__", f"{CARRY}:_hv15_reason"),  # endswith "hunyuan_video.vae_refiner"
         ("Decoder.refiner_vae", f"{CARRY}:_hv15_reason"),
         *attrs("Decoder", names_in(CARRY, "_hv15_reason", "norm_out"), f"{CARRY}:_hv15_reason"),
         ("Decoder.block_out_channels", f"{CARRY}:_hv15_prefix"),
         ("Decoder.z_channels", f"{CARRY}:_hv15_prefix"),
         *attrs("Decoder", ("block_1", "attn_1", "block_2"), f"{CARRY}:_hv15_prefix", "mid."),
         ("Decoder.up.block", f"{CARRY}:_hv15_chunk"),
         ("conv_carry_causal_3d(xl, op)", f"{CARRY}:_causal"),  # found in the decoder's module
         ("conv_carry_causal_3d(xl, op, conv_carry_in, conv_carry_out)", f"{CARRY}:_hv15_chunk"),
         # the up path's resnet block: 0.3.75's own subclass, model.py's ResnetBlock since (both take the carries)
         ("HunyuanRefinerResnetBlock.forward(x, conv_carry_in=..., conv_carry_out=...)", f"{CARRY}:_hv15_chunk",
          {"variant": "refiner block"}),
         ("ResnetBlock.forward(x, conv_carry_in=..., conv_carry_out=...)", f"{CARRY}:_hv15_chunk",
          {"variant": "model.py block"}),
         ("UpSmpl.forward(x, conv_carry_in, conv_carry_out)", f"{CARRY}:_hv15_chunk"),
         ("Encoder.__module__", f"{ENC}:_module"),
         ("Encoder.refiner_vae", f"{ENC}:_hv15_reason"),
         *attrs("Encoder", names_in(ENC, "_hv15_reason", "down"), f"{ENC}:_hv15_reason"),
         *attrs("Encoder", names_in(ENC, "_hv15_reason", "attn_1"), f"{ENC}:_hv15_reason", "mid.")),
    *fam("mochi", "comfy.ldm.genmo.vae.model",
         ("Decoder.__module__", f"{CARRY}:_mochi_reason"),  # endswith "genmo.vae.model"
         ("VideoVAE.decoder", f"{CARRY}:_mochi_reason"),
         ("VideoVAE.decode(z)", f"{CARRY}:_host_decode"),
         ("PConv3d", f"{CARRY}:_mochi_reason"),  # by its class name
         ("PConv3d.causal", f"{CARRY}:_mochi_reason"),
         ("DepthToSpaceTime", f"{CARRY}:_mochi_forwards"),
         ("DepthToSpaceTime.temporal_expansion", f"{CARRY}:_d2st_forward"),
         ("DepthToSpaceTime.spatial_expansion", f"{CARRY}:_d2st_forward")),
    *fam("ltx_video", LTX,
         ("VideoVAE.__module__", f"{CARRY}:_ltx_reason"),  # VideoVAE in ...causal_video_autoencoder
         ("VideoVAE.decoder", f"{CARRY}:_ltx_reason"),
         ("VideoVAE.per_channel_statistics", f"{CARRY}:_ltx_reason"),
         ("VideoVAE.timestep_conditioning", f"{CARRY}:_ltx_prefix"),
         ("processor.un_normalize(x)", f"{CARRY}:_ltx_prefix"),
         ("VideoVAE.decode_timestep", f"{CARRY}:_ltx_defaults", {"variant": "attributes"}),
         ("VideoVAE.decode_noise_scale", f"{CARRY}:_ltx_defaults", {"variant": "attributes"}),
         ("VideoVAE.decode(x, timestep=..., noise_scale=...)", f"{CARRY}:_ltx_defaults", {"variant": "defaults"}),
         ("Decoder.forward(x, timestep=...)", f"{CARRY}:_ltx_decoder"),
         ("ResnetBlock3D.inject_noise", f"{CARRY}:_noisy"),
         ("ResnetBlock3D._feed_spatial_noise(h, scale)", f"{CARRY}:_feeding"),
         *attrs("Encoder", names_in(ENC, "_ltx_reason", "down_blocks"), f"{ENC}:_ltx_reason"),
         ("VideoVAE.encode(x)", f"{ENC}:_ltx_prefix")),
    *fam("cogvideox", "comfy.ldm.cogvideo.vae",
         ("AutoencoderKLCogVideoX.__module__", f"{CARRY}:_cog_reason"),
         ("AutoencoderKLCogVideoX.decoder", f"{CARRY}:_cog_reason"),
         ("AutoencoderKLCogVideoX._decode_rolling", f"{CARRY}:_cog_reason"),
         ("AutoencoderKLCogVideoX.temporal_compression_ratio", f"{CARRY}:_cog_split"),
         ("_interpolate_zq(zq, target_size)", f"{CARRY}:_cog_prefix"),  # found in the model's module
         *attrs("Decoder3D", ("conv_in", "mid_block", "up_blocks", "norm_out", "conv_act", "conv_out"),
                f"{CARRY}:_cog_chunk"),
         ("CausalConv3d.forward(x)", f"{CARRY}:_cog_prefix"),
         ("CausalConv3d.forward(x, conv_cache=...)", f"{CARRY}:_cog_chunk"),
         ("MidBlock3D.forward(x, temb, zq)", f"{CARRY}:_cog_prefix"),
         ("UpBlock3D.forward(x, temb, zq, conv_cache=...)", f"{CARRY}:_cog_chunk"),
         ("SpatialNorm3D.forward(x, zq, conv_cache=...)", f"{CARRY}:_cog_chunk")),
    *fam("cosmos", COSMOS[0],
         ("CausalContinuousVideoTokenizer.__module__", f"{CARRY}:_cosmos_reason"),
         ("CausalContinuousVideoTokenizer.decoder", f"{CARRY}:_cosmos_reason"),
         ("CausalContinuousVideoTokenizer.post_quant_conv", f"{CARRY}:_cosmos_reason"),
         ("CausalContinuousVideoTokenizer.decode(z)", f"{CARRY}:_cosmos_prefix"),
         # every decoder class _cosmos_reason knows, in one of the modules it accepts
         *[(f"{'|'.join(COSMOS)}:{n}", f"{CARRY}:_cosmos_reason")
           for n in sorted(names_in(CARRY, "_cosmos_reason", "DecoderFactorized"))],
         *attrs(f"{COSMOS[1]}:CausalConv3d", ("conv3d", "time_pad", "spatial_pad", "pad_mode"),
                f"{CARRY}:_cosmos_conv_forward"),
         (f"{COSMOS[3]}:CausalNormalize.num_groups", f"{CARRY}:_cosmos_reason"),
         *attrs(f"{COSMOS[1]}:CausalTemporalAttnBlock", ("norm", "q", "k", "v", "proj_out"),
                f"{CARRY}:_cosmos_tattn_forward"),
         *attrs(f"{COSMOS[1]}:CausalHybridUpsample3d", ("spatial_up", "temporal_up", "conv1", "conv2", "conv3"),
                f"{CARRY}:_cosmos_upsample_forward"),
         *attrs(f"{COSMOS[2]}:UnPatcher3D", ("patch_method", "range", "patch_size"), f"{CARRY}:_cosmos_unpatch_forward"),
         (f'{COSMOS[2]}:UnPatcher3D._idwt(x, "haar", rescale=...)', f"{CARRY}:_cosmos_unpatch_forward")),
    *fam("mage", "comfy.ldm.mage_flow.vae",
         ("MageVAE.__module__", f"{SPLIT}:_mage_reason"),  # endswith "mage_flow.vae"
         ("MageVAE.decoder_model", f"{SPLIT}:_mage_reason"),
         *attrs("DConvDenoiser", names_in(SPLIT, "_mage_reason", "t_embedder"), f"{SPLIT}:_mage_reason"),
         *attrs("DConvDenoiser", names_in(SPLIT, "_mage_stages", "final_layer"), f"{SPLIT}:_mage_stages",
                fallback="left out of the per-patch tail's modules (read for global operations)"),
         ("YEmbedder.decoder", f"{SPLIT}:_mage_reason"),
         ("BottleneckPatchEmbed.proj1", f"{SPLIT}:_mage_reason"),
         ("BottleneckPatchEmbed.proj2", f"{SPLIT}:_mage_stages"),
         ("DConvDenoiser.forward(x, t, cond)", f"{SPLIT}:_mage_stages"),
         ("TimestepEmbedder.forward(t, dtype)", f"{SPLIT}:_mage_stages")),
    *fam("seedvr2", SEED,
         *attrs("VideoAutoencoderKLWrapper", constant(SEEDL, "_MODEL_ATTRS"), f"{SEEDL}:seedvr2_of"),
         *attrs("Decoder3D", constant(SEEDL, "_DECODER_ATTRS"), f"{SEEDL}:seedvr2_of"),
         ("VideoAutoencoderKLWrapper.decode(z)", "executors/seedvr2.py:decode_seedvr2"),
         ("VideoAutoencoderKLWrapper.slicing_decode(z)", "executors/seedvr2.py:decode_seedvr2"),
         ("VideoAutoencoderKLWrapper.use_slicing", f"{SEEDL}:seedvr2_layout",
          {"fallback": "slices whenever the latent is longer than one slice (use_slicing True)"}),
         ("InflatedCausalConv3d.__module__", f"{SEEDL}:_host_module"),  # conv_in's class names the host module
         ("MemoryState", f"{SEEDL}:_variant"),
         *attrs("MemoryState", ("INITIALIZING", "ACTIVE", "DISABLED"), f"{SEEDL}:SeedVR2Layout.slices"),
         ("UNetMidBlock3D.resnets", f"{SEEDL}:_variant"),
         ("UNetMidBlock3D.attentions", f"{SEEDL}:_variant"),
         ("UNetMidBlock3D.forward(h, memory_state=..., memory_cache=...)", f"{SEEDL}:SeedVR2Layout.mid"),
         ("UpDecoderBlock3D.resnets", f"{SEEDL}:_variant"),
         ("UpDecoderBlock3D.upsamplers", f"{SEEDL}:_variant"),
         *attrs("ResnetBlock3D", constant(SEEDL, "_RESNET_ATTRS"), f"{SEEDL}:_variant"),
         ("ResnetBlock3D.output_scale_factor", f"{SEEDL}:seedvr2_layout", {"fallback": "a residual scale of 1"}),
         *attrs("Upsample3D", constant(SEEDL, "_UP_ATTRS"), f"{SEEDL}:_variant"),
         ("InflatedCausalConv3d.forward(x, memory_state=..., memory_cache=...)", "executors/seedvr2.py:_Run._tile"),
         ("Decoder3D.conv_act", f"{SEEDL}:_variant", {"variant": "forward"}),
         ("ResnetBlock3D.nonlinearity", f"{SEEDL}:_variant", {"variant": "forward"}),
         ("Upsample3D.forward(x, memory_state=..., memory_cache=...)", f"{SEEDL}:SeedVR2Layout.up",
          {"variant": "forward"}),
         ("causal_norm_wrapper(norm_layer, x, silu=...)", f"{SEEDL}:_folded_silu", {"variant": "run"}),
         ("Upsample3D.run(source, memory_state, memory_cache)", f"{SEEDL}:SeedVR2Layout.up", {"variant": "run"}),
         ("CausalMemoryCache", f"{SEEDL}:seedvr2_layout", {"fallback": "a dict carries the prefix's caches"}),
         ("CausalMemoryCache._packable(value)", "plan/seedvr2.py:packed_tails",
          {"fallback": "nothing is int8-packed: the walk runs"}),
         ("_ck_eligible(x)", "plan/seedvr2.py:packed_tails", {"fallback": "tails probed as contiguous tensors"}),
         ("InflatedCausalConv3d.temporal_padding", "plan/seedvr2.py:packed_tails",
          {"fallback": "no prefix convolution's tail is probed for packing"}),
         ("VideoAutoencoderKLWrapper.comfy_memory_used_decode(shape, dtype)", f"{SEEDL}:hints_of",
          {"fallback": "no estimate of the model's own: the walk is sized on fake tensors"}),
         ("VideoAutoencoderKLWrapper.comfy_decode_estimate_is_reliable", f"{SEEDL}:hints_of",
          {"fallback": "the model's estimate is not trusted"}),
         ("VideoAutoencoderKLWrapper.preferred_decode_tile(free_memory, dtype)", f"{SEEDL}:hints_of",
          {"fallback": "no preferred tile"})),
    *fam("minimax", MINI,
         ("MiniMaxH3VideoVAE", f"{GRID}:host_grid_of"),
         *[(f"MiniMaxH3VideoVAE.{m}{GRID_CALLS.get(m, ('', ''))[0]}",
            GRID_CALLS.get(m, ("", f"{GRID}:host_grid_of"))[1]) for m in constant(GRID, "HOST_GRID_METHODS")],
         *attrs("MiniMaxH3VideoVAE", constant(GRID, "HOST_GRID_FIELDS"), f"{GRID}:host_grid_of"),
         ("MiniMaxH3VideoVAE.decode(z)", "decode/host_grid.py:check_host_grid"),
         (f"MiniMaxH3VideoVAE.{constant('executors/host_grid.py', 'ROW_METHOD', '_decode_tile_row')}"
          f"({', '.join(constant('executors/host_grid.py', 'ROW_ARGS'))})", "executors/host_grid.py:grid_kind",
          {"fallback": "the raw-edge grid (0.33.0's: a tile per decoder call)"})),
    *fam("dc-ae", DCAE,
         ("Decoder.__module__", f"{SPLIT}:is_dcae"),  # its last component in DCAE_MODULES
         *attrs("Decoder", names_in(SPLIT, "_dcae_reason", "up_blocks"), f"{SPLIT}:_dcae_reason"),
         ("Decoder.in_shortcut", f"{SPLIT}:_dcae_stages", {"fallback": "no latent channel-repeat shortcut"}),
         ("Decoder.in_shortcut_repeats", f"{SPLIT}:_dcae_stages"),
         ("AutoencoderDC.use_tiling", f"{SPLIT}:_dcae_reason", {"fallback": "its own tiling taken as off"}),
         ("AutoencoderDC.encode(x)", f"{ENC}:_dcae_prefix"),
         *attrs("Encoder", names_in(ENC, "_dcae_reason", "down_blocks"), f"{ENC}:_dcae_reason"),
         ("EfficientViTBlock.attn", f"{SPLIT}:_dcae_units"),
         ("EfficientViTBlock.conv_out", f"{SPLIT}:_dcae_units"),
         ("DCDownBlock2d", f"{ENC}:_dcae_finer"),
         ("diffusers.models.attention_processor:SanaMultiscaleLinearAttention", f"{SPLIT}:is_linear_attention"),
         ("diffusers.models.attention_processor:SanaMultiscaleAttnProcessor2_0", f"{SPLIT}:is_linear_attention"),
         *attrs("diffusers.models.attention_processor:SanaMultiscaleLinearAttention",
                names_in(SPLIT, "is_linear_attention", "to_q") + ("processor",), f"{SPLIT}:is_linear_attention")),
    # SVD's temporal decoder: the KL walker's time mixing (kl_structure.time_mixing / _video_block_reason)
    *fam("svd", "comfy.ldm.modules.temporal_ae",
         ("VideoDecoder", "vae/families.py:batch_coupling_hint"),
         ("VideoResBlock", f"{KLS}:_video_block_reason"),
         ("VideoResBlock.get_alpha", f"{KLS}:_video_block_reason"),
         ("VideoResBlock.time_stack", f"{KLS}:time_mixing"),
         ("VideoResBlock.mix_factor", f"{KLS}:_video_block_reason"),
         ("VideoResBlock.forward(x, temb)", "executors/kl_exact.py:_mid_video"),
         ("AE3DConv.time_mix_conv", f"{KLS}:_structure_reason"),
         ("AttnVideoBlock.time_mix_block", f"{KLS}:_structure_reason"),
         *attrs("comfy.ldm.modules.diffusionmodules.openaimodel:ResBlock",
                ("in_layers", "out_layers", "skip_connection", "updown", "skip_t_emb", "use_scale_shift_norm"),
                f"{KLS}:_video_block_reason")),
    # the ComfyUI VAE object every recogniser starts from
    *fam("vae", "comfy.sd",
         *attrs("VAE", ("first_stage_model", "upscale_ratio", "latent_dim", "latent_channels"),
                "vae/families.py:identify")),
]

FAMILY_MODULES = {
    "wan21": W21, "wan22": W22, "qwen_image21": W22, "kl": KLM, "hunyuan_video": KLM, "hunyuan_image": HV,
    "hunyuan_image_refiner": VR, "hunyuan_video15": VR, "mochi": "comfy.ldm.genmo.vae.model", "ltx_video": LTX,
    "cogvideox": "comfy.ldm.cogvideo.vae", "cosmos": COSMOS[0], "mage": "comfy.ldm.mage_flow.vae", "seedvr2": SEED,
    "minimax": MINI, "dc-ae": DCAE, "svd": "comfy.ldm.modules.temporal_ae", "vae": "comfy.sd",
}
"""The module whose absence means the family is not on this host (its pins skip)."""
FAMILY_MARKERS = {"qwen_image21": Pin("qwen_image21", W22, "WanVAE.__init__(image_channels=..., patch_size=..., "
                                      "temporal_kernel=...)", "vae/families.py:wan_family")}
"""A family that shares its module with another: the symbol that tells it is on the host (the newer ``sd.py`` builds
Qwen-Image 2.1's VAE as ``vae2_2.WanVAE(image_channels=4, patch_size=1, temporal_kernel=1)``)."""

UPSTREAM_DIFFERENCES = {
    "kl-comfy.ldm.modules.diffusionmodules.model.Decoder.give_pre_end":
        "gone since 0.33.0 (the KL decoder has no early exit): the structure check's default False holds",
    "seedvr2-comfy.ldm.seedvr.vae.VideoAutoencoderKLWrapper.use_slicing":
        "the rewrite always slices a latent longer than one slice: the layout's default (use_slicing True) holds",
    "seedvr2-comfy.ldm.seedvr.vae.Decoder3D.conv_act":
        "0.33.0's 'forward' variant; the rewrite is told by its structure as the 'run' variant (SiLU folded into "
        "causal_norm_wrapper(silu=), upsamplers' run(source, state, cache)): seedvr2_layout._variant",
    "seedvr2-comfy.ldm.seedvr.vae.ResnetBlock3D.nonlinearity": "the 'forward' variant only (see conv_act)",
    "seedvr2-comfy.ldm.seedvr.vae.Upsample3D.forward(x, memory_state=..., memory_cache=...)":
        "the 'forward' variant only: the rewrite's Upsample3D has no forward of its own, the layout calls its run()",
    "seedvr2-comfy.ldm.seedvr.vae.ResnetBlock3D.output_scale_factor":
        "the rewrite's resnets add without a scale: the layout's default 1.0",
}
"""``pin.id -> what the pack does about it``: pins that do not hold on the newest upstream files (over 0.33.0)."""


# ------------------------------------------------------------------------------------------ checking a pin


_CALL = re.compile(r"(!?)([\w.]+)(?:\((.*)\))?")


def _parse(spec: str) -> tuple[bool, list[str], tuple[int, tuple[str, ...], bool] | None]:
    """``(negated, dotted name, (positional count, keywords, partial) or None)``; a last argument ``...``: the other
    required arguments are not the pack's (a constructor ComfyUI calls): ``bind_partial``."""
    m = _CALL.fullmatch(spec)
    assert m, spec
    call = None
    if m.group(3) is not None:
        args = [a.strip() for a in m.group(3).split(",") if a.strip()]
        partial = args[-1:] == ["..."]
        args = args[:-1] if partial else args
        keywords = tuple(a.split("=")[0] for a in args if a.endswith("=..."))
        call = (len(args) - len(keywords), keywords, partial)
    return bool(m.group(1)), m.group(2).split("."), call


@functools.cache
def _assigned(cls: type) -> frozenset[str]:
    """Attribute names the source of ``cls`` and its host bases assign (``x.name = ``, ``register_buffer("name")``,
    ``setattr(x, "name")``): the instance attributes its objects get."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(SOURCE_PREFIXES):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Call):
                fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                args = node.args[1:] if fn == "setattr" else node.args
                if fn in ("register_buffer", "register_parameter", "register_module", "add_module", "setattr") \
                        and args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                    names.add(args[0].value)
    return frozenset(names)


def _has(cls: type, name: str) -> bool:
    return hasattr(cls, name) or name in _assigned(cls)


def _bind(fn: Any, positional: int, keywords: tuple[str, ...], partial: bool = False) -> None:
    sig = inspect.signature(fn)
    (sig.bind_partial if partial else sig.bind)(*[object()] * positional, **{k: object() for k in keywords})


def _import(module: str) -> Any:
    """The first of ``module``'s alternatives (``a|b``) that imports; raises the last ImportError."""
    error: ImportError | None = None
    for name in module.split("|"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            error = e
    raise error  # type: ignore[misc]


def why_not(pin: Pin) -> str | None:
    """Why ``pin`` does not hold on the modules imported now (None: it holds)."""
    negated, path, call = _parse(pin.spec)
    found = []
    for name in pin.module.split("|"):
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            found.append(f"{name} does not import ({type(e).__name__}: {e})")
            continue
        top = getattr(mod, path[0], _MISSING)
        if top is _MISSING:
            found.append(f"{name} has no {path[0]}")
            continue
        why = _member_why_not(pin, name, top, path, call, negated)
        if why is None:
            return None
        found.append(why)
    return "; ".join(found)


def _member_why_not(pin: Pin, module: str, top: Any, path: list[str], call: Any, negated: bool) -> str | None:
    members = path[1:]
    if members == ["__module__"]:
        return None if top.__module__ == module else f"{path[0]} is defined in {top.__module__}, not {module}"
    if not members:
        if negated:
            return f"{module}.{path[0]} exists"
        if pin.value is not _MISSING and top != pin.value:
            return f"{module}.{path[0]} is {top!r}, the pack assumes {pin.value!r}"
        return _call_why_not(top, call, f"{module}.{path[0]}", bound=True)
    if not isinstance(top, type):
        return f"{module}.{path[0]} is not a class"
    missing = [m for m in members if not _has(top, m)]
    if negated:
        return None if missing else f"{module}.{'.'.join(path)} exists (the pack relies on its absence)"
    if missing:
        return f"{module}.{path[0]} has no {'.'.join(missing)} (neither on the class nor assigned in its source)"
    if call is None:
        return None
    name = members[-1]
    fn = getattr(top, name, _MISSING)
    if fn is _MISSING:
        return f"{module}.{'.'.join(path)} is an instance attribute: its call cannot be checked"
    if not getattr(fn, "__module__", "").startswith(SOURCE_PREFIXES):  # e.g. nn.Module's unimplemented forward
        return f"{module}.{'.'.join(path)} is {fn.__module__}'s, not defined by the host's classes"
    bound = name != "__init__" and isinstance(inspect.getattr_static(top, name), (staticmethod, classmethod))
    return _call_why_not(fn, call, f"{module}.{'.'.join(path)}", bound=bound)


def _call_why_not(fn: Any, call: Any, where: str, bound: bool) -> str | None:
    if call is None:
        return None
    positional, keywords, partial = call
    try:
        _bind(fn, positional + (0 if bound else 1), keywords, partial)  # + the instance of a plain method
    except ValueError:  # no signature to read: existence is all there is to check
        return None if callable(fn) else f"{where} is not callable"
    except TypeError as e:
        return f"{where} does not bind {positional} positional argument(s) and keywords {list(keywords)}: {e}"
    return None


def _family_absent(family: str) -> str | None:
    module = FAMILY_MODULES[family]
    try:
        if importlib.util.find_spec(module) is None:
            return f"{module} is not on this host"
    except ModuleNotFoundError as e:
        return f"{module} is not on this host ({e})"
    marker = FAMILY_MARKERS.get(family)
    why = why_not(marker) if marker is not None else None
    return None if why is None else f"not on this host: {marker.symbol} does not hold ({why})"


def _variant_held(pin: Pin) -> str | None:
    """Another variant of ``pin``'s family that holds entirely on this host, if any."""
    others = {p.variant for p in PINS if p.family == pin.family and p.variant and p.variant != pin.variant}
    for v in sorted(others):
        if all(why_not(p) is None for p in PINS if p.family == pin.family and p.variant == v):
            return v
    return None


# ------------------------------------------------------------------------------------------ the table itself


def test_the_table_reads_the_pack() -> None:
    """The derived names are the pack's (so a pin is not vacuous), every pin's ``where`` names a function under
    ``memory/``, ids are unique and every family has its module."""
    assert not TABLE_ERRORS, TABLE_ERRORS
    assert {"conv1", "middle", "upsamples", "head"} <= set(names_in(WAN_LAYOUT, "is_wan_vae", "upsamples"))
    assert "split_tiles" in constant(GRID, "HOST_GRID_METHODS") and "decoder" in constant(SEEDL, "_MODEL_ATTRS")
    assert "UnPatcher3D" in names_in(CARRY, "_cosmos_reason", "DecoderFactorized")
    assert set(constant(GRID, "HOST_GRID_METHODS")) <= set(GRID_CALLS), "a host-grid method without a call shape"
    for pin in PINS:
        path, _, function = pin.where.partition(":")
        _function(path, function)
        _parse(pin.spec)
        assert pin.family in FAMILY_MODULES, pin.family
    ids = [p.id for p in PINS]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert set(UPSTREAM_DIFFERENCES) <= set(ids), set(UPSTREAM_DIFFERENCES) - set(ids)


# ------------------------------------------------------------------------------------------ on the host


@pytest.fixture(scope="module")
def host(host_config):
    from scripts.host import import_comfy

    import_comfy(host_config)
    return host_config


def test_a_renamed_symbol_or_changed_call_is_caught(host) -> None:
    """The checks fail where they should: a missing class, attribute or keyword, a present ``!`` symbol."""
    assert why_not(Pin("x", W21, "WanVAE.no_such_attribute", "")) is not None
    assert why_not(Pin("x", W21, "NoSuchVAE", "")) is not None
    assert why_not(Pin("x", W21, "ResidualBlock.forward(x, no_such_keyword=...)", "")) is not None
    assert why_not(Pin("x", W21, "CausalConv3d.forward(a, b, c, d, e)", "")) is not None
    assert why_not(Pin("x", W21, "!WanVAE.decoder", "")) is not None
    assert why_not(Pin("x", W21, "CACHE_T", "", value=3)) is not None
    assert why_not(Pin("x", W21, "Decoder3d.__module__", "")) is None
    assert why_not(Pin("x", W22, "CausalConv3d.__module__", "")) is not None  # imported from wan.vae


@pytest.mark.parametrize("pin", PINS, ids=[p.id for p in PINS])
def test_family_symbol(host, pin) -> None:
    absent = _family_absent(pin.family)
    if absent:
        pytest.skip(f"{pin.family}: {absent}")
    why = why_not(pin)
    if why is None:
        return
    if pin.fallback:
        pytest.skip(f"{pin.symbol} does not hold on ComfyUI {host.version} ({why}); the pack falls back: "
                    f"{pin.fallback}")
    held = _variant_held(pin) if pin.variant else None
    if held:
        pytest.skip(f"{pin.symbol} is of the {pin.variant!r} variant; the {held!r} variant holds on ComfyUI "
                    f"{host.version}, and the pack takes that one ({pin.where})")
    pytest.fail(f"{pin.symbol}, which {pin.where} relies on for {pin.family}, does not hold on ComfyUI "
                f"{host.version}: {why}")


# ------------------------------------------------------------------------------------------ the newest upstream files


def _upstream_pins() -> list[Pin]:
    from scripts.upstream import VAE_MODULES

    return [p for p in [*PINS, *FAMILY_MARKERS.values()] if all(m in VAE_MODULES for m in p.module.split("|"))]


UPSTREAM_PINS = _upstream_pins()


@pytest.fixture(scope="module")
def newest(host):
    if importlib.util.find_spec("comfy.ldm.seedvr") is None or importlib.util.find_spec("comfy.ldm.minimax") is None:
        pytest.skip("the newest upstream VAE files load over a ComfyUI 0.33.0 host only (0.3.75 predates SeedVR2's "
                    "and MiniMax's VAE)")
    from scripts.upstream import newest

    with newest() as mods:
        yield mods


@pytest.mark.parametrize("pin", UPSTREAM_PINS, ids=[p.id for p in UPSTREAM_PINS])
def test_family_symbol_upstream(newest, pin) -> None:
    """Each pin of the newest upstream files' modules holds there, or is a listed difference that still differs."""
    assert all(newest[m].__file__ == importlib.import_module(m).__file__ for m in pin.module.split("|"))
    why = why_not(pin)
    known = UPSTREAM_DIFFERENCES.get(pin.id)
    if known is not None:
        assert why is not None, f"{pin.symbol} holds on the newest upstream files now: drop it from UPSTREAM_DIFFERENCES"
        return
    assert why is None, (f"{pin.symbol}, which {pin.where} relies on for {pin.family}, does not hold on the newest "
                         f"upstream files: {why} (list it in UPSTREAM_DIFFERENCES with what the pack does about it)")
