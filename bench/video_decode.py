"""Temporal-Chunk Video Decode bench: ComfyUI's ``VAEDecode``, ComfyUI's ``VAEDecodeTiled`` and this pack's
Temporal-Chunk Video Decode, in one run, on the random-weight fixture Wan 2.1 VAE (real architecture), CPU
float32.

For each size (default 64^2 and 128^2 px, 17 frames = 5 latent frames), in this order, in one process:

1. core ``VAEDecode`` (ComfyUI's one-frame-per-call causal decode): the reference;
2. core ``VAEDecodeTiled`` (tile 64 px / overlap 32, temporal 8 / overlap 4 frames: the smallest settings
   its inputs allow at these sizes, so it tiles in space and time);
3. Temporal-Chunk Video Decode, auto plan (``budget_mb = 0``);
4. Temporal-Chunk Video Decode with ``budget_mb`` = 75 % of the auto plan's predicted peak (a re-plan).

The node's plan (meta sizing, cached per shape) is made before each tracked decode and timed apart.

Per decode: wall seconds, the live-tensor peak (``PeakTracker(method="dispatch")``: the same measure for
all, the output included), and the max abs diff vs ``VAEDecode`` on [0, 1]. Ratios against ``VAEDecode``.
Nothing is asserted (tests check correctness; numbers go to docs/BENCHMARKS.md).

    .cache/venv/bin/python bench/video_decode.py [--sizes 64 128] [--frames 17] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.video_decode")
log.setLevel(logging.INFO)
MiB = 2**20
NODE_ID = "VRAMFit_TemporalChunkVideoDecode"


def _host() -> tuple[Any, Any, Any]:
    """ComfyUI's ``nodes`` module, the node module and the pack's tracker module (as ComfyUI imported them)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.host import load_comfy_in_process

    nodes = load_comfy_in_process()
    cls = nodes.NODE_CLASS_MAPPINGS[NODE_ID]
    mod = sys.modules[cls.__module__]
    base = cls.__module__.rsplit(".nodes.", 1)[0]
    return nodes, mod, sys.modules[f"{base}.memory.tracker"]


def _measure(tracker_mod: Any, fn: Callable[[], Any]) -> dict:
    with torch.no_grad(), tracker_mod.PeakTracker("cpu", method="dispatch") as t:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    return {"out": out, "wall": wall, "peak": int(t.peak_bytes)}


def bench_size(nodes: Any, mod: Any, tracker_mod: Any, vae: Any, px: int, frames: int) -> list[dict]:
    from scripts.fixtures import structured_latent

    t = (frames - 1) // 4 + 1
    z = structured_latent((1, 16, t, px // 8, px // 8), seed=0)
    rows: list[dict] = []

    core = _measure(tracker_mod, lambda: nodes.VAEDecode().decode(vae, {"samples": z})[0])
    ref = core["out"]

    def row(name: str, m: dict, extra: str = "") -> None:
        img = m["out"]
        diff = (img.float() - ref.float()).abs().max().item() if img.shape == ref.shape else float("nan")
        r = {"size": f"{px}x{px}x{frames}", "decoder": name, "seconds": m["wall"], "peak_mib": m["peak"] / MiB,
             "max_abs_diff": diff, "time_vs_core": m["wall"] / core["wall"], "peak_vs_core": m["peak"] / core["peak"],
             "plan": extra}
        rows.append(r)
        log.info("%-36s %7.1f s (%.2fx)  peak %7.1f MiB (%.2fx)  max diff %.1e  %s", name, r["seconds"],
                 r["time_vs_core"], r["peak_mib"], r["peak_vs_core"], diff, extra)

    log.info("== Wan 2.1 fixture, %d x %d px x %d frames (latent %s) ==", px, px, frames, tuple(z.shape))
    row("core VAEDecode", core)
    tiled = _measure(tracker_mod, lambda: nodes.VAEDecodeTiled().decode(vae, {"samples": z}, 64, 32, 8, 4)[0])
    row("core VAEDecodeTiled 64/32, 8/4", tiled)
    # Plan first (meta sizing on fake tensors, cached per shape) so the tracked decode below counts only
    # the decode, as in the node (its tracker starts after planning); the planning time is reported.
    t0 = time.perf_counter()
    plan_auto = _plan_of(mod, vae, z, 0)
    plan_s = time.perf_counter() - t0
    auto = _measure(tracker_mod, lambda: mod.decode(vae, {"samples": z}).images)
    row("Temporal-Chunk, auto", auto, f"{plan_auto.describe()}; planned in {plan_s:.2f} s")
    budget_mb = max(1, int(0.75 * plan_auto.planned / MiB))
    try:
        t0 = time.perf_counter()
        plan_tight = _plan_of(mod, vae, z, budget_mb)
        plan_s = time.perf_counter() - t0
        tight = _measure(tracker_mod, lambda: mod.decode(vae, {"samples": z}, budget_mb=budget_mb).images)
        row(f"Temporal-Chunk, budget {budget_mb} MiB", tight,
            f"{plan_tight.describe()}, {'rollback' if plan_tight.rollback else 'in-place'} cache; predicted "
            f"{plan_tight.planned / MiB:.1f} MiB; planned in {plan_s:.2f} s")
    except ValueError as e:
        log.info("Temporal-Chunk at %d MiB: impossible (%s)", budget_mb, e)
    return rows


def _plan_of(mod: Any, vae: Any, z: torch.Tensor, budget_mb: int) -> Any:
    """The plan the node makes for this input (meta sizes are cached: no decode, no re-sizing)."""
    job = mod._validate(vae, {"samples": z}, 0, 0)
    budget = mod._comfy.vae_budget(vae, budget_mb)
    return mod._plan_wan(job, int(budget.available), 0, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    nodes, mod, tracker_mod = _host()
    from scripts.fixtures import make_models
    from scripts.host import HostConfig

    cfg = HostConfig.load()
    paths = make_models(cfg.models_dir / "vae", seed=0, kinds=["wan21"])
    vae = nodes.VAELoader().load_vae(paths["wan21"].name)[0]
    log.info("fixture Wan 2.1 VAE (random weights), float32, CPU, torch %s, %d threads, %s", torch.__version__,
             args.threads, platform.processor() or platform.machine())
    rows: list[dict] = []
    for px in args.sizes:
        rows += bench_size(nodes, mod, tracker_mod, vae, px, args.frames)
    log.info("\n| size | decoder | time (s) | vs VAEDecode | peak (MiB) | vs VAEDecode | max abs diff | plan |")
    log.info("|---|---|---|---|---|---|---|---|")
    for r in rows:
        log.info("| %s | %s | %.1f | %.2fx | %.1f | %.2fx | %.1e | %s |", r["size"], r["decoder"], r["seconds"],
                 r["time_vs_core"], r["peak_mib"], r["peak_vs_core"], r["max_abs_diff"], r["plan"])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
