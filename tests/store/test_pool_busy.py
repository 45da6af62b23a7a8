"""Every pooled connection in use past the pool's wait: the database is busy, as SQLite locked past its
busy timeout is. Before, 68 simulated runs launched at once in one `corral serve` on SQLite took the
pool's 15 connections: their store sinks dropped batches of events for good ("event sink store failed
on 500 events: TimeoutError('QueuePool limit of size 5 overflow 10 reached …')"), and requests were
500s with a traceback."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import TimeoutError as PoolTimeout

from app.store.db import is_outage, make_engine, outage_kind, outage_reason, through_outage


def test_a_pool_with_no_connection_free_is_waited_out(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'pool.db'}", pool_size=1, max_overflow=0, pool_timeout=0.05)
    try:
        with engine.begin() as c:
            c.execute(text("CREATE TABLE t (x INTEGER)"))
        held = engine.connect()  # the pool's one connection, given back after a second
        threading.Timer(1.0, held.close).start()

        def write() -> None:
            with engine.begin() as c:
                c.execute(text("INSERT INTO t VALUES (1)"))

        started = time.monotonic()
        through_outage(write, "probe", outage_s=30.0)
        assert time.monotonic() - started >= 0.9
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM t")).scalar() == 1
    finally:
        engine.dispose()


def test_a_pool_timeout_is_said_as_a_busy_database_in_one_line() -> None:
    exc = PoolTimeout(
        "QueuePool limit of size 5 overflow 10 reached, connection timed out, timeout 30.00 "
        "(Background on this error at: https://sqlalche.me/e/21/3o7r)"
    )
    assert is_outage(exc)
    assert outage_kind(exc) == "busy"
    said = "QueuePool limit of size 5 overflow 10 reached, connection timed out, timeout 30.00"
    assert outage_reason(exc) == f"every connection of its pool in use ({said})"


def test_a_pool_timeout_outlasting_the_wait_is_raised(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'pool.db'}", pool_size=1, max_overflow=0, pool_timeout=0.05)
    held = engine.connect()
    try:
        with pytest.raises(PoolTimeout):
            through_outage(lambda: engine.connect().close(), "probe", outage_s=0.3)
    finally:
        held.close()
        engine.dispose()
