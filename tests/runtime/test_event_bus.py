"""The event bus: gap-free envelopes on the run's clock, synchronous subscribers, and buffered sinks that
batch by count and by time and never stop the publisher, however slow or broken they are."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from app.core.events import BatchRequested, Envelope, GroupAdmitted, Ledger
from app.runtime.events import BEHIND_BATCHES, EventBus


class RecordingSink:
    def __init__(self) -> None:
        self.batches: list[list[Envelope]] = []
        self.got = threading.Event()

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.batches.append(list(envelopes))
        self.got.set()


class BlockedSink:
    """Blocks in write_batch until released: a database that hangs."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.written = 0
        self.inside = 0  # envelopes in the write_batch call that hangs

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.inside = len(envelopes)
        self.entered.set()
        self.release.wait(10)
        self.written += len(envelopes)


class BrokenSink:
    def __init__(self, fail_first: int) -> None:
        self.fail_first = fail_first
        self.calls = 0
        self.written = 0

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("database went away")
        self.written += len(envelopes)


def make_bus(**overrides: object) -> EventBus:
    clock = iter(float(t) for t in range(1_000_000))
    return EventBus(str(overrides.get("run_id", "run-1")), clock=lambda: next(clock))


def test_envelopes_are_numbered_without_gaps_and_timed_by_the_clock() -> None:
    bus = make_bus()
    seen: list[Envelope] = []
    ledger = Ledger()
    bus.subscribe(seen.append)
    bus.subscribe(ledger.on_envelope)
    for gid in range(5):
        bus.publish(GroupAdmitted(gid, gid, 2))
    assert [(e.run_id, e.seq, e.t) for e in seen] == [("run-1", n, float(n)) for n in range(5)]
    assert bus.published == 5
    assert ledger.gaps == 0
    assert ledger.open_groups == {0, 1, 2, 3, 4}


def test_a_sink_gets_batches_by_count_in_order() -> None:
    bus = make_bus()
    sink = RecordingSink()
    bus.add_sink(sink, batch_size=10, flush_interval_s=30.0)
    for n in range(25):
        bus.publish(BatchRequested(n))
    stats = bus.close()
    seqs = [e.seq for batch in sink.batches for e in batch]
    assert seqs == list(range(25))
    assert len(sink.batches) < 25  # in batches: the count, not the 30 s interval, flushed them
    assert stats["RecordingSink"]["written"] == 25
    assert stats["RecordingSink"]["dropped"] == stats["RecordingSink"]["failed"] == 0


def test_a_sink_that_fell_behind_catches_up_in_larger_batches_in_order() -> None:
    # A SQL sink's cost per event falls with the batch: one far behind writes up to BEHIND_BATCHES
    # batch sizes at once (at 500 a busy run's sink fell further behind; SQLite's cost per event is
    # 1.4x at 500 what it is at 5,000).
    bus = make_bus()
    sink = RecordingSink()
    gate = threading.Event()
    write = sink.write_batch

    def slow_first(envelopes: Sequence[Envelope]) -> None:
        gate.wait(10)
        write(envelopes)

    sink.write_batch = slow_first  # type: ignore[method-assign]
    bus.add_sink(sink, batch_size=10, flush_interval_s=30.0)
    for n in range(500):
        bus.publish(BatchRequested(n))
    gate.set()
    bus.close()
    sizes = [len(batch) for batch in sink.batches]
    assert [e.seq for batch in sink.batches for e in batch] == list(range(500))
    assert max(sizes) == 10 * BEHIND_BATCHES  # behind: as large as allowed, and no larger


def test_a_sink_gets_a_partial_batch_after_the_flush_interval() -> None:
    bus = make_bus()
    sink = RecordingSink()
    bus.add_sink(sink, batch_size=1000, flush_interval_s=0.05)
    for n in range(3):
        bus.publish(BatchRequested(n))
    assert sink.got.wait(5.0)  # time, not count, flushed it
    assert [e.seq for e in sink.batches[0]] == [0, 1, 2]
    bus.close()


def test_a_hung_sink_never_blocks_the_publisher_and_what_it_missed_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bus = make_bus()
    sink = BlockedSink()
    bus.add_sink(sink, batch_size=2, flush_interval_s=0.01, capacity=4)
    bus.publish(BatchRequested(0))
    assert sink.entered.wait(5.0)  # the worker is now stuck inside write_batch
    started = time.monotonic()
    for n in range(1, 101):
        bus.publish(BatchRequested(n))
    publish_s = time.monotonic() - started
    stats = bus.stats()["BlockedSink"]
    assert stats["dropped"] == 100 - 4  # the buffer holds 4; the rest are counted, not queued
    # and said: at the first drop, then at each power of two, so a flood of drops is a few lines
    warned = [r.getMessage() for r in caplog.records if "dropped so far" in r.getMessage()]
    assert [int(m.split(": ")[1].split()[0]) for m in warned] == [1, 2, 4, 8, 16, 32, 64]
    assert all(m.startswith("event sink BlockedSink is full (4 buffered)") for m in warned)
    sink.release.set()
    final = bus.close()["BlockedSink"]
    assert final["written"] + final["dropped"] + final["failed"] + final["unflushed"] == 101
    assert final["written"] == sink.written == 5
    print(f"100 publishes past a hung sink took {publish_s * 1e3:.2f} ms")


def test_a_failing_sink_is_counted_and_the_next_batches_still_go_through() -> None:
    bus = make_bus()
    sink = BrokenSink(fail_first=1)
    bus.add_sink(sink, name="store", batch_size=5, flush_interval_s=0.01)
    for n in range(5):
        bus.publish(BatchRequested(n))
    deadline = time.monotonic() + 5.0
    while bus.stats()["store"]["errors"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    for n in range(5, 12):
        bus.publish(BatchRequested(n))
    stats = bus.close()["store"]
    assert stats["errors"] == 1
    assert stats["failed"] == 5
    assert stats["written"] == sink.written == 7
    assert stats["last_error"] == "ConnectionError: database went away"


def test_a_sink_stuck_at_close_leaves_its_backlog_counted_as_unflushed() -> None:
    bus = make_bus()
    sink = BlockedSink()
    bus.add_sink(sink, batch_size=1, flush_interval_s=0.01, capacity=100)
    for n in range(10):
        bus.publish(BatchRequested(n))
    assert sink.entered.wait(5.0)
    stats = bus.close(timeout_s=0.05)["BlockedSink"]
    # what is inside the hung write_batch (one, or all ten when they were buffered by the time the
    # worker took them) is the sink's; the rest was never handed over
    assert stats["unflushed"] == 10 - sink.inside
    sink.release.set()


def test_a_subscriber_error_is_a_bug_and_propagates() -> None:
    bus = make_bus()

    def broken(env: Envelope) -> None:
        raise ValueError("accounting bug")

    bus.subscribe(broken)
    with pytest.raises(ValueError, match="accounting bug"):
        bus.publish(BatchRequested(0))


@pytest.mark.parametrize(
    ("batch_size", "flush_interval_s", "capacity"),
    [(0, 1.0, 10), (5, 1.0, 4), (5, 0.0, 10), (5, float("nan"), 10)],
)
def test_bad_sink_settings_are_refused(batch_size: int, flush_interval_s: float, capacity: int) -> None:
    bus = make_bus()
    with pytest.raises(ValueError, match="batch_size"):
        bus.add_sink(
            RecordingSink(), batch_size=batch_size, flush_interval_s=flush_interval_s, capacity=capacity
        )


def test_two_sinks_need_two_names() -> None:
    bus = make_bus()
    bus.add_sink(RecordingSink(), name="sse")
    with pytest.raises(ValueError, match="already attached"):
        bus.add_sink(RecordingSink(), name="sse")
    bus.close()


def test_an_observer_error_is_counted_logged_once_and_the_others_still_get_the_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An observer only watches the run (the dashboard's view): its bug must not reach the publisher."""
    bus = make_bus()
    after: list[int] = []

    def broken(env: Envelope) -> None:
        raise KeyError("view bug")

    bus.observe(broken, "live view", {GroupAdmitted: broken, BatchRequested: None})
    bus.subscribe(lambda env: after.append(env.seq))
    with caplog.at_level("ERROR", logger="app.runtime.events"):
        for _ in range(3):
            bus.publish(GroupAdmitted(0, 0, 2))
        bus.publish(BatchRequested(0))  # the observer takes none of these
    assert after == [0, 1, 2, 3]
    assert bus.observer_errors == {"live view": 3}
    failures = [r for r in caplog.records if "event observer live view failed" in r.getMessage()]
    assert len(failures) == 1
    assert failures[0].exc_info is not None
