"""A run on Postgres through a database outage (tests/db_relay.py): its state changes and its events wait
for the database and are all stored once it answers again; the run itself never notices."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from db_relay import RelayedDatabase, relayed_database
from sqlalchemy.orm import Session

from app.service.handle import RunHandle
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.db import make_engine
from app.store.models import RunState
from app.store.repos import EventRepo, GroupRepo, RunRepo

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@contextlib.contextmanager
def sim_run_on_relay(
    tmp_path: Path, name: str, batches: int
) -> Iterator[tuple[RelayedDatabase, RunManager, RunHandle]]:
    """A sim run through a relayed scratch database: the database, the run's manager and its handle.
    The manager is shut down (again, when the test did) and the relay cut at the end, after which the
    scratch database is gone: check what it holds inside."""
    with relayed_database(POSTGRES_URL, tmp_path) as db:
        store = ServiceStore(db.relayed_url)
        manager = RunManager(store, tmp_path / "data", 30.0)
        try:
            spec = {"name": name, "kind": "sim", "speed": 10.0, "trainer": "sentinel", "batches": batches}
            handle = manager.get(manager.create(RunCreate.model_validate(spec)))
            assert handle is not None
            yield db, manager, handle
        finally:
            manager.shutdown()  # waits for the store writer
            store.close()


def stored_events(url: str, run_id: str, state: RunState) -> int:
    """The events the database holds for the run, which it records in `state`."""
    straight = make_engine(url)
    try:
        with Session(straight) as s:
            row = RunRepo(s).get(run_id)
            assert row is not None
            assert row.state == state.value
            return EventRepo(s).count(run_id)
    finally:
        straight.dispose()


def test_a_run_through_a_postgres_outage_is_stored_whole(tmp_path: Path) -> None:
    # The store writer tried each write once: the run's end state, written while Postgres was away,
    # was lost (a run shown running forever after), and the event sink dropped the batches it met.
    with sim_run_on_relay(tmp_path, "outage", 3) as (db, manager, handle):
        # Postgres goes away as the run starts and comes back 15 s later, after the run has ended:
        # its events wait in more than one batch (the run takes several flush intervals), and the
        # end of the run waits for them (it waited 10 s, then counted what was left unflushed).
        db.relay.cut()
        threading.Timer(15, db.relay.restore).start()
        assert handle.join(120), "the run did not end"
        manager.shutdown()
        published = handle.recorder.bus.published
        assert handle.state is RunState.COMPLETED, handle.error
        stats = handle.recorder.bus.stats()["store"]
        assert (stats["written"], stats["failed"], stats["unflushed"]) == (published, 0, 0), stats
        assert stats["batches"] >= 2, stats
        assert stored_events(db.url, handle.run_id, RunState.COMPLETED) == published
        straight = make_engine(db.url)
        try:
            with Session(straight) as s:
                account = GroupRepo(s).account(handle.run_id)
                assert account.open == 0
                assert account.delivered >= 3 * handle.policy.groups_per_batch
        finally:
            straight.dispose()


def test_shutting_down_during_a_postgres_outage_waits_for_the_last_events(tmp_path: Path) -> None:
    # `corral serve` stopped (Ctrl-C) while Postgres was away: the shutdown gave up after its 30 s with
    # "did not end" and returned while the run's thread (a daemon) still held the run's last events and
    # its end state, which the exiting process then lost.
    with sim_run_on_relay(tmp_path, "bye", 1000) as (db, manager, handle):
        deadline = time.monotonic() + 60
        while handle.state is not RunState.RUNNING:
            assert time.monotonic() < deadline, "the run never ran"
            time.sleep(0.05)
        db.relay.cut()
        threading.Timer(8, db.relay.restore).start()
        manager.shutdown(timeout_s=2.0)
        assert handle.done.is_set(), "shutdown returned while the run still held unstored events"
        published = handle.recorder.bus.published
        assert handle.state is RunState.STOPPED, handle.error
        stats = handle.recorder.bus.stats()["store"]
        assert (stats["written"], stats["failed"], stats["unflushed"]) == (published, 0, 0), stats
        assert stored_events(db.url, handle.run_id, RunState.STOPPED) == published
