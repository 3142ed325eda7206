"""Tiled VAE Encode's planning costs less than the encode (issue 43 item 4), on the random-weight SD KL fixture:

* a sizing run counts each kind of tile once (``size_only``: :mod:`memory.executors.kl_memo`) and sizes the same
  peak, to the byte, as the walk that runs every tile;
* :func:`memory.plan.encode.lower_bound` is at most every plan's sized peak (the encoder's own forward and each
  tile), and a budget below it is refused before anything is sized, the error naming the node, the budget and
  the bound;
* a first encode with empty stores tags its sizing in the report (the ``first use`` row and the verdict line);
  the second one, on the same shape, sizes nothing.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from tests.helpers import sized_needs
from tests.host.test_tiled_encode_exact import _pixels

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("one_thread")]

NODE_ID = "VRAMFit_TiledVAEEncode"
MiB = 2**20
HW = (96, 128)


@pytest.fixture(scope="module")
def mod(comfy):
    return sys.modules[comfy.NODE_CLASS_MAPPINGS[NODE_ID].__module__]


@pytest.fixture(scope="module")
def pack(mod):
    base = mod.__name__.rsplit(".nodes.", 1)[0]
    return lambda name: importlib.import_module(f"{base}.{name}")


def _job(mod, vae):
    with torch.inference_mode():
        return mod._validate(vae, _pixels(1, *HW, seed=3), 0)


def _sized(pack, job, tile, size_only):
    sizing = pack("memory.measure.sizing")
    with torch.inference_mode(), sizing.MetaSizer([job.vae.first_stage_model], job.dtype, job.device) as s:
        x = torch.empty((1, *job.x.shape[1:]), dtype=job.dtype, device=job.device)
        out = job.run_tiles(x, tile, compute_device=job.device, store_device=job.device, out_device=job.device,
                            size_only=size_only)
        del out, x
    return s.peak_bytes


@pytest.mark.parametrize("tile", [16, *(pytest.param(t, marks=pytest.mark.slow) for t in (24, 40))])
def test_a_sizing_run_counts_repeated_tiles_to_the_byte(mod, pack, kl_vae, tile):
    job = _job(mod, kl_vae)
    assert _sized(pack, job, tile, True) == _sized(pack, job, tile, False)


def test_the_lower_bound_is_below_every_sized_plan(mod, pack, kl_vae):
    pe = pack("memory.plan.encode")
    job = _job(mod, kl_vae)
    least, what = pe.lower_bound(job)
    sized = sized_needs(pe, job)
    assert least <= min(sized), (least, sized)
    assert least >= 0.8 * min(sized), (least, sized)  # a bound that refuses what cannot fit, not a token one
    assert "down.0.block.0.conv1" in what


def test_an_impossible_budget_is_refused_before_any_sizing(mod, pack, kl_vae, fresh_stores, monkeypatch):
    pe = pack("memory.plan.encode")
    least = pe.lower_bound(_job(mod, kl_vae))[0]
    budget_mb = int(least / MiB) // 2

    def no_sizing(*a, **k):
        raise AssertionError("sized a plan for a budget below the lower bound")

    monkeypatch.setattr(pe, "MetaSizer", no_sizing)
    with pytest.raises(ValueError) as e, torch.inference_mode():
        mod.encode(kl_vae, _pixels(1, *HW, seed=3), budget_mb=budget_mb)
    text = str(e.value)
    assert "Tiled VAE Encode" in text and f"{budget_mb}.0 MiB" in text, text
    assert f"at least {least / MiB:,.1f} MiB" in text and "before any sizing" in text, text


def test_a_first_encode_tags_its_sizing(mod, pack, kl_vae, fresh_stores):
    pe = pack("memory.plan.encode")
    job = _job(mod, kl_vae)
    least = pe.lower_bound(job)[0]
    untiled = pe._out_bytes(job) + pe.encode_peak(job, None, pe.PeakStore(), pe.attention_bytes(1 << 30))
    budget_mb = int((least + untiled) / 2 / MiB)  # exact tiles: sized on the first call
    pixels = _pixels(1, *HW, seed=3)
    with torch.inference_mode():
        first = mod.encode(kl_vae, pixels, budget_mb=budget_mb)
        warm = mod.encode(kl_vae, pixels, budget_mb=budget_mb)
    assert first.plan.path == "exact", first.report.text()
    rows = dict(first.report.rows)
    assert "sizing the plans of this image shape" in rows["first use"], rows
    assert "per image shape" in rows["first use"] and "first use +" in first.report.summary
    assert "first use" not in dict(warm.report.rows) and "first use" not in warm.report.summary
    assert torch.equal(first.latent, warm.latent)


def test_the_self_check_runs_only_for_a_plan_that_takes_tiles(mod, pack, kl_vae, fresh_stores, monkeypatch):
    """The verify step: the encoder's own forward relies on no walker, so a first encode that fits runs no self-check
    (before: every first encode ran it, 12.8 s of Wan 2.1's 21.7 s first call); exact tiles run only after theirs
    passed, the first plan's and a re-plan's after an out-of-memory error alike."""
    enc = pack("memory.decode.encode")
    real, calls = enc.check_encode, []

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(enc, "check_encode", counted)
    pe = pack("memory.plan.encode")
    job = _job(mod, kl_vae)
    least = pe.lower_bound(job)[0]
    untiled = pe._out_bytes(job) + pe.encode_peak(job, None, pe.PeakStore(), pe.attention_bytes(1 << 30))
    pixels = _pixels(1, *HW, seed=3)
    with torch.inference_mode():
        free = mod.encode(kl_vae, pixels)
    rows = dict(free.report.rows)
    assert free.plan.path == "untiled" and not calls and "check" not in rows, free.report.text()
    with torch.inference_mode():
        tiled = mod.encode(kl_vae, pixels, budget_mb=int((least + untiled) / 2 / MiB))
    assert tiled.plan.path == "exact" and calls == [1], tiled.report.text()
    assert "self-check passed" in dict(tiled.report.rows)["check"]
    assert (free.latent - tiled.latent).abs().max().item() <= 1e-4


def test_a_replan_to_tiles_after_an_oom_checks_them_first(comfy, mod, pack, kl_vae, fresh_stores, monkeypatch):
    """The encoder's own forward runs out of memory; the re-plan takes exact tiles, which run only after their
    self-check (run there, outside the ``except`` block: nothing had checked them)."""
    enc = pack("memory.decode.encode")
    real, order = enc.check_encode, []

    def counted(*a, **k):
        order.append("check")
        return real(*a, **k)

    def hook(kind: str, k: int) -> None:
        order.append(kind)
        if kind == "pass" and k == 0 and order.count("pass") == 1:
            raise torch.OutOfMemoryError("injected in the encoder's own forward")

    monkeypatch.setattr(enc, "check_encode", counted)
    monkeypatch.setattr(mod, "_FAULT_HOOK", hook)
    with torch.inference_mode():
        r = mod.encode(kl_vae, _pixels(1, *HW, seed=3))
        (ref,) = comfy.VAEEncode().encode(kl_vae, _pixels(1, *HW, seed=3))
    assert r.plan.path == "exact" and len(r.oom_events) == 1, r.report.text()
    assert order[:2] == ["pass", "check"] and order[2] == "tile", order[:4]
    assert "self-check passed" in dict(r.report.rows)["check"]
    assert (r.latent - ref["samples"]).abs().max().item() <= 1e-4


def test_the_encode_check_keeps_its_store_key(mod, pack, kl_vae):
    """The encode self-check's key, built by ``self_check.check_key``, is byte-identical to the one earlier versions
    wrote (a stored verdict is found again): captured where it reaches the store."""
    enc, sc = pack("memory.decode.encode"), pack("memory.decode.self_check")
    job = _job(mod, kl_vae)

    class Found(Exception):
        pass

    def capture(key, *a, **k):
        raise Found(key)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(enc, "checked", capture)
        with pytest.raises(Found) as e:
            enc.check_encode(job, sc.memory_store())
    cls = type(job.vae.first_stage_model)
    assert str(e.value) == (f"kl-exact-encode/{cls.__module__}.{cls.__qualname__}/{job.fingerprint}/exact-"
                            f"{job.executor_version}/{str(job.dtype).removeprefix('torch.')}/{job.device.type}")
