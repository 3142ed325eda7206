"""The headless runner against a real server: success with progress, failure with ComfyUI's error."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from scripts.host import ROOT, WorkflowError
from scripts.run_workflow import collect_reports, run

pytestmark = pytest.mark.server


def _workflow(vae_name: str, width: int = 64) -> dict:
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": 64, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "vramfit_runner"}},
    }


def test_runner_follows_a_prompt(server, fixture_vaes):
    result = run(server.url, _workflow(fixture_vaes["kl_f8"], width=72), timeout=300)
    assert result.outputs and result.outputs[0]["filename"].startswith("vramfit_runner")
    assert (server.output_dir / result.outputs[0]["filename"]).is_file()
    assert result.entry["status"]["status_str"] == "success"


def test_runner_raises_comfy_validation_error(server):
    with pytest.raises(WorkflowError) as err:
        run(server.url, _workflow("missing_vae.safetensors"), timeout=60)
    assert "missing_vae.safetensors" in str(err.value)


def test_runner_cli_exit_codes(server, fixture_vaes, tmp_path):
    bad = tmp_path / "bad.json"
    wf = _workflow(fixture_vaes["kl_f8"])
    wf["2"]["inputs"]["width"] = -64  # below EmptyLatentImage's minimum
    bad.write_text(json.dumps(wf))
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.run_workflow", str(bad), "--url", server.url, "--timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "width" in proc.stdout + proc.stderr

    good = tmp_path / "good.json"
    good.write_text(json.dumps(_workflow(fixture_vaes["kl_f8"], width=80)))
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.run_workflow", str(good), "--url", server.url,
         "--output-dir", str(server.output_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outs = [line.split("output: ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("output: ")]
    assert outs and all(pathlib.Path(p).is_file() for p in outs), proc.stdout


def test_collect_reports_reads_vramfit_text_only():
    entry = {"outputs": {"5": {"text": ["VRAM Fit | VRAM Monitor | cpu\n  rss : 1 GiB", "other"]}}}
    assert collect_reports(entry) == ["VRAM Fit | VRAM Monitor | cpu\n  rss : 1 GiB"]
