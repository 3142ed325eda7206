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
    """``(vae, z, VAEDecode(z))`` for a fixture VAE ``kind`` and a structured latent, decoded once."""
    from scripts.fixtures import structured_latent

    seed = SEEDS.get(kind, 0) if seed is None else seed
    key = (kind, tuple(shape), seed)
    if key not in _REFS:
        z = structured_latent(shape, seed=seed)
        with torch.inference_mode():  # as ComfyUI runs nodes, loaders included (0.33 post-processes in place)
            vae = comfy.VAELoader().load_vae(fixture_vaes[kind])[0]
            (ref,) = comfy.VAEDecode().decode(vae, {"samples": z})
        _REFS[key] = (vae, z, ref)
    return _REFS[key]


def tiny_wan(version: str, seed: int = 0) -> torch.nn.Module:
    """A tiny Wan 2.1 / 2.2 ``first_stage_model`` from the host's own classes (``comfy.ldm.wan.vae`` /
    ``vae2_2``, ``dim=8``: every layer and cache protocol of the host, 8-32 channels), weights initialised as
    the fixture generator does. ComfyUI must be importable (``scripts.host.import_comfy``)."""
    import importlib

    from scripts import fixtures

    mod = importlib.import_module("comfy.ldm.wan.vae" if version == "2.1" else "comfy.ldm.wan.vae2_2")
    kw = dict(dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[], temperal_downsample=[False, True, True])
    with torch.device("meta"):
        if version == "2.1":
            model = mod.WanVAE(dim=8, z_dim=4, **kw)
        else:
            model = mod.WanVAE(dim=8, dec_dim=8, z_dim=4, **kw)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        fixtures._materialise(model, torch.float32)
    return model.eval()
