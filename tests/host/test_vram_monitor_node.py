"""VRAM Monitor on the real in-process host (--cpu): numbers against the tracker, per-prompt timelines, plot."""

from __future__ import annotations

import ctypes
import gc
import pathlib
import sys
import uuid

import numpy as np
import pytest
import torch
from vramfit.memory.measure.procfs import process_rss, rss_peak_supported
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.report import Report

from scripts.host import clone_node

pytestmark = pytest.mark.host
MiB = 2**20


def monitor_cls(comfy):
    return comfy.NODE_CLASS_MAPPINGS["VRAMFit_VRAMMonitor"]


def timelines(comfy):
    """The registry of the module ComfyUI loaded (not the ``vramfit`` copy the tests import)."""
    return sys.modules[monitor_cls(comfy).__module__].TIMELINES


def call(cls, prompt_id: str, node_id: str, **inputs):
    """Run the node as ComfyUI does: a class clone with hidden inputs, inside the executing context."""
    from comfy_execution.utils import CurrentNodeContext

    clone = clone_node(cls, node_id)
    with CurrentNodeContext(prompt_id, node_id):
        return clone.execute(**inputs)


def _exact(row: str) -> int:
    return int(row.split("(", 1)[1].split(" B", 1)[0])


@pytest.mark.skipif(not rss_peak_supported(), reason="the CPU peak needs Linux /proc/self/clear_refs")
def test_numbers_match_the_tracker(comfy) -> None:
    cls = monitor_cls(comfy)
    prompt = uuid.uuid4().hex

    def sample(node: str, label: str) -> str:
        out = call(cls, prompt, node, value=None, label=label, plot_width=256, plot_height=128)
        text = out.result[1]
        del out  # the plot tensor must not stay alive into the next sample
        return text

    gc.collect()
    gc.disable()  # no cyclic collection of unrelated garbage between the samples
    try:
        sample("1", "start")
        kept, kept_t, tmp_t, rss_at_alloc, text2, text3 = _three_samples(sample)
    finally:
        gc.enable()
    _check(comfy, prompt, kept_t, tmp_t, rss_at_alloc, text2, text3)
    del kept


def _three_samples(sample):
    with PeakTracker("cpu") as kept_t:
        kept = torch.ones(32 * MiB // 4)  # 32 MiB that stay alive
    # free heap memory the C allocator keeps resident would be reused by the temporary without any RSS
    # rise: give it back to the OS before monitor 2 resets the high-water mark
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    text2 = sample("2", "kept")
    rss_at_alloc = process_rss()  # the resident set just before the temporary
    with PeakTracker("cpu") as tmp_t:
        tmp = torch.ones(256 * MiB // 4)  # 256 MiB, freed before the next monitor
        del tmp
    text3 = sample("3", "temporary")
    return kept, kept_t, tmp_t, rss_at_alloc, text2, text3


def _check(comfy, prompt, kept_t, tmp_t, rss_at_alloc, text2, text3) -> None:
    s1, s2, s3 = timelines(comfy).get(prompt).samples
    assert [s.label for s in (s1, s2, s3)] == ["start", "kept", "temporary"]
    assert [s.node_id for s in (s1, s2, s3)] == ["1", "2", "3"] and s3.prompt_id == prompt
    # allocated: live CPU tensor bytes, the tracker's count of what stayed alive
    assert s2.allocated - s1.allocated == kept_t.end_bytes == 32 * MiB
    assert s3.allocated - s2.allocated == tmp_t.end_bytes == 0
    # peak since the previous monitor: the process high-water mark, the tracker's peak on top of the RSS
    assert s3.peak_since == "kept" and tmp_t.peak_bytes == 256 * MiB
    rise = s3.peak - rss_at_alloc
    assert abs(rise - tmp_t.peak_bytes) <= 0.10 * tmp_t.peak_bytes, (rise, tmp_t.peak_bytes)
    # the report shows exactly these numbers
    rows2, rows3 = dict(Report.parse(text2).rows), dict(Report.parse(text3).rows)
    assert _exact(rows2["allocated"]) == s2.allocated
    assert _exact(rows3["peak"]) == s3.peak and "since kept" in rows3["peak"]
    assert _exact(rows3["rss"]) == s3.rss and rows3["reserved"].startswith("-")


def test_one_timeline_per_prompt_across_monitors(comfy) -> None:
    cls = monitor_cls(comfy)
    p1, p2 = uuid.uuid4().hex, uuid.uuid4().hex
    value = {"anything": [1, 2, 3]}
    out_a = call(cls, p1, "10", value=value, label="after sampling", plot_width=256, plot_height=128)
    assert out_a.result[0] is value  # pass-through
    call(cls, p2, "10", value=value, label="other prompt", plot_width=256, plot_height=128)
    out_b = call(cls, p1, "11", value=value, label="", plot_width=320, plot_height=160)

    assert [s.label for s in timelines(comfy).get(p1).samples] == ["after sampling", "node 11"]
    assert [s.label for s in timelines(comfy).get(p2).samples] == ["other prompt"]
    report = Report.parse(out_b.result[1])
    rows = dict(report.rows)
    assert report.node == "VRAM Monitor" and report.device == "cpu"
    assert rows["prompt"] == f"{p1} (2 samples)" and rows["sample"] == "#2 node 11 (node 11)"
    s = report.summary
    assert s.startswith("#2 node 11 · RSS peak ") and " · free " in s, s
    assert out_b.result[1].splitlines()[1] == report.summary
    table = rows["timeline"].splitlines()
    assert len(table) == 3 and "after sampling" in table[1] and "node 11" in table[2]
    assert rows["models"].split()[0].isdigit()

    # plot: a ComfyUI IMAGE of the requested size, also previewed as a PNG in ComfyUI's temp folder
    import folder_paths
    from PIL import Image

    plot = out_b.result[2]
    assert plot.shape == (1, 160, 320, 3) and plot.dtype == torch.float32
    assert 0.0 <= float(plot.min()) and float(plot.max()) <= 1.0 and float(plot.std()) > 0.01
    ui = out_b.ui
    assert ui["text"] == (out_b.result[1],)
    (saved,) = ui["images"]
    path = pathlib.Path(folder_paths.get_temp_directory()) / saved["subfolder"] / saved["filename"]
    with Image.open(path) as im:
        im.load()
        assert im.size == (320, 160) and im.mode == "RGB"
        png = torch.from_numpy(np.asarray(im).copy()).to(torch.float32) / 255
    assert torch.allclose(png, plot[0], atol=1 / 255 + 1e-6)


def test_schema_contract(comfy) -> None:
    cls = monitor_cls(comfy)
    schema = cls.GET_SCHEMA()
    assert schema.display_name == "VRAM Monitor (VRAM Fit)" and schema.description
    assert schema.is_output_node and schema.not_idempotent
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)
    assert [o.io_type for o in schema.outputs] == ["*", "STRING", "IMAGE"]
    a = cls.fingerprint_inputs(value=None)
    assert a != a  # NaN: a new sample on every prompt
