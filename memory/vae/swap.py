"""Submodules of a host model replaced for one call (:func:`swapped`): how the pack runs the host's own forward
code on part of a model (a prefix with its suffix swapped out, a tail with its head swapped out)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["swapped"]


@contextlib.contextmanager
def swapped(*swaps: tuple[torch.nn.Module, str, Any]) -> Iterator[None]:
    """``(parent, name, stand-in)``: ``parent``'s submodule ``name`` is the stand-in within the block and restored
    after it, however it ends (not thread-safe: ComfyUI runs one node at a time)."""
    old = [(p, n, p._modules[n]) for p, n, _ in swaps]
    try:
        for p, n, m in swaps:
            p._modules[n] = m
        yield
    finally:
        for p, n, m in old:
            p._modules[n] = m
