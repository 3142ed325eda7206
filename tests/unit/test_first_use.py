"""``memory/decode/first_use.py``: once-per-VAE phases are shown while they run, timed, and described."""

from __future__ import annotations

import pytest
from vramfit.memory.decode.first_use import FirstUse, first_use_tag


def test_phases_are_shown_timed_and_described():
    shown: list[str] = []
    first = FirstUse(shown.append)
    assert first.describe() == "" and first.seconds == 0
    assert first.run("checking exactness", lambda: 42) == 42
    with pytest.raises(RuntimeError):
        first.run("calibrating", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert [w for w, _ in first.done] == ["checking exactness", "calibrating"]  # a failed phase is timed too
    assert shown == ["first use of this VAE: checking exactness (once per VAE structure on this host)",
                     "first use of this VAE: calibrating (once per VAE structure on this host)"]
    text = first.describe()
    assert "checking exactness" in text and "calibrating" in text and "later decodes skip it" in text


def test_without_a_display_it_still_times():
    first = FirstUse()
    first.run("x", lambda: None)
    assert len(first.done) == 1


def test_the_verdict_tag_appears_only_after_first_use_work():
    first = FirstUse()
    assert first_use_tag(first) == "" and first_use_tag(None) == ""
    first.run("checking", lambda: None)
    assert first_use_tag(first).startswith("first use +")
