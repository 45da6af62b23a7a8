"""Retention: an ended run is deleted with everything stored for it; a run that has not ended is refused
and keeps every row. On SQLite and on the real Postgres (`db_engine`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from run_events import make_run_events
from sqlalchemy import Engine, func, select

from app.service.store import RunLiveError, ServiceStore
from app.store.models import Base, RolloutStep, Run, RunState, WeightRollout


def stored_rows(store: ServiceStore, run_id: str) -> dict[str, int]:
    """Rows of `run_id` in every table that has a run_id column, and its rollouts' steps."""
    counts = {}
    with store.session() as s:
        for table in Base.metadata.sorted_tables:
            column = table.c.get("run_id") if table.name != "runs" else table.c.id
            if column is not None:
                counts[table.name] = s.scalar(select(func.count()).select_from(table).where(column == run_id))
        rollouts = select(WeightRollout.id).where(WeightRollout.run_id == run_id)
        counts["rollout_steps"] = s.scalar(
            select(func.count()).select_from(RolloutStep).where(RolloutStep.rollout_id.in_(rollouts))
        )
    return counts


def make_stored_run(store: ServiceStore, ended: bool) -> str:
    run_id = f"ret-{uuid.uuid4().hex[:8]}"
    store.create_run(run_id, "retention", {"kind": "sim"}, {"surplus_groups": 2})
    store.set_state(run_id, RunState.RUNNING)
    synthetic = make_run_events(run_id, open=0 if ended else 1)
    store.event_sink().write_batch(synthetic.envelopes)
    store.set_lanes(run_id, {"exec": ("2-3", 4)})
    store.mark_offered(run_id, 0)
    return run_id


@pytest.fixture
def store(db_engine: Engine) -> Iterator[ServiceStore]:
    """A store of its own on the test database: its writes commit (run ids are unique per test)."""
    store = ServiceStore(db_engine.url.render_as_string(hide_password=False), migrate=False)
    yield store
    store.close()


def test_an_ended_run_is_deleted_with_every_row_and_a_live_one_is_refused(store: ServiceStore) -> None:
    ended = make_stored_run(store, ended=True)
    live = make_stored_run(store, ended=False)
    assert store.get_run(ended).state == RunState.COMPLETED.value  # type: ignore[union-attr]
    assert store.get_run(live).state == RunState.RUNNING.value  # type: ignore[union-attr]
    before_live = stored_rows(store, live)
    before = stored_rows(store, ended)
    for table in ("runs", "events", "spans", "groups", "trajectories", "batches", "engines", "lanes",
                  "weight_rollouts", "rollout_steps", "policy_changes"):  # fmt: skip
        assert before[table] > 0, table

    with pytest.raises(RunLiveError, match="only an ended run"):
        store.delete_run(live)
    assert stored_rows(store, live) == before_live  # nothing of a live run is touched

    assert store.delete_run(ended) is True
    assert set(stored_rows(store, ended).values()) == {0}
    assert store.get_run(ended) is None
    assert store.delete_run(ended) is False  # no such run now
    assert stored_rows(store, live) == before_live  # nor of another run


def test_the_ended_runs_before_a_time_are_listed_oldest_first(store: ServiceStore) -> None:
    now = datetime.now(UTC)
    old, recent = make_stored_run(store, ended=True), make_stored_run(store, ended=True)
    live = make_stored_run(store, ended=False)
    for run_id, days in ((old, 30), (recent, 1)):
        with store.session() as s:
            run = s.get(Run, run_id)
            assert run is not None
            run.ended_at = now - timedelta(days=days)
    listed = [r.id for r in store.ended_runs(now - timedelta(days=7))]
    assert old in listed
    assert recent not in listed
    assert live not in listed
    everything = [r.id for r in store.ended_runs(now + timedelta(seconds=1))]
    assert everything.index(old) < everything.index(recent)
    assert live not in everything
