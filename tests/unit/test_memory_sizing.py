"""Meta sizing (fake tensors) against real decodes of a toy decoder; first-use calibration + cache;
family recognition on VAE-like objects."""

from __future__ import annotations

import types

import pytest
import torch
from vramfit.memory.cost.calibration import (
    calibrate_vae,
    cost_model_for,
    fit_grid,
    real_grid,
    subject,
    vae_key,
)
from vramfit.memory.cost.phases import CostModelStore
from vramfit.memory.geometry import Geometry, VaeGeometry
from vramfit.memory.measure.sizing import MetaSizer, decode_run, latent_shape
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.vae.families import FAMILIES, identify, model_name, vae_geometry


class ToyDecoder(torch.nn.Module):
    """4x upsampling conv decoder with GroupNorm and a latent-resolution attention (like a VAE)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = torch.nn.Conv2d(4, 32, 3, padding=1)
        self.norm = torch.nn.GroupNorm(8, 32)
        self.up1 = torch.nn.Conv2d(32, 16, 3, padding=1)
        self.up2 = torch.nn.Conv2d(16, 8, 3, padding=1)
        self.conv_out = torch.nn.Conv2d(8, 3, 3, padding=1)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        b, c, hh, ww = h.shape
        q = h.reshape(b, c, hh * ww)
        attn = torch.softmax(torch.bmm(q.transpose(1, 2), q), dim=-1)  # (hw)^2: quadratic
        h = h + torch.bmm(q, attn).reshape(b, c, hh, ww)
        del q, attn
        h = torch.nn.functional.silu(self.norm(h))
        h = self.up1(torch.nn.functional.interpolate(h, scale_factor=2.0))
        h = self.up2(torch.nn.functional.interpolate(h, scale_factor=2.0))
        return self.conv_out(h)


def toy_vae() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        first_stage_model=ToyDecoder().eval(),
        upscale_ratio=4,
        latent_dim=2,
        latent_channels=4,
        vae_dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_meta_sizer_equals_real_tracked_peak() -> None:
    vae = toy_vae()
    run = decode_run(vae.first_stage_model.decode, 4, torch.float32)
    for g in (Geometry(8, 8, spatial_ratio=4), Geometry(12, 20, batch=2, spatial_ratio=4)):
        with PeakTracker() as real:
            run(g)
        with MetaSizer([vae.first_stage_model], torch.float32) as meta:
            run(g)
        assert real.peak_bytes > 0
        assert meta.peak_bytes == real.peak_bytes, g.describe()
    # the weights were swapped back: the model still computes real numbers
    out = vae.first_stage_model.decode(torch.randn(1, 4, 4, 4))
    assert out.device.type == "cpu" and torch.isfinite(out).all()


def test_a_tracker_around_meta_sizing_counts_no_fake_bytes() -> None:
    """Sizing inside a measured block (a plan made while a decode is tracked) allocates nothing: an outer
    tracker must not count the fake weights and activations, while the sizer still sees its full peak."""
    vae = toy_vae()
    run = decode_run(vae.first_stage_model.decode, 4, torch.float32)
    g = Geometry(12, 20, batch=2, spatial_ratio=4)
    with PeakTracker(method="dispatch") as outer:
        with MetaSizer([vae.first_stage_model], torch.float32) as meta:
            run(g)
    with PeakTracker() as real:
        run(g)
    assert meta.peak_bytes == real.peak_bytes > 0
    assert outer.peak_bytes == 0, outer.peak_bytes


def test_meta_sizer_counts_a_store_in_host_memory_apart() -> None:
    """With ``track_host`` on an accelerator the fake tensors put in host memory are counted in
    ``host_peak_bytes``, apart from the device's peak; nothing is allocated (fake CUDA tensors on any machine)."""
    conv = torch.nn.Conv2d(4, 4, 3, padding=1)

    def run() -> None:
        x = conv(torch.empty(1, 4, 64, 64, device="cuda"))  # 64 KiB on the device
        kept = x.to("cpu")  # a store of it in host memory
        y = conv(x)
        del x, y, kept

    with MetaSizer([conv], torch.float32, "cuda", track_host=True) as s:
        run()
    assert s.host_peak_bytes == 4 * 64 * 64 * 4
    assert s.peak_bytes >= 2 * 4 * 64 * 64 * 4
    with MetaSizer([conv], torch.float32, "cuda") as s2:
        run()
    assert s2.host_peak_bytes == 0 and s2.peak_bytes == s.peak_bytes


def test_meta_sizer_huge_shape_and_dtype() -> None:
    vae = toy_vae()
    run32 = decode_run(vae.first_stage_model.decode, 4, torch.float32)
    run16 = decode_run(vae.first_stage_model.decode, 4, torch.bfloat16)
    g = Geometry(256, 256, spatial_ratio=4)  # 1024^2 px, attention 65536^2: 16 GiB in fp32
    with MetaSizer([vae.first_stage_model], torch.float32) as m32:
        run32(g)
    with MetaSizer([vae.first_stage_model], torch.bfloat16) as m16:
        run16(g)
    assert m32.peak_bytes > 16 * 2**30
    assert m16.peak_bytes * 2 == pytest.approx(m32.peak_bytes, rel=0.01)


def test_first_use_calibration_is_cached_and_predicts_real_peaks(tmp_path) -> None:
    vae = toy_vae()
    cache = tmp_path / "vramfit_costs.json"
    store = CostModelStore(cache, defaults_dir=None)
    model = cost_model_for(subject(vae), store)
    assert model.key == vae_key(subject(vae))
    assert model.key.family.startswith(model_name(vae) + ".") and model.key.device_type == "cpu"
    assert model_name(vae).endswith("ToyDecoder")
    assert len(model.points) == len(fit_grid(vae_geometry(vae)))
    # a real decode at a size not in the grid
    g = Geometry(40, 24, spatial_ratio=4)
    run = decode_run(vae.first_stage_model.decode, 4, torch.float32)
    with PeakTracker() as t:
        run(g)
    assert model.predict(g) == pytest.approx(t.peak_bytes, rel=0.05)
    # cached: a new store (new session) does not calibrate again
    calls = []
    store2 = CostModelStore(cache, defaults_dir=None)
    again = store2.get_or_calibrate(model.key, lambda: calls.append(1) or model)
    assert again == model and not calls


def test_real_mode_calibration() -> None:
    vae = toy_vae()
    model = calibrate_vae(subject(vae), mode="real")
    assert len(model.points) == len(real_grid(vae_geometry(vae)))
    assert model.inputs["mode"] == "real" and model.inputs["tracker"] == "dispatch"
    assert len(model.phases) == 1


def test_latent_shape() -> None:
    assert latent_shape(Geometry(3, 5, batch=2), 4) == (2, 4, 3, 5)
    assert latent_shape(Geometry(3, 5, latent_frames=7, temporal_ratio=4), 16) == (1, 16, 7, 3, 5)


def _fake_vae(
    cls_name: str, module: str, upscale_ratio, latent_dim: int, channels: int, decoder: str = "Decoder"
):
    dec_cls = type(decoder, (), {})
    model_cls = type(cls_name, (), {"__module__": module})
    model = model_cls()
    model.decoder = dec_cls()
    if decoder == "Decoder" and latent_dim == 2:  # the shipped KL decoder's structure (families.KL_DECODER)
        ns = types.SimpleNamespace
        model.decoder.__dict__.update(
            ch=128, num_res_blocks=2, tanh_out=False, mid=ns(attn_1=ns()),
            up=[ns(block=[ns(out_channels=w)] * 3, attn=[]) for w in (128, 256, 512, 512)],
            conv_in=ns(in_channels=channels, kernel_size=(3, 3)), conv_out=ns(out_channels=3, kernel_size=(3, 3)),
        )  # fmt: skip
    return types.SimpleNamespace(
        first_stage_model=model, upscale_ratio=upscale_ratio, latent_dim=latent_dim, latent_channels=channels
    )


def _wan_vae(layouts: dict, module: str, upscale_ratio, latent_dim: int, structure: tuple) -> types.SimpleNamespace:
    """A ``WanVAE`` whose decoder layout is ``structure`` (version, latent channels, image channels, patch, temporal
    kernel), kept in ``layouts`` (what the patched ``families.wan_layout`` returns)."""
    vae = _fake_vae("WanVAE", module, upscale_ratio, latent_dim, structure[1])
    version, channels, out, patch, kernel = structure
    layouts[id(vae.first_stage_model)] = types.SimpleNamespace(
        version=version, latent_channels=channels, out_channels=out, patch=patch, temporal_kernel=kernel)
    return vae


def test_identify_families(monkeypatch) -> None:
    from vramfit.memory.vae import families

    def video(s):
        return (lambda a: max(0, a * 4 - 3), s, s)

    layouts: dict = {}
    monkeypatch.setattr(families, "is_wan_vae", lambda m: id(m) in layouts)
    monkeypatch.setattr(families, "wan_layout", lambda m: layouts[id(m)])

    assert identify(_fake_vae("AutoencoderKL", "comfy.ldm.models.autoencoder", 8, 2, 4)) == "kl"
    assert identify(_fake_vae("AutoencodingEngine", "comfy.ldm.models.autoencoder", 8, 2, 16)) == "kl"
    wan21 = _wan_vae(layouts, "comfy.ldm.wan.vae", video(8), 3, ("2.1", 16, 3, 1, 3))
    assert identify(wan21) == "wan21"
    assert identify(_wan_vae(layouts, "comfy.ldm.wan.vae2_2", video(16), 3, ("2.2", 48, 3, 2, 3))) == "wan22"
    # Wan families are told by their decoder's structure, never by a module name: Qwen-Image 2.1's VAE is vae2_2's
    # WanVAE with 64 channels, temporal kernel 1, patch 1 and RGBA (an image VAE); a WanVAE without the structure is
    # no family either.
    assert identify(_wan_vae(layouts, "comfy.ldm.wan.vae2_2", 16, 2, ("2.2", 64, 4, 1, 1))) is None
    assert identify(_fake_vae("WanVAE", "comfy.ldm.wan.vae2_2", video(16), 3, 48)) is None
    assert (
        identify(_fake_vae("AutoencoderKL", "comfy.ldm.models.autoencoder", video(8), 3, 16))
        == "hunyuan_video"
    )
    svd = _fake_vae("AutoencodingEngine", "comfy.ldm.models.autoencoder", 8, 2, 4, decoder="VideoDecoder")
    assert identify(svd) is None
    unknown = _fake_vae("TAESD", "comfy.taesd.taesd", 8, 2, 4)
    assert identify(unknown) is None
    geo = vae_geometry(_fake_vae("Mochi", "x.y", (lambda a: a * 6 - 5, 8, 8), 3, 12))
    assert (geo.family, geo.spatial_ratio, geo.temporal_ratio) == ("x.y.Mochi", 8, 6)
    assert vae_geometry(wan21) == FAMILIES["wan21"].geometry


def test_vae_geometry_out_frames() -> None:
    v = VaeGeometry("wan21", 8, 4)
    assert [v.out_frames(t) for t in (0, 1, 2, 21)] == [1, 1, 5, 81]
    g = Geometry(4, 4, latent_frames=3, first_chunk=False, temporal_ratio=4)
    assert g.out_frames == 12 and g.frames_per_step == 4
    assert Geometry(4, 4, latent_frames=1, temporal_ratio=4).frames_per_step == 1
