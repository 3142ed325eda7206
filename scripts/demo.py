"""VRAM Fit's main job, headless: one latent decoded three ways by a real ComfyUI, compared.

Run by ``bash scripts/demo.sh`` (which installs the host first). A structured latent is decoded in one
prompt, one decode after the other, by

* core ``VAEDecode`` (untiled: the reference),
* core ``VAEDecodeTiled`` (tiles of ``--core-tile`` px), and
* VRAM Fit's Tiled VAE Decode under ``--budget-mb`` (a budget the untiled decode does not fit, so it tiles),

with VRAM Monitors around each decode (time and peak memory between them) and an Offload Manager
(``unload: nothing``, ``empty_cache``) before each, which orders the decodes and releases freed memory. The script
starts ComfyUI on 127.0.0.1, POSTs that API workflow (built here: :func:`build_workflow`), prints time,
peak and PSNR vs the untiled decode for each, and writes a side-by-side image with amplified difference
maps, the VRAM plot (the last VRAM Monitor's) and a JSON report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import sys

from memory.report import Report  # the pack's engine: plain Python, no ComfyUI
from scripts.host import ROOT, ComfyServer, HostConfig, import_comfy, output_files
from scripts.run_workflow import run as run_workflow

log = logging.getLogger("vramfit.demo")

LATENT_NAME = "vramfit_demo.latent"
DIFF_GAIN = 10
"""Difference maps show ``|decode - untiled|`` times this (clipped), so small errors are visible."""


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One decode of the comparison: its node, its label in the VRAM timeline and its saved image."""

    key: str
    title: str
    class_type: str
    label: str  # the sample after the decode in the VRAM timeline; "pre <label>" the one before (<= 14 chars)
    prefix: str


DECODERS = (
    Decoder("untiled", "VAEDecode (untiled, reference)", "VAEDecode", "untiled", "vramfit_demo_untiled"),
    Decoder("core_tiled", "VAEDecodeTiled (core)", "VAEDecodeTiled", "core tiled", "vramfit_demo_core_tiled"),
    Decoder("vramfit", "Tiled VAE Decode (VRAM Fit)", "VRAMFit_TiledVAEDecode", "VRAM Fit", "vramfit_demo_tiled"),
)
PLOT_PREFIX = "vramfit_vram_timeline"


def build_workflow(vae_name: str, latent_name: str, budget_mb: int, core_tile: int, core_overlap: int) -> dict:
    """The demo's API workflow: the same latent through the three decoders, strictly one after another.

    Decode ``k`` is node ``<k>2``, between the VRAM Monitors ``<k>1`` and ``<k>3``, saved by ``<k>4``. Before
    it, the Offload Manager ``<k>0`` (``unload: nothing``: it unloads no model; ``empty_cache``) passes the
    latent on only once it holds the previous decode's image (the loaded VAE for the first) in ``keep``:
    ComfyUI then runs the decodes in this order, and loading the VAE is in no decode's interval.
    """
    wf: dict[str, dict] = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": latent_name}},
    }
    latent: list = ["2", 0]
    wait_for: list = ["1", 0]
    for k, dec in enumerate(DECODERS, start=1):
        wf[f"{k}0"] = {
            "class_type": "VRAMFit_OffloadManager",
            "inputs": {"value": latent, "keep": wait_for, "unload": "nothing", "method": "offload",
                       "empty_cache": True},
        }  # fmt: skip
        wf[f"{k}1"] = _monitor([f"{k}0", 0], f"pre {dec.label}")
        latent = [f"{k}1", 0]
        inputs: dict = {"samples": latent, "vae": ["1", 0]}
        if dec.class_type == "VAEDecodeTiled":
            inputs |= {"tile_size": core_tile, "overlap": core_overlap, "temporal_size": 64, "temporal_overlap": 8}
        elif dec.class_type == "VRAMFit_TiledVAEDecode":
            inputs |= {"tile_size": 0, "halo": -1, "budget_mb": budget_mb, "unload_others": False}
        wf[f"{k}2"] = {"class_type": dec.class_type, "inputs": inputs}
        wf[f"{k}3"] = _monitor([f"{k}2", 0], dec.label)
        wf[f"{k}4"] = {"class_type": "SaveImage", "inputs": {"images": [f"{k}3", 0], "filename_prefix": dec.prefix}}
        wait_for = [f"{k}3", 0]
    last = len(DECODERS)
    wf["99"] = {"class_type": "SaveImage", "inputs": {"images": [f"{last}3", 2], "filename_prefix": PLOT_PREFIX}}
    return wf


def _monitor(value: list, label: str) -> dict:
    return {
        "class_type": "VRAMFit_VRAMMonitor",
        "inputs": {"value": value, "label": label, "plot_width": 960, "plot_height": 400},
    }


# ------------------------------------------------------------------------------------ reading the result


def _row_bytes(report_text: str, key: str) -> int | None:
    """The exact byte count of a monitor report row (``peak : 1.2 GiB (1289392128 B; ...)``)."""
    rows = dict(Report.parse(report_text).rows)
    match = re.search(r"\((\d+) B", rows.get(key, ""))
    return int(match.group(1)) if match else None


def timeline_seconds(report_text: str) -> dict[str, float]:
    """``{label: t}`` of the timeline table in a VRAM Monitor report (``t``: seconds since the first sample)."""
    table = dict(Report.parse(report_text).rows).get("timeline", "")
    times = {}
    for line in table.splitlines()[1:]:
        match = re.match(r"\s*\d+\s+(.*?)\s+\+(-?[\d.]+) s\b", line)
        if match:
            times[match.group(1)] = float(match.group(2))
    return times


def psnr(reference, image) -> tuple[float, float]:
    """``(PSNR in dB, max abs difference in 8-bit levels)`` of two uint8 arrays (inf dB when identical)."""
    import numpy as np

    diff = reference.astype(np.float64) - image.astype(np.float64)
    mse = float(np.mean((diff / 255.0) ** 2))
    return (math.inf if mse == 0 else 10 * math.log10(1.0 / mse)), float(np.abs(diff).max())


def side_by_side(images: dict[str, object], titles: dict[str, str], gain: int = DIFF_GAIN):
    """A PIL image: the decodes in a row, under each tiled one its ``|decode - untiled| x gain`` map."""
    import numpy as np
    from PIL import Image, ImageDraw

    ref = images["untiled"]
    h, w = ref.shape[:2]
    pad, head = 8, 22
    keys = list(images)
    canvas = Image.new("RGB", (len(keys) * (w + pad) + pad, 2 * (h + head + pad) + pad), (24, 24, 24))
    draw = ImageDraw.Draw(canvas)
    for col, key in enumerate(keys):
        x = pad + col * (w + pad)
        draw.text((x, pad), titles[key], fill=(230, 230, 230))
        canvas.paste(Image.fromarray(images[key]), (x, pad + head))
        y = 2 * pad + head + h
        if key == "untiled":
            draw.text((x, y), f"difference maps: |decode - untiled| x {gain}", fill=(230, 230, 230))
            continue
        diff = np.abs(images[key].astype(np.int16) - ref.astype(np.int16)) * gain
        draw.text((x, y), f"|{titles[key].split(' (')[0]} - untiled| x {gain}", fill=(230, 230, 230))
        canvas.paste(Image.fromarray(np.clip(diff, 0, 255).astype(np.uint8)), (x, y + head))
    return canvas


def summarise(entry: dict, files: dict[str, pathlib.Path]) -> list[dict]:
    """Time, peak and PSNR vs the untiled decode of each decoder, from the monitors and the saved images."""
    import numpy as np
    from PIL import Image

    outputs = entry["outputs"]
    last = outputs[f"{len(DECODERS)}3"]["text"][0]
    times = timeline_seconds(last)
    pixels = {dec.key: np.asarray(Image.open(files[dec.key]).convert("RGB")) for dec in DECODERS}
    rows = []
    for k, dec in enumerate(DECODERS, start=1):
        before, after = outputs[f"{k}1"]["text"][0], outputs[f"{k}3"]["text"][0]
        peak, rss_before = _row_bytes(after, "peak"), _row_bytes(before, "rss")
        t0, t1 = times.get(f"pre {dec.label}"), times.get(dec.label)
        db, max_levels = psnr(pixels["untiled"], pixels[dec.key])
        rows.append({
            "decoder": dec.title,
            "seconds": None if t0 is None or t1 is None else round(t1 - t0, 2),
            "peak_rss_bytes": peak,
            "peak_over_start_bytes": None if peak is None or rss_before is None else peak - rss_before,
            "psnr_db_vs_untiled": db,
            "max_abs_diff_8bit": max_levels,
            "image": str(files[dec.key]),
        })  # fmt: skip
    return rows


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def format_table(rows: list[dict]) -> str:
    lines = [f"{'decoder':<32} {'time':>8} {'peak RSS':>11} {'peak - start':>13} {'PSNR vs untiled':>16} {'max diff':>9}"]
    for r in rows:
        db = r["psnr_db_vs_untiled"]
        quality = "reference" if r is rows[0] else ("identical" if math.isinf(db) else f"{db:.1f} dB")
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.2f} s"
        lines.append(
            f"{r['decoder']:<32} {secs:>8} {_mib(r['peak_rss_bytes']):>11} {_mib(r['peak_over_start_bytes']):>13} "
            f"{quality:>16} {r['max_abs_diff_8bit']:>5.0f}/255"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ running it


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the demo decodes and how (the command-line options)."""

    latent_hw: tuple[int, int] = (32, 40)
    budget_mb: int = 256
    core_tile: int = 192
    core_overlap: int = 32


def compare(url: str, input_dir: pathlib.Path, output_dir: pathlib.Path, out: pathlib.Path,
            vae_name: str, settings: Settings) -> dict:
    """Run the comparison on the ComfyUI server at ``url`` (its folders ``input_dir``/``output_dir``);
    writes the side-by-side image and ``vram_report.json`` into ``out`` and returns that report."""
    from scripts.fixtures.files import write_latent_file
    from scripts.fixtures.latents import structured_latent

    h, w = settings.latent_hw
    write_latent_file(input_dir / LATENT_NAME, structured_latent((1, 4, h, w), seed=0))
    workflow = build_workflow(vae_name, LATENT_NAME, settings.budget_mb, settings.core_tile, settings.core_overlap)
    result = run_workflow(url, workflow, timeout=1800)
    saved = output_files(result.entry, output_dir)
    files = {dec.key: next(f for f in saved if f.name.startswith(dec.prefix + "_")) for dec in DECODERS}
    rows = summarise(result.entry, files)

    import numpy as np
    from PIL import Image

    pixels = {dec.key: np.asarray(Image.open(files[dec.key]).convert("RGB")) for dec in DECODERS}
    out.mkdir(parents=True, exist_ok=True)
    compare_png = out / "vramfit_demo_compare.png"
    side_by_side(pixels, {dec.key: dec.title for dec in DECODERS}).save(compare_png)
    report = {
        "latent": [1, 4, h, w],
        "image_px": [8 * h, 8 * w],
        "budget_mb": settings.budget_mb,
        "core_tiled": {"tile_size": settings.core_tile, "overlap": settings.core_overlap},
        "seconds_total": round(result.seconds, 2),
        "decoders": rows,
        "compare_image": str(compare_png),
        "vram_plot": str(next(f for f in saved if f.name.startswith(PLOT_PREFIX + "_"))),
        "tiled_vae_decode_report": result.entry["outputs"][f"{len(DECODERS)}2"]["text"][0],
        "vramfit_reports": result.reports,
    }
    (out / "vram_report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def tiled(report: dict) -> bool:
    """Whether VRAM Fit's decode ran tiled (its report's plan names tiles)."""
    return "tiles" in dict(Report.parse(report["tiled_vae_decode_report"]).rows).get("plan", "")


def main(argv: list[str] | None = None) -> int:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "outputs" / "demo", help="work/output folder")
    parser.add_argument("--latent", default="x".join(map(str, defaults.latent_hw)),
                        help="latent size HxW (image = 8x that), default %(default)s")
    parser.add_argument("--budget-mb", type=int, default=defaults.budget_mb,
                        help="VRAM Fit's budget in MiB, below the untiled decode's need (default %(default)s)")
    parser.add_argument("--core-tile", type=int, default=defaults.core_tile,
                        help="VAEDecodeTiled tile_size in px (default %(default)s)")
    parser.add_argument("--core-overlap", type=int, default=defaults.core_overlap,
                        help="VAEDecodeTiled overlap in px (default %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    h, w = (int(v) for v in args.latent.lower().split("x"))
    settings = Settings((h, w), args.budget_mb, args.core_tile, args.core_overlap)

    cfg = HostConfig.load()
    import_comfy(cfg)
    from scripts.fixtures.files import make_models
    from scripts.fixtures.kinds import FIXTURES

    make_models(cfg.models_dir / "vae", seed=0, kinds=["kl_f8"])
    out = args.out.resolve()
    with ComfyServer(cfg, work_dir=out) as server:
        report = compare(
            server.url, server.input_dir, server.output_dir, out, FIXTURES["kl_f8"].filename, settings
        )
    log.info("%s", report["tiled_vae_decode_report"])
    log.info(
        "\nthe same latent (%dx%d px image) decoded three ways in one prompt; VRAM Fit budget %d MiB, "
        "VAEDecodeTiled tile %d / overlap %d px.\ntime and peak: between the VRAM Monitors around each decode "
        "(peak: process RSS high-water mark on CPU; peak - start: above the RSS before that decode); PSNR "
        "on the saved 8-bit images\n%s\n",
        8 * w, 8 * h, settings.budget_mb, settings.core_tile, settings.core_overlap, format_table(report["decoders"]),
    )  # fmt: skip
    for row in report["decoders"]:
        log.info("output: %s", row["image"])
    log.info("side by side with difference maps (x%d): %s", DIFF_GAIN, report["compare_image"])
    log.info("VRAM plot: %s", report["vram_plot"])
    log.info("VRAM report: %s", out / "vram_report.json")
    log.info("ComfyUI log: %s", server.log_path)
    if not tiled(report):
        log.warning("VRAM Fit did not tile under --budget-mb %d: lower it to see the tiled path", settings.budget_mb)
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
