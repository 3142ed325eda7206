"""Helpers shared by the decode tests (import as ``tests.helpers``; fixtures live in ``conftest.py``).

* :func:`psnr`: images on [0, 1].
* :func:`seam_ratio`: mean abs error in bands centred on tile borders / mean abs error elsewhere, each
  plus a floor (``FLOOR`` = 1e-5, 1/400 of an 8-bit step) so that float noise of ~1e-7 cannot make a
  ratio of two near-zeros meaningful.
* :func:`exact_tile_borders`: full-resolution positions of every tile border of every segment of an
  exact tiled decode.
* :func:`one_thread`: one intra-op thread (the ``one_thread`` fixture): on the shared 2-core machine
  2 OpenMP threads made the tiled host modules ~2.3x slower in wall time (147 s vs 64 s measured
  under load) and the tiny-decoder unit modules ~10x.
* :func:`load_vae`: a VAE as ComfyUI's executor loads it (``VAELoader`` under ``torch.inference_mode``:
  ComfyUI runs every node so, and decodes are run the same way by the host tests), so that no plan is
  validated in a mode users never run (issue 22: views of inference tensors have no ``_base``).
* :func:`unload_and_watch` / :func:`assert_freed`: a VAE unloaded and dropped is freed, and ComfyUI keeps no dead
  entry for it (a cache holding the model would leak it and make ComfyUI collect all garbage on every later load).
* :func:`require_0_33` / :func:`pack_engine`: the newest-upstream tests' host check and the pack's engine modules
  as ComfyUI loads them (under the pack's folder path).
* :func:`sized_needs`: every plan's meta-sized need of one encode job (the encoder's own forward, each candidate
  tile), for the lower-bound tests.
* :data:`full_size`: the mark of a test on a full-size fixture of a family that the default run covers with its
  narrow twin (``scripts.fixtures.kinds.NARROW_KINDS``); it runs only with ``VRAMFIT_FULL_FIXTURES=1`` (``.ci/run``
  sets it): GBs of memory and minutes on a 2-core CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

FLOOR = 1e-5

FULL_FIXTURES = os.environ.get("VRAMFIT_FULL_FIXTURES", "") not in ("", "0")
full_size = pytest.mark.skipif(
    not FULL_FIXTURES, reason="a full-size fixture (narrow twin in the default run): set VRAMFIT_FULL_FIXTURES=1")


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images on [0, 1] (inf when equal)."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def seam_ratio(out: torch.Tensor, ref: torch.Tensor, ys: Iterable[int], xs: Iterable[int], band: int = 8,
               floor: float = FLOOR) -> float:
    """``out``/``ref``: (B, H, W, C). Error in ``band``-px bands centred on rows ``ys`` and columns ``xs``
    over the error elsewhere (each + ``floor``)."""
    err = (out.double() - ref.double()).abs().mean(dim=-1)  # (B, H, W)
    mask = torch.zeros(err.shape[1:], dtype=torch.bool)
    for y in ys:
        mask[max(0, y - band // 2) : y + band // 2, :] = True
    for x in xs:
        mask[:, max(0, x - band // 2) : x + band // 2] = True
    return (err[:, mask].mean().item() + floor) / (err[:, ~mask].mean().item() + floor)


def exact_tile_borders(plan: Any, ratio: int) -> tuple[set[int], set[int]]:
    """Output-px rows and columns of every internal tile border of every segment of ``plan`` (an
    ``ExactGeometry`` of ``memory.vae.kl_layout``); ``ratio``: output px per latent px."""
    from vramfit.memory.tiles import split_even

    ys: set[int] = set()
    xs: set[int] = set()
    _, _, lh, lw = plan.latent_shape
    for info in plan.segments:
        s = info.level_scale
        f = ratio // s
        ys |= {a * f for a, _ in split_even(lh * s, plan.tile[0])[1:]}
        xs |= {a * f for a, _ in split_even(lw * s, plan.tile[1])[1:]}
    return ys, xs


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One intra-op torch thread inside the block; the previous count is restored."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def load_vae(comfy: Any, name: str) -> Any:
    """``VAELoader().load_vae(name)`` under ``torch.inference_mode`` (as ComfyUI's executor runs the loader);
    ``comfy``: ComfyUI's ``nodes`` module. Its weights are inference tensors that require grad: decode it
    under inference mode (or ``no_grad``) only, as ComfyUI does; a core ``VAEDecode`` outside both raises."""
    with torch.inference_mode():
        return comfy.VAELoader().load_vae(name)[0]


def unload_and_watch(vae: Any) -> Any:
    """Unload ``vae`` from ComfyUI (every other model kept) and return a weak reference to its model: drop the VAE,
    then :func:`assert_freed`."""
    import weakref

    import comfy.model_management as mm

    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)
    return weakref.ref(vae.first_stage_model)


def assert_freed(model: Any, what: str) -> None:
    """``model`` (from :func:`unload_and_watch`) is gone after a collection and ComfyUI has no dead entry."""
    import gc

    import comfy.model_management as mm

    gc.collect()
    if model() is not None:
        holders = [f"{type(r).__qualname__} held by {[type(o).__qualname__ for o in gc.get_referrers(r)][:4]}"
                   for r in gc.get_referrers(model())]
        raise AssertionError(f"{what}: the VAE's model is still alive: {holders}")
    assert not [lm for lm in mm.current_loaded_models if lm.is_dead()], what


def require_0_33() -> None:
    """Skip unless the host is ComfyUI 0.33.0: the newest upstream files load over its tree (scripts/upstream.py)."""
    import comfyui_version

    if comfyui_version.__version__ != "0.33.0":
        pytest.skip(f"the newest upstream files load over a ComfyUI 0.33.0 tree (scripts/upstream.py); this host is "
                    f"{comfyui_version.__version__}")


def pack_engine(node_module: Any, name: str) -> Any:
    """The pack's module ``memory.<name>`` beside ``node_module`` (ComfyUI loads the pack under its folder path)."""
    import sys

    return sys.modules[f"{node_module.__name__.rsplit('.nodes.', 1)[0]}.memory.{name}"]


def sized_needs(pe: Any, job: Any) -> list[int]:
    """Every plan's sized need of an encode ``job``, its latent included: the encoder's own forward, then each of
    :func:`memory.plan.encode.candidates` (``pe``: the pack's ``memory.plan.encode`` as the test imports it)."""
    extra, peaks, attn = pe._out_bytes(job), pe.PeakStore(), pe.attention_bytes(1 << 30)
    return [extra + pe.encode_peak(job, cfg, peaks, attn) for cfg in (None, *pe.candidates(job))]
