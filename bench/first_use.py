"""First use vs warm: what a VAE's first decode and first encode cost on a fresh install, per fixture family.

Each family runs in its own fresh process (a new ComfyUI session: no verdict, cost model or layout cached
in memory) with an empty user folder (no ``vramfit/*.json``: a fresh install, the shipped cost models only).
In that process, in this order: core ``VAEDecode`` (untiled, timed: it also warms torch's kernels), then the
pack's node twice on the same latent: the first decode (self-check, calibrations, planning, decode) and the
warm one. With ``--encode`` (default for ``kl_f8`` and ``wan21``) the same for the encode on an image of
``--encode-hw`` (392x520, as issue 43 tried it; a video: ``--frames`` frames of ``--video-px``): core
``VAEEncode``, then Tiled VAE Encode (Temporal-Chunk Video Encode) twice under each of ``--encode-budgets`` (MiB;
0: free memory), the first of each in a fresh user folder. An impossible budget is refused: its first and warm
refusal times are printed. Printed per row: wall seconds of each, the first call's once-per-structure or per-shape
work (the report's ``first use`` row), and the ratios first / warm and first / core.

    .cache/venv/bin/python bench/first_use.py [--px 1024] [--video-px 256 --frames 9] [--budget-mb 0]
                                              [--kinds kl_f8 flux flux2 dcae_sana wan21 wan22 hunyuan_video]
                                              [--encode-kinds kl_f8 wan21] [--encode-budgets 0 220 150]

``--budget-mb`` 0 (default) decodes within free memory, as a user's first run does (untiled when it fits);
a budget forces tiles (the exact path's cost models are then needed too). Goals: first use at most 2x a warm decode
at 1024^2 on CPU (issue 22); the first encode's planning (a new shape's sizing) at most the encode's time: first
<= 1.5x warm (issue 43). Nothing is asserted here; figures go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.first_use")
IMAGE_KINDS = ("kl_f8", "flux", "flux2", "dcae_sana")
VIDEO_KINDS = ("wan21", "wan22", "hunyuan_video")
ENCODE_KINDS = ("kl_f8", "wan21")


def _fresh_user(comfy_mod: Any) -> pathlib.Path:
    """A fresh install's empty user folder for the pack's stores (a new process's stores read it)."""
    user = pathlib.Path(tempfile.mkdtemp(prefix="vramfit-first-use-"))
    comfy_mod.user_cache_file = lambda name, what: user / name
    return user


def _fresh_stores(pack: str) -> None:
    """Forget the stores the process holds (sizing, verdicts, observed ratios): the next call reads the new user
    folder as a fresh install does."""
    import importlib

    importlib.import_module(pack + ".nodes._decode_node")._STORES.clear()
    importlib.import_module(pack + ".memory.decode.self_check")._STORES.clear()


def _encode_rows(nodes: Any, comfy_mod: Any, pack: str, kind: str, vae: Any, pixels: Any,
                 budgets: list[int]) -> list[dict[str, Any]]:
    """Core VAEEncode, then the pack's encode twice per budget, the first in a fresh user folder."""
    import importlib

    video = kind in VIDEO_KINDS
    mod = importlib.import_module(pack + ".nodes.tiled_vae_encode")
    node = "Temporal-Chunk Video Encode" if video else "Tiled VAE Encode"
    t0 = time.perf_counter()
    nodes.VAEEncode().encode(vae, pixels)
    core = time.perf_counter() - t0
    rows = []
    for budget in budgets:
        _fresh_user(comfy_mod)
        _fresh_stores(pack)
        times, first_use, summary, refused = [], "", "", ""
        for _ in range(2):
            t0 = time.perf_counter()
            try:
                r = mod.encode(vae, pixels, budget_mb=budget, node=node)
                first_use = first_use or dict(r.report.rows).get("first use", "")
                summary = summary or r.report.summary
            except Exception as e:  # the node's input error: an impossible budget
                if type(e).__name__ != "NodeInputError":
                    raise
                refused = str(e)
            times.append(time.perf_counter() - t0)
        rows.append({"kind": f"{kind} encode", "latent": list(pixels.shape), "budget_mb": budget, "core_s": core,
                     "first_s": times[0], "warm_s": times[1], "first_use": first_use, "verdict": summary,
                     "refused": refused, "first_over_warm": times[0] / times[1], "first_over_core": times[0] / core})
    return rows


def _one(kind: str, px: int, frames: int, budget_mb: int, threads: int, encode_hw: tuple[int, int] | None = None,
         encode_budgets: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """The measurement of one family (run in a fresh process): its decode row, then its encode rows."""
    import importlib

    import torch

    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.fixtures.files import load_vae
    from scripts.fixtures.kinds import FIXTURES
    from scripts.fixtures.latents import structured_latent
    from scripts.host import HostConfig, load_comfy_in_process

    torch.set_num_threads(threads)
    nodes = load_comfy_in_process()
    video = kind in VIDEO_KINDS
    node_id = "VRAMFit_TemporalChunkVideoDecode" if video else "VRAMFit_TiledVAEDecode"
    mod = sys.modules[nodes.NODE_CLASS_MAPPINGS[node_id].__module__]
    pack = mod.__name__.rsplit(".nodes.", 1)[0]
    comfy_mod = importlib.import_module(pack + ".nodes._comfy")
    _fresh_user(comfy_mod)  # a fresh install's empty user folder

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
        out = [{"kind": kind, "latent": list(shape), "core_s": core, "first_s": first, "warm_s": warm,
                "first_use": rows.get("first use", ""), "verdict": r1.report.summary,
                "first_over_warm": first / warm, "first_over_core": first / core}]
        if encode_hw is not None:
            g = torch.Generator().manual_seed(5)
            n = frames if video else 1
            hw = (px, px) if video else encode_hw
            pixels = torch.rand((n, *hw, 3), generator=g)
            out += _encode_rows(nodes, comfy_mod, pack, kind, vae, pixels, list(encode_budgets) or [0])
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| family | latent / pixels | budget MiB | core s | first s | warm s | first / warm | "
             "first / core | first-use work |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | | | | | | | | failed: {r['error']} |")
            continue
        least = re.search(r"needs (at least )?[\d,.]+ \w+", r.get("refused") or "")
        work = f"refused: {least.group(0) if least else r['refused']}" if r.get("refused") else (r["first_use"] or "-")
        lines.append(f"| {r['kind']} | {tuple(r['latent'])} | {r.get('budget_mb', '-')} | {r['core_s']:.2f} | "
                     f"{r['first_s']:.2f} | {r['warm_s']:.2f} | {r['first_over_warm']:.2f}x | "
                     f"{r['first_over_core']:.2f}x | {work} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=[*IMAGE_KINDS, *VIDEO_KINDS])
    parser.add_argument("--px", type=int, default=1024, help="image side in px")
    parser.add_argument("--video-px", type=int, default=256, help="video frame side in px")
    parser.add_argument("--frames", type=int, default=9, help="video frames (1 + 4k)")
    parser.add_argument("--budget-mb", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--encode-kinds", nargs="*", default=list(ENCODE_KINDS), help="kinds also encoded")
    parser.add_argument("--encode-hw", type=int, nargs=2, default=[392, 520], help="image encode H W in px")
    parser.add_argument("--encode-budgets", type=int, nargs="+", default=[0, 220, 150],
                        help="MiB per encode row (0: free memory); one below the floor is refused")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if args.one is not None:
        px = args.video_px if args.one in VIDEO_KINDS else args.px
        enc = tuple(args.encode_hw) if args.one in args.encode_kinds else None
        rows = _one(args.one, px, args.frames, args.budget_mb, args.threads, enc, tuple(args.encode_budgets))
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    rows = []
    for kind in args.kinds:
        cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--one", kind, "--px", str(args.px),
               "--video-px", str(args.video_px), "--frames", str(args.frames),
               "--budget-mb", str(args.budget_mb), "--threads", str(args.threads),
               "--encode-kinds", *args.encode_kinds, "--encode-hw", *map(str, args.encode_hw),
               "--encode-budgets", *map(str, args.encode_budgets)]
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        lines = done.stdout.strip().splitlines()
        failed = [{"kind": kind, "error": done.returncode}]
        found = json.loads(lines[-1]) if done.returncode == 0 and lines else failed
        log.info("%s", found)
        rows += found
    log.info("\n%s\n\nCPU float32, %d threads, budget_mb %d, each family in a fresh process and user folder",
             _table(rows), args.threads, args.budget_mb)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
