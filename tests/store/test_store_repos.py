"""Repositories on SQLite and Postgres: run lifecycle, policy history, batch offers and acks, rollouts,
engines, lanes and the timeline. Repositories never commit: each test's transaction is rolled back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from run_events import make_run_events
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from app.core.events import (
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    VersionPublished,
)
from app.store.models import RunState
from app.store.repos import (
    BatchRepo,
    EngineRepo,
    IllegalTransitionError,
    LaneRepo,
    PolicyRepo,
    RolloutRepo,
    RunNotFoundError,
    RunRepo,
    SpanRepo,
    as_utc,
)
from app.store.sink import SqlEventSink


def make_run(session: Session, **overrides: Any) -> str:
    fields: dict[str, Any] = {
        "name": "demo",
        "config": {"engines": 2, "lanes": {"exec": 4}},
        "policy": {"groups_per_batch": 4, "group_size": 2, "surplus_groups": 2, "max_staleness": 1},
    }
    fields.update(overrides)
    return RunRepo(session).create(**fields).id


def test_a_run_moves_through_its_lifecycle(session: Session) -> None:
    runs = RunRepo(session)
    run_id = make_run(session)
    assert runs.require(run_id).state == "created"
    assert [r.id for r in runs.unfinished()] == []  # never started: nothing to resume

    runs.set_state(run_id, RunState.RUNNING)
    runs.set_state(run_id, RunState.RUNNING)  # repeated: a no-op
    runs.set_state(run_id, RunState.PAUSED)
    assert run_id in [r.id for r in runs.unfinished()]
    runs.set_state(run_id, RunState.RUNNING)
    runs.set_state(run_id, RunState.FAILED, error="engine e0 died")

    run = runs.require(run_id)
    assert (run.state, run.error) == ("failed", "engine e0 died")
    assert run.started_at is not None
    assert run.ended_at is not None
    assert as_utc(run.started_at) <= as_utc(run.ended_at)  # type: ignore[operator]
    with pytest.raises(IllegalTransitionError, match="is failed; it cannot become running"):
        runs.set_state(run_id, RunState.RUNNING)
    with pytest.raises(RunNotFoundError, match="run 'nope' not found"):
        runs.set_state("nope", RunState.RUNNING)


def test_runs_are_listed_newest_first_and_by_state(session: Session) -> None:
    runs = RunRepo(session)
    first = make_run(session, run_id="list-1")
    second = make_run(session, run_id="list-2")
    runs.require(first).created_at = datetime(2026, 1, 1, tzinfo=UTC)
    runs.require(second).created_at = datetime(2026, 1, 2, tzinfo=UTC)
    runs.set_state(second, RunState.RUNNING)

    listed = [r.id for r in runs.list() if r.id.startswith("list-")]
    assert listed == ["list-2", "list-1"]
    assert [r.id for r in runs.list(state=RunState.RUNNING) if r.id.startswith("list-")] == ["list-2"]


def test_policy_history_records_who_changed_what(session: Session) -> None:
    run_id = make_run(session)
    policy = PolicyRepo(session)
    policy.record(run_id, "max_staleness", 1, 3, actor="alice", at=10.0)
    policy.record(run_id, "surplus_groups", 2, 0, actor="trainer", at=12.5)

    history = [(c.field, c.old, c.new, c.actor, c.at) for c in policy.history(run_id)]
    assert history == [("max_staleness", 1, 3, "alice", 10.0), ("surplus_groups", 2, 0, "trainer", 12.5)]
    assert RunRepo(session).require(run_id).policy["max_staleness"] == 3
    assert RunRepo(session).require(run_id).policy["surplus_groups"] == 0


def test_batches_are_offered_again_until_acked(conn: Connection, session: Session) -> None:
    run = make_run_events("offers")
    SqlEventSink(conn).write_batch(run.envelopes)
    batches = BatchRepo(session)
    t0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

    offer = batches.next_to_offer("offers", offer_timeout_s=30, now=t0)
    assert offer is not None
    assert offer.batch_index == 0
    batches.mark_offered("offers", 0, now=t0)
    session.expire_all()
    nxt = batches.next_to_offer("offers", offer_timeout_s=30, now=t0 + timedelta(seconds=1))
    assert nxt is not None
    assert nxt.batch_index == 1  # batch 0 is out, not yet timed out
    again = batches.next_to_offer("offers", offer_timeout_s=30, now=t0 + timedelta(seconds=31))
    assert again is not None
    assert again.batch_index == 0  # unacked for longer than the timeout: offered again

    assert batches.ack("offers", 0, now=t0 + timedelta(seconds=40)) is True
    assert batches.ack("offers", 0) is False  # idempotent: the second ack changes only the count
    session.expire_all()
    acked = batches.get("offers", 0)
    assert acked is not None
    assert (acked.ack_count, acked.offer_count) == (2, 1)
    later = batches.next_to_offer("offers", offer_timeout_s=30, now=t0 + timedelta(seconds=100))
    assert later is not None
    assert later.batch_index == 1
    with pytest.raises(LookupError, match="no delivered batch 9"):
        batches.ack("offers", 9)


def test_a_rollout_created_by_the_api_is_the_one_the_stream_updates(
    conn: Connection, session: Session
) -> None:
    run_id = make_run(session, run_id="roll")
    rollouts = RolloutRepo(session)
    created = rollouts.create(run_id, version=1, path="/weights/v1", actor="trainer", at=0.0)
    EngineRepo(session).register(run_id, "e0", "http://127.0.0.1:8001")
    EngineRepo(session).register(run_id, "e1", "http://127.0.0.1:8002")
    session.flush()

    run = make_run_events("roll")  # publishes version 1 to e0 and e1 mid-run
    SqlEventSink(conn).write_batch(run.envelopes)
    session.expire_all()

    found = rollouts.by_version(run_id, 1)
    assert found is not None
    assert found.id == created.id
    assert (found.path, found.state) == ("/weights/v1", "completed")
    assert [(s.engine, s.state) for s in rollouts.steps(created.id)] == [("e0", "done"), ("e1", "done")]
    assert rollouts.get(run_id, created.id) is not None
    assert rollouts.get("other-run", created.id) is None
    assert [(e.name, e.url, e.weight_version) for e in EngineRepo(session).list(run_id)] == [
        ("e0", "http://127.0.0.1:8001", 1),
        ("e1", "http://127.0.0.1:8002", 1),
    ]


def test_a_newer_version_supersedes_an_unfinished_rollout(conn: Connection, session: Session) -> None:
    sink = SqlEventSink(conn)
    sink.write_batch(
        [
            Envelope("sup", 0, 1.0, VersionPublished(version=1, path=None)),
            Envelope("sup", 1, 2.0, VersionPublished(version=2, path="/w/2")),
        ]
    )
    rollouts = RolloutRepo(session)
    assert [(r.version, r.state, r.ended_at) for r in rollouts.list("sup")] == [
        (1, "superseded", 2.0),
        (2, "running", None),
    ]
    assert rollouts.latest_version("sup") == 2


def test_lanes_are_set_and_replaced(session: Session) -> None:
    run_id = make_run(session)
    lanes = LaneRepo(session)
    lanes.set(run_id, "exec", "2-3", 4)
    lanes.set(run_id, "reset", "4", 2)
    lanes.set(run_id, "exec", "2-5", 8)

    assert [(ln.name, ln.cpus, ln.slots) for ln in lanes.list(run_id)] == [
        ("exec", "2-5", 8),
        ("reset", "4", 2),
    ]


def test_a_lane_s_cpu_set_of_any_length_is_stored(session: Session) -> None:
    # `cpus` was a VARCHAR(200): Postgres refused every other CPU of a 256-CPU host (a 460-character list).
    from app.cpulist import format_cpu_list

    run_id = make_run(session)
    cpus = format_cpu_list(range(0, 256, 2))
    assert len(cpus) > 200
    LaneRepo(session).set(run_id, "exec", cpus, 4)
    session.expire_all()
    assert [(ln.name, ln.cpus) for ln in LaneRepo(session).list(run_id)] == [("exec", cpus)]


def test_the_timeline_pages_by_sequence_number(conn: Connection, session: Session) -> None:
    run = make_run_events("pages")
    SqlEventSink(conn).write_batch(run.envelopes)
    spans = SpanRepo(session)

    everything = [(s.seq, s.phase) for s in spans.list("pages")]
    assert len(everything) == run.spans
    assert everything == sorted(everything)
    paged: list[tuple[int, str]] = []
    since = -1
    while page := spans.list("pages", since=since, limit=7):  # 7: pages end inside an event's spans
        paged.extend((s.seq, s.phase) for s in page)
        since = page[-1].seq
    assert paged == everything
    group_spans = spans.list("pages", group_id=2)
    assert group_spans
    assert {s.group_id for s in group_spans} == {2}


def test_a_rollout_ends_without_the_engines_out_of_rotation(conn: Connection, session: Session) -> None:
    sink = SqlEventSink(conn)
    events = [
        EngineStateChanged(engine="e0", state="serving"),
        EngineStateChanged(engine="e1", state="serving"),
        VersionPublished(version=1, path=None),
        EngineUpdateBegin(engine="e0", version=1),
        EngineUpdateEnd(engine="e0", version=1),
    ]
    sink.write_batch([Envelope("rot", i, float(i), ev) for i, ev in enumerate(events)])
    rollouts = RolloutRepo(session)
    assert [r.state for r in rollouts.list("rot")] == ["running"]  # e1 has not updated yet

    sink.write_batch([Envelope("rot", 5, 5.0, EngineStateChanged(engine="e1", state="unhealthy"))])
    session.expire_all()
    assert [(r.state, r.ended_at) for r in rollouts.list("rot")] == [("completed", 5.0)]
