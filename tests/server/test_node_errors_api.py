"""How VRAM Fit's input errors reach a user over ComfyUI's HTTP API (issue 13, item 6):
a bad bf16 Loader input is reported once, under the input that is wrong, and a node failing at run time
shows a clean exception type in ``/history`` (not the module name ComfyUI's loader derives from the
pack's folder path)."""

from __future__ import annotations

import uuid

import pytest

from scripts.host import WorkflowError

pytestmark = pytest.mark.server


def _loader_workflow(model: str, weight_dtype: str = "bf16") -> dict:
    return {
        "1": {"class_type": "VRAMFit_Bf16Loader", "inputs": {"model": model, "weight_dtype": weight_dtype}},
        "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 3]}},
    }


def _node_errors(client, workflow: dict) -> list[dict]:
    """ComfyUI's validation errors of node "1" for ``workflow`` (which it must reject)."""
    with pytest.raises(WorkflowError) as err:
        client.queue(workflow)
    return err.value.details["node_errors"]["1"]["errors"]


def test_bad_model_name_is_reported_once_under_model(client, fixture_vaes) -> None:
    errors = _node_errors(client, _loader_workflow("vae/vramfit_no_such_file.safetensors"))
    assert [e["extra_info"]["input_name"] for e in errors] == ["model"], errors
    assert "[VRAM Fit · bf16 Loader]" in errors[0]["details"]
    assert "vramfit_no_such_file.safetensors" in errors[0]["details"]


def test_bad_weight_dtype_is_reported_once_under_weight_dtype(client, fixture_vaes) -> None:
    """ComfyUI checks the combo itself where it validates V3 combos (0.33); where it does not (0.3.75)
    the node rejects the value when it runs. Either way the error names weight_dtype only."""
    workflow = _loader_workflow(f"vae/{fixture_vaes['kl_f8']}", weight_dtype="int4")
    try:
        prompt_id = client.queue(workflow)
    except WorkflowError as e:
        errors = e.details["node_errors"]["1"]["errors"]
        assert [err["extra_info"]["input_name"] for err in errors] == ["weight_dtype"], errors
        assert "int4" in errors[0]["details"]
        return
    with pytest.raises(WorkflowError) as err:
        client.wait(prompt_id, timeout=120)
    text = str(err.value)
    assert "vramfit.NodeInputError" in text and "weight_dtype must be one of" in text and "'int4'" in text


def test_both_bad_are_reported_once_each(client) -> None:
    errors = _node_errors(client, _loader_workflow("loras/x.safetensors", weight_dtype="int4"))
    names = [e["extra_info"]["input_name"] for e in errors]
    assert names in (["model"], ["model", "weight_dtype"], ["weight_dtype", "model"]), errors
    (model_error,) = [e for e in errors if e["extra_info"]["input_name"] == "model"]
    assert "folder 'loras'" in model_error["details"] and "int4" not in model_error["details"]


def test_run_time_error_has_a_clean_exception_type(client, host_config) -> None:
    """A listed file that is not a valid safetensors file passes validation and fails in ``execute``."""
    name = f"vramfit_truncated_{uuid.uuid4().hex[:8]}.safetensors"
    path = host_config.models_dir / "vae" / name
    path.write_bytes((4096).to_bytes(8, "little") + b'{"a": {"dtype": "F16", "shape": [2048], "data_offsets"')
    try:
        prompt_id = client.queue(_loader_workflow(f"vae/{name}"))
        with pytest.raises(WorkflowError) as err:
            client.wait(prompt_id, timeout=120)
    finally:
        path.unlink(missing_ok=True)
    (error,) = [m[1] for m in err.value.details["status"]["messages"] if m[0] == "execution_error"]
    assert error["node_type"] == "VRAMFit_Bf16Loader"
    assert error["exception_type"] == "vramfit.NodeInputError", error["exception_type"]
    assert error["exception_message"].startswith("[VRAM Fit · bf16 Loader]") and name in error["exception_message"]
