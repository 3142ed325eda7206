"""ComfyUI glue shared by the node adapters: the only place ``nodes/`` touches ``comfy`` internals.

Everything here turns ComfyUI state into the plain inputs ``memory/`` takes (devices, free-memory
callables, progress and cancel callbacks, the OOM exception type, a cost-model cache path).
Imported only inside ComfyUI (by the node modules).
"""

from __future__ import annotations

import importlib
import logging
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import comfy.model_management as mm
import comfy.utils
import folder_paths
import torch

from ..memory.budget import Budget, compute_budget, weights_to_load
from ..memory.decode.guard import NotDescribed
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
from ..memory.plan.host_grid import host_grid_of
from ..memory.vae.seedvr2_layout import seedvr2_of

log = logging.getLogger("vramfit")

CATEGORY = "VRAM Fit"


class NodeInputError(ValueError):
    """Bad input to a VRAM Fit node; the message names the node and the value."""

    def __init__(self, node: str, message: str):
        super().__init__(f"[VRAM Fit · {node}] {message}")


# ComfyUI reports a failed node's exception type as ``<class __module__>.<qualname>`` (/history's
# ``exception_type``, the frontend's error dialog). Its custom-node loader names this package's modules
# after their folder path (``/…/custom_nodes/ComfyUI-VRAM-Fit.nodes._comfy``): a stable name instead.
NodeInputError.__module__ = "vramfit"


def latent_tensor(node: str, vae: Any, samples: Any, stream: str) -> tuple[torch.Tensor, str, str]:
    """The VAE and LATENT checks both decode nodes share: ``(latent, label, note)``.

    ``latent`` is laid out as the VAE decodes it: a 4-D latent on a video VAE is B single frames,
    ``(B, C, 1, H, W)`` (as ComfyUI's sampler lays it out for video models); a 5-D latent of one frame
    on an image VAE is 4-D (as 0.33's ``VAE.decode``). ``label`` names the value as given, ``note`` the
    reshape (""). A ComfyUI >= 0.33 NestedTensor (e.g. LTX-2's video + audio) gives its first stream, as
    core VAE Decode does.
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
    shape = tuple(z.shape)
    label = f"{label} {shape}"
    # latent_dim as ComfyUI's VAE means it; a third-party VAE without latent_channels (ExtraModels' EXVAE,
    # whose latent_dim counts channels) decodes images through its own decode.
    dim = int(getattr(vae, "latent_dim", 2))
    if dim != 3 and not hasattr(vae, "latent_channels"):
        dim = 2

    def error(message: str) -> NodeInputError:
        return NodeInputError(node, message)

    if dim not in (2, 3):
        raise NotDescribed(f"a VAE of latent_dim {dim} (audio or another 1-D latent, not images or video); the pack "
                           "decodes image and video VAEs (for audio, ComfyUI's VAE Decode Audio gives a waveform)")
    if z.ndim not in (4, 5):
        raise error(f"{label} is neither a 4-D image latent (B, C, H, W) nor a 5-D video latent "
                    "(B, C, T, H, W)")
    if min(shape) < 1:
        raise error(f"{label} is empty")
    if dim == 2 and z.ndim == 5 and shape[2] > 1:
        raise error(f"{label} is a 5-D video latent of {shape[2]} frames, but this is an image VAE, which "
                    "decodes single images: wrong VAE for this latent; connect the VAE of the video model "
                    "that made it (e.g. Wan's VAE)")
    if getattr(vae, "handles_tiling", False) and (dim != 3 or (host_grid_of(vae.first_stage_model) is None
                                                              and seedvr2_of(vae.first_stage_model) is None)):
        # ComfyUI >= 0.33: MiniMax H3's grid is reproduced (memory/plan/host_grid.py), SeedVR2 decoded in exact
        # tiles (memory/executors/seedvr2.py); another VAE that tiles internally gets the host's own decode
        raise NotDescribed(f"{type(vae.first_stage_model).__name__} tiles internally (handles_tiling) in a way the "
                           "pack does not reproduce; the host's decode lets the model bound its memory")
    want = getattr(vae, "latent_channels", None)
    if want is not None and int(want) != int(shape[1]):
        raise error(f"{label} has {shape[1]} channels but the VAE expects {want}: wrong VAE for this latent "
                    "(or an empty latent of another model family); connect the VAE of the model that made it")
    note = ""
    if dim == 3 and z.ndim == 4:  # no time axis: each batch item is one frame
        z = z.unsqueeze(2)
        note = f"4-D latent on a video VAE: {shape[0]} single frame(s), time axis added"
    elif dim == 2 and z.ndim == 5:
        z = z.squeeze(2)
        note = "5-D latent of one frame on an image VAE: decoded as images, time axis removed"
    return z, label, note


def oom_exceptions() -> tuple[type[BaseException], ...]:
    """The exception types ComfyUI treats as out-of-memory on this machine."""
    exc = getattr(mm, "OOM_EXCEPTION", None) or torch.cuda.OutOfMemoryError
    return (exc,) if isinstance(exc, type) else tuple(exc)


def cancel_exceptions() -> tuple[type[BaseException], ...]:
    """ComfyUI's Cancel (``InterruptProcessingException``): passed on, never replaced by the host's decode."""
    exc = getattr(mm, "InterruptProcessingException", None)
    return (exc,) if isinstance(exc, type) else ()


def core_node(name: str) -> Any:
    """An instance of ComfyUI's own node class ``name`` (``VAEDecode``, ``VAEEncode``, ``VAEEncodeForInpaint``): what
    a pack node returns when its own path cannot do better is exactly what that node returns."""
    import nodes as comfy_nodes  # ComfyUI's top-level node module

    return getattr(comfy_nodes, name)()


def should_stop() -> None:
    """Raises ComfyUI's interrupt exception when the user pressed Cancel."""
    mm.throw_exception_if_processing_interrupted()


def progress_callback(total: int, node_id: str | None = None) -> Callable[[int, int], None]:
    """``progress(done, total)`` driving ComfyUI's progress bar of the running node."""
    bar = comfy.utils.ProgressBar(max(1, int(total)), node_id=node_id)

    def progress(done: int, total_now: int | None = None) -> None:
        bar.update_absolute(int(done), total=None if total_now is None else max(1, int(total_now)))

    return progress


PHASE_EVENT = "vramfit.phase"
"""The websocket event that shows a decode's phase on its node (web/js/vramfit.js draws it in the report's
header): ``{"node": id, "text": ...}``. ComfyUI's own progress text is not used: the frontend of ComfyUI
0.3.75 saves it into the node's widget values, so saved workflows would carry it."""


def progress_text(node_id: str | None = None) -> Callable[[str], None]:
    """``show(text)``: a line of text on the running node while it works (:data:`PHASE_EVENT`); nothing
    without a running server (in-process use)."""

    def show(text: str) -> None:
        nid = node_id or executing_context()[1]
        server = sys.modules.get("server")
        instance = getattr(getattr(server, "PromptServer", None), "instance", None)
        if instance is None or nid is None:
            return
        try:
            data = {"node": str(nid), "text": text}
            instance.send_sync(PHASE_EVENT, data, getattr(instance, "client_id", None))
        except Exception as e:  # noqa: BLE001 - display only, never fails a decode
            log.debug("VRAM Fit: phase not sent: %s", e)

    return show


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
    elsewhere), which aimdo evicts when the decode allocates; under dynamic VRAM the VAE patcher's own
    ``get_free_memory`` (newer ComfyUI's advice to model code) is read and shown beside it. See docs/MEMORY.md,
    "Budget".
    """
    device = torch.device(vae.device)
    patcher = vae_patcher(vae)
    user = budget_mb if budget_mb and budget_mb > 0 else None
    to_load = 0
    evictable = 0
    patcher_free = None
    if user is None and hasattr(patcher, "model_size") and hasattr(patcher, "loaded_size"):
        to_load = weights_to_load(patcher.model_size(), patcher.loaded_size())
        evictable = evictable_bytes(mm, device, exclude=[patcher])
        if is_dynamic(patcher) and callable(getattr(patcher, "get_free_memory", None)):
            patcher_free = int(patcher.get_free_memory(device))  # upstream's hint, shown beside ours
    return compute_budget(
        device,
        mm.get_free_memory,
        get_total_memory=mm.get_total_memory,
        vae_weights_to_load=to_load,
        reserve_floor=int(mm.extra_reserved_memory()) if device.type != "cpu" else 0,
        user_budget_mb=user,
        evictable_bytes=evictable,
        patcher_free=patcher_free,
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
