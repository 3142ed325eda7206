"""Live-tensor counting and view detection on inference tensors (issue 22, item 6).

ComfyUI runs every node under ``torch.inference_mode``: tensors made there are inference tensors, with no
version counter and no view metadata (``_base`` is None on their views). The dispatch tracker identifies
storages by their Python object, which is the same for them; ``views_more`` (how the Wan executor and its
cache-protocol probe tell a view of a larger activation) reads the storage, not ``_base``.
"""

from __future__ import annotations

import pytest
import torch
from vramfit.memory.measure.tracker import PeakTracker
from vramfit.memory.vae.wan_layout import views_more


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_known_allocations_counted_alike_in_both_modes(mode) -> None:
    with mode(), PeakTracker("cpu") as t:
        a = torch.empty(1000)  # 4000 B
        v = a[10:]  # view: same storage
        a.add_(1)  # in place: same storage
        assert t.current_bytes == 4000
        c = a * 2  # 4000 B
        assert t.current_bytes == 8000
        del a  # the view keeps the storage alive
        assert t.current_bytes == 8000
        del v
        assert t.current_bytes == 4000
        d = c.clone()  # 4000 B
        del c, d
        assert t.current_bytes == 0
    assert (t.peak_bytes, t.end_bytes, t.allocations) == (8000, 0, 3)


def test_views_of_inference_tensors_are_told_by_their_storage() -> None:
    with torch.inference_mode():
        x = torch.zeros(1, 4, 3, 2, 2)
        last = x[:, :, -2:]
        assert last.is_inference() and last._base is None  # what the probe read before the fix
        assert views_more(last) and not views_more(x) and not views_more(last.clone())
    y = torch.zeros(1, 4, 3, 2, 2)
    assert views_more(y[:, :, -2:]) and y[:, :, -2:]._base is not None
