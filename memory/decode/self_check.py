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

Every executor decodes a batch one item (or a few) per pass, which is the host's result only when the decoder
treats its batch items independently. SVD's temporal decoder does not: it mixes the items of its batch as the
frames of one video. :func:`check_batch` proves independence on this host: a tiny batch of
:data:`BATCH_CHECK_ITEMS` decoded whole by the host, and one item per pass; a decoder that fails it is decoded
with its whole batch in one pass, or reported approximate (``decode.image``). The per-item checks above and this
one together prove a split decode exact.

A :class:`Verdict` is kept per key: the executor, the decoder's :func:`code_fingerprint` (parameter
structure, every module's class, forward and decode code, the source files behind them, the torch version), the
host behaviour the executor detected, the dtype and the device type. The store is in memory and, for the
nodes, ``self_checks.json`` under ComfyUI's user folder: one check per decoder and host, then none.

Three outcomes (:func:`checked`):

* **passed**: stored under the structure key; every file of that structure is then decoded exactly;
* **failed** (finite outputs that differ, or another shape): stored under the structure key *and the weights'
  digest* (:func:`weights_digest`), so one file cannot condemn the other files of its structure (each checks
  for itself); re-checked when the host, torch or the pack changes, or once per process when the store's
  ``recheck`` is set (the nodes set it from ``VRAMFIT_RECHECK=1``);
* **inconclusive** (non-finite values in the host's reference or the executor's output, or the check ran out
  of memory): no verdict, never stored; the decode reports exactness as unverified for this run and the next
  decode checks again.
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
from .first_use import FirstUse

log = logging.getLogger("vramfit.memory.decode.self_check")

__all__ = [
    "BATCH_CHECK_ITEMS", "ENCODE_METHODS", "FIDELITY_FLOOR_DB", "FILE_NAME", "RECHECK_HINT", "CheckStore", "Verdict",
    "check_batch", "check_key", "checked", "code_fingerprint", "fmt_db", "psnr_db",
    "memory_store", "store_at", "tolerance", "verify", "weights_digest",
]

NOISE_EPS = 8
"""Tolerance in machine epsilons of the dtype (float32: floored at :data:`MIN_TOLERANCE`)."""
MIN_TOLERANCE = 1e-4
"""Smallest tolerance (outputs on [-1, 1]; float32 noise of both executors measured <= 1e-5)."""
FIDELITY_FLOOR_DB = 30.0
"""The least PSNR (dB, on ``[0, 1]`` outputs, vs the host's own decode of the check's input) an approximate path
must measure to be taken without the user asking for approximate output (issue 36: an overlap-blend of LTX 2.4's
diffusion decoder measured 10 dB, Cosmos's frames off by 1.0)."""


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
    conclusive: bool = True
    """False: the check could not conclude (non-finite reference, out of memory): no verdict, never stored."""
    weights: str = ""
    """The weights' digest a failure was found with (:func:`weights_digest`; "" for passes)."""
    cached: bool = dataclasses.field(default=False, compare=False)
    """Read from the store (not run now); not stored itself."""
    psnr: float | None = None
    """A fidelity check's (:func:`verify` with ``floor_db``) worst PSNR in dB on ``[0, 1]`` outputs (``inf``: equal);
    None for an exactness check."""
    floor_db: float | None = None
    """The PSNR a fidelity check must reach to pass (None for an exactness check)."""

    @property
    def state(self) -> str:
        """``passed``, ``failed`` or ``inconclusive``."""
        return "passed" if self.ok else ("failed" if self.conclusive else "inconclusive")

    def describe(self) -> str:
        what = f"vs the host's own result on a tiny input, checked in {fmt_seconds(self.seconds)}"
        if self.floor_db is not None and self.conclusive and self.psnr is not None:
            cmp = ">=" if self.ok else "<"
            return (f"measured {fmt_db(self.psnr)} vs VAE Decode on the first-use check ({self.worst}; "
                    f"{cmp} the {self.floor_db:g} dB floor; max abs diff {self.max_diff:.3g}; checked in "
                    f"{fmt_seconds(self.seconds)})")
        if self.ok:
            return f"self-check passed on this host (max abs diff {self.max_diff:.1e} <= {self.tolerance:.0e} {what})"
        if not self.conclusive:
            return (f"self-check could not conclude on this host ({self.detail}): exactness is unverified "
                    "for this run; not cached, checked again at the next run")
        diff = "" if math.isinf(self.max_diff) else f"max abs diff {self.max_diff:.3g} > {self.tolerance:.0e} "
        extra = f" ({self.detail})" if self.detail else ""
        again = f"; {RECHECK_HINT}" if self.cached else ""
        return f"self-check FAILED on this host: {self.worst}: {diff}{what}{extra}{again}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("cached")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Verdict:
        def opt(v: Any) -> float | None:
            return None if v is None else float(v)

        return cls(bool(d["ok"]), float(d["max_diff"]), float(d["tolerance"]), str(d["worst"]),
                   float(d["seconds"]), str(d.get("detail", "")), bool(d.get("conclusive", True)),
                   str(d.get("weights", "")), psnr=opt(d.get("psnr")), floor_db=opt(d.get("floor_db")))


def fmt_db(psnr: float) -> str:
    """A PSNR for a report: ``23.4 dB``; ``inf dB`` for equal outputs."""
    return "inf dB (equal)" if math.isinf(psnr) else f"{psnr:.1f} dB"


def psnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR in dB of ``out`` against ``ref``, both on ``[0, 1]`` (peak 1); ``inf`` when equal. Compared on
    the CPU (:func:`_pair`)."""
    out, ref = _pair(out, ref)
    mse = (out - ref).pow(2).mean().item()
    return math.inf if mse == 0 else 10.0 * math.log10(1.0 / mse)


RECHECK_HINT = ("a verdict cached for this VAE file (its weights); other files of this structure check for "
                "themselves; it is checked again when ComfyUI, torch or VRAM Fit change, or now: restart "
                "ComfyUI with VRAMFIT_RECHECK=1")


class CheckStore(Store[dict]):
    """Verdicts by key (dicts of :meth:`Verdict.to_dict`)."""

    section = "checks"
    recheck = False
    """Set: a stored verdict is run again once per key in this process (nodes: ``VRAMFIT_RECHECK=1``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rechecked: set[str] = set()

    def decode(self, value: Any) -> dict[str, Any]:
        return Verdict.from_dict(value).to_dict()

    def verdict(self, key: str, weights: str) -> Verdict | None:
        """The verdict stored for ``key``: this file's failure (``key#weights``), else the structure's pass (a
        failure stored at ``key`` itself, by versions before per-file failures, is not a verdict). With
        ``recheck``, an entry not written by this process is no verdict (checked again, once)."""
        for k in (f"{key}#{weights}", key):
            found = self.get(k)
            if found is None or not (found["ok"] or k != key):
                continue
            if self.recheck and k not in self.rechecked:
                return None
            return dataclasses.replace(Verdict.from_dict(found), cached=True)
        return None

    def keep(self, key: str, verdict: Verdict, weights: str) -> None:
        """Store a conclusive verdict: a pass under ``key`` (this file's earlier failure dropped), a failure
        under ``key#weights``. An inconclusive one is not kept."""
        if not verdict.conclusive:
            return
        if verdict.ok:
            self.drop(f"{key}#{weights}")
            self.put(key, verdict.to_dict())
            self.rechecked.add(key)
        else:
            self.put(f"{key}#{weights}", verdict.to_dict())
            self.rechecked.add(f"{key}#{weights}")


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


def code_fingerprint(model: Any, methods: tuple[str, ...] = ("forward", "decode")) -> str:
    """Short digest of what decides ``model``'s behaviour besides its weights: its parameter structure,
    every module's class, its ``methods`` (instance-level overrides included; an encode's key adds ``encode``:
    :data:`ENCODE_METHODS`), the source files of those classes and their bases, and the torch version. A ComfyUI
    update or a patched layer gives a new fingerprint, hence a new self-check."""
    h = hashlib.sha256(f"{structure_digest(model)}|{torch.__version__}".encode())
    files: set[str] = set()
    for name, m in model.named_modules():
        cls = type(m)
        h.update(f"{name}={cls.__module__}.{cls.__qualname__}".encode())
        for method in methods:
            fn = m.__dict__.get(method, getattr(cls, method, None))
            if fn is not None:
                h.update(f":{method}={_function_digest(fn)}".encode())
        files.update(_class_files(cls))
    for f in sorted(files):
        h.update(f"{f}:{_file_digest(f)};".encode())
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------------------------------
# The check


ENCODE_METHODS = ("forward", "decode", "encode")
"""The methods an encode's :func:`code_fingerprint` digests (a decode's default stays, so its keys keep)."""


def check_key(kind: str, model: Any, *parts: object, dtype: torch.dtype, device: torch.device,
              fingerprint: str | None = None, suffix: str = "") -> str:
    """The store key of an image or encode self-check: ``kind/module.Class/fingerprint/parts.../dtype/device
    type`` + ``suffix``: a verdict holds for this code (``fingerprint``, default :func:`code_fingerprint`) on this
    dtype and device type, and for what ``parts`` name (the executor's version, a tile...). Keys are kept
    byte-identical across versions: a stored verdict is found again."""
    cls = type(model)
    fp = code_fingerprint(model) if fingerprint is None else fingerprint
    return "/".join((kind, f"{cls.__module__}.{cls.__qualname__}", fp, *map(str, parts),
                     str(dtype).removeprefix("torch."), device.type)) + suffix


def weights_digest(model: Any) -> str:
    """Short digest of ``model``'s weights (shapes, dtypes and up to 64 evenly spaced values of every
    parameter and buffer): which file a failure was found with. "" when a weight is not materialised."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.device.type == "meta":
                return ""
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:12]


def _pair(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both outputs of a check in float32 on the CPU: an executor may write into a buffer on the host while the
    host's decode returns on the device (the carried executors' checks on CUDA, 2026-11-27: "Expected all tensors
    to be on the same device" failed every carried family there). The check's tensors are tiny."""
    return out.detach().float().cpu(), ref.detach().float().cpu()


def _max_diff(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, f"output shape {tuple(out.shape)}, the host's {tuple(ref.shape)}"
    out, ref = _pair(out, ref)
    return (out - ref).abs().max().item(), ""


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "out of memory" in str(e).lower()


def verify(
    key: str,
    store: CheckStore,
    reference: Callable[[], torch.Tensor],
    configs: Sequence[tuple[str, Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
    weights: str = "",
    floor_db: float | None = None,
) -> Verdict:
    """The stored verdict for ``key`` and ``weights`` (:meth:`CheckStore.verdict`), or run the check now.

    ``reference()``: the host's own decode of a tiny latent; ``configs``: ``(label, run)`` pairs, each
    ``run()`` the executor's decode of the same latent in one configuration. Passes when every output has
    the reference's shape and is within :func:`tolerance` of it. Inconclusive (not stored, checked again next
    time) when an output is non-finite or the check runs out of memory. A run that raises otherwise fails
    the check; that verdict is not stored either (it may be transient).

    ``floor_db``: a *fidelity* check of an approximate path instead: the outputs (on ``[0, 1]``) pass when the
    worst PSNR against the reference (:func:`psnr_db`) is at least ``floor_db``; the verdict carries it
    (:attr:`Verdict.psnr`), stored and kept inconclusive exactly as an exactness check's."""
    found = store.verdict(key, weights)
    if found is not None:
        return found
    tol = tolerance(dtype)
    t0 = time.perf_counter()
    label = "the host's decode"
    worst, worst_d, detail = "", -1.0, ""
    worst_db: float | None = None
    try:
        with torch.inference_mode():
            ref = reference()
            if not bool(torch.isfinite(ref).all()):
                verdict = Verdict(False, math.inf, tol, label, time.perf_counter() - t0,
                                  "the host's own decode of the check latent has non-finite values: broken "
                                  "or overflowing weights", conclusive=False, weights=weights, floor_db=floor_db)
                log.warning("%s [%s]", verdict.describe(), key)
                return verdict
            for label, run in configs:
                out = run()
                if not bool(torch.isfinite(out).all()):  # e.g. an fp16 overflow: no evidence either way
                    verdict = Verdict(False, math.inf, tol, label, time.perf_counter() - t0,
                                      f"{label} gave non-finite values where the host's decode has none",
                                      conclusive=False, weights=weights, floor_db=floor_db)
                    log.warning("%s [%s]", verdict.describe(), key)
                    return verdict
                d, why = _max_diff(out, ref)
                if floor_db is not None:
                    db = psnr_db(out, ref) if not why else -math.inf
                    if worst_db is None or db < worst_db:
                        worst, worst_db, detail = label, db, why
                    worst_d = max(worst_d, d)
                elif d > worst_d:
                    worst, worst_d, detail = label, d, why
    except Exception as e:  # noqa: BLE001 - any failure means "not proven"; logged and reported
        oom = _is_oom(e)
        what = f"{label} ran out of memory: {e}" if oom else f"{type(e).__name__}: {e}"
        verdict = Verdict(False, math.inf, tol, label, time.perf_counter() - t0, what, conclusive=not oom,
                          weights=weights, floor_db=floor_db)
        log.warning("%s [%s]", verdict.describe(), key)
        return verdict
    ok = worst_d <= tol if floor_db is None else worst_db is not None and worst_db >= floor_db
    seconds = time.perf_counter() - t0
    verdict = Verdict(ok, worst_d, tol, worst, seconds, detail, weights="" if ok else weights, psnr=worst_db,
                      floor_db=floor_db)
    store.keep(key, verdict, weights)
    (log.info if verdict.ok else log.warning)("%s [%s]", verdict.describe(), key)
    return verdict


def checked(
    key: str,
    store: CheckStore,
    model: Any,
    reference: Callable[[], torch.Tensor],
    configs: Sequence[tuple[str, Callable[[], torch.Tensor]]],
    dtype: torch.dtype,
    prepare: Callable[[], None] | None = None,
    first_use: FirstUse | None = None,
    what: str = "checking exactness against the host's own result",
    floor_db: float | None = None,
) -> Verdict:
    """:func:`verify` for an executor over ``model``: the stored verdict for this structure (or, after a
    failure, for this file: :func:`weights_digest`), else ``prepare()`` (the node loads the weights) and check
    now (a ``first_use`` phase named ``what``: shown and timed). ``floor_db``: a fidelity check (:func:`verify`)."""
    weights = weights_digest(model)
    found = store.verdict(key, weights)
    if found is not None:
        return found

    def check() -> Verdict:
        w = weights
        if prepare is not None:
            prepare()
            w = w or weights_digest(model)
        return verify(key, store, reference, configs, dtype, w, floor_db)

    if first_use is None:
        return check()
    return first_use.run(what, check)


BATCH_CHECK_ITEMS = 3
"""Items of the batch self-check's latent (:func:`check_batch`)."""


def check_batch(
    key: str,
    store: CheckStore,
    model: Any,
    decode: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    dtype: torch.dtype,
    prepare: Callable[[], None] | None = None,
    first_use: FirstUse | None = None,
) -> Verdict:
    """Whether the host's ``decode`` of the batch ``z`` equals its items decoded one per pass (:func:`checked`:
    cached per ``key``, a failure per file, an inconclusive check never): passed, a decode may split the batch
    into passes; failed, the decoder's output for one item depends on the other items of its batch."""
    n = int(z.shape[0])

    def one_per_pass() -> torch.Tensor:
        return torch.cat([decode(z[i : i + 1]) for i in range(n)])

    return checked(key, store, model, lambda: decode(z), [(f"1 of {n} items per pass", one_per_pass)], dtype,
                   prepare, first_use, "checking that the items of a batch decode independently")
