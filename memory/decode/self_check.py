"""Self-checks: prove on the running host that an executor reproduces the host's own decode.

The exact executors (the KL walker, :mod:`..executors.kl_exact`; the chunked Wan executor, :mod:`..executors.wan`)
drive the host's modules themselves, so they are exact only while the host's decoder behaves as they
assume. ComfyUI 0.33 changed the Wan cache protocol under the chunked executor, whose output was then off
by up to 0.25 while the report said exact. Hence: before an executor's output is reported exact, the
executor must have passed a self-check on this host, for this decoder:

* a tiny latent is decoded by the host (``first_stage_model.decode``, what ``VAEDecode`` runs) and by the
  executor in a few configurations (:func:`verify`; the engines choose them: ``decode.image.check_exact``,
  ``decode.video.check_chunked``);
* every configuration must match within the float noise of the dtype (:func:`tolerance`): otherwise the
  engine falls back to an exact-by-construction path (the host's own decode) or reports the output as
  approximate, with the verdict as the reason.

A :class:`Verdict` is kept per key: the executor, the decoder's :func:`code_fingerprint` (parameter
structure, every module's class, forward and decode code, the source files behind them, the torch version), the
host behaviour the executor detected, the dtype and the device type. The store is in memory and, for the
nodes, ``self_checks.json`` under ComfyUI's user folder: one check per decoder and host, then none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import logging
import math
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..report import fmt_seconds
from ..store import Store
from ..vae.families import structure_digest

log = logging.getLogger("vramfit.memory.decode.self_check")

__all__ = ["FILE_NAME", "CheckStore", "Verdict", "code_fingerprint", "memory_store", "store_at", "tolerance", "verify"]

NOISE_EPS = 8
"""Tolerance in machine epsilons of the dtype (float32: floored at :data:`MIN_TOLERANCE`)."""
MIN_TOLERANCE = 1e-4
"""Smallest tolerance (outputs on [-1, 1]; float32 noise of both executors measured <= 1e-5)."""


def tolerance(dtype: torch.dtype) -> float:
    """Max abs difference on [-1, 1] outputs that still counts as float noise: ``8 eps`` of the dtype, at
    least 1e-4 (float32: 1e-4; float16: 7.8e-3; bfloat16: 6.3e-2). Measured: chunked Wan vs the host in
    bfloat16 / float16 on CPU: 0 (the same kernels); the host's own bfloat16 vs float32 decode: 2.4e-2; a
    cache-protocol mismatch: 0.26 (bfloat16) to 0.35 (float32)."""
    if not dtype.is_floating_point:
        return MIN_TOLERANCE
    return max(MIN_TOLERANCE, NOISE_EPS * torch.finfo(dtype).eps)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Outcome of one self-check."""

    ok: bool
    max_diff: float
    """Worst max abs difference over the configurations (``inf``: one failed to run or had another shape)."""
    tolerance: float
    worst: str
    """The configuration with the worst difference."""
    seconds: float
    """Time the check took when it ran (host decode + every configuration)."""
    detail: str = ""
    """What went wrong ("" when ok)."""

    def describe(self) -> str:
        what = f"vs the host's own decode of a tiny latent, checked in {fmt_seconds(self.seconds)}"
        if self.ok:
            return f"self-check passed on this host (max abs diff {self.max_diff:.1e} <= {self.tolerance:.0e} {what})"
        diff = "" if math.isinf(self.max_diff) else f"max abs diff {self.max_diff:.3g} > {self.tolerance:.0e} "
        extra = f" ({self.detail})" if self.detail else ""
        return f"self-check FAILED on this host: {self.worst}: {diff}{what}{extra}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        return cls(bool(d["ok"]), float(d["max_diff"]), float(d["tolerance"]), str(d["worst"]),
                   float(d["seconds"]), str(d.get("detail", "")))


class CheckStore(Store[dict]):
    """Verdicts by key (dicts of :meth:`Verdict.to_dict`)."""

    section = "checks"

    def decode(self, value: Any) -> dict[str, Any]:
        return Verdict.from_dict(value).to_dict()


FILE_NAME = "self_checks.json"
"""The nodes' verdict file under ComfyUI's user folder (``vramfit/self_checks.json``)."""
_MEMORY_STORE = CheckStore()
_STORES: dict[str, CheckStore] = {}


def memory_store() -> CheckStore:
    """The process-wide in-memory store (callers without a user folder)."""
    return _MEMORY_STORE


def store_at(path: str | pathlib.Path | None) -> CheckStore:
    """The process-wide store persisted at ``path`` (both nodes share one file); in memory for None."""
    if path is None:
        return _MEMORY_STORE
    key = str(path)
    if key not in _STORES:
        _STORES[key] = CheckStore(path)
    return _STORES[key]


# --------------------------------------------------------------------------------------------------
# What decides a decoder's behaviour besides its weights

_FUNCTION_DIGESTS: dict[Any, str] = {}
_CLASS_FILES: dict[type, tuple[str, ...]] = {}
_FILE_DIGESTS: dict[str, str] = {}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


def _function_digest(fn: Any) -> str:
    """Digest of a function's source (bytecode when the source is not available)."""
    fn = getattr(fn, "__func__", fn)
    if fn not in _FUNCTION_DIGESTS:
        try:
            text = inspect.getsource(fn).encode()
        except (OSError, TypeError):
            code = getattr(fn, "__code__", None)
            text = code.co_code if code is not None else repr(fn).encode()
        _FUNCTION_DIGESTS[fn] = _digest(text)
    return _FUNCTION_DIGESTS[fn]


def _class_files(cls: type) -> tuple[str, ...]:
    """Source files of a class and its bases (ComfyUI's ``vae.py``, ``ops.py``, torch's ``conv.py``, ...)."""
    if cls not in _CLASS_FILES:
        files = []
        for c in cls.__mro__:
            try:
                files.append(inspect.getsourcefile(c) or "")
            except TypeError:  # builtins
                continue
        _CLASS_FILES[cls] = tuple(f for f in files if f)
    return _CLASS_FILES[cls]


def _file_digest(path: str) -> str:
    if path not in _FILE_DIGESTS:
        try:
            _FILE_DIGESTS[path] = _digest(pathlib.Path(path).read_bytes())
        except OSError:
            _FILE_DIGESTS[path] = "na"
    return _FILE_DIGESTS[path]


def code_fingerprint(model: Any) -> str:
    """Short digest of what decides ``model``'s behaviour besides its weights: its parameter structure,
    every module's class, ``forward`` and ``decode`` (instance-level overrides included), the source files of
    those classes and their bases, and the torch version. A ComfyUI update or a patched layer gives a new
    fingerprint, hence a new self-check."""
    h = hashlib.sha256(f"{structure_digest(model)}|{torch.__version__}".encode())
    files: set[str] = set()
    for name, m in model.named_modules():
        cls = type(m)
        h.update(f"{name}={cls.__module__}.{cls.__qualname__}".encode())
        for method in ("forward", "decode"):
            fn = m.__dict__.get(method, getattr(cls, method, None))
            if fn is not None:
                h.update(f":{method}={_function_digest(fn)}".encode())
        files.update(_class_files(cls))
    for f in sorted(files):
        h.update(f"{f}:{_file_digest(f)};".encode())
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------------------------------
# The check


def _max_diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, f"output shape {tuple(out.shape)}, the host's {tuple(ref.shape)}"
    d = (out.float() - ref.float()).abs().max().item()
    return (d, "") if math.isfinite(d) else (math.inf, "non-finite values")


def verify(
    key: str,
    store: CheckStore,
    reference: Callable[[], torch.Tensor],
    configs: Sequence[tuple[str, Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
) -> Verdict:
    """The stored verdict for ``key``, or run the check now and store it.

    ``reference()``: the host's own decode of a tiny latent; ``configs``: ``(label, run)`` pairs, each
    ``run()`` the executor's decode of the same latent in one configuration. Passes when every output has
    the reference's shape and is within :func:`tolerance` of it. A run that raises fails the check; that
    verdict is not stored (it may be transient), so the next decode checks again."""
    found = store.get(key)
    if found is not None:
        return Verdict.from_dict(found)
    tol = tolerance(dtype)
    t0 = time.perf_counter()
    label = "the host's decode"
    worst, worst_d, detail = "", -1.0, ""
    try:
        with torch.inference_mode():
            ref = reference()
            for label, run in configs:
                d, why = _max_diff(run(), ref)
                if d > worst_d:
                    worst, worst_d, detail = label, d, why
    except Exception as e:  # noqa: BLE001 - any failure means "not proven"; logged and reported
        verdict = Verdict(False, math.inf, tol, label, time.perf_counter() - t0, f"{type(e).__name__}: {e}")
        log.warning("%s [%s]", verdict.describe(), key)
        return verdict
    verdict = Verdict(worst_d <= tol, worst_d, tol, worst, time.perf_counter() - t0, detail)
    store.put(key, verdict.to_dict())
    (log.info if verdict.ok else log.warning)("%s [%s]", verdict.describe(), key)
    return verdict
