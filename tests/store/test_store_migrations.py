"""Alembic migrations: `upgrade head` on a fresh SQLite and a fresh Postgres database produces exactly
the ORM models' schema, through the helper the app factory calls and through the `alembic` command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from run_events import make_run_events
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session
from store_backends import BACKENDS, POSTGRES_URL

from app.store.db import make_engine, scratch_database
from app.store.migrate import alembic_config, current_revision, head_revision, upgrade_to_head
from app.store.models import Base
from app.store.repos import EventRepo, SpanRepo
from app.store.sink import SqlEventSink

REPO = Path(__file__).resolve().parents[2]


def schema_diff(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        return list(
            compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_upgrade_to_head_matches_the_models(backend: str, tmp_path: Path) -> None:
    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        engine = make_engine(url)
        try:
            assert current_revision(engine) is None
            upgrade_to_head(url)
            upgrade_to_head(url)  # the app factory calls it at every start: a no-op the second time
            assert current_revision(engine) == head_revision() is not None
            assert schema_diff(engine) == []
            assert set(inspect(engine).get_table_names()) == {*Base.metadata.tables, "alembic_version"}

            command.downgrade(alembic_config(url), "base")
            assert set(inspect(engine).get_table_names()) == {"alembic_version"}
        finally:
            engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_alembic_command_reads_the_url_from_the_environment(backend: str, tmp_path: Path) -> None:
    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        env = {**os.environ, "CORRAL_DATABASE_URL": url}
        done = subprocess.run(
            [sys.executable, "-m", "alembic", "upgrade", "head"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        engine = make_engine(url)
        try:
            assert current_revision(engine) == head_revision()
            assert schema_diff(engine) == []
        finally:
            engine.dispose()


@pytest.mark.parametrize("backend", BACKENDS)
def test_downgrade_and_upgrade_keep_the_timeline(backend: str, tmp_path: Path) -> None:
    run = make_run_events("kept")
    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            SqlEventSink(engine).write_batch(run.envelopes)
            command.downgrade(alembic_config(url), "0001")  # through 0003 and 0002
            with engine.connect() as conn:
                ids = conn.execute(text("SELECT id FROM spans")).scalars().all()
            assert len(ids) == len(set(ids)) == run.spans
            assert None not in ids

            upgrade_to_head(url)
            assert schema_diff(engine) == []
            with Session(engine) as s:
                assert len(SpanRepo(s).list("kept")) == run.spans
                assert EventRepo(s).load_envelopes("kept") == run.envelopes
        finally:
            engine.dispose()
