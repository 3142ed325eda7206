"""Peak-memory tracking of a block of code.

``PeakTracker`` is a context manager reporting the peak bytes a block allocated on one device:

* ``method="dispatch"`` (CPU, ``meta``, and any device on request): a ``TorchDispatchMode`` sees the
  output of every aten op run inside the block. Bytes are counted per *untyped storage* (a view or
  an in-place op returns a storage that is already counted, so nothing is counted twice), and a
  ``weakref.finalize`` on each storage object removes its bytes the moment torch frees it (PyTorch
  keeps one Python object per storage alive as long as the storage, so the finalizer fires exactly
  when the memory is released). Storages that existed before entry are never counted: a storage
  is new when an op returns it and it is neither one of the op's inputs nor already tracked.
  What it cannot see: scratch memory a C++ kernel allocates and frees *inside* one op (e.g. a
  convolution workspace) and allocator overhead/fragmentation. On ``meta`` it is the only
  meaningful measure (nothing is allocated).
* ``method="cuda"``: ``torch.cuda.reset_peak_memory_stats`` at entry, then
  ``max_memory_allocated``/``max_memory_reserved`` at exit, relative to the values at entry. This is
  the allocator's own truth (kernel workspaces included) and is what matters for OOM on a GPU.

* ``method="rss"`` (Linux, CPU): the *process* resident-set high-water mark (``VmHWM``, reset through
  ``/proc/self/clear_refs`` at entry after ``malloc_trim``) above the resident set at entry. It
  sees everything the dispatch count cannot (oneDNN scratch and re-layouts, allocator overhead) but
  is process-wide (other threads count too) and page-granular; the bench uses it to measure how far
  the process grows beyond the tensor-level peak on CPU.

``method="auto"`` picks ``cuda`` for a CUDA device and ``dispatch`` elsewhere.

All figures are bytes *above the baseline at entry*: ``peak_bytes`` (highest live bytes reached),
``end_bytes`` (still alive at exit), and on CUDA ``peak_reserved_bytes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Literal, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..report import fmt_bytes
from . import procfs
from .procfs import rss_peak_supported as rss_supported

log = logging.getLogger("vramfit.memory.measure.tracker")

Method = Literal["auto", "dispatch", "cuda", "rss"]


class PeakMeter(Protocol):
    """What calibration needs from a tracker: a context manager with ``peak_bytes`` after exit."""

    peak_bytes: int

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> Any: ...


@dataclasses.dataclass(frozen=True)
class PeakResult:
    """Frozen figures of one tracked block (bytes above the baseline at entry)."""

    device: str
    method: str
    peak_bytes: int
    end_bytes: int
    peak_reserved_bytes: int | None = None
    allocations: int = 0

    def describe(self) -> str:
        peak, end = fmt_bytes(self.peak_bytes, "MiB"), fmt_bytes(self.end_bytes, "MiB")
        text = f"peak {peak} (end {end}) on {self.device} via {self.method}"
        if self.peak_reserved_bytes is not None:
            text += f", reserved peak {fmt_bytes(self.peak_reserved_bytes, 'MiB')}"
        return text


def _storage_nbytes(storage: torch.UntypedStorage) -> int:
    return int(storage.nbytes())


def _fake_types() -> tuple[type, bool]:
    """``FakeTensor`` and whether a fake mode (a :class:`.sizing.MetaSizer` run) is active now."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return FakeTensor, any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


class _StorageCounter(TorchDispatchMode):
    """Counts live bytes of storages created by ops under the mode, on one device type. Entered inside a
    fake mode (a :class:`.sizing.MetaSizer` run) it counts the fake tensors, as a real run would allocate;
    entered outside, only real ones: a sizing run inside a measured block allocates nothing."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self._fake_type, self._in_fake_mode = _fake_types()
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # id(storage) -> nbytes
        self._finalizers: dict[int, weakref.finalize] = {}
        self.current = 0
        self.peak = 0
        self.allocations = 0
        self.active = True

    def _on_free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            self._finalizers.pop(key, None)
            if nbytes is not None:
                self.current -= nbytes

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = _storage_nbytes(storage)
        with self._lock:
            known = self._live.get(key)
            if known is None:
                self._live[key] = nbytes
                self._finalizers[key] = weakref.finalize(storage, self._on_free, key)
                self.current += nbytes
                self.allocations += 1
            elif nbytes != known:  # a tracked storage was resized in place
                self._live[key] = nbytes
                self.current += nbytes - known
            if self.current > self.peak:
                self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        inputs, _ = tree_flatten((args, kwargs))
        input_ids = {
            id(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor) and _has_storage(t)
        }
        outputs, _ = tree_flatten(out)
        for t in outputs:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type or not _has_storage(t):
                continue
            if isinstance(t, self._fake_type) and not self._in_fake_mode:
                continue  # sizing inside a measured block: nothing is allocated
            storage = t.untyped_storage()
            key = id(storage)
            if key in input_ids and key not in self._live:
                continue  # a view of / in-place op on memory that existed before entry
            self._track(storage)
        return out

    def close(self) -> int:
        """Stop counting; detach every finalizer. Returns the bytes still alive."""
        with self._lock:
            self.active = False
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            end = self.current
            self._live.clear()
        return end


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Inside: the dispatch counters of this thread's trackers count nothing new. For bookkeeping that is no
    part of the block's memory: a fake run that only records the shapes of a decoder's calls, which a sizing run
    would otherwise count as if it were allocated."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _StorageCounter) and m.active]
    for c in counters:
        c.active = False
    try:
        yield
    finally:
        for c in counters:
            c.active = True


def active_counters() -> list[_StorageCounter]:
    """The dispatch counters of this thread's trackers that count now (outermost first)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _StorageCounter) and m.active]


@contextlib.contextmanager
def own_peaks(counters: list[_StorageCounter]) -> Iterator[list[int]]:
    """Inside: a block; after it, the yielded list holds, per counter of ``counters``, the block's own peak above
    the live bytes at its start (each counter keeps the higher of its peak before and the block's)."""
    starts = []
    for c in counters:
        with c._lock:
            starts.append((c.current, c.peak))
            c.peak = c.current
    out: list[int] = []
    try:
        yield out
    finally:
        for c, (current, peak) in zip(counters, starts, strict=True):
            with c._lock:
                out.append(c.peak - current)
                c.peak = max(peak, c.peak)


def raise_peaks(counters: list[_StorageCounter], own: list[int]) -> None:
    """Count, per counter, a block whose own peak (:func:`own_peaks`) is ``own`` above the live bytes now,
    without running it (a sizing run's repeat of a block it ran already)."""
    for c, d in zip(counters, own, strict=True):
        with c._lock:
            c.peak = max(c.peak, c.current + d)


def _has_storage(t: torch.Tensor) -> bool:
    # Sparse/nested or functional wrappers have no plain storage; they are not counted.
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


class PeakTracker:
    """Context manager: peak bytes allocated by the block on ``device`` (see module docstring)."""

    def __init__(self, device: torch.device | str = "cpu", method: Method = "auto") -> None:
        self.device = torch.device(device)
        if method == "auto":
            method = "cuda" if self.device.type == "cuda" else "dispatch"
        if method == "cuda" and self.device.type != "cuda":
            raise ValueError(f"method 'cuda' needs a CUDA device, not {self.device}")
        if method == "rss" and (self.device.type != "cpu" or not rss_supported()):
            raise ValueError("method 'rss' needs a CPU device on Linux (/proc/self/clear_refs)")
        if method not in ("dispatch", "cuda", "rss"):
            raise ValueError(f"unknown tracker method {method!r}")
        self.method: str = method
        self.peak_bytes = 0
        self.end_bytes = 0
        self.peak_reserved_bytes: int | None = None
        self.allocations = 0
        self._counter: _StorageCounter | None = None
        self._base_alloc = 0
        self._base_reserved = 0
        self._entered = False
        self._done = False

    # -- live view (dispatch method only) --------------------------------------------------
    @property
    def current_bytes(self) -> int:
        """Live bytes above the baseline right now (dispatch method; CUDA: allocator delta)."""
        if self._counter is not None and not self._done:
            return self._counter.current
        if self.method == "cuda" and self._entered and not self._done:
            return int(torch.cuda.memory_allocated(self.device)) - self._base_alloc
        return self.end_bytes

    @property
    def peak_so_far(self) -> int:
        """Peak live bytes above the baseline reached so far (dispatch method; else the peak after exit)."""
        if self._counter is not None and not self._done:
            return self._counter.peak
        return self.peak_bytes

    def __enter__(self) -> PeakTracker:
        if self._entered:
            raise RuntimeError("a PeakTracker can be entered only once; create a new one")
        self._entered = True
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            self._base_alloc = int(torch.cuda.memory_allocated(self.device))
            self._base_reserved = int(torch.cuda.memory_reserved(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.method == "rss":
            procfs.malloc_trim()
            if not procfs.reset_rss_peak():
                raise OSError(f"cannot reset the RSS high-water mark through {procfs.CLEAR_REFS}")
            self._base_alloc = _status("VmRSS")
        else:
            self._counter = _StorageCounter(self.device.type)
            self._counter.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, int(torch.cuda.max_memory_allocated(self.device)) - self._base_alloc)
            self.peak_reserved_bytes = max(
                0, int(torch.cuda.max_memory_reserved(self.device)) - self._base_reserved
            )
            self.end_bytes = int(torch.cuda.memory_allocated(self.device)) - self._base_alloc
        elif self.method == "rss":
            self.peak_bytes = max(0, _status("VmHWM") - self._base_alloc)
            self.end_bytes = _status("VmRSS") - self._base_alloc
        else:
            counter = self._counter
            assert counter is not None
            counter.__exit__(exc_type, exc, tb)
            self.end_bytes = counter.close()
            self.peak_bytes = counter.peak
            self.allocations = counter.allocations
            self._counter = None
        self._done = True

    def result(self) -> PeakResult:
        if not self._done:
            raise RuntimeError("the tracked block has not finished yet")
        return PeakResult(
            device=str(self.device),
            method=self.method,
            peak_bytes=self.peak_bytes,
            end_bytes=self.end_bytes,
            peak_reserved_bytes=self.peak_reserved_bytes,
            allocations=self.allocations,
        )


def _status(field: str) -> int:
    value = procfs.status_bytes(field)
    if value is None:
        raise RuntimeError(f"{field} not in {procfs.STATUS}")
    return value


def tracker_factory(device: torch.device | str = "cpu", method: Method = "auto") -> Callable[[], PeakTracker]:
    """A zero-argument factory of fresh trackers (what :func:`calibrate` takes)."""
    dev = torch.device(device)

    def make() -> PeakTracker:
        return PeakTracker(dev, method)

    return make


def measure_peak(
    fn: Callable[[], Any], device: torch.device | str = "cpu", method: Method = "auto"
) -> PeakResult:
    """Run ``fn()`` under a fresh tracker and return its :class:`PeakResult` (the output is dropped)."""
    with PeakTracker(device, method) as tracker:
        fn()
    return tracker.result()


def decode_tracker(device: torch.device, measure_cpu_tensors: bool = False) -> tuple[str, PeakTracker | None]:
    """The peak measure a decode reports on ``device`` and its tracker: CUDA ``max_memory_allocated``;
    on CPU the live tensor bytes when asked (exact, but it hooks every op), else the process RSS
    high-water mark (cheap); ``None`` where nothing can be measured."""
    if device.type == "cuda":
        return "CUDA max_memory_allocated", PeakTracker(device, method="cuda")
    if device.type == "cpu":
        if measure_cpu_tensors:
            return "live tensor bytes (PeakTracker dispatch)", PeakTracker(device, method="dispatch")
        if rss_supported():
            return "process RSS high-water mark", PeakTracker(device, method="rss")
    return "not measured on this device", None
