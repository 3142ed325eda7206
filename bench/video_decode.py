"""Temporal-Chunk Video Decode bench: ComfyUI's ``VAEDecode``, ComfyUI's ``VAEDecodeTiled`` and this pack's
Temporal-Chunk Video Decode, in one run, on the random-weight fixture Wan 2.1 VAE (real architecture), CPU
float32.

For each size (default 64^2 and 128^2 px, 17 frames = 5 latent frames), in this order, in one process:

1. core ``VAEDecode`` (ComfyUI's one-frame-per-call causal decode): the reference;
2. core ``VAEDecodeTiled`` (tile 64 px / overlap 32, temporal 8 / overlap 4 frames: the smallest settings
   its inputs allow at these sizes, so it tiles in space and time);
3. Temporal-Chunk Video Decode, auto plan (``budget_mb = 0``: the fastest plan, whole frames);
4. Temporal-Chunk Video Decode with ``budget_mb`` = 40 % of core ``VAEDecode``'s measured peak (issue 5's
   memory target; the planner picks tile-major tiles).

The node's plan is made before each tracked decode and timed apart, twice: **cold** (an empty peak store:
every candidate the planner needs is meta-sized) and **warm** (a new store read from the file the cold plan
wrote: what a second ComfyUI run finds in its user folder; no sizing).

Per decode: wall seconds, the live-tensor peak (``PeakTracker(method="dispatch")``: the same measure for
all, the output included), and the max abs diff vs ``VAEDecode`` on [0, 1]. The VAE is loaded and every
decode and sizing runs under ``torch.inference_mode``, as ComfyUI's executor runs nodes. Ratios against
``VAEDecode``.
Nothing is asserted (tests check correctness; numbers go to docs/BENCHMARKS.md).

    .cache/venv/bin/python bench/video_decode.py [--sizes 64 128] [--frames 17] [--threads 2] [--json out.json]
        [--no-tiled-above 128] [--meta 832x480x81 1280x720x81 --meta-only]

``--plan-only [--budgets MiB ...]``: no decode; per size, the node's plan for free memory and for the given
budget (default: the 40 % budgets of the last full run, 27 / 108 / 434 MiB for 64 / 128 / 256 px), cold and
warm, with the number of candidates sized and skipped by the lower bound.

``--meta WxHxF ...``: no decode; meta-sized (``MetaSizer``: fake tensors, exact live-tensor bytes) peaks of
the real-size fixture Wan 2.1 VAE in bfloat16 for core ``first_stage_model.decode`` (what ``VAEDecode``
runs on the device) and for the executor's plans (whole frames; tile-major grids with the store on the
host, i.e. on a ``meta`` device that is not counted, as pinned host memory is not on a GPU). Attention is
switched to ComfyUI's ``pytorch_attention`` (SDPA, as on a GPU) for these rows. Predictions pending a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import platform
import sys
import tempfile
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
    """ComfyUI's ``nodes`` module, the node module and the pack's tracker module (as ComfyUI imported them);
    the engine is ``memory.decode.video`` (planning: ``memory.plan.video``)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.host import load_comfy_in_process

    nodes = load_comfy_in_process()
    cls = nodes.NODE_CLASS_MAPPINGS[NODE_ID]
    mod = sys.modules[cls.__module__]
    base = cls.__module__.rsplit(".nodes.", 1)[0]
    return nodes, mod, sys.modules[f"{base}.memory.measure.tracker"]


def _measure(tracker_mod: Any, fn: Callable[[], Any]) -> dict:
    # under inference mode, as ComfyUI runs nodes
    with torch.inference_mode(), tracker_mod.PeakTracker("cpu", method="dispatch") as t:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    return {"out": out, "wall": wall, "peak": int(t.peak_bytes)}


def bench_size(nodes: Any, mod: Any, tracker_mod: Any, vae: Any, px: int, frames: int, store_dir: pathlib.Path,
               tiled_max: int = 1 << 30) -> list[dict]:
    from scripts.fixtures.latents import structured_latent
    from scripts.host import core_decode_tiled

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
             "plan": extra, "calls": m.get("calls"), "moves": m.get("moves")}
        rows.append(r)
        log.info("%-36s %7.1f s (%.2fx)  peak %7.1f MiB (%.2fx)  max diff %.1e  %s", name, r["seconds"],
                 r["time_vs_core"], r["peak_mib"], r["peak_vs_core"], diff, extra)

    log.info("== Wan 2.1 fixture, %d x %d px x %d frames (latent %s) ==", px, px, frames, tuple(z.shape))
    row("core VAEDecode", core)
    if px <= tiled_max:
        tiled = _measure(tracker_mod, lambda: core_decode_tiled(nodes, vae, {"samples": z}, 64, 32, 8, 4))
        row("core VAEDecodeTiled 64/32, 8/4", tiled)
    # Plan first, cold then warm, so the tracked decode below counts only the decode, as in the node (its
    # tracker starts after planning); the planning times are reported.
    plan_auto, cold, warm, st = _plan_of(mod, vae, z, 0, store_dir)
    auto = _node(mod, tracker_mod, vae, z, 0)
    row("Temporal-Chunk, auto", auto, f"{plan_auto.description}, {_cache(plan_auto)}; planned cold {cold:.2f} s "
        f"({st['sized']} sized), warm {warm:.3f} s; {_traffic(mod, vae, z, auto)}")
    budget_mb = max(1, int(0.40 * core["peak"] / MiB))
    try:
        plan_tight, cold, warm, st = _plan_of(mod, vae, z, budget_mb, store_dir)
        tight = _node(mod, tracker_mod, vae, z, budget_mb)
        row(f"Temporal-Chunk, budget {budget_mb} MiB (40 % of VAEDecode)", tight,
            f"{plan_tight.description}, {_cache(plan_tight)}; predicted {plan_tight.planned / MiB:.1f} MiB; planned "
            f"cold {cold:.2f} s ({st['sized']} sized, {st['bounded']} bounded), warm {warm:.3f} s; "
            f"{_traffic(mod, vae, z, tight)}")
    except ValueError as e:
        log.info("Temporal-Chunk at %d MiB: impossible (%s)", budget_mb, e)
    return rows


def _node(mod: Any, tracker_mod: Any, vae: Any, z: torch.Tensor, budget_mb: int) -> dict:
    """The node's decode, measured; ``result`` keeps its plan and stats (decoder calls, copies)."""
    res: list = []
    m = _measure(tracker_mod, lambda: res.append(mod.decode(vae, {"samples": z}, budget_mb=budget_mb)) or
                 res[-1].images)
    m["result"] = res[-1]
    return m


def _cache(plan: Any) -> str:
    if plan.path != "wan":
        return "the host's own decode"
    return "rollback cache" if plan.config.rollback else "in-place cache"


def _traffic(mod: Any, vae: Any, z: torch.Tensor, m: dict) -> str:
    """Decoder calls and the copies between compute device and latent / output / store (``stats["moves"]``: on
    a GPU with ComfyUI's placement, host<->device but for a device store's), checked against the plan's
    prediction (``memory.plan.video.traffic``; a row says "NOT as predicted" otherwise)."""
    r = m["result"]
    st = r.stats
    m["calls"], m["moves"] = st.get("calls"), st.get("moves")
    if r.plan.path != "wan":
        return f"{st.get('units', '?')} host decode call(s)"
    pv = sys.modules[f"{mod.__name__.rsplit('.nodes.', 1)[0]}.memory.plan.video"]
    want = pv.traffic(mod._validate(vae, {"samples": z}, 0, 0), r.plan.config)
    moves = st.get("moves", {})
    text = ", ".join(f"{k} {n} ({b / MiB:.1f} MiB)" for k, (n, b) in sorted(moves.items()))
    same = want["calls"] == st.get("calls") and want["moves"] == moves
    return f"{st.get('calls')} decoder calls; copies: {text}{'' if same else ' (NOT as predicted: ' + str(want) + ')'}"


def _plan_of(mod: Any, vae: Any, z: torch.Tensor, budget_mb: int, store_dir: pathlib.Path) -> tuple:
    """The plan the node makes for this input, cold (empty peak store) and warm (the store re-read from the
    file the cold plan wrote): ``(plan, cold s, warm s, cold plan stats)``. Raises ValueError if impossible."""
    base = mod.__name__.rsplit(".nodes.", 1)[0]
    pv = sys.modules[f"{base}.memory.plan.video"]
    job = mod._validate(vae, {"samples": z}, 0, 0)
    budget = int(mod._comfy.vae_budget(vae, budget_mb).available)
    path = store_dir / f"peaks-{'x'.join(map(str, z.shape))}-{budget_mb}.json"
    path.unlink(missing_ok=True)
    st: dict = {}
    t0 = time.perf_counter()
    try:
        plan = pv.plan(job, budget, pv.PeakStore(path))  # the node's planner (auto: capped by the host decode)
        st.update({"sized": 0, "bounded": 0, **(plan.stats or {})})
    finally:
        cold = time.perf_counter() - t0
        log.info("plan at %s MiB: cold %.2f s, %s", budget_mb or "free", cold, st)
    t0 = time.perf_counter()
    warm_store = pv.PeakStore(path)
    pv.plan(job, budget, warm_store)
    warm = time.perf_counter() - t0
    # the node's decode below plans warm: the tracked run is the decode
    sys.modules[f"{base}.nodes._decode_node"]._STORES["video_peaks.json"] = warm_store
    return plan, cold, warm, st


def plan_rows(mod: Any, vae: Any, px: int, frames: int, budget_mb: int, store_dir: pathlib.Path) -> list[dict]:
    """Planning only: the auto plan (free memory) and the plan at ``budget_mb``, cold and warm."""
    from scripts.fixtures.latents import structured_latent

    z = structured_latent((1, 16, (frames - 1) // 4 + 1, px // 8, px // 8), seed=0)
    rows = []
    for mb in (0, budget_mb):
        name = f"{px}x{px}x{frames} " + (f"budget {mb} MiB" if mb else "free memory")
        try:
            plan, cold, warm, st = _plan_of(mod, vae, z, mb, store_dir)
            text = f"{plan.description}, {'rollback' if plan.config.rollback else 'in place'}; {plan.planned / MiB:.1f} MiB"
        except ValueError as e:
            cold, warm, st, text = float("nan"), float("nan"), {}, f"impossible: {e}"
        rows.append({"case": name, "cold_s": cold, "warm_s": warm, **st, "plan": text})
        log.info("| %s | %.2f | %.3f | %s | %s | %s |", name, cold, warm, st.get("sized", "?"), st.get("bounded", "?"),
                 text)
    return rows


def meta_rows(nodes: Any, mod: Any, vae: Any, spec: str) -> list[dict]:
    """Meta-sized bf16 peaks (GiB) for one ``WxHxF`` size: core decode and the executor's plans."""
    from comfy.ldm.modules.diffusionmodules.model import pytorch_attention

    base = mod.__name__.rsplit(".nodes.", 1)[0]
    sizing = sys.modules[f"{base}.memory.measure.sizing"]
    vc = sys.modules[f"{base}.memory.executors.wan"]
    wl = sys.modules[f"{base}.memory.vae.wan_layout"]
    pv = sys.modules[f"{base}.memory.plan.video"]
    W, H, F = (int(v) for v in spec.lower().split("x"))
    m = vae.first_stage_model
    lay = wl.wan_layout(m)
    r = lay.spatial_ratio
    h, w, t = H // r, W // r, (F - 1) // lay.temporal_ratio + 1
    saved = {}
    for sub in m.modules():
        if hasattr(sub, "optimized_attention"):
            saved[sub] = sub.optimized_attention
            sub.optimized_attention = pytorch_attention  # SDPA, as ComfyUI uses on a GPU
    dt, dev = torch.bfloat16, torch.device("cpu")

    def peak(fn: Callable[[torch.Tensor], Any]) -> tuple[float, float]:
        t0 = time.perf_counter()
        with torch.inference_mode(), sizing.MetaSizer([m], dt, dev) as sz:
            z = torch.empty((1, lay.latent_channels, t, h, w), dtype=dt, device=dev)
            fn(z)
            del z
        return sz.peak_bytes / 2**30, time.perf_counter() - t0

    rows: list[dict] = []
    try:
        core, secs = peak(lambda z: m.decode(z))
        log.info("== meta %s (latent %dx%dx%d), bf16: core first_stage_model.decode %.2f GiB (%.0f s) ==", spec, t, h,
                 w, core, secs)
        rows.append({"size": spec, "decoder": "core VAEDecode (first_stage_model.decode)", "peak_gib": core,
                     "peak_vs_core": 1.0, "area": 1.0})
        split = lay.default_split
        halo = lay.split_info(split).halo
        cfgs: list[tuple[str, Any, bool, bool]] = [("whole frames, rollback", None, True, False),
                                                   ("whole frames, in place", None, False, False)]
        for g in (2, 3, 4):
            tile = (-(-h // g), -(-w // g))
            for rb in (True, False):
                cfgs.append((f"tile-major {g}x{g}, host store, {'rollback' if rb else 'in place'}", tile, rb, True))
        cfgs.append(("tile-major 2x2, device store, rollback", (-(-h // 2), -(-w // 2)), True, False))
        for name, tile, rb, host in cfgs:
            p, secs = peak(lambda z, tile=tile, rb=rb, host=host: vc.decode_wan_chunked(
                m, z, 1, tile, out_device="meta", store_device="meta" if host else None, rollback=rb))
            area = pv.area_factor(h, w, tile, halo)
            rows.append({"size": spec, "decoder": f"Temporal-Chunk k = 1, {name}", "peak_gib": p,
                         "peak_vs_core": p / core, "area": area})
            log.info("  %-52s %6.2f GiB (%.2fx core), tiled-part area %.2fx (%.0f s)", name, p, p / core, area, secs)
    finally:
        for sub, fn in saved.items():
            sub.optimized_attention = fn
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--no-tiled-above", type=int, default=1 << 30, help="skip VAEDecodeTiled above this size")
    parser.add_argument("--meta", nargs="*", default=[], help="WxHxF sizes to meta-size in bf16 (no decode)")
    parser.add_argument("--meta-only", action="store_true", help="only the --meta rows")
    parser.add_argument("--plan-only", action="store_true", help="only plan (cold and warm), no decode")
    parser.add_argument("--budgets", type=int, nargs="+", default=[], help="--plan-only budgets (MiB) per size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    nodes, mod, tracker_mod = _host()
    from scripts.fixtures.files import make_models
    from scripts.host import HostConfig

    cfg = HostConfig.load()
    paths = make_models(cfg.models_dir / "vae", seed=0, kinds=["wan21"])
    with torch.inference_mode():  # as ComfyUI's executor runs VAELoader
        vae = nodes.VAELoader().load_vae(paths["wan21"].name)[0]
    log.info("fixture Wan 2.1 VAE (random weights), float32, CPU, torch %s, %d threads, %s", torch.__version__,
             args.threads, platform.processor() or platform.machine())
    rows: list[dict] = []
    for spec in args.meta:
        rows += meta_rows(nodes, mod, vae, spec)
    if args.meta_only:
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    if args.plan_only:
        mod._comfy.load_vae_weights(vae, 0)  # as after a decode: the budget does not count weights to load
        budgets = args.budgets or [{64: 27, 128: 108, 256: 434}.get(px, 0) for px in args.sizes]
        log.info("| case | cold (s) | warm (s) | sized | bounded | plan |\n|---|---|---|---|---|---|")
        with tempfile.TemporaryDirectory() as store_dir:
            for px, mb in zip(args.sizes, budgets, strict=True):
                rows += plan_rows(mod, vae, px, args.frames, mb, pathlib.Path(store_dir))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    meta_n = len(rows)
    with tempfile.TemporaryDirectory() as store_dir:
        for px in args.sizes:
            rows += bench_size(nodes, mod, tracker_mod, vae, px, args.frames, pathlib.Path(store_dir),
                               args.no_tiled_above)
    log.info("\n| size | decoder | time (s) | vs VAEDecode | peak (MiB) | vs VAEDecode | max abs diff | plan |")
    log.info("|---|---|---|---|---|---|---|---|")
    for r in rows[meta_n:]:
        log.info("| %s | %s | %.1f | %.2fx | %.1f | %.2fx | %.1e | %s |", r["size"], r["decoder"], r["seconds"],
                 r["time_vs_core"], r["peak_mib"], r["peak_vs_core"], r["max_abs_diff"], r["plan"])
    log.info("load average at the end: %s", " ".join(f"{v:.2f}" for v in os.getloadavg()))
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k not in ("out", "result")} for r in rows],
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
