"""Shared fixtures.

* The pack is importable as ``vramfit`` with no ComfyUI (unit tests of ``memory/``).
* ``comfy``: a real ComfyUI host loaded in-process in ``--cpu`` mode, every node loaded by ComfyUI's
  own loader (this pack included); returns ComfyUI's top-level ``nodes`` module.
* ``fixture_vaes``: random-weight VAEs with the real architectures in the host's ``models/vae``.
* ``server`` / ``client``: a real ComfyUI server started headless on 127.0.0.1 for API tests.
* ``VRAMFIT_STRICT=1``: the pack's own path may not fall back to the host's result silently.
* The ``slow`` tier (tests marked ``slow``: a wider shape, a second route to a verdict the default run already
  proves, an end-to-end template run) runs with ``VRAMFIT_SLOW=1`` (``.ci/run`` sets it) or when ``-m`` names it;
  a user's default run skips it (README's 15-minute budget).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

# The pack's own path must work in its tests: a failure of its machinery raises here instead of being replaced by
# the host's result (memory/decode/guard.py; the servers the tests start inherit it). The never-worse tests set 0.
os.environ.setdefault("VRAMFIT_STRICT", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
# ``scripts`` (host harness, fixtures) is importable; appended so ComfyUI's modules still win.
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))


def _import_pack_as_vramfit():
    if "vramfit" in sys.modules:
        return sys.modules["vramfit"]
    spec = importlib.util.spec_from_file_location(
        "vramfit", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["vramfit"] = module
    spec.loader.exec_module(module)
    return module


_import_pack_as_vramfit()

SLOW_ENV = "VRAMFIT_SLOW"


def pytest_collection_modifyitems(config, items):
    """Skip the ``slow`` tier unless ``VRAMFIT_SLOW=1`` or a ``-m`` expression names it."""
    if os.environ.get(SLOW_ENV, "") not in ("", "0") or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason=f"slow tier: runs where CI runs it ({SLOW_ENV}=1, set by .ci/run)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def host_config():
    from scripts.host import HostConfig

    return HostConfig.load()


@pytest.fixture(scope="session")
def comfy(host_config):
    """ComfyUI's ``nodes`` module of an in-process ``--cpu`` host with every node loaded."""
    from scripts.host import load_comfy_in_process

    return load_comfy_in_process(host_config)


@pytest.fixture(scope="session")
def fixture_vaes(host_config):
    """``{kind: filename}`` of the random-weight fixture VAEs in the host's models/vae folder, each made on
    first use (:class:`scripts.fixtures.files.FixtureFolder`: on a small disk only the files in use must fit)."""
    from scripts.host import import_comfy

    import_comfy(host_config)
    from scripts.fixtures.files import FixtureFolder

    return FixtureFolder(host_config.models_dir / "vae", seed=0)


@pytest.fixture(scope="session")
def server(host_config, fixture_vaes, tmp_path_factory):
    """A real ComfyUI server on 127.0.0.1 (each fixture model made when a test first names it)."""
    from scripts.host import ComfyServer

    srv = ComfyServer(host_config, work_dir=tmp_path_factory.mktemp("comfy-server"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client(timeout=60.0)


# --------------------------------------------------------------------------------------------------
# Shared by the decode tests (helpers: ``tests/helpers.py``)


@pytest.fixture()
def inference_mode():
    """The test body under ``torch.inference_mode()``, as ComfyUI's executor runs every node
    (``pytestmark = pytest.mark.usefixtures("inference_mode")``; module-scoped fixtures run outside it)."""
    import torch

    with torch.inference_mode():
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a whole module (``pytestmark = pytest.mark.usefixtures("one_thread")``);
    see ``tests.helpers.one_thread``."""
    from tests.helpers import one_thread as ctx

    with ctx():
        yield


@pytest.fixture()
def fresh_stores(comfy, monkeypatch, tmp_path):
    """The nodes' stores new, backed by an empty user folder (a fresh install): self-check verdicts, sized peaks,
    cost models and observed ratios are found or made again. Returns the folder."""
    import importlib

    base = comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__.rsplit(".nodes.", 1)[0]
    monkeypatch.setattr(importlib.import_module(f"{base}.nodes._decode_node"), "_STORES", {})
    monkeypatch.setattr(importlib.import_module(f"{base}.nodes._comfy"), "user_cache_file",
                        lambda name, what: tmp_path / name)
    return tmp_path


@pytest.fixture(scope="session")
def kl_vae(comfy, fixture_vaes):
    """The random-weight fixture SD KL VAE loaded by ComfyUI's own ``VAELoader`` (one per session)."""
    return comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]


@pytest.fixture(scope="module")
def flux_vae(comfy, fixture_vaes):
    """The random-weight FLUX VAE (16-channel KL) by ``VAELoader``; unloaded after the module, since later
    tests count the models ComfyUI has loaded."""
    import comfy.model_management as mm

    vae = comfy.VAELoader().load_vae(fixture_vaes["flux"])[0]
    yield vae
    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)
