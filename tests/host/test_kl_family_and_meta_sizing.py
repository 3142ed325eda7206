"""On the host's own classes: only the KL decoder the shipped ``kl`` cost models were measured on is the
``kl`` family (SD/SDXL and FLUX fixtures are; a KL ``Decoder`` of another configuration is not), and meta
sizing a real VAE leaves its live weights in place for every other thread."""

from __future__ import annotations

import threading
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from vramfit.memory.cost import exact as dp
from vramfit.memory.geometry import Geometry
from vramfit.memory.measure.sizing import MetaSizer, decode_run
from vramfit.memory.vae.families import identify

from scripts.fixtures.image import KL_DDCONFIG
from scripts.fixtures.weights import build_model

pytestmark = pytest.mark.host


def test_fixture_kl_vaes_are_the_kl_family(kl_vae, flux_vae) -> None:
    assert identify(kl_vae) == "kl"
    assert identify(flux_vae) == "kl"


@pytest.mark.usefixtures("comfy")
def test_flux2_is_its_own_structure() -> None:
    """FLUX.2's VAE (the SD KL decoder at z 32 behind a latent BatchNorm, 128 channels at 16x) is no ``kl``:
    its untiled cost models are keyed by its structure, and its exact ones by its own structure signature
    (the BatchNorm's rescale) while FLUX.1's share SD's signature under their own class name."""
    models = {kind: build_model(kind, "meta") for kind in ("kl_f8", "flux", "flux2")}
    vae = types.SimpleNamespace(first_stage_model=models["flux2"], upscale_ratio=16, latent_dim=2,
                                latent_channels=128)  # fmt: skip
    assert identify(vae) is None
    sig = {kind: dp.structure_signature(m) for kind, m in models.items()}
    assert sig["flux"] == sig["kl_f8"] != sig["flux2"]
    keys = {kind: dp.exact_key(m, torch.float32, "cpu", False, True) for kind, m in models.items()}
    assert len(set(keys.values())) == 3


def _meta_kl_vae(**ddconfig) -> types.SimpleNamespace:
    """A ComfyUI ``AutoencoderKL`` of ``KL_DDCONFIG`` updated by ``ddconfig`` (weights on ``meta``)."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    dd = dict(KL_DDCONFIG, **ddconfig)
    with torch.device("meta"):
        model = AutoencoderKL(ddconfig=dd, embed_dim=dd["z_channels"])
    return types.SimpleNamespace(first_stage_model=model, upscale_ratio=8, latent_dim=2,
                                 latent_channels=dd["z_channels"])  # fmt: skip


@pytest.mark.usefixtures("comfy")
def test_other_kl_decoder_configurations_are_not_the_kl_family() -> None:
    assert identify(_meta_kl_vae()) == "kl"
    assert identify(_meta_kl_vae(z_channels=16)) == "kl"
    for variant in ({"ch_mult": [1, 2, 2, 4]}, {"ch": 64}, {"num_res_blocks": 1}, {"attn_resolutions": [32]},
                    {"out_ch": 4}, {"z_channels": 16, "ch_mult": [1, 2, 4, 8]}):  # fmt: skip
        assert identify(_meta_kl_vae(**variant)) is None, variant


def test_meta_sizing_a_real_vae_leaves_its_weights_to_other_threads(kl_vae) -> None:
    model = kl_vae.first_stage_model
    before = list(model.parameters())
    seen: dict[str, object] = {}

    def look() -> None:
        now = list(model.parameters())
        seen["same"] = len(now) == len(before) and all(a is b for a, b in zip(now, before, strict=False))
        seen["fake"] = any(isinstance(t, FakeTensor) for t in now)

    def hook(mod, args, out) -> None:  # inside the sized decode
        seen["sizing_sees_fake"] = isinstance(mod.weight, FakeTensor)
        t = threading.Thread(target=look)
        t.start()
        t.join()

    handle = model.decoder.conv_out.register_forward_hook(hook)
    try:
        with MetaSizer([model], torch.float32) as meta:
            decode_run(model.decode, 4, torch.float32)(Geometry(4, 4))
    finally:
        handle.remove()
    assert meta.peak_bytes > 0 and seen == {"sizing_sees_fake": True, "same": True, "fake": False}
