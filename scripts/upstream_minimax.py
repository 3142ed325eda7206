"""MiniMax H3's video VAE built as the newest upstream ``comfy/sd.py`` builds it, as a narrow random-weight model
(test harness only; the pack never imports this).

Call the builders inside :func:`newest_minimax` (``scripts.upstream.newest`` plus :func:`extended_ops`): the model is
the newest stored ``comfy/ldm/minimax/vae.py`` (Comfy-Org ``19315e86``: tiles blended against their already-blended
neighbours, a row of tiles per decoder call) with the released file's key names. The newest ``sd.py`` itself does not
import over 0.33.0, so :func:`vae_from_state_dict` mirrors its ``VAE.__init__`` for this branch (``comfy/sd.py`` at
``033046cc``, lines 1029-1063): 0.33.0's ``comfy.sd.VAE(sd={})`` sets every default attribute, then the branch's
model and attributes (``latent_channels`` 24, ``latent_dim`` 3, 16x, the frame formulas, ``handles_tiling``, an
identity ``process_output``, its memory estimates), then the end of ``__init__`` (dtype, devices, patcher, the state
dict). The branch passes ``num_layers`` (counted from the file), which the stored ``vae.py`` does not take yet: the
count goes to its ``ViT3DDecoder``, which takes it.

* Narrow (:data:`NARROW`): the decoder 2 layers of 2 heads x 32 (36 x 32 x 64 released), the encoder ``ch`` 32
  (128), ``tile_size`` 64 / ``tile_overlap_min`` 16 (256 / 64): constructor arguments of the host's classes, so a
  10x10-latent video is 3x3 tiles, as ``tests/host/test_host_grid.py``'s fixture on 0.33.0's file.
* ``quantized``: the decoder's transformer linears stored as int8 with ConvRot (``int8_tensorwise``, a
  ``comfy_quant`` entry per layer, as a quantized release): ``comfy.utils.detect_layer_quantization`` finds them and
  the branch builds the model on ``comfy.ops.mixed_precision_ops`` (0.33.0 has both and comfy-kitchen's CPU
  ``int8_linear``; its int8 attention kernel is CUDA-only: ``COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE`` False).

:func:`extended_ops`: the newest ``vae.py`` calls ``comfy.ops.linear_input_act(linear, x, act, act_weight, act_eps,
residual=, residual_scale=)`` (Comfy-Org ``comfy/ops.py`` ``0271a469``); 0.33.0's takes ``(linear, x, act)``. While
the block runs, a stand-in with the newer signature does what the newest function does off the kitchen's fused
kernels: the pre-norm (``comfy.rmsnorm.rms_norm``), then 0.33.0's own ``linear_input_act`` (or the layer itself for
no activation on a plain weight), then ``addcmul`` with the residual. It is not in ``scripts.upstream.STAND_INS``,
which only adds what a host lacks; this one replaces a function 0.33.0 has with an older signature.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterator
from typing import Any

import torch

from scripts.upstream import newest, quiet

__all__ = ["NARROW", "QUANT_LINEARS", "extended_ops", "minimax_state_dict", "minimax_vae", "newest_minimax",
           "vae_from_state_dict"]

NARROW = {"ch": 32, "tile_size": 64, "tile_overlap_min": 16, "num_layers": 2, "heads": 2, "dim_head": 32}
"""The narrow twin's constructor arguments (``num_layers``: what the released file holds 36 of)."""
QUANT_LINEARS = ("attn.to_qkv", "attn.to_out", "ff.w1", "ff.w2")
"""The transformer blocks' linears the branch's ``operations`` builds (``mixed_precision_ops`` when quantized)."""
CONVROT_GROUP = 64
"""ConvRot's Hadamard group of the narrow twin (256 released; it must divide the inputs: 64 and 256 here)."""


def _extended(host_lia: Any) -> Any:
    import comfy.ops
    import comfy.rmsnorm

    def linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):
        if input_act == "rms_norm":
            x = comfy.rmsnorm.rms_norm(x, act_weight, act_eps)
            input_act = None
        if input_act is None and not isinstance(linear.weight, comfy.ops.QuantizedTensor):
            out = linear(x)
        else:
            out = host_lia(linear, x, input_act)
        return out if residual is None else torch.addcmul(residual, out, residual_scale)

    return linear_input_act


@contextlib.contextmanager
def extended_ops() -> Iterator[None]:
    """The newest ``linear_input_act`` signature on a host whose function lacks it (module docstring)."""
    import comfy.ops

    host = comfy.ops.linear_input_act
    if "residual" in inspect.signature(host).parameters:
        yield
        return
    comfy.ops.linear_input_act = _extended(host)
    try:
        yield
    finally:
        comfy.ops.linear_input_act = host


@contextlib.contextmanager
def newest_minimax() -> Iterator[Any]:
    """``scripts.upstream.newest()`` with :func:`extended_ops`; yields the newest ``comfy.ldm.minimax.vae``."""
    with newest() as mods, extended_ops():
        yield mods["comfy.ldm.minimax.vae"]


@contextlib.contextmanager
def _narrow_decoder(mv: Any, num_layers: int) -> Iterator[None]:
    """The module's ``ViT3DDecoder`` with the file's layer count and the narrow heads while the model is built."""
    dec_cls = mv.ViT3DDecoder

    def dec(*a, **kw):
        return dec_cls(*a, **{"num_layers": num_layers, "heads": NARROW["heads"], "dim_head": NARROW["dim_head"],
                              **kw})

    mv.ViT3DDecoder = dec
    try:
        yield
    finally:
        mv.ViT3DDecoder = dec_cls


def _model_kwargs() -> dict[str, Any]:
    return {k: NARROW[k] for k in ("ch", "tile_size", "tile_overlap_min")}


def _init(model: torch.nn.Module, seed: int) -> None:
    """Every layer its torch initialiser (``comfy.ops`` layers skip theirs), the blocks' residual scales in
    [0.5, 1], the register tokens N(0, 0.02^2), the latent statistics the module's own constants."""
    from scripts.fixtures.weights import _torch_reset

    mv = inspect.getmodule(type(model))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, module in model.named_modules():
            own = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
            if not own or _torch_reset(module):
                continue
            kind = type(module).__name__
            if kind == "TransformerBlock":
                module.scale1.copy_(torch.rand_like(module.scale1) * 0.5 + 0.5)
                module.scale2.copy_(torch.rand_like(module.scale2) * 0.5 + 0.5)
            elif kind == "ViT3DDecoder":
                module.register_tokens.normal_(0.0, 0.02)
                module.mask_token.zero_()
            elif kind == "MiniMaxH3VideoVAE":
                module.latents_mean.copy_(torch.tensor(mv.LATENTS_MEAN))
                module.latents_std.copy_(torch.tensor(mv.LATENTS_STD))
            elif kind in ("RotaryEmbeddingND", "Attention"):
                continue  # non-persistent buffers the constructor computed
            else:
                raise TypeError(f"don't know how to initialise {name or '<root>'} ({type(module).__qualname__})")


def _quantize(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The decoder's transformer linears as int8 + ConvRot entries (weight, ``weight_scale``, ``comfy_quant``)."""
    from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout

    out = {}
    conf = json.dumps({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": CONVROT_GROUP})
    for k, v in sd.items():
        layer = k.removesuffix(".weight")
        if k.startswith("decoder.transformer_blocks.") and layer.endswith(QUANT_LINEARS) and k.endswith(".weight"):
            q, params = TensorWiseINT8Layout.quantize(v, is_weight=True, per_channel=True, convrot=True,
                                                      convrot_groupsize=CONVROT_GROUP)
            out[k] = q
            out[f"{layer}.weight_scale"] = params.scale.float()
            out[f"{layer}.comfy_quant"] = torch.tensor(list(conf.encode()), dtype=torch.uint8)
        else:
            out[k] = v
    return out


def minimax_state_dict(seed: int = 0, quantized: bool = False) -> dict[str, torch.Tensor]:
    """Random weights of the narrow MiniMax H3 video VAE, keyed as the released file (the newest ``vae.py``'s
    classes; call inside :func:`newest_minimax`). ``quantized``: its transformer linears int8 + ConvRot."""
    import comfy.ldm.minimax.vae as mv

    with _narrow_decoder(mv, NARROW["num_layers"]):
        model = mv.MiniMaxH3VideoVAE(**_model_kwargs())
    _init(model, seed)
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    return _quantize(sd) if quantized else sd


def _branch(vae: Any, sd: dict[str, torch.Tensor], dtype: torch.dtype | None) -> None:
    """sd.py lines 1029-1063 (``decoder.transformer_blocks.0.scale1`` and ``encoder.down.5.block.0.conv1.weight``):
    ``vae``'s model and attributes as the branch sets them (narrow: :data:`NARROW`)."""
    import comfy.ldm.minimax.vae as mv
    import comfy.model_management as mm
    import comfy.ops
    import comfy.utils

    if not ("decoder.transformer_blocks.0.scale1" in sd and "encoder.down.5.block.0.conv1.weight" in sd):
        raise ValueError("not a MiniMax H3 video VAE file")
    minimax_ops = comfy.ops.disable_weight_init
    minimax_quant = comfy.utils.detect_layer_quantization(sd, "")
    if minimax_quant is not None:  # int8+convrot quantized decoder
        minimax_ops = comfy.ops.mixed_precision_ops(minimax_quant, dtype if dtype is not None else torch.float16)
    minimax_layers = sum(k.startswith("decoder.transformer_blocks.") and k.endswith(".scale1") for k in sd)
    with _narrow_decoder(mv, minimax_layers):  # num_layers: the stored vae.py's decoder takes it, its VAE not yet
        vae.first_stage_model = mv.MiniMaxH3VideoVAE(operations=minimax_ops, **_model_kwargs())
    vae.latent_channels = 24
    vae.latent_dim = 3
    vae.upscale_ratio = (lambda a: max(1, (a - 2) // 5 * 17 + 5), 16, 16)
    vae.upscale_index_formula = (4, 16, 16)
    vae.downscale_ratio = (lambda a: max(1, (a - 5) // 17 * 5 + 2) if a > 1 else 1, 16, 16)
    vae.downscale_index_formula = (4, 16, 16)
    vae.working_dtypes = [torch.float16, torch.float32]
    vae.handles_tiling = True
    vae.process_output = lambda image: image
    fsm = vae.first_stage_model
    chunk_frames = (fsm.tokens_chunk_size + fsm.token_overlap) * fsm.vae_ratio_t

    def estimate_encode_memory(frames, height, width, dtype):
        fixed = 110_000_000 if frames == 1 else 1_300_000_000
        elements_per_pixel = 7 if frames == 1 else 9.5
        frames = min(frames, fsm.clip_length)
        return (elements_per_pixel * frames * height * width + fixed) * mm.dtype_size(dtype) * 1.03

    def estimate_decode_memory(frames, height, width, dtype):
        fixed = 110_000_000 if frames <= 22 else 270_000_000
        frames = min(frames, chunk_frames + 2)
        return (9.5 * frames * height * width + fixed) * mm.dtype_size(dtype) * 1.03

    vae.memory_used_encode = lambda shape, dtype: estimate_encode_memory(shape[2], shape[3], shape[4], dtype)
    vae.memory_used_decode = lambda shape, dtype: estimate_decode_memory(
        vae.upscale_ratio[0](shape[2]), shape[3] * vae.upscale_ratio[1], shape[4] * vae.upscale_ratio[2], dtype)


def vae_from_state_dict(sd: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> Any:
    """A ``comfy.sd.VAE`` as the newest sd.py builds it from ``sd`` (:func:`_branch`), then the end of its
    ``__init__`` (eval, device and dtype, ``CoreModelPatcher``, the state dict loaded; 0.33.0's patcher takes no
    ``fast_disk``). Inside :func:`newest_minimax`."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.sd

    with quiet():
        vae = comfy.sd.VAE(sd={})  # every default attribute of VAE.__init__; no model
    _branch(vae, dict(sd), None)
    vae.first_stage_model = vae.first_stage_model.eval()
    vae.device = mm.vae_device()
    offload_device = mm.vae_offload_device()
    vae.vae_dtype = dtype
    vae.first_stage_model.to(dtype)
    if hasattr(mm, "archive_model_dtypes"):
        mm.archive_model_dtypes(vae.first_stage_model)
    vae.output_device = mm.intermediate_device()
    mp = comfy.model_patcher.ModelPatcher if vae.disable_offload else comfy.model_patcher.CoreModelPatcher
    vae.patcher = mp(vae.first_stage_model, load_device=vae.device, offload_device=offload_device)
    missing, unexpected = vae.first_stage_model.load_state_dict(dict(sd), strict=False,
                                                                assign=vae.patcher.is_dynamic())
    if missing or unexpected:
        raise ValueError(f"state dict does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if not vae.patcher.is_dynamic():
        vae.first_stage_model.to(dtype)
    vae.model_size()
    return vae


def minimax_vae(seed: int = 0, dtype: torch.dtype = torch.float32, quantized: bool = False) -> Any:
    """The narrow MiniMax H3 video VAE on the newest ``vae.py`` (inside :func:`newest_minimax`)."""
    return vae_from_state_dict(minimax_state_dict(seed, quantized), dtype)

