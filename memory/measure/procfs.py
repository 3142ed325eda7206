"""This process's resident memory from Linux ``/proc``: the resident set (``VmRSS``), its high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``), and glibc's ``malloc_trim``. Used by the RSS
tracker method and the VRAM monitor's CPU samples (they share the one high-water mark)."""

from __future__ import annotations

import ctypes
import pathlib
import sys

STATUS = pathlib.Path("/proc/self/status")
CLEAR_REFS = pathlib.Path("/proc/self/clear_refs")


def _linux() -> bool:
    return sys.platform.startswith("linux")


def status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes; ``None`` if unreadable."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_rss() -> int | None:
    """Resident set of this process (bytes; ``/proc``, else psutil), or ``None`` when it cannot be read."""
    value = status_bytes("VmRSS") if _linux() else None
    if value is not None:
        return value
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.Process().memory_info().rss)


def read_rss_peak() -> int | None:
    """``VmHWM``: the peak resident bytes of this process since the last reset (Linux), else ``None``."""
    return status_bytes("VmHWM") if _linux() else None


def reset_rss_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set (``/proc/self/clear_refs``); False where unsupported."""
    if not _linux():
        return False
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_peak_supported() -> bool:
    """Whether the RSS high-water mark can be read and reset here (Linux ``/proc``; resets it)."""
    return read_rss_peak() is not None and reset_rss_peak()


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc ``malloc_trim(0)``); False where unavailable."""
    if not _linux():
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # not glibc
        return False
