"""VRAM Monitor (VRAM Fit): a pass-through that samples memory and plots the prompt's timeline.

Every monitor of a prompt adds one sample (allocated, reserved, free, total, peak since the previous
monitor, process RSS, ComfyUI's loaded weights) to that prompt's timeline; each outputs the report of
the timeline so far (the shared VRAM Fit report format, also sent to the UI and ``/history``) and a
plot of it as an ``IMAGE``. Measurement semantics: ``memory/measure/monitor.py`` and ``docs/NODES_UTILITY.md``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from comfy_api.v0_0_2 import io, ui

from ..memory.measure.monitor import DynamicVram, MemorySampler, TimelineRegistry, render_timeline
from ._comfy import (
    CATEGORY,
    aimdo_vbar_bytes,
    decode_device,
    dynamic_vram_state,
    executing_context,
    loaded_residency,
    loaded_weights,
)

log = logging.getLogger("vramfit.vram_monitor")

NODE = "VRAM Monitor"
SAMPLER = MemorySampler()
TIMELINES = TimelineRegistry(max_timelines=32, max_samples=512)
"""Per-prompt timelines of this process (the 32 most recent prompts)."""


def timeline_key(prompt_id: str | None) -> str:
    return prompt_id or "no prompt"


def dynamic_snapshot(device: torch.device) -> DynamicVram:
    """Dynamic-VRAM state of ``device``: ComfyUI's loaded models (aimdo pages, staged weights) and
    comfy-aimdo's own VBAR total where the host exposes it (docs/MEMORY.md, "Dynamic VRAM")."""
    res = loaded_residency(device)
    return DynamicVram(
        state=dynamic_vram_state(),
        models=res.dynamic_count,
        evictable=res.evictable,
        staged=res.staged,
        host_resident=aimdo_vbar_bytes(device),
    )


class VRAMMonitor(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VRAMFit_VRAMMonitor",
            display_name="VRAM Monitor (VRAM Fit)",
            category=CATEGORY,
            description=(
                "Pass-through that samples memory on the decode device (allocated, reserved, free, total, peak "
                "since the previous monitor) and the process RSS, keeps a timeline per prompt across every "
                "monitor of the graph, and outputs a text report and a plot of that timeline. Works on CPU "
                "(RAM) and CUDA."
            ),
            inputs=[
                io.AnyType.Input(
                    "value",
                    tooltip=(
                        "Anything; it comes out unchanged. Wire it where you want a sample, e.g. sampler "
                        "output -> monitor -> decode -> monitor -> save."
                    ),
                ),
                io.String.Input(
                    "label",
                    default="",
                    tooltip="Name of this sample in the timeline and the plot (empty: 'node <id>').",
                ),
                io.Int.Input(
                    "plot_width",
                    default=768,
                    min=128,
                    max=4096,
                    step=8,
                    tooltip="Width of the plot image (px).",
                ),
                io.Int.Input(
                    "plot_height",
                    default=384,
                    min=128,
                    max=4096,
                    step=8,
                    tooltip="Height of the plot image (px).",
                ),
            ],
            outputs=[
                io.AnyType.Output("value_out", display_name="value", tooltip="The input value, unchanged."),
                io.String.Output(
                    "report", display_name="report", tooltip="This prompt's timeline so far as text (the VRAM Fit report format)."
                ),
                io.Image.Output(
                    "plot", display_name="plot", tooltip="Plot of this prompt's timeline so far (allocated, reserved, peak, RSS)."
                ),
            ],
            hidden=[io.Hidden.unique_id],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> float:
        return float("nan")  # a new sample on every prompt

    @classmethod
    def execute(
        cls, value: Any = None, label: str = "", plot_width: int = 768, plot_height: int = 384
    ) -> io.NodeOutput:
        hidden = getattr(cls, "hidden", None)
        prompt_id, ctx_node = executing_context()
        node_id = ctx_node or getattr(hidden, "unique_id", None)
        device = decode_device()
        name = (label or "").strip() or (f"node {node_id}" if node_id else "monitor")
        sample = SAMPLER.sample(
            device, name, node_id=node_id, prompt_id=prompt_id, models_loaded=loaded_weights(device),
            dynamic=dynamic_snapshot(device),
        )  # fmt: skip
        timeline = TIMELINES.add(timeline_key(prompt_id), sample)
        text = timeline.report(NODE).text()
        plot = render_timeline(timeline.samples, plot_width, plot_height)
        log.info("%s", text)
        preview = ui.PreviewImage(plot, cls=cls)
        ui_out = {**ui.PreviewText(text).as_dict(), **preview.as_dict()}
        return io.NodeOutput(value, text, plot, ui=ui_out)
