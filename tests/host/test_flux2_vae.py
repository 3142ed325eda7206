"""FLUX.2's VAE (the ``flux2`` fixture: BFL's ``flux2-vae`` keys, random weights) on the host.

ComfyUI's ``VAELoader`` sees ``bn.running_mean`` and builds ``AutoencoderKL`` with ``batch_norm_latent``: the
latent has 128 channels (32 x a 2x2 patch) at 1/16 of the image, and the decode first undoes the BatchNorm
(``z * sqrt(var + eps) + mean``) and the patchify, then runs the SD KL decoder at z 32. Tiled VAE Decode takes
the exact path on it and equals core ``VAEDecode`` within float noise (max abs diff <= 1e-4 on [0, 1]).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from scripts.fixtures.kinds import FIXTURES
from scripts.fixtures.latents import structured_latent

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

TOL = 1e-4


@pytest.fixture(scope="module")
def tiled(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEDecode"].__module__]


@pytest.fixture(scope="module")
def flux2_vae(comfy, fixture_vaes):
    """The FLUX.2 fixture by ``VAELoader``; unloaded after the module (later tests count loaded models)."""
    import comfy.model_management as mm

    vae = comfy.VAELoader().load_vae(fixture_vaes["flux2"])[0]
    yield vae
    others = [lm for lm in mm.current_loaded_models if lm.model is not vae.patcher]
    mm.free_memory(1e30, vae.patcher.load_device, keep_loaded=others)


def test_flux2_loads_as_comfyui_detects_it(flux2_vae):
    spec = FIXTURES["flux2"]
    fsm = flux2_vae.first_stage_model
    assert (type(fsm).__module__, type(fsm).__name__) == (spec.module, spec.model_class) == (
        "comfy.ldm.models.autoencoder", "AutoencoderKL")
    assert flux2_vae.latent_channels == 128 and flux2_vae.spacial_compression_decode() == 16
    assert fsm.bn is not None and fsm.bn.num_features == 128 and tuple(fsm.ps) == (2, 2)
    assert fsm.decoder.conv_in.weight.shape[1] == 32 and fsm.post_quant_conv.weight.shape[:2] == (32, 32)
    assert float(fsm.bn.running_var.min()) > 0
    # The BatchNorm statistics are used: other statistics give another image.
    z = structured_latent((1, 128, 2, 2), seed=1)
    with torch.inference_mode():
        a = flux2_vae.decode(z)
        saved = fsm.bn.running_mean.clone()
        try:
            fsm.bn.running_mean.add_(1.0)
            b = flux2_vae.decode(z)
        finally:
            fsm.bn.running_mean.copy_(saved)
    assert a.shape == (1, 32, 32, 3) and (a - b).abs().mean().item() > 0.01


def test_flux2_tiles_are_exact(comfy, tiled, flux2_vae):
    z = structured_latent((1, 128, 5, 6), seed=5)  # 80 x 96 px: 3 x 3 tiles of 32 px
    with torch.inference_mode():
        ref = comfy.VAEDecode().decode(flux2_vae, {"samples": z})[0].clone()
        r = tiled.decode(flux2_vae, {"samples": z}, tile_size=32)
    text = r.report.text()
    assert r.plan.path == "exact" and r.plan.config.tile == 32 and not r.plan.config.whole, text
    h, w = r.images.shape[1:3]
    assert (h, w) == (80, 96) and math.ceil(h / 32) * math.ceil(w / 32) >= 4
    assert "self-check passed" in text, text
    assert ref.dtype == r.images.dtype == torch.float32
    diff = (r.images - ref).abs().max().item()
    assert diff <= TOL, (diff, text)
    assert r.images.std().item() > 0.02  # a real image, not a constant both decoders agree on
