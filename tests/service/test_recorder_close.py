"""Closing a run's recorder while the store cannot write (another connection holds the SQLite file's write
lock): from two threads at once (the run's thread as the run ends, and a second Ctrl-C letting its sinks
go: `RunManager._keep_unstored`), and while the store sink waits to try its batch again. Every event the
run published ends stored or in the store sink's spill, once, and counted once: the sink's counts are
checked against the database file and the spill's lines, read directly."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from factories import take_write_lock
from test_store_spill_kill import rows

from app.core.events import BatchRequested
from app.runtime.events import RETRY_FIRST_S
from app.runtime.spill import SpillFile
from app.service.manager import RunManager
from app.service.recorder import RunRecorder, StoredMark
from app.service.store import ServiceStore

STORED = 100  # published and stored before the lock
HELD = 100  # published while another writer holds the lock
WAIT_S = 30.0  # the most a test waits for what should come at once


def spilled_seqs(directory: Path) -> list[int]:
    """Every sequence number in the spill's files, each line counted (not through `spill.recover`, which
    keeps one of each)."""
    lines = [line for path in directory.glob("*.jsonl") for line in path.read_text().splitlines()]
    return sorted(json.loads(line)["seq"] for line in lines)


@dataclass
class Locked:
    recorder: RunRecorder
    run_id: str
    db: Path
    spill_dir: Path
    lock: sqlite3.Connection  # holds the file's write lock until it commits


@contextlib.contextmanager
def recorder_behind_a_lock(
    tmp_path: Path, outage_s: float, retry_first_s: float = RETRY_FIRST_S
) -> Iterator[Locked]:
    """A run's recorder whose store sink (a real SQLite file, with a spill) has stored STORED events, then
    was published HELD more while another connection holds the file's write lock (let go at the end).
    The sink's write waits out the lock for `outage_s`, then waits `retry_first_s` to try it again."""
    db = tmp_path / "corral.db"
    store = ServiceStore(f"sqlite:///{db}", outage_s=outage_s, busy_timeout_s=0.05)
    lock: sqlite3.Connection | None = None
    try:
        run_id = store.create_run("closed", "closed", {}, {}).id
        clock = iter(range(10**9))
        recorder = RunRecorder(run_id, clock=lambda: float(next(clock)))
        recorder.stored = StoredMark(store.event_sink())
        spill_dir = tmp_path / "spill"
        recorder.bus.add_sink(
            recorder.stored,
            name="store",
            spill=SpillFile(spill_dir, max_bytes=2**30),
            retry_first_s=retry_first_s,
            retry_max_s=retry_first_s,
        )
        for n in range(STORED):
            recorder.publish(BatchRequested(n))
        assert recorder.wait_stored(STORED - 1, WAIT_S), "the store did not take the first events"
        lock = take_write_lock(db)
        for n in range(STORED, STORED + HELD):
            recorder.publish(BatchRequested(n))
        yield Locked(recorder, run_id, db, spill_dir, lock)
    finally:
        if lock is not None:
            lock.close()
        store.close()


def check_ledger(locked: Locked, counts: dict[str, Any]) -> None:
    """Each event published is stored (the database file) or in the spill (its lines), once, and the
    sink's counts say the same: the store's rows `written`, the spill's lines `kept_on_disk`."""
    stored = rows(locked.db, locked.run_id)  # read straight from the file, not through Corral
    spilled = spilled_seqs(locked.spill_dir)
    assert stored == list(range(STORED))
    assert spilled == list(range(STORED, STORED + HELD))
    assert (counts["written"], counts["kept_on_disk"]) == (len(stored), len(spilled))
    assert (counts["failed"], counts["dropped"], counts["unflushed"]) == (0, 0, 0)


def test_two_closes_at_once_of_a_recorder_whose_store_is_locked_keep_each_event_once(tmp_path: Path) -> None:
    # Before: each close that timed out on the sink (stuck writing its batch to the locked file) appended
    # that batch to the spill, so the second wrote every one of its events there again, and its
    # kept_on_disk counted them twice (200 for 100). And once that write failed, its events were counted
    # failed as well as kept_on_disk.
    with recorder_behind_a_lock(tmp_path, outage_s=5.0) as locked:  # longer than both closes wait
        results: list[dict[str, Any]] = []
        both = threading.Barrier(2)

        def close(timeout_s: float) -> None:
            both.wait()
            results.append(locked.recorder.close(timeout_s)["store"])

        closers = [threading.Thread(target=close, args=(t,)) for t in (0.2, 0.5)]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(WAIT_S)
        assert len(results) == 2, "a close did not return"
        # A close waits for the sink's write on the locked file to end (a write that landed would leave a
        # copy stored and kept, which the next start skips), then the lock is let go.
        later = locked.recorder.close(WAIT_S)["store"]
    assert [r["kept_on_disk"] for r in results] == [HELD, HELD]
    assert [r["unflushed"] for r in results] == [0, 0]
    check_ledger(locked, later)


@pytest.mark.parametrize("lock_after", ["held on", "let go"])
def test_a_close_that_gives_up_while_the_store_sink_waits_to_try_again_ends_its_writes(
    tmp_path: Path, lock_after: str
) -> None:
    # Before: the give-up woke the sink from its pause and it wrote the batch it had just put in the spill
    # once more: on the locked file that failed, counted failed as well as kept_on_disk; with the lock let
    # go it was stored, and stayed in the spill.
    with recorder_behind_a_lock(tmp_path, outage_s=0.2, retry_first_s=WAIT_S * 10) as locked:
        recorder = locked.recorder
        deadline = time.monotonic() + WAIT_S
        while not recorder.bus.stats()["store"]["errors"]:  # its write failed: it waits to try again
            assert time.monotonic() < deadline, "the sink's write on the locked file did not fail"
            time.sleep(0.01)
        given_up = recorder.close(0.1)["store"]
        if lock_after == "let go":
            locked.lock.execute("COMMIT")
        later = recorder.close(WAIT_S)["store"]  # once the sink has ended
    check_ledger(locked, later)
    assert given_up["kept_on_disk"] == HELD
    assert later == given_up  # the sink counted nothing after it was given up


def test_a_write_that_lands_after_the_give_up_is_stored_once_by_the_next_start(tmp_path: Path) -> None:
    """A close gives up on the store sink while its write waits on the locked file: the batch it writes
    goes to the spill too. The lock is then let go and that write lands: its events are both stored and
    spilled. The next start stores the spill (`RunManager._recover_spill`), skipping the copies the store
    has: every event stored once, none lost, no hole."""
    with recorder_behind_a_lock(tmp_path, outage_s=5.0) as locked:  # its write outlasts the give-up
        recorder = locked.recorder
        given_up = recorder.close(0.2)["store"]
        assert given_up["kept_on_disk"] == HELD  # the batch being written included
        locked.lock.execute("COMMIT")  # the write under way lands now
        recorder.close(WAIT_S)
        landed = [seq for seq in rows(locked.db, locked.run_id) if seq >= STORED]
        assert landed, "the write under way at the give-up did not land: nothing was stored twice"
        assert set(landed) <= set(spilled_seqs(locked.spill_dir))  # stored and kept
        store = ServiceStore(f"sqlite:///{locked.db}", migrate=False)
        try:
            new = RunManager(store, tmp_path / "data", 30.0)._recover_spill(locked.run_id, locked.spill_dir)
            assert new == HELD - len(landed)
            assert store.event_gaps(locked.run_id) == 0
        finally:
            store.close()
    assert rows(locked.db, locked.run_id) == list(range(STORED + HELD))  # each once
    assert not locked.spill_dir.exists()
