"""Budget: the bytes a decode may use on its device.

``available = free + evictable - vae_weights_to_load - reserve`` where ``free`` is what ComfyUI
reports as free on the device (``comfy.model_management.get_free_memory(device)``: CUDA/XPU/NPU/MLU
free + torch's cached-but-unused bytes; on CPU and MPS, ``psutil.virtual_memory().available``), or
the user's budget in MB when given (it *replaces* free memory and ``evictable``, so low-VRAM
behaviour can be exercised on any machine). ``vae_weights_to_load`` is the part of the VAE's weights
not yet on the device (they will be loaded before decoding and are not part of a decode's peak).
A user budget caps the decode's working memory only: the nodes pass no weights with it
(``nodes/_comfy.vae_budget``), so it plans the same whether the VAE is loaded yet or not.

``evictable`` (ComfyUI >= 0.33 with dynamic VRAM on, else 0): the aimdo pages holding other dynamic
models' weights on the device (``memory.offload.evictable_bytes``). They are not in ``free`` (the
driver counts them as used), yet comfy-aimdo evicts them whenever torch's allocator needs the room,
so a decode can use them without unloading anything; ComfyUI's own VAE decode counts them the same
way (``ModelPatcher.get_free_memory``: free + ``vbars_analyze``).

Default safety reserve (``default_reserve``):

* accelerators: ``max(256 MiB, 5 % of total)``. The CUDA cost models measure the allocator's own
  peak, so what is left to cover is memory outside the measured block: the CUDA context growing
  when new kernels/libraries (cuDNN, cuBLAS handles and their workspaces) load on first use
  (~100-300 MiB), the gap between reserved and allocated blocks (fragmentation; the caching
  allocator rounds to 2 MiB segments), and other processes sharing the card. 5 % of a 24 GiB card
  is 1.2 GiB; 256 MiB is the floor for small cards. ComfyUI's own ``--reserve-vram`` (its
  ``extra_reserved_memory()``, 400 MiB by default, 600 MiB on Windows) is honoured when the caller
  passes it as ``reserve_floor``.
* CPU: ``max(512 MiB, 5 % of total RAM)``: RAM is shared with the OS page cache and every other
  program, and ``available`` moves while we decode.

Multiplicative untracked overhead (e.g. oneDNN scratch on CPU) belongs to the cost model
(``CostModel.overhead``), not to this constant.

Host memory (``host_room``): on an accelerator a plan may keep its store (whole-frame activations) in host
memory to leave room on the device. That store takes RAM the offloaded models, the output and the rest of the
process share, so a plan uses it only when it fits :data:`HOST_STORE_SHARE` of the RAM available once the
offload is done, less the output buffer when the output lives in host memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from .report import fmt_bytes

log = logging.getLogger("vramfit.memory.budget")

MiB = 2**20
ACCEL_RESERVE_MIN = 256 * MiB
CPU_RESERVE_MIN = 512 * MiB
RESERVE_FRACTION = 0.05


def default_reserve(device: torch.device | str, total_bytes: int | None) -> int:
    """The default safety reserve for ``device`` (see module docstring)."""
    dev = torch.device(device)
    floor = CPU_RESERVE_MIN if dev.type == "cpu" else ACCEL_RESERVE_MIN
    if not total_bytes:
        return floor
    return max(floor, int(total_bytes * RESERVE_FRACTION))


@dataclasses.dataclass(frozen=True)
class Budget:
    device: str
    free_bytes: int
    vae_weights_to_load: int
    reserve: int
    user_override: int | None
    available: int
    total_bytes: int | None = None
    psutil_available: int | None = None
    evictable_bytes: int = 0
    """Dynamic-VRAM weights of other models that aimdo evicts on demand (counted as available)."""
    patcher_free: int | None = None
    """The VAE patcher's own ``get_free_memory`` under dynamic VRAM (what newer ComfyUI asks model code to read):
    shown beside the figure used; it also counts the VAE's own staged weights as free, which the decode needs."""

    @property
    def source(self) -> str:
        return "user budget" if self.user_override is not None else "free memory"

    def describe(self, work: str = "decoding") -> str:
        """The report's ``budget`` row: the figure the plan is made with, named once. A user budget is that
        figure unless something is taken off it (``512 MiB (412 MiB after VAE weights to load 100 MiB)``);
        free memory shows its sum, ending in the bytes ``available for {work}``."""

        def mib(n: int | None) -> str:
            return fmt_bytes(n, "MiB", 0)

        user = self.user_override is not None
        if user:  # the nodes' user budget caps working memory: no weights in it (see module docstring)
            head = f"user budget {mib(self.user_override)}"
            if not self.vae_weights_to_load:
                head += " of working memory (VAE weights not counted)"
            taken = [f"{what} {mib(n)}" for what, n in (("VAE weights to load", self.vae_weights_to_load),
                                                       ("reserve", self.reserve)) if n]
            if taken:
                head += f" ({mib(self.available)} after {' and '.join(taken)})"
            return f"{self.device}: {head}"
        head = f"free {mib(self.free_bytes)}" + (f" of {mib(self.total_bytes)}" if self.total_bytes else "")
        if self.evictable_bytes:
            head += f" + evictable {mib(self.evictable_bytes)} (dynamic VRAM: other models' weights aimdo evicts)"
        text = (f"{self.device}: {head} - VAE weights to load {mib(self.vae_weights_to_load)} - reserve "
                f"{mib(self.reserve)} = {mib(self.available)} available for {work}")
        if self.psutil_available is not None:
            text += f" (psutil: {mib(self.psutil_available)} RAM available)"
        if self.patcher_free is not None:
            text += (f"; the VAE patcher's get_free_memory says {mib(self.patcher_free)} (it counts the VAE's own "
                     "staged weights as free too, so the figure above is the one used)")
        return text

    def __str__(self) -> str:
        return self.describe()


HOST_STORE_SHARE = 0.75
"""Part of the available host RAM a store in host memory may take (the rest: the OS, page cache, other programs)."""


def host_room(ram_available: int | None, held: int = 0) -> int | None:
    """Bytes a store in host memory may take: :data:`HOST_STORE_SHARE` of ``ram_available`` less ``held`` (what
    the decode keeps there besides, e.g. its output buffer); None when the RAM is not known (unbounded)."""
    if ram_available is None:
        return None
    return max(0, int(ram_available * HOST_STORE_SHARE) - int(held))


def host_refused_text(need: int, room: int | None) -> str:
    """The plan row's words when a store in host memory of ``need`` bytes was left out for :func:`host_room`."""
    return (f" (store in host memory not used: it needs {fmt_bytes(need)}, the host's RAM has room for "
            f"{fmt_bytes(room or 0)})")


def ram_available() -> int | None:
    """The host's available RAM now (``psutil.virtual_memory().available``; None without psutil)."""
    return _psutil_available()


def _psutil_available() -> int | None:
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def compute_budget(
    device: torch.device | str,
    get_free_memory: Callable[[Any], int] | None = None,
    *,
    get_total_memory: Callable[[Any], int] | None = None,
    vae_weights_to_load: int = 0,
    reserve: int | None = None,
    reserve_floor: int = 0,
    user_budget_mb: float | None = None,
    evictable_bytes: int = 0,
    patcher_free: int | None = None,
) -> Budget:
    """The :class:`Budget` of a decode on ``device``.

    ``get_free_memory``/``get_total_memory``: ``comfy.model_management.get_free_memory`` /
    ``get_total_memory`` (passed in; ``memory/`` never imports ComfyUI). Without them the CPU falls
    back to psutil and an accelerator to ``torch.cuda.mem_get_info``. ``reserve`` overrides the
    default; ``reserve_floor`` raises it (e.g. ComfyUI's ``extra_reserved_memory()``).
    ``user_budget_mb`` (> 0) replaces free memory. ``evictable_bytes``: dynamic-VRAM weights of other
    models on the device (``memory.offload.evictable_bytes``), added to free memory. ``patcher_free``: the VAE
    patcher's ``get_free_memory`` under dynamic VRAM, reported beside the figure used (:attr:`Budget.patcher_free`).
    """
    dev = torch.device(device)
    total: int | None = None
    if get_total_memory is not None:
        try:
            total = int(get_total_memory(dev))
        except (RuntimeError, AssertionError, ValueError) as e:
            log.debug("get_total_memory(%s) failed: %s", dev, e)
    psutil_avail = _psutil_available() if dev.type == "cpu" else None
    if get_free_memory is not None:
        free = int(get_free_memory(dev))
    elif dev.type == "cpu":
        if psutil_avail is None:
            raise RuntimeError("no get_free_memory given and psutil is not installed")
        free = psutil_avail
    elif dev.type == "cuda":
        free, tot = torch.cuda.mem_get_info(dev)
        free = int(free)
        total = total or int(tot)
    else:
        raise ValueError(f"pass get_free_memory for a {dev.type} device")
    if total is None and dev.type == "cpu":
        try:
            import psutil

            total = int(psutil.virtual_memory().total)
        except ImportError:
            total = None
    if dev.type == "cpu" and psutil_avail is not None and get_free_memory is not None:
        # ComfyUI reports psutil's figure on CPU; a large disagreement means something is off.
        if abs(free - psutil_avail) > max(256 * MiB, 0.1 * psutil_avail):
            log.warning(
                "free memory on cpu: ComfyUI says %.0f MiB, psutil %.0f MiB", free / MiB, psutil_avail / MiB
            )
    user = None
    if user_budget_mb is not None and user_budget_mb > 0:
        user = int(user_budget_mb * MiB)
    res = default_reserve(dev, total) if reserve is None else int(reserve)
    res = max(res, int(reserve_floor))
    if user is not None and reserve is None:
        # A user budget is what the decode may use: no hidden reserve on top of it.
        res = 0
    evictable = max(0, int(evictable_bytes))
    base = user if user is not None else free + evictable
    available = max(0, base - int(vae_weights_to_load) - res)
    return Budget(
        device=str(dev),
        free_bytes=free,
        vae_weights_to_load=int(vae_weights_to_load),
        reserve=res,
        user_override=user,
        available=available,
        total_bytes=total,
        psutil_available=psutil_avail,
        evictable_bytes=evictable,
        patcher_free=None if user is not None or patcher_free is None else int(patcher_free),
    )


def weights_to_load(model_size: int, loaded_size: int) -> int:
    """Bytes of a model's weights still to be moved to the device (``model_size - loaded_size``)."""
    return max(0, int(model_size) - int(loaded_size))
