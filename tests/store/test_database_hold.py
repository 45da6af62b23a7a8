"""`DatabaseHold` on the real Postgres when the connection holding its advisory lock is lost (its
backend terminated, as a Postgres restart would): a check takes the lock again, says who took it if
another process did meanwhile, and ends this process's own old session rather than taking it for
another server. Before, a lost lock was never taken again: a second `corral serve` could start beside
the first. Each check is called here one at a time; `watch` runs them on a thread in `corral serve`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from db_relay import postgres_answers, server_lock_holder, take_server_lock
from factories import wait_for
from sqlalchemy import Engine, text
from store_backends import POSTGRES_URL

from app.store.db import DatabaseHeld, DatabaseHold, make_engine, scratch_database


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    """A scratch Postgres database's URL, and an engine on it for the test's own connections."""
    if not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    with scratch_database("postgres", POSTGRES_URL, tmp_path) as url:
        engine = make_engine(url, isolation_level="AUTOCOMMIT")
        try:
            yield url, engine
        finally:
            engine.dispose()


def terminate_holder(engine: Engine) -> None:
    """End the backend holding the lock and wait until the lock is free, as after a Postgres restart."""
    held = server_lock_holder(engine)
    assert held is not None
    with engine.connect() as c:
        assert c.execute(text("SELECT pg_terminate_backend(:pid, 10000)"), {"pid": held[0]}).scalar()
    assert server_lock_holder(engine) is None


def test_a_lost_hold_is_taken_again_and_refuses_a_second_server(database: tuple[str, Engine]) -> None:
    url, engine = database
    hold = DatabaseHold(url)
    try:
        first = server_lock_holder(engine)
        assert first is not None
        assert first[1] == hold.application_name
        assert hold.check() is None  # held: nothing to do
        terminate_holder(engine)
        assert hold.check() is None
        assert hold.held
        again = server_lock_holder(engine)
        assert again is not None
        assert again[0] != first[0]
        assert again[1] == hold.application_name
        with pytest.raises(DatabaseHeld, match="held by Postgres backend"):
            DatabaseHold(url)  # before: taken, beside the first
    finally:
        hold.release()
    # Its backend lets the lock go as it ends, a moment after the close (CI saw it still listed).
    wait_for(lambda: server_lock_holder(engine) is None, 10, "the released lock to be free")


def test_a_hold_taken_by_another_process_meanwhile_is_said(database: tuple[str, Engine]) -> None:
    url, engine = database
    hold = DatabaseHold(url)
    other = None
    try:
        terminate_holder(engine)
        other = take_server_lock(engine, "another corral serve")
        taken = hold.check()
        assert taken is not None
        assert "another process took this database" in taken
        assert "(another corral serve, from 127.0.0.1)" in taken
        assert not hold.held
        now = server_lock_holder(engine)
        assert now is not None
        assert now[1] == "another corral serve"
    finally:
        hold.release()
        if other is not None:
            other.close()


def test_its_own_old_session_is_ended_not_taken_for_another(database: tuple[str, Engine]) -> None:
    """A network cut that Postgres has not noticed yet: the server still keeps this process's old
    session, lock and all. A check ends that session, and a later one takes the lock again."""
    url, engine = database
    hold = DatabaseHold(url)
    old = None
    try:
        terminate_holder(engine)
        old = take_server_lock(engine, hold.application_name)  # the session the server still keeps for it
        wait_for(lambda: hold.check() is None and hold.held, 10, what="the lock taken again", every_s=0.2)
        now = server_lock_holder(engine)
        assert now is not None
        assert now[1] == hold.application_name
        assert now[0] != old.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
    finally:
        hold.release()
        if old is not None:
            old.close()  # ended by the hold: closing it says so, quietly
