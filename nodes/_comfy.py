"""ComfyUI glue shared by the node adapters: the only place ``nodes/`` touches ``comfy`` internals.

Everything here turns ComfyUI state into the plain inputs ``memory/`` takes (devices, free-memory
callables, progress and cancel callbacks, the OOM exception type, a cost-model cache path).
Imported only inside ComfyUI (by the node modules).
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

import comfy.model_management as mm
import comfy.utils
import folder_paths
import torch

from ..memory.budget import Budget, compute_budget, weights_to_load
from ..memory.cost_model import CostModelStore
from ..memory.offload import OffloadReport, offload_for_decode

log = logging.getLogger("vramfit")

CATEGORY = "VRAM Fit"
_STORE: CostModelStore | None = None


class NodeInputError(ValueError):
    """Bad input to a VRAM Fit node; the message names the node and the value."""

    def __init__(self, node: str, message: str):
        super().__init__(f"[VRAM Fit · {node}] {message}")


def oom_exceptions() -> tuple[type[BaseException], ...]:
    """The exception types ComfyUI treats as out-of-memory on this machine."""
    exc = getattr(mm, "OOM_EXCEPTION", None) or torch.cuda.OutOfMemoryError
    return (exc,) if isinstance(exc, type) else tuple(exc)


def should_stop() -> None:
    """Raises ComfyUI's interrupt exception when the user pressed Cancel."""
    mm.throw_exception_if_processing_interrupted()


def progress_callback(total: int, node_id: str | None = None) -> Callable[[int, int], None]:
    """``progress(done, total)`` driving ComfyUI's progress bar of the running node."""
    bar = comfy.utils.ProgressBar(max(1, int(total)), node_id=node_id)

    def progress(done: int, total_now: int | None = None) -> None:
        bar.update_absolute(int(done), total=None if total_now is None else max(1, int(total_now)))

    return progress


def intermediate_device() -> torch.device:
    return mm.intermediate_device()


def vae_patcher(vae: Any) -> Any:
    return getattr(vae, "patcher", vae)


def vae_budget(vae: Any, budget_mb: float | None) -> Budget:
    """Bytes a decode with ``vae`` may use on its device (user budget in MB overrides free memory)."""
    device = torch.device(vae.device)
    patcher = vae_patcher(vae)
    to_load = 0
    if hasattr(patcher, "model_size") and hasattr(patcher, "loaded_size"):
        to_load = weights_to_load(patcher.model_size(), patcher.loaded_size())
    return compute_budget(
        device,
        mm.get_free_memory,
        get_total_memory=mm.get_total_memory,
        vae_weights_to_load=to_load,
        reserve_floor=int(mm.extra_reserved_memory()) if device.type != "cpu" else 0,
        user_budget_mb=budget_mb if budget_mb and budget_mb > 0 else None,
    )


def offload_others(vae: Any, required_bytes: int | None, mode: str = "needed") -> OffloadReport:
    """Unload upstream models from the VAE's device (keeping the VAE) before a decode."""
    return offload_for_decode(mm, torch.device(vae.device), required_bytes, keep=[vae_patcher(vae)], mode=mode)


def load_vae_weights(vae: Any, decode_bytes: int) -> None:
    """Put the VAE's weights on its device the way ComfyUI's own decode does."""
    mm.load_models_gpu([vae_patcher(vae)], memory_required=int(decode_bytes), force_full_load=True)


def cost_model_store() -> CostModelStore:
    """Process-wide store: shipped defaults + calibrations cached in ComfyUI's user folder."""
    global _STORE
    if _STORE is None:
        path: pathlib.Path | None
        try:
            path = pathlib.Path(folder_paths.get_user_directory()) / "vramfit" / "cost_models.json"
            path.parent.mkdir(parents=True, exist_ok=True)
        except (OSError, AttributeError) as e:  # read-only install: keep calibrations in memory
            log.warning("VRAM Fit: cost-model cache disabled (%s); calibrations are kept in memory", e)
            path = None
        _STORE = CostModelStore(path)
    return _STORE
