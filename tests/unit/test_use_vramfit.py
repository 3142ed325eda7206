"""The headless swap (scripts/use_vramfit.py) on every shipped workflow and on core graphs built from them:
pack -> core -> pack and core -> pack -> core give back the identical graph; widgets carry over by the
mapping (web/vramfit_swap.json, the browser command's too); video graphs take the video nodes. No ComfyUI."""

from __future__ import annotations

import copy
import json
import logging
import pathlib

import pytest

from scripts import use_vramfit as u
from scripts.workflows import WORKFLOWS_DIR

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = sorted(WORKFLOWS_DIR.glob("*.json")) + sorted((WORKFLOWS_DIR / "api").glob("*.json"))
M = u.load_mapping()
PACK_VAE = set(M.data["revert"])
CORE_VAE = {e["core"] for e in M.data["swap"]}


def _types(graph: dict) -> list[str]:
    if u.is_ui_format(graph):
        return [n["type"] for g in u._ui_graphs(graph) for n in g["nodes"]]
    return [n["class_type"] for n in graph.values()]


def _nodes(graph: dict) -> list[dict]:
    if u.is_ui_format(graph):
        return [n for g in u._ui_graphs(graph) for n in g["nodes"]]
    return list(graph.values())


def _strip_stash(graph: dict) -> dict:
    """``graph`` as a user's own core workflow has it: no stash left by a swap."""
    g = copy.deepcopy(graph)
    for n in _nodes(g):
        for holder in (n.get("properties"), n.get("_meta")):
            if isinstance(holder, dict):
                holder.pop(M.stash, None)
    return g


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_shipped_workflow_reverts_to_core_and_back_identically(path):
    pack = _load(path)
    assert PACK_VAE & set(_types(pack)), "every shipped workflow uses a VRAM Fit VAE node"
    core = u.swap(pack, revert=True, mapping=M)
    assert not core.skipped
    assert not PACK_VAE & set(_types(core.graph))
    assert len(core.swaps) == sum(t in PACK_VAE for t in _types(pack))
    back = u.swap(core.graph, mapping=M)
    assert back.graph == pack
    assert not any(M.stash in (n.get("properties") or n.get("_meta") or {}) for n in _nodes(back.graph))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_core_version_of_shipped_workflow_swaps_and_reverts_identically(path):
    core = _strip_stash(u.swap(_load(path), revert=True, mapping=M).graph)
    swapped = u.swap(core, mapping=M)
    assert not CORE_VAE & set(_types(swapped.graph))
    assert u.swap(swapped.graph, revert=True, mapping=M).graph == core
    # the core version of a shipped graph swaps to the same node types the pack's graph has
    assert _types(swapped.graph) == _types(_load(path))


def _core_ui(path: str = "VRAM Fit 1 - Tiled demo (CPU).json") -> dict:
    return _strip_stash(u.swap(_load(WORKFLOWS_DIR / path), revert=True, mapping=M).graph)


def _by_type(graph: dict, node_type: str) -> dict:
    return next(n for n in _nodes(graph) if n.get("type", n.get("class_type")) == node_type)


def test_tiled_core_nodes_map_tile_sizes_and_keep_core_only_widgets_for_the_way_back():
    core = _core_ui()
    dec = _by_type(core, "VAEDecode")
    dec.update(type="VAEDecodeTiled", widgets_values=[256, 32, 64, 8], title="my decode", color="#123")
    enc = _by_type(core, "VAEEncode")
    enc.update(type="VAEEncodeTiled", widgets_values=[512, 64, 64, 8])
    out = u.swap(core, mapping=M)
    new_dec = next(n for n in out.graph["nodes"] if n["id"] == dec["id"])
    new_enc = next(n for n in out.graph["nodes"] if n["id"] == enc["id"])
    assert new_dec["type"] == "VRAMFit_TiledVAEDecode"
    assert new_dec["widgets_values"] == [256, -1, 0, True, False]  # a chosen tile side stays
    assert (new_dec["title"], new_dec["color"], new_dec["pos"]) == ("my decode", "#123", dec["pos"])
    assert new_enc["widgets_values"] == [0, 0, True]  # core's default tile (512) -> auto
    kept = {s.node: s.kept for s in out.swaps}
    assert kept[str(dec["id"])] == {"overlap": 32, "temporal_size": 64, "temporal_overlap": 8}
    assert "overlap=32" in out.summary()
    assert new_dec["properties"][M.stash]["type"] == "VAEDecodeTiled"
    assert out.graph["links"] == core["links"]
    assert u.swap(out.graph, revert=True, mapping=M).graph == core


def test_a_value_changed_after_the_swap_is_carried_back():
    core = _core_ui()
    _by_type(core, "VAEDecode").update(type="VAEDecodeTiled", widgets_values=[512, 64, 64, 8])
    out = u.swap(core, mapping=M).graph
    dec = _by_type(out, "VRAMFit_TiledVAEDecode")
    assert dec["widgets_values"][0] == 0
    dec["widgets_values"][0] = 40  # the user sets a tile side on the pack node
    back = _by_type(u.swap(out, revert=True, mapping=M).graph, "VAEDecodeTiled")
    assert back["widgets_values"] == [64, 64, 64, 8]  # into core's range (min 64, step 32)


def test_video_graphs_take_the_video_nodes_and_temporal_size_becomes_latent_frames():
    core = _core_ui("VRAM Fit 3 - Video decode (CPU).json")
    assert sorted(t for t in _types(core) if t in CORE_VAE) == ["VAEDecode", "VAEEncode"]
    dec = _by_type(core, "VAEDecode")
    dec.update(type="VAEDecodeTiled", widgets_values=[512, 64, 32, 8])
    out = u.swap(core, mapping=M).graph
    assert _by_type(out, "VRAMFit_TemporalChunkVideoDecode")["widgets_values"] == [8, 0, 0, True, False]
    assert "VRAMFit_TemporalChunkVideoEncode" in _types(out)
    # the same decode in an image graph takes the image node
    image = _core_ui("VRAM Fit 2 - Image decode (CPU).json")
    assert "VRAMFit_TiledVAEDecode" in _types(u.swap(image, mapping=M).graph)


def test_video_is_told_from_downstream_too():
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "x.safetensors"}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "a.latent"}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "CreateVideo", "inputs": {"images": ["3", 0], "fps": 16}},
    }
    out = u.swap(api, mapping=M).graph
    assert out["3"]["class_type"] == "VRAMFit_TemporalChunkVideoDecode"
    del api["4"]
    assert u.swap(api, mapping=M).graph["3"]["class_type"] == "VRAMFit_TiledVAEDecode"


def test_api_titles_and_stash():
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "x.safetensors"}, "_meta": {"title": "Load VAE"}},
        "2": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": ["1", 0]},
              "_meta": {"title": "VAEEncode"}},  # the host's nodes by type, as the API twins name them
        "4": {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": ["2", 0], "vae": ["1", 0],
              "mask": ["2", 1], "grow_mask_by": 9}, "_meta": {"title": "mine"}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 0]},
              "_meta": {"title": "VAE Decode"}},  # as the frontend names it
    }
    out = u.swap(api, mapping=M).graph
    assert out["3"] == {"class_type": "VRAMFit_TiledVAEEncode", "_meta": {"title": "Tiled VAE Encode (VRAM Fit)"},
                        "inputs": {"pixels": ["2", 0], "vae": ["1", 0], "tile_size": 0, "budget_mb": 0,
                                   "unload_others": True}}
    assert out["4"]["_meta"] == {"title": "mine"}
    assert out["4"]["inputs"]["grow_mask_by"] == 9
    assert out["5"]["_meta"] == {"title": "Tiled VAE Decode (VRAM Fit)",
                                 M.stash: {"type": "VAEDecode", "widgets": {}, "title": "VAE Decode"}}
    assert u.swap(api, revert=True, mapping=M).graph == api  # nothing of VRAM Fit's to revert
    assert u.swap(out, revert=True, mapping=M).graph == api


def test_frontend_saved_ui_nodes_widget_inputs_registry_fields_and_subgraphs():
    core = _core_ui("VRAM Fit 2 - Image decode (CPU).json")
    node = _by_type(core, "VAEDecode")
    node["properties"].update(cnr_id="comfy-core", ver="0.3.75")
    node["size"] = [225, 46]  # as the frontend sizes a VAE Decode: no room for the pack node's widgets
    for entry in node["inputs"]:
        entry["localized_name"] = entry["name"]
    node["outputs"][0]["localized_name"] = "IMAGE"
    sub = {"id": "sub-1", "nodes": [copy.deepcopy(node)], "links": []}
    core["definitions"] = {"subgraphs": [sub]}
    out = u.swap(core, mapping=M)
    assert len(out.swaps) == 2
    new = _by_type(out.graph, "VRAMFit_TiledVAEDecode")
    assert "cnr_id" not in new["properties"]
    assert new["size"] == [225, 30 + 22 * 2 + 26 * 5] and new["properties"][M.stash]["size"] == [225, 46]
    assert [o["name"] for o in new["outputs"]] == ["IMAGE", "report"]
    assert out.graph["definitions"]["subgraphs"][0]["nodes"][0]["type"] == "VRAMFit_TiledVAEDecode"
    assert u.swap(out.graph, revert=True, mapping=M).graph == core


def test_nodes_a_swap_cannot_keep_are_left_and_named():
    pack = _load(WORKFLOWS_DIR / "VRAM Fit 2 - Image decode (CPU).json")
    dec = _by_type(pack, "VRAMFit_TiledVAEDecode")
    dec["outputs"][1]["links"] = [99]
    out = u.swap(pack, revert=True, mapping=M)
    assert out.swaps == [] and "report output is linked" in out.skipped[0][2]
    api = {"1": {"class_type": "VAEDecodeTiled", "inputs": {"samples": ["5", 0], "vae": ["6", 0],
           "tile_size": ["7", 0], "overlap": 64, "temporal_size": 64, "temporal_overlap": 8}}}
    out = u.swap(api, mapping=M)
    assert out.graph == api and "'tile_size' is driven by a link" in out.summary()


def test_mapping_is_consistent():
    nodes = M.data["nodes"]
    for e in M.data["swap"]:
        names = {"core": {w["name"] for w in nodes[e["core"]]["widgets"]},
                 "pack": {w["name"] for w in nodes[e["pack"]]["widgets"]}}
        assert [s for s, _ in nodes[e["core"]]["inputs"]] == [s for s, _ in nodes[e["pack"]]["inputs"]]
        assert nodes[e["core"]]["outputs"][0] == nodes[e["pack"]]["outputs"][0]
        for rule in e["widgets"]:
            assert rule["core"] in names["core"] and rule["pack"] in names["pack"]
    for pack, core in M.data["revert"].items():
        assert M.entry(core, pack) is not None
    readme = (ROOT / "README.md").read_text()
    for pack in PACK_VAE:
        assert f"`{pack}`" in readme  # the ids of README's node table (permanent)
    assert (ROOT / "web" / "js" / "vramfit_swap.js").read_text().count("vramfit_swap.json") >= 1


def test_cli_detects_the_format_writes_the_file_and_logs(tmp_path, caplog):
    src = WORKFLOWS_DIR / "api" / "vramfit_demo_cpu.json"
    out = tmp_path / "core.json"
    with caplog.at_level(logging.INFO, logger="vramfit.use_vramfit"):
        assert u.main([str(src), str(out), "--revert"]) == 0
    assert "3 node(s) swapped (API format)" in caplog.text
    assert {"VAEEncode", "VAEDecode", "VAEEncodeForInpaint"} <= set(_types(_load(out)))
    back = tmp_path / "pack.json"
    assert u.main([str(out), str(back)]) == 0
    assert _load(back) == _load(src)
    bad = tmp_path / "bad.json"
    bad.write_text('{"a": 1}')
    assert u.main([str(bad), str(tmp_path / "x.json")]) == 1
    assert not (tmp_path / "x.json").exists()
