"""Closing a run's recorder from two threads at once: the run's thread as the run ends, and a second Ctrl-C
letting its sinks go (`RunManager._keep_unstored`), while the store cannot write. Every event the run
published ends stored or in the store sink's spill, once, and both closes say so."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from factories import take_write_lock
from test_store_spill_kill import rows

from app.core.events import BatchRequested
from app.runtime.spill import SpillFile
from app.service.recorder import RunRecorder, StoredMark
from app.service.store import ServiceStore

STORED = 100  # published and stored before the lock
HELD = 100  # published while another writer holds the lock


def spilled_seqs(directory: Path) -> list[int]:
    """Every sequence number in the spill's files, each line counted (not through `spill.recover`, which
    keeps one of each)."""
    lines = [line for path in directory.glob("*.jsonl") for line in path.read_text().splitlines()]
    return sorted(json.loads(line)["seq"] for line in lines)


def test_two_closes_at_once_of_a_recorder_whose_store_is_locked_keep_each_event_once(tmp_path: Path) -> None:
    # Before: each close that timed out on the sink (stuck writing its batch to the locked file) appended
    # that batch to the spill, so the second wrote every one of its events there again, and its
    # kept_on_disk counted them twice (200 for 100).
    db = tmp_path / "corral.db"
    # A write waits out the lock for 5 s: longer than both closes wait for it
    store = ServiceStore(f"sqlite:///{db}", outage_s=5.0, busy_timeout_s=0.5)
    other: sqlite3.Connection | None = None
    try:
        run_id = store.create_run("closed-twice", "closed-twice", {}, {}).id
        clock = iter(range(10**9))
        recorder = RunRecorder(run_id, clock=lambda: float(next(clock)))
        recorder.stored = StoredMark(store.event_sink())
        spill_dir = tmp_path / "spill"
        recorder.bus.add_sink(recorder.stored, name="store", spill=SpillFile(spill_dir, max_bytes=2**30))
        for n in range(STORED):
            recorder.publish(BatchRequested(n))
        assert recorder.wait_stored(STORED - 1, 30), "the store did not take the first events"
        other = take_write_lock(db)
        for n in range(STORED, STORED + HELD):
            recorder.publish(BatchRequested(n))

        results: list[dict[str, Any]] = []
        both = threading.Barrier(2)

        def close(timeout_s: float) -> None:
            both.wait()
            results.append(recorder.close(timeout_s)["store"])

        closers = [threading.Thread(target=close, args=(t,)) for t in (0.2, 0.5)]
        for closer in closers:
            closer.start()
        for closer in closers:
            closer.join(30)
        assert len(results) == 2, "a close did not return"
        # The lock is let go once the sink has given its batch up: a write that landed would leave a copy
        # stored and kept (the next start skips it), which is not what this test looks at.
        deadline = time.monotonic() + 30
        while not recorder.bus.stats()["store"]["failed"]:
            assert time.monotonic() < deadline, "the sink's write on the locked file did not end"
            time.sleep(0.05)
        other.execute("COMMIT")
    finally:
        if other is not None:
            other.close()
        store.close()
    stored = rows(db, run_id)  # read straight from the file, not through Corral
    spilled = spilled_seqs(spill_dir)
    assert stored == list(range(STORED))
    assert spilled == list(range(STORED, STORED + HELD))  # each once
    assert [r["kept_on_disk"] for r in results] == [HELD, HELD]
    assert [r["unflushed"] for r in results] == [0, 0]
