"""Offload: free device memory for a decode through ComfyUI's own model management.

Every function takes ``mm``: the ``comfy.model_management`` module (or any object with the same
functions), so this module imports nothing from ComfyUI. Used from ``mm``:
``current_loaded_models`` (list of ``LoadedModel``), ``free_memory(memory_required, device,
keep_loaded)``, ``soft_empty_cache()``, ``get_free_memory(device)``; from each ``LoadedModel``:
``.model`` (its ``ModelPatcher``), ``.device``; from a ``ModelPatcher``: ``loaded_size()``,
``model_size()``, ``.model``.

What "bytes freed" means (both are reported, never assumed):

* ``bytes_freed`` (model level): how much the weights ComfyUI had loaded on ``device`` shrank, i.e.
  the sum over every model that was on the device of ``ModelPatcher.loaded_size()`` before minus
  after. This is ComfyUI's own bookkeeping of the weights it actually moved (partial loads
  included). On ``--cpu`` the load and offload devices are both the CPU: "unloading" moves nothing
  and frees no RAM, yet this figure still counts the weights ComfyUI released from the device.
* ``device_bytes_freed`` (allocator level): on CUDA the drop in ``torch.cuda.memory_allocated``
  across the call (after ``soft_empty_cache``), the memory really returned; on CPU the drop of
  the process resident set (``psutil``), ~0 with ``--cpu`` for the reason above.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any, Literal

import torch

log = logging.getLogger("vramfit.memory.offload")

Mode = Literal["needed", "all"]
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class OffloadReport:
    mode: str
    device: str
    required_bytes: int | None
    unloaded: list[str]
    """Models that left ``current_loaded_models`` (fully unloaded)."""
    partially_unloaded: list[str]
    """Models still listed whose loaded weights shrank (ComfyUI's partial unload)."""
    kept: list[str]
    loaded_before: list[str]
    loaded_after: list[str]
    bytes_freed: int
    """Model level: sum of ``loaded_size()`` on the device before - after (see module docstring)."""
    device_bytes_freed: int | None
    """Allocator level: CUDA ``memory_allocated`` drop, or the process RSS drop on CPU."""
    device_measure: str
    free_before: int | None
    free_after: int | None
    seconds: float

    def describe(self) -> str:
        what = "everything" if self.mode == "all" else f"{(self.required_bytes or 0) / MiB:,.0f} MiB"
        names = ", ".join(self.unloaded + [f"{n} (partly)" for n in self.partially_unloaded]) or "nothing"
        text = (
            f"offload on {self.device} to free {what}: unloaded {names}; "
            f"{len(self.loaded_before)} -> {len(self.loaded_after)} models loaded; "
            f"model weights released {self.bytes_freed / MiB:,.1f} MiB"
        )
        if self.device_bytes_freed is not None:
            text += f", {self.device_measure} {self.device_bytes_freed / MiB:+,.1f} MiB"
        if self.free_before is not None and self.free_after is not None:
            text += f"; free {self.free_before / MiB:,.0f} -> {self.free_after / MiB:,.0f} MiB"
        return text

    def __str__(self) -> str:
        return self.describe()


def _patcher(obj: Any) -> Any:
    """A ``ModelPatcher`` from a patcher, a ComfyUI ``VAE`` (``.patcher``) or a ``LoadedModel``."""
    if hasattr(obj, "loaded_size"):
        return obj
    if hasattr(obj, "patcher"):
        return obj.patcher
    model = getattr(obj, "model", None)
    if model is not None and hasattr(model, "loaded_size"):
        return model
    raise TypeError(f"not a model patcher, VAE or LoadedModel: {type(obj).__name__}")


def _name(patcher: Any) -> str:
    inner = getattr(patcher, "model", None)
    return type(inner).__name__ if inner is not None else type(patcher).__name__


def _same_device(a: Any, b: torch.device) -> bool:
    try:
        return torch.device(a) == b
    except (TypeError, RuntimeError):
        return False


def _on_device(mm: Any, device: torch.device) -> list[Any]:
    return [
        lm
        for lm in list(mm.current_loaded_models)
        if lm.model is not None and _same_device(lm.device, device)
    ]


def _device_bytes(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        return int(torch.cuda.memory_allocated(device)), "CUDA memory_allocated drop"
    if device.type == "cpu":
        try:
            import psutil
        except ImportError:
            return None, "unmeasured"
        return int(psutil.Process().memory_info().rss), "process RSS drop"
    return None, "unmeasured"


def loaded_summary(mm: Any, device: torch.device | str | None = None) -> list[tuple[str, int, int]]:
    """``(name, loaded bytes, total bytes)`` of every model ComfyUI has loaded (on ``device``)."""
    out = []
    for lm in list(mm.current_loaded_models):
        p = lm.model
        if p is None or (device is not None and not _same_device(lm.device, torch.device(device))):
            continue
        out.append((_name(p), int(p.loaded_size()), int(p.model_size())))
    return out


def offload_for_decode(
    mm: Any,
    device: torch.device | str,
    required_bytes: int | None = None,
    keep: Iterable[Any] = (),
    mode: Mode = "needed",
) -> OffloadReport:
    """Unload models from ``device`` except ``keep`` (patchers or VAEs), then ``soft_empty_cache``.

    ``mode="needed"``: ComfyUI's ``free_memory(required_bytes, device, keep_loaded)``: it unloads
    (largest offloadable first, partially when enough) until ``get_free_memory(device)`` exceeds
    ``required_bytes``. ``mode="all"``: every model on the device except ``keep``.
    """
    dev = torch.device(device)
    if mode not in ("needed", "all"):
        raise ValueError(f"mode must be 'needed' or 'all', not {mode!r}")
    if mode == "needed" and (required_bytes is None or required_bytes < 0):
        raise ValueError("mode 'needed' requires required_bytes >= 0")
    t0 = time.perf_counter()
    keep_patchers = [_patcher(k) for k in keep]
    keep_ids = {id(p) for p in keep_patchers}

    before_lms = _on_device(mm, dev)
    # Strong references for the measurement (LoadedModel only keeps weak ones).
    tracked = [(lm.model, int(lm.model.loaded_size())) for lm in before_lms]
    loaded_before = [_name(p) for p, _ in tracked]
    keep_loaded = [lm for lm in before_lms if id(lm.model) in keep_ids]
    free_before = _safe_free(mm, dev)
    dev_before, measure = _device_bytes(dev)

    target = float(required_bytes) if mode == "needed" else 1e30
    mm.free_memory(target, dev, keep_loaded=keep_loaded)
    mm.soft_empty_cache()

    after_lms = _on_device(mm, dev)
    after_ids = {id(lm.model) for lm in after_lms}
    unloaded, partial = [], []
    freed = 0
    for p, size_before in tracked:
        size_after = int(p.loaded_size())
        freed += size_before - size_after
        if id(p) not in after_ids:
            unloaded.append(_name(p))
        elif size_after < size_before:
            partial.append(_name(p))
    dev_after, _ = _device_bytes(dev)
    report = OffloadReport(
        mode=mode,
        device=str(dev),
        required_bytes=None if mode == "all" else int(required_bytes or 0),
        unloaded=unloaded,
        partially_unloaded=partial,
        kept=[_name(p) for p in keep_patchers],
        loaded_before=loaded_before,
        loaded_after=[_name(lm.model) for lm in after_lms],
        bytes_freed=freed,
        device_bytes_freed=None if dev_before is None or dev_after is None else dev_before - dev_after,
        device_measure=measure,
        free_before=free_before,
        free_after=_safe_free(mm, dev),
        seconds=time.perf_counter() - t0,
    )
    del tracked
    log.info("%s", report.describe())
    return report


def _safe_free(mm: Any, device: torch.device) -> int | None:
    try:
        return int(mm.get_free_memory(device))
    except Exception as e:  # noqa: BLE001 - the report must not fail on a measurement
        log.debug("get_free_memory(%s) failed: %s", device, e)
        return None
