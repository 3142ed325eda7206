"""Temporal-Chunk Video Decode (VRAM Fit) in a real headless ComfyUI server, over the HTTP API."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server

NODE_ID = "VRAMFit_TemporalChunkVideoDecode"


def _workflow(vae_name: str, width: int, height: int, length: int, **node_inputs) -> dict:
    inputs = {"samples": ["2", 0], "vae": ["1", 0], "frames_per_chunk": 0, "tile_size": 0, "budget_mb": 0,
              "unload_others": True}
    inputs.update(node_inputs)
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": width, "height": height, "length": length, "batch_size": 1}},
        "3": {"class_type": NODE_ID, "inputs": inputs},
        "4": {"class_type": "SaveAnimatedWEBP",
              "inputs": {"images": ["3", 0], "filename_prefix": "vramfit_video", "fps": 8.0, "lossless": False,
                         "quality": 80, "method": "fastest"}},
    }


def test_object_info_declares_inputs_outputs_and_tooltips(client):
    info = client.object_info(NODE_ID)[NODE_ID]
    assert info["display_name"] == "Temporal-Chunk Video Decode (VRAM Fit)"
    required = info["input"]["required"]
    assert list(required) == ["samples", "vae", "frames_per_chunk", "tile_size", "budget_mb", "unload_others"]
    assert all(spec[1].get("tooltip") for spec in required.values())
    optional = info["input"]["optional"]  # added after the widgets saved workflows hold: they keep their values
    assert list(optional) == ["allow_approximate"] and optional["allow_approximate"][1]["default"] is False
    assert "30 dB" in optional["allow_approximate"][1]["tooltip"]
    assert info["output"] == ["IMAGE", "STRING"]
    assert all(info["output_tooltips"])


def test_headless_hunyuan_latent_to_animated_webp(server, client, fixture_vaes):
    """VAELoader (Wan 2.1 fixture, 16 ch) + EmptyHunyuanLatentVideo (16 ch, 48x32, 9 frames) -> this node
    (k = 2) -> SaveAnimatedWEBP: one animated WEBP with 9 frames of 48x32; the plan report in /history."""
    from PIL import Image

    from scripts.host import output_files

    entry = client.run(_workflow(fixture_vaes["wan21"], 48, 32, 9, frames_per_chunk=2), timeout=300)
    files = output_files(entry, server.output_dir)
    assert len(files) == 1 and files[0].is_file() and files[0].suffix == ".webp", entry["outputs"]
    with Image.open(files[0]) as im:
        assert im.size == (48, 32) and getattr(im, "n_frames", 1) == 9
    text = entry["outputs"]["3"]["text"][0]
    assert text.startswith("VRAM Fit | Temporal-Chunk Video Decode | cpu"), text
    assert "exact: causal caches" in text and "k = 2" in text, text
    verdict = text.splitlines()[1]  # under the title
    assert verdict.startswith("exact · ") and " chunks · " in verdict, text


def test_image_latent_is_a_clear_error(client, fixture_vaes):
    from scripts.host import WorkflowError

    wf = _workflow(fixture_vaes["wan21"], 48, 32, 9)
    wf["2"] = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    with pytest.raises(WorkflowError) as err:
        client.run(wf, timeout=120)
    text = str(err.value)
    assert "[VRAM Fit · Temporal-Chunk Video Decode]" in text and "expects 16" in text, text
    assert "Tiled VAE Decode" not in text, text  # a 4-channel latent is the wrong VAE for both nodes
