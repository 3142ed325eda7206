"""Example workflows: build them from one description, and validate them against a real host.

    python -m scripts.workflows build  [--url URL]   # write workflows/*.json, *.jpg, api/*.json, README.md
    python -m scripts.workflows check  [--url URL]   # exit 1 when a committed file differs from the build
    python -m scripts.workflows validate [--url URL] # validate the committed workflows against /object_info

Without ``--url`` a headless ComfyUI (the host of ``scripts/setup_host.sh``) is started for the run.

One source of truth: ``scripts/workflow_graphs.py`` describes each graph (node types, widget values by
input name, links); this module turns a description into

* the UI-format workflow (ComfyUI frontend JSON, version 0.4) served as a template from
  ``workflows/<template>.json`` (the template browser shows a custom-node template under its file name),
* its API-format twin ``workflows/api/<name>.json`` (what ``POST /prompt`` and ``scripts/run_workflow.py`` take),
* a thumbnail ``workflows/<template>.jpg`` (the frontend requests ``<template>.jpg`` for custom-node templates),
* ``workflows/README.md`` (every workflow, the files it expects and the folder each goes in),

using the node schemas of the live ``/object_info`` plus the third-party node packs declared in
``scripts/workflow_declarations.json`` (read from their source; each with its repository and commit).

The layout leaves free the room below each node that it grows by after a run (image previews, VRAM Fit
report boxes), and ``extra.ds`` opens on the whole graph below the toolbars of a 1280x720 canvas
(:func:`layout_problems`, part of ``check``).

The node schemas and the UI -> API conversion are :mod:`scripts.workflow_schema`; the validator
(``validate``, and ``check`` for the committed files) is :mod:`scripts.workflow_validate`. One set of files
serves every supported host (ComfyUI 0.3.75 and 0.33): the builder writes only what both accept and the
validator reads both schemas.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import re
import shutil
import sys
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from scripts.workflow_desc import NodeDesc, Out, WorkflowDesc
from scripts.workflow_graphs import all_workflows
from scripts.workflow_schema import (
    DYNAMIC_COMBO,
    PACK_PREFIX,
    InputSpec,
    NodeSchema,
    Schemas,
    effective_type,
    ui_output_count,
    ui_to_api,
)
from scripts.workflow_validate import validate_workflow

log = logging.getLogger("vramfit.workflows")

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS_DIR = ROOT / "workflows"
API_DIR = WORKFLOWS_DIR / "api"

THUMB_SIZE = (640, 400)

SHIPPED_INPUTS = ("example.png",)
"""Files in ComfyUI's own ``input/`` folder (its repository; ComfyUI 0.3.75 and 0.33): on every fresh install,
so a CPU template may load them (every other file a CPU template needs is a fixture model)."""

TEMPLATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 .,()+-]*[A-Za-z0-9)]")
"""A template (UI) file name, which the template browser shows as the card's title: ASCII letters, digits,
spaces and ``.,()+-`` only (no ``:``, ``?`` or ``#``: not valid in Windows file names, and the frontend puts
the name into the template's URL unescaped)."""

# Layout (canvas units). Measured in Chromium with frontends 1.32.9 (ComfyUI 0.3.75) and 1.49.6 (0.33.0).
TITLE_HEIGHT = 30
"""``LiteGraph.NODE_TITLE_HEIGHT``: a node's title bar is drawn above its ``pos``."""
NODE_GAP = 40
"""Between a node (with the room below it) and the title bar of the next node in its column."""
COLUMN_GAP = 60
NOTE_POS, NOTE_SIZE = (40, 60), (440, 620)
REPORT_ROOM = 360
"""What a VRAM Fit node grows by after a run: the pack's web extension (web/js/vramfit.js) adds the report
box, at most 22 rows of 15 px, and grows the node to fit it (measured: +231 to +308 px)."""
IMAGE_ROOM = {"SaveImage": 300, "PreviewImage": 300, "SaveVideo": 340, "VRAMFit_VRAMMonitor": REPORT_ROOM + 240}
"""What a node that shows images grows by below its widgets once it has them (after a run): the image
preview, scaled to the node's width (measured: SaveImage of a 320x256 image +192 px, SaveVideo of 64x64
frames +288 px, VRAM Monitor with its 512x256 plot under the report box +514 px)."""
LOADED_IMAGE_ROOM = {"LoadImage": 340}
"""Nodes that show their image as soon as the workflow opens (LoadImage's preview): written into their size."""
VIEW_CANVAS = (1280, 720)
VIEW_SAFE = (70, 140, 1270, 710)
"""Left, top, right, bottom of the part of a 1280x720 canvas no toolbar covers: the side bar (left), the top
menu, workflow tabs and the floating Run toolbar (top; frontend 1.32.9)."""


# ------------------------------------------------------------------------------------ building


def _default(spec: InputSpec) -> Any:
    if "default" in spec.opts:
        return spec.opts["default"]
    if spec.type in ("COMBO", DYNAMIC_COMBO):
        return spec.options[0] if spec.options else ""
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[spec.type]


def _toposort(nodes: dict[int, set[int]]) -> list[int]:
    """Kahn's algorithm, ties by id; ``nodes`` maps id -> ids it depends on."""
    deps = {k: set(v) for k, v in nodes.items()}
    order: list[int] = []
    ready = sorted(k for k, v in deps.items() if not v)
    while ready:
        n = ready.pop(0)
        order.append(n)
        for k, v in deps.items():
            if n in v:
                v.discard(n)
                if not v and k not in order and k not in ready:
                    ready.append(k)
        ready.sort()
    if len(order) != len(deps):
        raise ValueError("the graph has a cycle")
    return order


def _node_size(schema: NodeSchema, desc: NodeDesc, widgets: list[InputSpec], outputs: int) -> list[int]:
    """Size of a node with these widgets (as written) and ``outputs`` listed outputs (LoadImage: with its
    image preview, shown as soon as the workflow opens)."""
    linked_widgets = sum(1 for w in schema.widgets if isinstance(desc.values.get(w.name), Out))
    sockets = len(schema.sockets) + linked_widgets
    multiline = any(w.type == "STRING" and w.opts.get("multiline") for w in widgets)
    title = desc.title or schema.display_name
    width = max(400 if multiline else 320, math.ceil((len(title) * 7.7 + 40) / 10) * 10)  # a long title widens it
    return [width, node_height(sockets, outputs, len(widgets), multiline) + LOADED_IMAGE_ROOM.get(desc.type, 0)]


def node_height(sockets: int, outputs: int, widgets: int, multiline: bool = False) -> int:
    """Height the classic canvas needs for a node's title, socket rows and widget rows."""
    return 30 + 22 * max(sockets, outputs, 1) + 26 * widgets + (110 if multiline else 0)


def preview_room(node_type: str) -> int:
    """Height a node grows by below its size after a run: image previews, VRAM Fit report boxes."""
    if node_type in IMAGE_ROOM:
        return IMAGE_ROOM[node_type]
    return REPORT_ROOM if node_type.startswith(PACK_PREFIX) else 0


def _columns(order: list[int], deps: dict[int, set[int]]) -> dict[int, int]:
    """Column of each node: one after its latest input; a node without inputs (loader, empty latent) sits
    right before its first consumer, so that it does not pile up in the first column."""
    depth: dict[int, int] = {}
    for nid in order:
        depth[nid] = 1 + max((depth[d] for d in deps[nid]), default=-1)
    for nid in order:
        consumers = [depth[k] for k, v in deps.items() if nid in v]
        if not deps[nid] and consumers:
            depth[nid] = min(consumers) - 1
    return depth


def _layout(nodes: list[NodeDesc], depth: dict[int, int], sizes: dict[int, list[int]]) -> dict[int, list[int]]:
    """Node positions: the note's column, then one column per dependency depth; the nodes of a column are
    stacked (those with inputs first, so that the main chain runs along the top; then by id) with the room
    each grows by after a run (:func:`preview_room`) left free below it."""
    col_x: dict[int, int] = {}
    x = NOTE_POS[0] + NOTE_SIZE[0] + COLUMN_GAP
    for d in sorted(set(depth.values())):
        col_x[d] = x
        x += max(sizes[i][0] for i in depth if depth[i] == d) + COLUMN_GAP
    col_y: dict[int, int] = {}
    pos = {}
    for n in sorted(nodes, key=lambda n: (not any(isinstance(v, Out) for v in n.values.values()), n.id)):
        d = depth[n.id]
        y = col_y.get(d, NOTE_POS[1])
        pos[n.id] = [col_x[d], y]
        col_y[d] = y + sizes[n.id][1] + preview_room(n.type) + NODE_GAP + TITLE_HEIGHT
    return pos


Rect = tuple[float, float, float, float]
"""x0, y0, x1, y1 in canvas units."""


def node_rect(node: dict, grown: bool = False) -> Rect:
    """A UI node's rectangle, title bar included; ``grown``: with the room it takes after a run."""
    (x, y), (w, h) = node["pos"], node["size"]
    return (x, y - TITLE_HEIGHT, x + w, y + h + (preview_room(node["type"]) if grown else 0))


def graph_bounds(nodes: list[dict], groups: list[dict]) -> Rect:
    """The rectangle around the nodes (as the workflow opens) and the groups."""
    rects = [node_rect(n) for n in nodes] + [
        (g["bounding"][0], g["bounding"][1], g["bounding"][0] + g["bounding"][2], g["bounding"][1] + g["bounding"][3])
        for g in groups
    ]  # fmt: skip
    return (min(r[0] for r in rects), min(r[1] for r in rects), max(r[2] for r in rects), max(r[3] for r in rects))


def view_for(bounds: Rect) -> dict:
    """``extra.ds`` (LiteGraph's view: screen = (canvas + offset) * scale) showing ``bounds`` in the
    :data:`VIEW_SAFE` part of a :data:`VIEW_CANVAS` canvas: as large as fits (at most 1:1), centred across,
    from the top of that part down (nodes grow downwards after a run)."""
    left, top, right, bottom = VIEW_SAFE
    x0, y0, x1, y1 = bounds
    scale = math.floor(min((right - left) / (x1 - x0), (bottom - top) / (y1 - y0), 1.0) * 1000) / 1000
    offset_x = (left + (right - left - (x1 - x0) * scale) / 2) / scale - x0
    offset_y = top / scale - y0
    return {"scale": scale, "offset": [round(offset_x, 1), round(offset_y, 1)]}


def _overlap(a: Rect, b: Rect) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def layout_problems(name: str, ui: dict) -> list[str]:
    """Why a UI workflow's layout is wrong: two nodes overlap, each with the room it grows by after a run
    (image previews, report boxes: :func:`preview_room`), or a node or group lies outside the view that
    ``extra.ds`` opens on (:data:`VIEW_SAFE`)."""
    problems = []
    nodes = sorted(ui.get("nodes", []), key=lambda n: n["id"])
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            if _overlap(node_rect(a, grown=True), node_rect(b, grown=True)):
                problems.append(f"{name}: node {a['id']} ({a['type']}) and node {b['id']} ({b['type']}) overlap "
                                "(with the room below each for previews and reports)")  # fmt: skip
    ds = (ui.get("extra") or {}).get("ds")
    if not ds:
        return problems + [f"{name}: no extra.ds (the view the workflow opens on)"]
    scale, (ox, oy) = ds["scale"], ds["offset"]
    left, top, right, bottom = VIEW_SAFE
    items = [(f"node {n['id']} ({n['type']})", node_rect(n)) for n in nodes]
    items += [(f"group {g.get('title')!r}", graph_bounds([], [g])) for g in ui.get("groups", [])]
    for what, (x0, y0, x1, y1) in items:
        sx0, sy0, sx1, sy1 = ((x0 + ox) * scale, (y0 + oy) * scale, (x1 + ox) * scale, (y1 + oy) * scale)
        if sx0 < left - 1 or sy0 < top - 1 or sx1 > right + 1 or sy1 > bottom + 1:
            problems.append(f"{name}: {what} is at ({sx0:.0f}, {sy0:.0f})-({sx1:.0f}, {sy1:.0f}) on a "
                            f"{VIEW_CANVAS[0]}x{VIEW_CANVAS[1]} canvas, outside the part no toolbar covers {VIEW_SAFE}")  # fmt: skip
    return problems


def _widgets_values(schema: NodeSchema, desc: NodeDesc, schemas: Schemas) -> tuple[list, list[InputSpec]]:
    """``widgets_values`` of a described node, and the widgets they belong to.

    A value is looked up by the widget's name, then by its prompt key (``format.codec`` -> ``codec``,
    :meth:`NodeSchema.api_name`); widgets not given take their default. Trailing optional widgets the
    description leaves unset are not written: the frontend keeps a widget's default when
    ``widgets_values`` ends early and the prompt then leaves the optional input out, so one template
    serves a host without the widget (0.3.75's ``CreateVideo``) and one with it (0.33 added ``bit_depth``).
    """

    def given(spec: InputSpec) -> Any:
        value = desc.values.get(spec.name)
        return desc.values.get(schema.api_name(spec.name)) if value is None else value

    def value_of(spec: InputSpec) -> Any:
        value = given(spec)
        return _default(spec) if value is None or isinstance(value, Out) else value

    slots = schemas.widget_layout(schema, lambda spec, _: value_of(spec))
    while slots and not slots[-1].spec.required and given(slots[-1].spec) is None:
        slots.pop()
    values: list[Any] = []
    for slot in slots:
        values.append(value_of(slot.spec))
        if slot.control:
            values.append(desc.control)
    return values, [slot.spec for slot in slots]


def _note_markdown(desc: WorkflowDesc, schemas: Schemas) -> str:
    lines = [f"## {desc.title}", "", desc.summary, ""]
    if desc.packs:
        lines += ["**Custom nodes required** (besides VRAM Fit):", ""]
        for pack in desc.packs:
            info = schemas.packs[pack]
            lines.append(f"- {pack}: {info['url']}")
        lines.append("")
    if desc.files:
        lines += ["**Files it expects** (name → folder):", ""]
        for f in desc.files:
            where = "ComfyUI/input/" if f.directory == "input" else f"ComfyUI/models/{f.directory}/"
            extra = f" ({f.url})" if f.url else ""
            how = f" {f.how}" if f.how else ""
            lines.append(f"- `{f.name}` → `{where}`{extra}{how}")
        lines.append("")
    if desc.notes:
        lines += [desc.notes, ""]
    lines.append(
        "VRAM Fit reports (plan, offload, memory timeline) show on the nodes and in `/history`; "
        "headless: `python -m scripts.run_workflow workflows/api/" + desc.name + ".json --url URL`."
    )
    return "\n".join(lines)


def build_ui(desc: WorkflowDesc, schemas: Schemas) -> dict:
    """The UI-format (frontend) workflow of a description."""
    by_id = {n.id: n for n in desc.nodes}
    node_schemas = {}
    for n in desc.nodes:
        schema = schemas.get(n.type)
        if schema is None:
            raise KeyError(f"{desc.name}: node type {n.type!r} is neither on the host nor declared")
        node_schemas[n.id] = schema
        for key, value in n.values.items():
            if schema.input(key) is None:
                raise KeyError(f"{desc.name}: node {n.id} ({n.type}) has no input {key!r}")
            if isinstance(value, Out) and value.node not in by_id:
                raise KeyError(f"{desc.name}: node {n.id} input {key!r} links to missing node {value.node}")
    deps = {n.id: {v.node for v in n.values.values() if isinstance(v, Out)} for n in desc.nodes}
    order = _toposort(deps)
    depth = _columns(order, deps)

    node_types = {n.id: n.type for n in desc.nodes}
    links_in = {(n.id, k): (v.node, v.slot) for n in desc.nodes for k, v in n.values.items() if isinstance(v, Out)}
    linked_slots: dict[int, set[int]] = {}
    for source in links_in.values():
        linked_slots.setdefault(source[0], set()).add(source[1])
    widgets = {n.id: _widgets_values(node_schemas[n.id], n, schemas) for n in desc.nodes}
    n_outputs = {n.id: ui_output_count(node_schemas[n.id], linked_slots.get(n.id, ())) for n in desc.nodes}
    sizes = {n.id: _node_size(node_schemas[n.id], n, widgets[n.id][1], n_outputs[n.id]) for n in desc.nodes}
    pos = _layout(desc.nodes, depth, sizes)

    links: list[list] = []
    ui_nodes = []
    out_links: dict[tuple[int, int], list[int]] = {}
    pending_inputs: dict[int, list[dict]] = {}
    for n in desc.nodes:
        schema = node_schemas[n.id]
        inputs = []
        for spec in schema.inputs:
            value = n.values.get(spec.name)
            if spec.hidden or (spec.widget and not isinstance(value, Out)):
                continue
            entry: dict[str, Any] = {"name": spec.name, "type": spec.type, "link": None}
            if spec.widget:
                entry["widget"] = {"name": spec.name}
            if isinstance(value, Out):
                link_id = len(links) + 1
                src_type = effective_type(schemas, node_types, links_in, value.node, value.slot)
                link_type = spec.type if spec.type != "*" else src_type
                links.append([link_id, value.node, value.slot, n.id, len(inputs), link_type])
                entry["link"] = link_id
                out_links.setdefault((value.node, value.slot), []).append(link_id)
            elif spec.required:
                raise ValueError(f"{desc.name}: node {n.id} ({n.type}) required input {spec.name!r} is not linked")
            inputs.append(entry)
        pending_inputs[n.id] = inputs

    for n in desc.nodes:
        schema = node_schemas[n.id]
        widgets_values = widgets[n.id][0]
        outputs = []
        for slot, (otype, oname) in enumerate(zip(schema.outputs, schema.output_names, strict=True)):
            if slot < n_outputs[n.id]:
                outputs.append({"name": oname, "type": otype, "links": out_links.get((n.id, slot), []), "slot_index": slot})
        node: dict[str, Any] = {
            "id": n.id, "type": n.type, "pos": pos[n.id], "size": sizes[n.id], "flags": {},
            "order": order.index(n.id), "mode": 0, "inputs": pending_inputs[n.id], "outputs": outputs,
            "properties": {"Node name for S&R": n.type}, "widgets_values": widgets_values,
        }  # fmt: skip
        if n.title:
            node["title"] = n.title
        if n.type.startswith(PACK_PREFIX):
            node["color"], node["bgcolor"] = "#233", "#355"
        elif schema.pack:
            node["color"], node["bgcolor"] = "#432", "#653"
        ui_nodes.append(node)

    note_id = len(desc.nodes) + 1
    ui_nodes.append({
        "id": note_id, "type": "MarkdownNote", "pos": list(NOTE_POS), "size": list(NOTE_SIZE), "flags": {},
        "order": len(desc.nodes), "mode": 0, "inputs": [], "outputs": [], "title": "Read me: models and folders",
        "properties": {}, "widgets_values": [_note_markdown(desc, schemas)], "color": "#432", "bgcolor": "#653",
    })  # fmt: skip

    groups = []
    pack_ids = [n.id for n in desc.nodes if n.type.startswith(PACK_PREFIX)]
    if pack_ids:
        x0 = min(pos[i][0] for i in pack_ids) - 20
        y0 = min(pos[i][1] for i in pack_ids) - 60
        x1 = max(pos[i][0] + sizes[i][0] for i in pack_ids) + 20
        y1 = max(pos[i][1] + sizes[i][1] for i in pack_ids) + 20
        groups.append({
            "id": 1, "title": "VRAM Fit", "bounding": [x0, y0, x1 - x0, y1 - y0], "color": "#3f789e",
            "font_size": 24, "flags": {},
        })  # fmt: skip

    files = [dataclasses.asdict(f) for f in desc.files]
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, "vramfit/workflows/" + desc.name)),
        "revision": 0,
        "last_node_id": note_id,
        "last_link_id": len(links),
        "nodes": ui_nodes,
        "links": links,
        "groups": groups,
        "config": {},
        "extra": {
            "ds": view_for(graph_bounds(ui_nodes, groups)),
            "vramfit": {
                "name": desc.name, "template": desc.template_name, "title": desc.title, "summary": desc.summary,
                "cpu": desc.cpu,
                "custom_node_packs": [{"name": p, "url": schemas.packs[p]["url"]} for p in desc.packs],
                "files": files,
            },
        },  # fmt: skip
        "models": [{"name": f.name, "url": f.url, "directory": f.directory} for f in desc.files if f.url],
        "version": 0.4,
    }


def build(desc: WorkflowDesc, schemas: Schemas) -> tuple[dict, dict]:
    ui = build_ui(desc, schemas)
    return ui, ui_to_api(ui, schemas)


# ---------------------------------------------------------------------------------- thumbnails


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: bitmap font only
        return ImageFont.load_default()


def render_thumbnail(ui: dict, path: pathlib.Path) -> None:
    """A diagram of the graph (nodes as boxes with titles, links as lines), deterministic, small JPEG."""
    from PIL import Image, ImageDraw

    width, height = THUMB_SIZE
    img = Image.new("RGB", (width, height), (32, 34, 38))
    draw = ImageDraw.Draw(img)
    meta = (ui.get("extra") or {}).get("vramfit") or {}
    draw.rectangle([0, 0, width, 62], fill=(24, 60, 78))
    title = meta.get("title", "").replace("×", "x").replace("→", "->")  # glyphs the default font lacks
    size = next((z for z in range(21, 13, -1) if draw.textlength(title, font=_font(z)) <= width - 32), 14)
    draw.text((16, 9 + (21 - size) // 2), title, fill=(240, 240, 240), font=_font(size))
    tag = "CPU variant · random-weight fixtures" if meta.get("cpu") else "VRAM Fit example workflow"
    packs = ", ".join(p["name"] for p in meta.get("custom_node_packs", []))
    draw.text((16, 38), tag + (f" · needs {packs}" if packs else ""), fill=(170, 205, 220), font=_font(12))

    nodes = [n for n in ui.get("nodes", []) if n["type"] != "MarkdownNote" and n["type"] != "Note"]
    if not nodes:
        img.save(path, "JPEG", quality=82, optimize=True)
        return
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] for n in nodes)
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    area = (16, 76, width - 16, height - 14)
    scale = min((area[2] - area[0]) / (x1 - x0), (area[3] - area[1]) / (y1 - y0))
    ox = area[0] + ((area[2] - area[0]) - (x1 - x0) * scale) / 2
    oy = area[1] + ((area[3] - area[1]) - (y1 - y0) * scale) / 2

    def box(n: dict) -> tuple[float, float, float, float]:
        return (ox + (n["pos"][0] - x0) * scale, oy + (n["pos"][1] - y0) * scale,
                ox + (n["pos"][0] + n["size"][0] - x0) * scale, oy + (n["pos"][1] + n["size"][1] - y0) * scale)  # fmt: skip

    by_id = {n["id"]: n for n in nodes}
    for link in ui.get("links", []):
        if link[1] in by_id and link[3] in by_id:
            a, b = box(by_id[link[1]]), box(by_id[link[3]])
            start = (a[2], a[1] + 10 + 8 * link[2])
            end = (b[0], b[1] + 10 + 8 * link[4])
            mid = (start[0] + end[0]) / 2
            draw.line([start, (mid, start[1]), (mid, end[1]), end], fill=(120, 150, 170), width=2)
    font = _font(max(9, min(13, int(15 * scale / 0.45))))
    for n in nodes:
        b = box(n)
        vram = n["type"].startswith(PACK_PREFIX)
        third = n.get("color") == "#432"
        fill = (36, 84, 90) if vram else (96, 72, 40) if third else (58, 60, 66)
        head = (60, 150, 160) if vram else (170, 120, 60) if third else (90, 94, 104)
        draw.rounded_rectangle(b, radius=5, fill=fill, outline=(20, 20, 22))
        draw.rectangle([b[0] + 1, b[1] + 1, b[2] - 1, min(b[3] - 1, b[1] + 16)], fill=head)
        title = n.get("title") or n["type"].replace(PACK_PREFIX, "")
        limit = max(4, int((b[2] - b[0]) / 6.5))
        draw.text((b[0] + 4, b[1] + 2), title if len(title) <= limit else title[: limit - 1] + "…",
                  fill=(250, 250, 250), font=font)  # fmt: skip
    img.save(path, "JPEG", quality=82, optimize=True)


def thumbnail_difference(a: pathlib.Path, b: pathlib.Path) -> float:
    """Mean absolute pixel difference of two images (0..255); inf when sizes differ."""
    from PIL import Image, ImageChops, ImageStat

    ia, ib = Image.open(a).convert("RGB"), Image.open(b).convert("RGB")
    if ia.size != ib.size:
        return math.inf
    return sum(ImageStat.Stat(ImageChops.difference(ia, ib)).mean) / 3


# ---------------------------------------------------------------------------------- README


def workflows_readme(descs: Iterable[WorkflowDesc], schemas: Schemas) -> str:
    lines = [
        "# VRAM Fit example workflows",
        "",
        "Generated by `python -m scripts.workflows build` from `scripts/workflow_graphs.py`; do not edit the",
        "JSON by hand (`python -m scripts.workflows check` and `tests/server/test_workflows.py` fail on drift).",
        "",
        "- `workflows/<template>.json`: UI format, shown by ComfyUI as templates (Workflow → Browse Templates →",
        "  ComfyUI-VRAM-Fit); `workflows/<template>.jpg` is its thumbnail (the frontend loads `<template>.jpg`",
        "  for custom-node templates).",
        "- `workflows/api/<name>.json`: the same graph in API format, for `POST /prompt` or",
        "  `python -m scripts.run_workflow workflows/api/<name>.json --url http://127.0.0.1:8188`.",
        "",
        "The template browser (frontends 1.32 and 1.49) shows a custom-node template under its file name: it",
        "reads no title, description or order for custom-node templates. So the UI files are named as the cards",
        "should read, numbered in the order to try them: the browser's *Alphabetical (A-Z)* sort follows the",
        "numbers; its default sort keeps the server's listing, which is the folder's directory order.",
        "",
        "Each template opens with the whole graph in view: `extra.ds` fits it into a 1280×720 canvas below the",
        "top bar and the Run toolbar (frontend 1.32 applies it; 1.49 fits the view to the graph itself when it",
        "opens a template), with room left below the nodes that show images or VRAM Fit reports after a run.",
        "The CPU templates need no file that only a script writes into ComfyUI's input folder: besides the",
        "random-weight fixture VAEs (`python -m scripts.fixtures` writes them), only ComfyUI's own",
        "`input/example.png`, which every install has.",
        "",
        "Thumbnails are diagrams of the graph (VRAM Fit nodes teal, third-party nodes orange), drawn with",
        "Pillow from the UI JSON: deterministic, ~20–40 KB, and true for the GPU workflows too, whose real",
        "outputs need models this repository cannot ship.",
        "",
        "Every workflow is validated against a real ComfyUI's `/object_info` (node types, link types, widget",
        "ranges; third-party node types from `scripts/workflow_declarations.json`, read from the packs'",
        "source), and the CPU variants run end to end headless in the tests.",
        "",
    ]
    for d in descs:
        lines += [f"## `{d.name}`: {d.title}", "", d.summary, ""]
        lines += [f"Template **{d.template_name}** (`workflows/{d.template_name}.json`); API format: "
                  f"`workflows/api/{d.name}.json`.", ""]  # fmt: skip
        if d.packs:
            lines.append(
                "Custom nodes: " + ", ".join(f"[{p}]({schemas.packs[p]['url']})" for p in d.packs) + "."
            )
            lines.append("")
        lines += ["| file | folder | source |", "|---|---|---|"]
        for f in d.files:
            where = "`ComfyUI/input/`" if f.directory == "input" else f"`ComfyUI/models/{f.directory}/`"
            src = f"[download]({f.url})" if f.url else (f.how or "")
            lines.append(f"| `{f.name}` | {where} | {src} |")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- files


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def api_dumps(api: dict) -> str:
    """One node per line (readable diffs, like the hand-written demo)."""
    rows = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in api.items()]
    return "{\n" + ",\n".join(rows) + "\n}\n"


def expected_files(schemas: Schemas, out_dir: pathlib.Path = WORKFLOWS_DIR) -> dict[pathlib.Path, str]:
    """Text files the build writes (thumbnails are written separately)."""
    files: dict[pathlib.Path, str] = {}
    descs = all_workflows()
    for desc in descs:
        if not TEMPLATE_NAME.fullmatch(desc.template_name):
            raise ValueError(f"{desc.name}: template name {desc.template_name!r} is not {TEMPLATE_NAME.pattern}")
        ui, api = build(desc, schemas)
        files[out_dir / f"{desc.template_name}.json"] = dumps(ui)
        files[out_dir / "api" / f"{desc.name}.json"] = api_dumps(api)
    files[out_dir / "README.md"] = workflows_readme(descs, schemas)
    return files


def write_all(schemas: Schemas, out_dir: pathlib.Path = WORKFLOWS_DIR) -> list[pathlib.Path]:
    written = []
    for path, text in expected_files(schemas, out_dir).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
        if path.parent == out_dir and path.suffix == ".json":
            thumb = path.with_suffix(".jpg")
            render_thumbnail(json.loads(text), thumb)
            written.append(thumb)
    return written


def check_all(schemas: Schemas, out_dir: pathlib.Path = WORKFLOWS_DIR, tolerance: float = 2.0) -> list[str]:
    """Differences between the committed files and a fresh build."""
    import tempfile

    problems = []
    expected = expected_files(schemas, out_dir)
    for path, text in expected.items():
        if not path.is_file():
            problems.append(f"missing: {path.relative_to(ROOT)}")
        elif path.read_text() != text:
            problems.append(f"differs from the build: {path.relative_to(ROOT)}")
    with tempfile.TemporaryDirectory() as tmp:
        for path, text in expected.items():
            if path.parent != out_dir or path.suffix != ".json":
                continue
            thumb = path.with_suffix(".jpg")
            fresh = pathlib.Path(tmp) / thumb.name
            render_thumbnail(json.loads(text), fresh)
            if not thumb.is_file():
                problems.append(f"missing: {thumb.relative_to(ROOT)}")
            elif (diff := thumbnail_difference(thumb, fresh)) > tolerance:
                problems.append(f"thumbnail differs from the build (mean diff {diff:.1f}): {thumb.relative_to(ROOT)}")
            problems += layout_problems(path.stem, json.loads(text))
    built = set(expected) | {p.with_suffix(".jpg") for p in expected if p.parent == out_dir and p.suffix == ".json"}
    for path in sorted(out_dir.glob("*.json")) + sorted(out_dir.glob("*.jpg")) + sorted((out_dir / "api").glob("*.json")):
        if path not in built:
            problems.append(f"not built by scripts/workflow_graphs.py: {path.relative_to(ROOT)}")
    return problems


def committed_workflows(out_dir: pathlib.Path = WORKFLOWS_DIR) -> Iterator[tuple[str, dict, dict | None]]:
    """``(name, UI workflow, API twin or None)`` of each template in ``out_dir``; the twin is
    ``api/<extra.vramfit.name>.json``."""
    for path in sorted(out_dir.glob("*.json")):
        ui = json.loads(path.read_text())
        name = ((ui.get("extra") or {}).get("vramfit") or {}).get("name") or path.stem
        api_path = out_dir / "api" / f"{name}.json"
        yield name, ui, json.loads(api_path.read_text()) if api_path.is_file() else None


def copy_shipped_inputs(comfyui_path: pathlib.Path, input_dir: pathlib.Path) -> list[pathlib.Path]:
    """Copy :data:`SHIPPED_INPUTS` from a ComfyUI tree's ``input/`` into ``input_dir``, so that a server
    started with its own ``--input-directory`` lists what a fresh install lists."""
    input_dir.mkdir(parents=True, exist_ok=True)
    return [pathlib.Path(shutil.copy2(comfyui_path / "input" / name, input_dir / name)) for name in SHIPPED_INPUTS]


# ---------------------------------------------------------------------------------- CLI


@contextlib.contextmanager
def _object_info(url: str | None) -> Iterator[dict]:
    from scripts.host import ComfyClient, ComfyServer, HostConfig

    if url:
        yield ComfyClient(url, timeout=120).object_info()
        return
    cfg = HostConfig.load()
    server = ComfyServer(cfg)
    copy_shipped_inputs(cfg.comfyui_path, server.input_dir)  # what a fresh install's input folder lists
    with server:
        yield server.client(timeout=120).object_info()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "check", "validate"])
    parser.add_argument("--url", default=None, help="a running ComfyUI (default: start a headless one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    with _object_info(args.url) as info:
        schemas = Schemas(info)
        if args.command == "build":
            for path in write_all(schemas):
                log.info("wrote %s", path.relative_to(ROOT))
            return 0
        if args.command == "check":
            problems = check_all(schemas)
        else:
            problems = []
            for name, ui, api in committed_workflows():
                problems += validate_workflow(name, ui, api, schemas)
    for p in problems:
        log.error("%s", p)
    if not problems:
        log.info("%s: all workflows OK", args.command)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
