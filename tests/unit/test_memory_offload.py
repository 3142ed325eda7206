"""offload_for_decode against a stand-in of comfy.model_management with ComfyUI's free_memory logic.

The real ComfyUI is exercised in tests/host/test_memory_offload.py; here the wrapper's own logic
(keep list, modes, what is reported and how it is measured) is checked on every path.
"""

from __future__ import annotations

import types

import pytest
import torch
from vramfit.memory.offload import loaded_summary, offload_for_decode

MiB = 2**20


class Patcher:
    def __init__(self, name: str, size: int) -> None:
        self.model = type(name, (), {})()
        self.size = size
        self.loaded = size

    def loaded_size(self) -> int:
        return self.loaded

    def model_size(self) -> int:
        return self.size


class Loaded:
    def __init__(self, patcher: Patcher, device: torch.device) -> None:
        self.model = patcher
        self.device = device

    def __eq__(self, other: object) -> bool:  # as ComfyUI's LoadedModel: by patcher identity
        return isinstance(other, Loaded) and self.model is other.model

    def model_unload(self, memory_to_free: int | None = None) -> bool:
        if memory_to_free is not None and memory_to_free < self.model.loaded:
            self.model.loaded -= memory_to_free  # partial unload
            return False
        self.model.loaded = 0
        return True


class FakeMM:
    """Mirrors comfy.model_management.free_memory (v0.3.75): smart memory on; order: most already
    offloaded first, then smallest."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.current_loaded_models: list[Loaded] = []
        self.empty_cache_calls = 0

    def load(self, patcher: Patcher, device: str = "cpu") -> None:
        self.current_loaded_models.insert(0, Loaded(patcher, torch.device(device)))

    def get_free_memory(self, device=None) -> int:
        return self.free

    def soft_empty_cache(self, force: bool = False) -> None:
        self.empty_cache_calls += 1

    def free_memory(self, memory_required, device, keep_loaded=()):
        can_unload = []
        for i in range(len(self.current_loaded_models) - 1, -1, -1):
            lm = self.current_loaded_models[i]
            if lm.device == device and lm not in keep_loaded:
                can_unload.append((-(lm.model.size - lm.model.loaded), lm.model.size, i))
        unloaded = []
        for x in sorted(can_unload):
            i = x[-1]
            if self.free > memory_required:
                break
            lm = self.current_loaded_models[i]
            before = lm.model.loaded
            full = lm.model_unload(memory_required - self.free)
            self.free += before - lm.model.loaded
            if full:
                unloaded.append(i)
        out = [self.current_loaded_models.pop(i) for i in sorted(unloaded, reverse=True)]
        if out:
            self.soft_empty_cache()
        return out


def setup() -> tuple[FakeMM, Patcher, Patcher, Patcher]:
    mm = FakeMM(free=100 * MiB)
    vae, unet, clip = (
        Patcher("VAEModel", 300 * MiB),
        Patcher("UNetModel", 2000 * MiB),
        Patcher("CLIP", 500 * MiB),
    )
    for p in (vae, unet, clip):
        mm.load(p)
    return mm, vae, unet, clip


def test_all_mode_unloads_everything_but_kept() -> None:
    mm, vae, unet, clip = setup()
    r = offload_for_decode(mm, "cpu", keep=[vae], mode="all")
    assert sorted(r.unloaded) == ["CLIP", "UNetModel"]
    assert r.loaded_after == ["VAEModel"] and len(r.loaded_before) == 3
    assert r.bytes_freed == 2500 * MiB
    assert r.kept == ["VAEModel"] and vae.loaded == 300 * MiB
    assert r.free_before == 100 * MiB and r.free_after == 2600 * MiB
    assert mm.empty_cache_calls >= 2  # ComfyUI's own + ours
    assert "unloaded" in str(r) and "3 -> 1 models loaded" in str(r)


def test_needed_mode_unloads_only_as_much_as_needed() -> None:
    mm, vae, unet, clip = setup()
    r = offload_for_decode(mm, torch.device("cpu"), required_bytes=50 * MiB, keep=[vae])
    assert r.unloaded == [] and r.bytes_freed == 0  # already enough free
    r = offload_for_decode(mm, "cpu", required_bytes=400 * MiB, keep=[vae])
    # smart memory: ComfyUI starts with the smallest fully loaded model and unloads it partially
    assert r.unloaded == [] and r.partially_unloaded == ["CLIP"]
    assert r.bytes_freed == 300 * MiB and clip.loaded == 200 * MiB and unet.loaded == 2000 * MiB


def test_keep_accepts_vae_objects_and_other_devices_are_left_alone() -> None:
    mm, vae, unet, clip = setup()
    other = Patcher("OnGPU", 700 * MiB)
    mm.load(other, device="cuda")
    vae_obj = types.SimpleNamespace(patcher=vae)
    r = offload_for_decode(mm, "cpu", keep=[vae_obj], mode="all")
    assert "OnGPU" not in r.unloaded and other.loaded == 700 * MiB
    assert r.kept == ["VAEModel"]
    assert loaded_summary(mm) == [("OnGPU", 700 * MiB, 700 * MiB), ("VAEModel", 300 * MiB, 300 * MiB)]
    assert loaded_summary(mm, "cpu") == [("VAEModel", 300 * MiB, 300 * MiB)]


def test_bad_arguments() -> None:
    mm, *_ = setup()
    with pytest.raises(ValueError):
        offload_for_decode(mm, "cpu", mode="needed")
    with pytest.raises(ValueError):
        offload_for_decode(mm, "cpu", required_bytes=1, mode="some")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        offload_for_decode(mm, "cpu", keep=[object()], mode="all")
