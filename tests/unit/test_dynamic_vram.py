"""Dynamic VRAM (ComfyUI >= 0.33, comfy-aimdo): residency arithmetic, budget, offload and monitor fields.

The stand-ins use the attribute names of ComfyUI 0.33's real objects (``ModelPatcherDynamic.is_dynamic``,
``loaded_size()`` = aimdo pages + ``model.model_loaded_weight_memory``, ``free_memory(..., for_dynamic=...)``);
``tests/host/test_dynamic_vram.py`` checks those names against the 0.33 source and runs the same logic
through the real ``comfy.model_management``.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from vramfit.memory.budget import MiB, compute_budget
from vramfit.memory.measure.monitor import (
    OPTIONAL_SERIES,
    DynamicVram,
    MemorySample,
    MemorySampler,
    Timeline,
    render_timeline,
)
from vramfit.memory.offload import (
    accepts_keyword,
    device_residency,
    evictable_bytes,
    is_dynamic,
    offload_for_decode,
    residency,
)
from vramfit.memory.report import Report

GiB = 1024 * MiB
PAGE = 32 * MiB  # comfy-aimdo's VBAR page


class Plain:
    """A 0.3.x ``ModelPatcher``: no ``is_dynamic``; ``loaded_size()`` = ``model_loaded_weight_memory``."""

    def __init__(self, name: str, size: int, loaded: int | None = None) -> None:
        self.model = type(name, (), {})()  # the module; its class name is the model's name
        self.model.model_loaded_weight_memory = size if loaded is None else loaded
        self.size = size

    def model_size(self) -> int:
        return self.size

    def loaded_size(self) -> int:
        return self.model.model_loaded_weight_memory

    def unload(self, memory_to_free: float) -> int:
        """What ``partially_unload``/``detach`` free (bytes)."""
        freed = int(min(memory_to_free, self.model.model_loaded_weight_memory))
        self.model.model_loaded_weight_memory -= freed
        return freed


class Dynamic(Plain):
    """A 0.33 ``ModelPatcherDynamic``: ``loaded_size()`` = resident VBAR pages + force-loaded tensors."""

    def __init__(self, name: str, size: int, pages: int, tensors: int) -> None:
        super().__init__(name, size, tensors)
        self.pages = pages

    def is_dynamic(self) -> bool:
        return True

    def loaded_size(self) -> int:
        return self.pages * PAGE + self.model.model_loaded_weight_memory

    def unload(self, memory_to_free: float) -> int:
        # ModelPatcherDynamic.partially_unload: VBAR pages first, then the force-loaded backups
        n = min(self.pages, int(-(-memory_to_free // PAGE)))
        self.pages -= n
        freed = n * PAGE
        if freed < memory_to_free:
            freed += self.model.model_loaded_weight_memory
            self.model.model_loaded_weight_memory = 0
        return freed


class Loaded:
    def __init__(self, patcher: Plain, device: torch.device) -> None:
        self.model = patcher
        self.device = device

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Loaded) and self.model is other.model

    def model_unload(self, memory_to_free: float | None = None) -> bool:
        p = self.model
        if memory_to_free is not None and memory_to_free < p.loaded_size():
            if p.unload(memory_to_free) >= memory_to_free:
                return False
        p.unload(1e32)
        return True


class FakeMM33:
    """comfy.model_management of 0.33 reduced to the logic offload relies on: ``free_memory`` with
    ``for_dynamic`` (True: dynamic models are not unloaded, their loaded size is credited instead)."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.current_loaded_models: list[Loaded] = []
        self.calls: list[dict] = []

    def load(self, patcher: Plain, device: str = "cuda:0") -> None:
        self.current_loaded_models.insert(0, Loaded(patcher, torch.device(device)))

    def get_free_memory(self, device=None) -> int:
        return self.free

    def soft_empty_cache(self, force: bool = False) -> None:
        pass

    def free_memory(self, memory_required, device, keep_loaded=[], for_dynamic=False, pins_required=0, ram_required=0):  # noqa: B006 - ComfyUI's signature
        self.calls.append({"for_dynamic": for_dynamic, "memory_required": memory_required})
        order = sorted(
            (-(lm.model.model_size() - lm.model.loaded_size()), lm.model.model_size(), i)
            for i, lm in enumerate(self.current_loaded_models)
            if lm.device == device and lm not in keep_loaded
        )
        gone = []
        for *_, i in order:
            lm = self.current_loaded_models[i]
            to_free = memory_required - self.free
            if is_dynamic(lm.model) and for_dynamic:
                memory_required -= lm.model.loaded_size()
                to_free = 0
            if to_free > 0:
                before = lm.model.loaded_size()
                if lm.model_unload(to_free):
                    gone.append(i)
                self.free += before - lm.model.loaded_size()
        return [self.current_loaded_models.pop(i) for i in sorted(gone, reverse=True)]


def dynamic_host() -> tuple[FakeMM33, Dynamic, Dynamic, Plain]:
    mm = FakeMM33(free=1 * GiB)
    vae = Dynamic("WanVAE", 254 * MiB, pages=8, tensors=2 * MiB)  # 256 MiB of pages: page rounding
    unet = Dynamic("WanModel", 2600 * MiB, pages=40, tensors=30 * MiB)  # 1,280 MiB resident, rest staged
    clip = Plain("T5", 900 * MiB)  # a non-dynamic model (e.g. disable_offload)
    for p in (clip, unet, vae):
        mm.load(p)
    return mm, vae, unet, clip


# ------------------------------------------------------------------------------------ residency


def test_residency_splits_aimdo_pages_from_tensors_and_staged_weights() -> None:
    mm, vae, unet, clip = dynamic_host()
    r = residency(unet)
    assert r.dynamic and r.name == "WanModel"
    assert r.loaded == 40 * PAGE + 30 * MiB and r.tensors == 30 * MiB
    assert r.evictable == 40 * PAGE  # resident pages, evicted on demand
    assert r.not_resident == 2600 * MiB - (40 * PAGE + 30 * MiB)  # staged in RAM
    # pages round up to 32 MiB: a fully faulted-in VAE can show more than its size, never negative staging
    v = residency(vae)
    assert v.loaded > v.size and v.not_resident == 0 and v.evictable == 8 * PAGE
    # a 0.3.x patcher (no is_dynamic): every loaded byte is a tensor, nothing evictable
    c = residency(clip)
    assert not c.dynamic and c.tensors == c.loaded == 900 * MiB and c.evictable == 0
    low = residency(Plain("UNet", 1000 * MiB, loaded=600 * MiB))  # a low-VRAM partial load
    assert low.evictable == 0 and low.not_resident == 400 * MiB
    assert residency(types.SimpleNamespace(patcher=unet)) == r  # a VAE object is accepted


def test_is_dynamic_by_attribute() -> None:
    assert is_dynamic(Dynamic("a", 1, 0, 0)) and not is_dynamic(Plain("b", 1))
    p = Plain("c", 1)
    p.is_dynamic = lambda: False  # 0.33's plain ModelPatcher
    assert not is_dynamic(p)


def test_device_residency_excludes_the_vae_and_its_clones_and_counts_clones_once() -> None:
    mm, vae, unet, clip = dynamic_host()
    other_card = Dynamic("Other", 500 * MiB, pages=4, tensors=0)
    mm.load(other_card, device="cuda:1")
    everything = device_residency(mm, "cuda:0")
    assert everything.count == 3 and everything.dynamic_count == 2
    assert everything.evictable == 48 * PAGE
    assert everything.staged == unet.model_size() - unet.loaded_size()
    assert everything.loaded == vae.loaded_size() + unet.loaded_size() + clip.loaded_size()
    assert evictable_bytes(mm, "cuda:0", exclude=[vae]) == 40 * PAGE  # the VAE's own pages are not free
    clone = Dynamic("WanVAE", 254 * MiB, pages=0, tensors=0)
    clone.model = vae.model  # ComfyUI clones share the module
    assert evictable_bytes(mm, "cuda:0", exclude=[clone]) == 40 * PAGE
    mm.load(clone)  # the same module listed twice counts once
    assert device_residency(mm, "cuda:0").count == 3
    assert evictable_bytes(mm, "cuda:1") == 4 * PAGE
    assert evictable_bytes(mm, "cpu") == 0


# ------------------------------------------------------------------------------------ budget


def test_budget_counts_evictable_pages_as_available() -> None:
    b = compute_budget(
        "cuda:0", lambda d: 2 * GiB, get_total_memory=lambda d: 24 * GiB,
        vae_weights_to_load=254 * MiB, evictable_bytes=40 * PAGE,
    )  # fmt: skip
    reserve = int(24 * GiB * 0.05)
    assert b.evictable_bytes == 40 * PAGE
    assert b.available == 2 * GiB + 40 * PAGE - 254 * MiB - reserve
    assert "+ evictable 1,280 MiB (dynamic VRAM" in b.describe()
    # a user budget replaces free memory and the evictable pages alike
    u = compute_budget("cuda:0", lambda d: 2 * GiB, user_budget_mb=512, evictable_bytes=40 * PAGE)
    assert u.available == 512 * MiB and "evictable" not in u.describe()
    # no dynamic models: the 0.3.x formula, unchanged text
    z = compute_budget("cuda:0", lambda d: 2 * GiB, get_total_memory=lambda d: 24 * GiB)
    assert z.evictable_bytes == 0 and "evictable" not in z.describe()
    assert z.available == b.available - 40 * PAGE + 254 * MiB
    assert compute_budget("cuda:0", lambda d: 0, evictable_bytes=-5).available == 0


# ------------------------------------------------------------------------------------ offload


def test_offload_unloads_dynamic_models_with_for_dynamic_false_and_reports_their_pages() -> None:
    mm, vae, unet, clip = dynamic_host()
    unet_loaded, clip_loaded = unet.loaded_size(), clip.loaded_size()
    r = offload_for_decode(mm, "cuda:0", keep=[vae], mode="all")
    assert mm.calls[-1]["for_dynamic"] is False and r.for_dynamic is False
    assert sorted(r.unloaded) == ["T5", "WanModel"] and r.kept == ["WanVAE"]
    assert r.bytes_freed == unet_loaded + clip_loaded  # pages included: loaded_size() counts them
    assert r.dynamic == ["WanVAE", "WanModel"]
    assert r.evictable_before == 48 * PAGE and r.evictable_after == 8 * PAGE  # the kept VAE's pages stay
    assert unet.pages == 0 and vae.pages == 8
    assert r.free_gain == unet_loaded + clip_loaded
    assert "aimdo pages 1,536.0 -> 256.0 MiB" in r.describe()


def test_needed_mode_frees_dynamic_pages_partially() -> None:
    mm, vae, unet, clip = dynamic_host()
    clip_model = mm.current_loaded_models[-1]
    mm.current_loaded_models.remove(clip_model)  # only dynamic models besides the VAE
    r = offload_for_decode(mm, "cuda:0", required_bytes=1 * GiB + 100 * MiB, keep=[vae])
    # 0.33 frees page by page (32 MiB): 100 MiB needs 4 pages
    assert r.partially_unloaded == ["WanModel"] and r.unloaded == []
    assert unet.pages == 36 and r.bytes_freed == 4 * PAGE
    assert r.evictable_before - r.evictable_after == 4 * PAGE


def test_hosts_without_for_dynamic_are_called_without_it() -> None:
    calls = []

    class MM075(FakeMM33):
        def free_memory(self, memory_required, device, keep_loaded=[]):  # noqa: B006 - 0.3.75's signature
            calls.append(memory_required)
            return super().free_memory(memory_required, device, keep_loaded)

    mm = MM075(free=GiB)
    p = Plain("UNet", 100 * MiB)
    mm.load(p)
    r = offload_for_decode(mm, "cuda:0", mode="all")
    assert calls == [1e30] and r.for_dynamic is None and r.unloaded == ["UNet"] and r.dynamic == []
    assert "dynamic VRAM" not in r.describe()


def test_accepts_keyword() -> None:
    def with_it(a, for_dynamic=False): ...
    def without(a, keep_loaded=()): ...
    def anything(a, **kw): ...

    assert accepts_keyword(with_it, "for_dynamic") and not accepts_keyword(without, "for_dynamic")
    assert accepts_keyword(anything, "for_dynamic")
    assert not accepts_keyword(object(), "for_dynamic")  # not callable: no signature


# ------------------------------------------------------------------------------------ monitor


class FakeCuda:
    def synchronize(self, device=None) -> None: ...
    def memory_allocated(self, device=None) -> int: return 100 * MiB
    def memory_reserved(self, device=None) -> int: return 128 * MiB
    def max_memory_allocated(self, device=None) -> int: return 200 * MiB
    def reset_peak_memory_stats(self, device=None) -> None: ...
    def mem_get_info(self, device=None) -> tuple[int, int]: return 4 * GiB, 24 * GiB


def test_monitor_sample_reports_resident_pages_and_staged_weights() -> None:
    sampler = MemorySampler(backend=FakeCuda())
    dyn = DynamicVram("on", models=2, evictable=48 * PAGE, staged=1200 * MiB, host_resident=48 * PAGE)
    s = sampler.sample("cuda:0", "after sampling", models_loaded=(3, 2500 * MiB), dynamic=dyn)
    assert (s.models_dynamic, s.models_evictable, s.models_staged, s.aimdo_resident) == (
        2, 48 * PAGE, 1200 * MiB, 48 * PAGE,
    )  # fmt: skip
    tl = Timeline("p")
    tl.add(s)
    rows = dict(Report.parse(tl.report().text()).rows)
    assert rows["dynamic"].startswith("on (comfy-aimdo): 2 dynamic models on cuda:0")
    assert f"({48 * PAGE} B; evictable on demand" in rows["dynamic"]
    assert f"({1200 * MiB} B; not resident" in rows["dynamic"] and "aimdo reports" in rows["dynamic"]
    usable = 4 * GiB + 48 * PAGE
    assert f"= {usable / GiB:.2f} GiB ({usable} B) usable by torch allocations" in rows["free"]
    assert "aimdo pages not included" in rows["allocated"]
    assert "evictable" in rows["timeline"].splitlines()[0]


def test_monitor_without_dynamic_vram_says_so_and_keeps_the_old_fields() -> None:
    sampler = MemorySampler(backend=FakeCuda())
    off = sampler.sample("cuda:0", "a", dynamic=DynamicVram("off"))
    absent = sampler.sample("cuda:0", "b", dynamic=DynamicVram("absent"))
    silent = sampler.sample("cuda:0", "c")
    for s in (off, absent, silent):
        assert s.models_evictable is None and s.models_staged is None and s.aimdo_resident is None
    assert (off.dynamic_vram, absent.dynamic_vram, silent.dynamic_vram) == ("off", "absent", None)

    def rows(sample: MemorySample) -> dict[str, str]:
        tl = Timeline("p")
        tl.add(sample)
        return dict(Report.parse(tl.report().text()).rows)

    assert rows(off)["dynamic"].startswith("off on cuda:0 (comfy-aimdo not enabled")
    assert rows(absent)["dynamic"].startswith("not on this host")
    assert "dynamic" not in rows(silent) and "usable" not in rows(off)["free"]
    assert "evictable" not in rows(off)["timeline"]
    # dynamic models loaded while aimdo reports off (e.g. a custom patcher): still shown
    odd = sampler.sample("cuda:0", "d", dynamic=DynamicVram("off", models=1, evictable=PAGE))
    assert odd.models_evictable == PAGE and rows(odd)["dynamic"].startswith("off (dynamic models loaded)")
    gone = sampler.sample("cuda:0", "e", dynamic=DynamicVram("absent", models=1))
    assert rows(gone)["dynamic"].startswith("not on this host (dynamic models loaded): 1 dynamic model")


def test_plot_draws_evictable_only_when_sampled() -> None:
    sampler = MemorySampler(backend=FakeCuda())
    dyn = [sampler.sample("cuda:0", f"s{i}", dynamic=DynamicVram("on", 1, (3 - i) * GiB, 0)) for i in range(3)]
    colour = dict(OPTIONAL_SERIES)["models_evictable"]

    def colours(samples: list[MemorySample]) -> set[tuple[int, ...]]:
        img = render_timeline(samples, 320, 200)
        return {tuple(int(round(c * 255)) for c in px) for px in img[0].reshape(-1, 3).tolist()}

    assert colour in colours(dyn)
    assert colour not in colours([dataclasses.replace(s, models_evictable=None) for s in dyn])


@pytest.mark.parametrize("state", ["on", "off", "absent"])
def test_dynamic_state_is_active_only_with_aimdo_or_dynamic_models(state: str) -> None:
    assert DynamicVram(state).active == (state == "on")
    assert DynamicVram(state, models=1).active
