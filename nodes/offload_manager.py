"""Offload Manager (VRAM Fit): a pass-through that unloads models before a decode and reports what it freed.

Placed between the sampler and the decode (sampler output -> ``value`` -> decode), graph order makes
it run after sampling and before the decode. It is an output node, so it runs even when its output is
left unconnected (ComfyUI then runs it as soon as its inputs are ready: still before a decode that
only waits for the same latent), and it re-runs on every prompt (side effects: ``fingerprint_inputs``
returns NaN, which never equals itself). Models are unloaded through ComfyUI's own model management
(``free_memory`` with a keep list), so every ``ModelPatcher`` subclass (GGUF's included) is handled the
way ComfyUI handles it; dynamic-VRAM models (ComfyUI >= 0.33, comfy-aimdo) are unloaded too
(``for_dynamic=False``), their aimdo pages measured apart from torch's allocator. See
``docs/NODES_UTILITY.md`` and ``docs/MEMORY.md`` ("Dynamic VRAM") for the measurement semantics.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from typing import Any

import comfy.model_management as mm
import torch
from comfy_api.v0_0_2 import io, ui

from ..memory.measure.monitor import module_weight_bytes
from ..memory.measure.procfs import malloc_trim, process_rss
from ..memory.offload import accepts_keyword, offload_for_decode, residency
from ..memory.report import Report, fmt_bytes, fmt_seconds, summary_line
from ._comfy import (
    CATEGORY,
    MODEL_SOCKET_TYPES,
    NodeInputError,
    aimdo_vbar_bytes,
    dynamic_vram_state,
    executing_context,
    loaded_models,
    node_return_types,
    request_cache_release,
)

log = logging.getLogger("vramfit.offload_manager")

NODE = "Offload Manager"
UNLOAD_KEEP = "all except kept"
UNLOAD_ALL = "everything"
UNLOAD_NONE = "nothing"
UNLOAD_CHOICES = (UNLOAD_KEEP, UNLOAD_ALL, UNLOAD_NONE)
METHOD_OFFLOAD = "offload"
METHOD_DROP = "drop"
METHOD_CHOICES = (METHOD_OFFLOAD, METHOD_DROP)
_RUNS = itertools.count(1)
_MAX_WALK = 4096


# ------------------------------------------------------------------------------------ finding models


def _is_patcher(obj: Any) -> bool:
    return hasattr(obj, "loaded_size") and hasattr(obj, "model_size") and hasattr(obj, "model")


def find_patchers(value: Any, depth: int = 4) -> list[Any]:
    """ModelPatchers held by ``value``: a MODEL, a VAE/CLIP (``.patcher``), or lists/tuples/dicts of them."""
    found: list[Any] = []
    seen: set[int] = set()
    budget = [_MAX_WALK]

    def walk(obj: Any, d: int) -> None:
        if obj is None or d < 0 or budget[0] <= 0 or id(obj) in seen:
            return
        budget[0] -= 1
        if isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)):
            return
        seen.add(id(obj))
        if _is_patcher(obj):
            found.append(obj)
            return
        patcher = getattr(obj, "patcher", None)
        if patcher is not None and _is_patcher(patcher):
            found.append(patcher)
            return
        if isinstance(obj, dict):
            for v in obj.values():
                walk(v, d - 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, d - 1)

    walk(value, depth)
    return found


def _same_model(a: Any, b: Any) -> bool:
    """Same patcher, or clones of one (clones share the underlying module, as ``is_clone`` checks)."""
    if a is b:
        return True
    inner_a, inner_b = getattr(a, "model", None), getattr(b, "model", None)
    return inner_a is not None and inner_a is inner_b


def _name(patcher: Any) -> str:
    inner = getattr(patcher, "model", None)
    return type(inner).__name__ if inner is not None else type(patcher).__name__


# ------------------------------------------------------------------------------------ measurement


@dataclasses.dataclass
class _ModelState:
    patcher: Any
    name: str
    device: torch.device
    loaded_before: int
    resident_before: int
    loaded_after: int = 0
    resident_after: int = 0
    still_listed: bool = True
    kept: bool = False
    dynamic: bool = False
    pages_before: int = 0
    """Resident aimdo pages of a dynamic model (``Residency.evictable``), outside torch's allocator."""
    pages_after: int = 0


def _device_usage(device: torch.device) -> dict[str, int | None]:
    """Device-level usage: CUDA allocator bytes (allocated, reserved) and the driver's used memory
    (``total - mem_get_info free``: aimdo pages included), plus comfy-aimdo's resident VBAR pages where
    dynamic VRAM is on; or the process RSS on the CPU."""
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        usage: dict[str, int | None] = {
            "CUDA memory_allocated": int(torch.cuda.memory_allocated(device)),
            "memory_reserved": int(torch.cuda.memory_reserved(device)),
            "driver used (mem_get_info)": int(total - free),
        }
        pages = aimdo_vbar_bytes(device)
        if pages is not None:
            usage["aimdo VBAR pages"] = pages
        return usage
    if device.type == "cpu":
        return {"process RSS": process_rss()}
    return {f"{device.type} memory": None}


def downstream_model_inputs(dynprompt: Any, node_id: str | None) -> list[tuple[str, str, str, str, int, str]]:
    """Model-typed inputs of nodes downstream of ``node_id`` whose source is not upstream of it.

    ``(node, class_type, input, source node, source slot, socket type)`` per input. These models are
    what the graph still needs after this node; when the source is not wired into this node
    (``value`` or ``keep``) they are candidates for ``keep``.
    """
    if dynprompt is None or node_id is None or not hasattr(dynprompt, "all_node_ids"):
        return []
    try:
        ids = list(dynprompt.all_node_ids())
        graph = {i: dynprompt.get_node(i) for i in ids}
    except Exception as e:  # noqa: BLE001 - a hint must never fail the node
        log.debug("no graph for downstream hints: %s", e)
        return []
    children: dict[str, list[str]] = {}
    for nid, node in graph.items():
        for v in (node.get("inputs") or {}).values():
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
                children.setdefault(v[0], []).append(nid)
    down: set[str] = set()
    stack = list(children.get(node_id, []))
    while stack:
        n = stack.pop()
        if n not in down:
            down.add(n)
            stack.extend(children.get(n, []))
    out = []
    own_sources = {
        (v[0], int(v[1]))
        for v in (graph.get(node_id, {}).get("inputs") or {}).values()
        if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
    }
    for nid in sorted(down, key=lambda x: (len(x), x)):
        node = graph[nid]
        for name, v in sorted((node.get("inputs") or {}).items()):
            if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)):
                continue
            src, slot = v[0], int(v[1])
            if src == node_id or src in down:
                continue
            types = node_return_types(graph.get(src, {}).get("class_type", ""))
            socket = types[slot] if slot < len(types) else ""
            if socket in MODEL_SOCKET_TYPES and (src, slot) not in own_sources:
                out.append((nid, node.get("class_type", "?"), name, src, slot, socket))
    return out


# ------------------------------------------------------------------------------------ the node


class OffloadManager(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="VRAMFit_OffloadManager",
            display_name="Offload Manager (VRAM Fit)",
            category=CATEGORY,
            description=(
                "Pass-through that unloads models before a decode and reports what it unloaded and the bytes "
                "freed (measured). Put it between the sampler and the decode: sampler output -> value -> decode. "
                "Runs on every prompt, headless too, with any ComfyUI model patcher (GGUF included)."
            ),
            inputs=[
                io.AnyType.Input(
                    "value",
                    tooltip=(
                        "Anything (latent, image, conditioning...). It comes out unchanged; wiring the sampler's "
                        "output through this node makes the unload happen after sampling and before the decode. "
                        "Models inside this value (a VAE, a MODEL) are kept."
                    ),
                ),
                io.Combo.Input(
                    "unload",
                    options=list(UNLOAD_CHOICES),
                    default=UNLOAD_KEEP,
                    tooltip=(
                        "all except kept: every loaded model except the ones passed into 'value' or 'keep' (wire "
                        "the VAE the decode will use into 'keep'). everything: all models, kept ones included. "
                        "nothing: unload nothing (only empty the cache, and report)."
                    ),
                ),
                io.Combo.Input(
                    "method",
                    options=list(METHOD_CHOICES),
                    default=METHOD_OFFLOAD,
                    tooltip=(
                        "offload: move the weights to ComfyUI's offload device (normally system RAM); the model "
                        "stays cached and reloads quickly next run. drop: offload now, and ask ComfyUI to unload "
                        "every model and clear its node cache when this prompt ends (as the 'Free model and node "
                        "cache' button does), so the weights leave RAM too; the next run reloads from disk."
                    ),
                ),
                io.Boolean.Input(
                    "empty_cache",
                    default=True,
                    tooltip=(
                        "After unloading, run the garbage collector and empty the allocator cache (CUDA "
                        "empty_cache via ComfyUI; on Linux also return freed heap memory to the OS)."
                    ),
                ),
                io.AnyType.Input(
                    "keep",
                    optional=True,
                    tooltip=(
                        "Optional: models to keep loaded, e.g. the VAE the decode will use (a VAE, MODEL or CLIP "
                        "socket, or any value holding them). Only used with 'all except kept'."
                    ),
                ),
            ],
            outputs=[
                io.AnyType.Output("value_out", display_name="value", tooltip="The input value, unchanged."),
                io.String.Output(
                    "report", display_name="report", tooltip="What was unloaded and the bytes freed (the VRAM Fit report format)."
                ),
            ],
            hidden=[io.Hidden.unique_id, io.Hidden.dynprompt],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs: Any) -> float:
        return float("nan")  # never equal to the previous run's value: runs on every prompt

    @classmethod
    def validate_inputs(cls, unload: str = UNLOAD_KEEP, *, method: str = METHOD_OFFLOAD) -> bool | str:
        """Checks ``unload`` (and ``method`` when a caller passes it).

        ``method`` is keyword-only, so ComfyUI does not pass it: ComfyUI files a failed check under every
        positional input this method takes (one bad ``unload`` was also reported under ``method``), and
        checks the inputs it does not take itself (``method``: its combo list; ``execute`` checks it too)."""
        try:
            _check_choices(unload, method)
        except NodeInputError as e:
            return str(e)
        return True

    @classmethod
    def execute(
        cls,
        value: Any = None,
        unload: str = UNLOAD_KEEP,
        method: str = METHOD_OFFLOAD,
        empty_cache: bool = True,
        keep: Any = None,
    ) -> io.NodeOutput:
        _check_choices(unload, method)
        t0 = time.perf_counter()
        run = next(_RUNS)
        hidden = getattr(cls, "hidden", None)
        prompt_id, ctx_node = executing_context()
        node_id = ctx_node or getattr(hidden, "unique_id", None)

        wanted = find_patchers(value) + find_patchers(keep) if unload == UNLOAD_KEEP else []
        lms = loaded_models()
        devices = sorted({torch.device(lm.device) for lm in lms}, key=str)
        states: list[_ModelState] = []
        for lm in lms:
            p = lm.model
            dev = torch.device(lm.device)
            res = residency(p)
            states.append(
                _ModelState(
                    patcher=p,
                    name=_name(p),
                    device=dev,
                    loaded_before=res.loaded,
                    resident_before=module_weight_bytes(p.model, dev),
                    kept=any(_same_model(p, k) for k in wanted),
                    dynamic=res.dynamic,
                    pages_before=res.evictable,
                )
            )
        usage_before = {d: _device_usage(d) for d in devices}

        if unload != UNLOAD_NONE:
            for dev in devices:
                keep_here = [s.patcher for s in states if s.kept and s.device == dev]
                offload_for_decode(mm, dev, keep=keep_here, mode="all")
        if empty_cache:
            gc.collect()
            mm.soft_empty_cache()
            malloc_trim()

        listed = {id(lm.model) for lm in loaded_models()}
        for s in states:
            res = residency(s.patcher)
            s.loaded_after = res.loaded
            s.pages_after = res.evictable
            s.resident_after = module_weight_bytes(s.patcher.model, s.device)
            s.still_listed = id(s.patcher) in listed
        usage_after = {d: _device_usage(d) for d in devices}

        dropped = None
        if method == METHOD_DROP and unload != UNLOAD_NONE:
            dropped = request_cache_release()

        dynprompt = getattr(hidden, "dynprompt", None)
        hints = downstream_model_inputs(dynprompt, node_id) if unload != UNLOAD_NONE else []
        report = _report(
            run=run, prompt_id=prompt_id, node_id=node_id, unload=unload, method=method,
            empty_cache=empty_cache, wanted=wanted, states=states, usage_before=usage_before,
            usage_after=usage_after, dropped=dropped, hints=hints, seconds=time.perf_counter() - t0,
        )  # fmt: skip
        text = report.text()
        log.info("%s", text)
        for s in states:  # no references to the models beyond this call
            s.patcher = None
        return io.NodeOutput(value, text, ui=ui.PreviewText(text))


def _check_choices(unload: str, method: str) -> None:
    if unload not in UNLOAD_CHOICES:
        raise NodeInputError(NODE, f"unload must be one of {list(UNLOAD_CHOICES)}, not {unload!r}")
    if method not in METHOD_CHOICES:
        raise NodeInputError(NODE, f"method must be one of {list(METHOD_CHOICES)}, not {method!r}")


def _dynamic_line(states: list[_ModelState]) -> str:
    """The report's ``dynamic`` row: the host's dynamic VRAM and the dynamic models' aimdo pages."""
    state = dynamic_vram_state()
    head = {"on": "on (comfy-aimdo)", "off": "off", "absent": "not on this host"}.get(state, state)
    dyn = [s for s in states if s.dynamic]
    if not dyn:
        if state == "absent":
            return head + " (every loaded weight is a torch tensor)"
        return head + "; no dynamic models were loaded"
    if accepts_keyword(mm.free_memory, "for_dynamic"):
        head += "; free_memory(for_dynamic=False) unloads dynamic models too"
    lines = [
        f"{s.name}: aimdo pages {fmt_bytes(s.pages_before)} -> {fmt_bytes(s.pages_after)} on {s.device}"
        + (" (kept)" if s.kept else "")
        for s in dyn
    ]
    return head + "; resident pages of the dynamic models:\n" + "\n".join(lines)


def _hint_lines(hints: list[tuple[str, str, str, str, int, str]]) -> str:
    """The ``downstream`` row: one line per model output not wired into value/keep, naming every
    downstream input that uses it (one missing keep is one line, however many nodes read that model)."""
    users: dict[tuple[str, int, str], list[str]] = {}
    for nid, ct, name, src, slot, socket in hints:
        use = f"node {nid} ({ct}).{name}"
        if use not in users.setdefault((src, slot, socket), []):
            users[(src, slot, socket)].append(use)
    lines = []
    for (src, _slot, socket), uses in users.items():
        verb, who = ("uses", "that node") if len(uses) == 1 else ("use", "the first that runs")
        lines.append(f"{', '.join(uses)} {verb} the {socket} of node {src}: not wired into value/keep - "
                     f"unloaded now, reloaded by {who}")
    return "\n".join(lines)


def _models_line(states: list[_ModelState], after: bool) -> str:
    items = [
        (s.name, s.loaded_after if after else s.loaded_before, s.device)
        for s in states
        if (s.still_listed if after else True)
    ]
    if not items:
        return "0 models loaded"
    total = sum(b for _, b, _ in items)
    names = ", ".join(f"{n} {fmt_bytes(b)} on {d}" for n, b, d in items)
    return (
        f"{len(items)} model{'s' if len(items) != 1 else ''} loaded, {fmt_bytes(total)} of weights: {names}"
    )


def _report(
    *,
    run: int,
    prompt_id: str | None,
    node_id: str | None,
    unload: str,
    method: str,
    empty_cache: bool,
    wanted: list[Any],
    states: list[_ModelState],
    usage_before: dict[torch.device, dict[str, int | None]],
    usage_after: dict[torch.device, dict[str, int | None]],
    dropped: bool | None,
    hints: list[tuple[str, str, str, str, int, str]],
    seconds: float,
) -> Report:
    devices = sorted({s.device for s in states}, key=str)
    r = Report(NODE, ", ".join(str(d) for d in devices) or str(mm.get_torch_device()))
    where = f" (node {node_id})" if node_id else ""
    r.add("prompt", f"{prompt_id or '-'} · run #{run}{where}")
    r.add("request", f"unload {unload} · method {method} · empty cache {'on' if empty_cache else 'off'}")
    if unload == UNLOAD_KEEP:
        kept = [s.name for s in states if s.kept]
        wired = ", ".join(sorted({_name(p) for p in wanted})) or "none"
        r.add(
            "keep", f"{', '.join(kept) or 'nothing loaded matched'} (models wired into value/keep: {wired})"
        )
    r.add("before", _models_line(states, after=False))
    unloaded = [s for s in states if not s.still_listed]
    partial = [s for s in states if s.still_listed and s.loaded_after < s.loaded_before]
    if unloaded or partial:
        lines = [
            f"{s.name}: {fmt_bytes(s.loaded_before)} -> {fmt_bytes(s.loaded_after)} on {s.device} "
            f"({s.loaded_before - s.loaded_after} B released)"
            for s in unloaded
        ]
        lines += [
            f"{s.name} (partly): {fmt_bytes(s.loaded_before)} -> {fmt_bytes(s.loaded_after)} on {s.device} "
            f"({s.loaded_before - s.loaded_after} B released)"
            for s in partial
        ]
        r.add("unloaded", "\n".join(lines))
    else:
        r.add("unloaded", "nothing")
    released = sum(s.loaded_before - s.loaded_after for s in states)
    gone = [s for s in states if s.loaded_after < s.loaded_before]
    res_before = sum(s.resident_before for s in gone)
    res_after = sum(s.resident_after for s in gone)
    freed = (
        f"{fmt_bytes(released)} ({released} B) of model weights released by ComfyUI (loaded_size); "
        f"exact storage count of those models' weights on their device: {fmt_bytes(res_before)} -> "
        f"{fmt_bytes(res_after)} ({res_before - res_after} B left the device)"
    )
    pages = sum(s.pages_before - s.pages_after for s in gone if s.dynamic)
    if any(s.dynamic for s in gone):
        freed += (
            f"; of the released weights, {fmt_bytes(pages)} ({pages} B) were aimdo pages of dynamic models "
            "(outside torch's allocator: not in the storage count nor memory_allocated; the driver's used "
            "memory shows them)"
        )
    r.add("freed", freed)
    dev_lines = []
    for d in sorted(usage_before, key=str):
        parts = []
        for how, before in usage_before[d].items():
            after = usage_after.get(d, {}).get(how)
            if before is None or after is None:
                parts.append(f"{how} unmeasured")
            else:
                parts.append(f"{how} {fmt_bytes(before)} -> {fmt_bytes(after)} ({before - after:+d} B freed)")
        line = f"{d}: " + ", ".join(parts)
        offload_devices = {
            torch.device(getattr(s.patcher, "offload_device", d)) for s in gone if s.patcher is not None
        }
        if gone and offload_devices == {d}:
            line += f"; load and offload device are both {d}: unloaded weights stay in this memory"
        dev_lines.append(line)
    r.add("device", "\n".join(dev_lines) or "no models were loaded")
    r.add("dynamic", _dynamic_line(states))
    r.add("after", _models_line(states, after=True))
    if method == METHOD_DROP:
        if unload == UNLOAD_NONE:
            r.add("drop", "nothing to drop (unload is 'nothing')")
        elif dropped:
            r.add(
                "drop",
                "requested: ComfyUI unloads every model and clears its node cache when this prompt ends",
            )
        else:
            r.add(
                "drop", "not available (no ComfyUI server in this process): the weights were offloaded only"
            )
    if hints:
        r.add("downstream", _hint_lines(hints))
    r.add("time", fmt_seconds(seconds))
    r.summary = _summary(unload, states, released, dropped, seconds)
    return r


def _summary(
    unload: str, states: list[_ModelState], released: int, dropped: bool | None, seconds: float
) -> str:
    """The verdict: ``freed 484.5 MiB · unloaded 1 of 2 models · kept AutoencoderKL · 95 ms``."""
    n = len(states)
    unloaded = sum(1 for s in states if not s.still_listed)
    partial = sum(1 for s in states if s.still_listed and s.loaded_after < s.loaded_before)
    kept = [s.name for s in states if s.kept]
    if unload == UNLOAD_NONE:
        what = f"nothing unloaded (unload: {UNLOAD_NONE}) · {n} model{'s' if n != 1 else ''} loaded"
    else:
        what = f"freed {fmt_bytes(released)} · unloaded {unloaded} of {n} model{'s' if n != 1 else ''}"
        what += f" ({partial} partly)" if partial else ""
    keep = ""
    if unload == UNLOAD_KEEP:
        more = f" +{len(kept) - 1} more" if len(kept) > 1 else ""
        keep = f"kept {kept[0]}{more}" if kept else "kept none"
    return summary_line(what, keep, "drop at prompt end" if dropped else "", fmt_seconds(seconds))
