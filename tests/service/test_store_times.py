"""A run's times as the store reads them back are Unix times whatever the machine's time zone: SQLite
hands back naive datetimes, stored as UTC, and they were read as local time (on a machine at UTC-5 a run
created now read as created five hours ahead, which the start timeout of celery runs counts from)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.service.store import ServiceStore
from app.store.models import RunState


@pytest.fixture
def away_from_utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("away_from_utc")
def test_a_runs_stored_times_are_unix_times_in_any_time_zone(tmp_path: Path) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        before = time.time()
        store.create_run("r", "n", {}, {})
        store.set_state("r", RunState.RUNNING)
        store.set_state("r", RunState.STOPPED)
        after = time.time()
        record = store.get_run("r")
        assert record is not None
        for name in ("created_at", "started_at", "ended_at"):
            stamp = getattr(record, name)
            assert before - 1 <= stamp <= after + 1, f"{name}: {stamp - before:+.0f} s from now"
    finally:
        store.close()
