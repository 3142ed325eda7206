"""Convolutional reach of a decoder, in latent pixels, from its modules (not a constant).

The *reach* of a decoder stage is how far (in latent px, Chebyshev distance) a change of one input
latent pixel can travel through its convolutions: a 3x3 conv at an activation ``s`` times the latent
resolution adds ``1 / s`` latent px; upsampling only changes ``s``. A tile decoded with a halo of at
least the reach computes its core from exactly the same inputs as the whole image would, *provided*
nothing global intervenes (GroupNorm statistics, attention): those make the real reach unbounded,
which is why the generic tiled path is only approximate and the exact path shares statistics and runs
the attention once on the whole latent.

Three measurements:

* :func:`structural_reach`: walks a KL ``Decoder`` (``conv_in``, ``mid``, ``up[i].block[j]``,
  ``up[i].upsample``, ``conv_out``) in forward order; residual branches count as the longer of the
  two paths. SD/SDXL KL: up path 12.25, ``conv_in`` + mid 5, global attention in the mid block.
* :func:`traced_reach`: any module: forward hooks on every convolution record the spatial size of its
  input during one small run, giving the scale of each conv; contributions are summed in execution
  order. Parallel branches are summed too, so this is an upper bound (exact for decoders whose
  shortcuts are 1x1 convs or identities). Modules whose class name contains ``Attn``/``Attention``
  are reported as global. :func:`traced_encoder_reach`: the same for an encoder's local part, a strided
  convolution counting its whole kernel (one-sided padding), norms over space reported as global too.
* :func:`impulse_extent` (+ :class:`GroupNormFreezer`): empirical check. Perturb one pixel of an
  activation, decode with GroupNorm statistics frozen to the unperturbed run, and measure how far
  the output changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

log = logging.getLogger("vramfit.memory.measure.reach")

__all__ = [
    "EncoderReach",
    "GroupNormFreezer",
    "ReachReport",
    "conv_radius",
    "default_halo",
    "encoder_radius",
    "impulse_extent",
    "structural_reach",
    "traced_encoder_reach",
    "traced_reach",
]

_CONV_TYPES = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
_CONVT_TYPES = (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d)


@dataclasses.dataclass(frozen=True)
class ReachReport:
    """Reach in latent px. ``total = pre_up + up_path``; global ops make the true reach unbounded."""

    up_path: float
    """From the mid block's output to the image (what the exact path's up-path tiles depend on)."""
    pre_up: float
    """``conv_in`` + mid block convolutions (post_quant_conv is 1x1)."""
    global_ops: tuple[str, ...]
    """Modules with a global receptive field (attention)."""
    contributions: tuple[tuple[str, float], ...]
    """(module name, latent px) in forward order."""
    method: str

    @property
    def total(self) -> float:
        return self.pre_up + self.up_path

    @property
    def has_global_ops(self) -> bool:
        return bool(self.global_ops)

    def describe(self) -> str:
        glob = f"; global: {global_summary(self.global_ops)}" if self.global_ops else ""
        return (
            f"conv reach {self.total:g} latent px (pre-up {self.pre_up:g} + up path {self.up_path:g}, "
            f"{self.method}){glob}"
        )


GLOBAL_SHOWN = 3
"""Global modules named in :meth:`ReachReport.describe`; the rest are counted."""


def global_summary(names: tuple[str, ...] | list[str], shown: int = GLOBAL_SHOWN) -> str:
    """``3 modules (mid.attn_1, up.0.attn.0, up.0.attn.1)`` or ``24 modules (a, b, c, +21 more)``."""
    head = ", ".join(names[:shown]) + (f", +{len(names) - shown} more" if len(names) > shown else "")
    return f"{len(names)} module{'s' if len(names) != 1 else ''} ({head})"


def conv_radius(conv: Any) -> float:
    """Spatial radius (px of the conv's input) of a convolution: ``dilation * (kernel - 1) / 2``.

    The largest over the last two (spatial) dims; ``stride`` and ``padding`` do not change how far
    an input change travels. Transposed convs: radius in input px, ``(kernel - 1) / 2 / stride``.
    """
    k = tuple(conv.kernel_size)[-2:]
    d = tuple(conv.dilation)[-2:]
    if isinstance(conv, _CONVT_TYPES):
        s = tuple(conv.stride)[-2:]
        return max(di * (ki - 1) / 2 / si for ki, di, si in zip(k, d, s, strict=True))
    return max(di * (ki - 1) / 2 for ki, di in zip(k, d, strict=True))


def _sub_conv(m: Any) -> Any:
    """The convolution inside ``m`` (``m`` itself, or a wrapper holding ``.conv`` as ComfyUI's VideoConv3d)."""
    if isinstance(m, _CONV_TYPES + _CONVT_TYPES):
        return m
    inner = getattr(m, "conv", None)
    return inner if isinstance(inner, _CONV_TYPES + _CONVT_TYPES) else None


def _r(m: Any) -> float:
    c = _sub_conv(m)
    return conv_radius(c) if c is not None else 0.0


def _resnet_reach(blk: Any) -> float:
    main = _r(blk.conv1) + _r(blk.conv2)
    short = 0.0
    for name in ("conv_shortcut", "nin_shortcut"):
        sc = getattr(blk, name, None)
        if sc is not None and (name == "nin_shortcut" or getattr(blk, "use_conv_shortcut", False)):
            short = _r(sc)
    return max(main, short)


def structural_reach(model: Any) -> ReachReport:
    """Reach of a KL ``Decoder`` (or a ``first_stage_model`` holding one) by walking its structure."""
    dec = getattr(model, "decoder", None)
    dec = model if dec is None else dec
    for name in ("conv_in", "mid", "up", "conv_out"):
        if getattr(dec, name, None) is None:
            raise ValueError(f"not a KL Decoder (no {name}); use traced_reach")
    contrib: list[tuple[str, float]] = []
    global_ops: list[str] = []
    contrib.append(("conv_in", _r(dec.conv_in)))
    for name in ("block_1", "attn_1", "block_2"):
        m = getattr(dec.mid, name, None)
        if m is None:
            continue
        if getattr(m, "conv1", None) is not None:
            contrib.append((f"mid.{name}", _resnet_reach(m)))
        else:
            global_ops.append(f"mid.{name}")
    pre_up = sum(v for _, v in contrib)
    scale = 1.0
    up_start = len(contrib)
    levels = len(dec.up)
    for i in reversed(range(levels)):
        level = dec.up[i]
        for j in range(len(level.block)):
            contrib.append((f"up.{i}.block.{j}", _resnet_reach(level.block[j]) / scale))
        for j in range(len(getattr(level, "attn", ()))):
            global_ops.append(f"up.{i}.attn.{j}")
        upsample = getattr(level, "upsample", None)
        if i > 0 and upsample is not None:
            sf = getattr(upsample, "scale_factor", 2.0)
            sf = float(sf[-1]) if isinstance(sf, (tuple, list)) else float(sf)
            scale *= sf
            conv = getattr(upsample, "conv", None) if getattr(upsample, "with_conv", True) else None
            contrib.append((f"up.{i}.upsample", _r(conv) / scale if conv is not None else 0.0))
    if not getattr(dec, "give_pre_end", False):
        contrib.append(("conv_out", _r(dec.conv_out) / scale))
    up_path = sum(v for _, v in contrib[up_start:])
    return ReachReport(up_path, pre_up, tuple(global_ops), tuple(contrib), "structure")


def _is_attention(m: Any) -> bool:
    name = type(m).__name__.lower()
    return "attn" in name or "attention" in name


def traced_reach(
    module: torch.nn.Module,
    run: Callable[[], Any],
    latent_hw: tuple[int, int],
    up_path_from: str | None = None,
    radius: Callable[[Any], float] = conv_radius,
    is_global: Callable[[Any], bool] = _is_attention,
) -> ReachReport:
    """Reach of any decoder from one small run: ``run()`` must decode a latent of spatial size ``latent_hw``.

    Each convolution's input spatial size gives its scale ``s`` (input height / latent height, rounded to an
    integer: a convolution whose caller pads its input first sees a few more px); it adds ``conv_radius / s``.
    ``up_path_from``: name of the submodule whose output starts the "up path" (e.g. ``"decoder.mid"``);
    contributions after it count as ``up_path``, before it as ``pre_up``.
    Without it everything counts as ``up_path``. Upper bound when branches run in parallel. ``radius(conv)``: px
    of its input a convolution reaches (default :func:`conv_radius`); ``is_global(m)``: a module reported in
    ``global_ops`` when it runs (default: attention by class name).
    """
    lh = float(latent_hw[0])
    records: list[tuple[str, float]] = []
    global_ops: list[str] = []
    marker: list[int] = []
    handles = []

    def conv_hook(name: str, conv: Any) -> Callable[..., None]:
        def hook(_m: Any, inputs: tuple[Any, ...]) -> None:
            x = inputs[0]
            if isinstance(x, torch.Tensor) and x.ndim >= 3:
                s = x.shape[-2] / lh if x.ndim >= 4 else x.shape[-1] / lh
                s = float(round(s)) if s >= 1 else s  # a conv padded by its caller (CarriedConv3d) sees more px
                records.append((name, radius(conv) / max(s, 1e-9)))

        return hook

    def attn_hook(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            if name not in global_ops:
                global_ops.append(name)

        return hook

    def mark_hook(*_: Any) -> None:
        marker.append(len(records))

    try:
        for name, m in module.named_modules():
            if isinstance(m, _CONV_TYPES + _CONVT_TYPES):
                handles.append(m.register_forward_pre_hook(conv_hook(name, m)))
            elif name and is_global(m):
                handles.append(m.register_forward_pre_hook(attn_hook(name)))
            if up_path_from is not None and name == up_path_from:
                handles.append(m.register_forward_hook(mark_hook))
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    split = marker[-1] if marker else 0
    pre = sum(v for _, v in records[:split])
    up = sum(v for _, v in records[split:])
    return ReachReport(up, pre, tuple(global_ops), tuple(records), "trace")


def default_halo(report: ReachReport, include_pre_up: bool = True, cap: int | None = None) -> int:
    """Halo (latent px) covering the convolutional reach: ``ceil(total)`` (or ``ceil(up_path)``), capped."""
    r = report.total if include_pre_up else report.up_path
    h = int(math.ceil(r - 1e-9))
    return min(h, cap) if cap is not None else h


def impulse_extent(delta: torch.Tensor, pos: tuple[int, int], scale: int, rel_tol: float = 0.0) -> float:
    """How far (latent px, Chebyshev) an impulse at latent pixel ``pos`` changed the output.

    ``delta``: output difference (..., H, W) at ``scale`` output px per latent px. A pixel counts as
    changed when ``|delta| > rel_tol * max|delta|`` (``rel_tol=0``: any change). The distance of an
    output pixel is measured from the impulse pixel's footprint ``[scale*p, scale*p + scale)``, in
    output px, divided by ``scale``. Returns 0 when nothing changed.
    """
    mag = delta.detach().abs().to(torch.float64)
    while mag.ndim > 2:
        mag = mag.amax(dim=0)
    peak = float(mag.max()) if mag.numel() else 0.0
    if peak == 0.0:
        return 0.0
    changed = mag > rel_tol * peak
    ys, xs = torch.nonzero(changed, as_tuple=True)
    py, px = pos
    lo_y, hi_y = scale * py, scale * py + scale - 1
    lo_x, hi_x = scale * px, scale * px + scale - 1
    dy = torch.clamp(torch.maximum(lo_y - ys, ys - hi_y), min=0)
    dx = torch.clamp(torch.maximum(lo_x - xs, xs - hi_x), min=0)
    return float(torch.maximum(dy, dx).max()) / scale


class GroupNormFreezer:
    """Record the statistics every ``GroupNorm`` of ``module`` sees in one run, and replay them.

    ``with f.record(): run(x)`` then ``with f.replay(): delta = run(x + impulse) - run(x)``: in replay
    runs each GroupNorm normalises with the recorded (per batch item, per group) mean/variance, so a
    local perturbation stays local and ``delta`` shows the convolutional reach alone (take both runs
    under ``replay`` so the arithmetic outside the reach is identical). Modules are matched by their
    call order within one run.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.norms = [m for m in module.modules() if isinstance(m, torch.nn.GroupNorm)]
        self.stats: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @staticmethod
    def _group_stats(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.reshape(x.shape[0], groups, -1).to(torch.float64)
        var, mean = torch.var_mean(flat, dim=-1, correction=0)
        return mean, var

    @contextlib.contextmanager
    def record(self) -> Iterator[GroupNormFreezer]:
        self.stats = {}
        handles = []

        def hook(m: Any, inputs: tuple[torch.Tensor, ...]) -> None:
            self.stats.setdefault(id(m), []).append(self._group_stats(inputs[0], m.num_groups))

        try:
            handles = [n.register_forward_pre_hook(hook) for n in self.norms]
            yield self
        finally:
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def replay(self) -> Iterator[GroupNormFreezer]:
        cursor: dict[int, int] = {}
        handles = []

        def hook(m: Any, inputs: tuple[torch.Tensor, ...], _out: torch.Tensor) -> torch.Tensor:
            recorded = self.stats[id(m)]
            k = cursor.get(id(m), 0)
            cursor[id(m)] = (k + 1) % len(recorded)
            mean, var = recorded[k]
            x = inputs[0]
            b, c = x.shape[0], x.shape[1]
            g = m.num_groups
            shape = (b, g) + (1,) * (x.ndim - 1)
            work = torch.float64 if x.dtype == torch.float64 else torch.float32
            xf = x.to(work).reshape(b, g, c // g, *x.shape[2:])
            y = (xf - mean.to(work).view(shape)) * torch.rsqrt(var.to(work).view(shape) + m.eps)
            y = y.reshape(x.shape)
            if m.weight is not None:
                view = (1, c) + (1,) * (x.ndim - 2)
                y = y * m.weight.to(work).view(view) + m.bias.to(work).view(view)
            return y.to(x.dtype)

        try:
            handles = [n.register_forward_hook(hook) for n in self.norms]
            yield self
        finally:
            for h in handles:
                h.remove()


@dataclasses.dataclass(frozen=True)
class EncoderReach:
    """What one traced run of an encoder's local part found: its spatial reach in latent px and the modules
    that ran whose output may depend on every pixel (then the reach does not bound it)."""

    reach: float
    global_ops: tuple[str, ...]

    @property
    def halo(self) -> int:
        """Latent px a tile's core is extended by: the reach, rounded up."""
        return int(math.ceil(self.reach - 1e-9))


def encoder_radius(conv: Any) -> float:
    """Spatial px of its input an encoder's convolution reaches: :func:`conv_radius`, but ``dilation * (k - 1)``
    for a strided one (its padding may be one-sided, as Wan's: output ``j`` reads ``[s j, s j + k)``)."""
    k, d, st = tuple(conv.kernel_size)[-2:], tuple(conv.dilation)[-2:], tuple(conv.stride)[-2:]
    return max(di * (ki - 1) / (1 if si > 1 else 2) for ki, di, si in zip(k, d, st, strict=True))


def traced_encoder_reach(module: torch.nn.Module, run: Callable[[], Any], latent_h: int,
                         is_global: Callable[[Any], bool] = _is_attention) -> EncoderReach:
    """Reach of an encoder's local part from one run (``run()`` encodes pixels ``latent_h`` latent px high; one
    chunk in time, so each convolution runs once): :func:`traced_reach` with :func:`encoder_radius`, each
    convolution's reach over its input px per latent px; parallel branches summed (an upper bound).
    ``is_global(m)``: a module that breaks locality (attention, norms over space), reported by its name when it
    runs."""
    r = traced_reach(module, run, (latent_h, latent_h), radius=encoder_radius, is_global=is_global)
    return EncoderReach(r.total, r.global_ops)
