"""Reference decodes shared by the video test modules (import as ``tests.video_refs``).

ComfyUI's ``VAEDecode`` of a fixture video VAE is the slowest step of most video tests; the node tests
(``tests/host/test_node_video_decode.py``) and the executor's host tests (``test_video_chunked_host.py``)
compare with the same latents, so each reference is decoded once per test process.
"""

from __future__ import annotations

from typing import Any

import torch

WAN21 = (1, 16, 4, 3, 5)
"""13 frames of 24x40 px: odd latent, chunks [0, 1), [1, 3), [3, 4) with k = 2."""
WAN22 = (1, 48, 3, 1, 3)
"""9 frames of 16x48 px: odd latent."""
HUNYUAN = (1, 16, 5, 4, 4)
"""17 frames of 32x32 px."""
SEEDS = {"wan21": 0, "wan22": 1, "hunyuan_video": 5}

_REFS: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}


def reference(comfy: Any, fixture_vaes: dict, kind: str, shape: tuple[int, ...],
              seed: int | None = None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """``(vae, z, VAEDecode(z))`` for a fixture VAE ``kind`` (a narrow twin: the seed of its full kind) and a
    structured latent, decoded once."""
    from scripts.fixtures.kinds import FIXTURES
    from scripts.fixtures.latents import structured_latent

    seed = SEEDS.get(FIXTURES[kind].full or kind, 0) if seed is None else seed
    key = (kind, tuple(shape), seed)
    if key not in _REFS:
        z = structured_latent(shape, seed=seed)
        with torch.inference_mode():  # as ComfyUI runs nodes, loaders included (0.33 post-processes in place)
            vae = fixture_vaes.load(comfy, kind)
            (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
        _REFS[key] = (vae, z, ref)
    return _REFS[key]


def tiny_wan(version: str, seed: int = 0) -> torch.nn.Module:
    """A tiny Wan 2.1 / 2.2 ``first_stage_model`` from the host's own classes (``comfy.ldm.wan.vae`` /
    ``vae2_2``, ``dim=8``: every layer and cache protocol of the host, 8-32 channels), weights initialised as
    the fixture generator does. ComfyUI must be importable (``scripts.host.import_comfy``)."""
    import importlib

    from scripts.fixtures.weights import _materialise

    mod = importlib.import_module("comfy.ldm.wan.vae" if version == "2.1" else "comfy.ldm.wan.vae2_2")
    kw = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
    with torch.device("meta"):
        if version == "2.1":
            model = mod.WanVAE(dim=8, z_dim=4, **kw)
        else:
            model = mod.WanVAE(dim=8, dec_dim=8, z_dim=4, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _materialise(model, torch.float32)
    return model.eval()


def _tiny(build: Any, seed: int) -> torch.nn.Module:
    """``build()`` on the meta device, materialised as the fixture generator does (seeded)."""
    from scripts.fixtures.weights import _materialise

    with torch.device("meta"):
        model = build()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        _materialise(model, torch.float32)
    return model.eval()


TINY_LTX_RATIO = 8
"""Image px per latent px of :func:`tiny_ltx` (2x2 patchify, a strided and a space-to-depth downsample)."""


def tiny_ltx(seed: int = 0) -> torch.nn.Module:
    """A tiny LTX-Video ``VideoVAE`` from the host's own class (pixel norms, causal convolutions, a 2x2x2 strided
    and a 1x2x2 space-to-depth downsample, 2x2 patchify: 8x in space, 2x in time; 8-32 channels, 128 latent
    channels as the host's latent statistics have)."""
    import importlib

    ltx = importlib.import_module("comfy.ldm.lightricks.vae.causal_video_autoencoder")
    enc = [["res_x", {"num_layers": 1}], ["compress_all_x_y", {"multiplier": 2}], ["res_x", {"num_layers": 1}],
           ["compress_space_res", {"multiplier": 2}], ["res_x", {"num_layers": 1}]]
    cfg = {"dims": 3, "latent_channels": 128, "encoder_blocks": enc, "decoder_blocks": [["res_x", {"num_layers": 1}]],
           "patch_size": 2, "norm_layer": "pixel_norm", "causal_decoder": False, "encoder_base_channels": 8,
           "decoder_base_channels": 8, "latent_log_var": "uniform"}
    return _tiny(lambda: ltx.VideoVAE(config=cfg), seed)


TINY_HV15_RATIO = 4
"""Image px per latent px of :func:`tiny_hv15`."""


def tiny_hv15(seed: int = 0) -> torch.nn.Module:
    """A tiny HunyuanVideo 1.5 ``first_stage_model`` from the host's own classes (``vae_refiner`` at 8-16
    channels: RMS norms, carried causal convolutions, space-to-depth in space and time, mid attention; 4x in
    space, 2x in time)."""
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    module = "comfy.ldm.hunyuan_video.vae_refiner"
    dd = {"block_out_channels": [8, 16, 16], "in_channels": 3, "out_channels": 3, "num_res_blocks": 1,
          "ffactor_spatial": 4, "ffactor_temporal": 2, "downsample_match_channel": True,
          "upsample_match_channel": True, "z_channels": 4}
    return _tiny(lambda: AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.EmptyRegularizer"},
        encoder_config={"target": f"{module}.Encoder", "params": dd},
        decoder_config={"target": f"{module}.Decoder", "params": dd}), seed)
