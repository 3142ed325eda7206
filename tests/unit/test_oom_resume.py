"""The shared out-of-memory resume driver (``memory/oom.py``)."""

from __future__ import annotations

import gc
import weakref

import pytest
from vramfit.memory.oom import OomEvent, OomResume


class FakeOOM(RuntimeError):
    pass


class Interrupted(Exception):
    pass


class Blob:
    """Stands in for a tensor held by the failed attempt's frame."""


def test_resumes_until_done_and_reports_each_event():
    driver = OomResume((FakeOOM,), on_oom=lambda: log.append("on_oom"))
    log: list[object] = []
    todo = [FakeOOM("one"), FakeOOM("two"), None]

    def attempt() -> str:
        err = todo.pop(0)
        if err is not None:
            raise err
        return "done"

    assert driver.run(attempt, recover=log.append) == "done"
    assert log == ["on_oom", OomEvent("FakeOOM", "one", 1), "on_oom", OomEvent("FakeOOM", "two", 2)]
    assert driver.retries == 2


def test_failed_frames_are_released_before_on_oom_and_recover():
    """ComfyUI's pattern: leave the ``except`` block first, so the failed attempt's locals are freed."""
    refs: list[weakref.ref] = []
    alive: list[bool] = []
    first = [True]

    def attempt() -> None:
        blob = Blob()
        refs.append(weakref.ref(blob))
        if first[0]:
            first[0] = False
            raise FakeOOM

    def check(*_) -> None:
        gc.disable()  # only reference counting may free it: no cycle collection to hide a leak
        try:
            alive.append(refs[0]() is not None)
        finally:
            gc.enable()

    OomResume((FakeOOM,), on_oom=check).run(attempt, recover=check)
    assert alive == [False, False]


def test_unrecoverable_and_foreign_exceptions_propagate():
    driver = OomResume((FakeOOM,))
    with pytest.raises(FakeOOM):
        driver.run(lambda: (_ for _ in ()).throw(FakeOOM("x")), can_recover=lambda e: False)
    with pytest.raises(KeyError):
        driver.run(lambda: {}["missing"])
    assert driver.retries == 0


def test_max_retries_bounds_recoveries_over_the_driver_lifetime():
    driver = OomResume((FakeOOM,), max_retries=2)
    calls: list[int] = []

    def attempt() -> None:
        calls.append(1)
        raise FakeOOM

    with pytest.raises(FakeOOM):
        driver.run(attempt)
    assert len(calls) == 3 and driver.retries == 2
    with pytest.raises(FakeOOM):  # a later run() of the same driver has no retries left
        driver.run(attempt)
    assert len(calls) == 4


def test_stop_is_never_an_oom_even_when_every_exception_is_one():
    stops = [False, False, True]
    recovered: list[OomEvent] = []

    def should_stop() -> None:
        if stops.pop(0):
            raise Interrupted

    driver = OomResume((Exception,), should_stop=should_stop)

    def attempt() -> None:
        driver.check_stop()
        raise FakeOOM  # a real OOM after a passing stop check is recovered

    with pytest.raises(Interrupted):
        driver.run(attempt, recover=recovered.append)
    assert [e.type_name for e in recovered] == ["FakeOOM", "FakeOOM"]


def test_nested_drivers_pass_a_stop_through_every_level():
    """An executor's driver given the outer driver's ``check_stop`` as its ``should_stop``."""

    def should_stop() -> None:
        raise Interrupted

    outer = OomResume((Exception,), should_stop=should_stop)
    inner = OomResume((Exception,), should_stop=outer.check_stop)
    recovered: list[OomEvent] = []

    def inner_attempt() -> None:
        inner.check_stop()

    with pytest.raises(Interrupted):
        outer.run(lambda: inner.run(inner_attempt, recover=recovered.append), recover=recovered.append)
    assert recovered == []
