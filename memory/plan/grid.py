"""Planner: the fastest decode plan whose predicted peak fits a budget.

Given a latent shape, the VAE's geometry, a budget in bytes and a cost model (anything with
``predict(Geometry) -> bytes``), :func:`plan_tiling` returns a :class:`Tiling`: spatial tiles (core
size, halo, grid), images per pass, and for video the latent frames per temporal chunk. Throughput
objective: fewest passes first, then least computed area (halos are recomputed work), then tile
cores aligned to ``VaeGeometry.align``, then the lowest predicted peak. The predicted peak of every plan it returns is <= the budget; when even the
smallest plan does not fit, :class:`ImpossibleBudgetError` says the minimum budget that would.

Tiling (latent px): ``rows x cols`` tiles; a tile's core is ``tile_h x tile_w`` (the last row/column
may be smaller); each tile is computed with ``halo`` extra latent px on every side that has a
neighbour, clipped to the latent, and the halo is cropped away after decoding.

Video (``(B, C, T, H, W)``): with temporal chunking (a chunking executor) the first chunk is latent
frame 0 alone, then chunks of up to ``frames_per_chunk`` latent frames (causal caches carried
across), so a chunked plan has at least 2 temporal passes when ``T > 1``; spatial tiles compose with
chunks. Without chunking (``temporal_chunking=False``, e.g. ComfyUI's own decode, which steps
through the frames itself) the clip is one chunk of ``T`` frames.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..geometry import Geometry, VaeGeometry
from ..report import fmt_bytes


class Predictor(Protocol):
    def predict(self, g: Geometry) -> int: ...


class ImpossibleBudgetError(ValueError):
    """Even the smallest plan's predicted peak exceeds the budget."""

    def __init__(self, message: str, budget: int, minimum: int, smallest: Tiling | None = None):
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum
        self.smallest = smallest


def scaled(plan_fn: Callable[[int], Any], budget: int, ratio: float) -> Any:
    """``plan_fn(budget / ratio)`` with its ``planned`` bytes scaled back by ``ratio``: the measured over
    predicted peak learned on this machine for that path (:mod:`..cost.observed`; 1: the plan as is).
    ``plan_fn`` returns a :class:`.types.Plan` or None; its impossible budget is told in the user's bytes."""
    if ratio <= 1.0:
        return plan_fn(budget)
    try:
        p = plan_fn(int(budget / ratio))
    except ImpossibleBudgetError as e:
        text = str(e)
        rest = text.split(" is too small", 1)[1] if " is too small" in text else f": {text}"
        raise ImpossibleBudgetError(
            f"budget {fmt_bytes(budget)} is too small{rest} (with the {ratio:.2f}x this path's measured peaks on "
            f"this device ran over its predictions: {fmt_bytes(int(e.minimum * ratio))}; it was planned for "
            f"{fmt_bytes(int(budget / ratio))})", budget, int(e.minimum * ratio), e.smallest) from e
    return None if p is None else dataclasses.replace(p, planned=int(p.planned * ratio), ratio=ratio)


@dataclasses.dataclass(frozen=True)
class Tile:
    """One tile: core ``[y0, y1) x [x0, x1)`` and computed region (core + halo, clipped), latent px."""

    row: int
    col: int
    y0: int
    y1: int
    x0: int
    x1: int
    cy0: int
    cy1: int
    cx0: int
    cx1: int


@dataclasses.dataclass(frozen=True)
class Tiling:
    """A decode plan (plain data; ``str(plan)`` is the user-facing summary)."""

    latent_shape: tuple[int, ...]
    family: str
    spatial_ratio: int
    temporal_ratio: int
    tile_h: int
    tile_w: int
    halo: int
    rows: int
    cols: int
    images_per_pass: int
    chunks: tuple[int, ...]
    predicted_peak: int
    budget: int
    overhead: float
    passes: int

    @property
    def is_video(self) -> bool:
        return len(self.latent_shape) == 5

    @property
    def tiled(self) -> bool:
        return self.rows * self.cols > 1

    @property
    def frames_per_chunk(self) -> int:
        """Latent frames of the largest chunk (0 for images)."""
        return max(self.chunks) if self.chunks else 0

    @property
    def latent_hw(self) -> tuple[int, int]:
        return int(self.latent_shape[-2]), int(self.latent_shape[-1])

    def tiles(self) -> list[Tile]:
        h, w = self.latent_hw
        ys = _spans(h, self.tile_h, self.rows, self.halo)
        xs = _spans(w, self.tile_w, self.cols, self.halo)
        return [
            Tile(r, c, y0, y1, x0, x1, cy0, cy1, cx0, cx1)
            for r, (y0, y1, cy0, cy1) in enumerate(ys)
            for c, (x0, x1, cx0, cx1) in enumerate(xs)
        ]

    def batches(self) -> list[tuple[int, int]]:
        """``[start, stop)`` batch ranges, one per group of ``images_per_pass``."""
        b = int(self.latent_shape[0])
        return [(i, min(b, i + self.images_per_pass)) for i in range(0, b, self.images_per_pass)]

    def chunk_ranges(self) -> list[tuple[int, int]]:
        """``[start, stop)`` latent-frame ranges of the temporal chunks (empty for images)."""
        out, t = [], 0
        for k in self.chunks:
            out.append((t, t + k))
            t += k
        return out

    def describe(self) -> str:
        h, w = self.latent_hw
        s = self.spatial_ratio
        parts = []
        if self.tiled:
            parts.append(
                f"{self.rows}x{self.cols} tiles of {self.tile_h}x{self.tile_w} latent px "
                f"({self.tile_h * s}x{self.tile_w * s} px) + halo {self.halo}"
            )
        else:
            parts.append(f"untiled {h}x{w} latent px ({h * s}x{w * s} px)")
        b = int(self.latent_shape[0])
        if b > 1:
            parts.append(f"{self.images_per_pass} of {b} {'videos' if self.is_video else 'images'} per pass")
        if self.is_video:
            t = int(self.latent_shape[2])
            if len(self.chunks) > 1:
                parts.append(f"{len(self.chunks)} chunks of <= {self.frames_per_chunk} of {t} latent frames")
            else:
                parts.append(f"all {t} latent frames at once")
        parts.append(f"{self.passes} pass{'es' if self.passes != 1 else ''}")
        if self.tiled:
            parts.append(f"halo overhead {self.overhead:.1%}")
        # No peak or budget here: the report's predicted row gives the plan's peak (output buffer included)
        # against the one budget its budget row names (this plan's budget may be less by that buffer).
        return f"{self.family}: " + ", ".join(parts)

    def __str__(self) -> str:
        return self.describe()


def _spans(n: int, core: int, count: int, halo: int) -> list[tuple[int, int, int, int]]:
    """``(core0, core1, ext0, ext1)`` of ``count`` cores of ``core`` px, the last one shorter: not
    :func:`..tiles.spans`, whose balanced cores would differ from the aligned core the plan scored."""
    out = []
    for i in range(count):
        a, b = i * core, min(n, (i + 1) * core)
        ca = a if i == 0 else max(0, a - halo)
        cb = b if i == count - 1 else min(n, b + halo)
        out.append((a, b, ca, cb))
    return out


def _axis(n: int, parts: int, align: int, halo: int) -> list[tuple[int, int, int, int]]:
    """Ways to split ``n`` latent px into ``parts`` tiles: ``(core, count, largest extent, total)``.

    The balanced core ``ceil(n / parts)`` (the smallest core giving ``parts`` tiles), and before it,
    when ``align > 1``, the core rounded up to a multiple of ``align`` if that still gives ``parts``
    tiles. Empty when ``parts`` tiles cannot be made (the count would repeat a smaller one).
    """
    base = -(-n // parts)
    cores = [base]
    if align > 1:
        aligned = -(-base // align) * align
        if aligned != base and -(-n // aligned) == parts:
            cores.insert(0, aligned)
    out = []
    for core in cores:
        count = -(-n // core)
        if count != parts:
            continue
        spans = _spans(n, core, count, halo)
        largest = max(cb - ca for _, _, ca, cb in spans)
        total = sum(cb - ca for _, _, ca, cb in spans)
        out.append((core, count, largest, total))
    return out


def _chunks(t: int, k: int, chunking: bool) -> tuple[int, ...]:
    """Latent frames per temporal pass: ``(T,)`` unchunked; chunked, frame 0 alone then ``k`` each."""
    if not chunking or t <= 1:
        return (t,)
    rest = t - 1
    return (1,) + (k,) * (rest // k) + ((rest % k,) if rest % k else ())


def plan_tiling(
    latent_shape: Sequence[int],
    vae: VaeGeometry,
    budget: int,
    cost: Predictor,
    *,
    halo: int | None = None,
    allow_tiling: bool = True,
    temporal_chunking: bool = True,
    split_batch: bool = True,
    min_tile: int = 8,
    max_tile: int | None = None,
    max_frames_per_chunk: int | None = None,
) -> Tiling:
    """The plan with the fewest passes (then least computed area) whose predicted peak <= ``budget``.

    ``min_tile``/``max_tile`` bound the tile core edge in latent px (a latent edge smaller than
    ``min_tile`` is never split). ``halo`` defaults to ``vae.halo``.
    """
    shape = tuple(int(x) for x in latent_shape)
    if len(shape) not in (4, 5):
        raise ValueError(f"latent shape must be (B,C,H,W) or (B,C,T,H,W), got {shape}")
    if any(x < 1 for x in shape):
        raise ValueError(f"latent shape has an empty dimension: {shape}")
    video = len(shape) == 5
    b_total, h, w = shape[0], shape[-2], shape[-1]
    t = shape[2] if video else 0
    halo = vae.halo if halo is None else int(halo)
    if halo < 0 or min_tile < 1:
        raise ValueError("halo must be >= 0 and min_tile >= 1")
    budget = int(budget)

    def axis_options(n: int) -> list[tuple[int, int, int, int]]:
        if not allow_tiling or n <= min_tile:
            return [(n, 1, n, n)]
        lo = 1 if max_tile is None or max_tile >= n else -(-n // max_tile)
        hi = -(-n // min_tile)
        opts = []
        for parts in range(lo, max(lo, hi) + 1):
            opts.extend(
                a
                for a in _axis(n, parts, vae.align, halo)
                if (a[0] >= min_tile or parts == 1) and (max_tile is None or a[0] <= max_tile or parts == lo)
            )
        return opts or [(n, 1, n, n)]

    rows_opts = axis_options(h)
    cols_opts = axis_options(w)
    if video and temporal_chunking and t > 1:
        kmax = t if max_frames_per_chunk is None else max(1, min(t, max_frames_per_chunk))
        k_opts = list(range(kmax, 0, -1))
    else:
        k_opts = [t] if video else [0]
    batch_opts = (
        sorted({-(-b_total // n) for n in range(1, b_total + 1)}, reverse=True) if split_batch else [b_total]
    )

    def geometries(bp: int, th: int, tw: int, chunks: tuple[int, ...]) -> list[Geometry]:
        common = dict(
            latent_h=th,
            latent_w=tw,
            batch=bp,
            spatial_ratio=vae.spatial_ratio,
            temporal_ratio=vae.temporal_ratio,
            job_batch=b_total,
            job_latent_h=h,
            job_latent_w=w,
            job_latent_frames=t,
        )
        if not video:
            return [Geometry(**common)]
        out = [Geometry(latent_frames=chunks[0], first_chunk=True, **common)]
        if len(chunks) > 1:
            out.append(Geometry(latent_frames=max(chunks[1:]), first_chunk=False, **common))
        return out

    def peak(bp: int, th: int, tw: int, chunks: tuple[int, ...]) -> int:
        return max(int(cost.predict(g)) for g in geometries(bp, th, tw, chunks))

    needed = h * w

    def make(
        bp: int, r: tuple[int, int, int, int], c: tuple[int, int, int, int], chunks: tuple[int, ...], pk: int
    ) -> Tiling:
        n_batches = -(-b_total // bp)
        passes = n_batches * r[1] * c[1] * max(1, len(chunks))
        return Tiling(
            latent_shape=shape,
            family=vae.family,
            spatial_ratio=vae.spatial_ratio,
            temporal_ratio=vae.temporal_ratio,
            tile_h=r[0],
            tile_w=c[0],
            halo=halo if (r[1] > 1 or c[1] > 1) else 0,
            rows=r[1],
            cols=c[1],
            images_per_pass=bp,
            chunks=chunks if video else (),
            predicted_peak=pk,
            budget=budget,
            overhead=(r[3] * c[3]) / needed - 1.0,
            passes=passes,
        )

    # The smallest plan allowed: predictions grow with every size, so if it does not fit nothing does.
    rs = min(rows_opts, key=lambda a: (a[2], -a[1]))
    cs = min(cols_opts, key=lambda a: (a[2], -a[1]))
    k_min = min(k_opts)
    b_min = 1 if split_batch else b_total
    chunks_min = _chunks(t, k_min, temporal_chunking) if video else ()
    pk_min = peak(b_min, rs[2], cs[2], chunks_min)
    if pk_min > budget:
        plan = make(b_min, rs, cs, chunks_min, pk_min)
        what = (
            f"tiles of {plan.tile_h}x{plan.tile_w} latent px + halo {plan.halo}"
            if plan.tiled
            else "no tiling"
        )
        if video:
            what += f", chunks of {plan.frames_per_chunk} latent frame(s)"
        have, need, more = (fmt_bytes(n, "MiB", 0, small="KiB") for n in (budget, pk_min, pk_min - budget))
        raise ImpossibleBudgetError(
            f"budget {have} is too small to decode latent {shape} ({vae.family}): the smallest "
            f"plan allowed ({what}, {plan.images_per_pass} per pass) needs {need} "
            f"({pk_min} bytes); free at least {more} more, or allow smaller tiles/chunks",
            budget=budget,
            minimum=pk_min,
            smallest=plan,
        )

    best: tuple[tuple[int, int, int, int], Tiling] | None = None
    for k in k_opts:
        chunks = _chunks(t, k, temporal_chunking) if video else ()
        n_chunks = max(1, len(chunks))
        for bp in batch_opts:
            n_batches = -(-b_total // bp)
            for r in rows_opts:
                if best is not None and n_batches * r[1] * n_chunks > best[0][0]:
                    break
                for c in cols_opts:
                    passes = n_batches * r[1] * c[1] * n_chunks
                    if best is not None and passes > best[0][0]:
                        break
                    pk = peak(bp, r[2], c[2], chunks)
                    if pk > budget:
                        continue
                    misaligned = sum(a[1] > 1 and a[0] % vae.align != 0 for a in (r, c))
                    score = (passes, r[3] * c[3], misaligned, pk)
                    if best is None or score < best[0]:
                        best = (score, make(bp, r, c, chunks, pk))
                    break  # more columns only add passes
    if best is None:  # only with a predictor that is not monotone in the pass size
        best = ((0, 0, 0, 0), make(b_min, rs, cs, chunks_min, pk_min))
    return best[1]


def compute_overhead(plan: Tiling) -> float:
    """Recompute ``plan.overhead`` from its tiles (computed / needed latent area - 1)."""
    h, w = plan.latent_hw
    computed = sum((t.cy1 - t.cy0) * (t.cx1 - t.cx0) for t in plan.tiles())
    return computed / (h * w) - 1.0 if h * w else math.nan
