"""A run on Postgres through a database outage (tests/db_relay.py): its state changes and its events wait
for the database and are all stored once it answers again; the run itself never notices."""

from __future__ import annotations

import threading
from pathlib import Path

from db_relay import relayed_database
from sqlalchemy.orm import Session

from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.db import make_engine
from app.store.models import RunState
from app.store.repos import EventRepo, GroupRepo, RunRepo

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def test_a_run_through_a_postgres_outage_is_stored_whole(tmp_path: Path) -> None:
    # The store writer tried each write once: the run's end state, written while Postgres was away,
    # was lost (a run shown running forever after), and the event sink dropped the batches it met.
    with relayed_database(POSTGRES_URL, tmp_path) as db:
        url, relay = db.url, db.relay
        store = ServiceStore(db.relayed_url)
        manager = RunManager(store, tmp_path / "data", 30.0)
        try:
            spec = {"name": "outage", "kind": "sim", "speed": 10.0, "trainer": "sentinel", "batches": 3}
            run_id = manager.create(RunCreate.model_validate(spec))
            handle = manager.get(run_id)
            assert handle is not None
            # Postgres goes away as the run starts and comes back 15 s later, after the run has ended:
            # its events wait in more than one batch (the run takes several flush intervals), and the
            # end of the run waits for them (it waited 10 s, then counted what was left unflushed).
            relay.cut()
            threading.Timer(15, relay.restore).start()
            assert handle.join(120), "the run did not end"
            published = handle.recorder.bus.published
        finally:
            manager.shutdown()  # waits for the store writer
            store.close()
            relay.cut()
        assert handle.state is RunState.COMPLETED, handle.error
        stats = handle.recorder.bus.stats()["store"]
        assert (stats["written"], stats["failed"], stats["unflushed"]) == (published, 0, 0), stats
        assert stats["batches"] >= 2, stats
        straight = make_engine(url)
        try:
            with Session(straight) as s:
                row = RunRepo(s).get(run_id)
                assert row is not None
                assert row.state == RunState.COMPLETED.value
                assert EventRepo(s).count(run_id) == published
                account = GroupRepo(s).account(run_id)
                assert account.open == 0
                assert account.delivered >= 3 * handle.policy.groups_per_batch
        finally:
            straight.dispose()
