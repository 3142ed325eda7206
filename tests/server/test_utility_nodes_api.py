"""Offload Manager, bf16 Loader and VRAM Monitor over ComfyUI's HTTP API (real server, --cpu)."""

from __future__ import annotations

import pytest
from vramfit.memory.report import Report

pytestmark = pytest.mark.server

NODE_IDS = ("VRAMFit_OffloadManager", "VRAMFit_Bf16Loader", "VRAMFit_VRAMMonitor")


def _run(client, workflow: dict) -> tuple[str, dict]:
    prompt_id = client.queue(workflow)
    return prompt_id, client.wait(prompt_id, timeout=300)


def _cached(entry: dict) -> list[str]:
    return next(m[1]["nodes"] for m in entry["status"]["messages"] if m[0] == "execution_cached")


def _report(entry: dict, node: str) -> dict[str, str]:
    return dict(Report.parse(entry["outputs"][node]["text"][0]).rows)


def _exact(row: str) -> int:
    return int(row.split("(", 1)[1].split(" B", 1)[0])


def test_object_info_has_tooltips_and_descriptions(client) -> None:
    for node_id in NODE_IDS:
        info = client.object_info(node_id)[node_id]
        assert info["description"] and info["display_name"].endswith("(VRAM Fit)")
        for group in ("required", "optional"):
            for name, spec in info["input"].get(group, {}).items():
                assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"
        assert all(info["output_tooltips"]), f"{node_id} outputs without tooltip"


def test_monitor_report_reaches_history_and_the_plot_is_an_image(server, client, fixture_vaes) -> None:
    from PIL import Image

    from scripts.host import output_files

    workflow = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 32, "batch_size": 1}},
        "3": {"class_type": "VRAMFit_VRAMMonitor",
              "inputs": {"value": ["2", 0], "label": "before decode", "plot_width": 384, "plot_height": 192}},
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
        "5": {"class_type": "VRAMFit_VRAMMonitor",
              "inputs": {"value": ["4", 0], "label": "after decode", "plot_width": 384, "plot_height": 192}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 2], "filename_prefix": "vramfit_plot"}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "vramfit_decoded"}},
    }  # fmt: skip
    prompt_id, entry = _run(client, workflow)
    rows = _report(entry, "5")
    assert rows["prompt"] == f"{prompt_id} (2 samples)"
    table = rows["timeline"].splitlines()
    assert "before decode" in table[1] and "after decode" in table[2]
    # after the decode the KL VAE is loaded (fp32 on CPU): the live-tensor count sees its weights
    weights = 83_653_863 * 4
    assert _exact(rows["allocated"]) >= weights
    assert int(rows["models"].split()[0]) >= 1 and _exact(rows["models"].split(", ", 1)[1]) >= weights
    assert _exact(rows["peak"]) >= _exact(rows["rss"]) * 0.5 and "since before decode" in rows["peak"]
    files = output_files(entry, server.output_dir)
    plots = [f for f in files if f.name.startswith("vramfit_plot")]
    # each monitor's preview, in ComfyUI's temp folder (--temp-directory X puts it in X/temp)
    temp = server.temp_dir
    previews = [
        temp / i["subfolder"] / i["filename"] for n in ("3", "5") for i in entry["outputs"][n]["images"]
    ]
    assert (
        len(plots) == 1
        and len(previews) == 2
        and all(i["type"] == "temp" for i in entry["outputs"]["5"]["images"])
    )
    for f in plots + previews:
        with Image.open(f) as im:
            im.verify()
        with Image.open(f) as im:
            assert im.size == (384, 192) and im.mode == "RGB"
    decoded = [f for f in files if f.name.startswith("vramfit_decoded")]
    with Image.open(decoded[0]) as im:
        assert im.size == (32, 32)  # the pass-through carried the decoded image


def _offload_workflow(fixture_vaes, method: str = "offload") -> dict:
    return {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "2": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["wan21"]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 24, "height": 16, "batch_size": 1}},
        "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 24, "height": 16, "length": 1, "batch_size": 1}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 0]}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["2", 0]}},
        "7": {"class_type": "ImageBatch", "inputs": {"image1": ["5", 0], "image2": ["6", 0]}},
        "8": {"class_type": "VRAMFit_OffloadManager",
              "inputs": {"value": ["7", 0], "unload": "all except kept", "method": method, "empty_cache": True,
                         "keep": ["1", 0]}},
        "9": {"class_type": "PreviewImage", "inputs": {"images": ["8", 0]}},
    }  # fmt: skip


def test_offload_manager_unloads_and_runs_on_every_prompt(client, fixture_vaes) -> None:
    workflow = _offload_workflow(fixture_vaes)
    first_id, first = _run(client, workflow)
    rows = _report(first, "8")
    assert rows["prompt"].startswith(first_id)
    assert "WanVAE" in rows["unloaded"]
    assert _exact(rows["freed"]) >= 126_892_531 * 4 * 0.9  # the Wan 2.1 VAE's fp32 weights
    # only the kept KL VAE stays loaded; everything else left (models earlier prompts left alive too, so
    # the count of unloaded models, not "exactly one", is what must match)
    before, after = int(rows["before"].split()[0]), int(rows["after"].split()[0])
    assert after == 1 and "AutoencoderKL" in rows["after"] and "WanVAE" not in rows["after"]
    assert rows["unloaded"].count(" B released)") == before - after

    second_id, second = _run(client, workflow)
    cached = _cached(second)
    assert "1" in cached and "6" in cached and "8" not in cached  # the node ran again
    rows2 = _report(second, "8")
    assert rows2["prompt"].startswith(second_id)
    run1 = int(rows["prompt"].split("run #")[1].split()[0])
    assert int(rows2["prompt"].split("run #")[1].split()[0]) == run1 + 1


def test_bf16_loader_decodes_over_the_api_and_rejects_bad_names(server, client, fixture_vaes) -> None:
    from PIL import Image

    from scripts.host import WorkflowError, output_files

    workflow = {
        "1": {"class_type": "VRAMFit_Bf16Loader",
              "inputs": {"model": f"vae/{fixture_vaes['kl_f8']}", "weight_dtype": "bf16"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 32, "height": 24, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 2]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "vramfit_bf16"}},
    }  # fmt: skip
    _, entry = _run(client, workflow)
    rows = _report(entry, "1")
    assert "bfloat16 100.0%" in rows["VAE"] and "50% of fp32" in rows["after"]
    assert "cannot compute bfloat16" in rows["compute"]
    (png,) = [f for f in output_files(entry, server.output_dir) if f.name.startswith("vramfit_bf16")]
    with Image.open(png) as im:
        assert im.size == (32, 24)

    bad = dict(workflow)
    bad["1"] = {
        "class_type": "VRAMFit_Bf16Loader",
        "inputs": {"model": "vae/../../secret.safetensors", "weight_dtype": "bf16"},
    }
    with pytest.raises(WorkflowError) as err:
        client.run(bad, timeout=60)
    text = str(err.value)
    assert "bf16 Loader" in text and "vae/../../secret.safetensors" in text and "not allowed" in text


def test_drop_makes_comfyui_release_its_cache_after_the_prompt(client, fixture_vaes) -> None:
    workflow = _offload_workflow(fixture_vaes, method="drop")
    workflow["3"]["inputs"]["width"] = 40  # not cached from another test
    _, first = _run(client, workflow)
    assert _report(first, "8")["drop"].startswith("requested")
    _, second = _run(client, workflow)
    cached = _cached(second)
    assert "1" not in cached and "2" not in cached  # ComfyUI dropped its node cache: the loaders ran again
