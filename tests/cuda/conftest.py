"""The CUDA-path tests run only inside the GPU suite (``bench/gpu_suite.sh tests``).

The suite sets ``VRAMFIT_COMFY_DEVICE`` (``cuda`` on a GPU; ``cpu`` for the dry run, ``--cpu --small``)
and the in-process host loads ComfyUI on that device. A plain ``pytest`` leaves it unset: ComfyUI is then
loaded ``--cpu`` for the other tiers and these tests are skipped here, because the dry run in
``tests/server/test_gpu_suite_dry_run.py`` runs them (on CPU) in every default test run.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from scripts.host import DEVICE_ENV

SMALL = os.environ.get("VRAMFIT_SUITE_SMALL") == "1"
"""Tiny sizes (the dry run)."""


def pytest_collection_modifyitems(config, items):
    if os.environ.get(DEVICE_ENV):
        return
    skip = pytest.mark.skip(reason=f"runs in the GPU suite (bench/gpu_suite.sh tests), which sets {DEVICE_ENV}")
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(comfy) -> torch.device:
    """The device ComfyUI decodes on in this run (``VRAMFIT_COMFY_DEVICE``)."""
    import comfy.model_management as mm

    dev = torch.device(mm.vae_device())
    want = os.environ[DEVICE_ENV]
    assert dev.type == torch.device(want).type, f"{DEVICE_ENV}={want} but ComfyUI decodes on {dev}"
    return dev


@pytest.fixture(scope="session")
def suite_kl(comfy, host_config):
    """The random-weight KL VAE (only this fixture: the suite does not build the video VAEs here)."""
    from scripts.fixtures.files import make_models

    path = make_models(host_config.models_dir / "vae", seed=0, kinds=["kl_f8"])["kl_f8"]
    return comfy.VAELoader().load_vae(path.name)[0]


@pytest.fixture(scope="session")
def suite_kl_fp32(comfy, host_config, suite_kl):
    """The same file loaded in float32 on the same device: the reference both bfloat16 decodes round from."""
    import comfy.sd
    import comfy.utils

    from scripts.fixtures.files import make_models

    path = make_models(host_config.models_dir / "vae", seed=0, kinds=["kl_f8"])["kl_f8"]
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)), dtype=torch.float32)


@pytest.fixture(scope="session")
def tiled(comfy):
    """This pack's Tiled VAE Decode node module, as ComfyUI imported it (hooks are set on it)."""
    mod = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]
    yield mod
    mod._FAULT_HOOK = None
    mod.MEASURE_CPU_TENSORS = True


@pytest.fixture(scope="session")
def pack_memory(tiled):
    """``name -> module`` of the pack's ``memory`` package as ComfyUI's loader imported it."""
    base = tiled.__name__.rsplit(".nodes.", 1)[0]
    import importlib

    return lambda name: importlib.import_module(f"{base}.memory.{name}")
