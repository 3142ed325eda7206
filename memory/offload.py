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

Dynamic VRAM (ComfyUI >= 0.33, ``comfy-aimdo``): a *dynamic* model (``ModelPatcherDynamic``,
``patcher.is_dynamic()``) keeps its weights staged in RAM and faults them into aimdo "VBAR" pages on
the GPU when a layer runs; aimdo evicts those pages when torch's allocator needs the room. Its
``loaded_size()`` is those resident pages (32 MiB each) plus ``model.model_loaded_weight_memory``,
the small weights and buffers it force-loads as ordinary tensors. :func:`residency` splits the two
(:class:`Residency`); the pages are *evictable* (usable by a decode without unloading anything) and
live outside torch's allocator: ``torch.cuda.memory_allocated`` never sees them, the driver's free
memory (``get_free_memory``, ``mem_get_info``) does. ``offload_for_decode`` passes
``for_dynamic=False`` to hosts whose ``free_memory`` has that parameter, so dynamic models are
unloaded like any other (``for_dynamic=True`` is ComfyUI's "leave dynamic models to aimdo" mode),
and reports their pages before and after (``evictable_before``/``evictable_after``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from .report import fmt_bytes

log = logging.getLogger("vramfit.memory.offload")

Mode = Literal["needed", "all"]


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
    dynamic: list[str] = dataclasses.field(default_factory=list)
    """Dynamic-VRAM models among ``loaded_before`` (``is_dynamic()``; empty on hosts without it)."""
    evictable_before: int = 0
    """Aimdo pages of the device's dynamic models before the call (:attr:`Residency.evictable`)."""
    evictable_after: int = 0
    for_dynamic: bool | None = None
    """The ``for_dynamic`` argument given to ``free_memory`` (``None``: the host has no such parameter)."""

    @property
    def free_gain(self) -> int | None:
        """Rise of ComfyUI's free memory across the call (driver level on CUDA: aimdo pages included)."""
        if self.free_before is None or self.free_after is None:
            return None
        return self.free_after - self.free_before

    def describe(self) -> str:
        what = "everything" if self.mode == "all" else fmt_bytes(self.required_bytes or 0, "MiB", 0)
        names = ", ".join(self.unloaded + [f"{n} (partly)" for n in self.partially_unloaded]) or "nothing"
        text = (
            f"offload on {self.device} to free {what}: unloaded {names}; "
            f"{len(self.loaded_before)} -> {len(self.loaded_after)} models loaded; "
            f"model weights released {fmt_bytes(self.bytes_freed, 'MiB')}"
        )
        if self.device_bytes_freed is not None:
            text += f", {self.device_measure} {fmt_bytes(self.device_bytes_freed, 'MiB', sign=True)}"
        if self.free_before is not None and self.free_after is not None:
            before = fmt_bytes(self.free_before, "MiB", 0, suffix=False)
            text += f"; free {before} -> {fmt_bytes(self.free_after, 'MiB', 0)}"
        if self.dynamic:
            before = fmt_bytes(self.evictable_before, "MiB", suffix=False)
            text += (
                f"; dynamic VRAM ({', '.join(self.dynamic)}): aimdo pages {before} -> "
                f"{fmt_bytes(self.evictable_after, 'MiB')} (outside torch's allocator)"
            )
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


def is_dynamic(patcher: Any) -> bool:
    """True for a dynamic-VRAM patcher (ComfyUI >= 0.33 ``ModelPatcherDynamic``: ``is_dynamic()``).

    Hosts whose ``ModelPatcher`` has no ``is_dynamic`` (ComfyUI 0.3.x) have no dynamic models.
    """
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


@dataclasses.dataclass(frozen=True)
class Residency:
    """Where one model's weights are, in bytes, from ComfyUI's own bookkeeping (see module docstring).

    ``loaded`` is ``loaded_size()``; ``tensors`` the part held as ordinary torch tensors on the device
    (all of ``loaded`` for a non-dynamic model, ``model.model_loaded_weight_memory`` for a dynamic one).
    """

    name: str
    dynamic: bool
    size: int
    loaded: int
    tensors: int

    @property
    def evictable(self) -> int:
        """Aimdo pages (dynamic models only): resident, evicted on demand when torch allocates."""
        return max(0, self.loaded - self.tensors) if self.dynamic else 0

    @property
    def not_resident(self) -> int:
        """Weights not on the device: staged in RAM (dynamic) or offloaded by a low-VRAM partial load."""
        return max(0, self.size - self.loaded)


def residency(patcher: Any) -> Residency:
    """The :class:`Residency` of a ``ModelPatcher`` (any host; a ``VAE`` or ``LoadedModel`` is accepted too)."""
    p = _patcher(patcher)
    loaded = int(p.loaded_size())
    dynamic = is_dynamic(p)
    tensors = loaded
    if dynamic:
        tensors = min(loaded, int(getattr(getattr(p, "model", None), "model_loaded_weight_memory", 0) or 0))
    return Residency(_name(p), dynamic, int(p.model_size()), loaded, tensors)


@dataclasses.dataclass(frozen=True)
class DeviceResidency:
    """The :class:`Residency` of every model ComfyUI has loaded on one device (one entry per module)."""

    device: str
    models: tuple[Residency, ...]

    @property
    def count(self) -> int:
        return len(self.models)

    @property
    def loaded(self) -> int:
        return sum(m.loaded for m in self.models)

    @property
    def dynamic_count(self) -> int:
        return sum(1 for m in self.models if m.dynamic)

    @property
    def evictable(self) -> int:
        return sum(m.evictable for m in self.models)

    @property
    def staged(self) -> int:
        """Weights of dynamic models not resident (in RAM, faulted in when a layer runs)."""
        return sum(m.not_resident for m in self.models if m.dynamic)


def _excluded(patcher: Any, exclude: list[Any]) -> bool:
    inner = getattr(patcher, "model", None)
    return any(patcher is e or (inner is not None and inner is getattr(e, "model", None)) for e in exclude)


def device_residency(mm: Any, device: torch.device | str, exclude: Iterable[Any] = ()) -> DeviceResidency:
    """Residency of the models in ``mm.current_loaded_models`` on ``device``, except ``exclude``.

    ``exclude`` takes patchers, VAEs or ``LoadedModel``s; a model is excluded when it is one of them
    or a clone of one (same underlying module). Clones loaded twice count once.
    """
    dev = torch.device(device)
    skip = [_patcher(e) for e in exclude]
    seen: set[int] = set()
    out = []
    for lm in _on_device(mm, dev):
        p = lm.model
        key = id(getattr(p, "model", p))
        if key in seen or _excluded(p, skip):
            continue
        seen.add(key)
        out.append(residency(p))
    return DeviceResidency(str(dev), tuple(out))


def evictable_bytes(mm: Any, device: torch.device | str, exclude: Iterable[Any] = ()) -> int:
    """Aimdo pages of the dynamic models on ``device`` except ``exclude``: memory a decode can use
    without unloading anything (aimdo evicts them when torch's allocator needs the room). 0 on hosts
    or devices without dynamic VRAM."""
    return device_residency(mm, device, exclude).evictable


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a parameter called ``name`` (capability check by signature, not version)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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
    tracked = [(lm.model, residency(lm.model)) for lm in before_lms]
    loaded_before = [_name(p) for p, _ in tracked]
    keep_loaded = [lm for lm in before_lms if id(lm.model) in keep_ids]
    free_before = _safe_free(mm, dev)
    dev_before, measure = _device_bytes(dev)

    target = float(required_bytes) if mode == "needed" else 1e30
    kwargs: dict[str, Any] = {"keep_loaded": keep_loaded}
    for_dynamic = None
    if accepts_keyword(mm.free_memory, "for_dynamic"):
        # False: unload dynamic models too (True would leave them for aimdo to evict on demand)
        kwargs["for_dynamic"] = for_dynamic = False
    mm.free_memory(target, dev, **kwargs)
    mm.soft_empty_cache()

    after_lms = _on_device(mm, dev)
    after_ids = {id(lm.model) for lm in after_lms}
    unloaded, partial = [], []
    freed = evict_after = 0
    for p, before in tracked:
        after = residency(p)
        freed += before.loaded - after.loaded
        evict_after += after.evictable if id(p) in after_ids else 0
        if id(p) not in after_ids:
            unloaded.append(_name(p))
        elif after.loaded < before.loaded:
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
        dynamic=[r.name for _, r in tracked if r.dynamic],
        evictable_before=sum(r.evictable for _, r in tracked),
        evictable_after=evict_after,
        for_dynamic=for_dynamic,
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
