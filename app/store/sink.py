"""The store's event sink: writes the typed event stream into the database, one transaction per batch.

`SqlEventSink.write_batch(envelopes)` is the bus sink protocol. Each batch is one transaction: the raw
events go to `events` in one bulk insert, and the new ones are projected into `groups`, `trajectories`,
`spans`, `tasks`, `batches`, `engines`, `weight_rollouts`/`rollout_steps`, `policy_changes` and `runs`
by bulk upserts, one statement per table, never a statement (or a commit) per timeline event.

Invariants:
- at-least-once in, exactly once stored: an envelope whose (run_id, seq) is already stored is skipped,
  events and projections alike, so a sink that re-delivers a batch changes nothing;
- a group's terminal account (delivered with batch and staleness, or discarded with reason and detail)
  is written once; a later terminal event for the same group stays in `events` but does not rewrite it;
- an event whose predecessors never arrived still lands (projected rows are upserts, with no foreign keys
  between projected tables), and a run row is created for an unknown run id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Connection, Engine, Table, and_, case, func, literal_column, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import Insert

from app.core.events import (
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    PolicyChanged,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
)
from app.store.db import OUTAGE_S, is_outage, through_outage
from app.store.models import (
    TERMINAL_GROUP_STATES,
    TERMINAL_RUN_STATES,
    Batch,
    EventRow,
    Group,
    GroupStatus,
    PolicyChange,
    RolloutStep,
    Run,
    RunState,
    Span,
    SpanPhase,
    Task,
    Trajectory,
    WeightRollout,
)
from app.store.models import (
    Engine as EngineRow,
)

SPAN_COLUMNS = ("run_id", "seq", "group_id", "attempt", "phase", "engine", "lane", "version", "start", "end",
                "tokens", "ok")  # fmt: skip
_TURN, _ENGINE_QUEUE, _LANE_QUEUE = (
    SpanPhase.TURN.value,
    SpanPhase.ENGINE_QUEUE.value,
    SpanPhase.LANE_QUEUE.value,
)
LANE_PHASE = {
    "reset": SpanPhase.RESET,
    "exec": SpanPhase.TOOL,
    "validate": SpanPhase.VALIDATE,
    "cleanup": SpanPhase.CLEANUP,
}
OUT_OF_ROTATION = ("unhealthy", "stopped")  # engine states a rollout does not wait for
RUN_ENDED = "run ended"  # why a step still under way when its run ended was cancelled
UNFINISHED_STEP = ("pending", "updating")
RUN_END_STATE = {
    "completed": RunState.COMPLETED,
    "duration": RunState.COMPLETED,
    "stopped": RunState.STOPPED,
    "error": RunState.FAILED,
}
GROUP_COLUMNS = (
    "task_index",
    "group_size",
    "admitted_at",
    "ready_at",
    "ended_at",
    "reason",
    "detail",
    "batch_index",
    "staleness",
)
_TERMINAL = tuple(s.value for s in TERMINAL_GROUP_STATES)

events_t = cast(Table, EventRow.__table__)
groups_t = cast(Table, Group.__table__)
trajectories_t = cast(Table, Trajectory.__table__)
spans_t = cast(Table, Span.__table__)
tasks_t = cast(Table, Task.__table__)
batches_t = cast(Table, Batch.__table__)
engines_t = cast(Table, EngineRow.__table__)
rollouts_t = cast(Table, WeightRollout.__table__)
steps_t = cast(Table, RolloutStep.__table__)
policy_t = cast(Table, PolicyChange.__table__)
runs_t = cast(Table, Run.__table__)


def insert_for(conn: Connection, table: Any) -> Any:
    """The dialect's INSERT, which has `on_conflict_do_nothing` / `on_conflict_do_update`."""
    name = conn.dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"database dialect {name!r} is not supported (use sqlite or postgresql)")


_FIELDS: dict[type[Event], tuple[str, ...]] = {}
to_json = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode  # strict JSON, as to_dict


def event_payload(event: Event) -> dict[str, Any]:
    """`Envelope.to_dict()` without the envelope's own keys (tuples as lists), at a fraction of its
    cost: the field names are looked up once per event class. Non-finite numbers are refused when the
    payload is serialised (`allow_nan=False`)."""
    names = _FIELDS.get(type(event))
    if names is None:
        names = _FIELDS[type(event)] = tuple(f.name for f in dataclasses.fields(event))
    payload = {}
    for name in names:
        value = getattr(event, name)
        payload[name] = list(value) if isinstance(value, tuple) else value
    return payload


def payload_json(env: Envelope, payload: dict[str, Any]) -> str:
    """The payload as strict JSON; a non-finite number (or time) raises naming its field."""
    try:
        if not math.isfinite(env.t):
            raise ValueError
        return to_json(payload)
    except ValueError:
        env.to_dict()  # raises naming the event and the non-finite field
        raise


# -- the fold: a batch of new events as one row per projected key -----------------------------------


@dataclass
class Projection:
    """What a batch of new events changes, one row per key, so each table takes one bulk upsert
    (Postgres refuses an upsert that touches the same row twice in one statement)."""

    tasks: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    groups: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    trajectories: dict[tuple[str, int, int], dict[str, Any]] = field(default_factory=dict)
    spans: list[tuple[Any, ...]] = field(default_factory=list)  # in SPAN_COLUMNS order
    batches: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    engine_states: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    engines_left: dict[str, float] = field(default_factory=dict)  # run -> when an engine left rotation
    rare: list[Envelope] = field(default_factory=list)  # rollouts, policy and run lifecycle: in order

    def add(self, env: Envelope) -> None:
        ev, run, t = env.event, env.run_id, env.t
        if isinstance(ev, TurnDone):
            self._turn(env, ev)
        elif isinstance(ev, SandboxOp):
            self._sandbox_op(env, ev)
        elif isinstance(ev, GroupAdmitted):
            self.tasks.setdefault((run, ev.task_index), {"run_id": run, "task_index": ev.task_index,
                                                         "name": ev.task})  # fmt: skip
            row = self._group(run, ev.group_id)
            row.update(task_index=ev.task_index, group_size=ev.group_size, admitted_at=t)
            if row["state"] is None:
                row["state"] = GroupStatus.ADMITTED.value
        elif isinstance(ev, GroupReady):
            row = self._group(run, ev.group_id)
            row["ready_at"] = t
            if row["state"] not in _TERMINAL:
                row["state"] = GroupStatus.READY.value
        elif isinstance(ev, GroupDelivered | GroupDiscarded):
            self._group_end(run, t, ev)
        elif isinstance(ev, AttemptStarted):
            row = self._trajectory(run, ev.group_id, ev.attempt)
            if row["started_at"] is None:
                row["started_at"] = t
        elif isinstance(ev, AttemptFinished):
            row = self._trajectory(run, ev.group_id, ev.attempt)
            row.update(finished_at=t, reward=ev.reward, error=ev.error)
        elif isinstance(ev, AttemptRestarted):
            self._trajectory(run, ev.group_id, ev.attempt)["restarts"] += 1
        elif ev.kind == "attempt_cancelled":  # its group was discarded while the try ran
            cancelled: Any = ev
            row = self._trajectory(run, cancelled.group_id, cancelled.attempt)
            row.update(finished_at=t, cancel_reason=cancelled.reason or "cancelled")
        elif isinstance(ev, BatchRequested):
            self._batch(run, ev.batch_index)["requested_at"] = t
        elif isinstance(ev, BatchDelivered):
            self._batch(run, ev.batch_index).update(
                group_ids=list(ev.group_ids),
                trainer_version=ev.trainer_version,
                requested_at=ev.requested_at,
                ready_at=ev.ready_at,
                delivered_at=t,
            )
        elif isinstance(ev, EngineStateChanged):
            self.engine_states[(run, ev.engine)] = {
                "run_id": run, "name": ev.engine, "state": ev.state, "detail": ev.detail or None,
            }  # fmt: skip
            if ev.state in OUT_OF_ROTATION:
                self.engines_left[run] = t
        elif isinstance(
            ev, VersionPublished | EngineUpdateBegin | EngineUpdateEnd | PolicyChanged | RunStarted | RunEnded
        ):
            self.rare.append(env)

    # spans are tuples in SPAN_COLUMNS order: run_id, seq, group_id, attempt, phase, engine, lane,
    # version, start, end, tokens, ok (the COPY row as is)
    def _turn(self, env: Envelope, ev: TurnDone) -> None:
        run, seq, g, a = env.run_id, env.seq, ev.group_id, ev.attempt
        if ev.start > ev.queued_at:
            self.spans.append((run, seq, g, a, _ENGINE_QUEUE, ev.engine, None, ev.version, ev.queued_at,
                               ev.start, None, True))  # fmt: skip
        self.spans.append((run, seq, g, a, _TURN, ev.engine, None, ev.version, ev.start, ev.end, ev.tokens,
                           ev.error is None))  # fmt: skip
        row = self._trajectory(run, g, a)
        row["turns"] += 1
        row["tokens"] += ev.tokens

    def _sandbox_op(self, env: Envelope, ev: SandboxOp) -> None:
        phase = LANE_PHASE.get(ev.lane)
        if phase is None:
            raise ValueError(f"sandbox_op seq {env.seq}: unknown lane {ev.lane!r}")
        run, seq, g, a = env.run_id, env.seq, ev.group_id, ev.attempt
        if ev.start > ev.queued_at:
            self.spans.append((run, seq, g, a, _LANE_QUEUE, None, ev.lane, None, ev.queued_at, ev.start, None,
                               True))  # fmt: skip
        self.spans.append((run, seq, g, a, phase.value, None, ev.lane, None, ev.start, ev.end, None, ev.ok))

    def _group(self, run: str, group_id: int) -> dict[str, Any]:
        key = (run, group_id)
        row = self.groups.get(key)
        if row is None:
            row = {"run_id": run, "group_id": group_id, "state": None, **dict.fromkeys(GROUP_COLUMNS)}
            self.groups[key] = row
        return row

    def _group_end(self, run: str, t: float, ev: GroupDelivered | GroupDiscarded) -> None:
        row = self._group(run, ev.group_id)
        if row["state"] in _TERMINAL:
            return  # ended twice: the first ending stands (the second stays in `events`)
        row["ended_at"] = t
        if isinstance(ev, GroupDelivered):
            row.update(state=GroupStatus.DELIVERED.value, batch_index=ev.batch_index, staleness=ev.staleness)
        else:
            row.update(state=GroupStatus.DISCARDED.value, reason=ev.reason, detail=ev.detail or None)

    def _trajectory(self, run: str, group_id: int, attempt: int) -> dict[str, Any]:
        key = (run, group_id, attempt)
        row = self.trajectories.get(key)
        if row is None:
            row = {"run_id": run, "group_id": group_id, "attempt": attempt, "reward": None, "error": None,
                   "cancel_reason": None, "restarts": 0, "turns": 0, "tokens": 0, "started_at": None,
                   "finished_at": None}  # fmt: skip
            self.trajectories[key] = row
        return row

    def _batch(self, run: str, index: int) -> dict[str, Any]:
        key = (run, index)
        row = self.batches.get(key)
        if row is None:
            row = {"run_id": run, "batch_index": index, "group_ids": None, "trainer_version": None,
                   "requested_at": None, "ready_at": None, "delivered_at": None}  # fmt: skip
            self.batches[key] = row
        return row


# -- writing -----------------------------------------------------------------------------------------


def ingest(conn: Connection, envelopes: Sequence[Envelope]) -> int:
    """Store `envelopes` and project the new ones on `conn` (the caller's transaction); returns how
    many were new. Envelopes already stored, or repeated within the batch, are skipped.

    The batch first locks out other writers of its runs (Postgres: the run's advisory lock; SQLite:
    transactions begin IMMEDIATE, one writer at a time) and reads which of its seqs are stored; only
    the others are inserted, in bulk and with no conflict handling per row (Postgres: binary COPY, which
    costs the server no SQL parsing and no text-to-number conversion per row; SQLite: one executemany),
    and only they are projected."""
    unique: dict[tuple[str, int], Envelope] = {}
    for env in envelopes:
        unique.setdefault((env.run_id, env.seq), env)
    if not unique:
        return 0
    pg = conn.dialect.name == "postgresql"
    stored = _stored_seqs(conn, unique, lock=pg)
    new = sorted((key, env) for key, env in unique.items() if key not in stored)
    if not new:
        return 0
    _ensure_runs(conn, {run for run, _ in unique})
    rows = [(e.run_id, e.seq, e.t, e.kind, payload_json(e, event_payload(e.event))) for _, e in new]
    if pg:
        wire = ((*row[:4], JSONB_V1 + row[4].encode()) for row in rows)
        _pg_copy(conn, "events", EVENT_COLUMNS, EVENT_WIRE, wire)
    else:
        conn.exec_driver_sql(_insert_sql("events", EVENT_COLUMNS), rows)
    projection = Projection()
    for _, env in new:
        projection.add(env)
    write_projection(conn, projection)
    return len(new)


def _stored_seqs(
    conn: Connection, unique: dict[tuple[str, int], Envelope], lock: bool
) -> set[tuple[str, int]]:
    seqs: dict[str, list[int]] = {}
    for run, seq in unique:
        seqs.setdefault(run, []).append(seq)
    stored: set[tuple[str, int]] = set()
    for run in sorted(seqs):
        if lock:  # two sinks writing one run take turns
            conn.execute(select(func.pg_advisory_xact_lock(func.hashtextextended(run, 0))))
        low, high = min(seqs[run]), max(seqs[run])
        found = conn.execute(
            select(events_t.c.seq).where(events_t.c.run_id == run, events_t.c.seq.between(low, high))
        ).scalars()
        stored.update((run, seq) for seq in found)
    return stored


EVENT_COLUMNS = ("run_id", "seq", "t", "kind", "payload")
# the wire types psycopg's binary COPY dumps each column as; `payload` goes as jsonb's binary form
# (version byte 1, then the JSON text), so it is handed over as bytes
EVENT_WIRE = ("text", "int8", "float8", "text", "bytea")
SPAN_WIRE = (
    "text",
    "int8",
    "int4",
    "int4",
    "text",
    "text",
    "text",
    "int4",
    "float8",
    "float8",
    "int4",
    "bool",
)
JSONB_V1 = b"\x01"


def _insert_sql(table: str, columns: Sequence[str]) -> str:
    names = ", ".join(f'"{c}"' for c in columns)
    return f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' for _ in columns)})"


def _pg_copy(
    conn: Connection, table: str, columns: Sequence[str], wire: Sequence[str], rows: Iterable[Sequence[Any]]
) -> None:
    """Binary COPY of `rows` into `table`, on the connection's own transaction."""
    raw: Any = conn.connection.driver_connection
    names = ", ".join(f'"{c}"' for c in columns)
    with raw.cursor() as cursor, cursor.copy(f"COPY {table} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(list(wire))
        for row in rows:
            copy.write_row(row)


def _ensure_runs(conn: Connection, run_ids: set[str]) -> None:
    rows = [{"id": r, "name": r, "state": RunState.RUNNING.value, "config": {}, "policy": {},
             "created_at": datetime.now(UTC)} for r in sorted(run_ids)]  # fmt: skip
    conn.execute(insert_for(conn, runs_t).on_conflict_do_nothing(index_elements=["id"]), rows)


def write_projection(conn: Connection, p: Projection) -> None:
    if p.tasks:
        stmt = insert_for(conn, tasks_t).on_conflict_do_nothing(index_elements=["run_id", "task_index"])
        conn.execute(stmt, list(p.tasks.values()))
    if p.groups:
        _upsert_groups(conn, list(p.groups.values()))
    if p.trajectories:
        _upsert_trajectories(conn, list(p.trajectories.values()))
    if p.spans and conn.dialect.name == "postgresql":  # spans of new events only: no conflicts
        _pg_copy(conn, "spans", SPAN_COLUMNS, SPAN_WIRE, p.spans)
    elif p.spans:
        conn.exec_driver_sql(_insert_sql("spans", SPAN_COLUMNS), p.spans)
    if p.batches:
        _upsert_batches(conn, list(p.batches.values()))
    if p.engine_states:
        stmt = insert_for(conn, engines_t)
        stmt = stmt.on_conflict_do_update(
            index_elements=["run_id", "name"],
            set_={"state": stmt.excluded.state, "detail": stmt.excluded.detail},
        )
        conn.execute(stmt, [{**row, "weight_version": 0} for row in p.engine_states.values()])
    for run, t in p.engines_left.items():  # a rollout may have waited only on that engine
        running = select(rollouts_t.c.id).where(rollouts_t.c.run_id == run, rollouts_t.c.state == "running")
        for rid in conn.execute(running).scalars().all():
            _maybe_finish_rollout(conn, run, rid, t)
    for env in p.rare:
        _write_rare(conn, env)


# spelled out: an expanding IN cannot be used in an executemany statement
_NOT_TERMINAL = and_(*(groups_t.c.state != literal_column(f"'{v}'") for v in sorted(_TERMINAL)))


def _upsert_groups(conn: Connection, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        if row["state"] is None:  # only a ready event arrived for a group never seen admitted
            row["state"] = GroupStatus.READY.value
    stmt: Insert = insert_for(conn, groups_t)
    ex = stmt.excluded  # type: ignore[attr-defined]
    set_ = {c: func.coalesce(ex[c], groups_t.c[c]) for c in GROUP_COLUMNS}
    set_["state"] = ex.state
    stmt = stmt.on_conflict_do_update(  # type: ignore[attr-defined]
        index_elements=["run_id", "group_id"], set_=set_, where=_NOT_TERMINAL
    )
    conn.execute(stmt, rows)


def _upsert_trajectories(conn: Connection, rows: list[dict[str, Any]]) -> None:
    stmt: Any = insert_for(conn, trajectories_t)
    ex, tr = stmt.excluded, trajectories_t.c
    finished = ex.finished_at.is_not(None)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "group_id", "attempt"],
        set_={
            "started_at": func.coalesce(tr.started_at, ex.started_at),
            "finished_at": func.coalesce(ex.finished_at, tr.finished_at),
            "reward": case((finished, ex.reward), else_=tr.reward),
            "error": case((finished, ex.error), else_=tr.error),
            "cancel_reason": func.coalesce(ex.cancel_reason, tr.cancel_reason),
            "restarts": tr.restarts + ex.restarts,
            "turns": tr.turns + ex.turns,
            "tokens": tr.tokens + ex.tokens,
        },
    )
    conn.execute(stmt, rows)


def _upsert_batches(conn: Connection, rows: list[dict[str, Any]]) -> None:
    stmt: Any = insert_for(conn, batches_t)
    ex, b = stmt.excluded, batches_t.c
    cols = ("trainer_version", "requested_at", "ready_at", "delivered_at")
    set_: dict[str, Any] = {c: func.coalesce(ex[c], b[c]) for c in cols}
    set_["group_ids"] = case((ex.delivered_at.is_not(None), ex.group_ids), else_=b.group_ids)
    stmt = stmt.on_conflict_do_update(index_elements=["run_id", "batch_index"], set_=set_)
    conn.execute(stmt, [{**row, "group_ids": row["group_ids"] or []} for row in rows])


# -- rare events: one small statement each ------------------------------------------------------------


def _write_rare(conn: Connection, env: Envelope) -> None:
    ev: Event = env.event
    if isinstance(ev, VersionPublished):
        _rollout_id(conn, env.run_id, ev.version, env.t, path=ev.path, actor=ev.actor)
        conn.execute(
            update(rollouts_t)
            .where(rollouts_t.c.run_id == env.run_id, rollouts_t.c.version < ev.version)
            .where(rollouts_t.c.state == "running")
            .values(state="superseded", ended_at=env.t)
        )
    elif isinstance(ev, EngineUpdateBegin):
        rid = _rollout_id(conn, env.run_id, ev.version, env.t)
        stmt: Any = insert_for(conn, steps_t)
        stmt = stmt.on_conflict_do_update(
            index_elements=["rollout_id", "engine"],
            set_={"state": "updating", "started_at": stmt.excluded.started_at},
            where=steps_t.c.state != "done",  # a reload (`_engine_update_end`) keeps the step it repeats
        )
        conn.execute(stmt, {"rollout_id": rid, "engine": ev.engine, "state": "updating", "started_at": env.t})
    elif isinstance(ev, EngineUpdateEnd):
        _engine_update_end(conn, env, ev)
    elif isinstance(ev, PolicyChanged):
        _policy_changed(conn, env, ev)
    elif isinstance(ev, RunStarted):
        conn.execute(
            update(runs_t)
            .where(runs_t.c.id == env.run_id, runs_t.c.state == RunState.CREATED.value)
            .values(state=RunState.RUNNING.value, started_at=datetime.now(UTC))
        )
        engines = getattr(ev, "engines", ())  # the engines the run drives, known from its start
        if engines:
            conn.execute(
                insert_for(conn, engines_t).on_conflict_do_nothing(index_elements=["run_id", "name"]),
                [
                    {"run_id": env.run_id, "name": name, "state": "serving", "weight_version": 0}
                    for name in engines
                ],
            )
        if ev.policy:
            conn.execute(update(runs_t).where(runs_t.c.id == env.run_id).values(policy=dict(ev.policy)))
    elif isinstance(ev, RunEnded):
        close_rollouts(conn, env.run_id, env.t)
        state = RUN_END_STATE.get(ev.reason, RunState.FAILED)
        conn.execute(
            update(runs_t)
            .where(runs_t.c.id == env.run_id, runs_t.c.state.not_in([s.value for s in TERMINAL_RUN_STATES]))
            .values(
                state=state.value,
                ended_at=datetime.now(UTC),
                error=(ev.detail or ev.reason) if state is RunState.FAILED else None,
            )
        )


def _rollout_id(
    conn: Connection, run_id: str, version: int, t: float, path: str | None = None, actor: str = "trainer"
) -> int:
    stmt = insert_for(conn, rollouts_t).on_conflict_do_nothing(index_elements=["run_id", "version"])
    conn.execute(
        stmt,
        {"run_id": run_id, "version": version, "path": path, "actor": actor, "state": "running",
         "started_at": t},
    )  # fmt: skip
    found = conn.execute(
        select(rollouts_t.c.id).where(rollouts_t.c.run_id == run_id, rollouts_t.c.version == version)
    ).scalar_one()
    return int(found)


def _engine_update_end(conn: Connection, env: Envelope, ev: EngineUpdateEnd) -> None:
    rid = _rollout_id(conn, env.run_id, ev.version, env.t)
    where = (steps_t.c.rollout_id == rid, steps_t.c.engine == ev.engine)
    if conn.execute(select(steps_t.c.state).where(*where)).scalar() == "done":
        # The engine had loaded this version already: a resumed run loading it again onto engines that
        # restarted. The rollout's step keeps its own times; the reload's pause is a span of its own.
        started = _update_began(conn, env, ev)
    else:
        state = "done" if ev.ok else "failed"
        stmt: Any = insert_for(conn, steps_t)
        ex = stmt.excluded
        stmt = stmt.on_conflict_do_update(
            index_elements=["rollout_id", "engine"],
            set_={"state": ex.state, "ended_at": ex.ended_at, "error": ex.error},
        )
        conn.execute(
            stmt,
            {"rollout_id": rid, "engine": ev.engine, "state": state, "started_at": env.t, "ended_at": env.t,
             "error": ev.error or None},
        )  # fmt: skip
        started = conn.execute(select(steps_t.c.started_at).where(*where)).scalar_one()
    conn.execute(
        insert_for(conn, spans_t).on_conflict_do_nothing(index_elements=["run_id", "seq", "phase"]),
        {"run_id": env.run_id, "seq": env.seq, "group_id": None, "attempt": None,
         "phase": SpanPhase.UPDATE_PAUSE.value, "engine": ev.engine, "lane": None, "version": ev.version,
         "start": started, "end": env.t, "tokens": None, "ok": ev.ok},
    )  # fmt: skip
    if ev.ok:
        stmt = insert_for(conn, engines_t)
        stmt = stmt.on_conflict_do_update(
            index_elements=["run_id", "name"], set_={"weight_version": stmt.excluded.weight_version}
        )
        conn.execute(stmt, {"run_id": env.run_id, "name": ev.engine, "state": "serving",
                            "weight_version": ev.version})  # fmt: skip
    _maybe_finish_rollout(conn, env.run_id, rid, env.t)


def _update_began(conn: Connection, env: Envelope, ev: EngineUpdateEnd) -> float:
    """When the update that `env` ends began: its `engine_update_begin`, the latest of that engine and
    version before it (stored already, earlier in this batch or before it); `env.t` when there is none."""
    payload = events_t.c.payload
    began = conn.execute(
        select(events_t.c.t)
        .where(events_t.c.run_id == env.run_id, events_t.c.seq < env.seq)
        .where(events_t.c.kind == EngineUpdateBegin.kind)
        .where(payload["engine"].as_string() == ev.engine, payload["version"].as_integer() == ev.version)
        .order_by(events_t.c.seq.desc())
        .limit(1)
    ).scalar()
    return env.t if began is None else float(began)


def _maybe_finish_rollout(conn: Connection, run_id: str, rid: int, t: float) -> None:
    """A rollout ends when every engine the run knows, and that is not out of rotation (unhealthy or
    stopped), has ended its step (done or failed); without registered engines, when no step is still
    updating."""
    steps = conn.execute(select(steps_t.c.engine, steps_t.c.state).where(steps_t.c.rollout_id == rid)).all()
    if any(s.state in UNFINISHED_STEP for s in steps):
        return
    query = select(engines_t.c.name).where(
        engines_t.c.run_id == run_id, engines_t.c.state.not_in(OUT_OF_ROTATION)
    )
    engines = set(conn.execute(query).scalars())
    if not engines <= {s.engine for s in steps}:
        return
    state = "failed" if any(s.state == "failed" for s in steps) else "completed"
    conn.execute(
        update(rollouts_t)
        .where(and_(rollouts_t.c.id == rid, rollouts_t.c.state == "running"))
        .values(state=state, ended_at=t)
    )


def close_rollouts(conn: Connection, run_id: str, t: float | None) -> None:
    """The run has ended: its rollouts still running are `cancelled` at `t` (the run's clock), and every
    engine step still under way is `cancelled` with the error `run ended` (nothing will end them now)."""
    rollouts = select(rollouts_t.c.id).where(rollouts_t.c.run_id == run_id)
    conn.execute(
        update(steps_t)
        .where(steps_t.c.rollout_id.in_(rollouts), steps_t.c.state.in_(UNFINISHED_STEP))
        .values(state="cancelled", ended_at=t, error=RUN_ENDED)
    )
    conn.execute(
        update(rollouts_t)
        .where(rollouts_t.c.run_id == run_id, rollouts_t.c.state == "running")
        .values(state="cancelled", ended_at=t)
    )


def _policy_changed(conn: Connection, env: Envelope, ev: PolicyChanged) -> None:
    conn.execute(
        insert_for(conn, policy_t).on_conflict_do_nothing(index_elements=["run_id", "seq"]),
        {"run_id": env.run_id, "seq": env.seq, "field": ev.field, "old": ev.old, "new": ev.new,
         "actor": ev.actor, "at": env.t},
    )  # fmt: skip
    policy = conn.execute(select(runs_t.c.policy).where(runs_t.c.id == env.run_id)).scalar_one()
    conn.execute(update(runs_t).where(runs_t.c.id == env.run_id).values(policy={**policy, ev.field: ev.new}))


# -- the sink ------------------------------------------------------------------------------------------


class SqlEventSink:
    """The bus sink: `write_batch` stores a batch in one transaction, or raises and stores nothing.

    `bind` is an Engine (each batch commits on its own) or a Connection already in a transaction (each
    batch is a savepoint in it: the tests' per-test rollback, or a caller that commits itself).
    """

    def __init__(self, bind: Engine | Connection, outage_s: float = OUTAGE_S) -> None:
        self._bind = bind
        self.outage_s = outage_s  # a database away is waited out this long (`through_outage`)
        self.written = 0  # new events stored
        self.duplicates = 0  # re-delivered events skipped

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        """Store `envelopes` in one transaction. A database that is away (Postgres restarting) is waited
        out (`through_outage`): the batch is tried again, which stores nothing twice."""
        if not envelopes:
            return

        def write() -> int:
            with self._transaction() as conn:
                return ingest(conn, envelopes)

        # Inside a caller's transaction a lost connection cannot be tried again: the caller's to handle.
        inside = isinstance(self._bind, Connection)
        new = write() if inside else through_outage(write, "event sink", self.outage_s)
        self.written += new
        self.duplicates += len(envelopes) - new

    def retryable(self, exc: BaseException) -> bool:
        """Whether a batch `write_batch` raised on may be written later (the bus tries it again): the
        database was still away when the outage wait ran out, and the failed transaction stored nothing."""
        return not isinstance(self._bind, Connection) and is_outage(exc)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Connection]:
        if isinstance(self._bind, Connection):
            with self._bind.begin_nested():
                yield self._bind
        else:
            with self._bind.begin() as conn:
                yield conn

    def close(self) -> None:
        """Nothing is buffered here (the bus buffers); present for the sink protocol."""
