"""What the two decode nodes share: ComfyUI's callables and the pack's stores in one ``DecodeEnv``, the
``budget_mb`` / ``unload_others`` inputs and the report output, and :func:`run` (validate, decode, an
impossible budget reported as the node's input error, the report logged and shown on the node)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

from comfy_api.v0_0_2 import io, ui

from ..memory.cost.exact import ExactCostStore
from ..memory.cost.observed import ObservedStore
from ..memory.cost.phases import CostModelStore
from ..memory.decode import self_check
from ..memory.decode.env import DecodeEnv
from ..memory.decode.guard import never_worse
from ..memory.oom import oom_types
from ..memory.plan.grid import ImpossibleBudgetError
from ..memory.plan.video import PeakStore
from . import _comfy
from ._vae_ops import bounded_vae_attention, group_norm_params

__all__ = ["budget_inputs", "comfy_env", "guarded", "input_errors", "report_output"]

_STORES: dict[str, Any] = {}
STAGE_HOOK: Callable[[str], None] | None = None
"""Test hook (``DecodeEnv.stage_hook``) of every decode and encode node: called with each step's name as the flow
enters it (raise there to make that step fail). Read when a node starts."""


def _store(name: str, make: Callable[[Any], Any], what: str) -> Any:
    """The process-wide store ``name`` under ComfyUI's user folder (in memory when it is not writable)."""
    if name not in _STORES:
        _STORES[name] = make(_comfy.user_cache_file(name, what))
    return _STORES[name]


def comfy_env(node_id: str | None, fault_hook: Callable[[str, int], None] | None = None,
              measure_cpu_tensors: bool = True) -> DecodeEnv:
    """ComfyUI's callables and the pack's persisted stores for either decode engine."""
    return DecodeEnv(
        should_stop=_comfy.should_stop,
        on_oom=_comfy.on_oom,
        oom_exceptions=_comfy.oom_exceptions(),
        progress_bar=lambda total: _comfy.progress_callback(total, node_id),
        phase=_comfy.progress_text(node_id),
        budget=_comfy.vae_budget,
        offload=lambda vae, need: _comfy.offload_others(vae, need, "needed" if need is not None else "all"),
        load_weights=_comfy.load_vae_weights,
        cost_models=_store("cost_models.json", CostModelStore, "cost-model"),
        exact_cost_models=_store("exact_cost_models.json", ExactCostStore, "exact cost-model"),
        peaks=_store("video_peaks.json", PeakStore, "video peak"),
        observed=_store("observed_peaks.json", ObservedStore, "observed peak ratio"),
        checks=_checks(),
        attention=bounded_vae_attention,
        norm_params=group_norm_params,
        fault_hook=fault_hook,
        measure_cpu_tensors=measure_cpu_tensors,
        stage_hook=STAGE_HOOK,
    )


RECHECK_ENV = "VRAMFIT_RECHECK"
"""``VRAMFIT_RECHECK=1`` in ComfyUI's environment: every stored self-check verdict is checked again, once per
decoder per process (the way to re-check a cached failure without deleting files)."""


def _checks() -> self_check.CheckStore:
    store = self_check.store_at(_comfy.user_cache_file(self_check.FILE_NAME, "self-check"))
    store.recheck = os.environ.get(RECHECK_ENV, "").strip() not in ("", "0")
    return store


@contextlib.contextmanager
def input_errors(node: str) -> Iterator[None]:
    """Inside: an impossible budget becomes the node's input error."""
    try:
        yield
    except ImpossibleBudgetError as e:
        raise _comfy.NodeInputError(node, str(e)) from e


def guarded(node: str, env: DecodeEnv, own: Callable[[], Any], host: Callable[[], Any], *, vae: Any,
            budget_mb: float, work: str = "decode") -> Any:
    """``own()`` (an impossible budget as the node's input error); when the pack's own machinery fails, the host's
    own node ``host()`` on the whole input instead, with a report saying why (:func:`never_worse`). The user's
    bad input, Cancel and out of memory are passed on."""
    passthrough = (_comfy.NodeInputError, *_comfy.cancel_exceptions(), *oom_types(env.oom_exceptions))

    def run() -> Any:
        env.at("identify")
        with input_errors(node):
            return own()

    return never_worse(node, env, run, host, vae=vae, budget_mb=budget_mb, passthrough=passthrough, work=work)


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


def output(result: Any, logger: logging.Logger) -> io.NodeOutput:
    """A decode result as the node's outputs: images, the report text (logged, and shown on the node)."""
    text = result.report.text()
    logger.info("%s", text)
    return io.NodeOutput(result.images, text, ui=ui.PreviewText(text))
