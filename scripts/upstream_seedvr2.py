"""The newest upstream SeedVR2 video VAE (``comfy/ldm/seedvr/vae.py`` at the commit ``tests/upstream/MANIFEST.json``
names) as a user's ComfyUI would hold it: a ``comfy.sd.VAE`` whose ``first_stage_model`` is that module's
``VideoAutoencoderKLWrapper``, with the attributes the newest ``comfy/sd.py``'s SeedVR2 branch sets (its memory
estimates from the model, ``handles_tiling``, the 4n+1 frame formulas, ...).

Narrow and random: the module's own classes and key names, built with a quarter of ``block_out_channels``
(32/64/128/128, as the ``seedvr2_narrow`` fixture twin of 0.33.0's class), every layer re-initialised as
``scripts.fixtures`` does (the ``torch.nn`` class's ``reset_parameters`` under a fixed seed, causal temporal taps
leaning on the current frame), then loaded through the host's own ``comfy.sd.VAE(sd=...)``. The newest ``sd.py``
does not import over a 0.33.0 host (``scripts.upstream``), so the 0.33.0 constructor builds the model (its SeedVR2
branch tells the family by the same key and calls the same constructor) and the newest branch's attributes are set
over its own. Call inside :func:`scripts.upstream.newest`. Test harness only; the pack never imports this.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("vramfit.upstream_seedvr2")

MODULE = "comfy.ldm.seedvr.vae"
NARROW = 4
"""Channel divisor of the narrow build (the module's ``BYTEDANCE_BLOCK_OUT_CHANNELS`` 128/256/512/512 -> 32/64/128/128;
32 GroupNorm groups still divide every width)."""


def _module() -> Any:
    from scripts.upstream import path_of

    mod = sys.modules.get(MODULE)
    if mod is None or getattr(mod, "__file__", None) != str(path_of(MODULE)):
        raise RuntimeError(f"{MODULE} is not the newest stored upstream file: build inside scripts.upstream.newest()")
    return mod


@contextlib.contextmanager
def narrow_widths(mod: Any, div: int = NARROW) -> Iterator[None]:
    """Inside, the module's ``Encoder3D`` and ``Decoder3D`` are built with ``block_out_channels // div`` (the wrapper
    passes it as their third argument): same classes, keys, kernels and norms, narrower."""
    orig = {name: getattr(mod, name) for name in ("Encoder3D", "Decoder3D")}

    def narrower(cls: type):
        def build(in_channels, out_channels, block_out_channels, *a, **kw):
            return cls(in_channels, out_channels, tuple(c // div for c in block_out_channels), *a, **kw)

        return build

    for name, cls in orig.items():
        setattr(mod, name, narrower(cls))
    try:
        yield
    finally:
        for name, cls in orig.items():
            setattr(mod, name, cls)


@contextlib.contextmanager
def no_pinned_offload() -> Iterator[None]:
    """Inside, on a machine without CUDA, ``comfy.model_management.ensure_pin_budget`` answers no: nothing can be
    pinned or copied on a CUDA stream there. The newest file asks it (``_offload_caches_for``) whether to park frames
    and carried caches in pinned host memory (``CausalMemoryCache.park``: ``torch.cuda.Event``, CUDA streams); 0.33.0's
    (as the newest ``model_management``'s) says yes on a CPU with free RAM, and the newest encode then fails on the
    CPU (``pin_memory(evict_active=)``, a CUDA event). A no-op where CUDA is available."""
    import comfy.model_management as mm

    if torch.cuda.is_available():
        yield
        return
    orig = mm.ensure_pin_budget
    mm.ensure_pin_budget = lambda *a, **k: False
    try:
        yield
    finally:
        mm.ensure_pin_budget = orig


def state_dict(seed: int = 0, div: int = NARROW) -> dict[str, torch.Tensor]:
    """Random weights of the narrow model (float32, CPU), keyed as the module's state dict (a released file's keys)."""
    from scripts.fixtures.weights import _eager_weights, _materialise

    mod = _module()
    with torch.device("meta"), narrow_widths(mod, div), _eager_weights():
        model = mod.VideoAutoencoderKLWrapper()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _materialise(model.eval(), torch.float32)
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def newest_branch(vae: Any) -> None:
    """The attributes the newest ``comfy/sd.py`` (``VAE.__init__``, its ``seedvr2`` branch) sets on ``vae``."""
    mod = _module()
    model = vae.first_stage_model
    vae.latent_channels = mod.SEEDVR2_LATENT_CHANNELS
    vae.latent_dim = 3
    vae.disable_offload = True
    vae.memory_used_decode = model.comfy_memory_used_decode
    vae.memory_used_encode = model.comfy_memory_used_encode
    vae.working_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    vae.handles_tiling = True
    vae.format_encoded = model.comfy_format_encoded
    vae.downscale_ratio = (lambda a: max(0, math.floor((a + 3) / 4)), 8, 8)
    vae.downscale_index_formula = (4, 8, 8)
    vae.upscale_ratio = (lambda a: max(0, a * 4 - 3), 8, 8)
    vae.upscale_index_formula = (4, 8, 8)
    vae.process_input = lambda image: image * 2.0 - 1.0
    vae.crop_input = False


def build(seed: int = 0, div: int = NARROW, dtype: torch.dtype | None = None) -> Any:
    """The narrow newest SeedVR2 VAE as a ``comfy.sd.VAE`` (``dtype``: the VAE's working dtype, default the host's
    choice: float32 on a CPU). Inside :func:`scripts.upstream.newest`."""
    import comfy.sd

    mod = _module()
    sd = state_dict(seed, div)
    with narrow_widths(mod, div):
        vae = comfy.sd.VAE(sd=sd, dtype=dtype)
    model = vae.first_stage_model
    if type(model) is not mod.VideoAutoencoderKLWrapper:
        raise RuntimeError(f"the host built {type(model).__module__}.{type(model).__qualname__}, not the newest "
                           "SeedVR2 wrapper")
    newest_branch(vae)
    got = {k: v for k, v in model.state_dict().items()}
    if set(got) != set(sd):
        raise RuntimeError(f"keys differ: missing {sorted(set(sd) - set(got))[:3]}, extra "
                           f"{sorted(set(got) - set(sd))[:3]}")
    log.info("newest SeedVR2 VAE (1/%d widths): %d parameters, %s", div, sum(v.numel() for v in sd.values()),
             vae.vae_dtype)
    return vae
