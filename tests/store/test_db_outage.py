"""The real Postgres going away under a run's event sink, and coming back: what it had to write is
stored once the database answers again, nothing twice (the outage: tests/db_relay.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from db_relay import CuttableRelay, postgres_answers, relayed_database
from run_events import make_run_events
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from store_backends import POSTGRES_URL

from app.runtime.events import EventBus
from app.store.db import make_engine, through_outage
from app.store.migrate import upgrade_to_head
from app.store.repos import EventRepo, GroupRepo
from app.store.sink import SqlEventSink


@pytest.fixture
def relayed(tmp_path: Path) -> Iterator[tuple[CuttableRelay, Engine, Engine]]:
    """A scratch database; a relay to its server; an engine through the relay and one straight to it."""
    with relayed_database(POSTGRES_URL, tmp_path) as db:
        upgrade_to_head(db.url)
        through = make_engine(db.relayed_url)
        straight = make_engine(db.url)
        relay = db.relay
        try:
            yield relay, through, straight
        finally:
            through.dispose()
            straight.dispose()


def test_events_published_while_postgres_is_away_are_stored_once_it_is_back(
    relayed: tuple[CuttableRelay, Engine, Engine], caplog: pytest.LogCaptureFixture
) -> None:
    # The sink tried each batch once: the batches of a 3 s outage were counted failed and never stored
    # (a run's history with holes: groups with no ending, batches missing).
    relay, through, straight = relayed
    run = make_run_events("outage", groups=40)
    times = iter([env.t for env in run.envelopes])
    half = len(run.envelopes) // 2
    caplog.set_level(logging.WARNING, "app.store.db")
    with EventBus("outage", clock=lambda: next(times)) as bus:
        bus.add_sink(SqlEventSink(through), name="store", batch_size=20, flush_interval_s=0.02)
        for env in run.envelopes[:half]:
            bus.publish(env.event)
        time.sleep(0.5)  # written
        relay.cut()
        for env in run.envelopes[half:]:
            bus.publish(env.event)
            time.sleep(0.002)
        time.sleep(3)  # the sink meets the outage
        relay.restore()
    stats = bus.stats()["store"]
    assert (stats["written"], stats["failed"], stats["dropped"]) == (len(run.envelopes), 0, 0), stats
    with Session(straight) as s:
        assert EventRepo(s).load_envelopes("outage") == run.envelopes
        assert GroupRepo(s).account("outage").delivered == len(run.delivered)
    assert "event sink: the database is not answering" in caplog.text
    assert "event sink: the database answers again" in caplog.text


def test_an_outage_longer_than_the_wait_fails_the_write_with_the_database_s_error(
    relayed: tuple[CuttableRelay, Engine, Engine],
) -> None:
    relay, through, _ = relayed
    relay.cut()
    started = time.monotonic()
    with pytest.raises(OperationalError):
        through_outage(lambda: through.connect().close(), "probe", outage_s=1.0)
    assert time.monotonic() - started >= 1.0  # it waited, and gave up


def test_an_error_of_the_write_itself_is_not_waited_on(relayed: tuple[CuttableRelay, Engine, Engine]) -> None:
    from sqlalchemy import text
    from sqlalchemy.exc import ProgrammingError

    _, through, _ = relayed

    def bad() -> None:
        with through.connect() as c:
            c.execute(text("SELECT * FROM no_such_table"))

    started = time.monotonic()
    with pytest.raises(ProgrammingError):
        through_outage(bad, "probe", outage_s=30.0)
    assert time.monotonic() - started < 10  # raised at once, not after the outage wait


def test_a_database_that_does_not_exist_is_not_waited_on(tmp_path: Path) -> None:
    # libpq gives it no SQLSTATE, as it gives none to a refused connection: it was waited on for 60 s.
    if not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering (the outage tests need the real server)")
    missing = make_engine(make_url(POSTGRES_URL).set(database="corral_no_such_db").render_as_string(False))
    try:
        started = time.monotonic()
        with pytest.raises(OperationalError, match="does not exist"):
            through_outage(lambda: missing.connect().close(), "probe", outage_s=30.0)
        assert time.monotonic() - started < 10  # raised at once, not after the outage wait
    finally:
        missing.dispose()


def test_sqlite_locked_past_its_busy_timeout_is_waited_out(tmp_path: Path) -> None:
    # Several runs' writers on a busy machine kept SQLite locked past the busy timeout: "database is
    # locked" failed a store sink's batch of 500 events, and a run's end state, for good.
    import sqlite3
    import threading

    from sqlalchemy import event, text

    url = f"sqlite:///{tmp_path / 'busy.db'}"
    engine = make_engine(url)

    @event.listens_for(engine, "connect")
    def _short_busy_timeout(dbapi_conn: object, _record: object) -> None:
        dbapi_conn.execute("PRAGMA busy_timeout=50")  # type: ignore[attr-defined]

    try:
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (x INTEGER)"))
        other = sqlite3.connect(tmp_path / "busy.db", isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")  # another writer, holding the lock for a second
        threading.Timer(1.0, other.execute, ("COMMIT",)).start()

        def write() -> None:
            with engine.begin() as c:
                c.execute(text("INSERT INTO t VALUES (1)"))

        started = time.monotonic()
        through_outage(write, "probe", outage_s=30.0)
        assert time.monotonic() - started >= 0.9  # it waited for the other writer
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM t")).scalar_one() == 1  # stored once
        other.close()
    finally:
        engine.dispose()
