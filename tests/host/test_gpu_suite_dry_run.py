"""The GPU suite's dry run: the kit builds within its size limit, and every part runs on the CPU at tiny
sizes (``bench/gpu_suite.sh PART --cpu --small``) on this test run's host, so the suite never rots.

The kit is built once per checkout (``scripts/gpu_kit.sh``; idempotent; needs PyPI the first time). The
parts run exactly as on a lent GPU (the kit's ComfyUI tree of this host's version unpacked and this pack
linked into it, one fresh process per part, JSON + Markdown written) except for the device, the sizes and
the interpreter (this host's, with its own packages; the kit's CPython 3.12 site is for the device).

The kit holds ComfyUI 0.33.0 exactly when its source exists (:data:`SRC_033`): CI's clone has it beside it
and exports it, a user's clone has none and gets a kit of 0.3.75 alone; the tests say which case they ran.

Run with ``VRAMFIT_GPU_DRY_RUN=1`` (``.ci/run`` sets it): about two minutes on 2 cores, for the GPU suite's
maintainers, not for a user's default run of README's test command.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

from scripts.host import cache_dir

pytestmark = [
    pytest.mark.host,
    pytest.mark.skipif(os.environ.get("VRAMFIT_GPU_DRY_RUN", "") in ("", "0"),
                       reason="the GPU suite's CPU dry run: set VRAMFIT_GPU_DRY_RUN=1 (CI does)"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]
KIT = pathlib.Path(os.environ.get("VRAMFIT_GPU_KIT") or ROOT / ".gpu")
SRC_033 = pathlib.Path(os.environ.get("VRAMFIT_GPU_033_SRC")
                       or ROOT.parent / "shared" / "hosts" / "comfyui-0.33.0.tar.gz")
"""ComfyUI 0.33.0's source where ``scripts/gpu_kit.sh`` looks (its default, or the variable CI sets)."""
KIT_LIMIT_MIB = 60


def _device_tests() -> set[str]:
    """The ids of the tests in tests/cuda, as pytest collects them (the ``tests`` part must run them all)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "cuda")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = {line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line}
    assert ids, out.stdout[-2000:] + out.stderr[-2000:]
    return ids


@pytest.fixture(scope="module")
def kit() -> pathlib.Path:
    subprocess.run(["bash", str(ROOT / "scripts" / "gpu_kit.sh")], cwd=ROOT, check=True, timeout=900,
                   env=dict(os.environ, VRAMFIT_GPU_KIT=str(KIT)))
    return KIT


def _kit_files(kit: pathlib.Path) -> list[str]:
    return sorted(p.name for p in kit.rglob("*") if p.is_file() and not p.name.endswith(".id"))


def test_kit_holds_the_default_host_and_the_site_within_the_limit(kit):
    files = _kit_files(kit)
    assert set(files) - {"comfyui-0.33.0.tar.xz"} == {"comfyui-0.3.75.tar.xz", "site.tar.xz"}, files
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size <= KIT_LIMIT_MIB * 2**20, f"kit {size / 2**20:.1f} MiB > {KIT_LIMIT_MIB} MiB"


def test_kit_holds_0_33_0_exactly_when_its_source_exists(kit):
    packed = "comfyui-0.33.0.tar.xz" in _kit_files(kit)
    if not SRC_033.is_file():
        assert not packed, _kit_files(kit)
        pytest.skip(f"no ComfyUI 0.33.0 source at {SRC_033} (a clone without ../shared): the kit holds "
                    "0.3.75 only, as it must; set VRAMFIT_GPU_033_SRC to pack and test 0.33.0 too")
    assert packed, f"{SRC_033} exists but the kit lacks ComfyUI 0.33.0: {_kit_files(kit)}"
    digest = hashlib.sha1(SRC_033.read_bytes()).hexdigest()[:12]
    assert (kit / "hosts" / "comfyui-0.33.0.tar.xz.id").read_text().strip() == digest


def test_a_kit_without_0_33_0_drops_its_stale_unpacked_tree_and_refuses_to_run_it(tmp_path):
    """A one-host kit: ``--hosts 0.33.0`` fails naming what the kit holds (never a silent 0.3.75-only run)."""
    kit, work = tmp_path / "kit", tmp_path / "work"
    src = tmp_path / "src" / "ComfyUI"
    (src / "comfy").mkdir(parents=True)
    (src / "models" / "vae").mkdir(parents=True)
    (src / "comfyui_version.py").write_text('__version__ = "0.3.75"\n')
    (src / "comfy" / "cli_args.py").write_text("")
    (kit / "hosts").mkdir(parents=True)
    with tarfile.open(kit / "hosts" / "comfyui-0.3.75.tar.xz", "w:xz") as tar:
        tar.add(src, arcname="ComfyUI")
    (kit / "hosts" / "comfyui-0.3.75.tar.xz.id").write_text("fake\n")
    stale = work / "hosts" / "comfyui-0.33.0" / "ComfyUI"
    stale.mkdir(parents=True)
    (stale / "comfyui_version.py").write_text('__version__ = "0.33.0"\n')
    env = dict(os.environ, OUT=str(tmp_path / "out"), VRAMFIT_GPU_KIT=str(kit), VRAMFIT_GPU_WORK=str(work),
               VRAMFIT_SUITE_PYTHON=sys.executable, VRAMFIT_SUITE_MODELS=str(tmp_path / "models"))
    cmd = ["bash", str(ROOT / "bench" / "gpu_suite.sh"), "tests", "--cpu", "--small", "--hosts", "0.33.0"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "the kit holds ComfyUI ['0.3.75'], not ['0.33.0']" in res.stderr, res.stderr
    assert not stale.parent.exists() and (work / "hosts" / "comfyui-0.3.75" / "ComfyUI").is_dir()
    assert not (tmp_path / "out" / "tests.json").exists()


@pytest.fixture(scope="module")
def dry_run(kit, host_config, tmp_path_factory):
    """``run(part) -> (exit code, results json, markdown)`` of the dry run on this host's version."""
    versions = {p.name.removeprefix("comfyui-").removesuffix(".tar.xz")
                for p in (kit / "hosts").glob("*.tar.xz")}
    if host_config.version not in versions:
        pytest.skip(f"the kit holds ComfyUI {sorted(versions)}, not this host's {host_config.version} "
                    f"(0.33.0 is packed only where its source is: {SRC_033})")
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
        cmd = ["bash", str(ROOT / "bench" / "gpu_suite.sh"), part, "--cpu", "--small",
               "--hosts", host_config.version]
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
    assert set(outcomes) == _device_tests(), outcomes
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
        cases = [r["case"] for r in rows]
        assert any(c.startswith("(a)") for c in cases) and any(c.startswith("(b)") for c in cases)
        flux = next(r for r in rows if r["case"].startswith("(b)"))
        assert "one transformer step ran" in flux["notes"], flux
    assert f"# GPU suite: {part}" in md and "| case | decode |" in md
