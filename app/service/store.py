"""The run service's view of the store (app.store): the few unit-of-work operations the manager and
the API make, each its own transaction (the store's repositories never commit; these methods do).

Events do not go through here: the event bus hands them to the store's `SqlEventSink`.

Invariants:
- every method opens and closes its own session, so it can be called from any thread; writes that
  find SQLite locked by another writer are tried again;
- offers and acks of batches are mirrored into the `batches` table after the sink has stored the
  batch (a write that finds no row yet, or a locked SQLite file, is retried briefly).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from app.core.events import Envelope, Ledger
from app.service.recorder import LiveView
from app.service.rollouts import RolloutLog, RolloutRow, StepRow, rollout_answer
from app.store.db import OUTAGE_S, SQLITE_BUSY_TIMEOUT_S, make_engine, make_sessionmaker, sqlite_file
from app.store.migrate import upgrade_to_head
from app.store.models import (
    TERMINAL_RUN_STATES,
    Batch,
    EventRow,
    Instance,
    RolloutStep,
    Run,
    RunState,
    WeightRollout,
)
from app.store.repos import (
    BatchRepo,
    EngineRepo,
    EventRepo,
    GroupRepo,
    IllegalTransitionError,
    LaneRepo,
    RolloutRepo,
    RunRepo,
    as_utc,
)
from app.store.sink import UNFINISHED_STEP, SqlEventSink, close_rollouts

log = logging.getLogger(__name__)

T = TypeVar("T")

ENDED = tuple(state.value for state in TERMINAL_RUN_STATES)

__all__ = ["IllegalTransitionError", "ResumePoint", "RunLiveError", "RunRecord", "ServiceStore"]


class RunLiveError(RuntimeError):
    """The run has not ended (the store says so): nothing of it is deleted (the API answers 409)."""


@dataclass(frozen=True)
class RunRecord:
    """A run row as the service reads it."""

    id: str
    name: str
    state: str
    config: dict[str, Any]
    policy: dict[str, Any]
    created_at: float
    started_at: float | None
    ended_at: float | None
    error: str | None

    @classmethod
    def of(cls, run: Run) -> RunRecord:
        return cls(
            id=run.id,
            name=run.name,
            state=run.state,
            config=dict(run.config or {}),
            policy=dict(run.policy or {}),
            # as UTC: SQLite's naive datetimes read as local time were off by the zone's offset
            created_at=_unix(run.created_at),
            started_at=_unix(run.started_at) if run.started_at else None,
            ended_at=_unix(run.ended_at) if run.ended_at else None,
            error=run.error,
        )


def _unix(value: datetime) -> float:
    utc = as_utc(value)
    assert utc is not None
    return utc.timestamp()


# How long an offer or ack mark waits for its batch's row (the event sink writes it, maybe later)
BATCH_ROW_WAIT_S = 10.0


@dataclass(frozen=True)
class TrainerFigures:
    """A stored run's trainer figures on its own clock (`ServiceStore.trainer_figures`)."""

    batches: int  # delivered
    trainer_wait_s: float  # the delivered batches' collection times, summed
    requested_at: float | None  # a request for a batch after the last delivered, never delivered
    first_t: float | None  # the run's first stored event (None: no event stored)
    last_t: float | None  # and its last


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: its next event, group and batch numbers and its policy version."""

    next_seq: int
    group_offset: int
    batch_offset: int
    version: int
    weights_path: str | None
    open_groups: frozenset[int]
    last_t: float  # where the run's clock had got to
    # The stored policy: what it was created with, and every knob changed live since (`resumed_policy`)
    policy: dict[str, Any] = field(default_factory=dict, compare=False)
    delivered_batches: frozenset[int] = frozenset()  # the batches whose delivery the store holds
    # The stored stream replayed: the resumed run's live view and rollouts go on from these.
    view: LiveView = field(default_factory=LiveView, compare=False)
    rollouts: RolloutLog = field(default_factory=RolloutLog, compare=False)


class ServiceStore:
    def __init__(
        self,
        url: str,
        migrate: bool = True,
        outage_s: float = OUTAGE_S,
        busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S,
    ) -> None:
        """`outage_s`: how long its writers wait out a database that is away (`through_outage`);
        `busy_timeout_s`: how long a SQLite transaction waits for another writer's lock."""
        self.url = url
        self.outage_s = outage_s
        self.busy_timeout_s = busy_timeout_s
        if migrate:
            upgrade_to_head(url)
        self.engine = make_engine(url, busy_timeout_s=busy_timeout_s)
        self._sessions = make_sessionmaker(self.engine)
        # On SQLite, for reads that take long (a run's stored stream replayed as it is resumed) and for
        # the health check: a transaction begun IMMEDIATE holds the write lock, so a replay held the
        # resumed runs' event sinks and /healthz for as long as it took. A deferred one reads a snapshot.
        on_file = self.engine.name == "sqlite" and sqlite_file(self.engine.url) is not None
        # (one in-memory database has no reader of its own)
        self._reader = make_engine(url, "DEFERRED", busy_timeout_s) if on_file else None
        self._read_sessions = make_sessionmaker(self._reader or self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A session that only reads: on SQLite it never holds, nor waits for, the write lock."""
        with self._read_sessions() as session, session.begin():
            yield session

    def _write(self, fn: Callable[[Session], T], wait_s: float | None = None) -> T:
        """Run `fn` in its own transaction. On SQLite, a transaction that read before writing can find
        the file locked by another writer (the event sink) and gets no busy wait: it is tried again, for
        `wait_s` at most (default: the busy timeout, which a writer waits for the lock; before, 30 s
        whatever the busy timeout, so a request on a locked database took 30 s to answer 503)."""
        deadline = time.monotonic() + (self.busy_timeout_s if wait_s is None else wait_s)
        while True:
            try:
                with self.session() as s:
                    return fn(s)
            except OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def event_sink(self) -> SqlEventSink:
        return SqlEventSink(self.engine, self.outage_s)

    # -- runs ----------------------------------------------------------------------------------------

    def create_run(self, run_id: str, name: str, config: dict[str, Any], policy: dict[str, Any]) -> RunRecord:
        return self._write(lambda s: RunRecord.of(RunRepo(s).create(name, config, policy, run_id=run_id)))

    def instance_id(self, create: bool = True) -> str | None:
        """This database's own random id: what run directories' tombstones name. Made when first asked
        for, unless `create` is False (None then); two processes asking at once get the same one (the
        table holds one row, key 1: the second insert fails, and reads the first's)."""
        with self.session() as s:
            found = s.scalars(select(Instance.id)).first()
        if found is not None or not create:
            return found

        def write(s: Session) -> str:
            made = uuid.uuid4().hex
            s.add(Instance(key=1, id=made))
            return made

        try:
            return self._write(write)
        except IntegrityError:  # another process's, made meanwhile
            with self.session() as s:
                return s.scalars(select(Instance.id)).one()

    def get_run(self, run_id: str) -> RunRecord | None:
        with self.session() as s:
            run = RunRepo(s).get(run_id)
            return None if run is None else RunRecord.of(run)

    def list_runs(self, limit: int = 100) -> list[RunRecord]:
        with self.session() as s:
            return [RunRecord.of(r) for r in RunRepo(s).list(limit=limit)]

    def unfinished_runs(self) -> list[RunRecord]:
        with self.session() as s:
            return [RunRecord.of(r) for r in RunRepo(s).unfinished()]

    def created_runs(self) -> list[RunRecord]:
        with self.session() as s:
            return [RunRecord.of(r) for r in RunRepo(s).created()]

    def close_ended_rollouts(self) -> list[str]:
        """Close the rollouts that outlived their ended run as `running` (a store written before the
        sink closed them at `run_ended`, or a run whose last events never reached it), as the sink
        does, at the run's last stored event (`app.store.sink.close_rollouts`). The runs closed."""

        def write(s: Session) -> list[str]:
            ended = [state.value for state in TERMINAL_RUN_STATES]
            running = select(WeightRollout.run_id).where(WeightRollout.state == "running")
            unfinished = (
                select(WeightRollout.run_id)
                .join(RolloutStep, RolloutStep.rollout_id == WeightRollout.id)
                .where(RolloutStep.state.in_(UNFINISHED_STEP))
            )
            query = select(Run.id).where(Run.state.in_(ended), Run.id.in_(running.union(unfinished)))
            run_ids = list(s.scalars(query))
            for run_id in run_ids:
                last = s.scalar(select(func.max(EventRow.t)).where(EventRow.run_id == run_id))
                close_rollouts(s.connection(), run_id, last)
            return run_ids

        return self._write(write)

    def set_state(
        self, run_id: str, state: RunState, error: str | None = None, at: float | None = None
    ) -> RunRecord:
        """Write the run's new state, which it took at `at` (a Unix time; default now); returns the
        row as stored (its end may have been written first by the event sink, at its own time)."""
        when = None if at is None else datetime.fromtimestamp(at, UTC)
        return self._write(lambda s: RunRecord.of(RunRepo(s).set_state(run_id, state, error, when)))

    def set_policy(self, run_id: str, policy: dict[str, Any]) -> None:
        """Write changed knobs over the stored policy: it keeps every field it was created with."""

        def write(s: Session) -> None:
            run = RunRepo(s).require(run_id)
            run.policy = {**(run.policy or {}), **policy}

        self._write(write)

    def set_lanes(self, run_id: str, lanes: Mapping[str, tuple[str, int]]) -> None:
        """Store each lane's CPU set and configured slots (`described_lanes`), over what was stored."""

        def write(s: Session) -> None:
            repo = LaneRepo(s)
            for name, (cpus, slots) in lanes.items():
                repo.set(run_id, name, cpus, slots)

        self._write(write)

    # -- retention -----------------------------------------------------------------------------------

    def delete_run(self, run_id: str) -> bool:
        """Delete an ended run and everything stored for it (its events, spans, groups, trajectories,
        batches, engines, rollouts, lanes, policy changes), in one transaction: False when there is no
        such run; `RunLiveError`, and nothing deleted, when its stored state is not an end state. The
        row is locked first (Postgres: `FOR UPDATE`), so a state written meanwhile waits for the
        deletion or is refused by it."""

        def write(s: Session) -> bool:
            run = s.scalars(select(Run).where(Run.id == run_id).with_for_update()).one_or_none()
            if run is None:
                return False
            if run.state not in ENDED:
                raise RunLiveError(
                    f"run {run_id!r} is {run.state}; only an ended run (stopped, completed, failed) can "
                    "be deleted: stop it and wait until it has ended"
                )
            return RunRepo(s).delete(run_id)

        return self._write(write)

    def ended_runs(self, before: datetime) -> list[RunRecord]:
        """The runs that ended before `before` (a wall-clock time), oldest first."""
        with self.session() as s:
            query = (
                select(Run)
                .where(Run.state.in_(ENDED), Run.ended_at.is_not(None), Run.ended_at < before)
                .order_by(Run.ended_at, Run.id)
            )
            return [RunRecord.of(r) for r in s.scalars(query)]

    # -- events and groups ---------------------------------------------------------------------------

    def timeline(self, run_id: str, since: int, limit: int) -> list[dict[str, Any]]:
        with self.session() as s:
            rows = EventRepo(s).list(run_id, since=since, limit=limit)
            return [{"seq": r.seq, "t": r.t, "kind": r.kind, **dict(r.payload)} for r in rows]

    def envelopes(self, run_id: str, since: int, limit: int) -> list[Envelope]:
        """Up to `limit` of the run's events after sequence number `since`, in order, as envelopes: the
        dashboard's catch-up with a stored stream."""
        with self.session() as s:
            return EventRepo(s).envelopes(run_id, since, limit)

    def last_seq(self, run_id: str) -> int | None:
        """The run's newest stored event's sequence number (a lookup by key), None with none stored."""
        with self.session() as s:
            return EventRepo(s).last_seq(run_id)

    def ledger(self, run_id: str, *also: Callable[[Envelope], None]) -> tuple[Ledger, float]:
        """Every group's account from the stored stream alone (the store's projection aside), and the
        time of the last event. `also` are fed the stored stream too, in order."""
        ledger = Ledger()
        last_t = 0.0
        with self.read_session() as s:
            for env in EventRepo(s).iter_envelopes(run_id):
                ledger.on_envelope(env)
                for fn in also:
                    fn(env)
                last_t = max(last_t, env.t)
        return ledger, last_t

    def group_account(self, run_id: str) -> dict[str, Any]:
        """Admitted, open, delivered and discarded (by reason) groups, from the store's projection."""
        with self.session() as s:
            account = GroupRepo(s).account(run_id)
        return {"admitted": account.admitted, "open": account.open, "delivered": account.delivered,
                "discarded": dict(account.discarded)}  # fmt: skip

    def event_gaps(self, run_id: str) -> int:
        """How many sequence numbers the run's stored stream misses below its last one."""
        with self.read_session() as s:
            return EventRepo(s).gaps(run_id)

    def resume_point(self, run_id: str, *also: Callable[[Envelope], None]) -> ResumePoint:
        """Where the run goes on from, from its stored stream replayed (`also` are fed it too)."""
        view, book = LiveView(), RolloutLog()
        ledger, last_t = self.ledger(run_id, view.on_envelope, book.on_envelope, *also)
        with self.read_session() as s:
            next_seq = EventRepo(s).next_seq(run_id)
            orphans = {g.group_id for g in GroupRepo(s).orphans(run_id)}
            batches = BatchRepo(s).list(run_id)
            rollouts = RolloutRepo(s)
            version = rollouts.latest_version(run_id) or 0
            latest = rollouts.by_version(run_id, version) if version else None
            path = latest.path if latest is not None else None
            policy = dict(RunRepo(s).require(run_id).policy or {})
        seen = ledger.admitted | set(ledger.ended)
        return ResumePoint(
            next_seq=next_seq,
            group_offset=max(seen, default=-1) + 1,
            # After the last batch delivered, not the last requested: a batch being collected at the
            # crash has a row (its request) and no delivery; counting it skipped its index for good.
            batch_offset=max((b.batch_index for b in batches if b.delivered_at is not None), default=-1) + 1,
            version=version,
            weights_path=path,
            open_groups=frozenset(ledger.open_groups | orphans),
            last_t=last_t,
            policy=policy,
            delivered_batches=frozenset(b.batch_index for b in batches if b.delivered_at is not None),
            view=view,
            rollouts=book,
        )

    # -- batches offered to an external trainer ------------------------------------------------------

    def mark_offered(self, run_id: str, batch_index: int, wait_s: float = BATCH_ROW_WAIT_S) -> None:
        self._when_batch_stored(
            run_id, batch_index, lambda repo: repo.mark_offered(run_id, batch_index), wait_s
        )

    def mark_acked(self, run_id: str, batch_index: int, wait_s: float = BATCH_ROW_WAIT_S) -> None:
        self._when_batch_stored(run_id, batch_index, lambda repo: repo.ack(run_id, batch_index), wait_s)

    def mark_batches(self, marks: Sequence[tuple[str, str, int, int]]) -> list[bool]:
        """Mirror many offers and acks, `(kind, run_id, batch_index, count)` with kind `offered`, `acked`
        or `restored` (a kept offer at a restart: its offer count becomes at least `count`, the hand-outs
        its kept file counted), in one transaction and in order: for each, whether it was written (False:
        the sink has not stored that batch's delivery yet; ask again). One transaction for all: on SQLite
        each waits for the file's one writer, which the event sink holds most of the time under a busy
        run."""

        def write(s: Session) -> list[bool]:
            repo = BatchRepo(s)
            done = []
            for kind, run_id, index, count in marks:
                batch = repo.get(run_id, index)
                if batch is None or batch.delivered_at is None:
                    done.append(False)
                    continue
                if kind == "acked":
                    repo.ack(run_id, index)
                elif kind == "restored":
                    if batch.offer_count < count:
                        batch.offer_count = count
                        batch.offered_at = batch.offered_at or datetime.now(UTC)
                else:
                    repo.mark_offered(run_id, index)
                done.append(True)
            return done

        return self._write(write) if marks else []

    def _when_batch_stored(
        self, run_id: str, batch_index: int, write: Any, wait_s: float = BATCH_ROW_WAIT_S
    ) -> None:
        """`write` once the batch's delivery is stored (the event sink writes it), waiting `wait_s` at
        most for it (0: one look); given up with a warning after that."""
        deadline = time.monotonic() + wait_s

        def attempt(s: Session) -> bool:
            repo = BatchRepo(s)
            batch = repo.get(run_id, batch_index)
            if batch is None or batch.delivered_at is None:
                return False
            write(repo)
            return True

        while True:
            if self._write(attempt):
                return
            if time.monotonic() > deadline:
                log.warning("batch %s/%d never reached the store; its offer/ack is not mirrored", run_id,
                            batch_index)  # fmt: skip
                return
            time.sleep(0.1)

    # -- rollouts ------------------------------------------------------------------------------------

    def rollout(self, run_id: str, version: int) -> dict[str, Any] | None:
        """A rollout as the store has it, in the same shape as a live run's (`rollout_answer`)."""
        with self.session() as s:
            repo = RolloutRepo(s)
            rollout = repo.by_version(run_id, version)
            run = RunRepo(s).get(run_id)
            if rollout is None or run is None:
                return None
            later = s.execute(
                select(WeightRollout.version, RolloutStep)
                .join(RolloutStep, RolloutStep.rollout_id == WeightRollout.id)
                .where(WeightRollout.run_id == run_id, WeightRollout.version >= version)
            ).all()
            steps = [StepRow(v, st.engine, st.state, st.started_at, st.ended_at, st.error) for v, st in later]
            engines = EngineRepo(s).list(run_id)
            first = EventRepo(s).list(run_id, since=-1, limit=1)
            row = RolloutRow(rollout.version, rollout.path, rollout.actor, rollout.state, rollout.started_at,
                             rollout.ended_at)  # fmt: skip
            return rollout_answer(
                row,
                newest=repo.latest_version(run_id) or version,
                engines=[e.name for e in engines],
                served={e.name: e.weight_version for e in engines},
                steps=steps,
                updating={},
                t0=first[0].t if first else None,
                knobs=dict(run.policy or {}),
                run_ended=run.state in TERMINAL_RUN_STATES,
            )

    # -- an ended run's account ------------------------------------------------------------------------

    def ack_batch(self, run_id: str, batch_id: str) -> bool | None:
        """Acknowledge a delivered batch in the store alone (its run is not executing here, or a
        predecessor of it handed the batch out): whether it had been acked already; None when the run
        has no such delivered batch."""
        digits = batch_id.removeprefix(f"{run_id}-b")
        if digits == batch_id or not (digits.isascii() and digits.isdigit()) or len(digits) > 12:
            return None  # not an id this run gave out
        index = int(digits)

        def write(s: Session) -> bool | None:
            repo = BatchRepo(s)
            batch = repo.get(run_id, index)
            if batch is None or batch.delivered_at is None:
                return None
            if batch.acked_at is not None:
                return True  # as a live run: a repeated ack changes nothing
            repo.ack(run_id, index)
            return False

        return self._write(write)

    def acked_batches(self, run_id: str) -> set[int]:
        """The indexes of the run's batches whose ack the store holds."""
        with self.session() as s:
            return {b.batch_index for b in BatchRepo(s).list(run_id) if b.acked_at is not None}

    def figures(self, run_id: str, kept: Mapping[int, int] | None = None) -> dict[str, Any]:
        """What the store knows of a run's figures (those a run executing here counts in memory).
        `kept`: batch index -> hand-outs, of the offers a resumed run kept on disk, which count where the
        store has fewer (a kill -9 before the store had them)."""
        with self.session() as s:
            account = GroupRepo(s).account(run_id)
            batches = [b for b in BatchRepo(s).list(run_id) if b.delivered_at is not None]
            engines = EngineRepo(s).list(run_id)
            version = RolloutRepo(s).latest_version(run_id) or 0
        offers = {b.batch_index: b.offer_count for b in batches if b.offered_at is not None}
        for index, handed_out in (kept or {}).items():
            offers[index] = max(offers.get(index, 0), handed_out, 1)
        return {
            "batches": len(batches),
            "groups_admitted": account.admitted,
            "groups_delivered": account.delivered,
            "groups_discarded": dict(account.discarded),
            "groups_live": account.open,
            "trainer_version": version,
            "engine_versions": {e.name: e.weight_version for e in engines},
            "offered": len(offers),
            "redelivered": sum(max(count - 1, 0) for count in offers.values()),
            "acked": sum(1 for b in batches if b.acked_at is not None),
        }

    def trainer_figures(self, run_id: str) -> TrainerFigures:
        """A run's trainer figures for the dashboard's runs list, from the `batches` projection and the
        run's first and last stored events (two lookups by the events' key: the stream is not read)."""
        with self.session() as s:
            delivered = (Batch.run_id == run_id) & Batch.delivered_at.is_not(None)
            count, waited, last_index = s.execute(
                select(
                    func.count(),
                    func.coalesce(func.sum(Batch.delivered_at - Batch.requested_at), 0.0),
                    func.max(Batch.batch_index),
                ).where(delivered)
            ).one()
            # the open request: asked for after the last batch delivered, and not delivered
            asked = select(Batch.requested_at).where(
                Batch.run_id == run_id, Batch.delivered_at.is_(None), Batch.requested_at.is_not(None)
            )
            if last_index is not None:
                asked = asked.where(Batch.batch_index > last_index)
            requested = s.scalar(asked.order_by(Batch.batch_index.desc()).limit(1))
            events = select(EventRow.t).where(EventRow.run_id == run_id).limit(1)
            first = s.scalar(events.order_by(EventRow.seq))
            last = s.scalar(events.order_by(EventRow.seq.desc()))
        return TrainerFigures(int(count), float(waited or 0.0), requested, first, last)

    def ping(self) -> bool:
        try:
            with (self._reader or self.engine).connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # a health check reports an unreachable database, it does not raise
            log.warning("database ping failed: %r", exc)
            return False
        return True

    def close(self) -> None:
        self.engine.dispose()
        if self._reader is not None:
            self._reader.dispose()
