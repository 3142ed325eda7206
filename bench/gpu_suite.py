"""GPU suite driver: one part on every ComfyUI host of the kit and every VRAM mode; JSON + Markdown out.

Called by ``bench/gpu_suite.sh PART`` (which unpacks the kit first; see docs/BENCHMARKS.md "GPU suite").
For each host unpacked under ``<work>/hosts/*/ComfyUI`` and each mode (on CUDA with ComfyUI >= 0.33:
dynamic VRAM ``on``, its default on NVIDIA, and ``off``; elsewhere one mode) it starts a fresh process:

* part ``tests``: ``pytest tests/cuda`` (the device-path tests; their ``record_property`` values go into
  the table);
* parts ``image``, ``encode``, ``video``, ``scenes``: ``python -m bench.gpu_parts PART`` (one row per decode
  or encode).

Workers share the time left before ``--deadline``; one that runs out is stopped and keeps the rows it
finished. Writes ``<out>/<part>.json``, ``<out>/<part>.md`` and ``<out>/<part>.log`` (3 files: the device
returns at most 8). Exit status 1 when a worker failed or a test did not pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
log = logging.getLogger("vramfit.bench.gpu_suite")
PARTS = ("tests", "image", "encode", "video", "scenes")
TABLE_COLUMNS = {
    "tests": ["test", "outcome", "seconds", "measured"],
    "image": ["case", "decode", "dtype", "seconds", "peak_mib", "peak_abs_mib", "device_peak_mib", "psnr_db",
              "max_abs", "predicted_mib", "path"],
    "encode": ["case", "encode", "dtype", "seconds", "peak_mib", "latent_max_abs", "round_trip_psnr_db",
               "predicted_mib", "plan", "path"],
    "video": ["case", "decode", "dtype", "seconds", "plan_s", "predicted_s", "peak_mib", "device_peak_mib", "max_abs",
              "psnr_db", "predicted_mib", "calls", "copies", "plan", "path"],
    "scenes": ["case", "decode", "seconds", "peak_mib", "peak_abs_mib", "device_peak_mib", "decode_phase_cut_pct",
               "within_24gb", "psnr_db", "notes"],
}  # fmt: skip


def host_dirs(work: pathlib.Path, versions: list[str] | None) -> list[tuple[str, pathlib.Path]]:
    """``(version, ComfyUI folder)`` of the unpacked hosts, optionally only ``versions``; raises
    ``LookupError`` naming the hosts there when one of ``versions`` is not (a kit built without 0.33.0)."""
    sys.path.insert(0, str(ROOT))
    from scripts.host import comfyui_version

    found = [(comfyui_version(comfy), comfy) for comfy in sorted(work.glob("hosts/*/ComfyUI"))]
    if versions is None:
        return found
    missing = [v for v in versions if v not in {f[0] for f in found}]
    if missing:
        raise LookupError(f"the kit holds ComfyUI {[f[0] for f in found]}, not {missing} (scripts/gpu_kit.sh "
                          "packs 0.33.0 only where its source is: VRAMFIT_GPU_033_SRC)")
    return [f for f in found if f[0] in versions]


def modes(comfy: pathlib.Path, device: str, wanted: list[str] | None) -> list[str]:
    """Dynamic VRAM modes to run: ``on``/``off`` where the host has it (CUDA), else ``-``."""
    has_dynamic = "def enables_dynamic_vram" in (comfy / "comfy" / "cli_args.py").read_text()
    if device == "cpu" or not has_dynamic:
        return ["-"]
    return [m for m in ("on", "off") if wanted is None or m in wanted]


def _junit_rows(path: pathlib.Path) -> list[dict[str, Any]]:
    rows = []
    if not path.is_file():
        return rows
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "").splitlines()[:1]
                outcome += f": {msg[0][:160]}" if msg else ""
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        rows.append({"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                     "measured": ", ".join(f"{k}={v}" for k, v in props.items())})
    return rows


def run_worker(part: str, version: str, comfy: pathlib.Path, mode: str, args: argparse.Namespace,
               timeout: float, logf: Any) -> dict[str, Any]:
    """One fresh process for one host and mode; returns ``{host, mode, rc, meta, rows}``."""
    tmp = args.work / "results" / f"{part}-{version}-{mode}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, COMFYUI_PATH=str(comfy), VRAMFIT_PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               VRAMFIT_COMFY_DEVICE=args.device, VRAMFIT_SUITE_SMALL="1" if args.small else "0")
    if mode != "-":
        env["VRAMFIT_DYNAMIC_VRAM"] = mode
    if part == "tests":
        xml = tmp.with_suffix(".xml")
        xml.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "tests/cuda", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
               "-o", "junit_family=xunit1", "--timeout", str(max(60, int(timeout)))]
    else:
        out = tmp.with_suffix(".json")
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.gpu_parts", part, "--json", str(out), *(["--small"] if args.small else []),
               "--models", args.models, "--sizes", args.sizes]
    logf.write(f"\n===== {part} | ComfyUI {version} | {args.device} | dynamic VRAM {mode} | {' '.join(cmd)}\n")
    logf.flush()
    t0 = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
        logf.write(f"\n===== stopped at the deadline after {timeout:.0f} s\n")
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {"host": version, "mode": mode, "rc": rc, "seconds": seconds, "meta": {}, "rows": []}
    if part == "tests":
        result["rows"] = _junit_rows(xml)
        result["meta"] = {"part": part, "comfyui": version, "device": args.device}
    elif out.is_file():
        data = json.loads(out.read_text())
        result["meta"], result["rows"] = data.get("meta", {}), data.get("rows", [])
    return result


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.3g}" if abs(value) < 0.01 and value != 0 else f"{value:,.2f}"
    text = str(value).replace("|", "/").replace("\n", " ")
    return text if len(text) <= 140 else text[:137] + "..."


def markdown(part: str, results: list[dict[str, Any]]) -> str:
    cols = TABLE_COLUMNS[part]
    out = [f"# GPU suite: {part}", ""]
    for res in results:
        meta = res["meta"]
        out.append(f"## ComfyUI {res['host']}, dynamic VRAM {res['mode']} "
                   f"({meta.get('device_name', meta.get('device', '?'))}, torch {meta.get('torch', '?')}, "
                   f"{meta.get('date', time.strftime('%Y-%m-%d'))}; exit {res['rc']}, {res['seconds']:.0f} s)")
        if meta.get("dynamic_vram"):
            out.append(f"dynamic VRAM: {meta['dynamic_vram']}; comfy_kitchen CUDA: {meta.get('comfy_kitchen_cuda')}")
        out += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in res["rows"]]
        out.append("")
    return "\n".join(out)


def failed(part: str, results: list[dict[str, Any]]) -> list[str]:
    bad = [f"ComfyUI {r['host']} / {r['mode']}: exit {r['rc']}" for r in results if r["rc"] != 0]
    if part == "tests":
        bad += [f"{r['host']} / {r['mode']}: {row['test']}: {row['outcome']}" for r in results for row in r["rows"]
                if not row["outcome"].startswith("passed")]
        bad += [f"ComfyUI {r['host']} / {r['mode']}: no test ran" for r in results if not r["rows"]]
    else:
        bad += [f"ComfyUI {r['host']} / {r['mode']}: no rows" for r in results if not r["rows"]]
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_suite")
    ap.add_argument("part", choices=PARTS)
    ap.add_argument("--work", type=pathlib.Path, required=True, help="where gpu_suite.sh unpacked the kit")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (the dry run)")
    ap.add_argument("--small", action="store_true", help="tiny sizes (the dry run)")
    ap.add_argument("--hosts", help="comma-separated ComfyUI versions (default: every host of the kit; "
                    "one the kit lacks is an error)")
    ap.add_argument("--modes", help="comma-separated dynamic VRAM modes: on,off (default: both where present)")
    ap.add_argument("--models", default="", help="video part: VAEs to run (default: every family, bench/gpu_parts.DEFAULT_VIDEO_MODELS); encode part: "
                    "encode these video VAEs instead of the KL image")
    ap.add_argument("--sizes", default="",
                    help="image and encode parts: comma-separated sides in px (default 2048,4096,8192; "
                    "encode: 2048,4096; 8192 alone needs its own call: core's own decode there ran over 98 s "
                    "on an H200)")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole part (default 540)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.cpu else "cuda"
    logging.basicConfig(level=logging.INFO, format="[vramfit-gpu] %(message)s")
    t_end = time.monotonic() + args.deadline
    try:
        hosts = host_dirs(args.work, args.hosts.split(",") if args.hosts else None)
    except LookupError as e:
        log.error("--hosts %s: %s", args.hosts, e)
        return 2
    wanted_modes = args.modes.split(",") if args.modes else None
    configs = [(v, c, m) for v, c in hosts for m in modes(c, args.device, wanted_modes)]
    if not configs:
        log.error("no ComfyUI host under %s/hosts (run bench/gpu_suite.sh, which unpacks the kit)", args.work)
        return 2
    log.info("%s on ComfyUI %s", args.part, ", ".join(v for v, _ in hosts))
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with open(args.out / f"{args.part}.log", "a") as logf:
        for i, (version, comfy, mode) in enumerate(configs):
            share = (t_end - time.monotonic()) / (len(configs) - i)
            log.info("%s: ComfyUI %s, dynamic VRAM %s (%.0f s)", args.part, version, mode, share)
            results.append(run_worker(args.part, version, comfy, mode, args, max(30.0, share), logf))
            (args.out / f"{args.part}.json").write_text(json.dumps({"part": args.part, "results": results},
                                                                   indent=1, default=str))
            (args.out / f"{args.part}.md").write_text(markdown(args.part, results))
    bad = failed(args.part, results)
    for line in bad:
        log.error("%s", line)
    log.info("wrote %s/%s.{json,md,log}", args.out, args.part)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
