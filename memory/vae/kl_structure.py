"""Which GroupNorm KL decoders and encoders the exact walker runs: the structure check, and the variations
it knows.

Each check says why a model's decoder (:func:`_structure_reason`) or encoder (:func:`_encoder_reason`) is not
one the walker runs, or None; the predicates name the variations that the walk (:mod:`.kl_layout`) then
follows: the SD KL and Hunyuan Image 2.1 stage orders, pixel-shuffle up- and downsampling and the latent's
channel-repeat shortcut, Hunyuan Image 2.1's 3-D refiner (:func:`whole_clip_3d`) and SVD's time mixing
(:func:`time_mixing`). Structure only, no geometry. Duck-typed: no ComfyUI import.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = [
    "RESNET_PARTS",
    "conv_dims",
    "find_decoder",
    "hunyuan_image",
    "in_shortcut_repeats",
    "stage_order",
    "time_mixing",
    "time_scale",
    "whole_clip_3d",
]


def find_decoder(model: Any) -> Any:
    """The ``Decoder`` of ``first_stage_model`` (``model.decoder``) or ``model`` itself if it is one."""
    dec = getattr(model, "decoder", None)
    return dec if dec is not None else model


def _is_conv(m: Any, kernel: int | None = None, dims: int = 2) -> bool:
    """A ``dims``-D convolution with a cubic ``kernel`` (any odd size when None), stride 1, no dilation or groups,
    zero padding of half the kernel on every side (3-D: in time too, the whole clip in one tile)."""
    if not isinstance(m, torch.nn.Conv3d if dims == 3 else torch.nn.Conv2d):
        return False
    ks = tuple(m.kernel_size)
    k = ks[0]
    if len(set(ks)) != 1 or (kernel is not None and k != kernel):
        return False
    return (
        tuple(m.stride) == (1,) * dims
        and tuple(m.dilation) == (1,) * dims
        and m.groups == 1
        and m.padding_mode == "zeros"
        and tuple(m.padding) == (k // 2,) * dims
    )


def _is_conv2d(m: Any, kernel: int | None = None) -> bool:
    return _is_conv(m, kernel, 2)


def conv_dims(dec: Any) -> int:
    """3 for a decoder of 3-D convolutions (Hunyuan Image 2.1's refiner), else 2."""
    return 3 if isinstance(getattr(dec, "conv_in", None), torch.nn.Conv3d) else 2


def whole_clip_3d(dec: Any) -> bool:
    """The one 3-D decoder the walker runs: ``comfy.ldm.hunyuan_video.vae_refiner.Decoder`` with ``refiner_vae``
    False (Hunyuan Image 2.1's refiner VAE: zero-padded 3-D convolutions and GroupNorm over the whole clip, the
    up path in one chunk, and only the last decoded frame kept for a one-frame latent)."""
    return conv_dims(dec) == 3 and getattr(dec, "refiner_vae", None) is False and hunyuan_image(dec)


def _is_gn(m: Any) -> bool:
    return isinstance(m, torch.nn.GroupNorm)


RESNET_PARTS = frozenset(
    ("swish", "nonlinearity", "norm1", "conv1", "temb_proj", "norm2", "dropout", "conv2", "conv_shortcut",
     "nin_shortcut"))
"""The submodules of a KL resnet block the walker runs (or knows to be inert: the activation, dropout, an unused
timestep projection). Anything else is code of the block's forward the walker would skip."""


def _required_inputs(m: Any) -> list[str]:
    """The arguments ``m.forward`` requires besides its input (SVD's ``VideoResBlock``: ``temb``)."""
    try:
        params = list(inspect.signature(m.forward).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.default is inspect.Parameter.empty and p.kind in kinds]


def _foreign_parts(blk: Any) -> list[str]:
    """What a resnet block holds beyond :data:`RESNET_PARTS`: other submodules (SVD's ``time_stack``) and
    parameters or buffers of its own (SVD's ``mix_factor``)."""
    extra = [n for n, _ in blk.named_children() if n not in RESNET_PARTS]
    extra += [n for n, _ in [*blk.named_parameters(recurse=False), *blk.named_buffers(recurse=False)]]
    return extra


def _class_name(m: Any) -> str:
    """The name of ``m``'s class, past classes made inside a function (ComfyUI's ``partialclass``: ``NewCls``)."""
    for cls in type(m).__mro__:
        if "<locals>" not in cls.__qualname__:
            return cls.__name__
    return type(m).__name__


def _block_call_reason(blk: Any, where: str) -> str | None:
    """Why the walker cannot call or re-run ``blk`` as a plain resnet block: its forward needs more than its
    input, or it holds modules the walker would not run (a video decoder's time mixing)."""
    needs = _required_inputs(blk)
    if needs:
        return (f"{where} ({_class_name(blk)}): its forward needs {', '.join(needs)} besides its input "
                "(a video or timestep-conditioned block)")
    extra = _foreign_parts(blk)
    if extra:
        return (f"{where} ({_class_name(blk)}) holds {', '.join(extra)}, which a plain resnet block does not "
                "(e.g. a video decoder's time mixing)")
    return None


def _is_time_conv(m: Any) -> bool:
    """A 3-D convolution over time only (kernel ``(k, 1, 1)``, zero padding ``(k // 2, 0, 0)``, stride 1)."""
    if not isinstance(m, torch.nn.Conv3d):
        return False
    k = m.kernel_size[0]
    return (k % 2 == 1 and tuple(m.kernel_size[1:]) == (1, 1) and tuple(m.stride) == (1, 1, 1)
            and tuple(m.dilation) == (1, 1, 1) and m.groups == 1 and m.padding_mode == "zeros"
            and tuple(m.padding) == (k // 2, 0, 0))


def time_mixing(dec: Any) -> bool:
    """The decoder mixes the items of its batch as one video's frames (SVD's ``temporal_ae.VideoDecoder``: its
    mid block's resnet blocks hold a ``time_stack``)."""
    mid = getattr(dec, "mid", None)
    return getattr(getattr(mid, "block_1", None), "time_stack", None) is not None


def _video_block_reason(blk: Any, where: str) -> str | None:
    """Why ``blk`` is not SVD's ``VideoResBlock`` as the walker runs it: a resnet block over each frame, then
    ``time_stack`` (a 3-D ``ResBlock``: GroupNorm over all frames, SiLU, a time-only convolution, twice, identity
    skip) blended with its input by ``get_alpha()``."""
    if _class_name(blk) != "VideoResBlock" or not callable(getattr(blk, "get_alpha", None)):
        return (f"{where} ({_class_name(blk)}): a decoder with a time_stack (time mixing), but this block is not "
                "SVD's VideoResBlock, the one the walker runs")
    ts = getattr(blk, "time_stack", None)
    ins, outs = getattr(ts, "in_layers", ()), getattr(ts, "out_layers", ())
    if not (len(ins) == 3 and len(outs) == 4 and _is_gn(ins[0]) and _is_gn(outs[0])
            and isinstance(ins[1], torch.nn.SiLU) and isinstance(outs[1], torch.nn.SiLU)
            and isinstance(outs[2], torch.nn.Dropout) and _is_time_conv(ins[2]) and _is_time_conv(outs[3])):
        return f"{where}.time_stack is not GroupNorm, SiLU, a time-only Conv3d (twice)"
    if not isinstance(getattr(ts, "skip_connection", None), torch.nn.Identity) or getattr(ts, "updown", True) \
            or not getattr(ts, "skip_t_emb", False) or getattr(ts, "use_scale_shift_norm", True):
        return f"{where}.time_stack has a skip convolution, resampling or a timestep embedding"
    extra = [n for n in _foreign_parts(blk) if n not in ("time_stack", "mix_factor")]
    if extra:
        return f"{where} ({_class_name(blk)}) holds {', '.join(extra)} besides its time mixing"
    return None


def _resnet_reason(blk: Any, where: str, dims: int = 2, video: bool = False) -> str | None:
    for name in ("norm1", "conv1", "norm2", "conv2"):
        if getattr(blk, name, None) is None:
            return f"{where}: no {name}"
    reason = _video_block_reason(blk, where) if video else _block_call_reason(blk, where)
    if reason:
        return reason
    if not (_is_gn(blk.norm1) and _is_gn(blk.norm2)):
        return f"{where}: norm1/norm2 are not GroupNorm"
    if not (_is_conv(blk.conv1, 3, dims) and _is_conv(blk.conv2, 3, dims)):
        return f"{where}: conv1/conv2 are not 3x3 stride-1 Conv{dims}d"
    if getattr(blk, "temb_proj", None) is not None:
        return f"{where}: has a timestep projection"
    cin = blk.conv1.in_channels
    cout = blk.conv2.out_channels
    if cin != cout:
        sc = getattr(blk, "nin_shortcut", None)
        if getattr(blk, "use_conv_shortcut", False):
            sc = getattr(blk, "conv_shortcut", None)
            if not _is_conv(sc, 3, dims):
                return f"{where}: conv_shortcut is not a 3x3 Conv{dims}d"
        elif not _is_conv(sc, 1, dims):
            return f"{where}: nin_shortcut is not a 1x1 Conv{dims}d"
    return None


def _level_reason(level: Any, where: str, path: str, dims: int = 2, video: bool = False) -> str | None:
    """Why one level of the up (down) path is not resnet blocks without attention, or None."""
    blocks = getattr(level, "block", None)
    if blocks is None or len(blocks) == 0:
        return f"{where} has no blocks"
    if len(getattr(level, "attn", ())) > 0:
        return f"{where} has attention in the {path}"
    for j in range(len(blocks)):
        reason = _resnet_reason(blocks[j], f"{where}.block[{j}]", dims, video)
        if reason:
            return reason
    return None


def _is_pixel_shuffle_up(m: Any, dims: int = 2) -> bool:
    """Hunyuan Image 2.1's upsample (``comfy.ldm.hunyuan_video.vae.PixelUnshuffle2D``): a 3x3 conv to 4x the
    output channels at the low resolution, then depth-to-space 2x, plus the channel-repeated input. 3-D: its
    refiner's (``vae_refiner.UpSmpl`` with ``refiner_vae`` False), the same in space and, where ``tus``, 2x in time
    (:func:`time_scale`)."""
    if dims == 3:
        return type(m).__name__ == "UpSmpl" and _is_conv(getattr(m, "conv", None), 3, 3) \
            and isinstance(getattr(m, "tus", None), bool) and getattr(m, "refiner_vae", None) is False
    return type(m).__name__ == "PixelUnshuffle2D" and _is_conv2d(getattr(m, "conv", None), 3) \
        and isinstance(getattr(m, "scale", None), int)


def time_scale(upsample: Any) -> int:
    """Output frames per input frame of an upsample (2 for the refiner's temporal ``UpSmpl``, else 1)."""
    return 2 if getattr(upsample, "tus", False) is True else 1


def hunyuan_image(dec: Any) -> bool:
    """Hunyuan Image 2.1's decoder (``block_out_channels``, no ``num_resolutions``), not the SD KL one."""
    return getattr(dec, "num_resolutions", None) is None and \
        getattr(dec, "block_out_channels", None) is not None


def stage_order(dec: Any) -> list[tuple[int, bool]]:
    """``(level, upsample after its blocks)`` in the decoder's forward order: the SD KL ``Decoder`` runs
    ``up`` from the deepest level, upsampling after every level but 0; Hunyuan Image 2.1's runs ``up`` in list
    order, upsampling where a level has one."""
    n = len(dec.up)
    if hunyuan_image(dec):
        return [(i, getattr(dec.up[i], "upsample", None) is not None) for i in range(n)]
    return [(i, i > 0) for i in reversed(range(n))]


def in_shortcut_repeats(dec: Any) -> int:
    """Channel repeats of the latent added to ``conv_in``'s output (Hunyuan Image 2.1's decoder); 0: none."""
    if not hunyuan_image(dec):
        return 0
    return int(dec.block_out_channels[0]) // int(dec.z_channels)


def _structure_reason(model: Any) -> str | None:
    bn = getattr(model, "bn", None)
    if bn is not None and not isinstance(bn, torch.nn.BatchNorm2d):
        return "latent batch-norm of an unknown kind"
    dec = find_decoder(model)
    if dec is None:
        return "no decoder"
    for name in ("conv_in", "mid", "up", "norm_out", "conv_out"):
        if getattr(dec, name, None) is None:
            return f"decoder has no {name}"
    dims = conv_dims(dec)
    if dims == 3 and not whole_clip_3d(dec):
        return ("conv_in/conv_out are not 3x3 Conv2d (a 3-D or video decoder other than Hunyuan Image 2.1's "
                "refiner, vae_refiner with refiner_vae False: the one 3-D decoder the walker runs)")
    if not (_is_conv(dec.conv_in, 3, dims) and _is_conv(dec.conv_out, 3, dims)):
        return f"conv_in/conv_out are not 3x3 Conv{dims}d (3-D or video decoder)"
    video = time_mixing(dec)
    for name in ("conv_in", "conv_out"):
        inner = [n for n, _ in getattr(dec, name).named_children()]
        if video and name == "conv_out" and inner == ["time_mix_conv"] and _is_time_conv(dec.conv_out.time_mix_conv):
            continue  # SVD's AE3DConv: the 2-D conv per frame, then a time-only conv over the frames
        if inner:
            return (f"{name} ({_class_name(getattr(dec, name))}) holds {', '.join(inner)} besides its "
                    "convolution (e.g. a video decoder's time mixing)")
    if not _is_gn(dec.norm_out):
        return "norm_out is not GroupNorm"
    mid = dec.mid
    for name in ("block_1", "attn_1", "block_2"):
        if getattr(mid, name, None) is None:
            return f"mid has no {name}"
    if not callable(mid.block_1) or not callable(mid.attn_1) or not callable(mid.block_2):
        return "mid blocks are not callable"
    for name in ("block_1", "block_2"):
        blk = getattr(mid, name)
        reason = _video_block_reason(blk, f"mid.{name}") if video else _block_call_reason(blk, f"mid.{name}")
        if reason:
            return reason
    if any(n.endswith("time_mix_block") for n, _ in mid.attn_1.named_modules()):
        return "mid.attn_1 mixes time (a video attention block): not built"
    up = dec.up
    try:
        levels = len(up)
    except TypeError:
        return "decoder.up is not a list"
    if levels == 0:
        return "decoder.up is empty"
    repeats = in_shortcut_repeats(dec)
    if repeats and int(dec.conv_in.out_channels) != repeats * int(dec.z_channels):
        return "conv_in's latent shortcut does not match its channels"
    for i, has_upsample in stage_order(dec):
        level = up[i]
        reason = _level_reason(level, f"up[{i}]", "up path", dims, video)
        if reason:
            return reason
        if has_upsample:
            upsample = getattr(level, "upsample", None)
            if upsample is None:
                return f"up[{i}] has no upsample"
            if _is_pixel_shuffle_up(upsample, dims):
                continue
            if dims == 3:
                return f"up[{i}].upsample is not the refiner's 3x3x3 conv + depth-to-space (UpSmpl)"
            sf = getattr(upsample, "scale_factor", None)
            if isinstance(sf, (tuple, list)):
                if len(sf) != 2 or any(float(s) != 2.0 for s in sf):
                    return f"up[{i}].upsample scale {sf} is not 2x2"
            elif sf is None or float(sf) != 2.0:
                return f"up[{i}].upsample scale {sf} is not 2"
            if getattr(upsample, "with_conv", False) and not _is_conv2d(getattr(upsample, "conv", None), 3):
                return f"up[{i}].upsample.conv is not a 3x3 Conv2d"
    if not all(isinstance(getattr(dec, a, False), bool) for a in ("give_pre_end", "tanh_out")):
        return "give_pre_end/tanh_out are not booleans"
    return None


def _is_down_conv(m: Any) -> bool:
    """The encoder's downsampling conv: 3x3, stride 2, unpadded (its module pads (0, 1, 0, 1) itself)."""
    return (isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) == (3, 3) and tuple(m.stride) == (2, 2)
            and tuple(m.padding) == (0, 0) and tuple(m.dilation) == (1, 1) and m.groups == 1)


def _is_pixel_shuffle_down(m: Any) -> bool:
    """Hunyuan Image 2.1's downsample (``comfy.ldm.hunyuan_video.vae.PixelShuffle2D``): a 3x3 conv to a quarter of
    the output channels at the high resolution, then space-to-depth 2x, plus the input's space-to-depth averaged
    over channel groups."""
    return type(m).__name__ == "PixelShuffle2D" and _is_conv2d(getattr(m, "conv", None), 3) \
        and isinstance(getattr(m, "ratio", None), int)


def _downsamples(enc: Any) -> list[bool]:
    """Per level of the down path: a downsample after its blocks (SD KL: every level but the last; Hunyuan Image
    2.1: the levels that have one)."""
    n = len(enc.down)
    if hunyuan_image(enc):
        return [getattr(enc.down[i], "downsample", None) is not None for i in range(n)]
    return [i != n - 1 for i in range(n)]


def _encoder_reason(model: Any) -> str | None:
    """Why the exact executor cannot encode with ``model`` (a ``first_stage_model``), or None."""
    bn = getattr(model, "bn", None)
    if bn is not None and not isinstance(bn, torch.nn.BatchNorm2d):
        return "latent batch-norm of an unknown kind"
    enc = getattr(model, "encoder", None)
    if enc is None or not callable(getattr(model, "encode", None)):
        return "no encoder"
    hunyuan = hunyuan_image(enc)
    if getattr(enc, "num_resolutions", None) is None and not hunyuan:
        return "not the SD/FLUX KL or Hunyuan Image 2.1 Encoder (no num_resolutions, no block_out_channels)"
    for name in ("conv_in", "down", "mid", "norm_out", "conv_out"):
        if getattr(enc, name, None) is None:
            return f"encoder has no {name}"
    if not (_is_conv2d(enc.conv_in, 3) and _is_conv2d(enc.conv_out, 3)):
        return "conv_in/conv_out are not 3x3 Conv2d (3-D or video encoder)"
    if not _is_gn(enc.norm_out):
        return "norm_out is not GroupNorm"
    if any(getattr(enc.mid, name, None) is None for name in ("block_1", "attn_1", "block_2")):
        return "mid has no block_1/attn_1/block_2"
    if getattr(getattr(model, "regularization", None), "sample", False):
        return "the regularizer samples the posterior (a random latent per call)"
    if hunyuan and not isinstance(getattr(enc, "z_channels", None), int):
        return "Hunyuan Image 2.1 encoder without z_channels (its output's channel-mean shortcut)"
    for i, has_down in enumerate(_downsamples(enc)):
        level = enc.down[i]
        reason = _level_reason(level, f"down[{i}]", "down path")
        if reason:
            return reason
        if has_down:
            down = getattr(level, "downsample", None)
            if hunyuan:
                if not _is_pixel_shuffle_down(down):
                    return f"down[{i}].downsample is not Hunyuan Image 2.1's 3x3 conv + space-to-depth"
                continue
            conv = getattr(down, "conv", None)
            if down is None or not getattr(down, "with_conv", False) or not _is_down_conv(conv):
                return f"down[{i}].downsample is not a padded 3x3 stride-2 Conv2d"
    return None
