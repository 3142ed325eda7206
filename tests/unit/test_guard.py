"""``memory/decode/guard.py`` without ComfyUI: the host's result when the pack's own path fails, what passes through,
the stage named, ``VRAMFIT_STRICT``."""

from __future__ import annotations

import types

import pytest
import torch
from vramfit.memory.decode.env import DecodeEnv
from vramfit.memory.decode.floor import HostOomError
from vramfit.memory.decode.guard import STAGES, HostResult, NotDescribed, never_worse
from vramfit.memory.plan.grid import ImpossibleBudgetError

VAE = types.SimpleNamespace(device="cpu")


@pytest.fixture(autouse=True)
def not_strict(monkeypatch):
    monkeypatch.setenv("VRAMFIT_STRICT", "0")


def _host() -> torch.Tensor:
    return torch.full((1, 4, 4, 3), 0.5)


def _failing_at(stage: str, exc: BaseException):
    env = DecodeEnv()

    def own():
        for s in STAGES:
            env.at(s)
            if s == stage:
                raise exc
        return "own"

    return env, own


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_failure_at_any_stage_gives_the_hosts_result_naming_the_stage(stage):
    env, own = _failing_at(stage, KeyError("boom"))
    r = never_worse("Tiled VAE Decode", env, own, _host, vae=VAE)
    assert isinstance(r, HostResult) and torch.equal(r.images, _host())
    assert r.report.summary.startswith("host decode: the pack's own path failed: KeyError: 'boom'")
    assert f"failed in its {STAGES[stage]}" in dict(r.report.rows)["path"]
    assert "test_guard.py" in dict(r.report.rows)["failed at"] or "memory/decode" in dict(r.report.rows)["failed at"]


def test_own_result_when_nothing_fails():
    env, own = _failing_at("none", RuntimeError())
    assert never_worse("n", env, own, _host, vae=VAE) == "own"


@pytest.mark.parametrize("exc", [ImpossibleBudgetError("too small", budget=1, minimum=2), HostOomError("out of memory"),
                                 ValueError("bad input")])
def test_what_passes_through(exc):
    env, own = _failing_at("plan", exc)
    with pytest.raises(type(exc)):
        never_worse("n", env, own, _host, vae=VAE, passthrough=(ValueError,))


def test_strict_raises(monkeypatch):
    monkeypatch.setenv("VRAMFIT_STRICT", "1")
    env, own = _failing_at("run", RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        never_worse("n", env, own, _host, vae=VAE)


def test_not_described_is_said_and_not_a_failure():
    env, own = _failing_at("identify", NotDescribed("a VAE of latent_dim 1"))
    r = never_worse("Tiled VAE Encode", env, own, _host, vae=VAE, work="encode")
    assert r.report.summary.startswith("host encode: not described: a VAE of latent_dim 1")
    assert "failed at" not in dict(r.report.rows)


def test_a_failing_host_raises_the_hosts_error():
    env, own = _failing_at("plan", RuntimeError("pack"))

    def host():
        raise TypeError("the host's own error")

    with pytest.raises(TypeError, match="the host's own error"):
        never_worse("n", env, own, host, vae=VAE)


def test_the_stage_hook_sees_every_stage():
    seen = []
    env = DecodeEnv(stage_hook=seen.append)
    for s in STAGES:
        env.at(s)
    assert seen == list(STAGES) and env.stage == "report"
