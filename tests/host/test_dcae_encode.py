"""Sana's DC-AE encoded exactly in tiles (issue 24): its ResBlock stages (local) in tiles extended by their traced
reach, its EfficientViT stages (global linear attention) once on the whole 1/8-resolution map, through the
prefix/suffix split (``vae.encode_split`` + ``executors.split_encode``), vs the encoder's own forward.

* the engine on a tiny diffusers ``AutoencoderDC`` (the real classes): <= 5e-5 max abs (float32; measured 9e-6)
  in >= 4 tiles; a halo below the traced reach differs by > 1e-3 (so the test can fail); an OOM inside a tile splits it and resumes;
  ComfyUI_ExtraModels' copy of the classes (module ``VAE.models.dcae``) is recognised for encode and decode;
* Tiled VAE Encode on the fixture loaded as ComfyUI_ExtraModels' ``ExtraVAELoader`` does (``scripts/sana_vae.py``)
  vs core ``VAE Encode`` on the same VAE (the loader's own ``encode``): exact tiles (>= 4) within 1e-4 after the
  self-check, an image whose sides are not multiples of 32 centre-cropped as ComfyUI crops its own VAEs' input, an
  OOM inside a tile resumed.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]
log = logging.getLogger("vramfit.tests.dcae_encode")

TINY = {
    "in_channels": 3,
    "latent_channels": 4,
    "attention_head_dim": 4,
    "encoder_block_types": ["ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
    "decoder_block_types": ["ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
    "encoder_block_out_channels": [8, 16, 32, 32],
    "decoder_block_out_channels": [8, 16, 32, 32],
    "encoder_layers_per_block": [1, 1, 1, 1],
    "decoder_layers_per_block": [1, 1, 1, 1],
    "encoder_qkv_multiscales": [[], [], [5], [5]],
    "decoder_qkv_multiscales": [[], [], [5], [5]],
    "upsample_block_type": "interpolate",
    "downsample_block_type": "Conv",
}
TINY_RATIO = 8  # three downsampling blocks; the prefix ends before stage 2 (attention): 1/4, one more below it


def _engine(mod, name: str):
    """A module of the engine of the package ComfyUI loaded the node from."""
    return sys.modules[mod.__name__.rsplit(".nodes.", 1)[0] + f".memory.{name}"]


@pytest.fixture(scope="module")
def node_mod(comfy):
    m = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_TiledVAEEncode"].__module__]
    yield m
    m._FAULT_HOOK = None


@pytest.fixture(scope="module")
def tiny(comfy):
    from scripts.sana_vae import _dcae_class

    # diffusers' AutoencoderDC returning tensors, as ExtraModels' class

    torch.manual_seed(0)
    m = _dcae_class()(**TINY).eval()
    with torch.no_grad():  # nonzero RMSNorm biases: a tile's halo that were missing would show
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def _x(h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand((1, 3, h, w), generator=g) * 2 - 1


def _split(node_mod, model):
    es = _engine(node_mod, "vae.encode_split")
    split, reason = es.encode_split(model)
    assert reason is None and split.name == "dc-ae", reason
    ratio = es.prefix_ratio(model, split, TINY_RATIO)
    halo = _engine(node_mod, "executors.split_encode").split_halo(
        model, split, ratio, 3, torch.float32, torch.device("cpu"), False)
    return split, ratio, halo


def test_tiles_equal_the_encoders_own_forward(node_mod, tiny):
    se = _engine(node_mod, "executors.split_encode")
    split, ratio, halo = _split(node_mod, tiny)
    assert ratio == 4 and 1 <= halo <= 8, (ratio, halo)
    x = _x(64, 160)  # 16 x 40 prefix px: tiles of 5 -> 4 x 8
    calls: list[int] = []
    with torch.inference_mode():
        ref = tiny.encode(x)
        out = se.encode_split_tiled(tiny, x, 5, ratio, split, progress=lambda d, t: calls.append(d))
        short = se.encode_split_tiled(tiny, x, 5, ratio, split, halo=max(0, halo - 2))
    diff, off = (out - ref).abs().max().item(), (short - ref).abs().max().item()
    log.info("dc-ae tiny: split vs encode %.2e, halo %d prefix px; halo - 2: %.2e", diff, halo, off)
    assert out.shape == ref.shape and diff <= 5e-5
    assert len(calls) == 4 * 8
    assert off > 1e-3


def test_an_oom_inside_a_tile_splits_it_and_resumes(node_mod, tiny):
    se = _engine(node_mod, "executors.split_encode")
    split, ratio, halo = _split(node_mod, tiny)
    x = _x(64, 128, seed=1)
    fired: list[int] = []

    def fault(k: int) -> None:
        if k == 2 and not fired:
            fired.append(k)
            raise torch.OutOfMemoryError("injected")

    with torch.inference_mode():
        ref = tiny.encode(x)
        out = se.encode_split_tiled(tiny, x, 8, ratio, split, fault_hook=fault, on_oom=lambda: fired.append(-1))
    assert fired == [2, -1]
    assert (out - ref).abs().max().item() <= 5e-5


def test_extramodels_copy_of_the_classes_is_recognised(node_mod, tiny):
    """ComfyUI_ExtraModels' ``VAE/models/dcae.py`` holds diffusers' classes, copied: same structure, another module."""
    import copy

    es, sl = _engine(node_mod, "vae.encode_split"), _engine(node_mod, "vae.split_layout")
    m = copy.deepcopy(tiny)
    for part in (m.encoder, m.decoder):
        part.__class__ = type(type(part).__name__, (type(part),), {"__module__": "ComfyUI_ExtraModels.VAE.models.dcae"})
    split, reason = es.encode_split(m)
    assert reason is None and split.name == "dc-ae"
    assert sl.split_layout(m).reason is None
    m.encoder.__class__ = type("Encoder", (type(tiny.encoder),), {"__module__": "other.pack.vae"})
    assert es.encode_split(copy.deepcopy(m))[0] is None


def test_a_prefix_scale_that_does_not_fit_is_refused(node_mod, tiny):
    """The trace checks the description's scale: a wrong one is no exact path (never misaligned tiles)."""
    es, se = _engine(node_mod, "vae.encode_split"), _engine(node_mod, "executors.split_encode")
    split, _ = es.encode_split(tiny)
    with pytest.raises(ValueError, match="prefix gives"):
        se.split_halo(tiny, split, 8, 3, torch.float32, torch.device("cpu"), False)


# ------------------------------------------------------------------------------------------------ the node


@pytest.fixture(scope="module")
def dcae(host_config, fixture_vaes):
    from scripts.sana_vae import load_dcae

    return load_dcae(str(host_config.models_dir / "vae" / fixture_vaes["dcae_sana"]), torch.float32)


def _pixels(h: int, w: int, seed: int) -> torch.Tensor:
    from tests.host.test_tiled_encode_exact import _pixels as pixels

    return pixels(1, h, w, seed=seed)


def test_tiled_vae_encode_is_exact_on_the_sana_vae(comfy, node_mod, dcae):
    pixels = _pixels(72, 272, seed=3)  # centre-cropped to 64 x 256 (offsets 4, 8), as VAE Encode crops
    with torch.inference_mode():
        (ref,) = comfy.VAEEncode().encode(dcae, pixels[:, 4:68, 8:264])
        r = node_mod.encode(dcae, pixels, tile_size=64)
    rows = dict(r.report.rows)
    text = r.report.text()
    assert r.plan.path == "exact" and r.plan.config.tile == 64, text
    assert "EfficientViT" in rows["path"] and "self-check passed" in rows["check"], text
    assert r.plan.config.grid((64, 256)) == (1, 4), text
    assert r.latent.dtype == torch.float32 and r.latent.shape == ref["samples"].shape == (1, 32, 2, 8)
    diff = (r.latent - ref["samples"]).abs().max().item()
    log.info("dc-ae fixture: Tiled VAE Encode vs VAE Encode %.2e", diff)
    assert diff <= 1e-4, text


def test_an_oom_in_a_tile_of_the_sana_vae_resumes(comfy, node_mod, dcae):
    pixels = _pixels(64, 256, seed=4)
    fired: list[tuple[str, int]] = []

    def hook(kind: str, k: int) -> None:
        if kind == "tile" and k == 3 and not fired:
            fired.append((kind, k))
            raise torch.OutOfMemoryError("injected")

    node_mod._FAULT_HOOK = hook
    try:
        with torch.inference_mode():
            (ref,) = comfy.VAEEncode().encode(dcae, pixels)
            r = node_mod.encode(dcae, pixels, tile_size=64)
    finally:
        node_mod._FAULT_HOOK = None
    assert fired == [("tile", 3)]
    assert "tile halved" in dict(r.report.rows)["oom"], r.report.text()
    assert (r.latent - ref["samples"]).abs().max().item() <= 1e-4


class _WithRatio:
    """The EXVAE with the encode ratio ComfyUI's own VAEs carry (``VAEEncodeForInpaint`` reads it), its own
    ``encode``: what the core node would compute if it could run this VAE."""

    downscale_ratio = 32

    def __init__(self, vae):
        self._vae = vae

    def __getattr__(self, name):
        return getattr(self._vae, name)

    def spacial_compression_encode(self) -> int:
        return 32


def test_inpaint_companion_runs_the_sana_vae(comfy, dcae):
    """Core ``VAE Encode (for Inpainting)`` fails on ExtraModels' VAE (it reads ComfyUI's encode ratio); the
    companion gives it the VAE's ``latent_scale``: the core node's preprocessing and noise mask, exact tiles."""
    pixels = _pixels(72, 256, seed=5)  # cropped to 64 x 256
    mask = torch.zeros(1, 72, 256)
    mask[:, 10:50, 40:120] = 1.0
    with torch.inference_mode(), pytest.raises(AttributeError):
        comfy.VAEEncodeForInpaint().encode(dcae, pixels, mask, 6)
    inpaint = sys.modules[comfy.NODE_CLASS_MAPPINGS["VRAMFit_VAEEncodeForInpaint"].__module__]
    with torch.inference_mode():
        (ref,) = comfy.VAEEncodeForInpaint().encode(_WithRatio(dcae), pixels, mask, 6)
        latent, result = inpaint.encode_inpaint(dcae, pixels, mask, 6, tile_size=64)
    assert result.plan.path == "exact", result.report.text()
    assert torch.equal(latent["noise_mask"], ref["noise_mask"])
    assert (latent["samples"] - ref["samples"]).abs().max().item() <= 1e-4
