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


def test_a_phase_run_again_adds_to_its_entry_and_says_what_it_is_once_for():
    """The sizing of each candidate plan is one phase (one entry, announced once), done once per image shape."""
    shown: list[str] = []
    first = FirstUse(shown.append, "encode")
    first.run("checking exactness", lambda: None)
    for _ in range(3):
        first.run("sizing the plans of this image shape", lambda: None, "image shape")
    assert [w for w, _ in first.done] == ["checking exactness", "sizing the plans of this image shape"]
    assert shown[1:] == ["first use of this VAE: sizing the plans of this image shape (once per image shape on "
                         "this host)"]
    assert first.describe().endswith("once per VAE structure and per image shape on this host, later encodes skip it")
