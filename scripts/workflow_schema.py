"""Node schemas of a host (its ``/object_info``) and of the declared third-party packs
(``scripts/workflow_declarations.json``), and what a UI workflow means under them: the frontend's widget
order (dynamic combos included), output types through pass-through outputs, and the UI -> API conversion
(:func:`ui_to_api`, the frontend's widget mapping).

One set of schemas serves every supported host (ComfyUI 0.3.75 and 0.33). What 0.33 changed: dynamic combos
(``COMFY_DYNAMICCOMBO_V3``: the selected option's inputs follow the combo's widget as ``<combo>.<id>``,
e.g. ``SaveVideo.format`` then ``format.codec``), hidden inputs kept for old prompts (``SaveVideo.codec``:
the API twin writes nested values under such a top-level key, :meth:`NodeSchema.api_name`), new
optional widgets (``CreateVideo.bit_depth``: trailing optional widgets left at their default are not
written, :func:`value_counts`) and outputs on output nodes (``SaveImage``, ``SaveVideo``: listed only up
to the last linked one, :func:`ui_output_count`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

DECLARATIONS_PATH = pathlib.Path(__file__).resolve().with_name("workflow_declarations.json")

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
"""A combo whose selected option adds inputs (ComfyUI 0.33+, e.g. ``SaveVideo.format``)."""
PACK_PREFIX = "VRAMFit_"


def load_declarations(path: pathlib.Path = DECLARATIONS_PATH) -> dict:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------ schemas


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One input of a node as the frontend sees it."""

    name: str
    """The input's id; inputs added by a dynamic combo option are named ``<combo>.<id>`` (as in the
    frontend's widgets and the API prompt)."""
    type: str
    """INT/FLOAT/STRING/BOOLEAN/COMBO/COMFY_DYNAMICCOMBO_V3 for widgets, else the socket type (``*`` = anything)."""
    opts: dict
    required: bool
    options: tuple | None = None
    """COMBO options (a dynamic combo's option keys)."""
    children: tuple[tuple[str, tuple[InputSpec, ...]], ...] = ()
    """Dynamic combo: ``(option key, inputs that option adds)`` for each option."""

    @property
    def widget(self) -> bool:
        return (self.type in WIDGET_TYPES or self.type == DYNAMIC_COMBO) and not self.opts.get("forceInput")

    @property
    def hidden(self) -> bool:
        """Declared for old prompts only (0.33's ``SaveVideo.codec``): no socket or widget in the UI."""
        return bool(self.opts.get("hidden"))

    def option_inputs(self, value: Any) -> tuple[InputSpec, ...]:
        """The inputs a dynamic combo adds when ``value`` is selected (none for other inputs)."""
        return next((specs for key, specs in self.children if key == value), ())


@dataclasses.dataclass(frozen=True)
class NodeSchema:
    type: str
    display_name: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[str, ...]
    output_names: tuple[str, ...]
    pack: str | None = None
    """Declared third-party pack, None for the host's own node types."""
    output_node: bool = False

    def input(self, name: str) -> InputSpec | None:
        """The input ``name``, nested inputs of dynamic combos included (``format.codec``)."""
        return next((i for i in _all_inputs(self.inputs) if i.name == name), None)

    @property
    def sockets(self) -> list[InputSpec]:
        return [i for i in self.inputs if not i.widget and not i.hidden]

    @property
    def widgets(self) -> list[InputSpec]:
        """Top-level widgets in order (a dynamic combo's option inputs follow it: :func:`widget_layout`)."""
        return [i for i in self.inputs if i.widget and not i.hidden]

    @property
    def host_output_node(self) -> bool:
        """An output node of the host (SaveImage, SaveVideo): its outputs differ between hosts (0.33 added
        pass-through outputs), so a template may list only the ones it links (:func:`ui_output_count`)."""
        return self.output_node and self.pack is None and not self.type.startswith(PACK_PREFIX)

    def api_name(self, name: str) -> str:
        """The prompt key for input ``name`` that every supported host accepts.

        An input nested in a dynamic combo whose own id is also a top-level input of the node is written
        under that top-level id: 0.33's ``SaveVideo`` keeps a hidden top-level ``codec`` for prompts
        written before ``format`` became a dynamic combo, and 0.3.75 only knows ``codec``; so
        ``format.codec`` -> ``codec`` (and ``format.codec.encoding`` -> ``codec.encoding``).
        """
        parts = name.split(".")
        top = {i.name for i in self.inputs}
        return next((".".join(parts[k:]) for k in range(1, len(parts)) if parts[k] in top), name)


def _all_inputs(specs: Iterable[InputSpec]) -> Iterator[InputSpec]:
    for spec in specs:
        yield spec
        for _, nested in spec.children:
            yield from _all_inputs(nested)


def _parse_inputs(sections: dict, order: dict | None, prefix: str = "") -> list[InputSpec]:
    inputs = []
    for section in ("required", "optional"):
        specs = sections.get(section) or {}
        for name in (order or {}).get(section) or list(specs):
            inputs.append(_parse_input(prefix + name, specs[name], section == "required"))
    return inputs


def _parse_input(name: str, spec: Any, required: bool) -> InputSpec:
    kind = spec[0] if isinstance(spec, (list, tuple)) and spec else spec
    opts = spec[1] if isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], dict) else {}
    if isinstance(kind, (list, tuple)):
        return InputSpec(name, "COMBO", opts, required, tuple(kind))
    if kind == "COMBO":
        options = opts.get("options")
        if options is None and isinstance(spec, (list, tuple)) and len(spec) > 1 and isinstance(spec[1], list):
            options, opts = spec[1], {}
        return InputSpec(name, "COMBO", opts, required, tuple(options or ()))
    if kind == DYNAMIC_COMBO:
        # {"options": [{"key": ..., "inputs": {"required": {...}, "optional": {...}}}]}; the frontend shows
        # the option keys as a combo and adds the selected option's inputs after it as "<name>.<id>"
        children = tuple(
            (o["key"], tuple(_parse_inputs(o.get("inputs") or {}, None, prefix=name + "."))) for o in opts["options"]
        )
        rest = {k: v for k, v in opts.items() if k != "options"}
        return InputSpec(name, DYNAMIC_COMBO, rest, required, tuple(k for k, _ in children), children)
    return InputSpec(name, str(kind), opts, required)


def parse_schema(node_type: str, info: dict, pack: str | None = None) -> NodeSchema:
    inputs = _parse_inputs(info.get("input") or {}, info.get("input_order"))
    outputs = tuple(str(o) if not isinstance(o, list) else "COMBO" for o in info.get("output") or ())
    names = tuple(info.get("output_name") or outputs)
    return NodeSchema(
        type=node_type, display_name=info.get("display_name") or node_type, inputs=tuple(inputs),
        outputs=outputs, output_names=names, pack=pack, output_node=bool(info.get("output_node")),
    )  # fmt: skip


class Schemas:
    """Node schemas: the host's ``/object_info`` first, then the declared third-party packs."""

    def __init__(self, object_info: dict, declarations: dict | None = None):
        self.object_info = object_info
        self.decl = declarations or load_declarations()
        self.frontend_only = dict(self.decl["frontend"]["node_types"])
        self.seed_names = set(self.decl["frontend"]["seed_widget_names"])
        self.control_values = set(self.decl["frontend"]["control_values"])
        self.file_inputs = {k: v for k, v in self.decl["file_inputs"].items() if k != "about"}
        self.passthrough = {
            k: {int(s): n for s, n in v.items()} for k, v in self.decl["passthrough_outputs"].items() if k != "about"
        }
        self.packs = self.decl["packs"]
        self._cache: dict[str, NodeSchema | None] = {}

    def pack_of(self, node_type: str) -> str | None:
        return next((p for p, d in self.packs.items() if node_type in d["nodes"]), None)

    def get(self, node_type: str) -> NodeSchema | None:
        if node_type in self._cache:
            return self._cache[node_type]
        schema = None
        if node_type in self.object_info:
            schema = parse_schema(node_type, self.object_info[node_type])
        elif (pack := self.pack_of(node_type)) is not None:
            info = dict(self.packs[pack]["nodes"][node_type])
            base = info.get("inherits_inputs_from")
            if base:
                base_info = self.object_info[base]
                info["input"], info["input_order"] = base_info["input"], base_info.get("input_order")
            schema = parse_schema(node_type, info, pack=pack)
        self._cache[node_type] = schema
        return schema

    def has_control(self, spec: InputSpec) -> bool:
        """The frontend adds a control_after_generate widget value after this widget."""
        return spec.type == "INT" and (bool(spec.opts.get("control_after_generate")) or spec.name in self.seed_names)

    def file_input(self, node_type: str, name: str) -> dict | None:
        return self.file_inputs.get(f"{node_type}.{name}")

    def widget_layout(self, schema: NodeSchema, value_at: Callable[[InputSpec, int], Any]) -> list[WidgetSlot]:
        """The node's widgets in the frontend's order, each with the position of its value.

        A dynamic combo is followed by the inputs of its selected option (``value_at(spec, index)``: the
        value it holds), recursively: the frontend inserts them after the combo's widget.
        """
        slots: list[WidgetSlot] = []

        def walk(specs: Iterable[InputSpec]) -> None:
            for spec in specs:
                if not spec.widget or spec.hidden:
                    continue
                slot = WidgetSlot(spec, slots[-1].end if slots else 0, self.has_control(spec))
                slots.append(slot)
                if spec.type == DYNAMIC_COMBO:
                    walk(spec.option_inputs(value_at(spec, slot.index)))

        walk(schema.widgets)
        return slots

    def ui_widget_layout(self, schema: NodeSchema, values: list) -> list[WidgetSlot]:
        """:meth:`widget_layout` of a UI node with these ``widgets_values``."""
        return self.widget_layout(schema, lambda _, i: values[i] if i < len(values) else None)


@dataclasses.dataclass(frozen=True)
class WidgetSlot:
    """One widget of a node and where its value sits in ``widgets_values``."""

    spec: InputSpec
    index: int
    control: bool
    """A control_after_generate value follows at ``index + 1``."""

    @property
    def end(self) -> int:
        return self.index + (2 if self.control else 1)


def value_counts(slots: list[WidgetSlot]) -> list[int]:
    """Lengths of ``widgets_values`` the frontend loads: all values, or without a trailing run of optional
    widgets (their widgets keep their defaults), ascending."""
    counts = [slots[-1].end if slots else 0]
    for slot in reversed(slots):
        if slot.spec.required:
            break
        counts.append(slot.index)
    return sorted(counts)


SHARED_OUTPUTS = {"GetVideoComponents": 3}
"""Nodes whose later hosts added outputs (0.33: ``bit_depth``, ``color_space``): templates list the outputs
every host has."""


def ui_output_count(schema: NodeSchema, linked_slots: Iterable[int]) -> int:
    """How many outputs a template lists: all of them, except that a host output node lists them only up to
    its last linked one (0.33 gave ``SaveImage``/``SaveVideo`` pass-through outputs 0.3.75 lacks; the
    frontend takes a node's outputs from the workflow, and 0.33's own templates list ``SaveImage`` both
    with and without them), and a node of :data:`SHARED_OUTPUTS` lists those every host has."""
    if schema.host_output_node:
        return max(linked_slots, default=-1) + 1
    return min(len(schema.outputs), SHARED_OUTPUTS.get(schema.type, len(schema.outputs)))


def effective_type(schemas: Schemas, node_types: dict[int, str], links_in: dict, node: int, slot: int) -> str:
    """Type of output ``slot`` of ``node``, following pass-through outputs (``*``) to their source."""
    schema = schemas.get(node_types[node])
    if schema is None or slot >= len(schema.outputs):
        return "?"
    declared = schema.outputs[slot]
    through = schemas.passthrough.get(schema.type, {}).get(slot)
    if declared == "*" and through and (node, through) in links_in:
        src_node, src_slot = links_in[(node, through)]
        return effective_type(schemas, node_types, links_in, src_node, src_slot)
    return declared


def types_compatible(src: str, dst: str) -> bool:
    if "*" in (src, dst):
        return True
    return src == dst or src in dst.split(",") or dst in src.split(",")


def _api_title(schema: NodeSchema) -> str:
    """``_meta.title`` of a node without a title of its own: the display name of this pack's and declared
    third-party nodes (the same on every host), the node type of the host's own nodes (their display
    names change between releases: ``LoadLatent`` became "Load Latent" and ``DualCLIPLoader``
    "Load CLIP (Dual)" in 0.33)."""
    host_node = schema.pack is None and not schema.type.startswith(PACK_PREFIX)
    return schema.type if host_node else schema.display_name


def ui_to_api(ui: dict, schemas: Schemas) -> dict:
    """API-format prompt of a UI workflow, mapping widgets_values by the node schemas (as the frontend).

    Inputs nested in a dynamic combo are written under the key every supported host accepts
    (:meth:`NodeSchema.api_name`), so that one twin runs on all of them.
    """
    links = {link[0]: link for link in ui.get("links", [])}
    api: dict[str, dict] = {}
    for node in sorted(ui.get("nodes", []), key=lambda n: n["id"]):
        if node["type"] in schemas.frontend_only or node.get("mode", 0) in (2, 4):
            continue
        schema = schemas.get(node["type"])
        if schema is None:
            raise KeyError(f"node {node['id']}: unknown node type {node['type']!r}")
        linked = {}
        for entry in node.get("inputs", []):
            if entry.get("link") is not None and entry["link"] in links:
                link = links[entry["link"]]
                linked[entry["name"]] = [str(link[1]), link[2]]
        values = list(node.get("widgets_values") or [])
        slots = schemas.ui_widget_layout(schema, values)
        widget_values = {slot.spec.name: values[slot.index] for slot in slots if slot.index < len(values)}
        inputs: dict[str, Any] = {}
        for spec in _all_inputs(schema.inputs):  # nested inputs of a dynamic combo right after it
            key = schema.api_name(spec.name)
            if key in inputs:
                continue
            if spec.name in linked:
                inputs[key] = linked[spec.name]
            elif spec.widget and spec.name in widget_values:
                inputs[key] = widget_values[spec.name]
        api[str(node["id"])] = {
            "class_type": node["type"],
            "inputs": inputs,
            "_meta": {"title": node.get("title") or _api_title(schema)},
        }
    return api
