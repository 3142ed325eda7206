"""ComfyUI glue shared by the node adapters: the only place ``nodes/`` touches ``comfy`` internals.

Everything here turns ComfyUI state into the plain inputs ``memory/`` takes (devices, free-memory
callables, progress and cancel callbacks, the OOM exception type, a cost-model cache path).
Imported only inside ComfyUI (by the node modules).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import logging
import pathlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import comfy.model_management as mm
import comfy.utils
import folder_paths
import torch
from comfy_api.v0_0_2 import io, ui

from ..memory.budget import Budget, compute_budget, weights_to_load
from ..memory.cost.phases import CostModelStore
from ..memory.offload import (
    DeviceResidency,
    OffloadReport,
    Residency,
    device_residency,
    evictable_bytes,
    is_dynamic,
    offload_for_decode,
    residency,
)

log = logging.getLogger("vramfit")

CATEGORY = "VRAM Fit"
_STORE: CostModelStore | None = None


class NodeInputError(ValueError):
    """Bad input to a VRAM Fit node; the message names the node and the value."""

    def __init__(self, node: str, message: str):
        super().__init__(f"[VRAM Fit · {node}] {message}")


# ComfyUI reports a failed node's exception type as ``<class __module__>.<qualname>`` (/history's
# ``exception_type``, the frontend's error dialog). Its custom-node loader names this package's modules
# after their folder path (``/…/custom_nodes/ComfyUI-VRAM-Fit.nodes._comfy``): a stable name instead.
NodeInputError.__module__ = "vramfit"


def latent_tensor(node: str, vae: Any, samples: Any, stream: str) -> tuple[torch.Tensor, str]:
    """The VAE and LATENT checks both decode nodes share: ``(latent tensor, label for the report)``.

    A ComfyUI >= 0.33 NestedTensor (e.g. video + audio of LTX-2) gives its first stream, as core VAE
    Decode does (the other streams belong to other VAEs), labelled ``"<stream> of a nested latent"``.
    """
    if vae is None or getattr(vae, "first_stage_model", None) is None:
        raise NodeInputError(
            node, "the VAE is invalid (None); if it comes from a checkpoint loader, the checkpoint has no VAE"
        )
    if not isinstance(samples, dict):
        raise NodeInputError(
            node, f"samples must be a LATENT (a dict with a 'samples' tensor), got {type(samples).__name__}"
        )
    z, label = samples.get("samples"), "latent"
    if getattr(z, "is_nested", False) and not isinstance(z, torch.Tensor):
        streams = list(z.unbind())
        z, label = (streams[0] if streams else None), f"{stream} of a nested latent ({len(streams)} streams)"
        log.info("nested latent: decoding its first stream of %d, as VAE Decode does", len(streams))
    if not isinstance(z, torch.Tensor):
        raise NodeInputError(node, f"samples['samples'] must be a tensor, got {type(z).__name__}")
    if z.is_nested:
        raise NodeInputError(node, "samples['samples'] is a torch nested (jagged) tensor; decode a regular LATENT")
    return z, label


def oom_exceptions() -> tuple[type[BaseException], ...]:
    """The exception types ComfyUI treats as out-of-memory on this machine."""
    exc = getattr(mm, "OOM_EXCEPTION", None) or torch.cuda.OutOfMemoryError
    return (exc,) if isinstance(exc, type) else tuple(exc)


def should_stop() -> None:
    """Raises ComfyUI's interrupt exception when the user pressed Cancel."""
    mm.throw_exception_if_processing_interrupted()


def progress_callback(total: int, node_id: str | None = None) -> Callable[[int, int], None]:
    """``progress(done, total)`` driving ComfyUI's progress bar of the running node."""
    bar = comfy.utils.ProgressBar(max(1, int(total)), node_id=node_id)

    def progress(done: int, total_now: int | None = None) -> None:
        bar.update_absolute(int(done), total=None if total_now is None else max(1, int(total_now)))

    return progress


def intermediate_device() -> torch.device:
    return mm.intermediate_device()


def vae_patcher(vae: Any) -> Any:
    return getattr(vae, "patcher", vae)


def vae_budget(vae: Any, budget_mb: float | None) -> Budget:
    """Bytes of working memory a decode with ``vae`` may use on its device.

    ``budget_mb`` > 0 caps the decode's working memory: what it allocates beyond the VAE's weights,
    which are not counted whether they are loaded yet or not (the same budget then gives the same plan
    either way). 0: ``free + evictable - VAE weights to load - reserve``, where ``evictable`` is the
    dynamic-VRAM pages of every *other* model on the device (ComfyUI >= 0.33 with comfy-aimdo; 0
    elsewhere), which aimdo evicts when the decode allocates. See docs/MEMORY.md, "Budget".
    """
    device = torch.device(vae.device)
    patcher = vae_patcher(vae)
    user = budget_mb if budget_mb and budget_mb > 0 else None
    to_load = 0
    evictable = 0
    if user is None and hasattr(patcher, "model_size") and hasattr(patcher, "loaded_size"):
        to_load = weights_to_load(patcher.model_size(), patcher.loaded_size())
        evictable = evictable_bytes(mm, device, exclude=[patcher])
    return compute_budget(
        device,
        mm.get_free_memory,
        get_total_memory=mm.get_total_memory,
        vae_weights_to_load=to_load,
        reserve_floor=int(mm.extra_reserved_memory()) if device.type != "cpu" else 0,
        user_budget_mb=user,
        evictable_bytes=evictable,
    )


def offload_others(vae: Any, required_bytes: int | None, mode: str = "needed") -> OffloadReport:
    """Unload upstream models from the VAE's device (keeping the VAE) before a decode; dynamic-VRAM
    models are unloaded too (``free_memory(..., for_dynamic=False)`` where the host has it)."""
    return offload_for_decode(mm, torch.device(vae.device), required_bytes, keep=[vae_patcher(vae)], mode=mode)


def load_vae_weights(vae: Any, decode_bytes: int) -> Residency:
    """Put the VAE's weights on its device the way ComfyUI's own decode does; returns where they are.

    A non-dynamic patcher is loaded in full (``force_full_load``: the budget counted every weight as
    resident). A dynamic-VRAM patcher (ComfyUI >= 0.33, comfy-aimdo) is *staged*: ComfyUI prioritises
    its pages and force-loads only small weights; the rest is faulted in layer by layer while the
    decode runs (a full load does not exist there, and ComfyUI's own decode never asks for one).
    """
    patcher = vae_patcher(vae)
    mm.load_models_gpu([patcher], memory_required=int(decode_bytes), force_full_load=not is_dynamic(patcher))
    return residency(patcher)


def user_cache_file(name: str, what: str) -> pathlib.Path | None:
    """``<ComfyUI user folder>/vramfit/<name>``, or ``None`` (logged: ``what`` is then kept in memory)
    when the folder cannot be created, e.g. on a read-only install."""
    try:
        path = pathlib.Path(folder_paths.get_user_directory()) / "vramfit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, AttributeError) as e:
        log.warning("VRAM Fit: %s cache disabled (%s); kept in memory for this session", what, e)
        return None
    return path


def cost_model_store() -> CostModelStore:
    """Process-wide store: shipped defaults + calibrations cached in ComfyUI's user folder."""
    global _STORE
    if _STORE is None:
        _STORE = CostModelStore(user_cache_file("cost_models.json", "cost-model"))
    return _STORE


# --------------------------------------------------------------------------------------------------
# Helpers of the utility nodes (Offload Manager, bf16 Loader, VRAM Monitor)

MODEL_SOCKET_TYPES = frozenset({"MODEL", "VAE", "CLIP", "CONTROL_NET", "CLIP_VISION", "STYLE_MODEL", "UPSCALE_MODEL"})
"""Socket types whose values hold models ComfyUI loads onto a device."""


def executing_context() -> tuple[str | None, str | None]:
    """``(prompt_id, node_id)`` of the node ComfyUI is executing now; ``(None, None)`` outside a prompt."""
    try:
        from comfy_execution.utils import get_executing_context
    except ImportError:  # older ComfyUI
        return None, None
    ctx = get_executing_context()
    if ctx is None:
        return None, None
    return getattr(ctx, "prompt_id", None), getattr(ctx, "node_id", None)


def loaded_models(device: torch.device | None = None) -> list[Any]:
    """ComfyUI's ``LoadedModel`` entries (alive, optionally on ``device``), most recent first."""
    out = []
    for lm in list(mm.current_loaded_models):
        if lm.model is None:
            continue
        if device is not None and torch.device(lm.device) != torch.device(device):
            continue
        out.append(lm)
    return out


def loaded_weights(device: torch.device | None = None) -> tuple[int, int]:
    """``(count, bytes)`` of the models ComfyUI has loaded (on ``device``): its ``loaded_size()``."""
    lms = loaded_models(device)
    return len(lms), sum(int(lm.model.loaded_size()) for lm in lms)


def loaded_residency(device: torch.device) -> DeviceResidency:
    """Per-model residency (resident tensors, aimdo pages, staged bytes) of ComfyUI's models on ``device``."""
    return device_residency(mm, device)


def dynamic_vram_state() -> str:
    """``"on"``/``"off"``: ComfyUI's dynamic VRAM (``comfy.memory_management.aimdo_enabled``, set by
    ``main.py`` when comfy-aimdo initialised: NVIDIA/AMD without ``--cpu``, ``--highvram``, ``--novram``,
    ``--gpu-only``, ``--disable-dynamic-vram``); ``"absent"``: a host without it (ComfyUI 0.3.x)."""
    try:
        cmm = importlib.import_module("comfy.memory_management")
    except ImportError:
        return "absent"
    if not hasattr(cmm, "aimdo_enabled"):
        return "absent"
    return "on" if cmm.aimdo_enabled else "off"


def aimdo_vbar_bytes(device: torch.device) -> int | None:
    """Bytes resident in comfy-aimdo's VBARs (every model's pages) on a CUDA ``device``, as aimdo
    reports them (``comfy_aimdo.model_vbar.vbars_analyze``); ``None`` where dynamic VRAM is not on."""
    if device.type != "cuda" or dynamic_vram_state() != "on":
        return None
    try:
        vbar = importlib.import_module("comfy_aimdo.model_vbar")
        return int(vbar.vbars_analyze(device.index))
    except (ImportError, AttributeError, RuntimeError, OSError) as e:
        log.debug("comfy-aimdo VBAR usage unavailable on %s: %s", device, e)
        return None


def decode_device() -> torch.device:
    """The device ComfyUI decodes VAEs on (``--cpu``: the CPU)."""
    return torch.device(mm.vae_device())


def request_cache_release() -> bool:
    """Ask ComfyUI to unload every model and drop its node-output cache once the current prompt ends.

    Sets the ``unload_models`` and ``free_memory`` flags of the prompt queue, exactly what ``POST /free``
    does; ComfyUI's prompt worker acts on them between prompts (``unload_all_models()`` then
    ``PromptExecutor.reset()``; the garbage collector then frees the weights). Returns False when no
    ComfyUI server runs in this process (in-process hosts, scripts).
    """
    server_module = sys.modules.get("server")
    instance = getattr(getattr(server_module, "PromptServer", None), "instance", None)
    queue = getattr(instance, "prompt_queue", None)
    if queue is None or not hasattr(queue, "set_flag"):
        return False
    queue.set_flag("unload_models", True)
    queue.set_flag("free_memory", True)
    return True


def blocked(message: str) -> Any:
    """An output value that blocks every node using it with ``message`` (ComfyUI's ExecutionBlocker)."""
    from comfy_execution.graph_utils import ExecutionBlocker

    return ExecutionBlocker(message)


def node_return_types(class_type: str) -> tuple[str, ...]:
    """``RETURN_TYPES`` of a registered node class (empty when unknown)."""
    import nodes as comfy_nodes  # ComfyUI's top-level nodes.py

    cls = comfy_nodes.NODE_CLASS_MAPPINGS.get(class_type)
    types = getattr(cls, "RETURN_TYPES", None) if cls is not None else None
    return tuple(str(t) for t in types) if types else ()


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc); False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------- Tiled VAE Decode helpers


def on_oom() -> None:
    """What ComfyUI does after an out-of-memory error before retrying: release cached blocks."""
    mm.soft_empty_cache()


def has_core_decode(vae: Any) -> bool:
    """True when ``vae`` decodes with ComfyUI's own ``VAE.decode`` contract: ``first_stage_model.decode``
    on the latent in ``vae_dtype`` on ``vae.device``, then ``process_output``. Third-party subclasses
    that override ``decode`` (e.g. ComfyUI_ExtraModels' ``EXVAE``: own device moves, own scaling) are
    decoded through their own ``decode``."""
    import comfy.sd

    return getattr(type(vae), "decode", None) is comfy.sd.VAE.decode and callable(
        getattr(vae, "process_output", None)
    )


def group_norm_params(norm: Any, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A GroupNorm's affine weight/bias as float32 (float64 for float64 ``x``) on ``x``'s device, through
    ComfyUI's weight casting (``comfy.ops``: low-VRAM offloaded weights, weight patches) when it applies."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    if getattr(norm, "weight", None) is None:
        bias = getattr(norm, "bias", None)
        return None, None if bias is None else bias.detach().to(x.device, dtype)
    casts = bool(getattr(norm, "comfy_cast_weights", False)) or bool(getattr(norm, "weight_function", None)) or bool(
        getattr(norm, "bias_function", None)
    )
    if casts:
        return _cast_norm_params(norm, x, dtype)
    b = getattr(norm, "bias", None)
    return norm.weight.detach().to(x.device, dtype), None if b is None else b.detach().to(x.device, dtype)


def _cast_norm_params(norm: Any, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``comfy.ops.cast_bias_weight`` for a parameter read outside the layer's forward: copies, then
    releases the cast. With dynamic VRAM the cast may return a view of an aimdo page (or of a shared
    cast buffer) that is only valid until ``uncast_bias_weight`` unpins it, so the values are copied
    first; hosts whose ``cast_bias_weight`` has no ``offloadable`` parameter get the plain call."""
    import comfy.ops

    uncast = getattr(comfy.ops, "uncast_bias_weight", None)
    if uncast is None or "offloadable" not in inspect.signature(comfy.ops.cast_bias_weight).parameters:
        w, b = comfy.ops.cast_bias_weight(norm, x, dtype=dtype, device=x.device)
        return w.to(dtype, copy=True), None if b is None else b.to(dtype, copy=True)
    w, b, stream = comfy.ops.cast_bias_weight(norm, x, dtype=dtype, device=x.device, offloadable=True)
    try:
        return w.to(dtype, copy=True), None if b is None else b.to(dtype, copy=True)
    finally:
        uncast(norm, w, b, stream)


_EXACT_STORE: Any = None


def exact_cost_store() -> Any:
    """Process-wide cache of exact-executor cost models (JSON in ComfyUI's user folder when writable)."""
    global _EXACT_STORE
    if _EXACT_STORE is None:
        from ..memory.cost.exact import ExactCostStore

        _EXACT_STORE = ExactCostStore(user_cache_file("exact_cost_models.json", "exact cost-model"))
    return _EXACT_STORE


def _bounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """ComfyUI's ``normal_attention`` + ``slice_attention`` (same reshapes, same ops per slice), with
    query-row slices sized from ``max_bytes`` instead of the free memory of the moment. Every slice holds
    complete rows of the score matrix, so each softmax is the untiled one; with one slice the calls are
    the very calls ComfyUI makes."""
    orig = q.shape
    b, c = orig[0], orig[1]
    q = q.reshape(b, c, -1).permute(0, 2, 1)  # b, hw, c
    k = k.reshape(b, c, -1)  # b, c, hw
    v = v.reshape(b, c, -1)
    n = int(q.shape[1])
    scale = int(q.shape[-1]) ** (-0.5)
    modifier = 3 if q.element_size() == 2 else 2.5  # ComfyUI's estimate of the live score copies
    per_row = b * int(k.shape[2]) * q.element_size() * modifier
    rows = max(1, min(n, int(max_bytes // max(1, per_row))))
    r1 = torch.zeros_like(k, device=q.device)
    for i in range(0, n, rows):
        s1 = torch.bmm(q[:, i : i + rows], k) * scale
        s2 = torch.nn.functional.softmax(s1, dim=2).permute(0, 2, 1)
        del s1
        r1[:, :, i : i + rows] = torch.bmm(v, s2)
        del s2
    return r1.reshape(orig)


@contextlib.contextmanager
def bounded_vae_attention(model: Any, max_bytes: int) -> Iterator[int]:
    """Within the block, the VAE attention blocks of ``model`` that use ComfyUI's split attention
    (``normal_attention``: the CPU path, and GPUs without PyTorch/xformers attention) slice their score
    matrix to at most ``max_bytes`` (ComfyUI's own estimate) instead of by the free memory of the moment.
    Memory-efficient kernels (PyTorch SDPA, xformers) are left alone. Yields how many blocks changed."""
    from comfy.ldm.modules.diffusionmodules import model as dm

    original = dm.normal_attention
    swapped = [m for m in model.modules() if getattr(m, "optimized_attention", None) is original]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _bounded_attention(q, k, v, max_bytes)

    for m in swapped:
        m.optimized_attention = attention
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            m.optimized_attention = original


def decode_env_callables(node_id: str | None) -> dict[str, Any]:
    """The ComfyUI callables both decode engines take (``DecodeEnv`` / ``VideoEnv`` fields)."""
    return {
        "should_stop": should_stop,
        "on_oom": on_oom,
        "oom_exceptions": oom_exceptions(),
        "progress_bar": lambda total: progress_callback(total, node_id),
        "budget": vae_budget,
        "load_weights": load_vae_weights,
    }


def budget_inputs() -> list[Any]:
    """The decode nodes' shared inputs: ``budget_mb`` and ``unload_others``."""
    return [
        io.Int.Input("budget_mb", default=0, min=0, max=1 << 22, step=64,
                     tooltip="Working memory the decode may use on the VAE's device, in MB: what it "
                     "allocates beyond the VAE's weights (the weights are not counted, loaded or not). 0 = the "
                     "free memory ComfyUI reports, minus the VAE weights still to load and a safety reserve."),
        io.Boolean.Input("unload_others", default=True,
                         tooltip="Offload other models (diffusion model, text encoders) from the VAE's "
                         "device first, as far as this decode needs the room."),
    ]  # fmt: skip


def report_output(tooltip: str) -> Any:
    """The decode nodes' STRING ``report`` output."""
    return io.String.Output("report", display_name="report", tooltip=tooltip)


def decode_output(result: Any, logger: logging.Logger) -> io.NodeOutput:
    """A decode result as the node's outputs: images, the report text (logged, and shown on the node)."""
    text = result.report.text()
    logger.info("%s", text)
    return io.NodeOutput(result.images, text, ui=ui.PreviewText(text))
