"""Choosing a family's description for a model (the carried-context decoders, the split encoders): the first whose
``reason(model)`` is None, else why none fits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["first_fit"]


def first_fit(descriptions: Sequence[Any], model: Any, what: str) -> tuple[Any | None, str | None]:
    """``(description, None)`` for the first of ``descriptions`` that fits ``model``, else ``(None, why)``: the
    reasons of the descriptions that know its class (a reason starting with ``"not "`` names another family's), or
    that none matches this ``what`` (e.g. ``"carried-context description ... decoder"``)."""
    reasons = []
    for d in descriptions:
        why = d.reason(model)
        if why is None:
            return d, None
        reasons.append(why)
    mine = [why for why in reasons if not why.startswith("not ")]
    names = ", ".join(d.name for d in descriptions)
    return None, "; ".join(mine) or f"no {what} matches ({names})"
