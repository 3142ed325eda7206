"""The VAE files ComfyUI's official templates load (``comfyui-workflow-templates-json`` 0.1.123), how the newest
upstream ``comfy/sd.py`` builds each, and narrow random-weight builders of the structures no other fixture has
(test harness only; the pack never imports this; issue 42 item 4).

No weights can be downloaded here. What each file is was read from its template (the loader node and what decodes
its output), the sd.py branch its keys select (``tests/upstream/files/comfy/sd.py``, Comfy-Org ``033046cc``) and
public code that names the file (:data:`TEMPLATE_FILES`' ``evidence``). For every file below the newest sd.py's
branch is the same text as the ComfyUI 0.33.0 host's (:func:`branch_text`; the newest file differs from 0.33.0's
only in the Qwen-Image 2.1, TAESD, SeedVR2, MiniMax H3 and YuE2 branches and its preamble/epilogue: ``fast_disk``,
``pause_malloc_graph``, a ``.to(dtype)`` after a lazy load), so the host's own ``comfy.sd.VAE`` builds what the
newest sd.py builds (:func:`vae_from_state_dict`), over the newest stored VAE modules when called inside
:func:`scripts.upstream.newest` (``comfy/ldm/wan/vae.py`` ``dcbf1c1``, ``diffusionmodules/model.py``
``9b6bab1``), as ``scripts/upstream_wan.py`` does for Qwen-Image 2.1.

The new structures (built here, narrow where sd.py reads the width from the file):

* :func:`wan21_rgba_state_dict`: Qwen-Image-Layered's and Ming-Image's RGBA VAE: sd.py's Wan 2.1 branch
  (``decoder.middle.0.residual.0.gamma``, no Wan 2.2 up path): ``comfy.ldm.wan.vae.WanVAE(dim, z_dim=16,
  image_channels=4, conv_out_channels=4)``, ``dim`` read from ``decoder.head.0.gamma`` (96 in the files; 24 here),
  ``output_channels`` from ``encoder.conv1.weight``'s input channels, ``pad_channel_value`` 1.0, 8x, 4x in time,
  ``latent_dim`` 3. The same builder with 3 channels is the Qwen-Image / Wan 2.1 layout (the ``wan21`` fixture's).
* :func:`flux2_small_state_dict`: ``flux2-vae_small`` (FLUX.2's small decoder): sd.py's KL branch
  (``decoder.conv_in.weight``, 32 channels) with ``bn.running_mean`` (``batch_norm_latent``: 128 channels, 16x) and
  ``decoder_ch = decoder.conv_in.weight.shape[0] // 4`` = 96 != 128: ``AutoencoderKL(ddconfig, embed_dim=32,
  decoder_ddconfig=ddconfig | {ch: 96})`` (BFL's ``FLUX.2-small-decoder`` config: encoder 128-256-512-512,
  decoder 96-192-384-384). sd.py fixes the encoder's ``ch`` at 128, so only the decoder's width could be narrowed;
  both are the file's.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import torch

from scripts.fixtures.weights import _trained_statistics
from scripts.upstream import FILES, quiet
from scripts.upstream_wan import _initialised

__all__ = ["BUILDERS", "LTX24_CONFIG", "NEWEST_SD_PY", "TEMPLATE_FILES", "TemplateFile", "branch_headers", "branch_text",
           "flux2_small_state_dict", "ltx24_state_dict", "state_dict", "vae_from_state_dict", "wan21_rgba_state_dict"]

NEWEST_SD_PY = FILES / "comfy" / "sd.py"

WAN21_NARROW_DIM = 24
"""Wan 2.1's ``dim`` (96) over 4, as ``scripts.fixtures.kinds.NARROW`` narrows the other families."""
FLUX2_SMALL_DECODER_CH = 96
"""``decoder_block_out_channels[0]`` of BFL's FLUX.2-small-decoder (96, 192, 384, 384)."""

WAN21_BRANCH = 'elif "decoder.middle.0.residual.0.gamma" in sd:'
KL_BRANCH = 'elif "decoder.conv_in.weight" in sd:'


@dataclasses.dataclass(frozen=True)
class TemplateFile:
    """One VAE file of the official templates."""

    name: str
    """The file name without ``.safetensors``."""
    templates: tuple[str, ...]
    """The templates that load it (``VAELoader``)."""
    branch: str
    """The line of the newest sd.py's ``VAE.__init__`` whose block builds it (its key test)."""
    builds: str
    """What that block builds for this file, in words."""
    covered_by: str | None
    """The existing test(s) that exercise this structure; None: :data:`BUILDERS` builds it for the new tests."""
    evidence: str
    """Where the file's layout was read from."""
    sub_branch: str | None = None
    """A line inside :attr:`branch`'s block that starts the part this file takes (compared too)."""


_WAN21 = ("comfy.ldm.wan.vae.WanVAE(dim=96 from decoder.head.0.gamma, z_dim=16, dim_mult [1, 2, 4, 4], "
          "image_channels=encoder.conv1 in, conv_out_channels=decoder.head.2 out); 8x, 4x in time, latent_dim 3, "
          "pad_channel_value 1.0")
_QWEN_VAE = ("the Qwen-Image VAE (Wan 2.1 layout, RGB: 242 MiB like wan_2.1_vae and qwen_image_vae); the "
             "template decodes VAEEncode's 5-D latent with VAEDecode")

TEMPLATE_FILES: tuple[TemplateFile, ...] = (
    TemplateFile(
        "qwen_image_layered_vae", ("image_qwen_image_layered", "image_qwen_image_layered_control"),
        WAN21_BRANCH, f"{_WAN21} with 4 in and 4 out (RGBA)", None,
        "Qwen-Image-Layered's RGBA VAE; EmptyQwenImageLayeredLatentImage makes (B, 16, layers + 1, h, w), "
        "LatentCutToBatch (t, 1) makes one-frame latents of a batch, VAEDecode gives RGBA",
        sub_branch="else:  # Wan 2.1 VAE"),
    TemplateFile(
        "ltx-2.5-video-vae-bf16", ("video_ltx2_5_t2v", "video_ltx2_5_i2v", "video_ltx2_5_flf2v"),
        'elif "decoder.conv_in_x_t.weight" in sd:  # lightricks LTX 2.4 diffusion VAE decoder',
        "comfy.ldm.lightricks.vae.na_diffusion_decoder.CausalDiffusionVAE(config=metadata['config']['vae']); "
        "128 ch, 32x, 8x in time, latent_dim 3 (LTX-2.5's 'Diffusion Video Decoder'; its '-conv-' twin is the "
        "LTX-2 VideoVAE)",
        "tests/host/test_cosmos_ltx24.py::test_ltx24_never_blends (decode: the host's, never a blend; encode: "
        "the host's, README encode table)",
        "public code naming the file: 'ComfyUI's own detection rule (comfy/sd.py at the LTX-2.5 merge): the "
        "presence of decoder.conv_in_x_t.weight selects CausalDiffusionVAE over the conv VideoVAE'"),
    TemplateFile(
        "ming_image_vae_bf16", ("image_ming_image_01_design_t2i", "image_ming_image_01_design_image_edit"),
        WAN21_BRANCH, f"{_WAN21} with 4 in and 4 out (RGBA), as Qwen-Image-Layered's", None,
        "Ming Image 0.1 Design outputs RGBA; sglang's Ming pipeline uses QwenImageVAEConfig and decodes each "
        "latent frame as (B * F, C, 1, h, w) with 4 output channels; 242.1 MB = the Wan 2.1 VAE's size",
        sub_branch="else:  # Wan 2.1 VAE"),
    *(TemplateFile(
        f"marigold_v2_{task}_vae", (f"image_marigold_v2_{template}",), WAN21_BRANCH, f"{_WAN21} with 3 in and 3 out",
        "the wan21 fixture (tests/host/test_node_video_decode.py, test_video_chunked_host.py, "
        "test_video_encode.py, test_upstream_wan.py)",
        f"{_QWEN_VAE} (base model qwen_image_edit_2509)", sub_branch="else:  # Wan 2.1 VAE")
      for task, template in (("depth_log_stage2", "depth_estimation"), ("normals", "surface_normal_estimation"),
                             ("albedo", "albedo_estimation"))),
    *(TemplateFile(
        f"wan_alpha_2.1_vae_{part}_channel", ("video_wan2.1_alpha_t2v_14B",), WAN21_BRANCH,
        f"{_WAN21} with 3 in and 3 out",
        "the wan21 fixture (tests/host/test_node_video_decode.py, test_video_chunked_host.py, "
        "test_video_encode.py)",
        "Wan-Alpha's two fine-tuned Wan 2.1 decoders on Wan 2.1's encoder (242 MiB each); both decode one "
        "EmptyHunyuanLatentVideo sample through VAEDecode, ImageToMask takes the alpha file's red channel",
        sub_branch="else:  # Wan 2.1 VAE")
      for part in ("rgb", "alpha")),
    TemplateFile(
        "flux2-vae_small", ("image_moss_image_t2i", "image_moss_image_t2i_bboxes", "image_moss_image_base_t2i",
                            "image_moss_image_base_t2i_bboxes", "image_moss_image_edit",
                            "image_moss_image_color_depth_control"),
        KL_BRANCH, "comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig: ch 128, z 32, batch_norm_latent, "
        "embed_dim 32, decoder_ddconfig: ch 96); 128 latent channels, 16x, RGB", None,
        "MOSS-Image's note 'FLUX.2 small VAE'; BFL's FLUX.2-small-decoder config (decoder_block_out_channels "
        "96-192-384-384); a public patch named flux2_small_decoder_patch adds exactly sd.py's decoder_ch test"),
    TemplateFile(
        "hunyuan_video_vae_bf16", ("hunyuan_video_text_to_video", "video_kandinsky5_t2v", "video_kandinsky5_i2v"),
        'elif "decoder.conv_in.conv.weight" in sd:',
        "comfy.ldm.models.autoencoder.AutoencoderKL(ddconfig: ch 128, z 16 from decoder.conv_in.conv, conv3d, "
        "time_compress 4, embed_dim from post_quant_conv); 8x, 4x in time, latent_dim 3",
        "the hunyuan_video fixture (tests/host/test_fixtures.py::test_loader_detects_the_real_architecture, "
        "test_video_coverage.py, test_video_auto_peak.py)",
        "HunyuanVideo 1.0's VAE (Comfy-Org/HunyuanVideo_repackaged); Kandinsky 5 uses the same file"),
    TemplateFile(
        "cogvideox_vae", ("utility_void_video_inpainting",),
        'elif "decoder.conv_in.conv.weight" in sd and "decoder.mid_block.resnets.0.norm1.norm_layer.weight" in '
        'sd:  # CogVideoX VAE',
        "comfy.ldm.cogvideo.vae.AutoencoderKLCogVideoX(latent_channels=encoder.conv_out.conv out // 2 = 16); 8x, "
        "4x in time, latent_dim 3",
        "the cogvideox fixture (tests/host/test_fixtures.py::test_loader_detects_the_real_architecture, "
        "test_video_coverage.py: carried-context chunks)",
        "Netflix VOID's CogVideoX VAE (Comfy-Org/void-model, 411 MB)"),
)
"""The VAE files of issue 42 item 4, with the templates of ``comfyui-workflow-templates-json`` 0.1.123 whose
``VAELoader`` names each (the ``marigold_v2_*`` and ``wan_alpha_*`` names are the files' own)."""

BUILDERS: dict[str, dict[str, Any]] = {
    "qwen_image_layered_vae": {"builder": "wan21_rgba", "channels": 4},
    "ming_image_vae_bf16": {"builder": "wan21_rgba", "channels": 4},
    "flux2-vae_small": {"builder": "flux2_small"},
    **{f.name: {"builder": "wan21_rgba", "channels": 3} for f in TEMPLATE_FILES
       if f.name.startswith(("marigold_v2_", "wan_alpha_"))},
}
"""How the tests build each file's structure narrow (the Wan RGB ones only to show sd.py's detection)."""


# ------------------------------------------------------------------------------------------------ sd.py's branches


def _lines(path: pathlib.Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _block(lines: list[str], start: int) -> list[str]:
    """Line ``start`` and the lines indented under it (its block), trailing blank lines dropped."""
    own = _indent(lines[start])
    out = [lines[start]]
    for line in lines[start + 1:]:
        if line.strip() and _indent(line) <= own:
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def _find(lines: list[str], text: str, after: int = 0) -> int:
    for i in range(after, len(lines)):
        if lines[i].strip() == text.strip():
            return i
    raise ValueError(f"no line {text!r}")


def _vae_init(lines: list[str]) -> int:
    return _find(lines, "class VAE:")


def branch_text(sd_py: pathlib.Path, branch: str, sub_branch: str | None = None) -> str:
    """The block of ``VAE.__init__`` that ``branch`` opens (``sub_branch``: the block inside it that this line
    opens), as text."""
    lines = _lines(sd_py)
    start = _find(lines, branch, _vae_init(lines))
    if sub_branch is not None:
        block = _block(lines, start)
        start = start + next(i for i, line in enumerate(block) if line.strip() == sub_branch.strip())
    return "\n".join(_block(lines, start))


def branch_headers(sd_py: pathlib.Path) -> list[str]:
    """The key tests of ``VAE.__init__``'s detection chain, in order (the ``if``/``elif`` lines at the level of its
    first ``if ... in sd:`` branch): which branch a file reaches depends on the ones before it."""
    lines = _lines(sd_py)
    first = next(i for i in range(_vae_init(lines), len(lines)) if lines[i].strip().startswith("if \"dec_in_proj")
                 or lines[i].strip().startswith("if 'dec_in_proj"))
    level = _indent(lines[first])
    out = []
    for line in lines[first:]:
        if line.strip() and _indent(line) < level:
            break
        if _indent(line) == level and line.strip().startswith(("if ", "elif ", "else")):
            out.append(line.strip())
    return out


# ------------------------------------------------------------------------------------------------ builders


def _wan21_config(dim: int, channels: int) -> dict[str, Any]:
    """sd.py's Wan 2.1 ``ddconfig`` for a file of width ``dim`` with ``channels`` in and out (RGB: without the
    channel arguments, which ComfyUI 0.3.75's ``WanVAE`` lacks; the same keys and shapes)."""
    rgba = {"image_channels": channels, "conv_out_channels": channels} if channels != 3 else {}
    return {"dim": dim, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
            "temperal_downsample": [False, True, True], **rgba, "dropout": 0.0}


def wan21_rgba_state_dict(seed: int = 0, dim: int = WAN21_NARROW_DIM, channels: int = 4) -> dict[str, torch.Tensor]:
    """Random weights of a Wan 2.1-layout VAE with ``channels`` image channels in and out (4: Qwen-Image-Layered's
    and Ming-Image's RGBA VAE; 3: Qwen-Image's, Wan-Alpha's, Marigold's), keyed as the released files (the module
    ``comfy.ldm.wan.vae`` in effect: the newest inside :func:`scripts.upstream.newest`)."""
    import comfy.ldm.wan.vae as wan_vae

    return _initialised(wan_vae.WanVAE(**_wan21_config(dim, channels)), seed)


def _flux2_ddconfig(ch: int) -> dict[str, Any]:
    """sd.py's default KL ``ddconfig`` with FLUX.2's z 32 and ``batch_norm_latent``."""
    return {"double_z": True, "z_channels": 32, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": ch,
            "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
            "batch_norm_latent": True}


def flux2_small_state_dict(seed: int = 0, decoder_ch: int = FLUX2_SMALL_DECODER_CH) -> dict[str, torch.Tensor]:
    """Random weights of FLUX.2's VAE with the small decoder (encoder ``ch`` 128, decoder ``decoder_ch``), keyed as
    BFL's file (the quant convs under ``encoder.`` / ``decoder.``, ``bn.*``; the loader moves them back). The
    BatchNorm has a trained model's statistics (``scripts.fixtures.weights._trained_statistics``)."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    model = AutoencoderKL(ddconfig=_flux2_ddconfig(128), embed_dim=32, decoder_ddconfig=_flux2_ddconfig(decoder_ch))
    sd = _initialised(model, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        _trained_statistics(model.bn)
    sd.update({f"bn.{k}": v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
               for k, v in model.bn.state_dict().items()})
    moved = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv."}
    out = {}
    for k, v in sd.items():
        prefix = next((p for p in moved if k.startswith(p)), None)
        out[moved[prefix] + k[len(prefix):] if prefix else k] = v
    return out


LTX24_CONFIG = {
    "encoder": {"blocks": [["res_x", {"num_layers": 1}]], "base_channels": 8},
    "decoder": {"in_channels": 128, "head_dim": 16, "stage_channels": [128, 64, 32, 32, 16],
                "stage_depths": [1, 1, 1, 1, 1], "stage_kernels": [[3, 3, 3]] * 4, "stage5_kernel": [3, 3, 3],
                "t_emb_dim": 64},
}
"""A small LTX 2.4 diffusion VAE (``ltx-2.5-video-vae``'s structure): the host's classes and key names, its
upsampling strides (8x, 32x), narrow stages and windows."""


def ltx24_state_dict(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """State dict and file metadata (its ``config``, as the released files carry it) of a small LTX 2.4 diffusion
    VAE, ``comfy.ldm.lightricks.vae.na_diffusion_decoder.CausalDiffusionVAE`` (ComfyUI 0.33+; ModuleNotFoundError
    on an older host), with a trained model's statistics and modulation tables rather than the constructor's."""
    import importlib
    import json

    nd = importlib.import_module("comfy.ldm.lightricks.vae.na_diffusion_decoder")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nd.CausalDiffusionVAE(config=LTX24_CONFIG)
        with torch.no_grad():
            for name, t in model.per_channel_statistics.named_buffers():
                trained = torch.exp(2 * torch.rand_like(t) - 1) if name in ("std-of-means", "mean-of-stds") else None
                t.copy_(0.5 * torch.randn_like(t) if trained is None else trained)
            for name, t in model.decoder.named_parameters():
                if name.endswith("scale_shift_table"):
                    t.copy_(torch.randn_like(t) / t.shape[-1] ** 0.5)
    return model.state_dict(), {"config": json.dumps({"vae": LTX24_CONFIG})}


def state_dict(name: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The narrow random-weight state dict of template file ``name`` (:data:`BUILDERS`)."""
    how = BUILDERS[name]
    if how["builder"] == "flux2_small":
        return flux2_small_state_dict(seed)
    return wan21_rgba_state_dict(seed, channels=how["channels"])


def vae_from_state_dict(sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Any:
    """The host's own ``comfy.sd.VAE`` built from ``sd`` in ``dtype``: these files' branches are the newest
    sd.py's, line for line (:func:`branch_text`); no missing or unexpected keys (checked)."""
    import comfy.sd

    with quiet():
        vae = comfy.sd.VAE(sd=dict(sd), dtype=dtype)
    if vae.first_stage_model is None:
        raise ValueError("no VAE branch took this state dict")
    model_keys = set(vae.first_stage_model.state_dict())
    missing = model_keys - set(_as_model_keys(sd))
    if missing:
        raise ValueError(f"state dict does not fit: missing {sorted(missing)[:3]}")
    return vae


def _as_model_keys(sd: dict[str, torch.Tensor]) -> list[str]:
    moved = {"encoder.quant_conv.": "quant_conv.", "decoder.post_quant_conv.": "post_quant_conv."}
    out = []
    for k in sd:
        prefix = next((p for p in moved if k.startswith(p)), None)
        out.append(moved[prefix] + k[len(prefix):] if prefix else k)
    return out
