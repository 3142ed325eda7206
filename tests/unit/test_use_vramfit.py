"""The headless swap (scripts/use_vramfit.py) on every shipped workflow and on core graphs built from them:
pack -> core -> pack and core -> pack -> core give back the identical graph; widgets carry over by the
mapping (web/vramfit_swap.json, the browser command's too); video graphs take the video nodes, seen through
subgraph boundaries. The corpus: ComfyUI's own templates (``comfyui-workflow-templates-json``, pinned), each
with a VAE node swapped and swapped back by the CLI as a user would, the revert byte-identical (issue 42).
No ComfyUI."""

from __future__ import annotations

import collections
import copy
import functools
import json
import logging
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import pytest

from scripts import use_vramfit as u
from scripts.workflows import WORKFLOWS_DIR

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHIPPED = sorted(WORKFLOWS_DIR.glob("*.json")) + sorted((WORKFLOWS_DIR / "api").glob("*.json"))
M = u.load_mapping()
PACK_VAE = set(M.data["revert"])
CORE_VAE = {e["core"] for e in M.data["swap"]}
UNMAPPED = set(M.unmapped())

TEMPLATES = "comfyui-workflow-templates-json==0.1.123"
"""ComfyUI's own templates (Comfy-Org; 644 UI-format workflows): what users decode, late 2026. The tests read
the pinned wheel, downloaded by ``pip download --no-deps`` into ``.cache/corpus`` (as scripts/fetch_comfyui.sh
takes ComfyUI), and do not install it: every host pins its own version of this package (0.33.0: 0.1.50, by
comfyui-workflow-templates 0.11.44, whose /templates route is not registered at all when a template of its
manifest is missing from the installed one, and 0.1.123 lacks 9 of them)."""
CORPUS_DIR = ROOT / ".cache" / "corpus"
log = logging.getLogger("vramfit.tests.use_vramfit")


@functools.cache
def corpus() -> dict[str, dict]:
    """``{file name: workflow}`` of the pinned template package's UI-format workflows."""
    name, version = TEMPLATES.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    wheel = next(iter(sorted(CORPUS_DIR.glob(pattern))), None)
    if wheel is None:
        CORPUS_DIR.mkdir(parents=True, exist_ok=True)
        part = pathlib.Path(tempfile.mkdtemp(prefix="download-", dir=CORPUS_DIR))  # another session may fetch too
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "-d", str(part), TEMPLATES],
                           check=True, timeout=600, capture_output=True, text=True)
        except (subprocess.SubprocessError, OSError) as e:
            pytest.fail(f"could not download {TEMPLATES} from PyPI into {CORPUS_DIR} (the swap corpus): "
                        f"{getattr(e, 'stderr', '') or e}")
        for got in part.glob(pattern):
            got.replace(CORPUS_DIR / got.name)
        shutil.rmtree(part, ignore_errors=True)
        wheel = next(iter(sorted(CORPUS_DIR.glob(pattern))))
    out = {}
    with zipfile.ZipFile(wheel) as z:
        for member in sorted(z.namelist()):
            if member.startswith(f"{name.replace('-', '_')}/templates/") and member.endswith(".json"):
                graph = json.loads(z.read(member))
                if isinstance(graph, dict) and u.is_ui_format(graph):
                    out[pathlib.PurePosixPath(member).name] = graph
    return out


def vae_corpus() -> dict[str, dict]:
    """The corpus's templates holding a VAE node (one the swap maps, or one it names as unmapped)."""
    return {k: g for k, g in corpus().items() if (CORE_VAE | UNMAPPED) & set(_types(g))}


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


def test_video_is_told_from_downstream_when_the_vae_file_is_not_seen():
    api = {
        "1": {"class_type": "SomeonesVAELoader", "inputs": {"name": "x.safetensors"}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "a.latent"}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "CreateVideo", "inputs": {"images": ["3", 0], "fps": 16}},
    }
    out = u.swap(api, mapping=M)
    assert out.graph["3"]["class_type"] == "VRAMFit_TemporalChunkVideoDecode"
    assert out.swaps[0].why == "video: into CreateVideo"
    # an image VAE's file is seen: the frames of an image (an image-to-video graph's first frame) stay an image
    seen = copy.deepcopy(api)
    seen["1"] = {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}}
    assert u.swap(seen, mapping=M).graph["3"]["class_type"] == "VRAMFit_TiledVAEDecode"
    del api["4"]
    assert u.swap(api, mapping=M).graph["3"]["class_type"] == "VRAMFit_TiledVAEDecode"


def _vae_tiled(node_id: int, link_samples: int, link_vae: int, temporal_size: int, mode: int = 0) -> dict:
    return {"id": node_id, "type": "VAEDecodeTiled", "pos": [0, 0], "size": [300, 150], "flags": {}, "order": 3,
            "mode": mode, "inputs": [{"name": "samples", "type": "LATENT", "link": link_samples},
                                     {"name": "vae", "type": "VAE", "link": link_vae}],
            "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": [], "slot_index": None}],
            "properties": {"Node name for S&R": "VAEDecodeTiled"}, "widgets_values": [512, 64, temporal_size, 8]}


def _subgraph_workflow(vae_file: str, latent_type: str = "LoadLatent", mode: int = 0) -> dict:
    """A VAE loader and a latent source outside a subgraph, a VAE Decode (Tiled) inside it (as the templates of
    late 2026 put their pipelines in subgraphs)."""
    sub_id = "5f2d1c9e-0000-4000-8000-000000000001"
    return {
        "id": "w", "revision": 0, "last_node_id": 12, "last_link_id": 4, "version": 0.4,
        "nodes": [
            {"id": 1, "type": "VAELoader", "pos": [0, 0], "size": [300, 60], "flags": {}, "order": 0, "mode": 0,
             "inputs": [], "outputs": [{"name": "VAE", "type": "VAE", "links": [2]}], "properties": {},
             "widgets_values": [vae_file]},
            {"id": 2, "type": latent_type, "pos": [0, 100], "size": [300, 60], "flags": {}, "order": 1, "mode": 0,
             "inputs": [], "outputs": [{"name": "LATENT", "type": "LATENT", "links": [1]}], "properties": {},
             "widgets_values": []},
            {"id": 3, "type": sub_id, "pos": [400, 0], "size": [300, 80], "flags": {}, "order": 2, "mode": 0,
             "inputs": [{"name": "samples", "type": "LATENT", "link": 1}, {"name": "vae", "type": "VAE", "link": 2}],
             "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": []}], "properties": {}, "widgets_values": []},
        ],
        "links": [[1, 2, 0, 3, 0, "LATENT"], [2, 1, 0, 3, 1, "VAE"]],
        "groups": [], "config": {}, "extra": {},
        "definitions": {"subgraphs": [{
            "id": sub_id, "version": 1, "state": {}, "revision": 0, "config": {}, "name": "decode",
            "inputNode": {"id": -10, "bounding": [0, 0, 120, 80]},
            "outputNode": {"id": -20, "bounding": [900, 0, 120, 60]},
            "inputs": [{"id": "i0", "name": "samples", "type": "LATENT", "linkIds": [3]},
                       {"id": "i1", "name": "vae", "type": "VAE", "linkIds": [4]}],
            "outputs": [{"id": "o0", "name": "IMAGE", "type": "IMAGE", "linkIds": []}], "widgets": [],
            "nodes": [_vae_tiled(12, 3, 4, 4096, mode)],
            "links": [{"id": 3, "origin_id": -10, "origin_slot": 0, "target_id": 12, "target_slot": 0,
                       "type": "LATENT"},
                      {"id": 4, "origin_id": -10, "origin_slot": 1, "target_id": 12, "target_slot": 1, "type": "VAE"}],
            "groups": [], "extra": {},
        }]},
    }


@pytest.mark.parametrize("mode", [0, 4], ids=["active", "bypassed"])
@pytest.mark.parametrize(("vae_file", "latent", "why", "frames"), [
    ("Wan2_1_VAE_bf16.safetensors", "LoadLatent", "video: VAE Wan2_1_VAE_bf16.safetensors", 1024),
    ("my_vae.safetensors", "WanInfiniteTalkToVideo", "video: from WanInfiniteTalkToVideo", 1024),
    ("my_vae.safetensors", "EmptyHunyuanVideo15Latent", "video: from EmptyHunyuanVideo15Latent", 1024),
    ("ltx-2.5-video-vae-bf16.safetensors", "LoadLatent", "video: VAE ltx-2.5-video-vae-bf16.safetensors", 512),
    ("my_vae.safetensors", "EmptyLTXVLatentVideo", "video: from EmptyLTXVLatentVideo", 512),
    ("ae.safetensors", "LoadLatent", "", None),
])  # fmt: skip
def test_video_is_seen_through_subgraph_boundaries_and_temporal_size_by_the_vaes_compression(
        vae_file, latent, why, frames, mode):
    core = _subgraph_workflow(vae_file, latent, mode)
    out = u.swap(core, mapping=M)
    node = out.graph["definitions"]["subgraphs"][0]["nodes"][0]
    assert [(s.node, s.why) for s in out.swaps] == [("12", why)]
    if frames is None:
        assert node["type"] == "VRAMFit_TiledVAEDecode"
    else:  # core's temporal_size 4096 output frames: 4096 / 4 (Wan, HunyuanVideo) or / 8 (LTX) latent frames
        assert node["type"] == "VRAMFit_TemporalChunkVideoDecode"
        assert node["widgets_values"][:2] == [frames, 0]
    assert node["mode"] == mode
    assert u.swap(out.graph, revert=True, mapping=M).graph == core


def test_the_way_back_keeps_absent_keys_absent_null_slots_null_and_property_order():
    core = _subgraph_workflow("ae.safetensors")
    node = core["definitions"]["subgraphs"][0]["nodes"][0]
    node.update(type="VAEDecode", properties={"ue_properties": {"version": "7.7"}, "cnr_id": "comfy-core",
                                              "ver": "0.3.40", "Node name for S&R": "VAEDecode"})
    del node["widgets_values"]  # as older frontends saved a widget-less node
    out = u.swap(core, mapping=M)
    swapped = out.graph["definitions"]["subgraphs"][0]["nodes"][0]
    assert swapped["outputs"][0]["slot_index"] is None
    assert [o.get("slot_index", "-") for o in swapped["outputs"]] == [None, 1]
    back = u.swap(json.loads(json.dumps(out.graph)), revert=True, mapping=M).graph
    assert json.dumps(back) == json.dumps(core)


def test_unmapped_vae_nodes_are_counted_and_said_why(tmp_path, caplog):
    api = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "x.safetensors"}},
        "2": {"class_type": "LoadAudio", "inputs": {"audio": "a.wav"}},
        "3": {"class_type": "VAEEncodeAudio", "inputs": {"audio": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
        "5": {"class_type": "VAEDecodeAudio", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
        "6": {"class_type": "VAEDecodeHunyuan3D", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
    }
    src, dst = tmp_path / "audio.json", tmp_path / "out.json"
    src.write_text(json.dumps(api))
    with caplog.at_level(logging.INFO, logger="vramfit.use_vramfit"):
        assert u.main([str(src), str(dst)]) == 0
    assert json.loads(dst.read_text()) == api
    assert "2 VAEDecodeAudio node(s) left as they are (no VRAM Fit counterpart): audio VAE" in caplog.text
    assert "1 VAEEncodeAudio node(s) left" in caplog.text
    assert "1 VAEDecodeHunyuan3D node(s) left as they are (no VRAM Fit counterpart): 3-D mesh VAE" in caplog.text
    assert all(why for why in M.unmapped().values())


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


# ------------------------------------------------------------------------------------ the template corpus


def _graphs(workflow: dict) -> dict:
    return {u._ui_graph_id(workflow, g): g for g in u._ui_graphs(workflow)}


def test_template_corpus_swaps_and_swaps_back_identically_by_the_cli(tmp_path, caplog):
    """Every template of the corpus with a VAE node, through ``python -m scripts.use_vramfit`` and back with
    ``--revert``: exit 0, every core VAE node swapped, no node id, link, group or subgraph slot lost or moved, the
    swapped nodes keep their links, the unmapped VAE nodes are named in the log with why, and the file written
    back is the original (the same JSON text once loaded: absent keys absent, key order kept). The counts go to
    the log and to outputs/swap_corpus.json."""
    templates = vae_corpus()
    swapped_by = collections.Counter()
    left = collections.Counter()
    video_why = collections.Counter()
    in_subgraphs = templates_swapped = 0
    src, mid, back = tmp_path / "in.json", tmp_path / "vramfit.json", tmp_path / "back.json"
    for name, graph in templates.items():
        src.write_text(json.dumps(graph))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vramfit.use_vramfit"):
            assert u.main([str(src), str(mid)]) == 0, name
            swap_log = caplog.text
            assert u.main([str(mid), str(back), "--revert"]) == 0, name
        swapped = json.loads(mid.read_text())
        assert json.dumps(json.loads(back.read_text())) == json.dumps(graph), name
        outcome = u.swap(graph, mapping=M)
        assert swapped == outcome.graph and not outcome.skipped, name
        templates_swapped += bool(outcome.swaps)
        assert not CORE_VAE & set(_types(swapped)), name
        assert len(outcome.swaps) == sum(t in CORE_VAE for t in _types(graph)), name
        assert f"{len(outcome.swaps)} node(s) swapped (UI format)" in swap_log, name
        before, after = _graphs(graph), _graphs(swapped)
        assert before.keys() == after.keys(), name
        for gid, g in before.items():
            h = after[gid]
            assert [n["id"] for n in g["nodes"]] == [n["id"] for n in h["nodes"]], (name, gid)
            for key in ("links", "groups", "inputs", "outputs", "widgets"):
                assert g.get(key) == h.get(key), (name, gid, key)
            for old, new in zip(g["nodes"], h["nodes"], strict=True):
                if old["type"] not in CORE_VAE:
                    assert old == new, (name, gid, old["id"])
                    continue
                in_subgraphs += gid is not None
                sockets = len(M.spec(old["type"])["inputs"])
                assert [i.get("link") for i in new["inputs"][:sockets]] == [i.get("link") for i in old["inputs"][:sockets]]
                assert new["outputs"][0].get("links") == old["outputs"][0].get("links")
                assert new["mode"] == old.get("mode") and new["pos"] == old["pos"]
        for t, (count, why) in outcome.left().items():
            assert f"{count} {t} node(s) left as they are (no VRAM Fit counterpart): {why}" in swap_log, name
            left[t] += count
        for s in outcome.swaps:
            swapped_by[f"{s.old} -> {s.new}"] += 1
            if s.why:
                video_why[s.why.split(" ")[1]] += 1
    counts = {
        "package": TEMPLATES, "templates": len(corpus()), "templates with a VAE node": len(templates),
        "templates swapped": templates_swapped,
        "nodes swapped": sum(swapped_by.values()), "inside subgraph definitions": in_subgraphs,
        "swaps": dict(sorted(swapped_by.items())), "video nodes by": dict(sorted(video_why.items())),
        "left": {t: [n, M.unmapped()[t]] for t, n in sorted(left.items())},
    }
    log.info("swap corpus: %s", json.dumps(counts, indent=1))
    (ROOT / "outputs").mkdir(exist_ok=True)
    (ROOT / "outputs" / "swap_corpus.json").write_text(json.dumps(counts, indent=1) + "\n")
    # the pinned package's figures (issue 42): a change in the swap or the mapping shows here
    assert (counts["templates"], counts["templates with a VAE node"], counts["templates swapped"]) == (644, 241, 218)
    assert (counts["nodes swapped"], counts["inside subgraph definitions"]) == (355, 269)
    assert sum(n for k, n in swapped_by.items() if "Temporal" in k) == 121
    assert {t: n for t, (n, _) in counts["left"].items()} == {
        "LTXVAudioVAEDecode": 21, "LTXVAudioVAEEncode": 2, "VAEDecodeAudio": 25, "VAEDecodeAudioTiled": 1,
        "VAEDecodeHunyuan3D": 4, "VAEDecodeTripoSplat": 1, "VAEEncodeAudio": 1, "VaeDecodeShapeTrellis": 2,
        "VaeDecodeStructureTrellis2": 2, "VaeDecodeTextureTrellis": 2,
    }  # fmt: skip


def test_every_vae_node_type_of_the_corpus_is_mapped_or_named():
    """A VAE decode or encode of the corpus the mapping neither swaps nor names as unmapped (with why) would be
    left without a word."""
    types = {t for g in corpus().values() for t in _types(g) if isinstance(t, str)}
    vae_like = {t for t in types if "vae" in t.lower() and ("decode" in t.lower() or "encode" in t.lower())}
    assert vae_like - CORE_VAE - UNMAPPED == set()


def _swapped_node(name: str, node_id: int) -> tuple[dict, u.Swap]:
    out = u.swap(corpus()[name], mapping=M)
    node = next(n for g in u._ui_graphs(out.graph) for n in g["nodes"] if n["id"] == node_id)
    return node, next(s for s in out.swaps if s.node == str(node_id))


def test_the_issues_templates_take_the_video_nodes():
    """Issue 42: the InfiniteTalk decodes (inside subgraphs, their latent from WanInfiniteTalkToVideo), the
    bypassed tiled decode of HunyuanVideo 1.5 (its latent from EmptyHunyuanVideo15Latent), and LTX's
    temporal_size 4096 as 4096 / 8 latent frames."""
    for node_id in (119, 310):
        node, s = _swapped_node("video_wan2_1_infinitetalk.json", node_id)
        assert node["type"] == "VRAMFit_TemporalChunkVideoDecode" and "Wan2_1_VAE" in s.why
    node, _ = _swapped_node("video_hunyuan_video_1.5_720p_t2v.json", 120)
    assert (node["type"], node["mode"]) == ("VRAMFit_TemporalChunkVideoDecode", 4)
    node, s = _swapped_node("video_ltx2_depth_to_video.json", 186)
    assert node["widgets_values"][0] == 512 and "ltx-2" in s.why
    node, _ = _swapped_node("video_hunyuan_video_1.5_720p_t2v.json", 112)  # temporal_size 64: core's default
    assert node["widgets_values"][0] == 0


_KINDS_JS = """
import fs from "node:fs";
const [js, mappingPath, dir, out] = process.argv.slice(2);
const src = fs.readFileSync(js, "utf8").replace(/^import \\{ app \\} from .*$/m, "const app = {registerExtension() {}};");
fs.writeFileSync(out + ".mjs", src + "\\nexport { flowOf, kindOf, keyOf };\\n");
const mod = await import(out + ".mjs");
const m = JSON.parse(fs.readFileSync(mappingPath, "utf8"));
const types = new Set([...m.swap.map((e) => e.core), ...Object.keys(m.revert)]);
const kinds = {};
for (const f of fs.readdirSync(dir).sort()) {
  const g = JSON.parse(fs.readFileSync(`${dir}/${f}`, "utf8"));
  const flow = mod.flowOf(g);
  for (const [gid, graph] of [[null, g], ...(g.definitions?.subgraphs ?? []).map((s) => [s.id, s])]) {
    for (const n of graph.nodes ?? []) {
      if (!types.has(n.type)) continue;
      const k = mod.kindOf(m, flow, mod.keyOf(gid, String(n.id)), n.type);
      kinds[`${f}|${gid}|${n.id}`] = [k.kind, k.temporal, k.why];
    }
  }
}
fs.writeFileSync(out, JSON.stringify(kinds));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node.js here: tests/browser/test_swap.py runs the command")
def test_the_canvas_command_chooses_as_the_script_over_the_corpus(tmp_path):
    """web/js/vramfit_swap.js's video choice (flowOf, kindOf: run by Node.js on the same JSON) is the script's,
    node for node, over every VAE node of the corpus (both read web/vramfit_swap.json)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    expected = {}
    for name, graph in vae_corpus().items():
        (folder / name).write_text(json.dumps(graph))
        flow = u.ui_flow(graph)
        for gid, g in _graphs(graph).items():
            for n in g["nodes"]:
                if n["type"] in CORE_VAE | PACK_VAE:
                    k = u.kind_of(M, flow, (gid, str(n["id"])), n["type"])
                    expected[f"{name}|{'null' if gid is None else gid}|{n['id']}"] = [k.kind, k.temporal_compression,
                                                                                       k.why]
    harness, out = tmp_path / "kinds.mjs", tmp_path / "kinds.json"
    harness.write_text(_KINDS_JS)
    subprocess.run(["node", str(harness), str(ROOT / "web" / "js" / "vramfit_swap.js"), str(u.MAPPING_PATH),
                    str(folder), str(out)], check=True, timeout=300)
    got = json.loads(out.read_text())
    assert len(expected) == 355
    assert {k: v for k, v in got.items() if expected.get(k) != v} == {}
    assert got.keys() == expected.keys()
