"""Random-weight diffusion models with real architectures, for the GPU suite's field scenes.

The VAE decode cases of the field start with a big diffusion model resident on the GPU. These files
give ComfyUI's ``UNETLoader`` (``comfy.sd.load_diffusion_model``) and the bf16 Loader exactly that: the
modules are ComfyUI's own classes built with the configuration ComfyUI's ``model_detection`` reads back
from the keys, with random weights (normal, std 0.02; norms 1; biases 0), saved as bfloat16 safetensors in
``models/diffusion_models``. The outputs are not images; the memory footprint and the compute are real.

The configuration is what the host's own ``model_detection`` reads from the keys (:func:`build`), so the
module matches each host's classes.

* ``pixart_1600m``: PixArt-Sigma (``comfy.ldm.pixart.pixartms.PixArtMS``, hidden 1152, 16 heads) at depth
  75, ~1.6B parameters: the size of Sana 1600M (Sana itself is not a ComfyUI architecture; PixArt is its
  predecessor from the same authors). ``depth`` is a parameter (the dry run uses 2).
* ``flux``: FLUX.1-dev (``comfy.ldm.flux.model.Flux``, hidden 3072, 24 heads, guidance embedding) with
  ``depth`` double and ``single`` single blocks (FLUX.1-dev: 19 / 38, ~11.9B parameters).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import pathlib
import time
from typing import Any

import safetensors.torch
import torch

log = logging.getLogger("vramfit.diffusion_fixtures")

def _probe_keys(kind: str, depth: int, single: int) -> dict[str, torch.Tensor]:
    """The keys (meta tensors of the real shapes) that ``model_detection`` reads to recognise ``kind``."""
    def t(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    if kind == "pixart_1600m":  # PixArt-Sigma: hidden 1152, T5 context 4096, 300 tokens
        keys = {"t_block.1.weight": t(6 * 1152, 1152), "y_embedder.y_embedding": t(300, 4096),
                "x_embedder.proj.weight": t(1152, 4, 2, 2)}
        keys.update({f"blocks.{i}.scale_shift_table": t(6, 1152) for i in range(depth)})
        return keys
    if kind == "flux":  # FLUX.1-dev: hidden 3072, T5 4096, CLIP-L pooled 768, guidance embedding
        keys = {"img_in.weight": t(3072, 64), "txt_in.weight": t(3072, 4096),
                "vector_in.in_layer.weight": t(3072, 768), "guidance_in.in_layer.weight": t(3072, 256),
                "final_layer.linear.weight": t(64, 3072)}
        keys.update({f"double_blocks.{i}.img_attn.norm.key_norm.scale": t(128) for i in range(depth)})
        keys.update({f"single_blocks.{i}.norm.key_norm.scale": t(128) for i in range(single)})
        return keys
    raise KeyError(kind)


def build(kind: str, depth: int, single: int = 0, device: str | torch.device = "meta") -> torch.nn.Module:
    """The bare diffusion module, built as ComfyUI builds it for a file with these keys: the config comes
    from the host's own ``model_detection`` (so it matches whatever that host's classes require)."""
    import comfy.model_detection
    import comfy.ops

    probe = _probe_keys(kind, depth, single)
    unet_config = comfy.model_detection.detect_unet_config(probe, "")
    if unet_config is None:
        raise ValueError(f"ComfyUI does not recognise the {kind} probe keys")
    model_config = comfy.model_detection.model_config_from_unet_config(unet_config, probe)
    if model_config is None:
        raise ValueError(f"ComfyUI has no model for {kind}: {unet_config}")
    module = importlib.import_module({"pixart_1600m": "comfy.ldm.pixart.pixartms", "flux": "comfy.ldm.flux.model"}[kind])
    cls = getattr(module, {"pixart_1600m": "PixArtMS", "flux": "Flux"}[kind])
    kwargs = dict(model_config.unet_config)
    return cls(**kwargs, dtype=torch.bfloat16, device=device, operations=comfy.ops.disable_weight_init)


def _init_(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        t.zero_()
    elif "norm" in name and leaf in ("weight", "scale"):
        t.fill_(1.0)
    else:
        t.normal_(0.0, 0.02, generator=gen)


def write(kind: str, path: pathlib.Path, depth: int, single: int = 0, device: str = "cpu",
          seed: int = 0) -> dict[str, Any]:
    """Write the file (bfloat16) unless one with the same kind/depth/seed is there; returns its facts."""
    path = pathlib.Path(path)
    t0 = time.perf_counter()
    model = build(kind, depth, single, device="meta")
    shapes = sorted((k, tuple(v.shape)) for k, v in model.state_dict().items())
    layout = hashlib.sha1(repr(shapes).encode()).hexdigest()[:16]
    meta = {"vramfit_fixture_kind": kind, "vramfit_depth": f"{depth}/{single}", "vramfit_seed": str(seed),
            "vramfit_layout": layout}
    if path.is_file():  # reused only when this host builds the very same keys and shapes
        with safetensors.safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}) == meta:
                params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
                return {"path": str(path), "params": params, "reused": True}
    gen = torch.Generator(device=device).manual_seed(seed)
    sd = {}
    with torch.no_grad():
        for name, t in list(model.state_dict().items()):
            real = torch.empty(t.shape, dtype=torch.float32, device=device)
            _init_(name, real, gen)
            sd[name] = real.to(torch.bfloat16).cpu()
            del real
    params = sum(v.numel() for v in sd.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    safetensors.torch.save_file(sd, str(tmp), metadata=meta)
    tmp.replace(path)
    log.info("%s: wrote %s (%.2fB params, %.1f GiB, %.1f s)", kind, path, params / 1e9,
             path.stat().st_size / 2**30, time.perf_counter() - t0)
    return {"path": str(path), "params": params, "reused": False}


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
