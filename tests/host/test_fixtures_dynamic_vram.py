"""A fixture built while ComfyUI's dynamic VRAM is on (0.33+ on CUDA) still holds every weight: there
``comfy.ops``' Linear defers its weights to the state dict's load, and the GPU suite's HunyuanVideo 1.5 and
LTX-Video files came out without them (H100, 2026-11-27). The flag is set here as the device sets it."""

from __future__ import annotations

import pytest
import torch

from scripts.fixtures.host import import_comfy_module
from scripts.fixtures.weights import build_model


@pytest.mark.parametrize("kind", ["hunyuan_video15_narrow", "ltx_video_narrow"])
def test_fixture_built_under_dynamic_vram_has_every_weight(host_config, kind):
    from scripts.host import import_comfy

    import_comfy(host_config)
    try:
        import comfy.memory_management as mm
    except ImportError:
        mm = None
    if not hasattr(mm, "aimdo_enabled"):
        pytest.skip("this ComfyUI has no dynamic VRAM (comfy.memory_management.aimdo_enabled)")
    plain = build_model(kind).state_dict()
    before = mm.aimdo_enabled
    mm.aimdo_enabled = True
    try:
        with torch.device("meta"):
            lazy = import_comfy_module("comfy.ops").disable_weight_init.Linear(4, 4)
        built = build_model(kind).state_dict()
        assert mm.aimdo_enabled  # restored after the build
    finally:
        mm.aimdo_enabled = before
    assert lazy.weight is None  # the host defers Linear weights under the flag (what the fix guards against)
    assert {k: tuple(v.shape) for k, v in built.items()} == {k: tuple(v.shape) for k, v in plain.items()}
