from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vramfit.memory.report import Report, fmt_bytes, fmt_seconds


def test_text_layout_and_roundtrip():
    r = Report("Tiled VAE Decode", "cuda:0").add("budget", "6.61 GiB").add("plan", "2x3 tiles\nexact")
    text = r.text()
    assert text.splitlines()[0] == "VRAM Fit | Tiled VAE Decode | cuda:0"
    assert "  budget : 6.61 GiB" in text
    assert "  plan   : 2x3 tiles" in text
    back = Report.parse(text)
    assert back.rows == r.rows and back.node == r.node and back.device == r.device
    assert Report.from_dict(r.to_dict()).rows == r.rows


def test_parse_rejects_foreign_text():
    with pytest.raises(ValueError):
        Report.parse("hello")


@given(st.lists(st.tuples(st.from_regex(r"[a-z][a-z ]{0,10}[a-z]", fullmatch=True),
                          st.from_regex(r"[A-Za-z0-9.%]{1,20}", fullmatch=True)), max_size=6))
def test_roundtrip_property(rows):
    r = Report("VRAM Monitor", "cpu").extend(rows)
    assert Report.parse(r.text()).rows == r.rows


def test_formatters():
    assert fmt_bytes(None) == "-"
    assert fmt_bytes(512) == "512 B"
    assert fmt_bytes(3 * 1024**2) == "3.0 MiB"
    assert fmt_bytes(-5 * 1024**3) == "-5.00 GiB"
    assert fmt_seconds(0.25) == "250 ms" and fmt_seconds(12.345) == "12.35 s"
