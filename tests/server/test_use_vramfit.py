"""The VAE node swap (scripts/use_vramfit.py, web/vramfit_swap.json) against a real ComfyUI: the mapping's
node specs are the host's own (/object_info: sockets, widgets in order with defaults and ranges, outputs,
display names), core versions of the CPU templates and their swapped graphs validate on the host, UI and API
swaps agree (the swapped UI converted to API format equals the swapped API twin), a swapped core graph
runs (issue 37), and every node the swap makes of ComfyUI's own templates (the corpus of
tests/unit/test_use_vramfit.py) is valid on the host (issue 42)."""

from __future__ import annotations

import copy
import json

import pytest

from scripts import use_vramfit as u
from scripts.host import output_files
from scripts.workflow_graphs import CPU_WORKFLOWS, all_workflows
from scripts.workflow_schema import Schemas, value_counts
from scripts.workflow_validate import check_widget_value, validate_workflow
from scripts.workflows import API_DIR, WORKFLOWS_DIR, copy_shipped_inputs
from tests.unit.test_use_vramfit import vae_corpus

pytestmark = pytest.mark.server

M = u.load_mapping()
TEMPLATE = {d.name: d.template_name for d in all_workflows()}


@pytest.fixture(scope="module")
def shipped_inputs(server, host_config):
    return [p.name for p in copy_shipped_inputs(host_config.comfyui_path, server.input_dir)]


@pytest.fixture(scope="module")
def object_info(client, shipped_inputs):
    return client.object_info()


def _widget_spec(spec) -> dict:
    typ, opts = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
    out = {"default": opts.get("default")}
    if typ == "INT":
        out.update({k: opts[k] for k in ("min", "max", "step") if k in opts})
    return out


@pytest.mark.parametrize("node_type", sorted(M.data["nodes"]))
def test_mapping_node_specs_are_the_hosts(object_info, node_type):
    info = object_info[node_type]
    spec = M.spec(node_type)
    assert info["display_name"] == spec["display_name"]
    required = info["input"]["required"]
    order = info.get("input_order", {}).get("required") or list(required)
    sockets = [(n, required[n][0]) for n in order if required[n][0] not in ("INT", "BOOLEAN", "FLOAT", "STRING")]
    assert [list(s) for s in sockets] == spec["inputs"]
    widgets = [{"name": n, **_widget_spec(required[n])} for n in order if required[n][0] in ("INT", "BOOLEAN")]
    optional = info["input"].get("optional") or {}  # after the required ones (allow_approximate): widgets only
    opt_order = info.get("input_order", {}).get("optional") or list(optional)
    assert all(optional[n][0] in ("INT", "BOOLEAN") for n in opt_order), optional
    widgets += [{"name": n, **_widget_spec(optional[n])} for n in opt_order]
    assert widgets == spec["widgets"]
    assert [list(o) for o in zip(info["output_name"], info["output"], strict=True)] == spec["outputs"]


def _core(graph: dict) -> dict:
    """The core version of a pack graph: reverted, with no stash (as a user's own core workflow)."""
    g = u.swap(graph, revert=True, mapping=M).graph
    nodes = [n for gr in u._ui_graphs(g) for n in gr["nodes"]] if u.is_ui_format(g) else list(g.values())
    for n in nodes:
        for holder in (n.get("properties"), n.get("_meta")):
            if isinstance(holder, dict):
                holder.pop(M.stash, None)
    return g


def _tiled(ui: dict, api: dict) -> None:
    """Make the core decode a VAE Decode (Tiled) with a tile side of its own, in both forms."""
    node = next(n for n in ui["nodes"] if n["type"] == "VAEDecode")
    node.update(type="VAEDecodeTiled", widgets_values=[64, 32, 64, 8])
    node["properties"]["Node name for S&R"] = "VAEDecodeTiled"
    twin = api[str(node["id"])]
    twin.update(class_type="VAEDecodeTiled", _meta={"title": "VAEDecodeTiled"})
    twin["inputs"].update(tile_size=64, overlap=32, temporal_size=64, temporal_overlap=8)


@pytest.mark.parametrize("name", CPU_WORKFLOWS)
def test_core_versions_and_their_swaps_validate_and_agree(object_info, name):
    schemas = Schemas(object_info)
    ui = json.loads((WORKFLOWS_DIR / f"{TEMPLATE[name]}.json").read_text())
    api = json.loads((API_DIR / f"{name}.json").read_text())
    core_ui, core_api = _core(ui), _core(api)
    _tiled(core_ui, core_api)
    assert validate_workflow(f"core {name}", core_ui, core_api, schemas) == []
    swapped_ui, swapped_api = u.swap(core_ui, mapping=M).graph, u.swap(core_api, mapping=M).graph
    # the stash differs between the forms (API titles); the rest must agree (ui_to_api in the validator)
    for graph in (swapped_ui, swapped_api):
        for n in graph["nodes"] if graph is swapped_ui else graph.values():
            (n.get("properties") or n.get("_meta") or {}).pop(M.stash, None)
    assert validate_workflow(f"swapped {name}", swapped_ui, swapped_api, schemas) == []


def test_a_swapped_core_graph_runs(server, client, shipped_inputs):
    core = _core(json.loads((API_DIR / "vramfit_image_cpu.json").read_text()))
    dec = next(k for k, n in core.items() if n["class_type"] == "VAEDecode")
    core[dec] = {"class_type": "VAEDecodeTiled", "_meta": {"title": "VAEDecodeTiled"}, "inputs": {
        **core[dec]["inputs"], "tile_size": 64, "overlap": 64, "temporal_size": 64, "temporal_overlap": 8}}
    swapped = u.swap(copy.deepcopy(core), mapping=M)
    assert [(s.old, s.new) for s in swapped.swaps] == [("VAEDecodeTiled", "VRAMFit_TiledVAEDecode")]
    entry = client.run(swapped.graph, timeout=300)
    assert output_files(entry, server.output_dir)
    reports = [t for out in entry["outputs"].values() for t in out.get("text", []) or []
               if isinstance(t, str) and t.startswith("VRAM Fit | Tiled VAE Decode")]
    assert len(reports) == 1
    verdict = reports[0].splitlines()[1]
    assert verdict.startswith("exact") and "tiles" in verdict, verdict  # core's tile side (64) carried


def _node_problems(schemas: Schemas, node: dict) -> list[str]:
    """Why UI node ``node`` would not load as the host declares its type: its widgets (count, types, ranges,
    steps), its sockets and widget entries, its outputs."""
    schema = schemas.get(node["type"])
    if schema is None:
        return ["the host has no such node type"]
    values = node.get("widgets_values") or []
    slots = schemas.ui_widget_layout(schema, values)
    problems = [] if len(values) in value_counts(slots) else [f"{len(values)} widget values: {values}"]
    problems += [f"{slot.spec.name}: {why}" for slot in slots
                 if slot.index < len(values) and (why := check_widget_value(slot.spec, values[slot.index]))]
    sockets = [(i["name"], i["type"]) for i in node.get("inputs") or [] if "widget" not in i]
    if sockets != [(spec.name, spec.type) for spec in schema.sockets]:
        problems.append(f"sockets {sockets}")
    widgets = {spec.name: spec.type for spec in schema.widgets}
    problems += [f"widget entry {i['name']} ({i['type']})" for i in node.get("inputs") or []
                 if "widget" in i and widgets.get(i["name"]) != i["type"]]
    outputs = [(o["name"], o["type"]) for o in node.get("outputs") or []]
    if outputs != list(zip(schema.output_names, schema.outputs, strict=True)):
        problems.append(f"outputs {outputs}")
    return problems


def test_every_node_the_swap_makes_of_the_template_corpus_is_valid_on_this_host(object_info):
    """Each of the 355 VRAM Fit nodes the swap makes of ComfyUI's own templates (the pinned corpus), checked
    against this host's /object_info: widget values (count, type, range, step: a mapped tile side or
    frames_per_chunk out of range would fail here), sockets, widget entries, outputs."""
    schemas = Schemas(object_info)
    problems, made = [], []
    for name, graph in vae_corpus().items():
        swapped = u.swap(graph, mapping=M).graph
        for g in u._ui_graphs(swapped):
            for node in g["nodes"]:
                if node["type"] in M.data["revert"]:
                    made.append(node)
                    problems += [f"{name} node {node['id']} {node['type']}: {p}" for p in _node_problems(schemas, node)]
    assert problems == []
    assert len(made) == 355
    bad = copy.deepcopy(next(n for n in made if n["type"] == "VRAMFit_TemporalChunkVideoDecode"))
    bad["widgets_values"][0] = 8192  # frames_per_chunk over its maximum: the check sees it
    assert _node_problems(schemas, bad) == ["frames_per_chunk: value 8192 is above the maximum 4096"]
