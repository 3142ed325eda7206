"""Tiled VAE Decode (VRAM Fit) in a real headless ComfyUI server, over the HTTP API."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server

NODE_ID = "VRAMFit_TiledVAEDecode"


def _workflow(vae_name: str, width: int, height: int, batch: int, **node_inputs) -> dict:
    inputs = {"samples": ["2", 0], "vae": ["1", 0], "tile_size": 0, "halo": -1, "budget_mb": 0,
              "unload_others": True}
    inputs.update(node_inputs)
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": vae_name}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": batch}},
        "3": {"class_type": NODE_ID, "inputs": inputs},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "vramfit_tiled"}},
    }


def test_object_info_declares_inputs_outputs_and_tooltips(client):
    info = client.object_info(NODE_ID)[NODE_ID]
    assert info["display_name"] == "Tiled VAE Decode (VRAM Fit)"
    required = info["input"]["required"]
    assert list(required) == ["samples", "vae", "tile_size", "halo", "budget_mb", "unload_others"]
    assert all(spec[1].get("tooltip") for spec in required.values())
    optional = info["input"]["optional"]  # added after the widgets saved workflows hold: they keep their values
    assert list(optional) == ["allow_approximate"] and optional["allow_approximate"][1]["default"] is False
    assert "30 dB" in optional["allow_approximate"][1]["tooltip"]
    assert info["input"]["hidden"] == {"unique_id": ["UNIQUE_ID"]}
    assert info["output"] == ["IMAGE", "STRING"]
    assert all(info["output_tooltips"])


def test_headless_workflow_saves_image_and_reports_plan(server, client, fixture_vaes):
    """VAELoader -> EmptyLatentImage -> Tiled VAE Decode (forced 32-px exact tiles, batch 2) -> SaveImage."""
    from PIL import Image

    from scripts.host import output_files

    entry = client.run(_workflow(fixture_vaes["kl_f8"], 96, 72, 2, tile_size=32), timeout=300)
    files = output_files(entry, server.output_dir)
    assert len(files) == 2 and all(f.is_file() for f in files), entry["outputs"]
    for f in files:
        with Image.open(f) as im:
            assert im.size == (96, 72)
    text = entry["outputs"]["3"]["text"][0]  # ui.PreviewText, stored in /history
    assert text.startswith("VRAM Fit | Tiled VAE Decode | cpu"), text
    assert "exact: layer-synchronous tiles" in text and "tiles of 32 px" in text, text
    verdict = text.splitlines()[1]  # under the title: 96x72 px in 32-px tiles
    assert verdict.startswith("exact · 3x3 tiles x 2 images · "), text


def test_video_latent_vae_mismatch_is_a_clear_error(client, fixture_vaes):
    from scripts.host import WorkflowError

    with pytest.raises(WorkflowError) as err:
        client.run(_workflow(fixture_vaes["wan21"], 64, 64, 1), timeout=120)
    text = str(err.value)  # EmptyLatentImage's 4 channels on Wan 2.1's 16: the wrong VAE for both nodes
    assert "[VRAM Fit · Tiled VAE Decode]" in text and "wrong VAE for this latent" in text, text
    assert "Temporal-Chunk Video Decode" not in text, text
