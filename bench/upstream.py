"""Newest upstream VAE structures bench: each VAE structure that is new on the newest upstream ComfyUI code, the host's
own ``VAEDecode`` / ``VAEEncode`` against this pack's node, in one run, CPU float32, ComfyUI 0.33.0.

The newest stored upstream VAE files (``tests/upstream/files``) are loaded over the 0.33.0 host's modules
(``scripts.upstream.newest``, with MiniMax's newer ``linear_input_act`` and no pinned offload on a CPU) and each VAE is
built as the newest ``comfy/sd.py`` builds it, narrow with random weights, as the tests build them
(``scripts/upstream_wan.py``, ``upstream_seedvr2.py``, ``upstream_minimax.py``):

* Qwen-Image 2.1's VAE: decode 512x512 (host ``VAEDecode``; Tiled VAE Decode auto, at 40 % and 20 % of the host
  decode's measured peak) and encode 512x512 (host ``VAEEncode``; Tiled VAE Encode auto and at 75 % of its peak);
* SeedVR2 (the rewritten ``seedvr/vae.py``): decode 9 frames of 256x256 (host; Temporal-Chunk Video Decode auto and at
  85 % of the host's peak);
* MiniMax H3 (the newest neighbour-blended grid): decode 39 frames of 160x160 (host; Temporal-Chunk Video Decode auto
  and at 90 % of the host's peak: its one-tile plan, output included, fits there), float weights and the decoder's
  linears int8 + ConvRot.

Each row calls its decode (or encode) twice on the same input: the first call (the node's first-use self-check and
sizing happen then: the user folder is a fresh temporary one), its time in its own column, then the measured call.
Both run under ``torch.inference_mode`` (as ComfyUI's executor runs nodes) and a ``PeakTracker(method="dispatch")``:
live tensor bytes above the call's start, its output included, the same measure for every row. Ratios are against
the host's call of the same group; the max abs diff is against its output (on [0, 1]; encodes: the latent). A peak
over the row's budget is marked (the whole call's, output included: the plan counts the output buffer; the report's
``measured`` row, in the verdict line, starts after that buffer is made). An impossible budget is a row with the
node's message. Nothing is asserted (tests check correctness; numbers go to docs/BENCHMARKS.md).

    set -a; source .cache/env033; set +a; $VRAMFIT_PYTHON -m bench.upstream [--quick] [--threads 2] [--json out.json]
        [--only qwen21 seedvr2 minimax]

``--quick``: tiny sizes (under a minute in all, the host's start included), the same rows; budgets there are mostly
impossible or over (fixed costs dominate), a smoke run only.
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
log = logging.getLogger("vramfit.bench.upstream")
log.setLevel(logging.INFO)
MiB = 2**20
NODES = {"tiled": "VRAMFit_TiledVAEDecode", "video": "VRAMFit_TemporalChunkVideoDecode",
         "encode": "VRAMFit_TiledVAEEncode"}

SIZES = {
    # name: (full, quick)
    "qwen_px": (512, 128),
    "qwen_encode_px": (512, 128),
    "seedvr2": ((1, 16, 3, 32, 32), (1, 16, 3, 6, 5)),  # 9 frames of 256x256 (quick: 48x40)
    "minimax": ((1, 24, 12, 10, 10), (1, 24, 2, 6, 6)),  # 39 frames of 160x160 (quick: 5 frames of 96x96)
}
BUDGETS = {
    # fractions of the host call's measured peak (None: auto, budget_mb 0)
    "qwen_decode": [None, 0.40, 0.20],
    "qwen_encode": [None, 0.75],
    "seedvr2": [None, 0.85],
    "minimax": [None, 0.90],
}


class Bench:
    """The host in-process (``--cpu``), the pack's node modules and tracker as ComfyUI loaded them, and the rows."""

    def __init__(self, user_dir: pathlib.Path) -> None:
        if str(ROOT) not in sys.path:
            sys.path.append(str(ROOT))
        from scripts.host import load_comfy_in_process

        self.nodes = load_comfy_in_process()
        self.mods = {k: sys.modules[self.nodes.NODE_CLASS_MAPPINGS[v].__module__] for k, v in NODES.items()}
        base = self.mods["tiled"].__name__.rsplit(".nodes.", 1)[0]
        self.tracker = sys.modules[f"{base}.memory.measure.tracker"]
        self.comfy = sys.modules[f"{base}.nodes._comfy"]
        self.input_error = self.comfy.NodeInputError
        # a fresh install's empty user folder: the first call of each structure self-checks and sizes
        self.comfy.user_cache_file = lambda name, what: user_dir / name
        sys.modules[f"{base}.nodes._decode_node"]._STORES.clear()
        self.rows: list[dict[str, Any]] = []

    def measure(self, fn: Callable[[], Any]) -> dict[str, Any]:
        with torch.inference_mode(), self.tracker.PeakTracker("cpu", method="dispatch") as t:
            t0 = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - t0
        return {"out": out, "wall": wall, "peak": int(t.peak_bytes)}

    def twice(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """The first call (timed), then the measured one."""
        first = self.measure(fn)["wall"]
        m = self.measure(fn)
        m["first"] = first
        return m

    def group(self, model: str, case: str, host_name: str, host: Callable[[], torch.Tensor], node_name: str,
              node: Callable[[int], Any], fractions: list[float | None]) -> None:
        """The host's row, then the node's at each budget (a fraction of the host's measured peak; None: auto)."""
        log.info("== %s: %s ==", model, case)
        h = self.twice(host)
        ref = h["out"]
        self._row(model, case, f"host {host_name}", "the host's own " + host_name, h, h, ref, None)
        for frac in fractions:
            budget_mb = 0 if frac is None else max(1, int(frac * h["peak"] / MiB))
            label = f"{node_name}, " + ("auto" if frac is None else f"budget {budget_mb} MiB ({frac:.0%} of host)")
            try:
                m = self.twice(lambda mb=budget_mb: node(mb))
            except self.input_error as e:
                log.info("%s: %s", label, e)
                text = str(e).splitlines()[0].split("] ", 1)[-1].split("; raise budget_mb", 1)[0]
                self.rows.append({"model": model, "case": case, "run": label, "impossible": text})
                continue
            r = m["out"]
            m["out"] = r.latent if hasattr(r, "latent") and not hasattr(r, "images") else r.images
            log.info("%s", r.report.text())
            self._row(model, case, label, r.report.summary, m, h, ref, budget_mb, getattr(r, "measured_peak", None))

    def _row(self, model: str, case: str, run: str, verdict: str, m: dict, h: dict, ref: torch.Tensor,
             budget_mb: int | None, own_peak: int | None = None) -> None:
        out = m["out"]
        diff = (out.float() - ref.float()).abs().max().item() if out.shape == ref.shape else float("nan")
        row = {"model": model, "case": case, "run": run, "verdict": " ".join(verdict.split()), "first_s": m["first"],
               "seconds": m["wall"], "time_vs_host": m["wall"] / h["wall"], "peak_mib": m["peak"] / MiB,
               "peak_vs_host": m["peak"] / h["peak"], "max_abs_diff": diff, "budget_mib": budget_mb or None,
               "node_measured_mib": None if own_peak is None else own_peak / MiB,
               "over_budget": bool(budget_mb) and m["peak"] > budget_mb * MiB}
        self.rows.append(row)
        log.info("%-50s first %6.1f s, %6.1f s (%.2fx), peak %7.1f MiB (%.2fx)%s, max diff %.1e", run, row["first_s"],
                 row["seconds"], row["time_vs_host"], row["peak_mib"], row["peak_vs_host"],
                 " OVER THE BUDGET" if row["over_budget"] else "", diff)


# --------------------------------------------------------------------------------------------------- the structures


def qwen21(b: Bench, quick: bool) -> None:
    from scripts import upstream_wan
    from scripts.fixtures.latents import structured_latent

    with torch.inference_mode():  # as ComfyUI's executor runs the loader
        vae = upstream_wan.qwen21_vae()
    px = SIZES["qwen_px"][quick]
    z = structured_latent((1, 64, px // 16, px // 16), seed=1)
    b.group("Qwen-Image 2.1 VAE", f"decode {px}x{px}", "VAEDecode",
            lambda: b.nodes.VAEDecode().decode(vae, {"samples": z})[0], "Tiled VAE Decode",
            lambda mb: b.mods["tiled"].decode(vae, {"samples": z}, budget_mb=mb), BUDGETS["qwen_decode"])
    px = SIZES["qwen_encode_px"][quick]
    pixels = torch.rand((1, px, px, 3), generator=torch.Generator().manual_seed(0))
    b.group("Qwen-Image 2.1 VAE", f"encode {px}x{px}", "VAEEncode",
            lambda: b.nodes.VAEEncode().encode(vae, pixels)[0]["samples"], "Tiled VAE Encode",
            lambda mb: b.mods["encode"].encode(vae, pixels, budget_mb=mb), BUDGETS["qwen_encode"])


def seedvr2(b: Bench, quick: bool) -> None:
    from scripts import upstream_seedvr2
    from scripts.fixtures.latents import structured_latent

    with torch.inference_mode():
        vae = upstream_seedvr2.build()
    shape = SIZES["seedvr2"][quick]
    z = structured_latent(shape, seed=5)
    b.group("SeedVR2 (rewritten vae.py)", f"decode {(shape[2] - 1) * 4 + 1} frames {shape[4] * 8}x{shape[3] * 8}",
            "VAEDecode", lambda: b.nodes.VAEDecode().decode(vae, {"samples": z})[0], "Temporal-Chunk Video Decode",
            lambda mb: b.mods["video"].decode(vae, {"samples": z}, budget_mb=mb), BUDGETS["seedvr2"])


def minimax(b: Bench, quick: bool) -> None:
    from scripts.fixtures.latents import structured_latent
    from scripts.upstream_minimax import minimax_vae

    shape = SIZES["minimax"][quick]
    z = structured_latent(shape, seed=5)
    for quantized in (False, True):
        with torch.inference_mode():  # int8 weights are re-wrapped under inference mode, as ComfyUI's loader runs
            vae = minimax_vae(quantized=quantized)
        frames = vae.upscale_ratio[0](shape[2])
        b.group(f"MiniMax H3 (newest grid), {'int8+ConvRot' if quantized else 'float'} decoder",
                f"decode {frames} frames {shape[4] * 16}x{shape[3] * 16}", "VAEDecode",
                lambda vae=vae: b.nodes.VAEDecode().decode(vae, {"samples": z})[0], "Temporal-Chunk Video Decode",
                lambda mb, vae=vae: b.mods["video"].decode(vae, {"samples": z}, budget_mb=mb), BUDGETS["minimax"])
        del vae


# --------------------------------------------------------------------------------------------------- the table


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | case | run | path / plan (the report's verdict) | first call s | time s | time vs host | "
             "tensor peak MiB | peak vs host | max abs diff vs host |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "impossible" in r:
            lines.append(f"| {r['model']} | {r['case']} | {r['run']} | impossible: {r['impossible']} | | | | | | |")
            continue
        over = " **over the budget**" if r["over_budget"] else ""
        host = r["run"].startswith("host ")
        diff = "reference" if host else f"{r['max_abs_diff']:.1e}"
        lines.append(f"| {r['model']} | {r['case']} | {r['run']} | {r['verdict']} | {r['first_s']:.2f} | "
                     f"{r['seconds']:.2f} | {r['time_vs_host']:.2f}x | {r['peak_mib']:,.1f}{over} | "
                     f"{r['peak_vs_host']:.2f}x | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.upstream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the same rows)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=["qwen21", "seedvr2", "minimax"],
                        default=["qwen21", "seedvr2", "minimax"])
    parser.add_argument("--json", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    load0 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="vramfit-bench-upstream-") as user:
        b = Bench(pathlib.Path(user))
        import comfyui_version

        if comfyui_version.__version__ != "0.33.0":
            log.error("the newest upstream files load over a ComfyUI 0.33.0 tree; this host is %s (source "
                      ".cache/env033)", comfyui_version.__version__)
            return 2
        from scripts.upstream_minimax import newest_minimax
        from scripts.upstream_seedvr2 import no_pinned_offload

        with newest_minimax(), no_pinned_offload():
            for name in args.only:
                {"qwen21": qwen21, "seedvr2": seedvr2, "minimax": minimax}[name](b, args.quick)
    load1 = " ".join(f"{v:.2f}" for v in os.getloadavg())
    log.info("\n%s\n\nnarrow random-weight models, float32, CPU, ComfyUI 0.33.0 + newest upstream VAE files, "
             "torch %s, %d threads, %s, load average at the start %s, at the end %s, bench %.0f s", table(b.rows),
             torch.__version__, args.threads, platform.platform(), load0, load1, time.perf_counter() - t0)
    if args.json is not None:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "out"} for r in b.rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
