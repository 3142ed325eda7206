"""Swap a workflow's core VAE nodes for VRAM Fit's, or back, headless (the browser's "Use VRAM Fit for VAE
nodes" command does the same on the open graph, web/js/vramfit_swap.js):

    python -m scripts.use_vramfit IN.json OUT.json            # VAE Decode, VAE Encode, ... -> VRAM Fit nodes
    python -m scripts.use_vramfit IN.json OUT.json --revert   # VRAM Fit's VAE nodes -> the core nodes

Takes API-format prompts (``{id: {class_type, inputs}}``) and UI-format workflows (``{nodes, links}``, their
subgraphs included), told apart by their shape. Which node becomes which, and how widgets carry over, is
``web/vramfit_swap.json`` (read by the browser command too): a core node becomes the video node where the
graph shows a video (its VAE's file, the latent's source; seen through reroutes and subgraph boundaries,
:func:`kind_of`), and its temporal widgets go by that VAE's temporal compression. Links, ids, titles,
positions, sizes, colours, modes and groups stay as they were; a widget without a counterpart (core
``overlap``, the pack's ``budget_mb``...) is kept on the swapped node (``properties`` / ``_meta`` under the
mapping's ``stash`` key) when a swap back needs it to give the same node again, and so is what the saved
node lacked or held otherwise (no ``widgets_values``, its registry fields' place), so swap then revert gives
back the identical graph (the same JSON once loaded). VAE nodes with no counterpart here (audio, 3-D) are
left as they are, counted with why in the log. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import Any

from scripts.workflows import node_height

log = logging.getLogger("vramfit.use_vramfit")

MAPPING_PATH = pathlib.Path(__file__).resolve().parents[1] / "web" / "vramfit_swap.json"
VIDEO, IMAGE, ANY = "video", "image", "any"
UI_KEYS_KEPT_ABSENT = ("widgets_values",)
"""Node keys a swap writes that a saved node may lack: a swap back leaves them out again."""
ORIGIN_PROPERTIES = ("cnr_id", "ver", "aux_id")
"""Node properties newer frontends save to say which pack (and version) a node comes from: they belong to
the old type, so a swapped node keeps them in its stash."""


# ------------------------------------------------------------------------------------ the mapping


@dataclasses.dataclass(frozen=True)
class Mapping:
    """``web/vramfit_swap.json``: node specs, core -> pack entries, pack -> core, video hints."""

    data: dict

    @property
    def stash(self) -> str:
        return self.data["stash"]

    def spec(self, node_type: str) -> dict:
        return self.data["nodes"][node_type]

    def widget_names(self, node_type: str) -> list[str]:
        return [w["name"] for w in self.spec(node_type)["widgets"]]

    def defaults(self, node_type: str) -> dict[str, Any]:
        return {w["name"]: w["default"] for w in self.spec(node_type)["widgets"]}

    def is_core(self, node_type: str) -> bool:
        return any(e["core"] == node_type for e in self.data["swap"])

    def is_pack(self, node_type: str) -> bool:
        return node_type in self.data["revert"]

    def sources(self, revert: bool) -> set[str]:
        """The node types a swap (or a revert) replaces."""
        return set(self.data["revert"]) if revert else {e["core"] for e in self.data["swap"]}

    def entry(self, core: str, pack: str) -> dict | None:
        return next((e for e in self.data["swap"] if e["core"] == core and e["pack"] == pack), None)

    def pick(self, core: str, kind: str) -> dict:
        """The swap entry of ``core`` for a graph of ``kind`` (``video``/``image``)."""
        found = [e for e in self.data["swap"] if e["core"] == core and e["kind"] in (kind, ANY)]
        return found[0]

    def video_hints(self) -> tuple[set[str], set[str]]:
        return set(self.data["video"]["upstream"]), set(self.data["video"]["downstream"])

    def unmapped(self) -> dict[str, str]:
        """VAE node types with no counterpart here, and why."""
        return self.data.get("unmapped") or {}


def load_mapping(path: pathlib.Path = MAPPING_PATH) -> Mapping:
    return Mapping(json.loads(path.read_text()))


def _clamp(value: int, spec: dict) -> int:
    lo, hi, step = spec.get("min"), spec.get("max"), spec.get("step") or 1
    if lo is not None and value < lo:
        value = lo
    if hi is not None and value > hi:
        value = hi
    base = lo if lo is not None and lo > 0 else 0
    return value - (value - base) % step


@dataclasses.dataclass(frozen=True)
class Kind:
    """What the graph shows at a node: ``kind`` (``video``/``image``), the VAE's temporal compression (output
    frames per latent frame, the mapping's ``divide: "temporal_compression"``) and why (for the log)."""

    kind: str = IMAGE
    temporal_compression: int = 4
    why: str = ""


def _map_value(rule: dict, value: Any, to_pack: bool, target_spec: dict, kind: Kind = Kind()) -> Any:
    """A widget value carried across a rule of the mapping: the core default <-> the pack's auto, else
    scaled by ``divide`` (a number, or ``"temporal_compression"``: the VAE's, from ``kind``) and kept in the
    target widget's range."""
    src_auto, dst_auto = ("core_auto", "pack_auto") if to_pack else ("pack_auto", "core_auto")
    if src_auto in rule and value == rule[src_auto]:
        return rule[dst_auto]
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    divide = rule.get("divide", 1)
    if divide == "temporal_compression":
        divide = kind.temporal_compression
    scaled = value // divide if to_pack else value * divide
    if to_pack and value > 0:
        scaled = max(scaled, 1)
    return _clamp(scaled, target_spec)


@dataclasses.dataclass(frozen=True)
class State:
    """What a swap reads and writes of a node: its type, widget values by name, title (None: the node has
    none of its own, the frontend shows its display name) and stash (what the other side had)."""

    type: str
    widgets: dict[str, Any]
    title: str | None
    stash: dict | None


def _convert(m: Mapping, x: State, kind: Kind, use_stash: bool = True) -> tuple[str, dict[str, Any], dict]:
    """``(type, widgets, entry)`` of the other side of node ``x``."""
    to_pack = m.is_core(x.type)
    stash = x.stash if use_stash else None
    entry = None
    if stash:
        pair = (x.type, stash.get("type")) if to_pack else (stash.get("type"), x.type)
        entry = m.entry(*pair)
    if entry is None:
        stash = None
        entry = m.pick(x.type, kind.kind) if to_pack else m.entry(m.data["revert"][x.type], x.type)
    y_type = entry["pack"] if to_pack else entry["core"]
    y_specs = {w["name"]: w for w in m.spec(y_type)["widgets"]}
    y = m.defaults(y_type)
    if stash:
        y.update({k: v for k, v in stash.get("widgets", {}).items() if k in y})
    for rule in entry["widgets"]:
        xn, yn = (rule["core"], rule["pack"]) if to_pack else (rule["pack"], rule["core"])
        if xn not in x.widgets:
            continue
        if stash and yn in stash.get("widgets", {}):
            x_spec = m.spec(x.type)["widgets"][_index(m, x.type, xn)]
            if _map_value(rule, stash["widgets"][yn], not to_pack, x_spec, kind) == x.widgets[xn]:
                continue  # unchanged since the stash was made: its value
        y[yn] = _map_value(rule, x.widgets[xn], to_pack, y_specs[yn], kind)
    return y_type, y, entry


def _index(m: Mapping, node_type: str, name: str) -> int:
    return m.widget_names(node_type).index(name)


def _auto_title(m: Mapping, x: State, y_type: str) -> str | None:
    """The title the other side gets: a title of its own stays; an automatic one (the type or the display
    name) becomes the new type's: a pack node's display name, a core node's type (as the API twins name the
    host's nodes: their display names change between releases, scripts/workflow_schema.py ``_api_title``);
    None (UI format: the frontend shows the display name) stays None."""
    if x.title is None:
        return None
    if x.title in (x.type, m.spec(x.type)["display_name"]):
        return y_type if m.is_core(y_type) else m.spec(y_type)["display_name"]
    return x.title


def convert(m: Mapping, x: State, kind: Kind) -> tuple[State, dict]:
    """The node ``x`` on the other side, and the mapping entry used. The result carries a stash (``x``'s type,
    widgets and title) only when converting it back without one would not give ``x`` again."""
    y_type, y_widgets, entry = _convert(m, x, kind)
    title = x.stash["title"] if x.stash and "title" in x.stash and x.stash.get("type") == y_type else (
        _auto_title(m, x, y_type))
    y = State(y_type, y_widgets, title, None)
    back_type, back_widgets, _ = _convert(m, y, kind, use_stash=False)
    back = State(back_type, back_widgets, _auto_title(m, y, back_type), None)
    if (back.type, back.widgets, back.title) != (x.type, x.widgets, x.title):
        y = dataclasses.replace(y, stash=_stash_of(x))
    return y, entry


def _stash_of(x: State) -> dict:
    """What a swap back needs of node ``x``: its type, widgets and title."""
    return {"type": x.type, "widgets": dict(x.widgets), "title": x.title}


# ------------------------------------------------------------------------------------ results


@dataclasses.dataclass
class Swap:
    node: str
    old: str
    new: str
    kept: dict[str, Any]
    """Widgets of the old node with no counterpart on the new one (kept in the stash for a swap back)."""
    why: str = ""
    """Why the video node was chosen (empty for the image node and for a swap back)."""


@dataclasses.dataclass
class Outcome:
    graph: dict
    format: str
    swaps: list[Swap] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """``(node, type, why)`` of the nodes left as they were."""
    unmapped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """``(node, type, why)`` of the VAE nodes with no VRAM Fit counterpart (audio, 3-D...), left as they are."""

    def left(self) -> dict[str, tuple[int, str]]:
        """``{type: (count, why)}`` of the unmapped VAE nodes."""
        out: dict[str, tuple[int, str]] = {}
        for _, t, why in self.unmapped:
            out[t] = (out.get(t, (0, why))[0] + 1, why)
        return out

    def summary(self) -> str:
        lines = [f"{len(self.swaps)} node(s) swapped ({self.format} format)"]
        for s in self.swaps:
            notes = [s.why] if s.why else []
            if s.kept:
                notes.append("no counterpart: " + ", ".join(f"{k}={v!r}" for k, v in s.kept.items()))
            lines.append(f"  node {s.node}: {s.old} -> {s.new}" + (f" ({'; '.join(notes)})" if notes else ""))
        lines += [f"  node {n} ({t}) left as it was: {why}" for n, t, why in self.skipped]
        lines += [f"  {count} {t} node(s) left as they are (no VRAM Fit counterpart): {why}"
                  for t, (count, why) in self.left().items()]
        return "\n".join(lines)


def _kept(m: Mapping, entry: dict, x: State) -> dict[str, Any]:
    side = "core" if m.is_core(x.type) else "pack"
    mapped = {r[side] for r in entry["widgets"]}
    return {k: v for k, v in x.widgets.items() if k not in mapped}


# ------------------------------------------------------------------------------------ video hints


@dataclasses.dataclass
class Flow:
    """The links of a whole workflow as one graph: node keys (API: the id; UI: ``(subgraph id or None, node
    id as a string)``, with ``(graph, "in"|"out", slot)`` for a subgraph's input and output slots), their types and
    values (UI widgets_values, API inputs), and each node's origins by input name and its targets. A link
    into a subgraph node goes to the subgraph's input slot, on to the nodes inside its definition; one out
    of it comes from the definition's output slot: the flow sees through subgraph boundaries."""

    types: dict[Any, str | None] = dataclasses.field(default_factory=dict)
    values: dict[Any, list] = dataclasses.field(default_factory=dict)
    ups: dict[Any, list[tuple[str | None, Any]]] = dataclasses.field(default_factory=dict)
    downs: dict[Any, set] = dataclasses.field(default_factory=dict)

    def link(self, origin: Any, target: Any, name: str | None) -> None:
        self.ups.setdefault(target, []).append((name, origin))
        self.downs.setdefault(origin, set()).add(target)

    def closure(self, starts: list, down: bool = False) -> set:
        """``starts`` and every node upstream of them (downstream with ``down``)."""
        seen, todo = set(starts), list(starts)
        while todo:
            key = todo.pop()
            nexts = self.downs.get(key, ()) if down else (o for _, o in self.ups.get(key, ()))
            for nxt in nexts:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen


def _ui_slot(node: dict, side: str, slot: Any, names: list[str]) -> Any:
    """The subgraph slot that slot ``slot`` of subgraph node ``node`` stands for (by name, else by index)."""
    entries = node.get(side) or []
    name = entries[slot].get("name") if isinstance(slot, int) and 0 <= slot < len(entries) else None
    return names.index(name) if name in names else slot


def ui_flow(workflow: dict) -> Flow:
    """The :class:`Flow` of a UI-format workflow, its subgraphs included."""
    flow = Flow()
    subs = {s.get("id"): s for s in (workflow.get("definitions") or {}).get("subgraphs") or []}
    io_names = {sid: ([i.get("name") for i in s.get("inputs") or []], [o.get("name") for o in s.get("outputs") or []])
                for sid, s in subs.items()}
    for gid, graph in [(None, workflow), *subs.items()]:
        nodes = {str(n.get("id")): n for n in graph.get("nodes") or []}
        for nid, n in nodes.items():
            flow.types[(gid, nid)] = n.get("type")
            flow.values[(gid, nid)] = n.get("widgets_values") if isinstance(n.get("widgets_values"), list) else []
        for origin, o_slot, target, t_slot in _ui_link_ends(graph):
            origin, target = str(origin), str(target)
            src, dst = (gid, origin), (gid, target)
            if origin == "-10":
                src = (gid, "in", o_slot)
            elif nodes.get(origin, {}).get("type") in subs:
                sid = nodes[origin]["type"]
                src = (sid, "out", _ui_slot(nodes[origin], "outputs", o_slot, io_names[sid][1]))
            name = None
            if target == "-20":
                dst = (gid, "out", t_slot)
            elif nodes.get(target, {}).get("type") in subs:
                sid = nodes[target]["type"]
                dst = (sid, "in", _ui_slot(nodes[target], "inputs", t_slot, io_names[sid][0]))
            else:
                entries = nodes.get(target, {}).get("inputs") or []
                name = entries[t_slot].get("name") if isinstance(t_slot, int) and 0 <= t_slot < len(entries) else None
            flow.link(src, dst, name)
    return flow


def api_flow(prompt: dict) -> Flow:
    """The :class:`Flow` of an API-format prompt."""
    flow = Flow()
    for k, n in prompt.items():
        flow.types[k] = n.get("class_type")
        flow.values[k] = list((n.get("inputs") or {}).values())
    for k, n in prompt.items():
        for name, v in (n.get("inputs") or {}).items():
            if _is_link(v) and v[0] in prompt:
                flow.link(v[0], k, name)
    return flow


def kind_of(m: Mapping, flow: Flow, key: Any, node_type: str) -> Kind:
    """Whether core node ``node_type`` at ``key`` works on a video (web/vramfit_swap.json ``video``): its VAE's
    file (a loader upstream of its ``vae`` input), a node making video latents or frames upstream of it, or,
    for a decode whose VAE file is not seen, a node downstream taking its frames as a video."""
    video = m.data["video"]
    upstream, downstream = m.video_hints()
    loaders = set(video.get("vae_loaders") or [])
    default = video.get("temporal_compression", 4)
    families = video.get("families") or {}
    vae_from = [o for name, o in flow.ups.get(key, ()) if name == "vae"]
    files = sorted({v for k in flow.closure(vae_from) if flow.types.get(k) in loaders
                    for v in flow.values.get(k) or [] if isinstance(v, str)})
    seen = next(((f, rule["family"]) for rule in video.get("vae_files") or [] for f in files
                 if re.search(rule["match"], f, re.IGNORECASE)), None)
    above = sorted({t for k in flow.closure([key]) - {key} if (t := flow.types.get(k)) in upstream})
    family = seen[1] if seen else next(
        (fam for fam, spec in families.items() if set(spec.get("upstream") or []) & set(above)), None)
    temporal = (families.get(family) or {}).get("temporal_compression", default)
    if seen:
        return Kind(VIDEO, temporal, f"video: VAE {seen[0]}")
    if above:
        return Kind(VIDEO, temporal, f"video: from {above[0]}")
    decode = bool(m.spec(node_type)["inputs"]) and m.spec(node_type)["inputs"][0][1] == "LATENT"
    if decode and not files:
        below = sorted({t for k in flow.closure([key], down=True) if (t := flow.types.get(k)) in downstream})
        if below:
            return Kind(VIDEO, temporal, f"video: into {below[0]}")
    return Kind(IMAGE, temporal)


# ------------------------------------------------------------------------------------ API format


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def swap_api(m: Mapping, prompt: dict, revert: bool = False) -> Outcome:
    out = Outcome(copy.deepcopy(prompt), "API")
    graph = out.graph
    flow = api_flow(graph)
    used_slots: dict[str, set[int]] = {k: set() for k in graph}
    for n in graph.values():
        for v in n.get("inputs", {}).values():
            if _is_link(v) and v[0] in graph:
                used_slots[v[0]].add(v[1])
    for k, n in graph.items():
        t = n.get("class_type")
        if not revert and t in m.unmapped():
            out.unmapped.append((k, t, m.unmapped()[t]))
        if t not in m.sources(revert):
            continue
        inputs = n.get("inputs", {})
        names = m.widget_names(t)
        driven = [w for w in names if _is_link(inputs.get(w))]
        if driven:
            out.skipped.append((k, t, f"widget {driven[0]!r} is driven by a link"))
            continue
        if revert and any(s > 0 for s in used_slots[k]):
            out.skipped.append((k, t, "its report output is linked (the core node has none)"))
            continue
        meta = n.get("_meta") or {}
        x = State(t, {w: inputs.get(w, m.defaults(t)[w]) for w in names}, meta.get("title"), meta.get(m.stash))
        kind = kind_of(m, flow, k, t)
        y, entry = convert(m, x, kind)
        sockets = [s for s, _ in m.spec(y.type)["inputs"]]
        new_inputs = {s: inputs[s] for s in sockets if s in inputs}
        new_inputs.update(y.widgets)
        n["class_type"] = y.type
        n["inputs"] = new_inputs
        new_meta = {key: v for key, v in meta.items() if key not in ("title", m.stash)}
        if y.title is not None:
            new_meta = {"title": y.title, **new_meta}
        if y.stash:
            new_meta[m.stash] = y.stash
        if new_meta or "_meta" in n:
            n["_meta"] = new_meta
        out.swaps.append(Swap(k, t, y.type, _kept(m, entry, x), "" if revert else kind.why))
    return out


# ------------------------------------------------------------------------------------ UI format


def _ui_graphs(workflow: dict) -> Iterator[dict]:
    """The workflow's graph and its subgraphs' (frontends with subgraphs keep them under definitions)."""
    yield workflow
    yield from (workflow.get("definitions") or {}).get("subgraphs") or []


def _ui_graph_id(workflow: dict, graph: dict) -> str | None:
    """``graph``'s part of a :class:`Flow` key: None for the workflow's own graph, else the subgraph's id."""
    return None if graph is workflow else graph.get("id")


def _ui_link_ends(graph: dict) -> list[tuple[Any, Any, Any, Any]]:
    """``(origin node, origin slot, target node, target slot)`` of each link (array or object form)."""
    ends = []
    for link in graph.get("links") or []:
        if isinstance(link, dict):
            ends.append((link["origin_id"], link["origin_slot"], link["target_id"], link["target_slot"]))
        else:
            ends.append((link[1], link[2], link[3], link[4]))
    return ends


def _ui_style(nodes: list[dict]) -> tuple[bool, bool]:
    """``(localized, widget_entries)``: whether the frontend that saved the graph names sockets with
    ``localized_name`` and lists every widget as an input entry (newer frontends do both), told from any node
    (an unlinked widget entry: older frontends list a widget only when it is converted to a linked input)."""
    inputs = [i for n in nodes for i in n.get("inputs") or []]
    return (any("localized_name" in i for i in inputs),
            any("widget" in i and i.get("link") is None for i in inputs))


def _ui_inputs(m: Mapping, node: dict, y: State, style: tuple[bool, bool]) -> list[dict]:
    old = node.get("inputs") or []
    by_name = {i.get("name"): i for i in old}
    localized, widget_entries = style
    new = []
    for name, typ in m.spec(y.type)["inputs"]:
        entry = dict(by_name.get(name) or {"name": name, "link": None})
        entry["type"] = typ
        new.append(entry)
    if widget_entries:
        for w in m.spec(y.type)["widgets"]:
            entry = {"name": w["name"], "type": "BOOLEAN" if isinstance(w["default"], bool) else "INT",
                     "widget": {"name": w["name"]}, "link": None}
            if localized:
                entry = {"localized_name": w["name"], **entry}
            new.append(entry)
    if localized:
        for entry in new:
            entry.setdefault("localized_name", entry["name"])
    return new


def _ui_outputs(m: Mapping, node: dict, y: State) -> list[dict]:
    old = node.get("outputs") or []
    numbered = any("slot_index" in o for o in old)
    localized = any("localized_name" in o for o in old)
    new = []
    for i, (name, typ) in enumerate(m.spec(y.type)["outputs"]):
        entry = dict(old[i]) if i < len(old) else {"name": name, "type": typ, "links": []}
        entry.update(name=name, type=typ)
        if localized:
            entry["localized_name"] = name
        if numbered and not (i < len(old) and "slot_index" in old[i]):  # an output's own (null or not) stays
            entry["slot_index"] = i
        new.append(entry)
    return new


def swap_ui(m: Mapping, workflow: dict, revert: bool = False) -> Outcome:
    out = Outcome(copy.deepcopy(workflow), "UI")
    flow = ui_flow(workflow)  # of the graph as it came: every node's kind from the same graph
    for graph in _ui_graphs(out.graph):
        gid = _ui_graph_id(out.graph, graph)
        nodes = graph.get("nodes") or []
        style = _ui_style(nodes)
        for n in nodes:
            t = n.get("type")
            if not revert and t in m.unmapped():
                out.unmapped.append((str(n["id"]), t, m.unmapped()[t]))
            if t not in m.sources(revert):
                continue
            nid = str(n["id"])
            driven = [i["name"] for i in n.get("inputs") or [] if "widget" in i and i.get("link") is not None]
            if driven:
                out.skipped.append((nid, t, f"widget {driven[0]!r} is driven by a link"))
                continue
            if revert and any(o.get("links") for o in (n.get("outputs") or [])[1:]):
                out.skipped.append((nid, t, "its report output is linked (the core node has none)"))
                continue
            names = m.widget_names(t)
            values = list(n.get("widgets_values") or [])
            widgets = {w: values[i] if i < len(values) else m.defaults(t)[w] for i, w in enumerate(names)}
            props = n.get("properties") or {}
            x = State(t, widgets, n.get("title"), props.get(m.stash))
            kind = kind_of(m, flow, (gid, str(n["id"])), t)
            y, entry = convert(m, x, kind)
            returning = bool(x.stash) and x.stash.get("type") == y.type  # back to what the node was
            absent = [k for k in UI_KEYS_KEPT_ABSENT if k not in n]
            n["type"] = y.type
            n["inputs"] = _ui_inputs(m, n, y, style)
            n["outputs"] = _ui_outputs(m, n, y)
            n["widgets_values"] = [y.widgets[w] for w in m.widget_names(y.type)]
            stash = y.stash
            if returning:
                for key in x.stash.get("absent") or []:
                    if not n.get(key):  # nothing of its own since (a widget-less node's [] is nothing)
                        n.pop(key, None)
            elif absent:  # a key the node had not (older frontends save no widgets_values on a widget-less node)
                stash = {**(stash or _stash_of(x)), "absent": absent}
            if returning and x.stash.get("size"):
                n["size"] = list(x.stash["size"])
            elif not returning and isinstance(n.get("size"), list) and len(n["size"]) == 2:
                y_spec = m.spec(y.type)
                need = node_height(len(y_spec["inputs"]), len(y_spec["outputs"]), len(y_spec["widgets"]))
                if n["size"][1] < need:  # room for the new widgets; the old size kept for the way back
                    stash = {**(stash or _stash_of(x)), "size": list(n["size"])}
                    n["size"] = [n["size"][0], need]
            if y.title is None:
                n.pop("title", None)
            else:
                n["title"] = y.title
            new_props = {k: v for k, v in props.items() if k != m.stash and k not in ORIGIN_PROPERTIES}
            if new_props.get("Node name for S&R") == t:
                new_props["Node name for S&R"] = y.type
            if returning:
                new_props.update(x.stash.get("properties") or {})
                order = x.stash.get("order") or []
                new_props = {**{k: new_props[k] for k in order if k in new_props}, **new_props}
            origin = {k: props[k] for k in ORIGIN_PROPERTIES if k in props}
            if origin:  # whose node it was (the frontend's registry fields): the other side's, kept for the way back
                stash = {**(stash or _stash_of(x)), "properties": origin}
                order = [k for k in props if k != m.stash]
                if order != [k for k in order if k not in origin] + list(origin):  # not last: where they were
                    stash["order"] = order
            if stash:
                new_props[m.stash] = stash
            n["properties"] = new_props
            out.swaps.append(Swap(nid, t, y.type, _kept(m, entry, x), "" if revert else kind.why))
    return out


# ------------------------------------------------------------------------------------ entry


def is_ui_format(graph: dict) -> bool:
    return isinstance(graph.get("nodes"), list)


def swap(graph: dict, revert: bool = False, mapping: Mapping | None = None) -> Outcome:
    """``graph`` (UI or API format, told apart by its shape) with its VAE nodes swapped."""
    m = mapping or load_mapping()
    if is_ui_format(graph):
        return swap_ui(m, graph, revert)
    if graph and all(isinstance(n, dict) and "class_type" in n for n in graph.values()):
        return swap_api(m, graph, revert)
    raise ValueError("not a ComfyUI workflow: neither UI format ({nodes, links}) nor API format "
                     "({id: {class_type, inputs}})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=pathlib.Path, help="workflow JSON (UI or API format)")
    parser.add_argument("output", type=pathlib.Path, help="where to write the swapped workflow")
    parser.add_argument("--revert", action="store_true", help="VRAM Fit's VAE nodes back to the core nodes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        graph = json.loads(args.input.read_text())
        outcome = swap(graph, revert=args.revert)
    except (OSError, ValueError) as e:
        log.error("%s: %s", args.input, e)
        return 1
    args.output.write_text(json.dumps(outcome.graph, indent=2 if is_ui_format(graph) else 1) + "\n")
    log.info("%s -> %s: %s", args.input, args.output, outcome.summary())
    return 0


if __name__ == "__main__":  # pragma: no cover - CLI
    sys.exit(main())
