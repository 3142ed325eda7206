"""What both decodes take from their host, and the steps they share around their own planning and execution:
offload and budget before planning (:func:`prepare`), the VAE's weights after it (:func:`load_weights`),
and the measured window around execution (:func:`measured`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..budget import Budget, compute_budget, host_room, ram_available
from ..cost.exact import ExactCostStore
from ..cost.observed import ObservedStore
from ..cost.phases import CostModelStore
from ..measure.tracker import decode_tracker
from ..oom import default_oom_exceptions
from ..plan.video import PeakStore
from ..run_context import ProgressFn, RunContext
from .self_check import CheckStore, memory_store

__all__ = ["DecodeEnv", "Measured", "Prepared", "default_budget", "host_room_for", "load_weights", "measured",
           "prepare", "unaliased"]


def default_budget(vae: Any, budget_mb: float) -> Budget:
    """Free memory of the VAE's device (``budget_mb`` > 0: that instead)."""
    return compute_budget(torch.device(vae.device), user_budget_mb=budget_mb if budget_mb > 0 else None)


def _no_attention_bound(model: Any, max_bytes: int) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclasses.dataclass
class DecodeEnv:
    """What a decode takes from its host (ComfyUI), as plain callables; the defaults run standalone.

    The nodes pass ComfyUI's: ``should_stop`` = ``throw_exception_if_processing_interrupted``, ``on_oom`` =
    ``soft_empty_cache``, ``oom_exceptions`` = ``(OOM_EXCEPTION,)``, ``progress_bar(total)`` = a
    ``comfy.utils.ProgressBar`` callback, ``budget(vae, budget_mb)`` from ComfyUI's free memory,
    ``offload(vae, bytes | None)`` unloading upstream models (None: all; returns an object with
    ``describe()``), ``load_weights(vae, bytes)`` = ``load_models_gpu``, the stores under ComfyUI's user
    folder, ``attention(model, bytes)`` bounding the KL mid block's split attention, ``norm_params`` =
    ComfyUI's weight casting for GroupNorm affines.
    """

    should_stop: Callable[[], Any] | None = None
    on_oom: Callable[[], None] | None = None
    oom_exceptions: tuple[type[BaseException], ...] = dataclasses.field(default_factory=default_oom_exceptions)
    progress_bar: Callable[[int], ProgressFn] | None = None
    budget: Callable[[Any, float], Budget] = default_budget
    offload: Callable[[Any, int | None], Any] | None = None
    load_weights: Callable[[Any, int], None] | None = None
    cost_models: CostModelStore = dataclasses.field(default_factory=lambda: CostModelStore(None))
    exact_cost_models: ExactCostStore = dataclasses.field(default_factory=lambda: ExactCostStore(None))
    peaks: PeakStore = dataclasses.field(default_factory=PeakStore)
    observed: ObservedStore = dataclasses.field(default_factory=ObservedStore)
    """Measured over predicted peaks per path (:mod:`..cost.observed`; the nodes' persist)."""
    checks: CheckStore = dataclasses.field(default_factory=memory_store)
    """Self-check verdicts (:mod:`.self_check`; the nodes' persist under ComfyUI's user folder)."""
    attention: Callable[[Any, int], contextlib.AbstractContextManager[Any]] = _no_attention_bound
    norm_params: Callable[[Any, torch.Tensor], Any] | None = None
    fault_hook: Callable[[str, int], None] | None = None
    """Tests: called as ``("tile", k)`` inside every tile attempt, ``("pass", i)`` before every image pass and
    ``("step", s)`` at every step of the video executors; raise an out-of-memory exception there to
    exercise the recovery paths."""
    phase: Callable[[str], None] | None = None
    """Shows what a decode is doing besides decoding (first use: checking, calibrating) on the node; the
    nodes pass ComfyUI's progress text."""
    host_ram: Callable[[], int | None] = ram_available
    """The host's available RAM now (None: unknown), read after the offload: a store in host memory must fit it
    (:func:`..budget.host_room`); tests pass a small figure."""
    measure_cpu_tensors: bool = True
    """On CPU, count live tensor bytes with ``PeakTracker`` (dispatch mode, a Python hook on every op: the
    figure the budget bounds); False: the process RSS high-water mark (cheaper, not comparable with it)."""
    stage: str = "identify"
    """The step the decode is in (:data:`.guard.STAGES`): named in the report when the pack's own path fails."""
    stage_hook: Callable[[str], None] | None = None
    """Tests: called with each step's name as the flow enters it (raise there to make that step fail)."""

    def at(self, stage: str) -> None:
        """The flow enters ``stage`` (one of :data:`.guard.STAGES`)."""
        self.stage = stage
        if self.stage_hook is not None:
            self.stage_hook(stage)

    def run_context(self, progress: ProgressFn | None, stats: dict) -> RunContext:
        """What an executor's run takes from this environment (the fault hook called as ``("step", s)``)."""
        hook = self.fault_hook
        return RunContext(progress, self.should_stop, (lambda s: hook("step", s)) if hook is not None else None,
                          self.oom_exceptions, self.on_oom, stats)


@dataclasses.dataclass(frozen=True)
class Prepared:
    budget: Budget
    offload: str
    """The offload row of the report."""
    host_room: int | None = None
    """Bytes a store in host memory may take (:func:`host_room_for`, read after the offload; None: no room given)."""


def host_room_for(env: DecodeEnv, device: torch.device, out_device: torch.device, out_bytes: int) -> int | None:
    """Bytes a store in host memory may take in a decode on ``device`` whose output of ``out_bytes`` lives on
    ``out_device`` (:func:`..budget.host_room`, read now: call it after the offload). None on the CPU (no store
    there) or when the RAM is not known."""
    if device.type == "cpu":
        return None
    return host_room(env.host_ram(), out_bytes if out_device.type == "cpu" else 0)


def prepare(vae: Any, env: DecodeEnv, need: Callable[[], int | None], budget_mb: float,
            unload_others: bool, host: tuple[torch.device, torch.device, int] | None = None) -> Prepared:
    """Offload upstream models, then take the budget and, for ``host`` = ``(device, out_device, out_bytes)``,
    the host room (:func:`host_room_for`). The decode asks for ``need()`` (the fastest plan's
    peak; None: unknown, offload everything), at most ``budget_mb``, plus the VAE's weights not yet loaded
    (``budget_mb`` caps the decode's working memory, not the weights). VAEs without a ComfyUI model
    patcher are not offloaded for."""
    patcher = getattr(vae, "patcher", None)
    if not unload_others:
        text = "off (unload_others disabled)"
    elif patcher is None:
        text = "skipped (this VAE has no ComfyUI model patcher)"
    elif env.offload is None:
        text = "skipped (no offload callable given)"
    else:
        want = need()
        cap = int(budget_mb * 2**20) if budget_mb else None
        if want is None or cap is not None:
            want = cap if want is None else min(want, cap)
        if want is not None:
            want += max(0, int(patcher.model_size()) - int(patcher.loaded_size()))
        text = env.offload(vae, want).describe()
    budget = env.budget(vae, budget_mb)
    return Prepared(budget, text, None if host is None else host_room_for(env, *host))


def unaliased(out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``out``, copied when it shares memory with ``given`` (a decoder that returns its input, as the pixel-space
    VAE's): ComfyUI's output processing works in place and must never write into a tensor the caller gave."""
    if out.device.type == "meta" or out.device != given.device:
        return out
    if out.untyped_storage().data_ptr() == given.untyped_storage().data_ptr():
        return out.clone()
    return out


def load_weights(vae: Any, env: DecodeEnv, planned: int) -> None:
    """Load the VAE's weights (ComfyUI models only) with room for the planned decode."""
    if getattr(vae, "patcher", None) is not None and env.load_weights is not None:
        env.load_weights(vae, int(planned))


@dataclasses.dataclass
class Measured:
    method: str
    """What was measured (tensors, RSS, ``max_memory_allocated``), for the report."""
    peak: int | None = None
    kind: str = ""
    """The tracker's method (``cuda``, ``dispatch``, ``rss``; "": not measured)."""


@contextlib.contextmanager
def measured(env: DecodeEnv, device: torch.device) -> Iterator[Measured]:
    """The execution window: no autograd graph (ComfyUI runs nodes under inference mode, direct callers
    may not), peak memory measured as the device allows."""
    method, tracker = decode_tracker(device, env.measure_cpu_tensors)
    m = Measured(method, kind=tracker.method if tracker is not None else "")
    with torch.no_grad(), tracker if tracker is not None else contextlib.nullcontext():
        yield m
    if tracker is not None:
        m.peak = int(tracker.peak_bytes)
