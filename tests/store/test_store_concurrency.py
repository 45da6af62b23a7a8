"""The sink and the API's sessions write the same database at the same time: on SQLite (the embedded
default) a read-then-write session must wait for the sink's batch, not fail with "database is locked"."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from run_events import batches_of, make_run_events
from store_backends import BACKENDS, POSTGRES_URL

from app.store.db import make_engine, make_sessionmaker, scratch_database
from app.store.migrate import upgrade_to_head
from app.store.repos import EventRepo, PolicyRepo, RunRepo
from app.store.sink import SqlEventSink


@pytest.mark.parametrize("backend", BACKENDS)
def test_sessions_and_the_sink_write_side_by_side(backend: str, tmp_path: Path) -> None:
    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        sessions = make_sessionmaker(engine)
        with sessions() as s, s.begin():
            RunRepo(s).create("ops", {}, {"max_staleness": 0}, run_id="ops")
        run = make_run_events("busy", groups=40, turns=6)
        errors: list[BaseException] = []

        def write_events() -> None:
            sink = SqlEventSink(engine)
            for chunk in batches_of(run.envelopes, 100):
                sink.write_batch(chunk)

        def change_policy() -> None:
            for k in range(40):
                try:
                    with sessions() as s, s.begin():
                        current = RunRepo(s).require("ops").policy["max_staleness"]  # read, then write
                        PolicyRepo(s).record("ops", "max_staleness", current, current + 1, "op", float(k))
                except Exception as exc:  # collected: the assertion below names them
                    errors.append(exc)

        threads = [threading.Thread(target=write_events), threading.Thread(target=change_policy)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        try:
            assert errors == []
            with sessions() as s:
                assert RunRepo(s).require("ops").policy["max_staleness"] == 40
                assert len(PolicyRepo(s).history("ops")) == 40
                assert EventRepo(s).count("busy") == len(run.envelopes)
        finally:
            engine.dispose()
