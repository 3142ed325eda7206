"""The GPU suite's dry run: the kit builds within its size limit, and every part runs on the CPU at tiny
sizes (``bench/gpu_suite.sh PART --cpu --small``) on this test run's host, so the suite never rots.

The kit is built once per checkout (``scripts/gpu_kit.sh``; idempotent; needs PyPI the first time). The
parts run exactly as on a lent GPU (the kit's ComfyUI tree of this host's version unpacked and this pack
linked into it, one fresh process per part, JSON + Markdown written) except for the device, the sizes and
the interpreter (this host's, with its own packages; the kit's CPython 3.12 site is for the device).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

from scripts.host import cache_dir

pytestmark = pytest.mark.host

ROOT = pathlib.Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpu"
KIT_LIMIT_MIB = 60
EXPECTED_TESTS = 7
"""Tests in tests/cuda (the ``tests`` part must run them all)."""


@pytest.fixture(scope="module")
def kit() -> pathlib.Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_kit.sh")], cwd=ROOT, check=True, timeout=900,
                   env=dict(os.environ, VRAMFIT_GPU_KIT=str(KIT)))
    return KIT


def test_kit_holds_both_hosts_and_the_site_within_the_limit(kit):
    files = sorted(p.name for p in kit.rglob("*") if p.is_file() and not p.name.endswith(".id"))
    assert files == ["comfyui-0.3.75.tar.xz", "comfyui-0.33.0.tar.xz", "site.tar.xz"], files
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size <= KIT_LIMIT_MIB * 2**20, f"kit {size / 2**20:.1f} MiB > {KIT_LIMIT_MIB} MiB"


@pytest.fixture(scope="module")
def dry_run(kit, host_config, tmp_path_factory):
    """``run(part) -> (exit code, results json, markdown)`` of the dry run on this host's version."""
    versions = {p.name.removeprefix("comfyui-").removesuffix(".tar.xz") for p in (kit / "hosts").glob("*.tar.xz")}
    if host_config.version not in versions:
        pytest.skip(f"the kit holds ComfyUI {sorted(versions)}, not this host's {host_config.version}")
    out = tmp_path_factory.mktemp("gpu-suite-out")
    env = dict(
        os.environ,
        OUT=str(out),
        VRAMFIT_GPU_KIT=str(kit),
        VRAMFIT_GPU_WORK=str(cache_dir() / "gpu-dry-run"),
        VRAMFIT_SUITE_PYTHON=str(host_config.python),
        VRAMFIT_SUITE_MODELS=str(host_config.models_dir),
    )

    def run(part: str) -> tuple[int, dict, str]:
        cmd = ["bash", str(ROOT / "bench" / "gpu_suite.sh"), part, "--cpu", "--small", "--hosts", host_config.version]
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=900).returncode
        data = json.loads((out / f"{part}.json").read_text())
        return rc, data, (out / f"{part}.md").read_text()

    return run


def _log_tail(data: dict) -> str:
    return json.dumps(data, indent=1, default=str)[-3000:]


def test_tests_part_runs_every_device_test(dry_run):
    rc, data, md = dry_run("tests")
    (res,) = data["results"]
    outcomes = {r["test"]: r["outcome"] for r in res["rows"]}
    assert len(outcomes) == EXPECTED_TESTS, outcomes
    assert all(o == "passed" for o in outcomes.values()), outcomes
    assert rc == 0 and "| test_planner_prediction_within_10_percent | passed |" in md


@pytest.mark.parametrize("part", ["image", "video", "scenes"])
def test_measurement_parts_write_their_rows(dry_run, part):
    rc, data, md = dry_run(part)
    assert rc == 0, _log_tail(data)
    (res,) = data["results"]
    rows = res["rows"]
    assert rows and res["meta"]["device"] == "cpu", _log_tail(data)
    for row in rows:
        assert row.get("error") is None or row["decode"].startswith("VRAM Fit"), row
        assert row.get("seconds") is not None or row.get("error"), row
    ours = [r for r in rows if r["decode"].startswith(("VRAM Fit", "Offload", "bf16", "no offload: Tiled"))]
    assert ours, rows
    if part in ("image", "video"):
        auto = next(r for r in rows if r["decode"] == "VRAM Fit auto")
        assert auto["max_abs"] is not None and auto["max_abs"] <= 1e-4, auto
        assert auto["path"].startswith("exact"), auto
    if part == "scenes":
        assert any(r["case"].startswith("(a)") for r in rows) and any(r["case"].startswith("(b)") for r in rows)
        flux = next(r for r in rows if r["case"].startswith("(b)"))
        assert "one transformer step ran" in flux["notes"], flux
    assert f"# GPU suite: {part}" in md and "| case | decode |" in md
