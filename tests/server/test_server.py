"""The pack loads in a real ComfyUI server, and a core decode workflow runs over the HTTP API."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.server


def test_pack_imports_cleanly(server):
    from scripts.host import PACK_LINK_NAME, pack_import_problems

    log = server.log_text()
    assert PACK_LINK_NAME in log, "ComfyUI did not list the pack among custom nodes:\n" + server.log_tail()
    assert pack_import_problems(log) == [], server.log_tail()


def test_pack_nodes_in_object_info(server, client, comfy):
    import vramfit.nodes as pack_nodes  # noqa: F401  (needs ComfyUI's comfy_api: in-process host)

    info = client.object_info()
    ids = [cls.GET_SCHEMA().node_id for cls in pack_nodes.node_classes()]
    missing = [i for i in ids if i not in info]
    assert not missing, f"pack nodes missing from /object_info: {missing}"
    for node_id in ids:
        assert info[node_id]["python_module"].startswith("custom_nodes."), info[node_id]["python_module"]


def test_core_decode_workflow_headless(server, client, fixture_vaes):
    workflow = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": fixture_vaes["kl_f8"]}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 48, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "vramfit_test"}},
    }
    from scripts.host import output_files

    entry = client.run(workflow, timeout=300)
    files = output_files(entry, server.output_dir)
    assert len(files) == 1 and files[0].is_file(), entry["outputs"]
    from PIL import Image

    with Image.open(files[0]) as im:
        assert im.size == (64, 48)


def test_bad_input_reports_comfy_error(server, client):
    from scripts.host import WorkflowError

    workflow = {
        "1": {"class_type": "VAELoader", "inputs": {"vae_name": "no_such_vae.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "3": {"class_type": "VAEDecode", "inputs": {"samples": ["2", 0], "vae": ["1", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": "x"}},
    }
    with pytest.raises(WorkflowError) as err:
        client.run(workflow, timeout=60)
    assert "no_such_vae.safetensors" in str(err.value)
