"""Store fixtures: every store test runs on SQLite and on the real Postgres.

Each backend gets one fresh database per test session (Postgres: `CREATE DATABASE corral_test_<hex>`,
dropped at the end; SQLite: a file under the session's temp dir), migrated to head. Each test then runs
inside a transaction that is rolled back: the sink writes its batches as savepoints in it, so nothing a
test writes is seen by another.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session
from store_backends import BACKENDS, POSTGRES_URL

from app.store.db import make_engine, scratch_database
from app.store.migrate import upgrade_to_head


@pytest.fixture(scope="session", params=BACKENDS)
def db_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with scratch_database(request.param, POSTGRES_URL, tmp_path_factory.mktemp("db")) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        yield engine
        engine.dispose()


@pytest.fixture
def conn(db_engine: Engine) -> Iterator[Connection]:
    with db_engine.connect() as connection:
        outer = connection.begin()
        yield connection
        outer.rollback()


@pytest.fixture
def session(conn: Connection) -> Iterator[Session]:
    with Session(bind=conn, join_transaction_mode="create_savepoint") as s:
        yield s
