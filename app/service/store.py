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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from sqlalchemy import func, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from app.core.events import Envelope, Ledger
from app.service.recorder import LiveView
from app.service.rollouts import RolloutLog, RolloutRow, StepRow, rollout_answer
from app.store.db import make_engine, make_sessionmaker
from app.store.migrate import upgrade_to_head
from app.store.models import TERMINAL_RUN_STATES, EventRow, RolloutStep, Run, RunState, WeightRollout
from app.store.repos import (
    BatchRepo,
    EngineRepo,
    EventRepo,
    GroupRepo,
    IllegalTransitionError,
    LaneRepo,
    RolloutRepo,
    RunRepo,
)
from app.store.sink import UNFINISHED_STEP, SqlEventSink, close_rollouts

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["IllegalTransitionError", "ResumePoint", "RunRecord", "ServiceStore"]


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
            created_at=run.created_at.timestamp(),
            started_at=run.started_at.timestamp() if run.started_at else None,
            ended_at=run.ended_at.timestamp() if run.ended_at else None,
            error=run.error,
        )


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
    def __init__(self, url: str, migrate: bool = True) -> None:
        self.url = url
        if migrate:
            upgrade_to_head(url)
        self.engine = make_engine(url)
        self._sessions = make_sessionmaker(self.engine)

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    def _write(self, fn: Callable[[Session], T], wait_s: float = 30.0) -> T:
        """Run `fn` in its own transaction. On SQLite, a transaction that read before writing can find
        the file locked by another writer (the event sink) and gets no busy wait: it is tried again."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                with self.session() as s:
                    return fn(s)
            except OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def event_sink(self) -> SqlEventSink:
        return SqlEventSink(self.engine)

    # -- runs ----------------------------------------------------------------------------------------

    def create_run(self, run_id: str, name: str, config: dict[str, Any], policy: dict[str, Any]) -> RunRecord:
        return self._write(lambda s: RunRecord.of(RunRepo(s).create(name, config, policy, run_id=run_id)))

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

    # -- events and groups ---------------------------------------------------------------------------

    def timeline(self, run_id: str, since: int, limit: int) -> list[dict[str, Any]]:
        with self.session() as s:
            rows = EventRepo(s).list(run_id, since=since, limit=limit)
            return [{"seq": r.seq, "t": r.t, "kind": r.kind, **dict(r.payload)} for r in rows]

    def ledger(self, run_id: str, *also: Callable[[Envelope], None]) -> tuple[Ledger, float]:
        """Every group's account from the stored stream alone (the store's projection aside), and the
        time of the last event. `also` are fed the stored stream too, in order."""
        ledger = Ledger()
        last_t = 0.0
        with self.session() as s:
            for env in EventRepo(s).load_envelopes(run_id):
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

    def resume_point(self, run_id: str) -> ResumePoint:
        view, book = LiveView(), RolloutLog()
        ledger, last_t = self.ledger(run_id, view.on_envelope, book.on_envelope)
        with self.session() as s:
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

    def mark_offered(self, run_id: str, batch_index: int) -> None:
        self._when_batch_stored(run_id, batch_index, lambda repo: repo.mark_offered(run_id, batch_index))

    def mark_acked(self, run_id: str, batch_index: int) -> None:
        self._when_batch_stored(run_id, batch_index, lambda repo: repo.ack(run_id, batch_index))

    def _when_batch_stored(self, run_id: str, batch_index: int, write: Any, wait_s: float = 10.0) -> None:
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

    def figures(self, run_id: str) -> dict[str, Any]:
        """What the store knows of a run's figures (those a run executing here counts in memory)."""
        with self.session() as s:
            account = GroupRepo(s).account(run_id)
            batches = [b for b in BatchRepo(s).list(run_id) if b.delivered_at is not None]
            engines = EngineRepo(s).list(run_id)
            version = RolloutRepo(s).latest_version(run_id) or 0
        offered = [b for b in batches if b.offered_at is not None]
        return {
            "batches": len(batches),
            "groups_admitted": account.admitted,
            "groups_delivered": account.delivered,
            "groups_discarded": dict(account.discarded),
            "groups_live": account.open,
            "trainer_version": version,
            "engine_versions": {e.name: e.weight_version for e in engines},
            "offered": len(offered),
            "redelivered": sum(max(b.offer_count - 1, 0) for b in offered),
            "acked": sum(1 for b in batches if b.acked_at is not None),
        }

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:  # a health check reports an unreachable database, it does not raise
            log.warning("database ping failed: %r", exc)
            return False
        return True

    def close(self) -> None:
        self.engine.dispose()
