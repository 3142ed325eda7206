"""The decode part of ComfyUI's official templates, swapped, headless over ``POST /prompt`` (issue 42 item 5).

For each VAE file the templates load (``scripts/upstream_templates.py``), one template that loads it, and each of
its decode nodes (bypassed ones run enabled): the template's own VAE part, that is its VAE loader (the file replaced
by a random-weight twin of its structure, saved under a name of the pack's own so that no user file is written
over), the latent source replaced by a saved latent of the shape that source makes (``LoadLatent``), the decode
node, and ``SaveImage``. Each part runs four ways on the same server:

* reference: the part with core ``VAEDecode`` (the host's own untiled decode, what "exact" is measured against);
* original: the part as the template has it (the reference itself when the template's node is ``VAEDecode``);
* swapped: the node ``python -m scripts.use_vramfit`` makes of it in the whole template (type and widgets);
* swapped under a budget: the same with ``budget_mb`` at half the peak the swapped run measured.

Both swapped runs save the reference's images (8-bit PNGs, equal within one level: float noise may round the other
way) and report exact or the host's own decode with its reason; the original runs, so a swapped template never
fails where the original runs. ``video_wan2_1_infinitetalk.json``'s 81-frame Wan latent is the issue's case.

Not over a server: Qwen-Image 2.1's VAE and MiniMax H3's int8 + ConvRot decoder load only with the newest upstream
files, in process (``tests/host/test_upstream_wan.py``, ``test_upstream_minimax.py``). A part whose file the host's
own loader cannot build (ComfyUI 0.3.75 has no RGBA Wan 2.1, FLUX.2 small decoder, LTX 2.4 or CogVideoX VAE) is
skipped on that host.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import re

import numpy as np
import pytest
import safetensors.torch

from scripts import use_vramfit as u
from scripts.host import WorkflowError, output_files
from scripts.workflow_schema import Schemas, ui_to_api
from tests.unit.test_use_vramfit import corpus

pytestmark = pytest.mark.server

log = logging.getLogger("vramfit.tests.template_decode_parts")
M = u.load_mapping()
TWIN_PREFIX = "vramfit_template_"


@dataclasses.dataclass(frozen=True)
class Part:
    """One template and what its decode part needs."""

    template: str
    latent: tuple[int, ...]
    """The shape of the latent its source makes (a narrow one: 4-8 latent px a side)."""
    hosts: tuple[str, ...] = ("0.3.75", "0.33.0")
    """The hosts whose own loader builds its VAE files."""
    slow: bool = False
    """In the slow tier: its structure is another part's (the RGB Wan 2.1 twin: the InfiniteTalk part's)."""


NEW_ONLY = ("0.33.0",)
PARTS = (
    # LatentCutToBatch's one-frame latents (a composite and a layer), decoded as one batch to RGBA
    Part("image_qwen_image_layered.json", (2, 16, 1, 12, 16), NEW_ONLY),
    # LTXVSeparateAVLatent's video latent, decoded by VAE Decode (Tiled) [512, 64, 64, 16]
    Part("video_ltx2_5_t2v.json", (1, 128, 3, 3, 4), NEW_ONLY),
    # SamplerCustomAdvanced's Qwen-Image latent (5-D, one frame), decoded to RGBA
    Part("image_ming_image_01_design_t2i.json", (1, 16, 1, 12, 16), NEW_ONLY),
    Part("image_marigold_v2_depth_estimation.json", (1, 16, 1, 12, 16), slow=True),
    # one EmptyHunyuanLatentVideo sample decoded by both Wan-Alpha files
    Part("video_wan2.1_alpha_t2v_14B.json", (1, 16, 3, 8, 8), slow=True),
    # EmptyFlux2LatentImage's (128 channels, 16x)
    Part("image_moss_image_t2i.json", (1, 128, 6, 8), NEW_ONLY),
    # VAE Decode (Tiled) [256, 64, 64, 8] and a bypassed VAE Decode on a HunyuanVideo 1.0 latent
    Part("hunyuan_video_text_to_video.json", (1, 16, 2, 4, 4)),
    # Chroma Radiance: pixel_space, the latent is the image
    Part("image_chroma1_radiance_text_to_image.json", (1, 3, 64, 64)),
    # Netflix VOID's CogVideoX latent
    Part("utility_void_video_inpainting.json", (1, 16, 3, 4, 4), NEW_ONLY),
    # 81 frames: WanInfiniteTalkToVideo's 21 latent frames (issue 42: the swap gave the image node here)
    Part("video_wan2_1_infinitetalk.json", (1, 16, 21, 4, 6)),
)
TWIN_OF = {
    "Wan2_1_VAE_bf16.safetensors": ("wan21_rgb", None),
    "ltx-2.5-video-vae-bf16.safetensors": ("ltx24", None),
    "hunyuan_video_vae_bf16.safetensors": ("fixture", "hunyuan_video"),
    "cogvideox_vae.safetensors": ("fixture", "cogvideox"),
    "pixel_space": ("builtin", None),
}
"""How each file's twin is made when not by :data:`scripts.upstream_templates.BUILDERS` (its own name)."""


def _decodes(template: dict) -> list[tuple[str | None, int]]:
    """``(graph id, node id)`` of each decode node of ``template`` (its subgraphs included)."""
    return [(u._ui_graph_id(template, g), n["id"]) for g in u._ui_graphs(template) for n in g["nodes"]
            if n["type"] in ("VAEDecode", "VAEDecodeTiled")]


CASES = [pytest.param(p, gid, nid, id=f"{p.template.removesuffix('.json')}-{nid}",
                      marks=[pytest.mark.slow] if i or p.slow else [])
         for p in PARTS for i, (gid, nid) in enumerate(_decodes(corpus()[p.template]))]
"""Every decode node of each template; the second one of a template (another subgraph or file, or bypassed) and the
parts of :attr:`Part.slow` in the slow tier."""


def _graph(template: dict, gid: str | None) -> dict:
    return next(g for g in u._ui_graphs(template) if u._ui_graph_id(template, g) == gid)


def _node(graph: dict, nid: int) -> dict:
    return next(n for n in graph["nodes"] if n["id"] == nid)


def _vae_file(graph: dict, decode: dict) -> str:
    """The file the decode node's VAE loader names (the loader is in the decode node's own graph)."""
    link = next(i["link"] for i in decode["inputs"] if i["name"] == "vae")
    origin = next((lk[1] if isinstance(lk, list) else lk["origin_id"]) for lk in graph["links"]
                  if (lk[0] if isinstance(lk, list) else lk["id"]) == link)
    loader = _node(graph, origin)
    assert loader["type"] == "VAELoader", loader["type"]
    return loader["widgets_values"][0]


def _twin(file: str, vae_dir, fixture_vaes) -> str:
    """The loader value of ``file``'s random-weight twin (written into ``vae_dir`` once)."""
    how, kind = TWIN_OF.get(file, ("builder", None))
    if how == "builtin":
        return file
    if how == "fixture":
        return fixture_vaes[kind]
    name = TWIN_PREFIX + file
    path = vae_dir / name
    if not path.is_file():
        from scripts import upstream_templates as ut

        metadata = None
        if how == "ltx24":
            sd, metadata = ut.ltx24_state_dict()
        elif how == "wan21_rgb":
            sd = ut.wan21_rgba_state_dict(channels=3)
        else:
            sd = ut.state_dict(file.removesuffix(".safetensors"))
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        safetensors.torch.save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp), metadata=metadata)
        tmp.replace(path)
    return name


@pytest.fixture(scope="module")
def schemas(client):
    return Schemas(client.object_info())


def _prompt(vae: str, latent: str, decode: dict, prefix: str) -> dict:
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": latent}},
        "3": {**decode, "inputs": {**decode["inputs"], "samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}},
    }


def _api(node: dict, schemas: Schemas) -> dict:
    """The API form of UI node ``node`` (its widgets by the host's schema), enabled, without its links."""
    node = {**copy.deepcopy(node), "mode": 0, "inputs": []}
    out = ui_to_api({"nodes": [node], "links": []}, schemas)[str(node["id"])]
    return {"class_type": out["class_type"], "inputs": out["inputs"]}


def _images(entry: dict, server) -> np.ndarray:
    from PIL import Image

    files = sorted(output_files(entry, server.output_dir))
    assert files, entry["outputs"]
    return np.stack([np.asarray(Image.open(f)) for f in files]).astype(np.int16)


def _report(entry: dict) -> str:
    texts = [t for out in entry["outputs"].values() for t in out.get("text", []) or []
             if isinstance(t, str) and t.startswith("VRAM Fit |")]
    assert len(texts) == 1, entry["outputs"]
    return texts[0]


PEAK = re.compile(r"peak ([\d.,]+) (KiB|MiB|GiB)")
SMALLEST = re.compile(r"no plan fits the budget of .*; the smallest found \(.*\) needs ([\d.]+) MiB")


def _with_budget(decode: dict, budget_mb: int) -> dict:
    return {**decode, "inputs": {**decode["inputs"], "budget_mb": budget_mb}}


def _peak_mib(report: str) -> float:
    value, unit = PEAK.search(report).groups()
    return float(value.replace(",", "")) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[unit]


@pytest.mark.parametrize(("part", "gid", "nid"), CASES)
def test_swapped_decode_part_runs_as_the_original(part, gid, nid, server, client, schemas, host_config,
                                                 fixture_vaes):
    from scripts.fixtures.files import write_latent_file
    from scripts.fixtures.latents import structured_latent

    template = corpus()[part.template]
    graph = _graph(template, gid)
    original = _node(graph, nid)
    swapped_template = u.swap(copy.deepcopy(template), mapping=M).graph
    swapped = _node(_graph(swapped_template, gid), nid)
    assert swapped["type"].startswith("VRAMFit_"), swapped["type"]

    file = _vae_file(graph, original)
    if host_config.version not in part.hosts:
        pytest.skip(f"{file}: ComfyUI {host_config.version}'s own loader cannot build its structure")
    vae = _twin(file, host_config.models_dir / "vae", fixture_vaes)
    tag = f"{part.template.removesuffix('.json')}-{nid}"
    latent = f"vramfit_{tag}.latent"
    write_latent_file(server.input_dir / latent, structured_latent(part.latent, seed=3))

    def run(decode: dict, name: str) -> dict:
        return client.run(_prompt(vae, latent, decode, f"parts/{tag}-{name}"), timeout=600)

    reference = {"class_type": "VAEDecode", "inputs": {}}
    want = _images(run(reference, "reference"), server)
    if original["type"] != "VAEDecode":
        got = _images(run(_api(original, schemas), "original"), server)
        assert got.shape == want.shape  # the template's own tiled decode: approximate, not compared

    pack = _api(swapped, schemas)
    entry = run(pack, "swapped")
    report = _report(entry)
    got = _images(entry, server)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1, report
    verdict = report.splitlines()[1]
    assert verdict.startswith(("exact", "host decode")), report

    budget = max(1, int(0.7 * _peak_mib(report)))
    try:
        entry = run(_with_budget(pack, budget), "budget")
    except WorkflowError as e:  # a refusal names the smallest plan it found: that budget runs
        found = SMALLEST.search(str(e))
        assert found, e
        budget = math.ceil(float(found.group(1)))
        entry = run(_with_budget(pack, budget), "budget")
    report = _report(entry)
    got = _images(entry, server)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1, report
    assert report.splitlines()[1].startswith(("exact", "host decode")), report
    log.info("%s: %s %s, budget %d MiB:\n%s", tag, swapped["type"], json.dumps(pack["inputs"]), budget, report)
