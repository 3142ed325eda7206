"""VRAM Fit's main job, headless: a real ComfyUI with this pack decodes a structured latent.

Run by ``bash scripts/demo.sh`` (which installs the host first). Steps: generate the random-weight
fixture VAE into the host's ``models/vae``, write a structured latent into the server's input
folder, start ComfyUI on 127.0.0.1, POST the example API workflow, wait for ``/history``, then
print where the decoded image and the VRAM report are.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import sys

from scripts.host import ROOT, ComfyServer, HostConfig, import_comfy, output_files
from scripts.run_workflow import run as run_workflow

log = logging.getLogger("vramfit.demo")

DEFAULT_WORKFLOW = ROOT / "workflows" / "api" / "vramfit_demo_cpu.json"
LATENT_NAME = "vramfit_demo.latent"


def _peak_rss(pid: int) -> int | None:
    """Peak resident set size (VmHWM) of a process in bytes, Linux only."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workflow", type=pathlib.Path, default=DEFAULT_WORKFLOW, help="API-format workflow")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "outputs" / "demo", help="work/output folder")
    parser.add_argument("--latent", default="48x64", help="latent size HxW (image = 8x that), default 48x64")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    cfg = HostConfig.load()
    import_comfy(cfg)
    from scripts.fixtures import FIXTURES, make_models, structured_latent, write_latent_file

    make_models(cfg.models_dir / "vae", seed=0, kinds=["kl_f8"])
    workflow = json.loads(args.workflow.read_text())
    for node in workflow.values():  # the example workflow names the fixture VAE and the latent file
        inputs = node.get("inputs", {})
        if node.get("class_type") == "VAELoader" and inputs.get("vae_name", "").startswith("vramfit_fixture"):
            inputs["vae_name"] = FIXTURES["kl_f8"].filename
        if node.get("class_type") == "LoadLatent":
            inputs["latent"] = LATENT_NAME

    h, w = (int(v) for v in args.latent.lower().split("x"))
    server = ComfyServer(cfg, work_dir=args.out.resolve())
    server.input_dir.mkdir(parents=True, exist_ok=True)
    write_latent_file(server.input_dir / LATENT_NAME, structured_latent((1, 4, h, w), seed=0))
    with server:
        client = server.client(timeout=60)
        stats_before = client.system_stats()
        result = run_workflow(server.url, workflow, timeout=1800)
        entry, elapsed = result.entry, result.seconds
        stats_after = client.system_stats()
        peak_rss = _peak_rss(server.proc.pid) if server.proc else None
    files = output_files(entry, server.output_dir)
    report = {
        "workflow": str(args.workflow),
        "latent": [1, 4, h, w],
        "seconds": round(elapsed, 3),
        "server_peak_rss_bytes": peak_rss,
        "devices_before": stats_before.get("devices"),
        "devices_after": stats_after.get("devices"),
        "outputs": [str(f) for f in files],
        "vramfit_reports": result.reports,
        "comfyui_log": str(server.log_path),
    }
    report_path = args.out / "vram_report.json"
    report_path.write_text(json.dumps(report, indent=2))
    for text in result.reports:
        log.info("%s", text)
    for f in files:
        log.info("output: %s", f)
    log.info("VRAM report: %s", report_path)
    if not files or not all(f.is_file() for f in files):
        log.error("the workflow produced no output file")
        return 1
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
