"""A sink's spill: once its buffer is full, envelopes go to an append-only file on local disk and come
back to the sink in order; a sink that fails on a batch for a passing reason gets it again. Nothing is
dropped while the disk takes the spill, and what the disk refuses is counted."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from kill_at import kill_when

from app.core.events import BatchRequested, Envelope
from app.runtime.events import EventBus
from app.runtime.spill import SpillFile, recover


class GateSink:
    """Blocks in write_batch while its gate is shut (a database held by another writer), fails its
    first `fail_first` calls with a passing error, and records every envelope it was given."""

    def __init__(self, fail_first: int = 0) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_first = fail_first
        self.calls = 0
        self.seqs: list[int] = []

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.entered.set()
        self.calls += 1
        assert self.gate.wait(30)
        if self.calls <= self.fail_first:
            raise ConnectionError("database went away")
        self.seqs.extend(e.seq for e in envelopes)

    def retryable(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)


QUICK_RETRIES = {"retry_first_s": 0.01, "retry_max_s": 0.05}  # a batch refused is tried again soon


def make_bus() -> EventBus:
    clock = iter(float(t) for t in range(10_000_000))
    return EventBus("run-1", clock=lambda: next(clock))


def held_store(
    spill_dir: Path, capacity: int, behind: int, max_bytes: int = 1_000_000
) -> tuple[EventBus, GateSink]:
    """A bus whose store sink (batches of 10, spilling to `spill_dir`) is held until `sink.gate` is set,
    inside its write of the first envelope, with `behind` more published after it."""
    bus = make_bus()
    sink = GateSink()
    sink.gate.clear()
    spill = SpillFile(spill_dir, max_bytes=max_bytes)
    bus.add_sink(sink, name="store", batch_size=10, flush_interval_s=0.01, capacity=capacity, spill=spill,
                 **QUICK_RETRIES)  # fmt: skip
    bus.publish(BatchRequested(0))
    assert sink.entered.wait(5)
    publish(bus, behind)
    return bus, sink


def publish(bus: EventBus, n: int) -> None:
    for i in range(n):
        bus.publish(BatchRequested(i))


def test_a_full_buffer_spills_to_disk_and_the_sink_gets_every_envelope_once_in_order(tmp_path: Path) -> None:
    bus = make_bus()
    sink = GateSink()
    sink.gate.clear()
    spill = SpillFile(tmp_path / "spill", max_bytes=10_000_000)
    bus.add_sink(sink, name="store", batch_size=50, flush_interval_s=0.01, capacity=200, spill=spill)
    bus.publish(BatchRequested(0))
    assert sink.entered.wait(5)  # the worker is now held inside write_batch
    publish(bus, 9_999)
    held = bus.stats()["store"]
    assert held["dropped"] == 0
    assert held["spilled"] == 10_000 - 1 - 200  # all but the batch being written and the buffer
    assert bus.backlog() == 9_999
    assert 0 < held["spill_bytes"] <= 10_000_000
    # A process killed now would leave every envelope not yet written on disk: the spill, and a copy
    # of the buffer and of the batch being written (made on a thread of its own)
    deadline = time.monotonic() + 10
    while len(recover(tmp_path / "spill").envelopes) < 10_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.seq for e in recover(tmp_path / "spill").envelopes] == list(range(10_000))
    sink.gate.set()
    stats = bus.close(timeout_s=30)["store"]
    assert sink.seqs == list(range(10_000))  # each once, in publication order
    assert (stats["written"], stats["dropped"], stats["failed"], stats["unflushed"]) == (10_000, 0, 0, 0)
    assert stats["recovered"] == 10_000 - 1 - 200
    assert stats["max_spill_bytes"] >= held["spill_bytes"]
    assert stats["spill_bytes"] == 0
    assert not (tmp_path / "spill").exists()  # drained: removed


def test_new_envelopes_go_to_memory_again_once_the_spill_is_drained(tmp_path: Path) -> None:
    bus, sink = held_store(tmp_path / "spill", capacity=20, behind=99)
    sink.gate.set()
    deadline = time.monotonic() + 10
    while bus.backlog() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bus.backlog() == 0
    spilled = bus.stats()["store"]["spilled"]
    publish(bus, 10)  # the buffer has room: not spilled
    stats = bus.close(timeout_s=10)["store"]
    assert stats["spilled"] == spilled
    assert sink.seqs == list(range(110))


def test_a_batch_the_sink_failed_on_for_a_passing_reason_is_written_later_in_order(tmp_path: Path) -> None:
    # Before: the batch was counted failed and lost, and the next batch written after the hole.
    bus = make_bus()
    sink = GateSink(fail_first=3)
    bus.add_sink(sink, name="store", batch_size=5, flush_interval_s=0.01, capacity=10,
                 spill=SpillFile(tmp_path / "spill", max_bytes=1_000_000), **QUICK_RETRIES)  # fmt: skip
    publish(bus, 5)
    deadline = time.monotonic() + 5
    while bus.stats()["store"]["errors"] == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    publish(bus, 95)  # more than the buffer holds: the failed batch's retries wait, the rest spills
    stats = bus.close(timeout_s=10)["store"]
    assert sink.seqs == list(range(100))
    assert (stats["errors"], stats["failed"], stats["dropped"], stats["written"]) == (3, 0, 0, 100)
    assert stats["last_error"] == "ConnectionError: database went away"


def test_a_failing_sink_that_says_nothing_of_its_errors_still_loses_the_batch_counted() -> None:
    class Broken:
        calls = 0

        def write_batch(self, envelopes: Sequence[Envelope]) -> None:
            self.calls += 1
            if self.calls == 1:
                raise ValueError("a bug")

    bus = make_bus()
    bus.add_sink(Broken(), name="metrics", batch_size=5, flush_interval_s=0.01)
    publish(bus, 5)
    stats = bus.close(timeout_s=10)["metrics"]
    assert (stats["errors"], stats["failed"]) == (1, 5)


def test_a_full_spill_drops_what_it_cannot_take_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bus, sink = held_store(tmp_path / "spill", capacity=20, behind=999, max_bytes=5_000)
    held = bus.stats()["store"]
    assert held["dropped"] > 0
    assert held["max_spill_bytes"] <= 5_000
    assert "spill: SpillFullError" in held["last_error"]
    assert any("spilling to" in r.getMessage() for r in caplog.records)
    assert any("dropped so far" in r.getMessage() and "5,000" in r.getMessage() for r in caplog.records)
    sink.gate.set()
    stats = bus.close(timeout_s=10)["store"]
    assert stats["written"] + stats["dropped"] == 1_000
    assert sink.seqs == sorted(set(sink.seqs))  # in order, none twice


def test_an_unwritable_spill_drops_counted_and_the_run_goes_on(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    bus, sink = held_store(tmp_path / "a-file" / "spill", capacity=20, behind=99)
    held = bus.stats()["store"]
    assert held["dropped"] == 100 - 1 - 20  # the batch being written and the buffer's 20 stay
    assert held["spilled"] == 0
    sink.gate.set()
    stats = bus.close(timeout_s=10)["store"]
    assert stats["written"] == 21


def test_a_sink_stuck_at_close_leaves_its_envelopes_on_disk_for_the_next_start(tmp_path: Path) -> None:
    bus, sink = held_store(tmp_path / "spill", capacity=50, behind=29)  # in memory only: the buffer holds 50
    stats = bus.close(timeout_s=0.1)["store"]
    assert stats["unflushed"] == 0
    assert stats["kept_on_disk"] == 30  # the batch being written (seq 0) too: its write may never end
    found = recover(tmp_path / "spill")
    assert [e.seq for e in found.envelopes] == list(range(30))
    assert found.bad_lines == 0
    sink.gate.set()


def test_a_sink_given_up_at_close_while_it_waits_to_try_a_batch_again_does_not_try_it() -> None:
    # Before: the give-up woke it from its pause, and it wrote the batch once more (here: written). With
    # no spill to keep it, the batch is the sink's to count: failed, its last try having raised.
    bus = make_bus()
    sink = GateSink(fail_first=1)
    bus.add_sink(sink, name="metrics", batch_size=5, flush_interval_s=0.01, retry_first_s=60, retry_max_s=60)
    publish(bus, 5)
    deadline = time.monotonic() + 5
    while not bus.stats()["metrics"]["errors"]:  # its write failed: it waits 60 s to try again
        assert time.monotonic() < deadline, "the sink's first write did not fail"
        time.sleep(0.005)
    bus.close(timeout_s=0.1)
    stats = bus.close(timeout_s=10)["metrics"]  # once the sink has ended
    assert (sink.calls, sink.seqs) == (1, [])
    assert (stats["failed"], stats["written"], stats["unflushed"], stats["errors"]) == (5, 0, 0, 1)


def test_a_line_cut_short_by_a_crash_is_skipped_when_recovered(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill", max_bytes=1_000_000)
    spill.append([Envelope("r", n, float(n), BatchRequested(n)) for n in range(3)])
    spill.close()
    with open(tmp_path / "spill" / "events-000001.jsonl", "ab") as f:
        f.write(b'{"run_id":"r","seq":3,"t"')
    found = recover(tmp_path / "spill")
    assert [e.seq for e in found.envelopes] == [0, 1, 2]
    assert found.bad_lines == 1


def test_segments_read_to_their_end_are_removed(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "spill", max_bytes=1_000_000, segment_bytes=500)
    for n in range(40):
        spill.append([Envelope("r", n, float(n), BatchRequested(n))])
    segments = len(list((tmp_path / "spill").iterdir()))
    assert segments > 3
    assert [e.seq for e in spill.read(20)] == list(range(20))
    assert len(list((tmp_path / "spill").iterdir())) < segments
    assert spill.bytes == sum(p.stat().st_size for p in (tmp_path / "spill").iterdir())
    assert [e.seq for e in spill.read(100)] == list(range(20, 40))
    assert not (tmp_path / "spill").exists()
    assert spill.bytes == spill.unread == 0


@pytest.mark.parametrize(("max_bytes", "segment_bytes"), [(0, 10), (-1, 10), (10, 0)])
def test_bad_spill_sizes_are_refused(tmp_path: Path, max_bytes: int, segment_bytes: int) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        SpillFile(tmp_path, max_bytes=max_bytes, segment_bytes=segment_bytes)


def test_a_buffer_past_half_full_is_copied_to_disk_and_the_copy_removed_once_the_sink_caught_up(
    tmp_path: Path,
) -> None:
    # Before: nothing reached the disk until the buffer was full and spilling, then its copy only later.
    # the batch being written (seq 0) and 799 buffered: past half, short of full
    bus, sink = held_store(tmp_path / "spill", capacity=1_000, behind=799)
    assert bus.stats()["store"]["spilled"] == 0
    deadline = time.monotonic() + 10
    while len(recover(tmp_path / "spill").envelopes) <= 790 and time.monotonic() < deadline:
        time.sleep(0.01)
    copied = [e.seq for e in recover(tmp_path / "spill").envelopes]
    assert copied == list(range(len(copied)))  # all but the last few (fewer than a batch), in order
    assert len(copied) > 800 - 10
    sink.gate.set()
    deadline = time.monotonic() + 10
    while (bus.backlog() or (tmp_path / "spill").exists()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not (tmp_path / "spill").exists()  # caught up: the copies are gone
    stats = bus.close(timeout_s=10)["store"]
    assert sink.seqs == list(range(800))
    assert (stats["spilled"], stats["dropped"], stats["spill_bytes"]) == (0, 0, 0)


class StepSink:
    """Writes one batch each time `step` is released (a database that answers now and then)."""

    def __init__(self) -> None:
        self.step = threading.Semaphore(0)
        self.entered = threading.Event()
        self.calls = 0
        self.seqs: list[int] = []

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        self.entered.set()
        self.calls += 1
        assert self.step.acquire(timeout=30)
        self.seqs.extend(e.seq for e in envelopes)


def test_the_copies_of_what_the_sink_has_written_are_removed_while_it_stays_behind(tmp_path: Path) -> None:
    bus = make_bus()
    sink = StepSink()
    spill = SpillFile(tmp_path / "spill", max_bytes=10_000_000, backup_file_bytes=2_000)  # ~27 a file
    bus.add_sink(sink, name="store", batch_size=10, flush_interval_s=0.01, capacity=1_000, spill=spill)
    bus.publish(BatchRequested(0))
    assert sink.entered.wait(5)
    publish(bus, 949)  # past half full: copied to disk, the buffer at once, then files of ~27 envelopes
    assert spill.backed_up()
    copied = [e.seq for e in recover(tmp_path / "spill").envelopes]
    assert copied[0] == 0
    for _ in range(7):  # seq 0, then six batches of 100 (the sink is behind): up to seq 600 written
        sink.step.release()
    deadline = time.monotonic() + 10
    while sink.calls < 8 and time.monotonic() < deadline:  # held in its 8th: the 7th's removal is queued
        time.sleep(0.01)
    assert spill.backed_up()
    left = [e.seq for e in recover(tmp_path / "spill").envelopes]
    assert 500 < left[0] <= 601  # the files of written envelopes are gone, not one unwritten with them
    assert left == list(range(left[0], copied[-1] + 1))
    for _ in range(100):
        sink.step.release()
    stats = bus.close(timeout_s=10)["store"]
    assert sink.seqs == list(range(950))
    assert (stats["spilled"], stats["dropped"]) == (0, 0)
    assert not (tmp_path / "spill").exists()


# The child: a bus whose sink is held shut until 3,000 envelopes are published (1,000 buffered, the
# rest spilled), then writes, recording each batch in `written` (its own ledger), until it is given
# the last envelope, read back from the spill: it says so (`held`) and never returns (a database away
# again). The publisher records each seq it published in `published`.
HELD_IN_LAST = """
import os, sys, threading, time
from pathlib import Path
from app.core.events import BatchRequested
from app.runtime.events import EventBus
from app.runtime.spill import SpillFile

spill_dir, written, published, held = sys.argv[1:]
N = 3_000
gate = threading.Event()

class Sink:
    def write_batch(self, envelopes):
        gate.wait()
        if envelopes[-1].seq == N - 1:
            Path(held).write_text("held")
            time.sleep(600)
        with open(written, "a") as f:
            f.write("".join(f"{e.seq}\\n" for e in envelopes))

clock = iter(range(10**9))
bus = EventBus("run-1", clock=lambda: float(next(clock)))
bus.add_sink(Sink(), name="store", batch_size=10, flush_interval_s=0.01, capacity=1_000,
             spill=SpillFile(Path(spill_dir), max_bytes=10**8))
fd = os.open(published, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
for n in range(N):
    bus.publish(BatchRequested(n))
    os.write(fd, b"%d\\n" % n)
gate.set()
time.sleep(600)
"""


@pytest.mark.slow
def test_a_process_killed_while_its_sink_writes_the_spills_last_batch_leaves_it_on_disk(
    tmp_path: Path,
) -> None:
    # Before: the spill read to its end was removed before the sink had written its last batch: a kill
    # then lost that batch (and, at a segment's end with more behind it, left a hole).
    spill_dir, written, published, held = (
        tmp_path / name for name in ("spill", "written", "published", "held")
    )
    argv = [sys.executable, "-c", HELD_IN_LAST, *map(str, (spill_dir, written, published, held))]
    kill_when(argv, held.exists, "the sink got the last envelope")
    sent = [int(n) for n in published.read_text().split()]
    assert sent == list(range(3_000))
    stored = {int(n) for n in written.read_text().split()}
    left = {e.seq for e in recover(spill_dir).envelopes}  # what the next start would store
    assert sorted(stored | left) == sent


def test_a_sink_whose_spill_the_disk_refuses_is_at_risk_before_it_drops_and_not_once_it_drains(
    tmp_path: Path,
) -> None:
    """`EventBus.at_risk` is what holds a local run before its events would be dropped: true from the
    share of the buffer asked about while the spill's disk refuses (a directory under a file: mkdir
    fails as on a full or read-only disk), before any envelope is dropped; false once the sink writes
    again and the buffer is below that share."""
    (tmp_path / "a-file").write_text("")
    bus, sink = held_store(tmp_path / "a-file" / "spill", capacity=100, behind=79)
    assert not bus.at_risk(0.8)  # 79 buffered
    publish(bus, 1)
    assert bus.at_risk(0.8)
    assert not bus.at_risk(0.81)
    assert bus.stats()["store"]["dropped"] == 0
    sink.gate.set()
    deadline = time.monotonic() + 10
    while bus.at_risk(0.5) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not bus.at_risk(0.5)
    assert bus.close(timeout_s=10)["store"]["written"] == 81


def test_a_spill_that_takes_writes_keeps_its_sink_out_of_risk_and_one_near_its_bound_does_not(
    tmp_path: Path,
) -> None:
    bus, sink = held_store(tmp_path / "spill", capacity=100, behind=99)
    assert not bus.at_risk(0.5)  # a full buffer, but the disk takes the spill
    assert not (tmp_path / "spill" / "probe.tmp").exists()
    sink.gate.set()
    bus.close(timeout_s=10)
    near = SpillFile(tmp_path / "near", max_bytes=1_000)
    near.append([Envelope("run-1", 0, 0.0, BatchRequested(0))] * 12)  # 76 bytes each
    assert near.disk_bytes >= 900
    assert not near.taking()
    near.clear()
