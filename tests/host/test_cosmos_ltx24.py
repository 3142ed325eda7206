"""Cosmos and LTX 2.4 through Temporal-Chunk Video Decode (issue 36 item 3).

* Cosmos (``comfy.ldm.cosmos.vae.CausalContinuousVideoTokenizer``, both hosts, its narrow twin): carried-context
  chunks (``memory/vae/carry_layout.py``: causal convolutions carry their last frames, the causal temporal attention
  every earlier frame's keys and values, the latent un-normalised once by its frame index): equal to VAE Decode
  within 1e-4 over at least 3 chunks, under a budget below the host's own decode and with ``frames_per_chunk`` 1.
  Before: an overlap-blend, frames off by up to 1.0.
* A blend under 30 dB is not taken silently: with Cosmos's description left out, the blend that fits measures under
  the floor on its first-use check; the host's own decode runs (exact, flagged over budget, the dB in its reason)
  unless ``allow_approximate`` is on, and then the report states the measured dB.
* LTX 2.4's diffusion decoder (``na_diffusion_decoder.CausalDiffusionVAE``, ComfyUI 0.33 only; a small model of the
  host's class loaded by ``comfy.sd.VAE`` from its state dict and a ``config`` in its metadata, as the released
  files carry it): never an overlap-blend, even with ``allow_approximate``: the host's own decode with the reason,
  equal to VAE Decode.
"""

from __future__ import annotations

import importlib
import sys
import weakref

import pytest
import torch

from scripts.fixtures.latents import structured_latent
from scripts.fixtures.narrow import narrow
from scripts.upstream_templates import ltx24_state_dict

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("inference_mode")]
MiB = 1 << 20


@pytest.fixture(scope="module")
def video(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TemporalChunkVideoDecode"].__module__]


def _engine(video, name: str):
    """A module of the pack's engine (``memory.<name>``), as the host imported it (the node module ``video``'s
    package; the unit tier's ``vramfit`` copy may be loaded too)."""
    return importlib.import_module(f"{video.__name__.rsplit('.nodes.', 1)[0]}.memory.{name}")


def _release(vae) -> None:
    import comfy.model_management as mm

    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)


@pytest.fixture(scope="module")
def cosmos(comfy, fixture_vaes):
    vae = fixture_vaes.load(comfy, narrow("cosmos"))
    z = structured_latent((1, 16, 5, 3, 4), seed=4)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    yield vae, z, ref
    _release(vae)


def test_cosmos_loads_as_its_family(cosmos, video):
    vae, z, ref = cosmos
    assert type(vae.first_stage_model).__name__ == "CausalContinuousVideoTokenizer"
    assert ref.shape == (8 * 5 - 7, 24, 32, 3)
    layout = _engine(video, "vae.carry_layout").carry_layout(vae.first_stage_model)
    assert layout.reason is None and layout.family == "cosmos", layout.reason


def test_cosmos_chunks_are_exact_under_a_budget(cosmos, video):
    vae, z, ref = cosmos
    whole = video.decode(vae, {"samples": z})  # free memory: the host's own decode fits
    assert whole.plan.path == "host" and (whole.images - ref).abs().max().item() <= 1e-4
    r = video.decode(vae, {"samples": z}, budget_mb=max(1, int(whole.plan.planned * 0.6 / MiB)))
    text = r.report.text()
    assert r.plan.path == "carry" and r.plan.exact and r.stats["chunks"] >= 3, text
    assert text.splitlines()[1].startswith("exact · "), text
    assert "self-check passed" in text and "keys and values" in text, text
    diff = (r.images - ref).abs().max().item()
    assert diff <= 1e-4, (diff, text)
    one = video.decode(vae, {"samples": z}, frames_per_chunk=1)  # frame 0, then one latent frame per chunk
    assert one.plan.path == "carry" and one.stats["chunks"] == 5, one.report.text()
    assert (one.images - ref).abs().max().item() <= 1e-4, one.report.text()


def test_a_sub_floor_blend_is_not_taken_silently(cosmos, video, monkeypatch):
    """Cosmos without its description (as before this issue): the blend that fits measures under 30 dB."""
    vae, z, ref = cosmos
    layout = _engine(video, "vae.carry_layout")
    monkeypatch.setattr(layout, "DESCRIPTIONS", tuple(d for d in layout.DESCRIPTIONS if d.name != "cosmos"))
    monkeypatch.setattr(layout, "_LAYOUTS", weakref.WeakKeyDictionary())
    r = video.decode(vae, {"samples": z}, frames_per_chunk=2)
    text, path = r.report.text(), dict(r.report.rows)["path"]
    assert r.plan.path == "host" and r.plan.exact, text
    assert "not taken without allow_approximate" in path and "vs VAE Decode on the first-use check" in path, text
    db = float(path.split("measured ")[1].split(" dB")[0])
    assert db < 30, text
    assert (r.images - ref).abs().max().item() <= 1e-4, text
    tight = video.decode(vae, {"samples": z}, budget_mb=1)  # over budget: run anyway, flagged
    assert tight.plan.path == "host" and tight.plan.over_budget and "OVER BUDGET" in tight.report.text()
    ok = video.decode(vae, {"samples": z}, frames_per_chunk=2, allow_approximate=True)
    text, path = ok.report.text(), dict(ok.report.rows)["path"]
    assert ok.plan.path == "blend" and text.splitlines()[1].startswith("approximate · "), text
    assert f"measured {db:.1f} dB" in path and "taken because allow_approximate is on" in path, text


def test_the_node_has_allow_approximate(video):
    schema = video.TemporalChunkVideoDecode.define_schema()
    inputs = {i.id: i for i in schema.inputs}
    names = [i.id for i in schema.inputs]
    assert names[-1] == "allow_approximate" and names[:-1] == [
        "samples", "vae", "frames_per_chunk", "tile_size", "budget_mb", "unload_others"]
    flag = inputs["allow_approximate"]
    assert flag.default is False and flag.optional and "30 dB" in flag.tooltip


@pytest.fixture(scope="module")
def ltx24(comfy):
    try:
        nd = importlib.import_module("comfy.ldm.lightricks.vae.na_diffusion_decoder")
    except ModuleNotFoundError:
        pytest.skip("this host has no LTX 2.4 diffusion decoder (comfy.ldm.lightricks.vae.na_diffusion_decoder, "
                    "ComfyUI 0.33+)")
    import comfy.sd as comfy_sd

    sd, metadata = ltx24_state_dict()
    vae = comfy_sd.VAE(sd=sd, metadata=metadata)
    assert type(vae.first_stage_model) is nd.CausalDiffusionVAE
    z = structured_latent((1, 128, 3, 3, 4), seed=4)
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(vae, {"samples": z})[0].clone()
    yield vae, z, ref
    _release(vae)


@pytest.mark.parametrize("allow", [False, True])
def test_ltx24_never_blends(ltx24, video, allow):
    vae, z, ref = ltx24
    for kw in ({"budget_mb": 1}, {"frames_per_chunk": 2}):
        r = video.decode(vae, {"samples": z}, allow_approximate=allow, **kw)
        text, path = r.report.text(), dict(r.report.rows)["path"]
        assert r.plan.path == "host" and r.plan.exact, text
        assert "no overlap-blend for this decoder: LTX 2.4's diffusion decoder draws the noise" in path, text
        assert (r.images - ref).abs().max().item() <= 1e-4, text
        assert r.plan.over_budget == ("budget_mb" in kw), text
