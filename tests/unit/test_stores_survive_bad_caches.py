"""A cost-model cache problem never fails a decode; a failed cancel check does not turn a later OOM fatal;
only the KL decoder the shipped model was measured on is the ``kl`` family; meta sizing leaves the live
model's tensors alone for everyone else."""

from __future__ import annotations

import json
import logging
import pathlib
import threading
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from vramfit.memory.cost.phases import CostModel, CostModelStore, ModelKey, Phase
from vramfit.memory.geometry import Geometry
from vramfit.memory.measure.monitor import module_weight_bytes
from vramfit.memory.measure.sizing import MetaSizer, decode_run
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.oom import OomResume
from vramfit.memory.vae.families import identify

KEY = ModelKey("toy", "full", "float32", "cpu")


def _model(key: ModelKey = KEY) -> CostModel:
    return CostModel(key, (Phase(("const", "px"), (1.0, 2.0)),))


# ------------------------------------------------------------------------ cost-model store: cache problems


@pytest.mark.parametrize(
    "text",
    [
        "{not json",  # not JSON
        "[1, 2]",  # JSON, not a model
        "null",
        '{"models": {"a": 1}}',
        '{"models": [[1]]}',
        json.dumps(
            {
                "models": [
                    dict(
                        _model().to_dict(),
                        key={"family": 5, "executor": "full", "dtype": "float32", "device_type": "cpu"},
                    )
                ]
            }
        ),
    ],
)
def test_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, caplog, text) -> None:
    cache = tmp_path / "costs.json"
    cache.write_text(text)
    with caplog.at_level(logging.WARNING, logger="vramfit.memory.cost.phases"):
        store = CostModelStore(cache, defaults_dir=None)
    assert store.keys() == [] and "ignoring unreadable cost-model cache" in caplog.text
    store.put(_model())  # a new calibration replaces the broken file
    assert [m.key for m in CostModelStore(cache, defaults_dir=None).models()] == [KEY]


def test_unreadable_cache_file_is_ignored(tmp_path, monkeypatch, caplog) -> None:
    cache = tmp_path / "costs.json"
    CostModelStore(cache, defaults_dir=None).put(_model())

    def fail(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(pathlib.Path, "read_text", fail)
    with caplog.at_level(logging.WARNING, logger="vramfit.memory.cost.phases"):
        store = CostModelStore(cache, defaults_dir=None)
    assert store.get(KEY) is None and "Permission denied" in caplog.text


def test_unwritable_cache_keeps_the_calibration_in_memory(tmp_path, caplog) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    store = CostModelStore(blocker / "costs.json", defaults_dir=None)  # its folder cannot be created
    calls = []
    with caplog.at_level(logging.WARNING, logger="vramfit.memory.cost.phases"):
        got = store.get_or_calibrate(KEY, lambda: calls.append(1) or _model())
    assert got == _model() and store.get(KEY) == _model()
    assert "could not write the cost-model cache" in caplog.text
    assert store.get_or_calibrate(KEY, lambda: calls.append(1) or _model()) == _model() and calls == [1]


# ------------------------------------------------------------------------ OOM resume after a failed cancel check


class FakeOOM(RuntimeError):
    pass


class CheckFailed(Exception):
    pass


def test_oom_after_a_raising_cancel_check_is_still_recovered() -> None:
    fail_once = [True]

    def should_stop() -> None:
        if fail_once.pop() if fail_once else False:
            raise CheckFailed("cancel check broke")

    driver = OomResume((FakeOOM,), should_stop=should_stop)
    with pytest.raises(CheckFailed):  # the caller catches it and carries on
        driver.check_stop()
    todo = [FakeOOM("out of memory"), None]

    def attempt() -> str:  # out of memory before its first cancel check
        err = todo.pop(0)
        if err is not None:
            raise err
        return "done"

    events = []
    assert driver.run(attempt, recover=events.append) == "done"
    assert [e.type_name for e in events] == ["FakeOOM"] and driver.retries == 1


# ------------------------------------------------------------------------ KL family: the shipped decoder only


def _kl_decoder(ch=128, ch_mult=(1, 2, 4, 4), num_res_blocks=2, z_channels=4, out_ch=3, up_attn=False,
                mid_attn=True, kernel=(3, 3)) -> types.SimpleNamespace:  # fmt: skip
    """The attributes of ComfyUI's ``comfy.ldm.modules.diffusionmodules.model.Decoder`` identify reads."""
    ns = types.SimpleNamespace
    levels = []
    for mult in ch_mult:  # up[i] is the level of ch_mult[i]
        width = ch * mult
        blocks = [ns(out_channels=width) for _ in range(num_res_blocks + 1)]
        levels.append(ns(block=blocks, attn=[ns()] * len(blocks) if up_attn else []))
    mid = ns(block_1=ns(), block_2=ns(), **({"attn_1": ns()} if mid_attn else {}))
    dec = type("Decoder", (), {})()
    dec.__dict__.update(
        ch=ch, num_resolutions=len(ch_mult), num_res_blocks=num_res_blocks, up=levels, mid=mid,
        conv_in=ns(in_channels=z_channels, kernel_size=kernel), conv_out=ns(out_channels=out_ch, kernel_size=kernel),
        tanh_out=False,
    )  # fmt: skip
    return dec


def _kl_vae(decoder, channels: int = 4, cls: str = "AutoencoderKL") -> types.SimpleNamespace:
    model = type(cls, (), {"__module__": "comfy.ldm.models.autoencoder"})()
    model.decoder = decoder
    return types.SimpleNamespace(
        first_stage_model=model, upscale_ratio=8, latent_dim=2, latent_channels=channels
    )


def test_kl_family_is_the_shipped_decoder_structure() -> None:
    assert identify(_kl_vae(_kl_decoder())) == "kl"  # SD1.x / SDXL
    assert identify(_kl_vae(_kl_decoder(z_channels=16), 16, "AutoencodingEngine")) == "kl"  # SD3 / FLUX
    variants = {
        "ch_mult": _kl_decoder(ch_mult=(1, 2, 4)),
        "ch_mult widths": _kl_decoder(ch_mult=(1, 2, 2, 4)),
        "ch": _kl_decoder(ch=64),
        "num_res_blocks": _kl_decoder(num_res_blocks=1),
        "up attention": _kl_decoder(up_attn=True),
        "no mid attention": _kl_decoder(mid_attn=False),
        "out_ch": _kl_decoder(out_ch=4),
        "3-D convs": _kl_decoder(kernel=(3, 3, 3)),
        "z_channels": _kl_decoder(z_channels=16),  # latent_channels says 4
    }
    for what, dec in variants.items():
        assert identify(_kl_vae(dec)) is None, what
    assert identify(_kl_vae(type("Decoder", (), {})())) is None  # structure unknown: not trusted


# ------------------------------------------------------------------------ meta sizing leaves the live model alone


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.conv_out = torch.nn.Conv2d(16, 3, 3, padding=1)
        self.register_buffer("scale", torch.ones(1))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(self.norm(self.conv_in(z)))
        return self.conv_out(torch.nn.functional.interpolate(h, scale_factor=2.0)) * self.scale


def _observe(model: torch.nn.Module) -> dict:
    """What another thread sees of ``model`` (a sampler, the VRAM monitor's walk, ComfyUI's model manager)."""
    seen = {}

    def look() -> None:
        tensors = list(model.parameters()) + list(model.buffers())
        seen["tensors"] = tensors
        seen["attr"] = model.conv_in.weight
        seen["fake"] = any(isinstance(t, FakeTensor) for t in tensors + [seen["attr"]])
        seen["bytes"] = module_weight_bytes(model, "cpu")

    t = threading.Thread(target=look)
    t.start()
    t.join()
    return seen


def test_meta_sizing_does_not_swap_the_live_models_tensors() -> None:
    model = _Toy().eval()
    before = list(model.parameters()) + list(model.buffers())
    real_bytes = module_weight_bytes(model, "cpu")
    assert real_bytes > 0
    run, run16 = (decode_run(model.decode, 4, dt) for dt in (torch.float32, torch.bfloat16))
    g = Geometry(6, 10, batch=2, spatial_ratio=2)
    inside = {}

    def hook(mod, args, out) -> None:  # runs inside the sized forward
        inside.update(_observe(model), sizing_sees=mod.weight)

    handle = model.conv_out.register_forward_hook(hook)
    with MetaSizer([model], torch.bfloat16) as meta:
        run16(g)
        after_run = _observe(model)
    handle.remove()
    for seen in (inside, after_run):
        assert not seen["fake"]
        assert all(a is b for a, b in zip(seen["tensors"], before, strict=True))
        assert seen["attr"] is before[0] and seen["bytes"] == real_bytes
    assert isinstance(inside["sizing_sees"], FakeTensor) and inside["sizing_sees"].dtype == torch.bfloat16
    # the sizing itself is unchanged: the same bytes as a real run (float32 here)
    with MetaSizer([model], torch.float32) as m32:
        run(g)
    with PeakTracker() as real:
        run(g)
    assert m32.peak_bytes == real.peak_bytes > 0 and meta.peak_bytes < m32.peak_bytes
    assert (
        type(model.conv_in._parameters) is dict and list(model.parameters()) + list(model.buffers()) == before
    )


def test_nested_meta_sizing_restores_each_level() -> None:
    model = _Toy().eval()
    weight = model.conv_in.weight
    with MetaSizer([model], torch.float32):
        outer = model.conv_in.weight
        with MetaSizer([model], torch.bfloat16):
            assert model.conv_in.weight.dtype == torch.bfloat16
        assert model.conv_in.weight is outer and isinstance(outer, FakeTensor)
    assert model.conv_in.weight is weight and type(model.conv_in._parameters) is dict
