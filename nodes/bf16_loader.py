"""bf16 Loader (VRAM Fit): load a VAE, a diffusion model or a checkpoint with a chosen weight dtype.

Files come only from ComfyUI's model folders (``folder_paths``: ``vae``, ``diffusion_models``,
``checkpoints``), only as safetensors (never a pickle), and are loaded through ComfyUI's own loaders
(``comfy.utils.load_torch_file``, ``comfy.sd.VAE``, ``comfy.sd.load_diffusion_model``,
``comfy.sd.load_state_dict_guess_config``), so detection, key conversion and model classes are
ComfyUI's. The chosen dtype is the *storage* dtype of the weights; the compute dtype is the same when
ComfyUI computes it on the device (``should_use_bf16`` / ``should_use_fp16``), otherwise the weights
are cast per layer to a dtype the device computes (ComfyUI's manual cast), and the report says so.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import comfy.model_management as mm
import comfy.sd
import comfy.utils
import folder_paths
import torch
from comfy_api.v0_0_2 import io, ui

from ..memory import safetensors_header
from ..memory.measure.monitor import module_weight_bytes
from ..memory.report import Report, fmt_bytes, summary_line
from ..memory.safetensors_header import SafetensorsError, SafetensorsInfo
from ._comfy import CATEGORY, NodeInputError, blocked, oom_exceptions

log = logging.getLogger("vramfit.bf16_loader")

NODE = "bf16 Loader"
FOLDERS = {"vae": "VAE", "diffusion_models": "diffusion model", "checkpoints": "checkpoint"}
"""ComfyUI model folders this node lists (``folder/name`` entries), and what each holds."""
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
SAFE_EXTENSIONS = (".safetensors", ".sft")


# ------------------------------------------------------------------------------------ file checks


def read_safetensors_info(path: str, shown_name: str) -> SafetensorsInfo:
    """Validate a safetensors file's header and sizes; raises ``NodeInputError`` naming the file."""
    try:
        return safetensors_header.read_safetensors_info(path)
    except SafetensorsError as e:
        raise NodeInputError(NODE, f"'{shown_name}' ({path}) {e}") from e.__cause__


def model_choices() -> list[str]:
    """``folder/name`` of every safetensors file in the VAE, diffusion-model and checkpoint folders."""
    out: list[str] = []
    for folder in FOLDERS:
        try:
            names = folder_paths.get_filename_list(folder)
        except KeyError:
            continue
        out += [f"{folder}/{n}" for n in names if n.lower().endswith(SAFE_EXTENSIONS)]
    return out


def resolve(model: str) -> tuple[str, str, str]:
    """``(folder, filename, full path)`` of a listed choice; anything else raises ``NodeInputError``."""
    if not isinstance(model, str) or "/" not in model:
        raise NodeInputError(NODE, f"model {model!r} is not of the form 'folder/file' ({', '.join(FOLDERS)})")
    folder, name = model.split("/", 1)
    segments = model.replace("\\", "/").split("/")
    if any(seg in ("..", ".", "") for seg in segments) or os.path.isabs(name):
        raise NodeInputError(
            NODE, f"model {model!r}: '..', '.' and absolute paths are not allowed; pick a listed file"
        )
    if folder not in FOLDERS:
        raise NodeInputError(NODE, f"model {model!r}: folder {folder!r} is not one of {list(FOLDERS)}")
    if not name.lower().endswith(SAFE_EXTENSIONS):
        raise NodeInputError(
            NODE, f"model {model!r} is not a .safetensors file: only safetensors are loaded (never pickles)"
        )
    listed = folder_paths.get_filename_list(folder)
    if name not in listed:
        raise NodeInputError(
            NODE,
            f"model {model!r} is not a file in ComfyUI's '{folder}' folders "
            f"({len(listed)} files there); names must come from that list (no paths outside it)",
        )
    path = folder_paths.get_full_path(folder, name)
    if path is None or not os.path.isfile(path):
        raise NodeInputError(NODE, f"model {model!r}: the file is missing from ComfyUI's '{folder}' folders")
    return folder, name, path


# ------------------------------------------------------------------------------------ dtypes


def device_computes(dtype: torch.dtype, device: torch.device) -> bool:
    """ComfyUI's own rule for running math in ``dtype`` on ``device`` (fp8 is storage only here)."""
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return bool(mm.should_use_bf16(device))
    if dtype == torch.float16:
        return bool(mm.should_use_fp16(device))
    return False


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def _cast_own(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast a module's own floating parameters and buffers (not its children's) to ``dtype``.

    Hosts that archive each tensor's dtype (ComfyUI >= 0.33 ``archive_model_dtypes``:
    ``<name>_comfy_model_dtype``, read when a dynamic-VRAM patcher stages the weights and sizes their
    aimdo pages) get the archive updated, or the staged copy would be cast back to the old dtype.
    """
    for name, p in list(module._parameters.items()):
        if p is not None and p.is_floating_point() and p.dtype != dtype:
            module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            _archive_dtype(module, name, dtype)
    for name, b in list(module._buffers.items()):
        if b is not None and b.is_floating_point() and b.dtype != dtype:
            module._buffers[name] = b.to(dtype)
            _archive_dtype(module, name, dtype)


def _archive_dtype(module: torch.nn.Module, name: str, dtype: torch.dtype) -> None:
    attr = f"{name}_comfy_model_dtype"
    if hasattr(module, attr):
        setattr(module, attr, dtype)


def _load_vae(sd: dict, metadata: Any, storage: torch.dtype) -> tuple[Any, torch.dtype, str]:
    """A ComfyUI ``VAE`` whose weights are stored in ``storage``; returns it, its compute dtype and a note."""
    device = torch.device(mm.vae_device())
    float_storage = storage in (torch.bfloat16, torch.float16, torch.float32)
    construct = (
        storage
        if float_storage
        else (torch.bfloat16 if device_computes(torch.bfloat16, device) else torch.float32)
    )
    vae = comfy.sd.VAE(sd=sd, metadata=metadata, dtype=construct)
    vae.throw_exception_if_invalid()
    working = list(getattr(vae, "working_dtypes", [torch.float32]))
    if float_storage and storage in working and device_computes(storage, device):
        return vae, storage, f"{_dtype_name(storage)} (computed as stored)"
    compute = (
        construct
        if (construct in working and device_computes(construct, device))
        else mm.vae_dtype(device, working)
    )
    why = (
        f"{_dtype_name(storage)} is not a working dtype of this VAE ({', '.join(_dtype_name(d) for d in working)})"
        if float_storage and storage not in working
        else f"{device} cannot compute {_dtype_name(storage)} per ComfyUI"
        + (" (should_use_bf16 is False)" if storage == torch.bfloat16 else "")
    )
    for m in vae.first_stage_model.modules():
        if not m._parameters and not m._buffers:
            continue
        if hasattr(m, "comfy_cast_weights"):  # ComfyUI op: weights cast per call to the input's dtype
            _cast_own(m, storage)
            m.comfy_cast_weights = True
        else:  # plain torch parameters (e.g. norm scales): keep them in the compute dtype
            _cast_own(m, compute)
    vae.vae_dtype = compute
    vae.size = None
    vae.patcher.size = 0
    vae.model_size()
    return (
        vae,
        compute,
        (
            f"{_dtype_name(compute)}: {why}; weights stay stored in {_dtype_name(storage)} and are cast to "
            f"{_dtype_name(compute)} per layer"
        ),
    )


def _fix_model_compute(patcher: Any, storage: torch.dtype) -> tuple[torch.dtype | None, str]:
    """Compute dtype of a loaded diffusion model; fp8 storage computes in bf16 where ComfyUI supports it."""
    model = patcher.model
    device = torch.device(patcher.load_device)
    supported = list(getattr(model.model_config, "supported_inference_dtypes", [torch.float32]))
    cast = getattr(model, "manual_cast_dtype", None)
    if storage in (torch.float8_e4m3fn, torch.float8_e5m2):
        if torch.bfloat16 in supported and device_computes(torch.bfloat16, device):
            patcher.set_model_compute_dtype(torch.bfloat16)
            return torch.bfloat16, "bfloat16: fp8 storage, weights cast to bf16 per layer"
        return (
            cast,
            f"{_dtype_name(cast)}: {device} cannot compute bf16 per ComfyUI; fp8 weights cast per layer",
        )
    if cast is None:
        if storage not in supported:
            pick = (
                torch.bfloat16
                if torch.bfloat16 in supported and device_computes(torch.bfloat16, device)
                else torch.float32
            )
            patcher.set_model_compute_dtype(pick)
            return (
                pick,
                f"{_dtype_name(pick)}: the model does not support {_dtype_name(storage)} compute; cast per layer",
            )
        return storage, f"{_dtype_name(storage)} (computed as stored)"
    return cast, (
        f"{_dtype_name(cast)}: {device} cannot compute {_dtype_name(storage)} per ComfyUI; weights stay stored in "
        f"{_dtype_name(storage)} and are cast per layer (ComfyUI manual cast)"
    )


def _param_dtypes(module: Any) -> str:
    counts: dict[str, int] = {}
    for p in module.parameters():
        key = _dtype_name(p.dtype)
        counts[key] = counts.get(key, 0) + p.numel()
    total = sum(counts.values()) or 1
    return ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------ the node


class Bf16Loader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VRAMFit_Bf16Loader",
            display_name="bf16 Loader (VRAM Fit)",
            category=CATEGORY,
            description=(
                "Loads a VAE, a diffusion model or a checkpoint (safetensors only) from ComfyUI's model folders "
                "with a chosen weight dtype (bf16 halves fp32 memory), through ComfyUI's own loaders, and reports "
                "the bytes before (in the file) and after (loaded)."
            ),
            inputs=[
                io.Combo.Input(
                    "model",
                    options=model_choices(),
                    tooltip=(
                        "File to load, as folder/name: vae/... (a VAE), diffusion_models/... (a diffusion model, "
                        "as Load Diffusion Model), checkpoints/... (a checkpoint: MODEL, CLIP and VAE). Only "
                        "safetensors files of ComfyUI's model folders are listed and accepted."
                    ),
                ),
                io.Combo.Input(
                    "weight_dtype",
                    options=list(DTYPES),
                    default="bf16",
                    tooltip=(
                        "Storage dtype of the weights. bf16/fp16: half of fp32; fp8_e4m3fn/fp8_e5m2: a quarter, "
                        "computed in bf16 where ComfyUI supports it. When the device cannot compute the chosen "
                        "dtype (e.g. bf16 on CPU), the weights stay in it and are cast per layer; the report says so."
                    ),
                ),
            ],
            outputs=[
                io.Model.Output(
                    "MODEL", display_name="MODEL",
                    tooltip="The diffusion model (diffusion_models/ and checkpoints/ files; blocked otherwise).",
                ),
                io.Clip.Output(
                    "CLIP", display_name="CLIP",
                    tooltip="The text encoder of a checkpoint (blocked for other files or when absent).",
                ),
                io.Vae.Output(
                    "VAE", display_name="VAE", tooltip="The VAE (vae/ files, or a checkpoint's VAE; blocked otherwise)."
                ),
                io.String.Output(
                    "report", display_name="report",
                    tooltip="Bytes before (file) and after (loaded), dtypes and compute (VRAM Fit report).",
                ),
            ],
        )

    @classmethod
    def validate_inputs(cls, model: str) -> bool | str:
        """Checks ``model`` (any listed file, also one added since the list was built).

        Takes only ``model``: ComfyUI files a failed check under every input this method takes (so one bad
        name would also be reported under ``weight_dtype``), and checks the inputs it does not take itself
        (``weight_dtype``: its combo list)."""
        try:
            resolve(model)
        except NodeInputError as e:
            return str(e)
        return True

    @classmethod
    def fingerprint_inputs(cls, model: str, weight_dtype: str = "bf16") -> str:
        """Reload when the file changes on disk (same name, new content)."""
        try:
            _, _, path = resolve(model)
            st = os.stat(path)
        except (NodeInputError, OSError):
            return f"{model}|{weight_dtype}|?"
        return f"{model}|{weight_dtype}|{st.st_size}|{st.st_mtime_ns}"

    @classmethod
    def execute(cls, model: str, weight_dtype: str = "bf16") -> io.NodeOutput:
        storage = _check_dtype(weight_dtype)
        folder, name, path = resolve(model)
        info = read_safetensors_info(path, model)
        kind = FOLDERS[folder]
        r = Report(NODE)
        r.add("file", f"{model} ({kind}; {fmt_bytes(info.file_bytes)})")
        stored = ", ".join(f"{k} x{v}" for k, v in sorted(info.dtypes.items()))
        r.add(
            "before",
            f"{fmt_bytes(info.data_bytes)} ({info.data_bytes} B) of tensors in the file ({stored}); "
            f"{info.float_params} floating-point values = {fmt_bytes(4 * info.float_params)} in fp32",
        )
        r.add("dtype", f"{weight_dtype} ({_dtype_name(storage)}) requested for the weights")
        model_out: Any = blocked(f"[VRAM Fit · {NODE}] {model} is a {kind}: it has no MODEL output")
        clip_out: Any = blocked(f"[VRAM Fit · {NODE}] {model} is a {kind}: it has no CLIP output")
        vae_out: Any = blocked(f"[VRAM Fit · {NODE}] {model} is a {kind}: it has no VAE output")
        parts: list[tuple[str, Any, str]] = []  # (label, module, compute note)
        try:
            if folder == "vae":
                sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
                vae, _compute, note = _load_vae(sd, metadata, storage)
                del sd
                vae_out = vae
                parts.append(("VAE", vae.first_stage_model, note))
                r.device = str(vae.device)
            elif folder == "diffusion_models":
                patcher = comfy.sd.load_diffusion_model(path, model_options={"dtype": storage})
                _compute, note = _fix_model_compute(patcher, storage)
                model_out = patcher
                parts.append((f"MODEL ({type(patcher.model).__name__})", patcher.model, note))
                r.device = str(patcher.load_device)
            else:
                model_out, clip_out, vae_out = _load_checkpoint(path, storage, parts, model)
                r.device = str(mm.get_torch_device())
        except NodeInputError:
            raise
        except Exception as e:  # ComfyUI's own loader errors, made to name this node and the file
            if isinstance(e, oom_exceptions()):
                raise  # ComfyUI reacts to OOM by type (unloads models): keep it
            raise NodeInputError(NODE, f"could not load '{model}' ({path}): {type(e).__name__}: {e}") from e

        total_after = 0
        for label, module, note in parts:
            after = module_weight_bytes(module)
            total_after += after
            n_params = sum(p.numel() for p in module.parameters())
            r.add(
                label,
                f"{fmt_bytes(after)} ({after} B) loaded; {n_params} parameters: {_param_dtypes(module)}",
            )
            r.add("compute", note)
            if "cannot compute" in note or "not a working dtype" in note or "does not support" in note:
                log.warning("[VRAM Fit · %s] %s: %s", NODE, model, note)
        fp32 = 4 * info.float_params
        r.add(
            "after",
            f"{fmt_bytes(total_after)} ({total_after} B) of weights loaded = "
            f"{100 * total_after / max(1, info.data_bytes):.0f}% of the file, {100 * total_after / max(1, fp32):.0f}% of fp32",
        )
        r.summary = _summary(weight_dtype, total_after, info.data_bytes, parts)
        text = r.text()
        log.info("%s", text)
        return io.NodeOutput(model_out, clip_out, vae_out, text, ui=ui.PreviewText(text))


def _summary(weight_dtype: str, loaded: int, file_bytes: int, parts: list[tuple[str, Any, str]]) -> str:
    """The verdict: ``bf16 · 80.1 MiB loaded, 50% of the file's 160.2 MiB · VAE · computed as stored``."""
    labels = ", ".join(label.split(" (")[0] for label, _, _ in parts)
    casts = sorted({note.split(":")[0] for _, _, note in parts if "cast" in note and ":" in note})
    return summary_line(
        weight_dtype,
        f"{fmt_bytes(loaded)} loaded, {100 * loaded / max(1, file_bytes):.0f}% of the file's "
        f"{fmt_bytes(file_bytes)}",
        labels,
        f"cast per layer to {'/'.join(casts)}" if casts else "computed as stored",
    )


def _check_dtype(weight_dtype: str) -> torch.dtype:
    dtype = DTYPES.get(weight_dtype)
    if dtype is None:
        raise NodeInputError(NODE, f"weight_dtype must be one of {list(DTYPES)}, not {weight_dtype!r}")
    return dtype


def _load_checkpoint(path: str, storage: torch.dtype, parts: list, shown: str) -> tuple[Any, Any, Any]:
    """MODEL, CLIP and VAE of a checkpoint with ``storage`` weights (ComfyUI's guess-config loader)."""
    sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    te_device = torch.device(mm.text_encoder_device())
    te_options = (
        {"dtype": storage}
        if storage in (torch.bfloat16, torch.float16, torch.float32) and device_computes(storage, te_device)
        else {}
    )
    out = comfy.sd.load_state_dict_guess_config(
        sd,
        output_vae=False,
        output_clip=True,
        embedding_directory=folder_paths.get_folder_paths("embeddings"),
        model_options={"dtype": storage},
        te_model_options=te_options,
        metadata=metadata,
    )
    if out is None or out[0] is None:
        raise NodeInputError(
            NODE, f"'{shown}' ({path}): ComfyUI could not detect the model type of this checkpoint"
        )
    patcher, clip = out[0], out[1]
    _compute, note = _fix_model_compute(patcher, storage)
    parts.append((f"MODEL ({type(patcher.model).__name__})", patcher.model, note))
    if clip is not None:
        te_note = (
            f"{_dtype_name(storage)}"
            if te_options
            else f"ComfyUI's default text-encoder dtype ({_dtype_name(storage)} is not computed on {te_device})"
        )
        parts.append(("CLIP", clip.cond_stage_model, te_note))
        clip_out = clip
    else:
        clip_out = blocked(f"[VRAM Fit · {NODE}] {shown} has no text encoder weights")
    config = patcher.model.model_config
    prefixes = list(getattr(config, "vae_key_prefix", []) or [])
    vae_sd = (
        comfy.utils.state_dict_prefix_replace(sd, {k: "" for k in prefixes}, filter_keys=True)
        if prefixes
        else {}
    )
    if vae_sd:
        vae_sd = config.process_vae_state_dict(vae_sd)
        vae, _c, vnote = _load_vae(vae_sd, metadata, storage)
        parts.append(("VAE", vae.first_stage_model, vnote))
        vae_out = vae
    else:
        vae_out = blocked(f"[VRAM Fit · {NODE}] {shown} has no VAE weights")
    del sd
    return patcher, clip_out, vae_out
