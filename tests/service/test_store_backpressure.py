"""A simulated run whose store falls behind (SQLite held by another writer) waits for it: every event it
published is stored, none dropped, and its clock stood still meanwhile (`live.pace.held_s`)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from factories import take_write_lock
from sqlalchemy import text

from app.service import recorder
from app.service.handle import RunHandle
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.db import make_engine
from app.store.models import TERMINAL_RUN_STATES


@contextlib.contextmanager
def fast_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **spec: Any) -> Iterator[RunHandle]:
    """A simulated run at speed 1,000 on a SQLite store, once it has published 200 events; its hold
    marks lowered to 1,000 and 200 events. The manager is shut down and the store closed after."""
    monkeypatch.setattr(recorder, "BACKLOG_HIGH", 1_000)
    monkeypatch.setattr(recorder, "BACKLOG_LOW", 200)
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    body = {"kind": "sim", "speed": 1000.0, "trainer": "sentinel", **spec}
    try:
        handle = manager.get(manager.create(RunCreate.model_validate(body)))
        assert handle is not None
        deadline = time.monotonic() + 30
        while handle.recorder.bus.published < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield handle
    finally:
        manager.shutdown()
        store.close()


def test_a_simulated_run_waits_for_a_store_that_falls_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "corral.db"
    with fast_run(tmp_path, monkeypatch, name="fast", batches=200) as handle:
        other = take_write_lock(db)  # the store's writer waits for this one for 3 s
        most = 0
        locked_until = time.monotonic() + 3.0
        while time.monotonic() < locked_until:
            most = max(most, handle.recorder.bus.backlog())
            time.sleep(0.01)
        other.execute("COMMIT")
        other.close()
        assert handle.join(120), "the run did not end"
        pace = handle.live()["pace"]
        stats = handle.recorder.bus.stats()["store"]
    assert pace["held_s"] > 1.0  # it stood still while the store could not write
    assert most < 1_000 + 1_000  # the hold engaged near its mark (a loop turn's events past it)
    assert stats["dropped"] == stats["failed"] == stats["unflushed"] == 0
    published = handle.recorder.bus.published  # its sequence numbers are 0..published-1
    straight = make_engine(f"sqlite:///{db}")
    try:
        with straight.connect() as c:
            count, top = c.execute(
                text("SELECT count(*), max(seq) FROM events WHERE run_id = :r"), {"r": handle.run_id}
            ).one()
            state = c.execute(text("SELECT state FROM runs WHERE id = :r"), {"r": handle.run_id}).scalar_one()
    finally:
        straight.dispose()
    assert (count, top) == (published, published - 1)  # every event, no hole
    assert state in {s.value for s in TERMINAL_RUN_STATES}


def test_a_run_held_for_its_store_still_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A stop must not wait on a database that is away: the run ends with its clock going again, and its
    # last events wait in the sink, which the recorder's close waits for.
    other: sqlite3.Connection | None = None
    try:
        with fast_run(tmp_path, monkeypatch, name="held") as handle:
            deadline = time.monotonic() + 30
            other = take_write_lock(tmp_path / "corral.db")  # the store cannot write until COMMIT
            while not handle.recorder.backlogged() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert handle.recorder.backlogged()
            handle.submit(handle.stop).result(timeout=10)
            while handle.runtime is None or not handle.flushing.is_set():
                assert time.monotonic() < deadline + 30, "the held run did not end while the store was locked"
                time.sleep(0.05)
            ended_while_locked = handle.recorder.bus.published
            other.execute("COMMIT")
            assert handle.join(120)
            stats = handle.recorder.bus.stats()["store"]
    finally:
        if other is not None:
            other.close()
    assert stats["dropped"] == stats["failed"] == stats["unflushed"] == 0
    assert stats["written"] == ended_while_locked == handle.recorder.bus.published


def test_a_stopped_run_waits_for_its_store_as_long_as_corral_store_outage_s_says(tmp_path: Path) -> None:
    """Closing a run's recorder waited `CLOSE_WAIT_S` (the default outage wait, 60 s, + 10 s) whatever
    `CORRAL_STORE_OUTAGE_S` said: set to 2 s, a run stopped while another writer held SQLite still held
    its stop 70 s (and set above 60 s, a run's last events were given up before the store would have
    stopped waiting). It now waits the store's own outage wait + 10 s, then keeps on disk what is left."""
    from app.service.compose import manager_for, store_for
    from app.settings import Settings

    db = tmp_path / "corral.db"
    settings = Settings(
        database_url=f"sqlite:///{db}",
        data_dir=tmp_path / "data",
        store_outage_s=2.0,
        sqlite_busy_timeout_s=0.5,
        sink_retry_max_s=0.5,
    )
    store = store_for(settings)
    manager = manager_for(settings, store)
    other: sqlite3.Connection | None = None
    try:
        body = {"name": "held", "kind": "sim", "speed": 1000.0, "trainer": "sentinel"}
        handle = manager.get(manager.create(RunCreate.model_validate(body)))
        assert handle is not None
        assert handle.recorder.close_wait_s == 2.0 + recorder.CLOSE_MARGIN_S
        deadline = time.monotonic() + 30
        while handle.recorder.bus.published < 200:
            assert time.monotonic() < deadline, "the run published nothing"
            time.sleep(0.01)
        other = take_write_lock(db)  # held until the run has ended: the store cannot write meanwhile
        handle.submit(handle.stop).result(timeout=10)
        # The old wait (70 s) ends after this one; the new one (12 s) well before it.
        ended = handle.join(55)
        stats = handle.recorder.bus.stats()["store"]
        assert ended, "the stop waited for the locked store past CORRAL_STORE_OUTAGE_S + 10 s"
        other.execute("COMMIT")
    finally:
        if other is not None:
            other.close()
        manager.shutdown()
        store.close()
    published = handle.recorder.bus.published
    assert stats["dropped"] == stats["failed"] == 0
    assert stats["kept_on_disk"] > 0  # its last events, for the next start to store
    assert stats["written"] + stats["kept_on_disk"] == published
