"""The one plan type of both decodes (:class:`Plan`) and the video executors' parameters (:class:`Chunking`).
Every planner returns a :class:`Plan`; the decode runs its ``config`` and reports its fields."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["IMAGE_PATHS", "VIDEO_PATHS", "Chunking", "Plan"]

IMAGE_PATHS = ("untiled", "exact", "split", "generic")
"""The VAE's own decode; the exact tiled walker; exact prefix/suffix tiles; approximate tiles with a halo."""
VIDEO_PATHS = ("wan", "carry", "host", "blend")
"""The chunked Wan executor; carried-context chunks (causal decoders without a host cache); the host's own
decode per batch item; overlapping chunks cross-faded."""


@dataclasses.dataclass
class Plan:
    """What a decode runs and what it is predicted to need: the fields of the plan report."""

    path: str
    """One of :data:`IMAGE_PATHS` or :data:`VIDEO_PATHS`."""
    config: Any
    """The executor's parameters: a :class:`.grid.Tiling` (untiled, generic), an :class:`.exact.ExactChoice`
    (exact) or a :class:`Chunking` (video paths)."""
    description: str
    """One line for the report's ``plan`` row."""
    planned: int
    """Predicted peak bytes on the compute device, compared with the budget (0: not predicted)."""
    tracked: int = 0
    """Predicted tensor-level peak (image paths; 0: not predicted)."""
    exact: bool = True
    """The output equals the host's own decode (by construction or by its self-check)."""
    reason: str = ""
    """Why the output is (or is not) exact, for the report."""
    halo: int = 0
    """Latent px of context each tile reads (tiled paths)."""
    feather: int = 0
    """Latent px of the cross-fade inside the halo (approximate tiles of decoders with global ops)."""
    over_budget: bool = False
    """Nothing fits the budget with the user's setting: the smallest plan, run anyway and flagged."""
    units: int = 1
    """Progress units of one batch item (image paths: the executor's steps)."""
    stats: dict = dataclasses.field(default_factory=dict)
    """Planning statistics (video: candidates ``sized`` now, ``bounded`` by the lower bound)."""
    ratio: float = 1.0
    """Measured over predicted peak learned on this machine for this path (``planned`` includes it;
    :mod:`..cost.observed`)."""


@dataclasses.dataclass(frozen=True)
class Chunking:
    """How a video is cut: ``k`` latent frames per chunk after frame 0, spatial tiles, cache and store."""

    k: int
    tile: tuple[int, int] | None = None
    """Tile core in latent px (None: whole frames)."""
    grid: tuple[int, int] = (1, 1)
    split: int = 0
    """The Wan decoder's split point between the tiled part and the global part (tiles only)."""
    rollback: bool = True
    """Keep a tile's committed cache during a chunk (an OOM resumes from its last chunk; 2x one tile's
    cache); False: ComfyUI's in-place protocol (1x; an OOM decodes that tile again from frame 0)."""
    store: str | None = None
    """Where the global part's output of every frame lives with tiles: "device" or "host" (None: whole
    frames, no store)."""

    def needs_more_than(self, f: Chunking) -> bool:
        """Surely needs at least the failed ``f``'s memory: same kind, no smaller in k, tile, cache, store."""
        if (self.tile is None) != (f.tile is None) or self.split != f.split:
            return False
        tile_ok = self.tile is None or (self.tile[0] >= f.tile[0] and self.tile[1] >= f.tile[1])  # type: ignore[index]
        host, f_host = self.store == "host", f.store == "host"
        return tile_ok and self.k >= f.k and self.rollback >= f.rollback and (not host or f_host)
