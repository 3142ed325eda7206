"""Offload Manager input errors in ComfyUI's own prompt validation (in-process host): a bad ``unload`` is
reported once, under ``unload`` (ComfyUI files a failed ``validate_inputs`` under every input it takes)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytestmark = pytest.mark.host


def _errors(unload: str, method: str) -> list[dict] | None:
    """ComfyUI's validation errors of the Offload Manager (node "2"), ``None`` when the prompt is valid."""
    import execution

    prompt = {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "2": {
            "class_type": "VRAMFit_OffloadManager",
            "inputs": {"value": ["1", 0], "unload": unload, "method": method, "empty_cache": False},
        },
    }
    valid, _error, _outputs, node_errors = asyncio.run(
        execution.validate_prompt(uuid.uuid4().hex, prompt, None)
    )
    return None if valid else node_errors["2"]["errors"]


def test_bad_unload_is_reported_once_under_unload(comfy) -> None:
    errors = _errors("some", "offload")
    assert errors is not None
    assert [e["extra_info"]["input_name"] for e in errors] == ["unload"], errors
    assert "[VRAM Fit · Offload Manager]" in errors[0]["details"] and "'some'" in errors[0]["details"]


def test_bad_method_is_not_reported_under_unload(comfy) -> None:
    """ComfyUI checks the ``method`` combo itself where it validates V3 combos; where it does not
    (0.3.75) ``execute`` rejects the value. Either way no error is filed under ``unload``."""
    errors = _errors("everything", "delete")
    if errors is not None:
        assert [e["extra_info"]["input_name"] for e in errors] == ["method"], errors
    assert _errors("all except kept", "drop") is None
