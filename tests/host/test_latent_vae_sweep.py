"""Each latent layout x VAE kind x decode node has one answer; no error sends the user in a loop (issue 22).

Cells: latents (4-D image ``(B, C, H, W)``, 5-D of one frame ``(B, C, 1, H, W)``, 5-D video of 3 frames, and
both with the channels of another family: a wrong VAE) x fixture VAEs (image: SD KL, FLUX; video: Wan 2.1,
Wan 2.2, HunyuanVideo) x the two nodes. Each cell expects either a decode equal to the host's own
``VAEDecode`` of the latent as that VAE means it, or a ``NodeInputError`` naming the node and the value (a wrong
VAE only). Both nodes take every latent VAE Decode takes (issue 42: a swapped template never fails where the
original runs): each routes the other's latents to the other's engine, and says so in its report.

What the hosts show (0.3.75 and 0.33.0): every video VAE in ``comfy/sd.py`` but the self-tiling ones maps
``T`` latent frames to ``max(0, a*T - (a-1))`` frames (one latent frame: one image), and ComfyUI's sampler
turns a 4-D latent into ``(B, C, 1, H, W)`` for every video model (``sample.fix_empty_latent_channels``):
a 4-D latent on a video VAE is B single frames. Core ``VAEDecode`` raises IndexError on it (both hosts), so
the reference is its decode of the 5-D single-frame latent. On an image VAE, 0.3.75 fails on any 5-D latent
and 0.33 decodes ``z[:, :, 0]``: equal for one frame; several frames are refused (a video model's latent).
"""

from __future__ import annotations

import logging
import re
import sys
import types

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.latent_vae_sweep")

NODES = {"tiled": "VRAMFit_TiledVAEDecode", "video": "VRAMFit_TemporalChunkVideoDecode"}
TITLES = {"tiled": "Tiled VAE Decode", "video": "Temporal-Chunk Video Decode"}
TOL = 1e-4
"""Max abs diff (images on [0, 1], float32) of a decoded cell vs the host's own ``VAEDecode``."""

VAES = {  # kind: (channels, latent px of a 32-px image, is a video VAE)
    "kl_f8": (4, 4, False),
    "flux": (16, 4, False),
    "flux2": (128, 2, False),
    "wan21": (16, 4, True),
    "wan22": (48, 2, True),
    "hunyuan_video": (16, 4, True),
}
FOREIGN = {"kl_f8": 16, "flux": 4, "flux2": 16, "wan21": 4, "wan22": 16, "hunyuan_video": 4}
"""Channels of another family's latent (a wrong VAE for it)."""
LATENTS = ("image", "frame", "video", "foreign_image", "foreign_video")
WRONG_VAE = "wrong VAE for this latent"


def _latent(kind: str, layout: str) -> torch.Tensor:
    channels, px, _ = VAES[kind]
    c = FOREIGN[kind] if layout.startswith("foreign") else channels
    shape = {
        "image": (2, c, px, px),
        "frame": (1, c, 1, px, px),
        "video": (1, c, 3, px, px),
        "foreign_image": (1, c, px, px),
        "foreign_video": (1, c, 3, px, px),
    }[layout]
    return structured_latent(shape, seed=3)


def expected(kind: str, layout: str, node: str) -> tuple[str, str]:
    """``("decode", "")`` or ``("error", needle)``: the one answer of a cell."""
    video_vae = VAES[kind][2]
    if layout.startswith("foreign"):
        return "error", WRONG_VAE
    if not video_vae and layout == "video":
        return "error", "image VAE, which decodes single images: " + WRONG_VAE
    return "decode", ""  # every latent VAE Decode takes, in both nodes (each routes to the other's engine)


def _reference_latent(kind: str, layout: str, z: torch.Tensor) -> torch.Tensor:
    """The latent as the VAE means it: single frames gain a time axis (video VAE) or lose it (image VAE)."""
    if VAES[kind][2] and z.ndim == 4:
        return z.unsqueeze(2)
    if not VAES[kind][2] and z.ndim == 5:
        return z[:, :, 0]
    return z


@pytest.fixture(scope="module")
def mods(comfy):
    return {k: sys.modules[comfy.NODE_CLASS_MAPPINGS[v].__module__] for k, v in NODES.items()}


@pytest.fixture(scope="module")
def vaes(comfy, fixture_vaes):
    import comfy.model_management as mm

    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            with torch.inference_mode():  # as ComfyUI's executor runs the loader
                loaded[kind] = fixture_vaes.load(comfy, narrow(kind))  # Wan 2.2: its narrow twin
        return loaded[kind]

    yield get
    patchers = [v.patcher for v in loaded.values()]
    for v in loaded.values():
        others = [lm for lm in mm.current_loaded_models if lm.model not in patchers]
        mm.free_memory(1e30, v.patcher.load_device, keep_loaded=others)


@pytest.fixture(scope="module")
def refs(comfy):
    cache: dict = {}

    def get(kind: str, layout: str, vae, z: torch.Tensor) -> torch.Tensor:
        key = (kind, layout)
        if key not in cache:
            with torch.inference_mode():  # as ComfyUI runs nodes
                (cache[key],) = comfy.VAEDecode().decode(vae, {"samples": _reference_latent(kind, layout, z)})
        return cache[key]

    return get


def _accepts(mod, vae, z: torch.Tensor) -> bool:
    try:
        with torch.inference_mode():
            mod._validate(vae, {"samples": z}, 0, 0 if mod.__name__.endswith("video_decode") else -1)
    except ValueError:
        return False
    return True


def _check_error(mods, node: str, vae, z: torch.Tensor, needle: str) -> str:
    with pytest.raises(ValueError) as err, torch.inference_mode():
        mods[node].decode(vae, {"samples": z})
    text = str(err.value)
    assert type(err.value).__name__ == "NodeInputError", text
    assert text.startswith(f"[VRAM Fit · {TITLES[node]}]"), text
    assert str(tuple(z.shape)) in text and needle in text, text
    other = "video" if node == "tiled" else "tiled"
    if re.search(re.escape(TITLES[other]), text):  # a pointer to the other node: it accepts the same input
        assert _accepts(mods[other], vae, z), f"{text}\n-> {TITLES[other]} rejects the same input"
    return text


@pytest.mark.parametrize("node", list(NODES))
@pytest.mark.parametrize("layout", LATENTS)
@pytest.mark.parametrize("kind", [k if k in ("kl_f8", "wan21") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in VAES])  # an image and a video VAE by default, every kind in the slow tier
def test_cell(mods, vaes, refs, kind, layout, node):
    vae = vaes(kind)
    z = _latent(kind, layout)
    outcome, needle = expected(kind, layout, node)
    if outcome == "error":
        text = _check_error(mods, node, vae, z, needle)
        log.info("CELL %s %s %s %s: error: %s", kind, layout, node, tuple(z.shape), text)
        return
    with torch.inference_mode():
        r = mods[node].decode(vae, {"samples": z})
    ref = refs(kind, layout, vae, z)
    assert r.images.shape == ref.shape and r.images.dtype == torch.float32, (r.images.shape, ref.shape)
    d = (r.images - ref).abs().max().item()
    text = r.report.text()
    log.info("CELL %s %s %s %s: decoded %s, max abs diff %.1e, %s", kind, layout, node, tuple(z.shape),
             tuple(r.images.shape), d, dict(r.report.rows).get("path"))
    assert TITLES[node] in text.splitlines()[0], text
    if z.ndim != _reference_latent(kind, layout, z).ndim:
        assert "input" in dict(r.report.rows), text
    assert d <= TOL, f"{kind} {layout} {node}: max abs diff {d:.2e}\n{text}"
    if VAES[kind][2]:  # Wan: the chunked executor; other video VAEs: the host's own decode (it fits)
        assert dict(r.report.rows)["path"].startswith("exact"), text


def test_a_4d_latent_on_wan_is_its_batch_of_frames_in_both_nodes(mods, vaes):
    """Qwen-Image / Wan image latents: both nodes give the same images, the B frames of the 5-D latent."""
    vae = vaes("wan21")
    z = _latent("wan21", "image")
    with torch.inference_mode():
        a = mods["tiled"].decode(vae, {"samples": z}).images
        b = mods["video"].decode(vae, {"samples": z}).images
        one = mods["video"].decode(vae, {"samples": z[1:].unsqueeze(2)}).images
    assert a.shape == (2, 32, 32, 3) and torch.equal(a, b)
    assert (a[1:] - one).abs().max().item() <= TOL


@pytest.mark.slow
def test_the_issue_latent_decodes_in_both_nodes_as_the_host_decodes_its_frame(comfy, mods, vaes):
    """Issue 22: a (1, 16, 20, 16) latent on Wan 2.1 got two contradictory errors; now one 160x128 image."""
    vae = vaes("wan21")
    z = structured_latent((1, 16, 20, 16), seed=7)
    with torch.inference_mode():
        (ref,) = comfy.VAEDecode().decode(vae, {"samples": z.unsqueeze(2)})
        results = {node: mods[node].decode(vae, {"samples": z}) for node in NODES}
    for node, r in results.items():
        d = (r.images - ref).abs().max().item()
        log.info("issue latent via %s: %s, max abs diff %.1e\n%s", node, tuple(r.images.shape), d,
                 r.report.text())
        assert r.images.shape == (1, 160, 128, 3) and d <= TOL, (node, d)
        assert r.report.text().startswith(f"VRAM Fit | {TITLES[node]}")


@pytest.mark.parametrize("node", list(NODES))
@pytest.mark.parametrize("shape", [(1, 64, 100), (1, 64, 4, 4)])
def test_an_audio_vae_gets_the_hosts_decode_and_says_why(comfy, mods, node, shape):
    """Never worse than VAE Decode: what it returns for an audio VAE (not described by the pack), said so."""
    vae = types.SimpleNamespace(first_stage_model=torch.nn.Identity(), latent_dim=1, latent_channels=64,
                                device="cpu", decode=lambda z: z * 2.0)
    z = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    with torch.inference_mode():
        r = mods[node].decode(vae, {"samples": z})
        (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
    text = r.report.text()
    assert torch.equal(r.images, ref), text
    assert r.report.summary.startswith("host decode: not described: a VAE of latent_dim 1"), text
    assert "VAE Decode Audio" in text and TITLES["video" if node == "tiled" else "tiled"] not in text


def _nested(*streams: torch.Tensor):
    from comfy.nested_tensor import NestedTensor

    return NestedTensor(streams)


def test_a_nested_latent_whose_first_stream_is_one_frame_decodes_as_that_frame(mods, vaes):
    vae = vaes("wan21")
    z = structured_latent((1, 16, 4, 4), seed=13)
    audio = torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = mods["video"].decode(vae, {"samples": z.unsqueeze(2)}).images
        for node in NODES:
            r = mods[node].decode(vae, {"samples": _nested(z, audio)})
            assert r.images.shape == (1, 32, 32, 3) and (r.images - plain).abs().max().item() <= TOL
            assert "single frame" in dict(r.report.rows)["input"]


@pytest.mark.parametrize("node", list(NODES))
def test_a_nested_latent_of_another_family_is_a_wrong_vae_naming_the_stream(mods, vaes, node):
    audio = torch.randn(1, 8, 4, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError) as err, torch.inference_mode():
        mods[node].decode(vaes("wan21"), {"samples": _nested(torch.zeros(1, 4, 8, 8), audio)})
    text = str(err.value)
    assert text.startswith(f"[VRAM Fit · {TITLES[node]}]"), text
    assert "of a nested latent (2 streams) (1, 4, 8, 8) has 4 channels but the VAE expects 16" in text, text
