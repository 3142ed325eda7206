"""Tiled VAE Decode bench: ComfyUI's ``VAEDecode``, ComfyUI's ``VAEDecodeTiled`` (512 / 64) and this pack's
Tiled VAE Decode, in one run, on the random-weight fixture KL VAE (real SD architecture), CPU float32.

For each image size (default 512^2 and 1024^2), in this order, in one process:

1. core ``VAEDecode`` (untiled): the reference image;
2. core ``VAEDecodeTiled`` (tile 512, overlap 64: ComfyUI's defaults);
3. Tiled VAE Decode with ``budget_mb`` = the process RSS peak that ``VAEDecodeTiled`` just reached
   (or, when the exact plan cannot fit that, the smallest budget it can: the planner's minimum);
4. with ``--default``: Tiled VAE Decode with ``budget_mb = 0`` (free memory: untiled when it fits).

Per decode: wall seconds, CPU seconds of the process (``time.process_time``, all threads), the process
RSS high-water mark above the RSS at entry (``PeakTracker(method="rss")``: the same measure for all
three), the tensor-level peak where a model predicts it, and PSNR vs the untiled decode on [0, 1].
Ratios are printed against ``VAEDecodeTiled`` and the untiled decode. Nothing here is asserted (the
test suite checks correctness; the numbers go to docs/BENCHMARKS.md).

    .cache/venv/bin/python bench/tiled_decode.py [--sizes 512 1024] [--threads 2] [--default] [--json out.json]

``--write-defaults`` instead (re)writes the shipped exact cost models of every KL decoder structure of the
fixtures (float32 on CPU, store / recompute; meta sizing, ~10-30 s each), one file per structure in
``memory/cost/data/exact/``: ``kl_cpu.json`` (SD/SDXL ``AutoencoderKL``), ``flux_cpu.json`` (FLUX.1's
``AutoencodingEngine``: same decoder, its own key) and ``flux2_cpu.json`` (FLUX.2: the latent BatchNorm makes
its own structure signature), ``hunyuan_image_cpu.json`` (Hunyuan Image 2.1), then exits. ``--kinds`` writes a
subset.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import pathlib
import platform
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.tiled_decode")
log.setLevel(logging.INFO)
MiB = 2**20
NODE_ID = "VRAMFit_TiledVAEDecode"


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _host() -> tuple[Any, Any]:
    """ComfyUI's ``nodes`` module (in-process ``--cpu`` host, every node loaded) and the node module."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))
    from scripts.host import load_comfy_in_process

    nodes = load_comfy_in_process()
    cls = nodes.NODE_CLASS_MAPPINGS[NODE_ID]
    mod = sys.modules[cls.__module__]
    mod.MEASURE_CPU_TENSORS = False  # the node's own peak as the process RSS: the measure of the other rows
    return nodes, mod


def _load_kl(nodes: Any, kind: str = "kl_f8") -> Any:
    from scripts.fixtures.files import make_models
    from scripts.host import HostConfig

    path = make_models(HostConfig.load().models_dir / "vae", seed=0, kinds=[kind])[kind]
    return nodes.VAELoader().load_vae(path.name)[0]


def _measure(fn: Callable[[], Any]) -> dict[str, Any]:
    from importlib import import_module

    tracker_mod = import_module(_pack_name() + ".memory.measure.tracker")
    c0, w0 = time.process_time(), time.perf_counter()
    with torch.no_grad(), tracker_mod.PeakTracker("cpu", method="rss") as t:
        out = fn()
    return {"out": out, "wall": time.perf_counter() - w0, "cpu": time.process_time() - c0, "rss": t.peak_bytes}


def _pack_name() -> str:
    mod = sys.modules[[m for m in sys.modules if m.endswith(".nodes.tiled_vae_decode")][0]]
    return mod.__name__.rsplit(".nodes.", 1)[0]


def _image_plan() -> Any:
    """The pack's image planning module, as ComfyUI's loader imported it."""
    return importlib.import_module(_pack_name() + ".memory.plan.image")


def _budget_for_tile(mod: Any, vae: Any, z: torch.Tensor, tile: int) -> int:
    """Smallest ``budget_mb`` at which the planner can use ``tile``-px exact tiles (store on the device, with
    or without recomputation): planning only, no decode."""
    env = mod.comfy_env()
    job = mod._validate(vae, {"samples": z}, 0, -1)
    full = _image_plan().full_cost_model(job, env)
    need = 0
    for _ in range(3):  # the mid block's attention slices depend on the budget: iterate to a fixed point
        attention = max(_image_plan().ATTENTION_MIN, need // 4) if need else 1 << 62
        planner = _image_plan().ExactPlanner(job, env, float(full.overhead), attention)
        extra = _image_plan().buffer_bytes(job)
        post = _image_plan().item_image_bytes(job)
        need = min(extra + max(planner.predict(rec, True, tile).with_overhead(float(full.overhead)), post)
                   for rec in (False, True))
    return math.ceil(need / MiB)


def _ours(mod: Any, vae: Any, z: torch.Tensor, budget_mb: int) -> dict[str, Any]:
    c0 = time.process_time()
    r = mod.decode(vae, {"samples": z}, budget_mb=budget_mb)
    return {"out": r.images, "wall": r.seconds, "plan_wall": r.plan_seconds, "rss": r.measured_peak,
            "cpu": time.process_time() - c0, "result": r}


def _ours_row(px: int, label: str, m: dict[str, Any], ref: torch.Tensor) -> dict[str, Any]:
    r = m["result"]
    return {"decode": label, "px": px, **_public(m), "psnr": _psnr(r.images, ref), "tensor_peak": r.plan.tracked,
            "planned": r.plan.planned, "plan": r.plan.description, "report": r.report.text()}


def bench_size(nodes: Any, mod: Any, vae: Any, px: int, default: bool) -> list[dict[str, Any]]:
    from scripts.fixtures.latents import structured_latent
    from scripts.host import core_decode_tiled

    z = structured_latent((1, 4, px // 8, px // 8), seed=5)
    rows: list[dict[str, Any]] = []
    log.info("== %d x %d px ==", px, px)

    core = _measure(lambda: nodes.VAEDecode().decode(vae, {"samples": z})[0])
    ref = core["out"]
    full = _image_plan().full_cost_model(mod._validate(vae, {"samples": z}, 0, -1), mod.comfy_env())
    g = importlib.import_module(_pack_name() + ".memory.geometry").Geometry(px // 8, px // 8, spatial_ratio=8)
    rows.append({"decode": "core VAEDecode (untiled)", "px": px, **_public(core), "psnr": math.inf,
                 "tensor_peak": full.predict_tracked(g), "plan": "untiled"})
    log.info("core VAEDecode: %.1f s wall, %.1f s CPU, RSS +%.0f MiB", core["wall"], core["cpu"], core["rss"] / MiB)

    tiled = _measure(lambda: core_decode_tiled(nodes, vae, {"samples": z}, 512, 64, 64, 8))
    rows.append({"decode": "core VAEDecodeTiled 512/64", "px": px, **_public(tiled), "psnr": _psnr(tiled["out"], ref),
                 "tensor_peak": None, "plan": "3 offset grids of 512-px tiles, averaged"})
    log.info("core VAEDecodeTiled: %.1f s wall, %.1f s CPU, RSS +%.0f MiB, PSNR %.1f dB", tiled["wall"],
             tiled["cpu"], tiled["rss"] / MiB, rows[-1]["psnr"])

    # Warm the exact cost models (first-use calibration) so the timed runs measure the decode.
    mod.decode(vae, {"samples": z[..., :8, :8]}, tile_size=32)
    mod.decode(vae, {"samples": z[..., :8, :8]}, budget_mb=8)

    # (a) at VAEDecodeTiled's peak
    budget_mb = math.ceil(tiled["rss"] / MiB)
    try:
        m = _ours(mod, vae, z, budget_mb)
    except ValueError as e:
        found = re.search(r"needs ([0-9,]+ MiB)", str(e))
        minimum = found.group(1) if found else "?"
        log.info("Tiled VAE Decode at %d MiB: impossible (%s)", budget_mb, e)
        rows.append({"decode": f"Tiled VAE Decode (VRAM Fit), budget {budget_mb} MiB (= VAEDecodeTiled's peak)",
                     "px": px, "skipped": f"impossible: the exact plan needs at least {minimum}"})
    else:
        rows.append(_ours_row(px, f"Tiled VAE Decode (VRAM Fit), budget {budget_mb} MiB (= VAEDecodeTiled's peak)",
                              m, ref))
        log.info("%s", m["result"].report.text())

    # (b) at the smallest budget that allows 256-px tiles
    budget_mb = _budget_for_tile(mod, vae, z, 256)
    if budget_mb * MiB < tiled["rss"]:
        log.info("256-px tiles fit below VAEDecodeTiled's peak; (a) covers it")
    else:
        m = _ours(mod, vae, z, budget_mb)
        rows.append(_ours_row(px, f"Tiled VAE Decode (VRAM Fit), budget {budget_mb} MiB (smallest for 256-px tiles)",
                              m, ref))
        log.info("%s", m["result"].report.text())

    if default:
        m = _ours(mod, vae, z, 0)
        rows.append(_ours_row(px, "Tiled VAE Decode (VRAM Fit), budget 0 (free memory)", m, ref))
        log.info("%s", m["result"].report.text())
    return rows


def _public(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k in ("wall", "cpu", "rss", "plan_wall")}


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| size | decode | wall s | CPU s | RSS peak (MiB) | tensor peak (MiB) | PSNR vs untiled | time vs tiled | "
        "time vs untiled |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for px in sorted({r["px"] for r in rows}):
        group = [r for r in rows if r["px"] == px]
        untiled = next(r for r in group if r["decode"].startswith("core VAEDecode ("))
        tiled = next(r for r in group if r["decode"].startswith("core VAEDecodeTiled"))
        for r in group:
            if "skipped" in r:
                lines.append(f"| {px}² | {r['decode']} | {r['skipped']} | | | | | | |")
                continue
            tp = "-" if r.get("tensor_peak") is None else f"{r['tensor_peak'] / MiB:,.0f}"
            ps = "ref" if math.isinf(r["psnr"]) and r is untiled else f"{r['psnr']:.1f} dB"
            lines.append(
                f"| {px}² | {r['decode']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['rss'] / MiB:,.0f} | {tp} | {ps} | "
                f"{tiled['wall'] / r['wall']:.2f}x faster | {r['wall'] / untiled['wall']:.2f}x |"
            )
    return "\n".join(lines)


DEFAULT_FILES = {"kl_f8": "kl_cpu.json", "flux": "flux_cpu.json", "flux2": "flux2_cpu.json",
                 "hunyuan_image": "hunyuan_image_cpu.json"}
"""Fixture kind -> its shipped exact cost-model file (one KL decoder structure each)."""


def write_defaults(vae: Any, kind: str) -> None:
    """Calibrate the exact cost models ComfyUI uses on CPU (float32) for ``vae``'s structure and ship them in
    ``DEFAULT_FILES[kind]``."""
    from importlib import import_module

    dp = import_module(_pack_name() + ".memory.cost.exact")
    model = vae.first_stage_model
    models = []
    for recompute in (False, True):
        m = dp.calibrate_exact(model, int(vae.latent_channels), torch.float32, "cpu", recompute=recompute,
                               store_on_device=True)
        log.info("%s: %s", kind, m.describe())
        models.append(m)
    path = dp.DEFAULTS_DIR / DEFAULT_FILES[kind]
    dp.write_exact_models(path, models)
    log.info("wrote %s", path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--default", action="store_true", help="also run the node with budget_mb=0")
    parser.add_argument("--json", type=pathlib.Path, default=None)
    parser.add_argument("--write-defaults", action="store_true", help="write the shipped exact cost models and exit")
    parser.add_argument("--kinds", nargs="+", choices=list(DEFAULT_FILES), default=list(DEFAULT_FILES),
                        help="with --write-defaults: the fixture kinds to write (default: all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if "vramfit" not in sys.modules:  # the pack importable without ComfyUI, as in the tests
        spec = importlib.util.spec_from_file_location("vramfit", ROOT / "__init__.py",
                                                      submodule_search_locations=[str(ROOT)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["vramfit"] = module
        spec.loader.exec_module(module)
    torch.set_num_threads(args.threads)
    nodes, mod = _host()
    if args.write_defaults:
        for kind in args.kinds:
            write_defaults(_load_kl(nodes, kind), kind)
        return 0
    vae = _load_kl(nodes)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for px in args.sizes:
        rows.extend(bench_size(nodes, mod, vae, px, args.default))
    try:
        load = " ".join(pathlib.Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        load = "?"
    log.info("\n%s\n\nfixture KL VAE (random weights, SD architecture), float32, CPU, torch %s, %d threads, "
             "%s, load average %s, bench %.0f s", _table(rows), torch.__version__, args.threads,
             platform.platform(), load, time.perf_counter() - t0)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
