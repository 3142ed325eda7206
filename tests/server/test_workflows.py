"""The example workflows (issues 7 and 13) against a real ComfyUI: built from one description, valid against
the live /object_info, served as templates under readable names, laid out so that nothing overlaps after a
run and opening with the whole graph in view, and the CPU variants run headless end to end on what a fresh
install has (the fixture VAEs and ComfyUI's own input/example.png)."""

from __future__ import annotations

import copy
import json
import pathlib
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest

from scripts.host import ROOT, output_files
from scripts.workflow_desc import WorkflowDesc
from scripts.workflow_graphs import CPU_TEMPLATES, CPU_WORKFLOWS, DEMO_BUDGET_MB, all_workflows
from scripts.workflow_schema import Schemas, ui_to_api
from scripts.workflow_validate import validate_workflow
from scripts.workflows import (
    API_DIR,
    SHIPPED_INPUTS,
    TEMPLATE_NAME,
    VIEW_SAFE,
    WORKFLOWS_DIR,
    build,
    check_all,
    committed_workflows,
    copy_shipped_inputs,
    layout_problems,
)

pytestmark = pytest.mark.server

DESCS = {d.name: d for d in all_workflows()}
NAMES = list(DESCS)
TEMPLATES = [d.template_name for d in DESCS.values()]
CARD_TITLE_CHARS = 31
"""A card's title is one line: at 1280x720 (three cards a row) 1.32.9 shows 31 characters before the ellipsis."""


@pytest.fixture(scope="module")
def shipped_inputs(server, host_config):
    """The server's input folder as on a fresh install: the files ComfyUI ships in its own input/."""
    return [p.name for p in copy_shipped_inputs(host_config.comfyui_path, server.input_dir)]


@pytest.fixture(scope="module")
def schemas(client, shipped_inputs):
    """The live /object_info (read after the shipped inputs are in the input folder) and the declarations."""
    return Schemas(client.object_info())


def _load(name: str) -> tuple[dict, dict]:
    """The UI workflow (``workflows/<template>.json``) and the API twin of workflow ``name``."""
    ui_path = WORKFLOWS_DIR / f"{DESCS[name].template_name}.json"
    return json.loads(ui_path.read_text()), json.loads((API_DIR / f"{name}.json").read_text())


def _reports(entry: dict) -> str:
    return "\n".join(t for out in entry["outputs"].values() for t in out.get("text", []) or [] if isinstance(t, str))


# ------------------------------------------------------------------------------ files and build


def test_committed_files_are_the_builder_output(schemas):
    """UI, API twin, README and thumbnails equal a fresh build: the UI and API can never drift."""
    assert check_all(schemas) == []


def test_every_workflow_has_ui_api_thumbnail_and_readme_entry():
    readme = (WORKFLOWS_DIR / "README.md").read_text()
    assert sorted(p.stem for p in WORKFLOWS_DIR.glob("*.json")) == sorted(TEMPLATES)
    assert sorted(p.stem for p in API_DIR.glob("*.json")) == sorted(NAMES)
    for name, desc in DESCS.items():
        thumb = WORKFLOWS_DIR / f"{desc.template_name}.jpg"
        assert thumb.read_bytes()[:3] == b"\xff\xd8\xff" and thumb.stat().st_size <= 60_000, thumb
        assert f"`{name}`" in readme and f"**{desc.template_name}**" in readme
        ui, _ = _load(name)
        assert ui["version"] == 0.4 and any(n["type"] == "MarkdownNote" for n in ui["nodes"])
        assert ui["extra"]["vramfit"]["name"] == name and ui["extra"]["vramfit"]["template"] == desc.template_name


def test_template_names_read_as_card_titles_in_order():
    """Both frontends title a custom-node template's card with its file name and sort cards alphabetically by
    it on request: readable, safe names, numbered in the order of all_workflows(), CPU variants first (an
    alphabetical sort puts 10 after 1: the numbers are in the titles)."""
    assert all(TEMPLATE_NAME.fullmatch(t) and len(t) <= CARD_TITLE_CHARS for t in TEMPLATES), TEMPLATES
    assert all(t != d.name and not t.startswith("vramfit_") for t, d in zip(TEMPLATES, DESCS.values(), strict=True))
    number = lambda t: int(t.split(" - ")[0].rsplit(" ", 1)[1])  # noqa: E731  (10 after 9, not after 1)
    assert sorted(TEMPLATES, key=number) == TEMPLATES and len(set(TEMPLATES)) == len(TEMPLATES)
    assert [t.split(" - ")[0] for t in TEMPLATES] == [f"VRAM Fit {i}" for i in range(1, len(TEMPLATES) + 1)]
    cpu = [DESCS[n].cpu for n in NAMES]
    assert cpu == sorted(cpu, reverse=True) and set(CPU_WORKFLOWS) == {n for n in NAMES if DESCS[n].cpu}
    assert CPU_TEMPLATES == tuple(DESCS[n].template_name for n in CPU_WORKFLOWS)


def test_cpu_templates_need_no_input_file_a_script_writes(host_config):
    """On a fresh install the CPU templates find every input file they load: ComfyUI ships it in input/.
    (Their models are the random-weight fixtures; no LoadLatent of a latent only the demo script writes.)"""
    from scripts.fixtures.kinds import FIXTURES

    fixtures = {f.filename for f in FIXTURES.values()}
    input_widgets = {"LoadImage": "image", "LoadLatent": "latent"}
    for name in CPU_WORKFLOWS:
        desc = DESCS[name]
        for f in desc.files:
            if f.directory == "input":
                assert f.name in SHIPPED_INPUTS and (host_config.comfyui_path / "input" / f.name).is_file(), (name, f)
            else:
                assert f.name in fixtures, (name, f)
        _, api = _load(name)
        loaded = [n["inputs"][input_widgets[n["class_type"]]] for n in api.values() if n["class_type"] in input_widgets]
        assert all(value in SHIPPED_INPUTS for value in loaded), (name, loaded)


def _chain(ui: dict, *types: str) -> bool:
    """Whether nodes of these types follow each other along links, in this order."""
    nodes = {n["id"]: n["type"] for n in ui["nodes"]}
    edges = {(link[1], link[3]) for link in ui["links"]}
    starts = [i for i, t in nodes.items() if t == types[0]]
    for start in starts:
        cur, ok = start, True
        for t in types[1:]:
            nxt = [d for (s, d) in edges if s == cur and nodes[d] == t]
            if not nxt:
                ok = False
                break
            cur = nxt[0]
        if ok:
            return True
    return False


def test_workflows_have_the_graphs_the_issue_asks_for():
    for res, (w, h) in {"480p": (832, 480), "720p": (1280, 720)}.items():
        ui, api = _load(f"vramfit_wan21_t2v_1_3b_{res}")
        assert _chain(ui, "KSampler", "VRAMFit_OffloadManager", "VRAMFit_TemporalChunkVideoDecode",
                      "VRAMFit_VRAMMonitor", "CreateVideo", "SaveVideo")  # fmt: skip
        latent = next(n["inputs"] for n in api.values() if n["class_type"] == "EmptyHunyuanLatentVideo")
        assert (latent["width"], latent["height"], latent["length"]) == (w, h, 81)
        shift = next(n["inputs"]["shift"] for n in api.values() if n["class_type"] == "ModelSamplingSD3")
        assert shift == 8.0
    ui, api = _load("vramfit_sana_1600m_2048_batch2")
    assert _chain(ui, "KSampler", "VRAMFit_OffloadManager", "VRAMFit_TiledVAEDecode")
    assert next(n["inputs"]["batch_size"] for n in api.values() if n["class_type"] == "EmptySanaLatentImage") == 2
    assert next(n["inputs"]["model"] for n in api.values() if n["class_type"] == "SanaResolutionSelect") == "2K"
    ui, api = _load("vramfit_infiniteyou_flux")
    types = {n["class_type"] for n in api.values()}
    assert {"VRAMFit_Bf16Loader", "InfuseNetApply", "ExtractIDEmbedding"} <= types
    assert _chain(ui, "VRAMFit_Bf16Loader", "KSampler", "VRAMFit_OffloadManager", "VRAMFit_TiledVAEDecode")
    ui, api = _load("vramfit_8k_decode_sdxl_vae")
    assert next(n["inputs"]["scale_by"] for n in api.values() if n["class_type"] == "LatentUpscaleBy") * 1024 == 8192
    assert _chain(ui, "LatentUpscaleBy", "VRAMFit_OffloadManager", "VRAMFit_VRAMMonitor", "VRAMFit_TiledVAEDecode")
    ui, api = _load("vramfit_demo_cpu")
    assert _chain(ui, "LoadImage", "ImageScale", "VRAMFit_TiledVAEEncode", "VRAMFit_VRAMMonitor",
                  "VRAMFit_OffloadManager", "VRAMFit_TiledVAEDecode", "VRAMFit_VRAMMonitor", "SaveImage")  # fmt: skip
    decode = next(n["inputs"] for n in api.values() if n["class_type"] == "VRAMFit_TiledVAEDecode")
    assert decode["budget_mb"] == DEMO_BUDGET_MB > 0 and decode["tile_size"] == 0  # tiles sized to that budget
    ui, api = _load("vramfit_img2img_4k_sdxl")
    assert _chain(ui, "LoadImage", "ImageScale", "VRAMFit_TiledVAEEncode", "KSampler", "VRAMFit_OffloadManager",
                  "VRAMFit_TiledVAEDecode")
    scale = next(n["inputs"] for n in api.values() if n["class_type"] == "ImageScale")
    assert (scale["width"], scale["height"]) == (4096, 4096)
    ui, api = _load("vramfit_wan21_v2v_480p")
    assert _chain(ui, "LoadVideo", "GetVideoComponents", "ImageFromBatch", "ImageScale",
                  "VRAMFit_TemporalChunkVideoEncode", "KSampler", "VRAMFit_OffloadManager",
                  "VRAMFit_TemporalChunkVideoDecode", "VRAMFit_VRAMMonitor", "CreateVideo", "SaveVideo")  # fmt: skip
    assert next(n["inputs"]["denoise"] for n in api.values() if n["class_type"] == "KSampler") < 1
    cpu_types = set()
    for name in CPU_WORKFLOWS:
        cpu_types |= {n["class_type"] for n in _load(name)[1].values()}
    assert {t for t in cpu_types if t.startswith("VRAMFit_")} == {
        "VRAMFit_TiledVAEDecode", "VRAMFit_TiledVAEEncode", "VRAMFit_TemporalChunkVideoDecode",
        "VRAMFit_TemporalChunkVideoEncode", "VRAMFit_VAEEncodeForInpaint", "VRAMFit_OffloadManager",
        "VRAMFit_Bf16Loader", "VRAMFit_VRAMMonitor",
    }  # fmt: skip


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("name", NAMES)
def test_workflow_is_valid_against_object_info(name, schemas):
    ui, api = _load(name)
    assert validate_workflow(name, ui, api, schemas) == []


def test_committed_workflows_listing_matches(schemas):
    committed = list(committed_workflows())
    assert sorted(name for name, _, api in committed if api is not None) == sorted(NAMES)
    problems = [p for name, ui, api in committed for p in validate_workflow(name, ui, api, schemas)]
    assert problems == []


# ------------------------------------------------------------------------------ layout and view


def test_layout_leaves_room_for_previews_and_opens_on_the_whole_graph():
    for name in NAMES:
        assert layout_problems(name, _load(name)[0]) == []


def _by_title(ui: dict, title: str) -> dict:
    return next(n for n in ui["nodes"] if n.get("title") == title)


def test_layout_check_finds_a_covered_preview_and_a_view_under_the_toolbars():
    """The layout issue 13 reported: the timeline's SaveImage right below the image's SaveImage, whose
    preview then covers it, and the view [0, 0] at 0.75, which puts titles under the top bar."""
    ui, _ = _load("vramfit_demo_cpu")
    save = next(n for n in ui["nodes"] if n["type"] == "SaveImage" and "title" not in n)
    timeline = _by_title(ui, "Save VRAM timeline")
    timeline["pos"] = [save["pos"][0], save["pos"][1] + save["size"][1] + 50]
    problems = layout_problems("demo", ui)
    assert problems == [f"demo: node {save['id']} (SaveImage) and node {timeline['id']} (SaveImage) overlap "
                        "(with the room below each for previews and reports)"]  # fmt: skip
    ui, _ = _load("vramfit_demo_cpu")
    ui["extra"]["ds"] = {"scale": 0.75, "offset": [0, 0]}
    problems = layout_problems("demo", ui)
    note = _by_title(ui, "Read me: models and folders")
    assert any(p.startswith(f"demo: node {note['id']} (MarkdownNote) is at (30, 22)-") for p in problems), problems
    assert all(str(VIEW_SAFE) in p for p in problems)


def _node(ui: dict, node_type: str) -> dict:
    return next(n for n in ui["nodes"] if n["type"] == node_type)


def test_validator_rejects_a_wrong_link_type(schemas):
    ui, api = _load("vramfit_wan21_t2v_1_3b_480p")
    # feed the CLIP loader's output into the sampler's latent_image (LATENT)
    clip = _node(ui, "CLIPLoader")
    sampler = _node(ui, "KSampler")
    slot = next(i for i, e in enumerate(sampler["inputs"]) if e["name"] == "latent_image")
    link_id = sampler["inputs"][slot]["link"]
    link = next(lk for lk in ui["links"] if lk[0] == link_id)
    link[1], link[2] = clip["id"], 0
    clip["outputs"][0]["links"].append(link_id)
    api[str(sampler["id"])]["inputs"]["latent_image"] = [str(clip["id"]), 0]
    errors = validate_workflow("wan480", ui, api, schemas)
    expected = f"wan480: node {sampler['id']} (KSampler): input 'latent_image' (LATENT) is linked to output 0 of node {clip['id']} (CLIPLoader), of type 'CLIP'"
    assert expected in errors
    assert any(e.startswith("wan480 (API):") and "'latent_image' (LATENT)" in e and "'CLIP'" in e for e in errors)


def test_validator_rejects_an_out_of_range_widget(schemas):
    ui, api = _load("vramfit_video_cpu")
    node = _node(ui, "EmptyHunyuanLatentVideo")
    node["widgets_values"][2] = 100000  # length: max 16384
    errors = validate_workflow("video_cpu", ui, None, schemas)
    assert errors == [f"video_cpu: node {node['id']} (EmptyHunyuanLatentVideo): input 'length': value 100000 is above the maximum 16384"]
    decode = _node(ui, "VRAMFit_TemporalChunkVideoDecode")
    decode_api = api[str(decode["id"])]["inputs"]
    decode_api["frames_per_chunk"] = -1
    errors = validate_workflow("video_cpu", *_load("vramfit_video_cpu")[:1], api, schemas)
    assert f"video_cpu (API): node {decode['id']} (VRAMFit_TemporalChunkVideoDecode): input 'frames_per_chunk': value -1 is below the minimum 0" in errors


def test_validator_rejects_bad_combo_and_control_values(schemas):
    ui, _ = _load("vramfit_wan21_t2v_1_3b_720p")
    sampler = _node(ui, "KSampler")
    sampler["widgets_values"][1] = "sometimes"  # control_after_generate
    sampler["widgets_values"][4] = "euler_magic"  # sampler_name
    errors = validate_workflow("wan720", ui, None, schemas)
    assert any(f"node {sampler['id']} (KSampler): input 'seed': control_after_generate value 'sometimes'" in e for e in errors)
    assert any(f"node {sampler['id']} (KSampler): input 'sampler_name': value 'euler_magic' is not one of" in e for e in errors)
    del sampler["widgets_values"][1]  # a seed widget without its control value shifts every later widget
    assert any("widgets_values has 6 values, the node's widgets take 7" in e for e in validate_workflow("wan720", ui, None, schemas))


def test_validator_rejects_an_undeclared_node_type(schemas):
    ui, api = _load("vramfit_image_cpu")
    node = _node(ui, "VRAMFit_TiledVAEDecode")
    node["type"] = "MysteryDecode"
    api[str(node["id"])]["class_type"] = "MysteryDecode"
    errors = validate_workflow("image_cpu", ui, api, schemas)
    msg = "node type 'MysteryDecode' is not on the host (/object_info) and not declared as a third-party node"
    assert f"image_cpu: node {node['id']} (MysteryDecode): {msg}" in errors
    assert f"image_cpu (API): node {node['id']} (MysteryDecode): {msg}" in errors


def test_validator_requires_third_party_packs_and_model_files_declared(schemas):
    ui, api = _load("vramfit_sana_1600m_2048_batch2")
    ui["extra"]["vramfit"]["custom_node_packs"] = []
    errors = validate_workflow("sana", ui, api, schemas)
    assert any("(SanaCheckpointLoader): node type 'SanaCheckpointLoader' belongs to the third-party pack" in e for e in errors)
    ui, api = _load("vramfit_infiniteyou_flux")
    ui["extra"]["vramfit"]["files"] = [f for f in ui["extra"]["vramfit"]["files"] if f["name"] != "ae.safetensors"]
    vae = _node(ui, "VAELoader")
    errors = validate_workflow("infu", ui, None, schemas)
    assert errors == [f"infu: node {vae['id']} (VAELoader): input 'vae_name': file 'ae.safetensors' is neither on the host nor declared in the workflow's files with directory 'vae'"]
    ui, _ = _load("vramfit_infiniteyou_flux")
    loader = _node(ui, "VRAMFit_Bf16Loader")
    loader["widgets_values"][0] = "loras/flux1-dev.safetensors"
    assert any("input 'model': value 'loras/flux1-dev.safetensors' is not 'folder/file'" in e for e in validate_workflow("infu", ui, None, schemas))


def test_validator_rejects_an_api_twin_that_drifted(schemas):
    ui, api = _load("vramfit_demo_cpu")
    decode = next(k for k, v in api.items() if v["class_type"] == "VRAMFit_TiledVAEDecode")
    api[decode]["inputs"]["tile_size"] = 512
    errors = validate_workflow("demo", ui, api, schemas)
    assert len(errors) == 1 and errors[0].startswith(f"demo: node {decode}: the API twin"), errors
    assert "'tile_size': 512" in errors[0]


# ------------------------------------------------------------------------------ 0.33 schema shapes
# A synthetic /object_info with the shapes ComfyUI 0.33 introduced, so that both hosts test them: a dynamic
# combo with nested options and a hidden top-level twin of a nested input (SaveVideo.format/codec), a
# trailing optional widget (CreateVideo.bit_depth) and an output node with an output (SaveImage).


def _codec(hidden: bool = False) -> list:
    options = [{"key": "auto", "inputs": {"required": {}}},
               {"key": "h264", "inputs": {"required": {"crf": ["FLOAT", {"default": 23.0, "min": 0.0, "max": 51.0}]}}}]
    return ["COMFY_DYNAMICCOMBO_V3", {"options": options, **({"hidden": True} if hidden else {})}]  # fmt: skip


SYNTHETIC = {
    "Maker": {
        "input": {"required": {"fps": ["FLOAT", {"default": 30.0, "min": 1.0, "max": 120.0}]},
                  "optional": {"bit_depth": ["INT", {"default": 8, "min": 8, "max": 10, "step": 2}]}},
        "input_order": {"required": ["fps"], "optional": ["bit_depth"]},
        "output": ["VIDEO"], "output_name": ["VIDEO"], "output_node": False, "display_name": "Make",
    },
    "Saver": {
        "input": {"required": {"video": ["VIDEO", {}], "filename_prefix": ["STRING", {"default": "video/x"}],
                               "format": ["COMFY_DYNAMICCOMBO_V3", {"options": [
                                   {"key": "auto", "inputs": {"required": {"codec": _codec()}}},
                                   {"key": "webm", "inputs": {"required": {}}}]}]},
                  "optional": {"codec": _codec(hidden=True)}},
        "input_order": {"required": ["video", "filename_prefix", "format"], "optional": ["codec"]},
        "output": ["VIDEO"], "output_name": ["video"], "output_node": True, "display_name": "Save",
    },
}  # fmt: skip


def _synthetic_workflow(**saver: object) -> tuple[Schemas, dict, dict]:
    desc = WorkflowDesc(name="synthetic", title="t", summary="s")
    maker = desc.add("Maker", fps=16.0)
    desc.add("Saver", video=maker.out(), **saver)
    schemas = Schemas(SYNTHETIC)
    ui, api = build(desc, schemas)
    return schemas, ui, api


def test_builder_writes_what_every_host_accepts():
    schemas, ui, api = _synthetic_workflow(format="auto", codec="h264", **{"codec.crf": 18.0})
    maker, saver = ui["nodes"][0], ui["nodes"][1]
    assert maker["widgets_values"] == [16.0]  # bit_depth (optional, not set) left to its default
    assert saver["widgets_values"] == ["video/x", "auto", "h264", 18.0]  # format, then its option's inputs
    assert saver["outputs"] == []  # an output node's unlinked outputs are not listed
    assert [i["name"] for i in saver["inputs"]] == ["video"]  # the hidden codec has no socket or widget
    assert api["1"]["inputs"] == {"fps": 16.0}
    # nested inputs under the keys every host accepts: format.codec -> the hidden top-level codec
    assert api["2"]["inputs"] == {"video": ["1", 0], "filename_prefix": "video/x", "format": "auto", "codec": "h264",
                                  "codec.crf": 18.0}  # fmt: skip
    assert validate_workflow("synthetic", ui, api, schemas) == []


def test_validator_follows_dynamic_combo_options():
    schemas, ui, api = _synthetic_workflow(format="auto", codec="auto")
    saver = ui["nodes"][1]
    assert saver["widgets_values"] == ["video/x", "auto", "auto"]
    saver["widgets_values"] = ["video/x", "webm"]  # an option without inputs
    assert validate_workflow("s", ui, None, schemas) == []
    saver["widgets_values"] = ["video/x", "auto", "h264"]  # h264 needs crf
    assert validate_workflow("s", ui, None, schemas) == [
        "s: node 2 (Saver): widgets_values has 3 values, the node's widgets take 4"]
    saver["widgets_values"] = ["video/x", "auto", "h264", 99.0]
    assert validate_workflow("s", ui, None, schemas) == [
        "s: node 2 (Saver): input 'format.codec.crf': value 99.0 is above the maximum 51.0"]
    saver["widgets_values"] = ["video/x", "avi"]
    errors = validate_workflow("s", ui, None, schemas)
    assert errors == ["s: node 2 (Saver): input 'format': value 'avi' is not one of the options ['auto', 'webm']"]
    # the API twin: h264 requires crf, under its own key or the one every host accepts
    saver["widgets_values"] = ["video/x", "auto", "auto"]
    api["2"]["inputs"]["codec"] = "h264"
    errors = validate_workflow("s", ui, api, schemas)
    assert errors == ["s (API): node 2 (Saver): required input 'format.codec.crf' is missing"]
    api["2"]["inputs"] |= {"format.codec.crf": 20.0, "mystery": 1}
    errors = validate_workflow("s", ui, api, schemas)
    assert errors == ["s (API): node 2 (Saver): input 'mystery' is not an input of Saver"]


def test_validator_accepts_trailing_optional_widgets_and_output_node_outputs_either_way():
    schemas, ui, api = _synthetic_workflow(format="webm")
    maker, saver = ui["nodes"][0], ui["nodes"][1]
    maker["widgets_values"] = [16.0, 10]
    saver["outputs"] = [{"name": "video", "type": "VIDEO", "links": [], "slot_index": 0}]
    assert validate_workflow("s", ui, None, schemas) == []
    assert ui_to_api(ui, schemas)["1"]["inputs"] == {"fps": 16.0, "bit_depth": 10}
    maker["widgets_values"] = [16.0, 12]
    assert validate_workflow("s", ui, None, schemas) == ["s: node 1 (Maker): input 'bit_depth': value 12 is above the maximum 10"]
    maker["widgets_values"] = []
    assert validate_workflow("s", ui, None, schemas) == [
        "s: node 1 (Maker): widgets_values has 0 values, the node's widgets take 2 (or 1 without trailing optional widgets)"]
    maker["widgets_values"] = [16.0]
    maker["outputs"] = []  # not an output node: its outputs must all be listed
    errors = validate_workflow("s", ui, None, schemas)
    assert "s: node 1 (Maker): outputs [] are not the declared [('VIDEO', 'VIDEO')]" in errors


# ------------------------------------------------------------------------------ templates


def test_server_lists_and_serves_the_templates(server):
    """Listed by their names; served at the URLs the frontend builds from a name (unescaped: the browser's
    URL parser encodes only the spaces)."""
    with urllib.request.urlopen(server.url + "/workflow_templates", timeout=30) as resp:
        listing = json.loads(resp.read())
    assert sorted(listing.get("ComfyUI-VRAM-Fit", [])) == sorted(TEMPLATES)
    for template in TEMPLATES:
        for suffix, ctype in ((".json", "application/json"), (".jpg", "image/jpeg")):
            path = urllib.parse.quote(f"/api/workflow_templates/ComfyUI-VRAM-Fit/{template}{suffix}", safe="/(),+-.")
            with urllib.request.urlopen(server.url + path, timeout=30) as resp:
                assert resp.headers["Content-Type"].startswith(ctype)
                assert resp.read() == (WORKFLOWS_DIR / f"{template}{suffix}").read_bytes()


# ------------------------------------------------------------------------------ CPU variants run


def test_image_cpu_variant_runs_end_to_end(server, client, shipped_inputs):
    from PIL import Image

    entry = client.run(_load("vramfit_image_cpu")[1], timeout=300)
    files = output_files(entry, server.output_dir)
    images = sorted(p for p in files if p.name.startswith("vramfit_image_cpu_0"))
    assert len(images) == 2 and all(Image.open(p).size == (128, 128) for p in images)
    plot = [p for p in files if p.name.startswith("vramfit_image_cpu_vram")]
    assert len(plot) == 1 and Image.open(plot[0]).size == (512, 256)
    text = _reports(entry)
    for title in ("bf16 Loader", "VRAM Monitor", "Offload Manager", "Tiled VAE Decode"):
        assert f"VRAM Fit | {title}" in text
    assert "exact" in text and "(2, 4, 16, 16)" in text


@pytest.mark.slow
def test_video_cpu_variant_runs_end_to_end(server, client, shipped_inputs):
    import av

    entry = client.run(_load("vramfit_video_cpu")[1], timeout=300)
    videos = [p for p in output_files(entry, server.output_dir) if p.suffix == ".mp4"]
    assert len(videos) == 1 and videos[0].is_file()
    with av.open(str(videos[0])) as container:
        frames = [f for f in container.decode(video=0)]
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (64, 64)
    text = _reports(entry)
    for title in ("Offload Manager", "Temporal-Chunk Video Decode", "Temporal-Chunk Video Encode", "VRAM Monitor"):
        assert f"VRAM Fit | {title}" in text
    assert "exact" in text and "2x2 tiles" in text  # the re-encode: 8x8 latent px in tiles of 4


def _run_cli(server, workflow: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.run_workflow", str(workflow), "--url", server.url, "--timeout", "300",
         "--output-dir", str(server.output_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip


@pytest.mark.slow
def test_demo_cpu_variant_runs_through_the_headless_runner(server, shipped_inputs):
    """ComfyUI's example image, encoded, decoded in tiles under the demo's budget: the exact tiled plan."""
    from PIL import Image

    from memory.report import Report

    proc = _run_cli(server, API_DIR / "vramfit_demo_cpu.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outs = [pathlib.Path(line.split("output: ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("output: ")]
    image = next(p for p in outs if p.name.startswith("vramfit_demo_"))
    assert Image.open(image).size == (320, 256)
    assert any(p.name.startswith("vramfit_vram_timeline_") and p.is_file() for p in outs)
    for title in ("VRAM Monitor", "Offload Manager", "Tiled VAE Decode", "VAE Encode for Inpaint"):
        assert f"VRAM Fit | {title}" in proc.stdout
    lines = proc.stdout[proc.stdout.index("VRAM Fit | Tiled VAE Decode"):].splitlines()
    assert lines[1].startswith("exact · "), lines[:2]  # the verdict, right under the title
    end = next(i for i, line in enumerate(lines[2:], 2) if not line.startswith("  "))  # rows are indented
    report = Report.parse("\n".join(lines[:end]))
    rows = dict(report.rows)
    assert report.summary == lines[1] and " tensor budget" in report.summary, report.summary
    assert rows["path"].startswith("exact: layer-synchronous tiles"), rows
    assert "tiles" in rows["plan"] and f"{DEMO_BUDGET_MB} MiB" in rows["budget"], rows


def test_runner_exits_nonzero_with_comfy_error_on_a_bad_node_input(server, tmp_path):
    api = copy.deepcopy(_load("vramfit_video_cpu")[1])
    decode = next(k for k, v in api.items() if v["class_type"] == "VRAMFit_TemporalChunkVideoDecode")
    api[decode]["inputs"]["frames_per_chunk"] = -3
    bad = tmp_path / "bad_video_cpu.json"
    bad.write_text(json.dumps(api))
    proc = _run_cli(server, bad)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "frames_per_chunk" in out and "-3" in out and f"node {decode}" in out
