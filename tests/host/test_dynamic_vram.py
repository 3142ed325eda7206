"""Dynamic VRAM (ComfyUI >= 0.33, comfy-aimdo) on the real in-process hosts (--cpu, so aimdo is off).

A real ``ModelPatcherDynamic`` cannot be built here (its constructor allocates comfy-aimdo host buffers,
whose library only loads on an NVIDIA/AMD machine), so the dynamic model of these tests is the real
``ModelPatcher`` with ``ModelPatcherDynamic``'s accounting (``is_dynamic()``, ``loaded_size()`` = resident
pages + ``model.model_loaded_weight_memory``, unloading releases the pages), loaded through the real
``load_models_gpu`` into the real ``current_loaded_models`` and unloaded by the real ``free_memory``.
``test_the_pack_reads_the_names_the_host_has`` checks those names against the host's source.
The CUDA proof (real aimdo pages) is the GPU suite's; entry points are listed in docs/MEMORY.md.
"""

from __future__ import annotations

import gc
import inspect
import sys
import types

import pytest
import torch
from vramfit.memory.report import Report

pytestmark = pytest.mark.host
MiB = 2**20
PAGES = 64 * MiB  # "resident aimdo pages" of the staged model (two 32 MiB VBAR pages)
CPU = torch.device("cpu")


def is_033(mm) -> bool:
    """A host with dynamic VRAM (the capability, not a version string)."""
    import comfy.model_patcher as mp

    return hasattr(mp, "ModelPatcherDynamic")


def pack(comfy, name: str):
    """A module of the pack instance ComfyUI loaded (not the ``vramfit`` copy the tests import)."""
    base = comfy.NODE_CLASS_MAPPINGS["VRAMFit_OffloadManager"].__module__.rsplit(".nodes.", 1)[0]
    return sys.modules[f"{base}.{name}"]


def staged_patcher(name: str = "StagedUNet"):
    """The real ModelPatcher with ModelPatcherDynamic's accounting (see the module docstring)."""
    import comfy.model_patcher as mp

    class StagedPatcher(mp.ModelPatcher):
        pages = 0

        def is_dynamic(self) -> bool:
            return True

        def loaded_size(self) -> int:
            return self.pages + self.model.model_loaded_weight_memory

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            freed = min(self.pages, int(memory_to_free))  # pages first, as ModelPatcherDynamic
            self.pages -= freed
            if freed < memory_to_free:
                freed += super().partially_unload(device_to, memory_to_free - freed, force_patch_weights)
            return freed

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            super().unpatch_model(device_to, unpatch_weights)
            if unpatch_weights:
                self.pages = 0

    module = type(name, (torch.nn.Sequential,), {})(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    return StagedPatcher(module, load_device=CPU, offload_device=CPU)


@pytest.fixture
def staged(comfy):
    """A staged (dynamic) model loaded by the real ``load_models_gpu``, with PAGES resident pages."""
    import comfy.model_management as mm

    before = {id(lm.model) for lm in mm.current_loaded_models}
    p = staged_patcher()
    mm.load_models_gpu([p])
    p.pages = PAGES
    yield p
    keep = [lm for lm in mm.current_loaded_models if id(lm.model) in before]
    mm.free_memory(1e30, CPU, keep_loaded=keep)
    gc.collect()
    mm.cleanup_models()


@pytest.fixture
def kl_vae(comfy, fixture_vaes):
    import comfy.model_management as mm

    vae = comfy.VAELoader().load_vae(fixture_vaes["kl_f8"])[0]
    mm.load_models_gpu([vae.patcher])
    yield vae
    keep = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, CPU, keep_loaded=keep)
    del vae
    gc.collect()


def test_the_pack_reads_the_names_the_host_has(comfy) -> None:
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    import comfy.ops as ops

    glue = pack(comfy, "nodes._comfy")
    offload = pack(comfy, "memory.offload")
    has_for_dynamic = offload.accepts_keyword(mm.free_memory, "for_dynamic")
    assert "offloadable" in inspect.signature(ops.cast_bias_weight).parameters
    assert callable(ops.uncast_bias_weight)
    if not is_033(mm):  # 0.3.x: no dynamic VRAM anywhere
        assert not hasattr(mp.ModelPatcher, "is_dynamic") and not has_for_dynamic
        assert glue.dynamic_vram_state() == "absent"
        return
    dyn = mp.ModelPatcherDynamic
    assert has_for_dynamic and inspect.signature(mm.free_memory).parameters["for_dynamic"].default is False
    assert mp.ModelPatcher.is_dynamic(None) is False and dyn.is_dynamic(None) is True
    # what residency() assumes: loaded_size() = VBAR pages + the force-loaded tensors
    src = inspect.getsource(dyn.loaded_size)
    assert "_vbar_get" in src and "model_loaded_weight_memory" in src
    # unloading a dynamic model releases its pages (partially_unload -> vbar.free_memory)
    assert "free_memory" in inspect.getsource(dyn.partially_unload)
    assert "partially_unload" in inspect.getsource(dyn.unpatch_model)
    # ComfyUI's own decode counts every VBAR page as free (what the budget's evictable mirrors)
    assert "vbars_analyze" in inspect.getsource(mp.ModelPatcher.get_free_memory)
    import comfy.memory_management as cmm
    import comfy_aimdo.model_vbar as vbar

    assert cmm.aimdo_enabled is False  # --cpu
    assert callable(vbar.vbars_analyze)
    assert glue.dynamic_vram_state() == "off"
    assert glue.aimdo_vbar_bytes(torch.device("cuda", 0)) is None  # off: not asked


def test_offload_unloads_staged_models_that_for_dynamic_would_leave(comfy, staged) -> None:
    import comfy.model_management as mm

    offload = pack(comfy, "memory.offload")
    others = [lm for lm in mm.current_loaded_models if lm.model is not staged]
    tensors = staged.model.model_loaded_weight_memory
    assert tensors > 0 and staged.loaded_size() == PAGES + tensors
    res = offload.residency(staged)
    assert res.dynamic and res.evictable == PAGES and res.tensors == tensors
    if is_033(mm):
        # ComfyUI's own "dynamic" free leaves dynamic models to aimdo: nothing is unloaded
        assert mm.free_memory(1e30, CPU, keep_loaded=others, for_dynamic=True) == []
        assert any(lm.model is staged for lm in mm.current_loaded_models)
    report = offload.offload_for_decode(mm, CPU, keep=others, mode="all")
    assert report.unloaded == ["StagedUNet"] and not any(lm.model is staged for lm in mm.current_loaded_models)
    assert report.for_dynamic is (False if is_033(mm) else None)
    assert report.dynamic == ["StagedUNet"]
    assert report.evictable_before == PAGES and report.evictable_after == 0
    assert report.bytes_freed == PAGES + tensors
    assert staged.loaded_size() == 0 and "aimdo pages 64.0 -> 0.0 MiB" in report.describe()


def test_budget_counts_other_models_pages_not_the_vaes(comfy, kl_vae, staged) -> None:
    glue = pack(comfy, "nodes._comfy")
    b = glue.vae_budget(kl_vae, 0)
    assert b.evictable_bytes == PAGES  # the staged model's pages, not its tensors, not the VAE
    assert b.vae_weights_to_load == 0  # the KL VAE is fully loaded
    assert b.available == max(0, b.free_bytes + PAGES - b.reserve)
    assert "+ evictable 64 MiB" in b.describe()
    assert glue.vae_budget(kl_vae, 256).available == 256 * MiB  # a user budget replaces both
    staged.pages = 0
    assert glue.vae_budget(kl_vae, 0).evictable_bytes == 0


def test_load_vae_weights_stages_dynamic_patchers_and_fully_loads_others(comfy, kl_vae, monkeypatch) -> None:
    import comfy.model_management as mm

    glue = pack(comfy, "nodes._comfy")
    real = mm.load_models_gpu
    calls: list[dict] = []

    def spy(models, **kwargs):
        calls.append(kwargs)
        return real(models, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", spy)
    res = glue.load_vae_weights(kl_vae, 64 * MiB)
    assert calls[-1] == {"memory_required": 64 * MiB, "force_full_load": True}
    assert not res.dynamic and res.loaded == res.size == kl_vae.patcher.model_size() > 0
    p = staged_patcher("StagedVAE")
    try:
        res = glue.load_vae_weights(types.SimpleNamespace(patcher=p, device=CPU), 0)
        assert calls[-1]["force_full_load"] is False  # a dynamic load is staged, never "full"
        assert res.dynamic and res.name == "StagedVAE" and any(lm.model is p for lm in mm.current_loaded_models)
    finally:
        keep = [lm for lm in mm.current_loaded_models if lm.model is not p]
        mm.free_memory(1e30, CPU, keep_loaded=keep)


def test_group_norm_params_copy_the_cast_and_release_it(comfy, monkeypatch) -> None:
    import comfy.ops as ops

    glue = pack(comfy, "nodes._vae_ops")
    norm = ops.disable_weight_init.GroupNorm(4, 16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
        norm.bias.copy_(torch.linspace(-1.0, 1.0, 16))
    norm.comfy_cast_weights = True
    released = []
    real = ops.uncast_bias_weight

    def spy(s, weight, bias, stream):
        released.append(s)
        return real(s, weight, bias, stream)

    monkeypatch.setattr(ops, "uncast_bias_weight", spy)
    x = torch.zeros(1, 16, 4, 4)
    w, b = glue.group_norm_params(norm, x)
    assert released == [norm]  # the cast is released (aimdo pages are unpinned there)
    assert torch.equal(w, norm.weight.detach()) and torch.equal(b, norm.bias.detach())
    # copies: a staged weight's cast is only valid until released
    assert w.untyped_storage().data_ptr() != norm.weight.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() != norm.bias.untyped_storage().data_ptr()


def test_monitor_reports_resident_and_staged_weights(comfy, staged) -> None:
    import comfy.model_management as mm

    cls = comfy.NODE_CLASS_MAPPINGS["VRAMFit_VRAMMonitor"]

    def dynamic_row() -> tuple[str, str]:
        out = cls.execute(value=None, label="staged", plot_width=256, plot_height=128)
        rows = dict(Report.parse(out.result[1]).rows)
        return rows["dynamic"], rows["timeline"]

    state = "off" if is_033(mm) else "not on this host"
    row, table = dynamic_row()
    assert row.startswith(f"{state} (dynamic models loaded): 1 dynamic model on cpu")
    assert f"resident in aimdo pages 64.0 MiB ({PAGES} B;" in row and "staged 0 B (0 B;" in row
    assert "evictable" in table.splitlines()[0]
    # pages evicted, only a few small weights force-loaded: the rest is staged
    staged.pages = 0
    staged.model.model_loaded_weight_memory = 1024
    rest = staged.model_size() - 1024
    row, _ = dynamic_row()
    assert "resident in aimdo pages 0 B (0 B;" in row and f"({rest} B; not resident" in row


def test_monitor_without_dynamic_models_says_what_the_host_has(comfy) -> None:
    import comfy.model_management as mm

    cls = comfy.NODE_CLASS_MAPPINGS["VRAMFit_VRAMMonitor"]
    out = cls.execute(value=None, label="plain", plot_width=256, plot_height=128)
    rows = dict(Report.parse(out.result[1]).rows)
    if is_033(mm):
        assert rows["dynamic"].startswith("off on cpu (comfy-aimdo not enabled")
    else:
        assert rows["dynamic"].startswith("not on this host")
    del out


def test_offload_manager_reports_the_pages_it_released(comfy, staged) -> None:
    import comfy.model_management as mm

    keep = [lm.model for lm in mm.current_loaded_models if lm.model is not staged]
    cls = comfy.NODE_CLASS_MAPPINGS["VRAMFit_OffloadManager"]
    tensors = staged.model.model_loaded_weight_memory
    out = cls.execute(value=None, unload="all except kept", method="offload", empty_cache=False, keep=keep)
    rows = dict(Report.parse(out.result[1]).rows)
    assert f"StagedUNet: {(PAGES + tensors) / MiB:.1f} MiB -> 0 B on cpu ({PAGES + tensors} B released)" in rows[
        "unloaded"
    ]
    assert f"({PAGES} B) were aimdo pages of dynamic models" in rows["freed"]
    if is_033(mm):
        assert rows["dynamic"].startswith("off; free_memory(for_dynamic=False) unloads dynamic models too;")
    else:
        assert rows["dynamic"].startswith("not on this host; resident pages of the dynamic models:")
    assert "StagedUNet: aimdo pages 64.0 MiB -> 0 B on cpu" in rows["dynamic"]
    assert not any(lm.model is staged for lm in mm.current_loaded_models)


def test_bf16_loader_keeps_the_archived_dtypes_in_step(comfy, fixture_vaes) -> None:
    """0.33 archives each tensor's dtype (``<name>_comfy_model_dtype``); a dynamic load stages weights in
    that dtype, so after the loader re-stores a VAE's weights the archive must say the new dtype."""
    cls = comfy.NODE_CLASS_MAPPINGS["VRAMFit_Bf16Loader"]
    out = cls.execute(model=f"vae/{fixture_vaes['kl_f8']}", weight_dtype="fp8_e4m3fn")
    vae = out.result[2]
    archived = []
    for m in vae.first_stage_model.modules():
        for name, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False)):
            attr = f"{name}_comfy_model_dtype"
            if hasattr(m, attr):
                archived.append((type(m).__name__, name, getattr(m, attr), t.dtype))
    if not archived:
        pytest.skip("this host does not archive model dtypes (ComfyUI 0.3.x)")
    wrong = [a for a in archived if a[2] != a[3]]
    assert not wrong, wrong[:5]
    assert any(d == torch.float8_e4m3fn for *_, d in archived)  # the re-stored weights were checked
    del out, vae
    gc.collect()
