"""Causal video decoders without a host cache, described once per family, for the carried-context executor.

A causal decoder whose only temporal dependencies are its causal convolutions (each reads ``kt - 1`` past
frames, padded at the clip's start) and whose other operations are per frame decodes exactly in temporal
chunks when each causal convolution is given, instead of its start padding, the last ``kt - 1`` input frames
it saw in the previous chunk (:mod:`..executors.carry`). Operations that treat the clip's first frames
specially (Mochi drops the first ``st - 1`` frames after each temporal depth-to-space) do so in the first
chunk only. A :class:`Description` names those modules; the first-use self-check proves the result equal to
the host's decode. Duck-typed: no ComfyUI import.

A decoder whose global operations all sit at the latent's resolution before that causal part (HunyuanVideo
1.5: attention over the whole clip in its mid block) names them as a *prefix*, run once on the whole latent;
its chunks are then the causal suffix on the prefix's output. A decoder that carries its own context between
calls (HunyuanVideo 1.5's ``conv_carry_in``/``conv_carry_out`` lists) describes its suffix with that carry.

* Mochi (``comfy.ldm.genmo.vae.model``): ``PConv3d`` (causal, replicate padding), ``DepthToSpaceTime``; its
  decoder has per-frame GroupNorm (``GroupNormSpatial``) and no attention. Its temporal reach is 46 latent
  frames (docs/VIDEO_DECODE.md): without carried context a chunk would need the whole clip before it.
* HunyuanVideo 1.5 (``comfy.ldm.hunyuan_video.vae_refiner``, ``refiner_vae``): prefix ``conv_in`` + the mid
  block (attention over every latent voxel of the clip); suffix: the up path, RMS norms over channels and causal
  3x3x3 convolutions that carry their last 2 input frames (the host's own carry lists), in chunks of at least 2
  latent frames (the host decodes chunks of 2; a 1-frame chunk would carry 1 frame and pad differently).
* LTX-Video (``comfy.ldm.lightricks.vae.causal_video_autoencoder``, 0.9.0, 0.9.1 and 0.9.5+): its decoder is
  local in space (pixel norms, 0.9.0's LayerNorms over channels, convolutions, depth-to-space) but symmetric in
  time with a reach of ~20 latent frames each side, so it is not chunked in time (``temporal`` False): each
  spatial tile decodes the whole clip. A timestep-conditioned ``decode`` (0.9.1, 0.9.5+) mixes fresh noise
  (``randn_like``, unseeded) into the latent first: the prefix draws it once on the whole latent, as the host
  does (one clip per call: the host's timestep embedding has batch 1, so a batch decodes only clip by clip).
  0.9.1's blocks then add a fresh ``randn(H, W)`` field per call (``_feed_spatial_noise``), at the shape of what
  they decode, which on 0.33 is each of ``run_up``'s temporal chunks, sized by bytes: :func:`_ltx_draws` records
  the host's calls for the whole clip on fake tensors, draws their fields in the host's order, and every tile adds
  its crop of them (:class:`Draws`). The result equals the host's decode for the same random state.
* CogVideoX (``comfy.ldm.cogvideo.vae``, ComfyUI 0.33+): the host's decode is itself rolling: ``conv_in``, the mid
  block and the temporal up blocks on the whole latent (GroupNorm over the clip: the prefix), then the spatial up
  blocks in chunks of 4 frames with causal caches (GroupNorm per chunk): our chunks are whole numbers of its
  chunks, its caches carried between them. Whole frames only (the per-chunk GroupNorm spans the frame).
* Cosmos (``comfy.ldm.cosmos.vae.CausalContinuousVideoTokenizer``, both hosts): the latent's un-normalising uses
  each latent frame's index (statistics with a period of 16 frames) and ``post_quant_conv`` is 1x1x1: the prefix,
  through the host's own ``decode`` with its decoder swapped out. The decoder is causal: ``CausalConv3d`` pads
  each clip with copies of its first frame (carried: the last ``time_pad`` input frames), GroupNorm with one
  group per frame, attention per frame, a *temporal* attention that is causal over every earlier frame (carried:
  the keys and values of every earlier frame of the clip), a temporal upsample that doubles the frames and drops
  the clip's first (first chunk only; the host skips it for a 1-frame clip, which gives the same frame), and a
  Haar unpatcher local in time that drops the clip's first ``patch_size - 1`` frames (first chunk only). Whole
  frames only (per-frame GroupNorm and attention span the frame).

Decoders the overlap-blend cannot serve (:func:`blend_refusal`) take the host's own decode: LTX 2.4's diffusion
decoder (``na_diffusion_decoder.CausalDiffusionVAE``) draws its noise from a generator seeded on every call on the
whole output, so each blended chunk would get other noise (measured 10 dB, issue 36).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ..measure.sizing import MetaSizer
from ..measure.tracker import uncounted
from .describe import first_fit
from .split_layout import is_global
from .swap import swapped

__all__ = ["CarryLayout", "Description", "DESCRIPTIONS", "blend_refusal", "carry_layout"]

Forward = Callable[[Any, torch.Tensor, dict], torch.Tensor]
"""``forward(module, x, state)``: a module's forward in a chunk; ``state`` holds its carried context (the key
``"first"`` is True in the first chunk)."""
Chunk = Callable[[Any, torch.Tensor, dict], torch.Tensor]
"""``chunk(model, x, states)``: one chunk's frames from its latent frames (or the prefix's output for them);
``states`` is the executor's carried state (``states["first"]``: the clip's first chunk)."""


def _host_decode(model: Any, z: torch.Tensor, states: dict) -> torch.Tensor:
    """A chunk through the host's own ``decode`` (the described modules' forwards are swapped meanwhile)."""
    return model.decode(z)


@dataclasses.dataclass(frozen=True)
class Description:
    """A causal family: which decoders it matches and the forwards of its modules that cross chunk borders."""

    name: str
    reason: Callable[[Any], str | None]
    """Why ``first_stage_model`` is not of this family (None: it is)."""
    forwards: Callable[[Any], dict[Any, Forward]] = lambda model: {}
    """Module -> its chunk forward, for every module that reads past frames or treats the clip's start (none:
    a family whose ``chunk`` carries its context itself)."""
    chunk: Chunk = _host_decode
    """One chunk: by default the host's ``decode`` of its latent frames."""
    prefix: Callable[[Any, torch.Tensor], Any] | None = None
    """The global part, run once per video on the whole latent (None: none); its output is a tensor or a tuple of
    tensors with one time axis (dim 2), which the chunks slice."""
    min_k: int = 1
    """Fewest units (:attr:`unit`) a chunk may have (the last excepted)."""
    step: int = 1
    """Chunks hold a multiple of ``step`` units (the last excepted): the host's own chunk grid."""
    unit: str = "latent frames"
    """What the chunks count: the time axis of the prefix's output (latent frames where it keeps the latent's)."""
    check_t: int = 0
    """Latent frames of the self-check's latent (0: enough for three chunks of ``min_k`` latent frames)."""
    first_alone: bool = True
    """The first chunk is latent frame 0 alone (else it has ``k`` frames like the others)."""
    temporal: bool = True
    """Chunks in time (False: one chunk of the whole clip per tile; the decoder is not causal)."""
    tiles: bool = False
    """The chunks are spatially local (no norm or attention over space after the prefix): spatial tiles with
    a halo of their traced reach are exact too."""
    how: str = "each causal convolution reads the previous chunk's last frames"
    """What carries the context, for the report."""
    draws: Callable[[Any, torch.Tensor], Draws | None] | None = None
    """The host's random draws inside the chunked part, made once per video (batch item) on the prefix's output,
    before any chunk, and replayed by the chunks (``states["draws"]``; ``states["at"]``: the tile's origin in px of
    the chunks' input). Only for whole-clip chunks (``temporal`` False)."""

    def fit(self, k: int) -> int:
        """``k`` units rounded down to the chunk grid: a multiple of :attr:`step`, at least :attr:`min_k`."""
        return max(self.min_k, int(k) // self.step * self.step)


def _mochi_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if dec is None or not type(dec).__module__.endswith("genmo.vae.model"):
        return "not a Mochi decoder (comfy.ldm.genmo)"
    for m in dec.modules():
        name = type(m).__name__
        if "Attention" in name:
            return "its decoder has attention blocks (frames would not be independent)"
        if name == "PConv3d" and not (getattr(m, "causal", False) and m.padding_mode == "replicate"
                                       and tuple(m.stride)[0] == 1 and m.padding[0] == 0):
            return "a PConv3d that is not causal, stride-1 and replicate-padded in time"
    return None


def _pconv_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``PConv3d.forward`` with the previous chunk's last ``kt - 1`` input frames instead of the start
    padding."""
    ctx = int(m.kernel_size[0]) - 1
    prev = state.get("prev")
    if ctx == 0:
        xp = x
    elif prev is None:
        xp = F.pad(x, (0, 0, 0, 0, ctx, 0), mode="replicate")
    else:
        xp = torch.cat([prev, x], dim=2)
    state["prev"] = xp[:, :, xp.shape[2] - ctx :].clone() if ctx else None
    return type(m).__mro__[1].forward(m, xp)  # the host's Conv3d (its weight casting), without the padding


def _d2st_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``DepthToSpaceTime.forward``; the first ``st - 1`` frames are dropped in the first chunk only."""
    st, s = int(m.temporal_expansion), int(m.spatial_expansion)
    b, c, t, h, w = x.shape
    y = x.reshape(b, c // (st * s * s), st, s, s, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    y = y.reshape(b, c // (st * s * s), t * st, h * s, w * s)
    return y[:, :, st - 1 :] if st > 1 and state.get("first", True) else y


def _mochi_forwards(model: Any) -> dict[Any, Forward]:
    out: dict[Any, Forward] = {}
    for m in model.decoder.modules():
        name = type(m).__name__
        if name == "PConv3d":
            out[m] = _pconv_forward
        elif name == "DepthToSpaceTime":
            out[m] = _d2st_forward
    return out


def _hv15_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if dec is None or not type(dec).__module__.endswith("hunyuan_video.vae_refiner"):
        return "not a HunyuanVideo 1.5 decoder (comfy.ldm.hunyuan_video.vae_refiner)"
    if not getattr(dec, "refiner_vae", False):
        return "a vae_refiner decoder without causal carries (refiner_vae False: GroupNorm over the whole clip)"
    if not callable(_causal(dec)):
        return "its module has no conv_carry_causal_3d"
    for name in ("conv_in", "mid", "up", "norm_out", "conv_out"):
        if getattr(dec, name, None) is None:
            return f"its decoder has no {name}"
    for m in list(dec.up.modules()) + [dec.norm_out]:
        if is_global(m):
            return f"its up path has a global {type(m).__name__}"
    return None


def _causal(dec: Any) -> Any:
    """The host's ``conv_carry_causal_3d`` (the decoder's module has it: 0.3.75 defines it there, 0.33 imports it)."""
    return getattr(sys.modules.get(type(dec).__module__), "conv_carry_causal_3d", None)


def _hv15_prefix(model: Any, z: torch.Tensor) -> torch.Tensor:
    """``Decoder.forward`` up to its chunk loop: ``conv_in`` plus the latent's channel repeat, the mid block."""
    dec = model.decoder
    causal = _causal(dec)
    x = causal([z], dec.conv_in) + z.repeat_interleave(dec.block_out_channels[0] // dec.z_channels, 1)
    return dec.mid.block_2(dec.mid.attn_1(dec.mid.block_1(x)))


def _hv15_chunk(model: Any, x: torch.Tensor, states: dict) -> torch.Tensor:
    """One iteration of ``Decoder.forward``'s chunk loop; ``states["hv15"]``: the previous chunk's carry list,
    replaced by this chunk's (copied when the executor keeps it for a rollback: the host pops from it)."""
    dec = model.decoder
    causal = _causal(dec)
    prev = None if states["first"] else states["hv15"]
    cin, cout = (None if prev is None else list(prev) if states.get("rollback", True) else prev), []
    for stage in dec.up:
        for blk in stage.block:
            x = blk(x, conv_carry_in=cin, conv_carry_out=cout)
        if hasattr(stage, "upsample"):
            x = stage.upsample(x, cin, cout)
    x = causal([F.silu(dec.norm_out(x))], dec.conv_out, cin, cout)
    states["hv15"] = cout
    return x


def _ltx_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if type(model).__name__ != "VideoVAE" or not type(model).__module__.endswith("causal_video_autoencoder"):
        return "not an LTX-Video VAE (comfy.ldm.lightricks.vae.causal_video_autoencoder)"
    if dec is None or getattr(model, "per_channel_statistics", None) is None:
        return "its VAE has no decoder or per-channel statistics"
    for m in dec.modules():
        if getattr(m, "inject_noise", False) and not callable(getattr(m, "_feed_spatial_noise", None)):
            return "its decoder injects noise in its blocks other than by _feed_spatial_noise (not replayable)"
        if is_global(m):
            return f"its decoder has a global {type(m).__name__}"
    return None


def _ltx_defaults(model: Any) -> tuple[float, float]:
    """``(timestep, noise scale)`` of the host's ``decode``: attributes (0.33) or its signature's defaults."""
    import inspect

    params = inspect.signature(model.decode).parameters
    t = getattr(model, "decode_timestep", None)
    s = getattr(model, "decode_noise_scale", None)
    t = params["timestep"].default if t is None else t
    s = params["noise_scale"].default if s is None else s
    return float(t), float(s)


def _ltx_prefix(model: Any, z: torch.Tensor) -> torch.Tensor:
    """``VideoVAE.decode`` up to its decoder: the noise mix (one draw on the whole latent) and un-normalising."""
    if getattr(model, "timestep_conditioning", False):
        s = _ltx_defaults(model)[1]
        z = torch.randn_like(z) * s + (1.0 - s) * z
    return model.per_channel_statistics.un_normalize(z)


def _ltx_decoder(model: Any, x: torch.Tensor) -> torch.Tensor:
    t = _ltx_defaults(model)[0] if getattr(model, "timestep_conditioning", False) else None
    return model.decoder(x, timestep=t)


def _ltx_chunk(model: Any, x: torch.Tensor, states: dict) -> torch.Tensor:
    """The host's decoder on one tile of the whole clip, adding its crop of the host's block noise (0.9.1)."""
    draws = states.get("draws")
    if draws is None:
        return _ltx_decoder(model, x)
    with draws.replayed(states.get("at", (0, 0))):
        return _ltx_decoder(model, x)


def _noisy(model: Any) -> list:
    return [m for m in model.decoder.modules() if getattr(m, "inject_noise", False)]


Feed = Callable[[Any, tuple[int, int], int, int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``feed(block, key, t0, t1, h, scale)``: a block's noise call on frames ``[t0, t1)`` of its slot's stream."""


@contextlib.contextmanager
def _feeding(noisy: list, feed: Feed) -> Iterator[None]:
    """Inside: each block's ``_feed_spatial_noise(h, scale)`` is ``feed(block, (id, slot), t0, t1, h, scale)``;
    ``slot``: the block's first or second noise of a call (it feeds two, in that order); ``[t0, t1)``: the frames
    of that slot's input stream this call holds (counted from the context's start)."""
    calls: dict = {}
    frames: dict = {}
    try:
        for m in noisy:
            def fed(h: torch.Tensor, scale: torch.Tensor, m: Any = m) -> torch.Tensor:
                n = calls[id(m)] = calls.get(id(m), 0) + 1
                key = (id(m), (n - 1) % 2)
                t0 = frames.get(key, 0)
                t1 = frames[key] = t0 + int(h.shape[2])
                return feed(m, key, t0, t1, h, scale)

            m._feed_spatial_noise = fed
        yield
    finally:
        for m in noisy:
            m.__dict__.pop("_feed_spatial_noise", None)


@dataclasses.dataclass(frozen=True)
class Draws:
    """The host's block noise for one video: for each block's noise slot, the frames ``[a, b)`` of its input
    stream each of the host's calls covered and the field it drew, on the whole frame (``hw``: the chunks' input
    px)."""

    noisy: list
    hw: tuple[int, int]
    spans: dict

    @contextlib.contextmanager
    def replayed(self, at: tuple[int, int]) -> Iterator[None]:
        """Inside: the blocks add, instead of a fresh draw, the crop of the host's fields at the tile whose origin
        is ``at`` (px of the chunks' input), frame by frame as the host's calls covered them."""
        def feed(m: Any, key: tuple[int, int], t0: int, t1: int, h: torch.Tensor, scale: torch.Tensor
                 ) -> torch.Tensor:
            rows, cols = (int(v) for v in h.shape[-2:])
            pieces = []
            for a, b, field in self.spans.get(key, ()):
                if min(b, t1) > max(a, t0):
                    s = int(field.shape[-2]) // self.hw[0]
                    crop = field[at[0] * s : at[0] * s + rows, at[1] * s : at[1] * s + cols]
                    if tuple(crop.shape) != (rows, cols):
                        raise RuntimeError(f"noise replay: a {rows}x{cols} tile at {at} leaves the host's "
                                           f"{tuple(field.shape)} field")
                    pieces.append((min(b, t1) - max(a, t0), crop))
            if sum(n for n, _ in pieces) != t1 - t0:
                raise RuntimeError(f"noise replay: frames [{t0}, {t1}) of a {type(m).__name__} were not in the "
                                   "host's calls")
            if len(pieces) == 1:  # one host call: its field broadcast over time, as the host adds it
                return h + (pieces[0][1][None] * scale)[None, :, None, ...]
            if not pieces:
                return h
            frames = torch.cat([crop[None].expand(n, -1, -1) for n, crop in pieces])
            return h + (frames[None] * scale[:, None])[None]

        with _feeding(self.noisy, feed):
            yield


_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Model -> {(shape, dtype, device): the host's noise calls}: they depend on the shapes alone (and, on 0.33, on the
device's total memory, which sets ``run_up``'s chunk size)."""


def _ltx_draws(model: Any, x: torch.Tensor) -> Draws | None:
    """0.9.1's block noise for the whole clip ``x`` (the prefix's output): the host decoder's
    calls recorded on fake tensors (cached per shape), then their fields drawn as the host draws them, in its
    order, from the current random state (fake fields in a sizing run)."""
    noisy = _noisy(model)
    if not noisy:
        return None
    key = (tuple(x.shape), x.dtype, x.device)
    calls = _CALLS.setdefault(model, {}).get(key)
    if calls is None:
        calls = []

        def record(m: Any, k: tuple[int, int], t0: int, t1: int, h: torch.Tensor, scale: torch.Tensor
                   ) -> torch.Tensor:
            calls.append((k, t0, t1, tuple(int(v) for v in h.shape[-2:]), h.dtype, h.device))
            return h

        from torch._subclasses.fake_tensor import FakeTensor

        with contextlib.ExitStack() as stack:
            stack.enter_context(uncounted())  # a sizing run's peak is the decode's, not this recording's
            if not isinstance(x, FakeTensor):  # in a sizing run the model is fake already
                stack.enter_context(MetaSizer([model], x.dtype, x.device))
            stack.enter_context(_feeding(noisy, record))
            _ltx_decoder(model, torch.empty(x.shape, dtype=x.dtype, device=x.device))
        _CALLS[model][key] = calls
    spans: dict = {}
    for k, a, b, hw, dtype, device in calls:
        spans.setdefault(k, []).append((a, b, torch.randn(hw, device=device, dtype=dtype)))
    return Draws(noisy, (int(x.shape[-2]), int(x.shape[-1])), spans)


COG_CHUNK = 4
"""Frames per chunk of CogVideoX's rolling decode (a constant inside the host's ``_decode_rolling``; its GroupNorm
statistics are per chunk, so ours hold a multiple of it: the self-check proves the grid)."""


def _cog_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if type(model).__name__ != "AutoencoderKLCogVideoX" or not type(model).__module__.endswith("cogvideo.vae"):
        return "not a CogVideoX VAE (comfy.ldm.cogvideo.vae)"
    if not callable(getattr(model, "_decode_rolling", None)) or _cog_interp(model) is None:
        return "its VAE has no rolling decode (_decode_rolling, _interpolate_zq) to reproduce"
    if dec is None or len(dec.up_blocks) <= _cog_split(model):
        return "its decoder has no spatial-only up blocks after the temporal ones"
    return None


def _cog_interp(model: Any) -> Any:
    return getattr(sys.modules.get(type(model).__module__), "_interpolate_zq", None)


def _cog_split(model: Any) -> int:
    """Up blocks with a temporal upsample (run on the whole clip by the host)."""
    return int(round(math.log2(int(model.temporal_compression_ratio))))


def _cog_prefix(model: Any, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``_decode_rolling``'s first phase on the whole latent: ``conv_in``, the mid block and the temporal up
    blocks (GroupNorm over the clip), with the latent expanded in time to their output's frames."""
    dec = model.decoder
    x, _ = dec.conv_in(z)
    x, _ = dec.mid_block(x, None, z)
    for i in range(_cog_split(model)):
        x, _ = dec.up_blocks[i](x, None, z)
    return x, _cog_interp(model)(z, (x.shape[2], z.shape[3], z.shape[4]))


def _cog_chunk(model: Any, src: tuple[torch.Tensor, torch.Tensor], states: dict) -> torch.Tensor:
    """Iterations of ``_decode_rolling``'s chunk loop (:data:`COG_CHUNK` frames each) over this chunk's frames;
    ``states["cog"]``: the host's ``conv_caches`` between them (entries replaced, never changed)."""
    dec, (x, zt) = model.decoder, src
    caches = states.setdefault("cog", {})
    if states["first"]:
        caches.clear()
    outs = []
    for a in range(0, x.shape[2], COG_CHUNK):
        xc, zc = x[:, :, a : a + COG_CHUNK], zt[:, :, a : a + COG_CHUNK]
        zqs: dict = {}  # the latent at each resolution of this chunk (the host's z_spatial_cache)

        def zq(hw: tuple[int, ...], zc: torch.Tensor = zc, zqs: dict = zqs) -> torch.Tensor:
            if hw not in zqs:
                zqs[hw] = zc if zc.shape[-2:] == hw else F.interpolate(zc, size=(zc.shape[2], *hw))
            return zqs[hw]

        for i in range(_cog_split(model), len(dec.up_blocks)):
            xc, caches[f"up_block_{i}"] = dec.up_blocks[i](xc, None, zq(xc.shape[-2:]),
                                                           conv_cache=caches.get(f"up_block_{i}"))
        xc, caches["norm_out"] = dec.norm_out(xc, zq(xc.shape[-2:]), conv_cache=caches.get("norm_out"))
        xc, caches["conv_out"] = dec.conv_out(dec.conv_act(xc), conv_cache=caches.get("conv_out"))
        outs.append(xc)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


_COSMOS = ("comfy.ldm.cosmos.vae", "comfy.ldm.cosmos.cosmos_tokenizer.layers3d",
           "comfy.ldm.cosmos.cosmos_tokenizer.patching", "comfy.ldm.cosmos.cosmos_tokenizer.utils")
"""Modules of Cosmos's tokenizer (both hosts: the same code)."""


def _cosmos_reason(model: Any) -> str | None:
    dec = getattr(model, "decoder", None)
    if type(model).__name__ != "CausalContinuousVideoTokenizer" or type(model).__module__ != _COSMOS[0]:
        return "not a Cosmos tokenizer (comfy.ldm.cosmos.vae.CausalContinuousVideoTokenizer)"
    if dec is None or getattr(model, "post_quant_conv", None) is None:
        return "its tokenizer has no decoder or post_quant_conv"
    known = {"DecoderFactorized", "CausalConv3d", "CausalNormalize", "CausalAttnBlock", "CausalTemporalAttnBlock",
             "CausalHybridUpsample3d", "CausalResnetBlockFactorized3d", "UnPatcher3D"}
    for m in dec.modules():
        name, mod = type(m).__name__, type(m).__module__
        if mod.startswith("comfy.ldm.cosmos") and (mod not in _COSMOS or name not in known):
            return f"its decoder has a {name} ({mod}; not described)"
        if name == "CausalConv3d" and (int(m.conv3d.stride[0]) != 1 or int(m.conv3d.dilation[0]) != 1
                                       or m.time_pad != int(m.conv3d.kernel_size[0]) - 1):
            return "a CausalConv3d that is not stride-1, dilation-1 and padded kt - 1 frames in time"
        if name == "CausalNormalize" and getattr(m, "num_groups", 1) != 1:
            return "a CausalNormalize with several groups (its GroupNorm spans the whole clip)"
        if name == "UnPatcher3D" and (m.patch_method != "haar" or not callable(getattr(m, "_idwt", None))):
            return f"an unpatcher of method {m.patch_method!r} (Haar only)"
    return None


def _cosmos_prefix(model: Any, z: torch.Tensor) -> torch.Tensor:
    """``decode`` without its decoder, on the whole latent: each latent frame un-normalised by its index's
    statistics, then ``post_quant_conv`` (1x1x1)."""
    with swapped((model, "decoder", torch.nn.Identity())):
        return model.decode(z)


def _cosmos_conv_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``CausalConv3d.forward`` with the previous chunk's last ``time_pad`` input frames instead of the clip's first
    frame repeated (first chunk: the host's padding)."""
    ctx, prev = int(m.time_pad), state.get("prev")
    xt = torch.cat([x[:, :, :1].repeat(1, 1, ctx, 1, 1) if prev is None else prev, x], dim=2)
    state["prev"] = xt[:, :, xt.shape[2] - ctx :].clone()
    return m.conv3d(F.pad(xt, tuple(m.spatial_pad) + (0, 0), mode=m.pad_mode, value=0.0))


def _cosmos_tattn_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``CausalTemporalAttnBlock.forward``, its queries attending to the keys and values of every earlier frame of
    the clip (carried: ``state["k"]``, ``state["v"]``, ``(b h w, c, frames)``)."""
    h_ = m.norm(x)
    q, k, v = m.q(h_), m.k(h_), m.v(h_)
    b, c, t, hh, ww = q.shape

    def space2batch(y: torch.Tensor) -> torch.Tensor:
        return y.permute(0, 3, 4, 1, 2).reshape(b * hh * ww, c, t)

    q, k, v = space2batch(q), space2batch(k), space2batch(v)
    if state.get("k") is not None:
        k, v = torch.cat([state["k"], k], dim=2), torch.cat([state["v"], v], dim=2)
    state["k"], state["v"] = k, v
    past = int(k.shape[2]) - t
    w_ = torch.bmm(q.permute(0, 2, 1), k) * (int(c) ** (-0.5))  # (bhw, t, past + t)
    mask = torch.ones((t, past + t), dtype=torch.bool, device=w_.device).tril(diagonal=past)
    w_ = F.softmax(w_.masked_fill(~mask, float("-inf")), dim=2)
    h_ = torch.bmm(w_, v.permute(0, 2, 1)).permute(0, 2, 1).reshape(b, hh, ww, c, t).permute(0, 3, 4, 1, 2)
    return x + m.proj_out(h_)


def _cosmos_upsample_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``CausalHybridUpsample3d.forward``: every frame doubled in time, the clip's first copy dropped in the first
    chunk only (the host doubles only a clip of more than one frame: for one frame, doubling and dropping gives the
    same frame)."""
    if not m.spatial_up and not m.temporal_up:
        return x
    if m.temporal_up:
        x = x.repeat_interleave(2, dim=2)
        if state.get("first", True):
            x = x[:, :, 1:]
        x = m.conv1(x) + x
    if m.spatial_up:
        x = x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
        x = m.conv2(x) + x
    return m.conv3(x)


def _cosmos_unpatch_forward(m: Any, x: torch.Tensor, state: dict) -> torch.Tensor:
    """``UnPatcher3D`` (Haar): its inverse wavelet levels (each input frame gives its own output frames); the clip's
    first ``patch_size - 1`` frames dropped in the first chunk only."""
    for _ in m.range:
        x = m._idwt(x, "haar", rescale=True)
    return x[:, :, m.patch_size - 1 :] if state.get("first", True) else x


def _cosmos_forwards(model: Any) -> dict[Any, Forward]:
    out: dict[Any, Forward] = {}
    for m in model.decoder.modules():
        name = type(m).__name__
        if name == "CausalConv3d" and int(m.time_pad) > 0:
            out[m] = _cosmos_conv_forward
        elif name == "CausalTemporalAttnBlock":
            out[m] = _cosmos_tattn_forward
        elif name == "CausalHybridUpsample3d":
            out[m] = _cosmos_upsample_forward
        elif name == "UnPatcher3D":
            out[m] = _cosmos_unpatch_forward
    return out


def _cosmos_chunk(model: Any, x: torch.Tensor, states: dict) -> torch.Tensor:
    """One chunk: the host's decoder on the prefix's frames (its described modules' forwards swapped)."""
    return model.decoder(x)


def blend_refusal(model: Any) -> str | None:
    """Why an overlap-blend of independently decoded chunks cannot serve this decoder at all (None: it may, if it
    measures well): LTX 2.4's diffusion decoder draws the noise it denoises from a generator it seeds on every call,
    at the shape of what it decodes, so each chunk gets other noise (issue 36 measured 10 dB); its neighbourhood
    attention is not causal either. The host's own decode (exact) runs instead."""
    if type(model).__name__ == "CausalDiffusionVAE" and type(model).__module__.endswith("na_diffusion_decoder"):
        blocks = getattr(getattr(model, "decoder", None), "diff_blocks", ())
        kernel = getattr(getattr(blocks[0], "attn", None), "kernel_size", None) if len(blocks) else None
        reach = (f"; its {len(blocks)} diffusion blocks' neighbourhood attention ({kernel[0]} frames wide, not "
                 "causal) reads the frames after a chunk too") if kernel else ""
        return ("LTX 2.4's diffusion decoder draws the noise it denoises on every call, seeded, at the shape it "
                f"decodes: each chunk would denoise other noise (measured 10 dB){reach}")
    return None


DESCRIPTIONS: tuple[Description, ...] = (
    Description("mochi", _mochi_reason, _mochi_forwards),
    Description("hunyuan_video15", _hv15_reason, chunk=_hv15_chunk, prefix=_hv15_prefix, min_k=2,
                first_alone=False, tiles=True,
                how="the host's causal carries (2 frames per convolution), after conv_in and the mid block's "
                    "attention once on the whole latent"),
    Description("ltx_video", _ltx_reason, chunk=_ltx_chunk, prefix=_ltx_prefix, temporal=False,
                first_alone=False, tiles=True, draws=_ltx_draws,
                how="spatial tiles of the whole clip with a halo of the decoder's traced reach; any noise the "
                    "host's decode draws is drawn as the host draws it (into the whole latent; 0.9.1's blocks': on "
                    "whole frames, each tile adding its crop)"),
    Description("cogvideox", _cog_reason, chunk=_cog_chunk, prefix=_cog_prefix, min_k=COG_CHUNK, step=COG_CHUNK,
                unit="frames", first_alone=False, check_t=3,
                how=f"the host's rolling decode: its low-resolution phase once on the whole latent, then its chunks of "
                    f"{COG_CHUNK} frames with their causal caches"),
    Description("cosmos", _cosmos_reason, _cosmos_forwards, chunk=_cosmos_chunk, prefix=_cosmos_prefix,
                how="each causal convolution reads the previous chunk's last frames and the causal temporal "
                    "attention every earlier frame's keys and values; the latent un-normalised once by its frame "
                    "index"),
)


@dataclasses.dataclass(frozen=True)
class CarryLayout:
    """One causal decoder for the carried-context executor; ``reason``: why not (then nothing else)."""

    reason: str | None
    family: str = ""
    forwards: dict = dataclasses.field(default_factory=dict, compare=False)
    description: Description | None = dataclasses.field(default=None, compare=False)

    def require(self) -> CarryLayout:
        if self.reason is not None:
            raise ValueError(f"no carried-context chunking for this decoder: {self.reason}")
        return self


_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def carry_layout(model: Any) -> CarryLayout:
    """The carried-context layout of ``model`` (a ``first_stage_model``), walked once per model object."""
    try:
        found = _LAYOUTS.get(model)
    except TypeError:
        found = None
    if found is None:
        d, why = first_fit(DESCRIPTIONS, model, "carried-context description")
        found = CarryLayout(why) if d is None else CarryLayout(None, d.name, d.forwards(model), d)
        try:
            _LAYOUTS[model] = found
        except TypeError:
            pass
    return found
