"""VRAM Monitor engine: memory samples of one device, per-prompt timelines, and their plot.

Imports nothing from ComfyUI (the node adapter passes in labels, prompt ids and ComfyUI's loaded
model bytes). What one :class:`MemorySample` holds, by device type:

========== ================================================ ==============================================
field      CUDA / XPU (``torch.cuda``-style allocator)      CPU
========== ================================================ ==============================================
allocated  ``memory_allocated``: bytes of live tensors      bytes of every live CPU tensor storage reachable
                                                            from Python (:func:`live_tensor_bytes`: a walk of
                                                            ``gc.get_objects()``, one count per storage)
reserved   ``memory_reserved`` (allocator cache included)   ``None``: CPU tensors use the system allocator,
                                                            which keeps no separate cache (see ``rss``)
peak       ``max_memory_allocated`` since the previous      process resident-set high-water mark (Linux
           sample, then ``reset_peak_memory_stats``         ``VmHWM``) since the previous sample, then reset
                                                            through ``/proc/self/clear_refs``
free/total ``mem_get_info`` (whole device, all processes)   ``psutil.virtual_memory()`` available / total
rss        process resident set (``psutil``)               same
========== ================================================ ==============================================

Dynamic VRAM (ComfyUI >= 0.33, comfy-aimdo; the adapter passes a :class:`DynamicVram`): weights of
dynamic models sit in aimdo "VBAR" pages that comfy-aimdo maps with the CUDA driver, *outside* torch's
allocator. ``allocated``/``reserved``/``peak`` therefore never include them, while ``free``
(``mem_get_info``) counts them as used; the sample's ``models_evictable`` (their pages: resident, and
evicted on demand when torch allocates), ``models_staged`` (their weights not resident: staged in RAM,
faulted in when a layer runs) and ``aimdo_resident`` (aimdo's own total of resident VBAR pages on the
device, every model included) say where those weights are. See ``docs/MEMORY.md``.

So "peak" is always *the highest value of the device's own usage measure between two samples* (the
allocator's bytes on a GPU, the process's resident bytes on the CPU); every sample resets the counter,
so consecutive samples partition time. The first sample of a process reports the peak since process
start (or since whoever reset the counter last, e.g. a ``PeakTracker`` of a decode: they share the
counter, see ``docs/NODES_UTILITY.md``).

Cost: on CUDA a handful of allocator queries; on CPU the ``gc`` walk (~0.2 s for the ~460k objects of
a ComfyUI process) plus two ``/proc`` reads.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..report import Report, byte_unit, fmt_bytes, measure_tag, summary_line
from .procfs import process_rss, read_rss_peak, reset_rss_peak

log = logging.getLogger("vramfit.memory.measure.monitor")


# ------------------------------------------------------------------------------------ tensor bytes


def _device_matches(dev: torch.device, want: torch.device | None) -> bool:
    if want is None:
        return True
    if dev.type != want.type:
        return False
    return want.index is None or dev.index == want.index


def tensors_storage_bytes(tensors: Iterable[Any], device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` on ``device`` (``None``: any device).

    One count per storage (views and tensors sharing memory count once); tensors without a real
    storage (``meta``, fake, sparse, nested, wrapper subclasses without data) count 0.
    """
    want = None if device is None else torch.device(device)
    seen: dict[tuple[str, int | None, int], int] = {}
    for t in tensors:
        if not issubclass(type(t), torch.Tensor):
            continue
        try:
            storage = t.untyped_storage()
            sdev = storage.device
            ptr = storage.data_ptr()
            nbytes = int(storage.nbytes())
        except (RuntimeError, NotImplementedError, TypeError, AttributeError):
            continue
        if sdev.type == "meta" or ptr == 0 or not _device_matches(sdev, want):
            continue
        key = (sdev.type, sdev.index, ptr)
        if nbytes > seen.get(key, -1):
            seen[key] = nbytes
    return sum(seen.values())


def module_weight_bytes(module: Any, device: torch.device | str | None = None) -> int:
    """Exact bytes of a module's parameters and buffers on ``device`` (storage-deduplicated)."""
    if module is None or not hasattr(module, "parameters"):
        return 0
    tensors = list(module.parameters())
    if hasattr(module, "buffers"):
        tensors += list(module.buffers())
    return tensors_storage_bytes(tensors, device)


def live_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of every live tensor storage on ``device`` that Python can reach (``gc`` walk).

    Tensors are container objects tracked by the garbage collector, so ``gc.get_objects()`` returns
    every tensor that has a Python object: model weights, cached outputs, intermediate results held
    by a node. Not seen: memory held only inside C++ (a kernel's scratch, autograd buffers without a
    Python handle) and allocator overhead; that is what RSS shows in addition.
    """
    return tensors_storage_bytes(gc.get_objects(), device)


# ------------------------------------------------------------------------------------ process memory


def system_memory() -> tuple[int | None, int | None]:
    """``(available, total)`` RAM in bytes (psutil), ``(None, None)`` without psutil."""
    try:
        import psutil
    except ImportError:
        return None, None
    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


# ------------------------------------------------------------------------------------ samples


@dataclasses.dataclass(frozen=True)
class DynamicVram:
    """Dynamic-VRAM state of one device at a sample (ComfyUI >= 0.33; built by the node adapter).

    ``state``: ``"on"``/``"off"`` (ComfyUI's ``aimdo_enabled``) or ``"absent"`` (a host without dynamic
    VRAM). ``models``: dynamic models ComfyUI has loaded on the device; ``evictable``: their resident
    aimdo pages; ``staged``: their weights not resident; ``host_resident``: aimdo's own count of
    resident VBAR pages on the device (``None`` where not exposed).
    """

    state: str
    models: int = 0
    evictable: int = 0
    staged: int = 0
    host_resident: int | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything dynamic to report (dynamic VRAM on, or dynamic models loaded)."""
        return self.state == "on" or self.models > 0


@dataclasses.dataclass(frozen=True)
class MemorySample:
    """One reading of a device (bytes; ``None`` = not measurable there). See the module docstring."""

    label: str
    device: str
    wall_time: float
    allocated: int | None
    reserved: int | None
    free: int | None
    total: int | None
    peak: int | None
    """Highest usage since the previous sample (CUDA: allocator bytes; CPU: process RSS)."""
    peak_since: str
    """Label of the sample that last reset the peak counter (or ``process start``)."""
    rss: int | None
    models_loaded: int | None = None
    """Weights ComfyUI has loaded on the device (bytes), when the caller passes them."""
    models_count: int | None = None
    node_id: str | None = None
    prompt_id: str | None = None
    sample_seconds: float = 0.0
    methods: tuple[tuple[str, str], ...] = ()
    """``(field, how it was measured)`` pairs, shown in the report."""
    dynamic_vram: str | None = None
    """``on``/``off``/``absent`` (see :class:`DynamicVram`); ``None`` when the caller did not say."""
    models_dynamic: int | None = None
    models_evictable: int | None = None
    """Resident aimdo pages of dynamic models (outside ``allocated``; evicted on demand)."""
    models_staged: int | None = None
    """Weights of dynamic models not resident (staged in RAM, faulted in when used)."""
    aimdo_resident: int | None = None
    """comfy-aimdo's own total of resident VBAR pages on the device."""

    def method(self, field: str) -> str:
        return dict(self.methods).get(field, "")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["methods"] = dict(self.methods)
        return d


class MemorySampler:
    """Samples a device; each sample resets that device's peak counter (so peaks partition time).

    ``backend`` replaces ``torch.cuda``/``torch.xpu`` (tests pass a fake with the same functions:
    ``synchronize, memory_allocated, memory_reserved, max_memory_allocated, reset_peak_memory_stats,
    mem_get_info``).
    """

    def __init__(self, backend: Any = None) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        self._last_reset: dict[str, str] = {}

    def _accel(self, device: torch.device) -> Any:
        if self._backend is not None:
            return self._backend
        mod = getattr(torch, device.type, None)
        if mod is not None and hasattr(mod, "memory_allocated") and hasattr(mod, "max_memory_allocated"):
            return mod
        return None

    def sample(
        self,
        device: torch.device | str,
        label: str,
        *,
        node_id: str | None = None,
        prompt_id: str | None = None,
        models_loaded: tuple[int, int] | None = None,
        dynamic: DynamicVram | None = None,
    ) -> MemorySample:
        """Read ``device`` now. ``models_loaded``: ``(count, bytes)`` of ComfyUI's loaded weights;
        ``dynamic``: the device's dynamic-VRAM state (fields ``models_evictable`` etc. are ``None``
        unless it is active)."""
        dev = torch.device(device)
        t0 = time.perf_counter()
        with self._lock:
            key = str(dev)
            since = self._last_reset.get(key, "process start")
            if dev.type == "cpu":
                fields = self._sample_cpu()
            elif dev.type == "mps":
                fields = self._sample_mps()
            else:
                fields = self._sample_accel(dev)
            self._last_reset[key] = label
        count, loaded = models_loaded if models_loaded is not None else (None, None)
        active = dynamic is not None and dynamic.active
        return MemorySample(
            label=label,
            device=str(dev),
            wall_time=time.time(),
            peak_since=since,
            models_loaded=loaded,
            models_count=count,
            node_id=node_id,
            prompt_id=prompt_id,
            sample_seconds=time.perf_counter() - t0,
            dynamic_vram=None if dynamic is None else dynamic.state,
            models_dynamic=dynamic.models if active else None,
            models_evictable=dynamic.evictable if active else None,
            models_staged=dynamic.staged if active else None,
            aimdo_resident=dynamic.host_resident if active else None,
            **fields,
        )

    def _sample_cpu(self) -> dict[str, Any]:
        peak = read_rss_peak()
        rss = process_rss()
        available, total = system_memory()
        allocated = live_tensor_bytes("cpu")
        if peak is not None:
            # reset last: the sampling's own memory (the gc walk's object list) is in no interval
            reset_rss_peak()
        methods = (
            ("allocated", "live CPU tensor storages reachable from Python (gc walk)"),
            ("reserved", "n/a on cpu: no caching allocator (see rss)"),
            ("peak", "process RSS high-water mark (VmHWM)" if peak is not None else "unavailable here"),
            ("free", "psutil available RAM"),
        )
        return dict(
            allocated=allocated, reserved=None, free=available, total=total, peak=peak, rss=rss,
            methods=methods,
        )  # fmt: skip

    def _sample_mps(self) -> dict[str, Any]:
        mps = getattr(torch, "mps", None)
        allocated = int(mps.current_allocated_memory()) if mps is not None else None
        reserved = int(mps.driver_allocated_memory()) if mps is not None else None
        available, total = system_memory()
        methods = (
            ("allocated", "torch.mps.current_allocated_memory"),
            ("reserved", "torch.mps.driver_allocated_memory"),
            ("peak", "unavailable on mps"),
            ("free", "psutil available RAM (unified memory)"),
        )
        return dict(
            allocated=allocated, reserved=reserved, free=available, total=total, peak=None,
            rss=process_rss(), methods=methods,
        )  # fmt: skip

    def _sample_accel(self, dev: torch.device) -> dict[str, Any]:
        acc = self._accel(dev)
        if acc is None:
            return dict(
                allocated=None, reserved=None, free=None, total=None, peak=None, rss=process_rss(),
                methods=(("allocated", f"unavailable on {dev.type}"),),
            )  # fmt: skip
        if hasattr(acc, "synchronize"):
            acc.synchronize(dev)
        allocated = int(acc.memory_allocated(dev))
        reserved = int(acc.memory_reserved(dev)) if hasattr(acc, "memory_reserved") else None
        peak = int(acc.max_memory_allocated(dev))
        free = total = None
        if hasattr(acc, "mem_get_info"):
            free, total = (int(x) for x in acc.mem_get_info(dev))
        if hasattr(acc, "reset_peak_memory_stats"):
            acc.reset_peak_memory_stats(dev)
        name = dev.type
        methods = (
            ("allocated", f"torch.{name}.memory_allocated"),
            ("reserved", f"torch.{name}.memory_reserved"),
            ("peak", f"torch.{name}.max_memory_allocated, reset at each sample"),
            ("free", f"torch.{name}.mem_get_info (whole device)"),
        )
        return dict(
            allocated=allocated, reserved=reserved, free=free, total=total, peak=peak, rss=process_rss(),
            methods=methods,
        )  # fmt: skip


# ------------------------------------------------------------------------------------ timelines


@dataclasses.dataclass
class Timeline:
    """The samples of one prompt, in the order the monitors ran."""

    key: str
    samples: list[MemorySample] = dataclasses.field(default_factory=list)
    created: float = dataclasses.field(default_factory=time.time)

    def add(self, sample: MemorySample) -> None:
        self.samples.append(sample)

    def table(self) -> str:
        """A fixed-width table of every sample (one line each, header first); an ``evictable`` column
        (aimdo pages of dynamic models) is added when a sample has one."""
        t0 = self.samples[0].wall_time if self.samples else 0.0
        dyn = any(s.models_evictable is not None for s in self.samples)
        head = f"{'#':>2}  {'label':<18} {'t':>8} {'allocated':>11} {'reserved':>11} {'peak':>11} {'rss':>11}"
        lines = [head + (f" {'evictable':>11}" if dyn else "")]
        for i, s in enumerate(self.samples, 1):
            lines.append(
                f"{i:>2}  {_clip(s.label, 18):<18} {'+' + format(s.wall_time - t0, '.2f') + ' s':>8} "
                f"{fmt_bytes(s.allocated):>11} {fmt_bytes(s.reserved):>11} {fmt_bytes(s.peak):>11} "
                f"{fmt_bytes(s.rss):>11}" + (f" {fmt_bytes(s.models_evictable):>11}" if dyn else "")
            )
        return "\n".join(lines)

    def report(self, node: str = "VRAM Monitor") -> Report:
        """The shared report format: the latest sample in detail, then the whole timeline."""
        if not self.samples:
            return Report(node, summary="no samples").add("timeline", "no samples")
        s = self.samples[-1]
        r = Report(node, s.device)
        r.add("prompt", f"{self.key} ({len(self.samples)} sample{'s' if len(self.samples) != 1 else ''})")
        where = f" (node {s.node_id})" if s.node_id else ""
        r.add("sample", f"#{len(self.samples)} {s.label}{where}")
        outside = "; aimdo pages not included (see dynamic)" if s.models_evictable else ""
        r.add("allocated", _fmt_exact(s.allocated, s.method("allocated") + outside))
        r.add("reserved", _fmt_exact(s.reserved, s.method("reserved")))
        r.add("peak", _fmt_exact(s.peak, f"since {s.peak_since}; {s.method('peak')}{outside}"))
        if s.free is not None and s.total is not None:
            free = f"{fmt_bytes(s.free)} of {fmt_bytes(s.total)} ({s.free} of {s.total} B; {s.method('free')})"
            if s.models_evictable:
                usable = s.free + s.models_evictable
                free += (
                    f" + {fmt_bytes(s.models_evictable)} evictable dynamic-VRAM weights = {fmt_bytes(usable)} "
                    f"({usable} B) usable by torch allocations"
                )
            r.add("free", free)
        else:
            r.add("free", "-")
        r.add("rss", _fmt_exact(s.rss, "process resident set"))
        if s.models_count is not None:
            r.add(
                "models",
                f"{s.models_count} loaded by ComfyUI on {s.device}, {_fmt_exact(s.models_loaded, 'weights')}",
            )
        if s.dynamic_vram is not None:
            r.add("dynamic", _dynamic_row(s))
        r.add("timeline", self.table())
        r.add("cost", f"{s.sample_seconds * 1000:.0f} ms to sample")
        r.summary = _summary(s, len(self.samples))
        return r


def _summary(s: MemorySample, n: int) -> str:
    """The verdict: ``#2 after decode · RSS peak 1.21 GiB · allocated 120.0 MiB · free 10.2 GiB of
    15.6 GiB``."""
    tag = measure_tag(s.method("peak"))
    return summary_line(
        f"#{n} {_clip(s.label, 24)}",
        f"{tag + ' ' if tag else ''}peak {fmt_bytes(s.peak)}" if s.peak is not None else "peak unmeasured",
        f"allocated {fmt_bytes(s.allocated)}" if s.allocated is not None else "",
        "" if s.free is None or s.total is None else f"free {fmt_bytes(s.free)} of {fmt_bytes(s.total)}",
    )


def _dynamic_row(s: MemorySample) -> str:
    """The report's ``dynamic`` row: what is resident vs staged/evictable (see :class:`DynamicVram`)."""
    if s.models_evictable is None:
        if s.dynamic_vram == "absent":
            return "not on this host (no dynamic VRAM: every loaded weight is a torch tensor on its device)"
        return (
            f"off on {s.device} (comfy-aimdo not enabled, e.g. --cpu, --highvram, --novram, --gpu-only, "
            "--disable-dynamic-vram): every loaded weight is a torch tensor on its device"
        )
    head = {"on": "on (comfy-aimdo)", "absent": "not on this host"}.get(s.dynamic_vram or "", s.dynamic_vram)
    if s.dynamic_vram != "on":
        head = f"{head} (dynamic models loaded)"
    text = (
        f"{head}: {s.models_dynamic} dynamic model{'s' if s.models_dynamic != 1 else ''} on {s.device}; "
        f"resident in aimdo pages {_fmt_exact(s.models_evictable, 'evictable on demand, outside torch allocator')}; "
        f"staged {_fmt_exact(s.models_staged, 'not resident: in RAM, faulted in when used')}"
    )
    if s.aimdo_resident is not None:
        text += f"; aimdo reports {_fmt_exact(s.aimdo_resident, 'resident VBAR pages, all models')}"
    return text


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "~"


def _fmt_exact(n: int | None, how: str = "") -> str:
    if n is None:
        return "-" + (f" ({how})" if how else "")
    return f"{fmt_bytes(n)} ({n} B" + (f"; {how})" if how else ")")


class TimelineRegistry:
    """Per-prompt timelines kept in memory, at most ``max_timelines`` (oldest dropped first)."""

    def __init__(self, max_timelines: int = 32, max_samples: int = 512) -> None:
        if max_timelines < 1 or max_samples < 1:
            raise ValueError("max_timelines and max_samples must be >= 1")
        self.max_timelines = max_timelines
        self.max_samples = max_samples
        self._lock = threading.Lock()
        self._timelines: collections.OrderedDict[str, Timeline] = collections.OrderedDict()

    def add(self, key: str, sample: MemorySample) -> Timeline:
        """Append ``sample`` to the timeline of ``key``; returns a snapshot of that timeline."""
        with self._lock:
            tl = self._timelines.get(key)
            if tl is None:
                tl = Timeline(key)
                self._timelines[key] = tl
                while len(self._timelines) > self.max_timelines:
                    self._timelines.popitem(last=False)
            else:
                self._timelines.move_to_end(key)
            tl.add(sample)
            if len(tl.samples) > self.max_samples:
                del tl.samples[: len(tl.samples) - self.max_samples]
            return Timeline(tl.key, list(tl.samples), tl.created)

    def get(self, key: str) -> Timeline | None:
        with self._lock:
            tl = self._timelines.get(key)
            return None if tl is None else Timeline(tl.key, list(tl.samples), tl.created)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._timelines)

    def __len__(self) -> int:
        with self._lock:
            return len(self._timelines)


# ------------------------------------------------------------------------------------ plot

SERIES: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("allocated", (31, 119, 180)),
    ("reserved", (255, 127, 14)),
    ("peak", (214, 39, 40)),
    ("rss", (44, 160, 44)),
)
"""Plotted fields and their colours (RGB)."""

OPTIONAL_SERIES: tuple[tuple[str, tuple[int, int, int]], ...] = (("models_evictable", (148, 103, 189)),)
"""Plotted when a sample has them: resident aimdo pages of dynamic models (purple)."""

_LEGEND = {"models_evictable": "evictable"}

BACKGROUND = (255, 255, 255)
AXIS = (60, 60, 60)
GRID = (225, 225, 225)


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(1, ticks)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def render_timeline(samples: Sequence[MemorySample], width: int = 768, height: int = 384) -> torch.Tensor:
    """Draw ``samples`` (one timeline) into a ComfyUI ``IMAGE``: float32 ``[1, height, width, 3]`` in [0, 1].

    x: samples in order (labelled underneath); y: bytes. ``allocated``, ``reserved`` and ``rss`` are
    points joined by lines; ``peak`` covers the interval *before* its sample (it is the highest value
    since the previous one), so it is drawn as a horizontal bar over that interval. Uses Pillow (a
    ComfyUI requirement) and no other dependency.
    """
    from PIL import Image, ImageDraw, ImageFont

    width, height = int(width), int(height)
    if width < 64 or height < 64:
        raise ValueError(f"plot size {width}x{height} is too small (min 64x64)")
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    left, right, top, bottom = 78, 16, 34, 46
    x0, x1, y0, y1 = left, width - right, top, height - bottom
    if x1 - x0 < 16 or y1 - y0 < 16:
        x0, x1, y0, y1 = 4, width - 4, 4, height - 4

    series = SERIES + OPTIONAL_SERIES
    values = [getattr(s, f) for s in samples for f, _ in series if getattr(s, f) is not None]
    vmax = max(values) if values else 1
    unit, div = byte_unit(vmax)
    step = _nice_step(max(vmax * 1.05, 1.0) / div) * div  # round ticks in the displayed unit
    top_value = max(step, math.ceil(vmax * 1.05 / step) * step)

    def ypix(v: float) -> float:
        return y1 - (y1 - y0) * (v / top_value)

    n = len(samples)

    def xpix(i: float) -> float:
        return x0 + (x1 - x0) * ((i + 0.5) / max(1, n))

    # grid and y labels
    k = 0
    while k * step <= top_value + 1e-9:
        y = ypix(k * step)
        draw.line([(x0, y), (x1, y)], fill=GRID)
        draw.text((4, y - 6), f"{k * step / div:.4g} {unit}", fill=AXIS, font=font)
        k += 1
    draw.line([(x0, y0), (x0, y1), (x1, y1)], fill=AXIS)

    # series
    for field, colour in series:
        pts = [(i, getattr(s, field)) for i, s in enumerate(samples) if getattr(s, field) is not None]
        if not pts:
            continue
        if field == "peak":
            for i, v in pts:
                xa = xpix(i - 1) if i > 0 else x0
                y = ypix(v)
                draw.line([(xa, y), (xpix(i), y)], fill=colour, width=3)
            continue
        xy = [(xpix(i), ypix(v)) for i, v in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy:
            draw.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)

    # x labels
    for i, s in enumerate(samples):
        x = xpix(i)
        draw.line([(x, y1), (x, y1 + 4)], fill=AXIS)
        draw.text(
            (x - 3 * min(len(s.label), 14), y1 + 8), _clip(s.label or f"#{i + 1}", 14), fill=AXIS, font=font
        )

    # legend and title
    lx = x0 + 4
    for field, colour in series:
        if not any(getattr(s, field) is not None for s in samples):
            continue
        name = _LEGEND.get(field, field)
        draw.rectangle([lx, 10, lx + 10, 20], fill=colour)
        draw.text((lx + 14, 8), name, fill=AXIS, font=font)
        lx += 24 + 7 * len(name)
    if samples:
        draw.text((max(lx + 8, x1 - 150), 8), _clip(samples[-1].device, 24), fill=AXIS, font=font)
    else:
        draw.text((x0 + 8, (y0 + y1) // 2), "no samples", fill=AXIS, font=font)

    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).reshape(height, width, 3)
    return (data.to(torch.float32) / 255.0).unsqueeze(0)
