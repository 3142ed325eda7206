"""Exact tiled encode of Wan 2.1 / 2.2 videos (:func:`encode_wan_tiled`), by a prefix/suffix split.

Everything the Wan encoder does before its ``middle`` (``conv1`` and the ``downsamples``: causal convolutions,
RMS norms over channels, stride-2 resamples, 2.2's patchify and average shortcuts) is spatially local, so it
runs in spatial tiles extended by its reach (:func:`prefix_halo`), each tile through **the host's own**
``model.encode`` with ``middle``, ``head`` and ``model.conv1`` swapped out for the call: the host's own temporal
loop (chunk sizes, causal caches, 0.33's deferred frames and ``final``) runs each tile. The tiles' cores land in
a store at latent resolution. The suffix (``middle`` with its per-frame global attention, ``head``, ``conv1``)
then runs on whole latent frames, chunk by chunk through the host's own ``encoder.forward`` with ``conv1`` and
``downsamples`` swapped out, its causal caches carried. Exact by construction wherever the split is (the
first-use self-check proves it per host). Nothing here imports ComfyUI. Design: docs/ENCODE.md section 5."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..oom import oom_types
from ..tiles import spans
from .blend import stop_driver

__all__ = ["EXECUTOR_VERSION", "MIN_TILE", "SUFFIX_FRAMES", "encode_wan_tiled", "prefix_halo", "wan_encode_reason"]

EXECUTOR_VERSION = "v1"
"""Part of the self-check's key: bump it when a change here could change the result (the stored verdicts are
then re-checked)."""
MIN_TILE = 4
"""Smallest tile core (latent px) the OOM fallback splits to and the planner tries: with a reach of 10 latent
px, smaller cores hardly shrink a tile's extended area."""
SUFFIX_FRAMES = 2
"""Latent frames per suffix call after frame 0. At least 2: 0.33's per-call caches keep the last two frames
of a call's input only when it has two (a 1-frame call after frame 0 would lose one frame of history)."""

ProgressFn = Callable[[int, int], None]


def wan_encode_reason(model: Any) -> str | None:
    """Why :func:`encode_wan_tiled` cannot run ``model`` (None: it can): a ComfyUI Wan VAE with the encoder
    parts the split swaps."""
    enc = getattr(model, "encoder", None)
    mod = type(model).__module__
    if not mod.startswith("comfy.ldm.wan."):
        return f"{type(model).__name__} is not a Wan VAE"
    for name in ("conv1", "downsamples", "middle", "head"):
        if not isinstance(getattr(enc, name, None), torch.nn.Module):
            return f"its encoder has no {name}"
    if not isinstance(getattr(model, "conv1", None), torch.nn.Module):
        return "it has no conv1 after the encoder"
    return None


def prefix_halo(model: Any, ratio: int) -> int:
    """The prefix's spatial reach in latent px (rounded up), from its convolutions walked back from the latent:
    ``(k - 1) // 2`` input px for a stride-1 kernel, ``k - 1`` for a strided one (asymmetric padding), each at
    its level's scale. Parallel shortcuts (1x1 convolutions, 2.2's average pooling) reach no further than the
    main path beside them. Checked against the encoder's own downscale: the strides must multiply to
    ``ratio`` (with 2.2's 2x2 patchify)."""
    enc = model.encoder
    convs = [m for m in (enc.conv1, *enc.downsamples.modules()) if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    scale, reach = 1.0, 0.0
    for conv in reversed(convs):
        k = max(conv.kernel_size[-2:])
        s = max(conv.stride[-2:])
        d = max(conv.dilation[-2:])
        scale /= s
        reach += ((k - 1) * d if s > 1 else (k - 1) // 2 * d) * scale
    patch = round(1 / scale)
    if ratio % patch:
        raise ValueError(f"the encoder's strides give {patch}x, not a divisor of the VAE's {ratio}x")
    return math.ceil(reach - 1e-9)


class _Pass(torch.nn.Module):
    """Stands in for a causal convolution: returns its input (the cache arguments are ignored)."""

    def forward(self, x: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return x


class _First:
    """Stands in for ``model.conv1(out)`` in the host's ``mu, log_var = self.conv1(out).chunk(2, dim=1)``: its
    ``chunk`` gives ``out`` itself as ``mu``."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def chunk(self, n: int, dim: int = 0) -> tuple[torch.Tensor, None]:
        return self.x, None


class _Keep(torch.nn.Module):
    """Stands in for ``model.conv1`` in the prefix: hands the encoder's output through ``chunk``."""

    def forward(self, x: torch.Tensor) -> _First:
        return _First(x)


@contextlib.contextmanager
def _swapped(*swaps: tuple[torch.nn.Module, str, torch.nn.Module]) -> Iterator[None]:
    """Submodules replaced for the block (``(parent, name, stand-in)``), restored after it (not thread-safe:
    ComfyUI runs one node at a time)."""
    old = [(p, n, p._modules[n]) for p, n, _ in swaps]
    try:
        for p, n, m in swaps:
            p._modules[n] = m
        yield
    finally:
        for p, n, m in old:
            p._modules[n] = m


def run_prefix(model: Any, x: torch.Tensor) -> torch.Tensor:
    """The encoder's prefix on pixels ``x`` (1, C, T, H, W): the host's ``model.encode`` with the suffix
    swapped out; returns the features the ``middle`` would get, all latent frames."""
    enc = model.encoder
    with _swapped((enc, "middle", torch.nn.Sequential()), (enc, "head", torch.nn.Sequential()),
                  (model, "conv1", _Keep())):
        return model.encode(x)


def run_suffix(model: Any, feats: torch.Tensor, frames: int = SUFFIX_FRAMES, device: Any = None) -> torch.Tensor:
    """The suffix on prefix features ``feats`` (1, C, T_lat, h, w): latent frame 0, then ``frames`` at a time,
    through the host's ``encoder.forward`` (caches carried) with the prefix swapped out, then ``model.conv1``;
    returns the posterior mean, as ``model.encode``."""
    enc = model.encoder
    device = feats.device if device is None else device
    n_cache = sum(1 for _ in enc.modules()) + 1  # more slots than any encoder uses
    cache: list[Any] = [None] * n_cache
    final = "final" in inspect.signature(enc.forward).parameters
    t = int(feats.shape[2])
    bounds = [0, 1, *range(1 + frames, t, frames), t] if t > 1 else [0, 1]
    outs = []
    with _swapped((enc, "conv1", _Pass()), (enc, "downsamples", torch.nn.Sequential())):
        for a, b in zip(bounds[:-1], bounds[1:], strict=False):
            kw = {"final": b == t} if final else {}
            outs.append(enc(feats[:, :, a:b].to(device), feat_cache=cache, feat_idx=[0], **kw))
    out = torch.cat(outs, 2) if len(outs) > 1 else outs[0]
    return model.conv1(out).chunk(2, dim=1)[0]


def encode_wan_tiled(
    model: Any,
    x: torch.Tensor,
    tile: int,
    ratio: int,
    *,
    compute_device: torch.device | str | None = None,
    store_device: torch.device | str | None = None,
    out_device: torch.device | str | None = None,
    progress: ProgressFn | None = None,
    should_stop: Callable[[], Any] | None = None,
    fault_hook: Callable[[int], None] | None = None,
    oom_exceptions: Any = None,
    on_oom: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Encode processed pixels ``x`` (1, 3, T, H, W; sides multiples of ``ratio``) exactly: the prefix in tiles
    of ``tile`` latent px (cores) extended by :func:`prefix_halo`, the suffix on whole frames; returns what
    ``model.encode(x)`` returns. An out-of-memory error inside a tile splits that tile into quarters and goes on
    (finished tiles are kept); ``on_oom`` runs after each. ``fault_hook(k)``: called inside the k-th tile
    attempt (tests)."""
    dev = torch.device(compute_device) if compute_device is not None else x.device
    store_dev = torch.device(store_device) if store_device is not None else dev
    out_dev = torch.device(out_device) if out_device is not None else dev
    h, w = int(x.shape[-2]) // ratio, int(x.shape[-1]) // ratio
    halo = prefix_halo(model, ratio)
    queue = [(a, b, c, d) for a, b, _, _ in spans(h, tile, 0) for c, d, _, _ in spans(w, tile, 0)]
    total, done_area, attempts = h * w, 0, 0
    driver = stop_driver(oom_types(oom_exceptions), should_stop, on_oom)
    store: torch.Tensor | None = None

    def attempt(rect: tuple[int, int, int, int]) -> torch.Tensor:
        nonlocal attempts
        a, b, c, d = rect
        ea, eb, ec, ed = max(0, a - halo), min(h, b + halo), max(0, c - halo), min(w, d + halo)
        attempts += 1
        if fault_hook is not None:
            fault_hook(attempts)
        px = x[..., ea * ratio : eb * ratio, ec * ratio : ed * ratio].to(dev)
        feats = run_prefix(model, px)
        return feats[..., a - ea : b - ea, c - ec : d - ec].to(store_dev)

    while queue:
        driver.check_stop()
        rect = queue.pop(0)
        a, b, c, d = rect
        big = max(b - a, d - c) > MIN_TILE
        try:  # an OOM in a tile larger than MIN_TILE: on_oom, then _Split (the smallest re-raises as it came)
            core = driver.run(lambda rect=rect: attempt(rect), can_recover=lambda e, big=big: big, recover=_split)
        except _Split:
            queue[:0] = _quarters(rect)
            continue
        if store is None:
            store = torch.empty((*core.shape[:3], h, w), dtype=core.dtype, device=store_dev)
        store[..., a:b, c:d] = core
        del core
        done_area += (b - a) * (d - c)
        if progress is not None:
            progress(done_area, total)
    driver.check_stop()
    assert store is not None
    try:
        return run_suffix(model, store, device=dev).to(out_dev)
    except oom_types(oom_exceptions) as e:
        e._vramfit_tail = True  # type: ignore[attr-defined]  # after the tiles: a smaller tile would not help
        raise


class _Split(Exception):
    """Ends :meth:`..oom.OomResume.run` after an OOM in a tile, so the tile loop puts the tile's quarters in its
    place."""


def _split(event: Any) -> None:
    raise _Split


def _quarters(rect: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """A tile's halves along each side longer than :data:`MIN_TILE`, in row-major order."""
    a, b, c, d = rect
    ys = [(a, (a + b) // 2), ((a + b) // 2, b)] if b - a > MIN_TILE else [(a, b)]
    xs = [(c, (c + d) // 2), ((c + d) // 2, d)] if d - c > MIN_TILE else [(c, d)]
    return [(ya, yb, xa, xb) for ya, yb in ys for xa, xb in xs]
