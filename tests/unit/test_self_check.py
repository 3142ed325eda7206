"""The self-check mechanism (``memory/decode/self_check.py``) without ComfyUI: verdicts, tolerance, storage, and the
code fingerprint that keys them. Host tests with real decoders: ``tests/host/test_decoder_self_check.py``."""

from __future__ import annotations

import math

import pytest
import torch
from vramfit.memory.decode import self_check as sc


def _calls(values: list[torch.Tensor]):
    """A run returning ``values`` in turn, counting its calls."""
    seen: list[int] = []

    def run() -> torch.Tensor:
        seen.append(1)
        return values[len(seen) - 1]

    return run, seen


def test_tolerance_is_float_noise_of_the_dtype():
    assert sc.tolerance(torch.float32) == sc.tolerance(torch.float64) == 1e-4
    assert sc.tolerance(torch.float16) == pytest.approx(8 * 2**-10)
    assert sc.tolerance(torch.bfloat16) == pytest.approx(8 * 2**-7)


def test_a_match_passes_and_is_stored_then_reused_without_running():
    x = torch.linspace(-1, 1, 50)
    store = sc.CheckStore()
    ref, ref_calls = _calls([x])
    run, run_calls = _calls([x + 3e-6])
    v = sc.verify("k", store, ref, [("config a", run)], torch.float32)
    assert v.ok and v.max_diff == pytest.approx(3e-6, rel=0.01) and v.worst == "config a"
    assert "passed" in v.describe() and ref_calls == run_calls == [1]
    # cached: nothing runs again, even with runs that would fail
    again = sc.verify("k", store, lambda: 1 / 0, [("b", lambda: 1 / 0)], torch.float32)
    assert again == v


def test_a_difference_beyond_noise_fails_and_names_the_worst_config():
    x = torch.zeros(4, 4)
    store = sc.CheckStore()
    bad = x.clone()
    bad[1, 2] = 0.25
    v = sc.verify("k", store, lambda: x, [("fine", lambda: x), ("bad one", lambda: bad)], torch.float32)
    assert not v.ok and v.worst == "bad one" and v.max_diff == pytest.approx(0.25)
    text = v.describe()
    assert "FAILED" in text and "bad one" in text and "max abs diff 0.25" in text
    assert store.get("k") == v.to_dict()  # a real mismatch is stored: it will not pass next time either


def test_shape_mismatch_and_nan_fail():
    x = torch.zeros(2, 3)
    v = sc.verify("s", sc.CheckStore(), lambda: x, [("short", lambda: x[:1])], torch.float32)
    assert not v.ok and math.isinf(v.max_diff) and "shape" in v.detail
    v = sc.verify("n", sc.CheckStore(), lambda: x, [("nan", lambda: x * float("nan"))], torch.float32)
    assert not v.ok and "non-finite" in v.detail


def test_a_run_that_raises_fails_unstored():
    store = sc.CheckStore()

    def boom() -> torch.Tensor:
        raise RuntimeError("no such layer")

    v = sc.verify("r", store, lambda: torch.zeros(1), [("walker", boom)], torch.float32)
    assert not v.ok and v.worst == "walker" and "RuntimeError: no such layer" in v.describe()
    assert store.get("r") is None  # may be transient: checked again next time


def test_verdicts_persist_in_the_file(tmp_path):
    path = tmp_path / "vramfit" / "checks.json"
    x = torch.ones(3)
    v = sc.verify("p", sc.CheckStore(path), lambda: x, [("a", lambda: x)], torch.float32)
    assert path.is_file()
    assert sc.Verdict.from_dict(sc.CheckStore(path).get("p")) == v
    assert sc.store_at(path) is sc.store_at(path) and sc.store_at(None) is sc.memory_store()
    path.write_text("{not json")
    assert len(sc.CheckStore(path)) == 0  # an unreadable file is ignored


def test_code_fingerprint_follows_code_not_weights():
    def net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.SiLU())

    a, b = net(), net()
    assert sc.code_fingerprint(a) == sc.code_fingerprint(b)  # other weights, same code
    orig = b[1].forward
    b[1].forward = lambda x: orig(x) * 2  # an instance-level patch of one layer
    assert sc.code_fingerprint(a) != sc.code_fingerprint(b)

    class Other(torch.nn.SiLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    c = net()
    c[1] = Other()
    assert sc.code_fingerprint(c) not in (sc.code_fingerprint(a), sc.code_fingerprint(b))
    d = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.SiLU())
    assert sc.code_fingerprint(d) != sc.code_fingerprint(a)  # structure
