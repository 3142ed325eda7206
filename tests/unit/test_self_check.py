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
    # a real mismatch is stored, for these weights: it will not pass next time either
    assert store.get("k#") == v.to_dict() and store.verdict("k", "") == v and store.get("k") is None
    assert store.verdict("k", "").cached and "VRAMFIT_RECHECK=1" in store.verdict("k", "").describe()


def test_shape_mismatch_fails_and_a_non_finite_output_is_no_verdict():
    x = torch.zeros(2, 3)
    v = sc.verify("s", sc.CheckStore(), lambda: x, [("short", lambda: x[:1])], torch.float32)
    assert not v.ok and v.conclusive and math.isinf(v.max_diff) and "shape" in v.detail
    store = sc.CheckStore()
    v = sc.verify("n", store, lambda: x, [("nan", lambda: x * float("nan"))], torch.float32)
    assert v.state == "inconclusive" and "non-finite" in v.detail and len(store) == 0


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


def test_an_encodes_fingerprint_follows_a_patched_encode():
    """An instance-level ``encode`` (a pack patching the VAE) changes an encode's fingerprint, not a decode's."""

    class Vae(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)

        def encode(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    a, b = Vae(), Vae()
    b.encode = lambda x: a.conv(x) * 2
    assert sc.code_fingerprint(a) == sc.code_fingerprint(b)
    assert sc.code_fingerprint(a, sc.ENCODE_METHODS) != sc.code_fingerprint(b, sc.ENCODE_METHODS)


def test_a_non_finite_reference_is_inconclusive_and_never_cached():
    """The host's own decode is non-finite (broken or overflowing weights): no verdict, checked again."""
    store = sc.CheckStore()
    x = torch.zeros(3)
    run, run_calls = _calls([x, x])
    v = sc.verify("k", store, lambda: x / 0 * 0, [("tiles", run)], torch.float32, weights="w1")
    assert not v.ok and not v.conclusive and v.state == "inconclusive" and run_calls == []
    text = v.describe()
    assert "could not conclude" in text and "unverified" in text and "non-finite" in text
    assert len(store) == 0 and store.verdict("k", "w1") is None
    # the next decode checks again, and a good file of the same structure passes
    v = sc.verify("k", store, lambda: x, [("tiles", run)], torch.float32, weights="w2")
    assert v.ok and run_calls == [1] and store.verdict("k", "w1") == v


def test_a_check_out_of_memory_is_inconclusive_and_never_cached():
    store = sc.CheckStore()

    def oom() -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    v = sc.verify("k", store, lambda: torch.zeros(2), [("tiles", oom)], torch.float32)
    assert v.state == "inconclusive" and "out of memory" in v.describe() and len(store) == 0


def test_one_file_failure_does_not_condemn_other_files_of_the_structure():
    store = sc.CheckStore()
    x = torch.zeros(4)
    bad = sc.verify("k", store, lambda: x, [("tiles", lambda: x + 0.5)], torch.float32, weights="fileA")
    assert bad.state == "failed" and store.verdict("k", "fileA") == bad
    assert store.verdict("k", "fileB") is None  # file B is not judged by file A's failure: it checks itself
    good = sc.verify("k", store, lambda: x, [("tiles", lambda: x)], torch.float32, weights="fileB")
    assert good.ok and store.verdict("k", "fileC") == good  # a pass holds for the structure
    assert store.verdict("k", "fileA") == bad  # file A keeps its own failure


def test_recheck_runs_a_stored_verdict_again_once_and_a_pass_replaces_the_failure(tmp_path):
    path = tmp_path / "checks.json"
    x = torch.zeros(4)
    sc.verify("k", sc.CheckStore(path), lambda: x, [("tiles", lambda: x + 0.5)], torch.float32, weights="A")
    store = sc.CheckStore(path)  # the next ComfyUI session, started with VRAMFIT_RECHECK=1
    store.recheck = True
    run, run_calls = _calls([x, x])
    v = sc.verify("k", store, lambda: x, [("tiles", run)], torch.float32, weights="A")
    assert v.ok and not v.cached and run_calls == [1]
    again = sc.verify("k", store, lambda: x, [("tiles", run)], torch.float32, weights="A")
    assert again.ok and again.cached and run_calls == [1]  # once per process
    assert sc.CheckStore(path).verdict("k", "A").ok  # the failure is gone from the file


def test_a_failure_stored_per_structure_by_an_older_version_is_not_a_verdict():
    store = sc.CheckStore()
    store.put("k", sc.Verdict(False, math.inf, 1e-4, "tiles", 1.0, "non-finite values").to_dict())
    assert store.verdict("k", "any") is None


def test_weights_digest_follows_weights_not_code():
    a = torch.nn.Conv2d(2, 3, 3)
    b = torch.nn.Conv2d(2, 3, 3)
    assert sc.weights_digest(a) != sc.weights_digest(b)
    with torch.no_grad():
        b.weight.copy_(a.weight)
        b.bias.copy_(a.bias)
    assert sc.weights_digest(a) == sc.weights_digest(b)
    assert sc.weights_digest(torch.nn.Conv2d(2, 3, 3, device="meta")) == ""
