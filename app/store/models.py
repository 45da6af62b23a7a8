"""The ORM models of Corral's state (SQLAlchemy 2, typed).

Two kinds of time live here: wall-clock `DateTime` columns for the run's lifecycle (created, started,
ended), and `Float` seconds on the run's own clock for everything projected from the event stream
(`Envelope.t`), so a stored timeline lines up with the report and the simulator's virtual clock.

Invariants:
- `events` holds every event of a run exactly once: its primary key is (run_id, seq), so a sink that
  delivers a batch twice (at least once) cannot duplicate it;
- every table below `runs` is keyed by run and cascades with it, except the two high-volume tables
  `events` and `spans`: a foreign key there is checked per row, which cost about 40% of the database's
  ingestion work, so the sink creates the run row before a batch and `RunRepo.delete` removes both;
- tables projected from the stream (groups, trajectories, spans, batches, engines, rollouts) carry no
  foreign keys among themselves, so an event that arrives without its predecessor (a sink that dropped a
  batch) is still stored;
- a group row is terminal (`delivered` or `discarded`) at most once: the sink never rewrites a terminal
  group, so the table keeps each group's first and only ending.

The migrations in `migrations/` must produce exactly this metadata; `tests/store` checks it.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# JSONB on Postgres (indexable, compact), plain JSON (text) on SQLite.
JSONType = JSON().with_variant(JSONB(), "postgresql")

# Stable constraint names, so migrations can address them on every backend.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSONType, list[Any]: JSONType}


def utcnow() -> datetime:
    return datetime.now(UTC)


class RunState(enum.StrEnum):
    CREATED = "created"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    COMPLETED = "completed"


TERMINAL_RUN_STATES = frozenset({RunState.STOPPED, RunState.FAILED, RunState.COMPLETED})


class GroupStatus(enum.StrEnum):
    ADMITTED = "admitted"  # in flight: attempts running
    READY = "ready"  # all G attempts done, waiting in the ready queue
    DELIVERED = "delivered"
    DISCARDED = "discarded"


TERMINAL_GROUP_STATES = frozenset({GroupStatus.DELIVERED, GroupStatus.DISCARDED})


class SpanPhase(enum.StrEnum):
    RESET = "reset"
    TURN = "turn"
    TOOL = "tool"
    VALIDATE = "validate"
    CLEANUP = "cleanup"
    LANE_QUEUE = "lane_queue"
    ENGINE_QUEUE = "engine_queue"
    UPDATE_PAUSE = "update_pause"


def _in(column: str, values: type[enum.StrEnum]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


def _run_fk() -> Mapped[str]:
    return mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)


def _run_key() -> Mapped[str]:
    """A run id with no foreign key: the high-volume tables (see the module's invariants)."""
    return mapped_column(String(64), primary_key=True)


class Instance(Base):
    """This database's own random id: what a run directory's tombstone names (`app.service.retention`),
    so that a data directory shared by two databases never has one's leftovers taken for the other's,
    however their URLs are spelled. One row at most (its key is 1), made when first asked for
    (`ServiceStore.instance_id`): two processes asking at once get the same one."""

    __tablename__ = "instance"
    __table_args__ = (CheckConstraint("key = 1", name="one_row"),)

    key: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    id: Mapped[str] = mapped_column(String(32))


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (CheckConstraint(_in("state", RunState), name="state"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), default=RunState.CREATED.value)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    policy: Mapped[dict[str, Any]] = mapped_column(default=dict)  # B, G, S, K, ... as now in force
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    error: Mapped[str | None] = mapped_column(Text)


class PolicyChange(Base):
    """One live change of a policy knob; `seq` is the PolicyChanged event's, when it came from one."""

    __tablename__ = "policy_changes"
    __table_args__ = (UniqueConstraint("run_id", "seq"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int | None] = mapped_column(BigInteger)
    field: Mapped[str] = mapped_column(String(64))
    old: Mapped[Any] = mapped_column(JSONType, nullable=True)
    new: Mapped[Any] = mapped_column(JSONType, nullable=True)
    actor: Mapped[str] = mapped_column(String(64))
    at: Mapped[float] = mapped_column(Float)  # run clock


class Task(Base):
    __tablename__ = "tasks"

    run_id: Mapped[str] = _run_fk()
    task_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")


class Group(Base):
    """Each admitted group's account: when it was admitted, became ready and ended, and how."""

    __tablename__ = "groups"
    __table_args__ = (
        CheckConstraint(_in("state", GroupStatus), name="state"),
        Index("ix_groups_run_id_state", "run_id", "state"),
    )

    run_id: Mapped[str] = _run_fk()
    group_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    task_index: Mapped[int | None] = mapped_column(Integer)
    group_size: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    admitted_at: Mapped[float | None] = mapped_column(Float)
    ready_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(String(32))  # discard reason
    detail: Mapped[str | None] = mapped_column(Text)
    batch_index: Mapped[int | None] = mapped_column(Integer)
    staleness: Mapped[int | None] = mapped_column(Integer)


class Trajectory(Base):
    """One attempt of a group (GRPO member). `turns` and `tokens` count every turn it ran, those a
    restart threw away included."""

    __tablename__ = "trajectories"

    run_id: Mapped[str] = _run_fk()
    group_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    reward: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)  # an infrastructure error
    cancel_reason: Mapped[str | None] = mapped_column(String(32))  # its group was discarded mid-try
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    turns: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)


class Span(Base):
    """The timeline: one interval of one phase. `seq` is the event it was projected from (one event can
    give two spans: a turn and its engine queue wait), so (run_id, seq, phase) is the key, and
    `timeline?since=<seq>` is a range scan of it."""

    __tablename__ = "spans"
    __table_args__ = (
        CheckConstraint(_in("phase", SpanPhase), name="phase"),
        Index("ix_spans_run_id_group_id", "run_id", "group_id"),
    )

    run_id: Mapped[str] = _run_key()
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    phase: Mapped[str] = mapped_column(String(16), primary_key=True)
    group_id: Mapped[int | None] = mapped_column(Integer)
    attempt: Mapped[int | None] = mapped_column(Integer)
    engine: Mapped[str | None] = mapped_column(String(64))
    lane: Mapped[str | None] = mapped_column(String(32))
    version: Mapped[int | None] = mapped_column(Integer)
    start: Mapped[float] = mapped_column(Float)
    end: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(Integer)
    ok: Mapped[bool] = mapped_column(default=True)


class EventRow(Base):
    """The raw event log: `payload` is `Envelope.to_dict()` without run_id, seq, t and kind."""

    __tablename__ = "events"

    run_id: Mapped[str] = _run_key()
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    t: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(32))
    payload: Mapped[dict[str, Any]] = mapped_column()


class Batch(Base):
    """A trainer batch: requested, ready, delivered (from the stream), then offered to and acked by an
    external trainer (at-least-once: an unacked batch is offered again)."""

    __tablename__ = "batches"

    run_id: Mapped[str] = _run_fk()
    batch_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    group_ids: Mapped[list[Any]] = mapped_column(default=list)
    requested_at: Mapped[float | None] = mapped_column(Float)
    ready_at: Mapped[float | None] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    trainer_version: Mapped[int | None] = mapped_column(Integer)
    offered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    offer_count: Mapped[int] = mapped_column(Integer, default=0)
    acked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ack_count: Mapped[int] = mapped_column(Integer, default=0)


class Engine(Base):
    __tablename__ = "engines"

    run_id: Mapped[str] = _run_fk()
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str | None] = mapped_column(String(500))
    state: Mapped[str] = mapped_column(String(16), default="serving")
    weight_version: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[str | None] = mapped_column(Text)


class WeightRollout(Base):
    """Publishing one policy version across a run's engines, one (or a few) at a time."""

    __tablename__ = "weight_rollouts"
    __table_args__ = (UniqueConstraint("run_id", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64), ForeignKey("runs.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(Integer)
    path: Mapped[str | None] = mapped_column(Text)  # None: a sentinel update
    actor: Mapped[str] = mapped_column(String(64), default="trainer")
    # running, completed, failed, superseded, cancelled (its run ended first)
    state: Mapped[str] = mapped_column(String(16), default="running")
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)


class RolloutStep(Base):
    __tablename__ = "rollout_steps"

    rollout_id: Mapped[int] = mapped_column(
        Integer, ForeignKey("weight_rollouts.id", ondelete="CASCADE"), primary_key=True
    )
    engine: Mapped[str] = mapped_column(String(64), primary_key=True)
    # pending, updating, done, failed, cancelled (its run ended first: error "run ended")
    state: Mapped[str] = mapped_column(String(16), default="pending")
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class Lane(Base):
    """A lane of a run as it started: its CPU set (worked out at start, so not in the run's config) and
    its configured slots. `cpus` is a cpulist ("2-3,6"), or "unpinned"; Text, since a host's list can
    run past any fixed width ("0,2,4,...,254")."""

    __tablename__ = "lanes"

    run_id: Mapped[str] = _run_fk()
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    cpus: Mapped[str] = mapped_column(Text, default="")
    slots: Mapped[int] = mapped_column(Integer)
