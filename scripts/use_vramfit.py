"""Swap a workflow's core VAE nodes for VRAM Fit's, or back, headless (the browser's "Use VRAM Fit for VAE
nodes" command does the same on the open graph, web/js/vramfit_swap.js):

    python -m scripts.use_vramfit IN.json OUT.json            # VAE Decode, VAE Encode, ... -> VRAM Fit nodes
    python -m scripts.use_vramfit IN.json OUT.json --revert   # VRAM Fit's VAE nodes -> the core nodes

Takes API-format prompts (``{id: {class_type, inputs}}``) and UI-format workflows (``{nodes, links}``, their
subgraphs included), told apart by their shape. Which node becomes which, and how widgets carry over, is
``web/vramfit_swap.json`` (read by the browser command too). Links, ids, titles, positions, sizes, colours
and groups stay as they were; a widget without a counterpart (core ``overlap``, the pack's ``budget_mb``...)
is kept on the swapped node (``properties`` / ``_meta`` under the mapping's ``stash`` key) when a swap back
needs it to give the same node again, so swap then revert gives back the identical graph. Needs only the
standard library.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

from scripts.workflows import node_height

log = logging.getLogger("vramfit.use_vramfit")

MAPPING_PATH = pathlib.Path(__file__).resolve().parents[1] / "web" / "vramfit_swap.json"
VIDEO, IMAGE, ANY = "video", "image", "any"
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


def _map_value(rule: dict, value: Any, to_pack: bool, target_spec: dict) -> Any:
    """A widget value carried across a rule of the mapping: the core default <-> the pack's auto, else
    scaled by ``divide`` and kept in the target widget's range."""
    src_auto, dst_auto = ("core_auto", "pack_auto") if to_pack else ("pack_auto", "core_auto")
    if src_auto in rule and value == rule[src_auto]:
        return rule[dst_auto]
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    divide = rule.get("divide", 1)
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


def _convert(m: Mapping, x: State, kind: str, use_stash: bool = True) -> tuple[str, dict[str, Any], dict]:
    """``(type, widgets, entry)`` of the other side of node ``x``."""
    to_pack = m.is_core(x.type)
    stash = x.stash if use_stash else None
    entry = None
    if stash:
        pair = (x.type, stash.get("type")) if to_pack else (stash.get("type"), x.type)
        entry = m.entry(*pair)
    if entry is None:
        stash = None
        entry = m.pick(x.type, kind) if to_pack else m.entry(m.data["revert"][x.type], x.type)
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
            back = _map_value(rule, stash["widgets"][yn], not to_pack, m.spec(x.type)["widgets"][_index(m, x.type, xn)])
            if back == x.widgets[xn]:
                continue  # unchanged since the stash was made: its value
        y[yn] = _map_value(rule, x.widgets[xn], to_pack, y_specs[yn])
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


def convert(m: Mapping, x: State, kind: str) -> tuple[State, dict]:
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


@dataclasses.dataclass
class Outcome:
    graph: dict
    format: str
    swaps: list[Swap] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    """``(node, type, why)`` of the nodes left as they were."""

    def summary(self) -> str:
        lines = [f"{len(self.swaps)} node(s) swapped ({self.format} format)"]
        for s in self.swaps:
            kept = ", ".join(f"{k}={v!r}" for k, v in s.kept.items())
            lines.append(f"  node {s.node}: {s.old} -> {s.new}" + (f" (no counterpart: {kept})" if kept else ""))
        lines += [f"  node {n} ({t}) left as it was: {why}" for n, t, why in self.skipped]
        return "\n".join(lines)


def _kept(m: Mapping, entry: dict, x: State) -> dict[str, Any]:
    side = "core" if m.is_core(x.type) else "pack"
    mapped = {r[side] for r in entry["widgets"]}
    return {k: v for k, v in x.widgets.items() if k not in mapped}


# ------------------------------------------------------------------------------------ video hints


def _reaches(start: str, edges: dict[str, set[str]], types: dict[str, str], wanted: set[str]) -> bool:
    seen, todo = {start}, [start]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                if types.get(nxt) in wanted:
                    return True
                seen.add(nxt)
                todo.append(nxt)
    return False


def _kind(m: Mapping, node: str, node_type: str, types: dict, ups: dict, downs: dict) -> str:
    upstream, downstream = m.video_hints()
    if _reaches(node, ups, types, upstream):
        return VIDEO
    decode = bool(m.spec(node_type)["inputs"]) and m.spec(node_type)["inputs"][0][1] == "LATENT"
    return VIDEO if decode and _reaches(node, downs, types, downstream) else IMAGE


# ------------------------------------------------------------------------------------ API format


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def swap_api(m: Mapping, prompt: dict, revert: bool = False) -> Outcome:
    out = Outcome(copy.deepcopy(prompt), "API")
    graph = out.graph
    types = {k: n.get("class_type") for k, n in graph.items()}
    ups: dict[str, set[str]] = {k: set() for k in graph}
    downs: dict[str, set[str]] = {k: set() for k in graph}
    used_slots: dict[str, set[int]] = {k: set() for k in graph}
    for k, n in graph.items():
        for v in n.get("inputs", {}).values():
            if _is_link(v) and v[0] in graph:
                ups[k].add(v[0])
                downs[v[0]].add(k)
                used_slots[v[0]].add(v[1])
    for k, n in graph.items():
        t = n.get("class_type")
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
        y, entry = convert(m, x, _kind(m, k, t, types, ups, downs))
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
        out.swaps.append(Swap(k, t, y.type, _kept(m, entry, x)))
    return out


# ------------------------------------------------------------------------------------ UI format


def _ui_graphs(workflow: dict) -> Iterator[dict]:
    """The workflow's graph and its subgraphs' (frontends with subgraphs keep them under definitions)."""
    yield workflow
    yield from (workflow.get("definitions") or {}).get("subgraphs") or []


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
        if numbered:
            entry["slot_index"] = i
        new.append(entry)
    return new


def swap_ui(m: Mapping, workflow: dict, revert: bool = False) -> Outcome:
    out = Outcome(copy.deepcopy(workflow), "UI")
    for graph in _ui_graphs(out.graph):
        nodes = graph.get("nodes") or []
        types = {n["id"]: n.get("type") for n in nodes}
        style = _ui_style(nodes)
        ups: dict[Any, set] = {n["id"]: set() for n in nodes}
        downs: dict[Any, set] = {n["id"]: set() for n in nodes}
        for a, _, b, _ in _ui_link_ends(graph):
            ups.setdefault(b, set()).add(a)
            downs.setdefault(a, set()).add(b)
        for n in nodes:
            t = n.get("type")
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
            y, entry = convert(m, x, _kind(m, n["id"], t, types, ups, downs))
            n["type"] = y.type
            n["inputs"] = _ui_inputs(m, n, y, style)
            n["outputs"] = _ui_outputs(m, n, y)
            n["widgets_values"] = [y.widgets[w] for w in m.widget_names(y.type)]
            stash = y.stash
            returning = bool(x.stash) and x.stash.get("type") == y.type  # back to what the node was
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
            if x.stash and x.stash.get("type") == y.type:
                new_props.update(x.stash.get("properties") or {})
            origin = {k: props[k] for k in ORIGIN_PROPERTIES if k in props}
            if origin:  # whose node it was (the frontend's registry fields): the other side's, kept for the way back
                stash = {**(stash or _stash_of(x)), "properties": origin}
            if stash:
                new_props[m.stash] = stash
            n["properties"] = new_props
            out.swaps.append(Swap(nid, t, y.type, _kept(m, entry, x)))
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
