"""memory/measure/monitor.py: tensor byte counts, samples (CPU for real, CUDA through a fake allocator), timelines, plot."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from vramfit.memory.measure.monitor import (
    SERIES,
    MemorySample,
    MemorySampler,
    Timeline,
    TimelineRegistry,
    live_tensor_bytes,
    module_weight_bytes,
    render_timeline,
    tensors_storage_bytes,
)
from vramfit.memory.measure.procfs import process_rss, rss_peak_supported
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.report import Report

MiB = 2**20


def test_storage_bytes_count_each_storage_once() -> None:
    a = torch.empty(1000)  # 4000 B
    b = torch.empty(10, dtype=torch.float64)  # 80 B
    views = [a, a[10:], a.view(10, 100), a[::2]]
    assert tensors_storage_bytes(views) == 4000
    assert tensors_storage_bytes([a, b, b[1:]]) == 4080
    assert tensors_storage_bytes([torch.empty(100, device="meta"), "not a tensor", 3]) == 0
    assert tensors_storage_bytes([a], device="meta") == 0
    lin = torch.nn.Linear(100, 10)  # 1000 + 10 floats
    lin.register_buffer("stat", torch.zeros(5, dtype=torch.float16))
    assert module_weight_bytes(lin) == (1000 + 10) * 4 + 5 * 2
    assert module_weight_bytes(lin, "cpu") == module_weight_bytes(lin)
    assert module_weight_bytes(None) == 0


def test_live_tensor_bytes_sees_a_known_allocation_exactly() -> None:
    gc.collect()
    before = live_tensor_bytes("cpu")
    with PeakTracker("cpu") as t:
        kept = torch.ones(3 * MiB // 4)  # 3 MiB
        alias = kept[5:]  # same storage: not counted twice
    after = live_tensor_bytes("cpu")
    assert t.end_bytes == 3 * MiB
    assert after - before == t.end_bytes
    del kept, alias
    gc.collect()
    assert live_tensor_bytes("cpu") == before


@pytest.mark.skipif(not rss_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_cpu_samples_match_the_tracker() -> None:
    sampler = MemorySampler()
    gc.collect()
    gc.disable()  # no cyclic collection of unrelated garbage between the samples
    try:
        _cpu_samples(sampler)
    finally:
        gc.enable()


def _cpu_samples(sampler: MemorySampler) -> None:
    a = sampler.sample("cpu", "A")
    assert a.peak_since == "process start"  # first sample of this sampler
    assert a.reserved is None and a.total is not None and a.free is not None and 0 < a.free <= a.total
    assert a.rss is not None and a.rss > 0 and a.peak is not None and a.peak >= a.rss - 64 * MiB

    with PeakTracker("cpu") as t_keep:
        kept = torch.ones(16 * MiB // 4)  # 16 MiB alive at the next sample
    # free heap memory the C allocator keeps resident would be reused by the temporary below without
    # any RSS rise: give it back to the OS before sample B resets the high-water mark
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    b = sampler.sample("cpu", "B")
    assert b.peak_since == "A"
    assert b.allocated - a.allocated == t_keep.end_bytes == 16 * MiB

    rss_at_alloc = process_rss()
    with PeakTracker("cpu") as t_tmp:
        tmp = torch.ones(256 * MiB // 4)  # 256 MiB, touched, then freed before the next sample
        del tmp
    c = sampler.sample("cpu", "C")
    assert c.peak_since == "B"
    assert t_tmp.peak_bytes == 256 * MiB
    rise = c.peak - rss_at_alloc  # the high-water mark since sample B, above the RSS before the temporary
    assert abs(rise - t_tmp.peak_bytes) <= 0.10 * t_tmp.peak_bytes, (rise, t_tmp.peak_bytes)
    assert c.allocated - b.allocated == 0  # the temporary is gone
    del kept


class FakeCuda:
    """The slice of ``torch.cuda`` the sampler uses, with a scripted allocator."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak = 0
        self.resets = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated + 2 * MiB)
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def synchronize(self, device=None) -> None:
        pass

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.allocated

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 8192 * MiB - self.reserved, 8192 * MiB


def test_accelerator_samples_reset_the_peak_at_each_monitor() -> None:
    cuda = FakeCuda()
    sampler = MemorySampler(backend=cuda)
    cuda.alloc(100 * MiB)
    s1 = sampler.sample("cuda:0", "after sampling", models_loaded=(2, 90 * MiB))
    assert (s1.allocated, s1.peak, s1.peak_since) == (100 * MiB, 100 * MiB, "process start")
    assert s1.reserved == 102 * MiB and s1.free == 8192 * MiB - 102 * MiB and s1.total == 8192 * MiB
    assert (s1.models_count, s1.models_loaded) == (2, 90 * MiB)
    assert cuda.resets == 1
    cuda.alloc(500 * MiB)  # a decode's activations
    cuda.free(500 * MiB)
    cuda.alloc(30 * MiB)  # its output
    s2 = sampler.sample("cuda:0", "after decode")
    assert s2.peak == 600 * MiB and s2.peak_since == "after sampling"
    assert s2.allocated == 130 * MiB
    s3 = sampler.sample("cuda:0", "idle")
    assert s3.peak == 130 * MiB and s3.peak_since == "after decode"
    assert "max_memory_allocated" in s3.method("peak")
    assert sampler.sample("cuda:1", "other card").peak_since == "process start"  # per device


def _sample(label: str, allocated: int | None, peak: int | None, rss: int | None, t: float) -> MemorySample:
    return MemorySample(
        label=label, device="cuda:0", wall_time=t, allocated=allocated, reserved=None if allocated is None else allocated + MiB,
        free=1000 * MiB, total=2000 * MiB, peak=peak, peak_since="x", rss=rss,
    )  # fmt: skip


def test_registry_is_bounded_and_returns_snapshots() -> None:
    reg = TimelineRegistry(max_timelines=2, max_samples=3)
    tl = reg.add("p1", _sample("a", 1, 2, 3, 0.0))
    reg.add("p1", _sample("b", 1, 2, 3, 1.0))
    assert [s.label for s in tl.samples] == ["a"]  # snapshot, not a live view
    reg.add("p2", _sample("c", 1, 2, 3, 0.0))
    reg.add("p1", _sample("d", 1, 2, 3, 2.0))  # p1 becomes the most recent
    reg.add("p3", _sample("e", 1, 2, 3, 0.0))  # evicts p2, the least recent
    assert reg.keys() == ["p1", "p3"] and len(reg) == 2
    for label in "fg":
        reg.add("p1", _sample(label, 1, 2, 3, 3.0))
    assert [s.label for s in reg.get("p1").samples] == ["d", "f", "g"]
    assert reg.get("p2") is None
    with pytest.raises(ValueError):
        TimelineRegistry(max_timelines=0)


def test_timeline_report_uses_the_shared_format() -> None:
    tl = Timeline("prompt-1")
    tl.add(_sample("before decode", 100 * MiB, 120 * MiB, 900 * MiB, 10.0))
    tl.add(_sample("after decode", 150 * MiB, 700 * MiB, 950 * MiB, 12.5))
    r = tl.report()
    back = Report.parse(r.text())
    assert back.node == "VRAM Monitor" and back.device == "cuda:0"
    rows = dict(back.rows)
    assert rows["prompt"] == "prompt-1 (2 samples)"
    assert f"({150 * MiB} B" in rows["allocated"] and f"({700 * MiB} B" in rows["peak"]
    table = rows["timeline"].splitlines()
    assert len(table) == 3 and "before decode" in table[1] and "+2.50 s" in table[2]
    assert Report.parse(Timeline("empty").report().text()).rows == [("timeline", "no samples")]


def test_plot_is_a_comfy_image_with_every_series_drawn() -> None:
    samples = [
        _sample("start", 100 * MiB, 100 * MiB, 600 * MiB, 0.0),
        _sample("decode", 300 * MiB, 900 * MiB, 800 * MiB, 1.0),
        _sample("end", 120 * MiB, 320 * MiB, 700 * MiB, 2.0),
    ]
    img = render_timeline(samples, 320, 200)
    assert img.shape == (1, 200, 320, 3) and img.dtype == torch.float32
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    pixels = {tuple(int(round(c * 255)) for c in px) for px in img[0].reshape(-1, 3).tolist()}
    for field, colour in SERIES:
        assert colour in pixels, f"{field} not drawn"
    # a sample without CPU 'reserved' still plots; too small a canvas is refused
    cpu_like = [dataclass_replace(s, reserved=None) for s in samples]
    no_reserved = render_timeline(cpu_like, 320, 200)
    pixels = {tuple(int(round(c * 255)) for c in px) for px in no_reserved[0].reshape(-1, 3).tolist()}
    assert dict(SERIES)["reserved"] not in pixels
    assert render_timeline([], 128, 128).shape == (1, 128, 128, 3)
    with pytest.raises(ValueError):
        render_timeline(samples, 32, 200)


def dataclass_replace(sample: MemorySample, **changes) -> MemorySample:
    import dataclasses

    return dataclasses.replace(sample, **changes)
