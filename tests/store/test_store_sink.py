"""The event sink on SQLite and Postgres: every group's account, idempotent re-delivery, orphans."""

from __future__ import annotations

from typing import Any

import pytest
from factories import make_run_ended_mid_rollout, reloaded_after_a_resume
from run_events import batches_of, make_run_events
from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.orm import Session

from app.core.events import (
    EVENT_TYPES,
    AttemptFinished,
    AttemptRestarted,
    Envelope,
    GroupDelivered,
    GroupDiscarded,
    SandboxOp,
)
from app.runtime.events import BEHIND_BATCHES, EventBus
from app.store.models import (
    Batch,
    EventRow,
    Group,
    PolicyChange,
    RolloutStep,
    Run,
    Span,
    Trajectory,
    WeightRollout,
)
from app.store.models import (
    Engine as EngineRow,
)
from app.store.repos import EventRepo, GroupRepo, RunRepo, SpanRepo
from app.store.sink import SqlEventSink

TABLES = (EventRow, Group, Trajectory, Span, Batch, EngineRow, WeightRollout, PolicyChange)


def ingest(conn: Connection, envelopes: list[Envelope], batch: int = 7) -> SqlEventSink:
    sink = SqlEventSink(conn)
    for chunk in batches_of(envelopes, batch):
        sink.write_batch(chunk)
    return sink


def count(session: Session, model: Any, run_id: str) -> int:
    return int(session.scalar(select(func.count()).select_from(model).where(model.run_id == run_id)) or 0)


def test_sink_stores_every_groups_terminal_account(conn: Connection, session: Session) -> None:
    run = make_run_events("acct", groups=9, discard={1: "stale", 4: "zero_variance"})
    sink = ingest(conn, run.envelopes)

    assert sink.written == len(run.envelopes)
    groups = {g.group_id: g for g in GroupRepo(session).list("acct")}
    assert set(groups) == set(range(9))
    for gid, (batch, staleness) in run.delivered.items():
        g = groups[gid]
        assert (g.state, g.batch_index, g.staleness) == ("delivered", batch, staleness)
        assert g.admitted_at is not None
        assert g.ready_at is not None
        assert g.ended_at is not None
        assert g.admitted_at < g.ready_at <= g.ended_at
    for gid, reason in run.discarded.items():
        assert (groups[gid].state, groups[gid].reason) == ("discarded", reason)
    assert len(run.delivered) == 6
    assert len(run.discarded) == 3
    account = GroupRepo(session).account("acct")
    assert (account.admitted, account.open, account.delivered) == (9, 0, 6)
    assert account.discarded == {"stale": 1, "zero_variance": 1, "cancelled": 1}

    trajectories = session.scalars(select(Trajectory).where(Trajectory.run_id == "acct")).all()
    assert len(trajectories) == 9 * run.group_size
    for tr in trajectories:
        assert (tr.turns, tr.tokens) == run.turns[(tr.group_id, tr.attempt)]
        assert tr.reward == float(tr.attempt % 2)
        assert tr.started_at is not None
        assert tr.finished_at is not None
    assert count(session, Span, "acct") == run.spans
    assert count(session, EventRow, "acct") == len(run.envelopes)


def test_sink_projects_batches_engines_rollouts_policy_and_run(conn: Connection, session: Session) -> None:
    run = make_run_events("proj")
    ingest(conn, run.envelopes, batch=5)

    batches = session.scalars(select(Batch).where(Batch.run_id == "proj").order_by(Batch.batch_index)).all()
    delivered_in = {b: sorted(g for g, (bi, _) in run.delivered.items() if bi == b) for b in range(2)}
    assert [sorted(b.group_ids) for b in batches] == [delivered_in[0], delivered_in[1]]
    for b in batches:
        assert b.requested_at is not None
        assert b.delivered_at is not None
        assert b.trainer_version == 1
    engines = session.scalars(select(EngineRow).where(EngineRow.run_id == "proj")).all()
    assert {(e.name, e.state, e.weight_version) for e in engines} == {
        ("e0", "serving", 1),
        ("e1", "serving", 1),
    }
    rollout = session.scalars(select(WeightRollout).where(WeightRollout.run_id == "proj")).one()
    assert (rollout.version, rollout.state) == (1, "completed")
    steps = session.scalars(select(RolloutStep).where(RolloutStep.rollout_id == rollout.id)).all()
    assert {(s.engine, s.state) for s in steps} == {("e0", "done"), ("e1", "done")}
    pauses = session.scalars(select(Span).where(Span.run_id == "proj", Span.phase == "update_pause")).all()
    assert sorted(p.engine or "" for p in pauses) == ["e0", "e1"]
    assert all(p.end - p.start == pytest.approx(1.0) for p in pauses)
    change = session.scalars(select(PolicyChange).where(PolicyChange.run_id == "proj")).one()
    assert (change.field, change.old, change.new, change.actor) == ("max_staleness", 2, 3, "operator")
    stored_run = session.get(Run, "proj")
    assert stored_run is not None
    assert stored_run.policy["max_staleness"] == 3
    assert stored_run.state == "completed"
    assert stored_run.ended_at is not None


def test_a_resumed_runs_reload_keeps_the_rollouts_times_and_has_pauses_of_its_own(
    conn: Connection, session: Session
) -> None:
    """A resumed run loads its version again onto engines that restarted: that reload replaced the
    rollout's engine times in the store (its steps said 21-26 s for a rollout that ended at 4 s)."""
    timed = reloaded_after_a_resume()
    ingest(conn, [Envelope("reload", seq, t, ev) for seq, (t, ev) in enumerate(timed)], batch=3)
    rollout = session.scalars(select(WeightRollout).where(WeightRollout.run_id == "reload")).one()
    assert (rollout.version, rollout.state, rollout.ended_at) == (1, "completed", 4.0)
    steps = session.scalars(select(RolloutStep).where(RolloutStep.rollout_id == rollout.id)).all()
    assert {s.engine: (s.state, s.started_at, s.ended_at) for s in steps} == {
        "e0": ("done", 1.0, 2.0),
        "e1": ("done", 3.0, 4.0),
    }
    pauses = session.scalars(select(Span).where(Span.run_id == "reload", Span.phase == "update_pause")).all()
    assert sorted((p.engine, p.start, p.end) for p in pauses) == [
        ("e0", 1.0, 2.0),
        ("e0", 21.0, 23.0),
        ("e1", 3.0, 4.0),
        ("e1", 24.0, 26.0),
    ]


def test_a_rollout_still_running_when_the_run_ends_is_stored_cancelled(
    conn: Connection, session: Session
) -> None:
    """It stayed `running` in the store, its engine's step `updating`, once the run had ended."""
    timed = make_run_ended_mid_rollout()
    ingest(conn, [Envelope("cut", seq, t, ev) for seq, (t, ev) in enumerate(timed)], batch=3)
    rollouts = session.scalars(select(WeightRollout).where(WeightRollout.run_id == "cut")).all()
    assert {r.version: (r.state, r.ended_at) for r in rollouts} == {
        1: ("superseded", 3.0),
        2: ("cancelled", 4.0),
    }
    ids = {r.id: r.version for r in rollouts}
    steps = session.scalars(select(RolloutStep).where(RolloutStep.rollout_id.in_(ids))).all()
    assert {(ids[s.rollout_id], s.engine): (s.state, s.error) for s in steps} == {
        (1, "e0"): ("done", None),
        (1, "e1"): ("cancelled", "run ended"),
        (2, "e0"): ("cancelled", "run ended"),
    }


def table_snapshot(session: Session, run_id: str) -> dict[str, Any]:
    snap: dict[str, Any] = {m.__tablename__: count(session, m, run_id) for m in TABLES}
    snap["groups"] = [
        (g.group_id, g.state, g.reason, g.batch_index, g.staleness, g.ended_at)
        for g in GroupRepo(session).list(run_id)
    ]
    snap["trajectories"] = sorted(
        (t.group_id, t.attempt, t.turns, t.tokens, t.restarts, t.reward)
        for t in session.scalars(select(Trajectory).where(Trajectory.run_id == run_id))
    )
    return snap


def test_redelivered_events_are_stored_once(conn: Connection, session: Session) -> None:
    run = make_run_events("dup")
    sink = ingest(conn, run.envelopes, batch=4)
    before = table_snapshot(session, "dup")

    # at least once: the whole stream again in other batch sizes, overlapping windows, and a batch
    # that repeats an envelope inside itself
    for chunk in batches_of(run.envelopes, 9):
        sink.write_batch(chunk)
    sink.write_batch(run.envelopes[10:30] + run.envelopes[20:25])
    session.expire_all()

    assert table_snapshot(session, "dup") == before
    assert sink.written == len(run.envelopes)
    assert sink.duplicates == len(run.envelopes) + 25


def test_a_batch_that_fails_stores_nothing(conn: Connection, session: Session) -> None:
    run = make_run_events("fail")
    sink = ingest(conn, run.envelopes[:20])
    bad = Envelope(
        "fail", 20, 99.0, SandboxOp(group_id=0, attempt=0, lane="gpu", queued_at=1, start=2, end=3)
    )

    with pytest.raises(ValueError, match="unknown lane 'gpu'"):
        sink.write_batch([*run.envelopes[21:30], bad])

    assert EventRepo(session).next_seq("fail") == 20
    sink.write_batch(run.envelopes[20:])  # the stream goes on once the bad event is gone
    assert count(session, EventRow, "fail") == len(run.envelopes)


def test_orphans_are_the_groups_admitted_without_an_ending(conn: Connection, session: Session) -> None:
    run = make_run_events("crash", groups=7, open=3, discard={})
    sink = ingest(conn, run.envelopes)
    groups = GroupRepo(session)

    orphans = groups.orphans("crash")
    assert {g.group_id for g in orphans} == run.open_groups == {0, 1, 2}
    assert all(g.state == "admitted" and g.ended_at is None for g in orphans)
    assert groups.account("crash").open == 3

    # the run manager, resuming, discards them through the stream; sequence numbers continue
    seq = EventRepo(session).next_seq("crash")
    assert seq == len(run.envelopes)
    assert groups.next_group_id("crash") == 7
    assert groups.next_group_id("never-ran") == 0
    sink.write_batch(
        [Envelope("crash", seq + i, 100.0, GroupDiscarded(group_id=g.group_id, reason="orphaned"))
         for i, g in enumerate(orphans)]
    )  # fmt: skip
    session.expire_all()
    assert groups.orphans("crash") == []
    account = groups.account("crash")
    assert account.open == 0
    assert account.discarded["orphaned"] == 3
    assert account.admitted == account.delivered + sum(account.discarded.values()) == 7


def test_a_group_ends_once_even_when_the_stream_ends_it_twice(conn: Connection, session: Session) -> None:
    run = make_run_events("twice")
    sink = ingest(conn, run.envelopes)
    gid = next(iter(run.delivered))
    seq = len(run.envelopes)

    sink.write_batch([Envelope("twice", seq, 500.0, GroupDiscarded(group_id=gid, reason="stale"))])
    sink.write_batch(
        [Envelope("twice", seq + 1, 501.0, GroupDelivered(group_id=99, batch_index=7, staleness=0))]
    )

    group = GroupRepo(session).get("twice", gid)
    assert group is not None
    assert (group.state, group.reason) == ("delivered", None)
    assert group.ended_at is not None
    assert group.ended_at < 500.0
    never_admitted = GroupRepo(session).get("twice", 99)  # still stored: nothing is lost silently
    assert never_admitted is not None
    assert (never_admitted.state, never_admitted.admitted_at) == ("delivered", None)


def test_restarts_and_cancelled_tries_are_counted(conn: Connection, session: Session) -> None:
    cancelled_cls: Any = EVENT_TYPES["attempt_cancelled"]
    run = make_run_events("tries", groups=2, open=1, discard={})
    seq = len(run.envelopes)
    extra = [
        Envelope("tries", seq, 50.0, AttemptRestarted(group_id=0, attempt=0)),
        Envelope("tries", seq + 1, 51.0, AttemptRestarted(group_id=0, attempt=0)),
        Envelope("tries", seq + 2, 52.0, cancelled_cls(group_id=0, attempt=1, reason="stale")),
    ]
    ingest(conn, run.envelopes + extra, batch=len(run.envelopes) + 1)  # the restarts straddle two batches

    by_attempt = {t.attempt: t for t in GroupRepo(session).trajectories("tries", 0)}
    assert by_attempt[0].restarts == 2
    assert by_attempt[1].cancel_reason == "stale"
    assert by_attempt[1].finished_at == 52.0
    assert by_attempt[1].reward is None


def test_load_envelopes_replays_the_stream_exactly(conn: Connection, session: Session) -> None:
    run = make_run_events("replay")
    ingest(conn, list(reversed(run.envelopes)), batch=11)  # arrival order does not matter

    assert EventRepo(session).load_envelopes("replay", chunk=13) == run.envelopes
    assert EventRepo(session).gaps("replay") == 0


def test_sink_on_an_engine_commits_each_batch(db_engine: Engine) -> None:
    run = make_run_events("committed")
    sink = SqlEventSink(db_engine)
    try:
        for chunk in batches_of(run.envelopes, 50):
            sink.write_batch(chunk)
        with Session(db_engine) as other:  # a separate connection sees every batch
            assert EventRepo(other).count("committed") == len(run.envelopes)
            assert GroupRepo(other).account("committed").delivered == len(run.delivered)
    finally:
        with Session(db_engine) as s, s.begin():
            assert RunRepo(s).delete("committed")
        with Session(db_engine) as other:
            assert EventRepo(other).count("committed") == 0
            assert SpanRepo(other).list("committed") == []
            assert GroupRepo(other).list("committed") == []


@pytest.mark.parametrize(("t", "reward", "field"), [(1.0, float("nan"), "reward"), (float("inf"), 1.0, "t")])
def test_a_non_finite_number_is_refused_naming_the_field(
    conn: Connection, session: Session, t: float, reward: float, field: str
) -> None:
    sink = SqlEventSink(conn)
    bad = Envelope("nan", 0, t, AttemptFinished(group_id=0, attempt=0, reward=reward))

    with pytest.raises(ValueError, match=f"attempt_finished field {field} is not finite"):
        sink.write_batch([bad])

    assert EventRepo(session).count("nan") == 0


def test_the_event_bus_feeds_the_sink_in_batches(db_engine: Engine) -> None:
    run = make_run_events("bus", groups=12)
    times = iter([env.t for env in run.envelopes])
    sink = SqlEventSink(db_engine)
    try:
        with EventBus("bus", clock=lambda: next(times)) as bus:
            bus.add_sink(sink, name="store", batch_size=50, flush_interval_s=0.05)
            for env in run.envelopes:
                bus.publish(env.event)
        stats = bus.stats()["store"]
        assert (stats["written"], stats["dropped"], stats["failed"]) == (len(run.envelopes), 0, 0)
        # batches, not one write per event, and none past what a sink behind may take at once
        assert len(run.envelopes) // (50 * BEHIND_BATCHES) <= stats["batches"] < len(run.envelopes)
        with Session(db_engine) as s:
            assert EventRepo(s).load_envelopes("bus") == run.envelopes
            assert GroupRepo(s).account("bus").delivered == len(run.delivered)
    finally:
        with Session(db_engine) as s, s.begin():
            RunRepo(s).delete("bus")
