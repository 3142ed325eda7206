"""pyproject.toml carries what the Comfy Registry shows, in the forms it accepts (issue 37, item 5).

comfy-cli (``comfy node validate``, 1.23) passes a pyproject whose fields the Registry then drops: one classifier
outside its lists drops all of them, a malformed ``requires-comfyui`` is left out, an empty ``Icon`` shows no icon.
So this checks the fields themselves, against this checkout:

* ``[tool.comfy]``: PublisherId, DisplayName, an Icon URL that names a PNG of this repository (the file exists,
  within the Registry's 800x400 px), ``requires-comfyui`` in the Registry's ``[operator]X.Y.Z`` form and equal to
  the oldest ComfyUI README says the tests run on;
* ``[project]``: a Registry node id, an X.Y.Z version, the project URLs comfy-cli reads (Homepage, Documentation,
  Repository, Issues) under the repository, classifiers the Registry accepts.
"""

from __future__ import annotations

import pathlib
import re
import struct

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the hosts' Python)

ROOT = pathlib.Path(__file__).resolve().parents[2]
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {"GPU :: NVIDIA CUDA", "GPU :: AMD ROCm", "GPU :: Intel Arc", "NPU :: Huawei Ascend", "GPU :: Apple Metal"}
VERSION_PART = re.compile(r"^(==|>=|<=|!=|~=|>|<|<>|=)?\s*(\d+\.\d+\.\d+(-[A-Za-z0-9]+)?)$")


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _png_size(path: pathlib.Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_tool_comfy_fields(pyproject) -> None:
    comfy = pyproject["tool"]["comfy"]
    assert re.fullmatch(r"[a-z0-9-]+", comfy["PublisherId"]), comfy["PublisherId"]
    assert comfy["DisplayName"] == "VRAM Fit"
    repo = pyproject["project"]["urls"]["Repository"]
    owner_repo = repo.removeprefix("https://github.com/")
    prefix = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    icon = comfy["Icon"]
    assert icon.startswith(prefix), (icon, prefix)
    path = ROOT / icon.removeprefix(prefix)
    assert path.is_file(), f"Icon {icon} names {path}, which is not in this checkout"
    w, h = _png_size(path)
    assert 64 <= w <= 800 and 64 <= h <= 400, (w, h)  # the Registry's limit: 800 x 400 px


def test_requires_comfyui_is_the_oldest_tested_host(pyproject) -> None:
    spec = pyproject["tool"]["comfy"]["requires-comfyui"]
    parts = [VERSION_PART.match(p.strip()) for p in spec.split(",")]
    assert all(parts), f"requires-comfyui {spec!r} is not in the Registry's [operator]X.Y.Z form"
    lower = [m[2] for m in parts if m and m[1] in (">=", None, "==")]
    tested = re.search(r"\*\*Tested with ComfyUI ([\d.]+) and ([\d.]+)\.\*\*", (ROOT / "README.md").read_text())
    assert tested, "README no longer says which ComfyUI versions the tests run on"
    oldest = min(tested.groups(), key=lambda v: tuple(int(x) for x in v.split(".")))
    assert lower == [oldest], (spec, tested.groups())


def test_project_fields_the_registry_reads(pyproject) -> None:
    project = pyproject["project"]
    name = project["name"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*", name), name
    assert not re.search(r"[._-]{2}", name), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), project["version"]
    assert project["description"] and project["license"]
    urls = project["urls"]
    repo = urls["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo), repo
    for key in ("Homepage", "Documentation", "Issues"):
        assert urls[key].startswith(repo), (key, urls[key])
    assert urls["Issues"] == f"{repo}/issues"
    docs = urls["Documentation"].removeprefix(f"{repo}/tree/main/")
    assert (ROOT / docs).is_dir(), urls["Documentation"]


def test_classifiers_are_ones_the_registry_keeps(pyproject) -> None:
    classifiers = pyproject["project"]["classifiers"]
    oses = [c.removeprefix("Operating System :: ") for c in classifiers if c.startswith("Operating System :: ")]
    assert oses and all(o.startswith(OS_PREFIXES) for o in oses), oses
    envs = [c.removeprefix("Environment :: ") for c in classifiers if c.startswith("Environment ::")]
    assert all(e in ACCELERATORS for e in envs), envs
