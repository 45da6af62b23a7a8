"""A real (local) run whose SQLite store is held by another writer for longer than the store waits out
an outage: it cannot stand still for the store, so its events go to the store sink's spill on local
disk and reach the store once the lock is let go; the stored stream has no hole and holds what the run
published. A spill a killed process left is stored by the next start, before its run resumes."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from factories import take_write_lock
from test_engine_supervision import make_config

from app.core.events import BatchRequested, Envelope
from app.runtime.spill import SpillFile
from app.service.compose import manager_for, store_for
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.settings import Settings
from app.store.models import RunState


def stored_rows(db: Path, run_id: str) -> list[tuple[int, str]]:
    """(seq, kind) of the run's stored events, read straight from the file, not through Corral."""
    conn = sqlite3.connect(db)
    try:
        query = "SELECT seq, kind FROM events WHERE run_id = ? ORDER BY seq"
        return conn.execute(query, (run_id,)).fetchall()
    finally:
        conn.close()


@pytest.mark.slow
def test_a_local_run_whose_store_is_locked_past_the_outage_wait_stores_every_event(tmp_path: Path) -> None:
    # Before: after the outage wait the store sink gave its batch up (`failed`), and once its buffer
    # filled it dropped the rest: a stored stream with holes.
    db = tmp_path / "corral.db"
    settings = Settings(
        database_url=f"sqlite:///{db}",
        data_dir=tmp_path / "data",
        store_outage_s=1.0,  # the store waits out 1 s of a locked file...
        sqlite_busy_timeout_s=0.5,  # ...of 0.5 s tries
        store_buffer=20,  # and its buffer fills within the lock
        sink_retry_max_s=0.5,
    )
    store = store_for(settings)
    manager = manager_for(settings, store)
    spec = {"name": "locked", "kind": "local", "config": make_config(), "trainer": "sentinel",
            "sentinel_step_s": 0.2}  # fmt: skip
    ledger: dict[int, str] = {}  # what the bus published, as its observer saw it
    other: sqlite3.Connection | None = None
    try:
        handle = manager.get(manager.create(RunCreate.model_validate(spec)))
        assert handle is not None
        handle.recorder.bus.observe(lambda env: ledger.__setitem__(env.seq, env.kind), "test ledger")
        deadline = time.monotonic() + 120
        while handle.recorder.view.batches < 1:
            assert time.monotonic() < deadline, "no batch in 120 s"
            assert not handle.done.is_set(), handle.error
            time.sleep(0.05)
        other = take_write_lock(db)  # another writer holds the file: 8 s, past the 1.5 s wait
        published_at_lock = handle.recorder.bus.published
        most_unwritten = 0
        spill: dict[str, Any] = {}
        locked_until = time.monotonic() + 8.0
        while time.monotonic() < locked_until:
            live = handle.live()
            most_unwritten = max(most_unwritten, live["events_unwritten"])
            spill = live.get("events_spill", {})
            time.sleep(0.05)
        during = handle.recorder.bus.stats()["store"]
        published_in_lock = handle.recorder.bus.published - published_at_lock
        other.execute("COMMIT")
        other.close()
        other = None
        deadline = time.monotonic() + 60
        while handle.recorder.bus.backlog() and time.monotonic() < deadline:
            time.sleep(0.05)
        handle.submit(handle.stop).result(timeout=10)
        assert handle.join(60), "the run did not end after stop"
        assert handle.state is RunState.STOPPED, handle.error
        manager.shutdown()
        stats = handle.recorder.bus.stats()["store"]
        published = handle.recorder.bus.published
    finally:
        if other is not None:
            other.execute("COMMIT")
            other.close()
        manager.shutdown()
        store.close()
    assert published_in_lock > 20  # it went on past its buffer
    assert during["errors"] >= 1, during  # the outage wait ran out on the lock, at least once
    rows = stored_rows(db, handle.run_id)
    assert [seq for seq, _ in rows] == list(range(published))  # every event, once, no hole
    kinds = dict(rows)
    assert all(kinds[seq] == kind for seq, kind in ledger.items())
    assert len(ledger) > published_at_lock  # the ledger saw the lock's events
    assert spill["spilled"] > 0, spill  # the API showed it on disk
    assert spill["spill_bytes"] > 0, spill
    assert most_unwritten > 20
    assert (stats["dropped"], stats["failed"], stats["unflushed"], stats["kept_on_disk"]) == (0, 0, 0, 0)
    assert stats["written"] == published
    assert stats["recovered"] > 0, stats
    assert stats["spill_bytes"] == 0, stats
    assert not (tmp_path / "data" / handle.run_id / "event-spill").exists()
    print(f"published {published} ({published_in_lock} while locked), spilled {stats['spilled']}, "
          f"at most {stats['max_spill_bytes']} bytes on disk")  # fmt: skip


@pytest.mark.parametrize("configured", [False, True])
def test_a_spill_left_by_a_dead_process_is_stored_by_the_next_start(tmp_path: Path, configured: bool) -> None:
    db = tmp_path / "corral.db"
    spill_dir = tmp_path / "spills" if configured else None
    store = ServiceStore(f"sqlite:///{db}")
    try:
        manager = RunManager(store, tmp_path / "data", ack_timeout_s=30.0, spill_dir=spill_dir)
        spec = {"name": "dead", "kind": "sim", "speed": 100.0, "trainer": "sentinel", "batches": 1}
        run_id = manager.create(RunCreate.model_validate(spec))
        handle = manager.get(run_id)
        assert handle is not None
        assert handle.join(60)
        manager.shutdown()
        stored = len(stored_rows(db, run_id))
        # What a process killed while its spill held the next events leaves (as the bus writes it)
        where = tmp_path / "spills" / run_id if configured else tmp_path / "data" / run_id / "event-spill"
        spill = SpillFile(where, max_bytes=10**6)
        spill.append([Envelope(run_id, stored + n, 1e6 + n, BatchRequested(100 + n)) for n in range(50)])
        spill.close()
        again = RunManager(store, tmp_path / "data", ack_timeout_s=30.0, spill_dir=spill_dir)
        assert again.recover_spills() == {run_id: 50}
        rows = stored_rows(db, run_id)
        assert [seq for seq, _ in rows] == list(range(stored + 50))
        assert rows[-1][1] == "batch_requested"
        assert not where.exists()
        assert again.recover_spills() == {}
    finally:
        store.close()


def test_bad_spill_settings_are_refused_by_the_manager(tmp_path: Path) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        with pytest.raises(ValueError, match="spill_max_bytes must be at least 1"):
            RunManager(store, tmp_path / "data", ack_timeout_s=30.0, spill_max_bytes=0)
    finally:
        store.close()
