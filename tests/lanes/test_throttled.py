"""`Throttled`: one read serves every caller within its period, and a caller that comes while the very
first read is under way gets that read's answer, not "nothing read yet" (which `/healthz` took for "no
worker" and answered 503 at start-up)."""

from __future__ import annotations

import threading

import pytest

from app.lanes.lost_ops import Throttled


def test_a_caller_during_the_first_read_gets_its_answer() -> None:
    started, release = threading.Event(), threading.Event()
    reads = []

    def read() -> dict[str, int]:
        reads.append(1)
        started.set()
        release.wait(5)
        return {"lane.a.exec": 1}

    throttled = Throttled(read, lambda: 60.0)
    answers: list[object] = []
    first = threading.Thread(target=lambda: answers.append(throttled.latest()))
    first.start()
    assert started.wait(5)
    second = threading.Thread(target=lambda: answers.append(throttled.latest()))
    second.start()
    second.join(0.2)
    assert second.is_alive(), "the second caller answered before the first read ended"
    release.set()
    first.join(5)
    second.join(5)
    assert answers == [{"lane.a.exec": 1}, {"lane.a.exec": 1}]
    assert len(reads) == 1


def test_a_first_read_that_fails_does_not_leave_callers_waiting() -> None:
    def read() -> None:
        raise ConnectionError("broker gone")

    throttled: Throttled[int] = Throttled(read, lambda: 60.0)
    with pytest.raises(ConnectionError):
        throttled.latest()
    assert throttled.latest() is None  # within the period: the value before (none), at once


def test_a_new_read_after_the_period() -> None:
    values = iter([1, 2])
    throttled = Throttled(lambda: next(values), lambda: 0.0)
    assert throttled.latest() == 1
    assert throttled.latest() == 2
