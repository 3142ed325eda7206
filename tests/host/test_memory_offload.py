"""offload_for_decode on the real comfy.model_management of the in-process host (--cpu)."""

from __future__ import annotations

import gc

import pytest
import torch
from vramfit.memory.offload import loaded_summary, offload_for_decode

pytestmark = pytest.mark.host


@pytest.fixture
def two_loaded(comfy, fixture_vaes):
    import comfy.model_management as mm

    # start from an empty device: the assertions below name what was unloaded (models other tests left
    # loaded, e.g. another AutoencoderKL, would be unloaded too and named alike)
    mm.unload_all_models()
    gc.collect()
    keep = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]
    other = comfy.VAELoader().load_vae(fixture_vaes["wan21"])[0]
    mm.load_models_gpu([keep.patcher, other.patcher])
    yield mm, keep, other
    # leave other tests' models alone: unload only ours
    ours = {id(keep.patcher), id(other.patcher)}
    others = [lm for lm in mm.current_loaded_models if id(lm.model) not in ours]
    mm.free_memory(1e30, torch.device("cpu"), keep_loaded=others)
    del keep, other
    gc.collect()


def test_offload_keeps_the_vae_and_frees_the_rest(two_loaded) -> None:
    mm, keep, other = two_loaded
    cpu = torch.device("cpu")
    loaded = mm.loaded_models()
    assert any(p is keep.patcher for p in loaded) and any(p is other.patcher for p in loaded)
    other_loaded = other.patcher.loaded_size()
    assert other_loaded == other.patcher.model_size() > 0  # fully loaded by load_models_gpu

    # "needed" with nothing needed: ComfyUI's free_memory stops at once (free RAM > 0)
    r0 = offload_for_decode(mm, cpu, required_bytes=0, keep=[keep])
    assert r0.unloaded == [] and r0.bytes_freed == 0
    assert len(mm.loaded_models()) == len(loaded)

    n_before = len(mm.loaded_models())
    report = offload_for_decode(mm, cpu, keep=[keep], mode="all")
    after = mm.loaded_models()
    assert len(after) < n_before  # loaded_models() shrank
    assert any(p is keep.patcher for p in after)
    assert not any(p is other.patcher for p in after)
    assert "WanVAE" in report.unloaded and "AutoencoderKL" not in report.unloaded
    # model level: exactly the weights ComfyUI had loaded for the unloaded model(s)
    assert report.bytes_freed > 0
    assert report.bytes_freed >= other_loaded
    assert other.patcher.loaded_size() == 0 and keep.patcher.loaded_size() == keep.patcher.model_size()
    # device level on --cpu: measured and reported as such (weights stay in RAM, offload device = CPU)
    assert report.device_measure == "process RSS drop" and report.device_bytes_freed is not None
    assert report.free_before is not None and report.free_after is not None
    assert ("AutoencoderKL", keep.patcher.model_size(), keep.patcher.model_size()) in loaded_summary(mm, cpu)
    text = str(report)
    assert "WanVAE" in text and "model weights released" in text


def test_needed_mode_beyond_free_memory_unloads_until_nothing_is_left(two_loaded) -> None:
    mm, keep, other = two_loaded
    cpu = torch.device("cpu")
    # more than the machine has: on --cpu, unloading frees no RAM, so ComfyUI unloads every candidate
    report = offload_for_decode(mm, cpu, required_bytes=1 << 50, keep=[keep])
    assert "WanVAE" in report.unloaded and report.bytes_freed >= other.patcher.model_size()
    assert any(p is keep.patcher for p in mm.loaded_models())
