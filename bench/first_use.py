"""First use vs warm: what a VAE's first decode costs on a fresh install, per fixture family, in one run.

Each family runs in its own fresh process (a new ComfyUI session: no verdict, cost model or layout cached
in memory) with an empty user folder (no ``vramfit/*.json``: a fresh install, the shipped cost models only).
In that process, in this order: core ``VAEDecode`` (untiled, timed: it also warms torch's kernels), then the
pack's node twice on the same latent: the first decode (self-check, calibrations, planning, decode) and the
warm one. Printed per family: wall seconds of each, the first decode's once-per-structure work (the report's
``first use`` row), and the ratios first / warm and first / core.

    .cache/venv/bin/python bench/first_use.py [--px 1024] [--video-px 256 --frames 9] [--budget-mb 0]
                                              [--kinds kl_f8 flux flux2 dcae_sana wan21 wan22 hunyuan_video]

``--budget-mb`` 0 (default) decodes within free memory, as a user's first run does (untiled when it fits);
a budget forces tiles (the exact path's cost models are then needed too). Goal (issue 22): first use at most
2x a warm decode at 1024^2 on CPU. Nothing is asserted here; figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.first_use")
IMAGE_KINDS = ("kl_f8", "flux", "flux2", "dcae_sana")
VIDEO_KINDS = ("wan21", "wan22", "hunyuan_video")


def _one(kind: str, px: int, frames: int, budget_mb: int, threads: int) -> dict[str, Any]:
    """The measurement of one family (run in a fresh process)."""
    import importlib

    import torch

    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.fixtures import FIXTURES, load_vae, structured_latent
    from scripts.host import HostConfig, load_comfy_in_process

    torch.set_num_threads(threads)
    nodes = load_comfy_in_process()
    video = kind in VIDEO_KINDS
    node_id = "VRAMFit_TemporalChunkVideoDecode" if video else "VRAMFit_TiledVAEDecode"
    mod = sys.modules[nodes.NODE_CLASS_MAPPINGS[node_id].__module__]
    pack = mod.__name__.rsplit(".nodes.", 1)[0]
    comfy_mod = importlib.import_module(pack + ".nodes._comfy")
    user = pathlib.Path(tempfile.mkdtemp(prefix="vramfit-first-use-"))
    comfy_mod.user_cache_file = lambda name, what: user / name  # a fresh install's empty user folder

    spec = FIXTURES[kind]
    with torch.inference_mode():  # as ComfyUI's executor runs every node, loaders included
        vae = load_vae(nodes, kind, HostConfig.load().models_dir / "vae")
        s, c = spec.spatial_ratio, spec.latent_channels
        shape = (1, c, (frames + 3) // 4, px // s, px // s) if video else (1, c, px // s, px // s)
        z = structured_latent(shape, seed=5)
        t0 = time.perf_counter()
        if kind == "dcae_sana":
            vae.decode(z)
        else:
            nodes.VAEDecode().decode(vae, {"samples": z})
        core = time.perf_counter() - t0
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            r = mod.decode(vae, {"samples": z}, budget_mb=budget_mb)
            runs.append((time.perf_counter() - t0, r))
    (first, r1), (warm, r2) = runs
    rows = dict(r1.report.rows)
    return {"kind": kind, "latent": list(shape), "core_s": core, "first_s": first, "warm_s": warm,
            "first_use": rows.get("first use", ""), "verdict": r1.report.summary,
            "first_over_warm": first / warm, "first_over_core": first / core}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| family | latent | core VAEDecode s | first decode s | warm decode s | first / warm | "
             "first / core | first-use work |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | | | | | | | failed: {r['error']} |")
            continue
        lines.append(f"| {r['kind']} | {tuple(r['latent'])} | {r['core_s']:.2f} | {r['first_s']:.2f} | "
                     f"{r['warm_s']:.2f} | {r['first_over_warm']:.2f}x | {r['first_over_core']:.2f}x | "
                     f"{r['first_use'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=[*IMAGE_KINDS, *VIDEO_KINDS])
    parser.add_argument("--px", type=int, default=1024, help="image side in px")
    parser.add_argument("--video-px", type=int, default=256, help="video frame side in px")
    parser.add_argument("--frames", type=int, default=9, help="video frames (1 + 4k)")
    parser.add_argument("--budget-mb", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.one is not None:
        px = args.video_px if args.one in VIDEO_KINDS else args.px
        sys.stdout.write(json.dumps(_one(args.one, px, args.frames, args.budget_mb, args.threads)) + "\n")
        return 0
    rows = []
    for kind in args.kinds:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--one", kind, "--px", str(args.px),
               "--video-px", str(args.video_px), "--frames", str(args.frames),
               "--budget-mb", str(args.budget_mb), "--threads", str(args.threads)]
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        failed = {"kind": kind, "error": done.returncode}
        row = json.loads(lines[-1]) if done.returncode == 0 and lines else failed
        log.info("%s", row)
        rows.append(row)
    log.info("\n%s\n\nCPU float32, %d threads, budget_mb %d, each family in a fresh process and user folder",
             _table(rows), args.threads, args.budget_mb)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
