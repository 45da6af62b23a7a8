"""Repositories over a `Session`: the queries the API, the run manager and the dashboard make.

The caller owns the transaction: a repository may `flush` (to get generated ids) but never commits or
rolls back. Most rows below a run are projected from the event stream by `app.store.sink`; the writes
here are the ones that do not come from the stream (creating a run, its lifecycle, registering engines
and lanes, offering and acking batches to an external trainer).

Snapshot and restore: `GroupRepo.orphans(run_id)` lists the groups a crashed control plane left
admitted or ready without an ending, so the run manager can resume them or discard them with the
reason `orphaned` (as a `GroupDiscarded` event, so the stream stays the account); `EventRepo.next_seq`
says where the resumed run's sequence numbers continue, and `EventRepo.iter_envelopes` replays the run.
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session

from app.core.events import Envelope, envelope_from_dict
from app.store.models import (
    TERMINAL_GROUP_STATES,
    TERMINAL_RUN_STATES,
    Batch,
    Engine,
    EventRow,
    Group,
    GroupStatus,
    Lane,
    PolicyChange,
    RolloutStep,
    Run,
    RunState,
    Span,
    Task,
    Trajectory,
    WeightRollout,
    utcnow,
)


class RunNotFoundError(LookupError):
    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id!r} not found")
        self.run_id = run_id


class IllegalTransitionError(ValueError):
    """A lifecycle change the run's current state does not allow (the API answers 409)."""


# which states each state may move to; terminal states go nowhere
RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.CREATED: frozenset({RunState.RUNNING, RunState.STOPPED, RunState.FAILED}),
    RunState.RUNNING: frozenset(
        {RunState.PAUSED, RunState.STOPPING, RunState.STOPPED, RunState.FAILED, RunState.COMPLETED}
    ),
    RunState.PAUSED: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.STOPPED, RunState.FAILED}),
    RunState.STOPPING: frozenset({RunState.STOPPED, RunState.FAILED, RunState.COMPLETED}),
    RunState.STOPPED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.COMPLETED: frozenset(),
}


T = TypeVar("T")


def stamped(state: RunState, started: T | None, ended: T | None, now: T) -> tuple[T | None, T | None]:
    """A run's (started_at, ended_at) after it moves to `state` at `now`: started at its first move to
    running, ended at its move to a terminal state."""
    if state is RunState.RUNNING and started is None:
        started = now
    if state in TERMINAL_RUN_STATES:
        ended = now
    return started, ended


class RunRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def create(
        self,
        name: str,
        config: dict[str, Any],
        policy: dict[str, Any],
        run_id: str | None = None,
    ) -> Run:
        run = Run(
            id=run_id or uuid.uuid4().hex,
            name=name,
            state=RunState.CREATED.value,
            config=config,
            policy=policy,
            created_at=utcnow(),
        )
        self.session.add(run)
        self.session.flush()
        return run

    def get(self, run_id: str) -> Run | None:
        return self.session.get(Run, run_id)

    def require(self, run_id: str) -> Run:
        run = self.get(run_id)
        if run is None:
            raise RunNotFoundError(run_id)
        return run

    def list(self, state: RunState | None = None, limit: int = 100, offset: int = 0) -> Sequence[Run]:
        query = select(Run).order_by(Run.created_at.desc(), Run.id)
        if state is not None:
            query = query.where(Run.state == state.value)
        return self.session.scalars(query.limit(limit).offset(offset)).all()

    def delete(self, run_id: str) -> bool:
        """Remove a run and everything stored for it; False if there was no such run. `events` and
        `spans` have no foreign key to cascade along (see app.store.models), so they go explicitly."""
        self.session.execute(delete(EventRow).where(EventRow.run_id == run_id))
        self.session.execute(delete(Span).where(Span.run_id == run_id))
        deleted = self.session.execute(delete(Run).where(Run.id == run_id))
        self.session.expire_all()
        return bool(getattr(deleted, "rowcount", 0))

    def unfinished(self) -> Sequence[Run]:
        """Runs a control plane was driving when it stopped: the candidates to resume at start-up."""
        terminal = [s.value for s in TERMINAL_RUN_STATES] + [RunState.CREATED.value]
        return self.session.scalars(select(Run).where(Run.state.not_in(terminal)).order_by(Run.id)).all()

    def created(self) -> Sequence[Run]:
        """Runs stored and not started: a celery run no orchestrator worker has taken yet, say."""
        return self.session.scalars(
            select(Run).where(Run.state == RunState.CREATED.value).order_by(Run.id)
        ).all()

    def set_state(
        self, run_id: str, state: RunState, error: str | None = None, at: datetime | None = None
    ) -> Run:
        """Move a run along its lifecycle (at `at`, default now); raises `IllegalTransitionError` for a
        move it does not allow (a repeated move to the current state is a no-op)."""
        run = self.require(run_id)
        current = RunState(run.state)
        if current is state:
            return run
        if state not in RUN_TRANSITIONS[current]:
            raise IllegalTransitionError(f"run {run_id} is {current.value}; it cannot become {state.value}")
        run.state = state.value
        run.started_at, run.ended_at = stamped(state, run.started_at, run.ended_at, at or utcnow())
        if error is not None:
            run.error = error
        self.session.flush()
        return run


class PolicyRepo:
    """A run's policy history. Changes made while the run is live arrive as `PolicyChanged` events and
    the sink records them; `record` is for changes made with no runtime to emit them (a run not yet
    started), so a change is never recorded twice."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def record(
        self,
        run_id: str,
        field: str,
        old: Any,
        new: Any,
        actor: str,
        at: float,
        seq: int | None = None,
    ) -> PolicyChange:
        run = RunRepo(self.session).require(run_id)
        change = PolicyChange(run_id=run_id, seq=seq, field=field, old=old, new=new, actor=actor, at=at)
        self.session.add(change)
        run.policy = {**run.policy, field: new}
        self.session.flush()
        return change

    def history(self, run_id: str) -> Sequence[PolicyChange]:
        query = select(PolicyChange).where(PolicyChange.run_id == run_id)
        return self.session.scalars(query.order_by(PolicyChange.at, PolicyChange.id)).all()


class EventRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def last_seq(self, run_id: str) -> int | None:
        return self.session.scalar(select(func.max(EventRow.seq)).where(EventRow.run_id == run_id))

    def next_seq(self, run_id: str) -> int:
        """Where a resumed run's sequence numbers continue."""
        last = self.last_seq(run_id)
        return 0 if last is None else last + 1

    def count(self, run_id: str) -> int:
        return int(self.session.scalar(select(func.count()).where(EventRow.run_id == run_id)) or 0)

    def list(
        self, run_id: str, since: int = -1, limit: int = 1000, kinds: Iterable[str] | None = None
    ) -> Sequence[EventRow]:
        """Events with seq > `since`, in seq order (the live stream's catch-up and `timeline?since=`)."""
        query = select(EventRow).where(EventRow.run_id == run_id, EventRow.seq > since)
        if kinds is not None:
            query = query.where(EventRow.kind.in_(list(kinds)))
        return self.session.scalars(query.order_by(EventRow.seq).limit(limit)).all()

    def envelopes(self, run_id: str, since: int = -1, limit: int = 1000) -> builtins.list[Envelope]:
        """Up to `limit` of the run's events with seq > `since`, in seq order, as envelopes. Their
        columns are read as rows on the session's connection, not through the ORM: building an
        `EventRow` for each took over half of a replay's time (a 363,753-event run: 12.6 of 22.5 s
        under cProfile), and the ORM's loading of plain rows another 7.8 of the 21 s left."""
        query = (
            select(EventRow.seq, EventRow.t, EventRow.kind, EventRow.payload)
            .where(EventRow.run_id == run_id, EventRow.seq > since)
            .order_by(EventRow.seq)
            .limit(limit)
        )
        return [
            envelope_from_dict({**payload, "run_id": run_id, "seq": seq, "t": t, "kind": kind})
            for seq, t, kind, payload in self.session.connection().execute(query)
        ]

    def iter_envelopes(self, run_id: str, chunk: int = 10_000) -> Iterator[Envelope]:
        """Every stored event of the run, in seq order, as the envelopes the runtime emitted, read
        `chunk` at a time (a long run's whole stream is never held at once)."""
        since = -1
        while True:
            envelopes = self.envelopes(run_id, since=since, limit=chunk)
            yield from envelopes
            if len(envelopes) < chunk:
                return
            since = envelopes[-1].seq

    def load_envelopes(self, run_id: str, chunk: int = 10_000) -> builtins.list[Envelope]:
        return builtins.list(self.iter_envelopes(run_id, chunk))

    def gaps(self, run_id: str) -> int:
        """How many sequence numbers are missing between 0 and the last stored one."""
        last = self.last_seq(run_id)
        return 0 if last is None else last + 1 - self.count(run_id)


@dataclass(frozen=True)
class GroupAccount:
    """Every admitted group's outcome: open ones are in flight or ready, the others ended once."""

    admitted: int
    open: int
    delivered: int
    discarded: dict[str, int]


class GroupRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, run_id: str, group_id: int) -> Group | None:
        return self.session.get(Group, (run_id, group_id))

    def list(self, run_id: str, states: Iterable[GroupStatus] | None = None) -> Sequence[Group]:
        query = select(Group).where(Group.run_id == run_id)
        if states is not None:
            query = query.where(Group.state.in_([s.value for s in states]))
        return self.session.scalars(query.order_by(Group.group_id)).all()

    def next_group_id(self, run_id: str) -> int:
        """Where a resumed run's group ids continue: one past the largest stored."""
        last = self.session.scalar(select(func.max(Group.group_id)).where(Group.run_id == run_id))
        return 0 if last is None else last + 1

    def orphans(self, run_id: str) -> Sequence[Group]:
        """Groups admitted (or ready) with no terminal state: in flight when the control plane stopped."""
        return self.list(run_id, [GroupStatus.ADMITTED, GroupStatus.READY])

    def account(self, run_id: str) -> GroupAccount:
        rows = self.session.execute(
            select(Group.state, Group.reason, func.count())
            .where(Group.run_id == run_id)
            .group_by(Group.state, Group.reason)
        ).all()
        terminal = {s.value for s in TERMINAL_GROUP_STATES}
        discarded: dict[str, int] = {}
        delivered = opened = 0
        for state, reason, n in rows:
            if state == GroupStatus.DELIVERED.value:
                delivered += n
            elif state == GroupStatus.DISCARDED.value:
                discarded[reason or "unknown"] = discarded.get(reason or "unknown", 0) + n
            elif state not in terminal:
                opened += n
        return GroupAccount(delivered + opened + sum(discarded.values()), opened, delivered, discarded)

    def trajectories(self, run_id: str, group_id: int) -> Sequence[Trajectory]:
        query = select(Trajectory).where(Trajectory.run_id == run_id, Trajectory.group_id == group_id)
        return self.session.scalars(query.order_by(Trajectory.attempt)).all()

    def tasks(self, run_id: str) -> Sequence[Task]:
        return self.session.scalars(select(Task).where(Task.run_id == run_id).order_by(Task.task_index)).all()


class SpanRepo:
    """The timeline."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def list(
        self, run_id: str, since: int = -1, group_id: int | None = None, limit: int = 5000
    ) -> Sequence[Span]:
        """Spans projected from events with seq > `since`, in seq order, about `limit` of them: a page
        always holds every span of its last event, so the next page resumes at `since=<its last seq>`."""
        query = select(Span).where(Span.run_id == run_id)
        if group_id is not None:
            query = query.where(Span.group_id == group_id)
        page = list(
            self.session.scalars(query.where(Span.seq > since).order_by(Span.seq, Span.phase).limit(limit))
        )
        if len(page) == limit and page:
            last = page[-1]
            rest = query.where(Span.seq == last.seq, Span.phase > last.phase).order_by(Span.phase)
            page.extend(self.session.scalars(rest))
        return page


class BatchRepo:
    """Batches and their delivery to an external trainer: offered, then acked; at least once."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def get(self, run_id: str, batch_index: int) -> Batch | None:
        return self.session.get(Batch, (run_id, batch_index))

    def list(self, run_id: str) -> Sequence[Batch]:
        return self.session.scalars(
            select(Batch).where(Batch.run_id == run_id).order_by(Batch.batch_index)
        ).all()

    def next_to_offer(self, run_id: str, offer_timeout_s: float, now: datetime | None = None) -> Batch | None:
        """The oldest delivered, unacked batch never offered or offered more than `offer_timeout_s` ago."""
        now = now or utcnow()
        cutoff = now - timedelta(seconds=offer_timeout_s)
        query = (
            select(Batch)
            .where(Batch.run_id == run_id, Batch.delivered_at.is_not(None), Batch.acked_at.is_(None))
            .where((Batch.offered_at.is_(None)) | (Batch.offered_at <= cutoff))
            .order_by(Batch.batch_index)
            .limit(1)
        )
        return self.session.scalars(query).first()

    def mark_offered(self, run_id: str, batch_index: int, now: datetime | None = None) -> None:
        self.session.execute(
            update(Batch)
            .where(Batch.run_id == run_id, Batch.batch_index == batch_index)
            .values(offered_at=now or utcnow(), offer_count=Batch.offer_count + 1)
        )

    def ack(self, run_id: str, batch_index: int, now: datetime | None = None) -> bool:
        """Acknowledge a batch; True the first time, False for a repeated ack (which changes only the
        count). Raises `LookupError` for a batch that does not exist or was not delivered."""
        batch = self.get(run_id, batch_index)
        if batch is None or batch.delivered_at is None:
            raise LookupError(f"run {run_id!r} has no delivered batch {batch_index}")
        first = batch.acked_at is None
        if first:
            batch.acked_at = now or utcnow()
        batch.ack_count += 1
        self.session.flush()
        return first


class RolloutRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def create(self, run_id: str, version: int, path: str | None, actor: str, at: float) -> WeightRollout:
        """A rollout requested through the API, before the runtime's events about it arrive (the sink's
        `VersionPublished` then finds it by (run, version))."""
        rollout = WeightRollout(
            run_id=run_id, version=version, path=path, actor=actor, state="running", started_at=at
        )
        self.session.add(rollout)
        self.session.flush()
        return rollout

    def get(self, run_id: str, rollout_id: int) -> WeightRollout | None:
        rollout = self.session.get(WeightRollout, rollout_id)
        return rollout if rollout is not None and rollout.run_id == run_id else None

    def by_version(self, run_id: str, version: int) -> WeightRollout | None:
        query = select(WeightRollout).where(WeightRollout.run_id == run_id, WeightRollout.version == version)
        return self.session.scalars(query).first()

    def latest_version(self, run_id: str) -> int | None:
        return self.session.scalar(
            select(func.max(WeightRollout.version)).where(WeightRollout.run_id == run_id)
        )

    def list(self, run_id: str) -> Sequence[WeightRollout]:
        query = select(WeightRollout).where(WeightRollout.run_id == run_id)
        return self.session.scalars(query.order_by(WeightRollout.version)).all()

    def steps(self, rollout_id: int) -> Sequence[RolloutStep]:
        query = select(RolloutStep).where(RolloutStep.rollout_id == rollout_id)
        return self.session.scalars(query.order_by(RolloutStep.started_at, RolloutStep.engine)).all()


class EngineRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def register(self, run_id: str, name: str, url: str | None, state: str = "serving") -> Engine:
        engine = self.session.get(Engine, (run_id, name))
        if engine is None:
            engine = Engine(run_id=run_id, name=name, url=url, state=state, weight_version=0)
            self.session.add(engine)
        else:
            engine.url, engine.state = url, state
        self.session.flush()
        return engine

    def list(self, run_id: str) -> Sequence[Engine]:
        return self.session.scalars(select(Engine).where(Engine.run_id == run_id).order_by(Engine.name)).all()


class LaneRepo:
    def __init__(self, session: Session) -> None:
        self.session = session

    def set(self, run_id: str, name: str, cpus: str, slots: int) -> Lane:
        lane = self.session.get(Lane, (run_id, name))
        if lane is None:
            lane = Lane(run_id=run_id, name=name, cpus=cpus, slots=slots)
            self.session.add(lane)
        else:
            lane.cpus, lane.slots = cpus, slots
        self.session.flush()
        return lane

    def list(self, run_id: str) -> Sequence[Lane]:
        return self.session.scalars(select(Lane).where(Lane.run_id == run_id).order_by(Lane.name)).all()


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes for `DateTime(timezone=True)`; they were stored as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
