"""The newest upstream VAE code as a test host: ``tests/upstream/files`` (upstream ComfyUI files newer than 0.33.0,
byte for byte, with their commits in ``tests/upstream/MANIFEST.json``) loaded over a ComfyUI 0.33.0 host's modules.

No newer whole tree can be had here, and the newest ``comfy/sd.py`` does not import over 0.33.0 (it needs newer
text encoders, ``comfy.storage`` and a ``ModelPatcher`` taking ``fast_disk``). So the VAE modules are loaded under
their own names (``comfy.ldm.wan.vae2_2``, ...) in place of 0.33.0's for the duration of :func:`newest`, and each VAE
is built as the newest ``sd.py`` builds it (``scripts/upstream_wan.py``, ``upstream_seedvr2.py``,
``upstream_minimax.py``). Where a newest module calls a ComfyUI
helper 0.33.0 lacks, :data:`STAND_INS` gives it the value a CPU host has (every such helper serves a CUDA-only fast
path: a kitchen kernel, int8 attention, pinned-memory eviction); a missing helper the leg does not know fails by
name. Test harness only; the pack never imports this.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import pathlib
import sys
import types
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "tests" / "upstream"
FILES = UPSTREAM / "files"

VAE_MODULES = (
    "comfy.ldm.modules.diffusionmodules.model",
    "comfy.ldm.wan.vae",
    "comfy.ldm.wan.vae2_2",
    "comfy.ldm.seedvr.constants",
    "comfy.ldm.seedvr.vae",
    "comfy.ldm.minimax.vae",
)
"""The newest files the leg loads, in import order (a module's imports bind to what is loaded before it)."""


def _int8_layout_stand_in() -> type:
    class TensorWiseINT8Layout:  # noqa: D401 - never instantiated on a CPU host (int8 caches are CUDA-only)
        """Stand-in for ``comfy.quant_ops.TensorWiseINT8Layout`` (newer than 0.33.0)."""

    return TensorWiseINT8Layout


STAND_INS: dict[tuple[str, str], Any] = {
    # the fp16-accumulate opt-in of the kitchen GEMMs and convs (CUDA fp16 only): off
    ("comfy.ops", "_fp16_linear_wanted"): lambda *a, **k: False,
    # int8 cache tails of SeedVR2's CausalMemoryCache: a layout class the CPU path never builds
    ("comfy.quant_ops", "TensorWiseINT8Layout"): _int8_layout_stand_in(),
    # pinned host memory for cache offload (CUDA streams): nothing to pin or unpin on the CPU
    ("comfy.model_management", "ensure_pin_budget"): lambda *a, **k: None,
    ("comfy.model_management", "unpin_memory"): lambda *a, **k: False,
    # int8 attention of MiniMax H3 (kitchen, CUDA): unavailable
    ("comfy.ldm.modules.attention", "COMFY_KITCHEN_INT8_ATTENTION_IS_AVAILABLE"): False,
}
"""``(module, attribute): value`` set only where the host lacks the attribute, and removed afterwards."""

MISSING_CONSTANTS = {
    "SEEDVR2_EAGER_DECODE_FACTOR": 1.0,
    "SEEDVR2_EAGER_ENCODE_FACTOR": 1.0,
}
"""Names the newest ``seedvr/vae.py`` (``1fa9472c``) imports from ``seedvr/constants.py`` that the newest stored
``constants.py`` (``9738444c``) lacks (a later commit adds them; the index holds none): factors of its own memory
estimates, which decide nothing the tests compare. Set on the constants module before ``vae.py`` loads."""


def manifest() -> dict[str, dict]:
    """``{path: entry}`` of the stored files (repository, commit, sha256, note)."""
    data = json.loads((UPSTREAM / "MANIFEST.json").read_text())
    return {f["path"]: f for f in data["files"]}


def path_of(module: str) -> pathlib.Path:
    return FILES / (module.replace(".", "/") + ".py")


def commit_of(module: str) -> str:
    """The upstream commit of ``module``'s stored file (40 hex)."""
    return manifest()[path_of(module).relative_to(FILES).as_posix()]["commit"]


def _load(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path_of(name))
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    parent, _, leaf = name.rpartition(".")
    setattr(importlib.import_module(parent), leaf, module)
    if name == "comfy.ldm.seedvr.constants":
        spec.loader.exec_module(module)
        for key, value in MISSING_CONSTANTS.items():
            if not hasattr(module, key):
                setattr(module, key, value)
        return module
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def newest(modules: tuple[str, ...] = VAE_MODULES) -> Iterator[dict[str, types.ModuleType]]:
    """Inside: ``modules`` are the newest stored upstream files (with :data:`STAND_INS` for what 0.33.0 lacks);
    ComfyUI's own modules (``comfy.sd`` included) reach them through their packages. 0.33.0's come back after."""
    saved_modules = {name: sys.modules.get(name) for name in modules}
    for name in modules:  # the host's own first (its package, and the module to restore)
        importlib.import_module(name.rpartition(".")[0])
        with contextlib.suppress(ModuleNotFoundError):
            saved_modules[name] = importlib.import_module(name)
    added: list[tuple[Any, str]] = []
    for (mod_name, attr), value in STAND_INS.items():
        mod = importlib.import_module(mod_name)
        if not hasattr(mod, attr):
            setattr(mod, attr, value)
            added.append((mod, attr))
    loaded: dict[str, types.ModuleType] = {}
    try:
        for name in modules:
            loaded[name] = _load(name)
        yield loaded
    finally:
        for name in reversed(modules):
            old = saved_modules.get(name)
            parent, _, leaf = name.rpartition(".")
            if old is None:
                sys.modules.pop(name, None)
                with contextlib.suppress(AttributeError):
                    delattr(importlib.import_module(parent), leaf)
            else:
                sys.modules[name] = old
                setattr(importlib.import_module(parent), leaf, old)
        for mod, attr in added:
            delattr(mod, attr)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """ComfyUI's "No VAE weights detected" warning (root logger) while a builder calls ``VAE(sd={})``: expected."""
    logger = logging.getLogger()
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
