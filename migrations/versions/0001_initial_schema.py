"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 22:35:29.836683
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# JSONB on Postgres, JSON text on SQLite (as app.store.models.JSONType, frozen here).
JSON_T = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("config", JSON_T, nullable=False),
        sa.Column("policy", JSON_T, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "state IN ('created', 'running', 'paused', 'stopping', 'stopped', 'failed', 'completed')",
            name=op.f("ck_runs_state"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "batches",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("batch_index", sa.Integer(), nullable=False),
        sa.Column("group_ids", JSON_T, nullable=False),
        sa.Column("requested_at", sa.Float(), nullable=True),
        sa.Column("ready_at", sa.Float(), nullable=True),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.Column("trainer_version", sa.Integer(), nullable=True),
        sa.Column("offered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("offer_count", sa.Integer(), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ack_count", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_batches_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "batch_index", name=op.f("pk_batches")),
    )
    op.create_table(
        "engines",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=500), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("weight_version", sa.Integer(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_engines_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_engines")),
    )
    op.create_table(
        "events",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("payload", JSON_T, nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "seq", name=op.f("pk_events")),
    )
    op.create_index("ix_events_run_id_kind", "events", ["run_id", "kind"], unique=False)
    op.create_table(
        "groups",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=False),
        sa.Column("task_index", sa.Integer(), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("admitted_at", sa.Float(), nullable=True),
        sa.Column("ready_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=True),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column("batch_index", sa.Integer(), nullable=True),
        sa.Column("staleness", sa.Integer(), nullable=True),
        sa.CheckConstraint(
            "state IN ('admitted', 'ready', 'delivered', 'discarded')", name=op.f("ck_groups_state")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_groups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "group_id", name=op.f("pk_groups")),
    )
    op.create_index("ix_groups_run_id_state", "groups", ["run_id", "state"], unique=False)
    op.create_table(
        "lanes",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("cpus", sa.String(length=200), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_lanes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", name=op.f("pk_lanes")),
    )
    op.create_table(
        "policy_changes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.Column("field", sa.String(length=64), nullable=False),
        sa.Column("old", JSON_T, nullable=True),
        sa.Column("new", JSON_T, nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_policy_changes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_policy_changes")),
        sa.UniqueConstraint("run_id", "seq", name=op.f("uq_policy_changes_run_id_seq")),
    )
    op.create_index(op.f("ix_policy_changes_run_id"), "policy_changes", ["run_id"], unique=False)
    op.create_table(
        "spans",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("engine", sa.String(length=64), nullable=True),
        sa.Column("lane", sa.String(length=32), nullable=True),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("start", sa.Float(), nullable=False),
        sa.Column("end", sa.Float(), nullable=False),
        sa.Column("tokens", sa.Integer(), nullable=True),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.CheckConstraint(
            "phase IN ('reset', 'turn', 'tool', 'validate', 'cleanup', "
            "'lane_queue', 'engine_queue', 'update_pause')",
            name=op.f("ck_spans_phase"),
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_spans_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_spans")),
        sa.UniqueConstraint("run_id", "seq", "phase", name=op.f("uq_spans_run_id_seq_phase")),
    )
    op.create_index("ix_spans_run_id_group_id", "spans", ["run_id", "group_id"], unique=False)
    op.create_index("ix_spans_run_id_start", "spans", ["run_id", "start"], unique=False)
    op.create_table(
        "tasks",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("task_index", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_tasks_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "task_index", name=op.f("pk_tasks")),
    )
    op.create_table(
        "trajectories",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("group_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("cancel_reason", sa.String(length=32), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("turns", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_trajectories_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "group_id", "attempt", name=op.f("pk_trajectories")),
    )
    op.create_table(
        "weight_rollouts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=True),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_weight_rollouts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_weight_rollouts")),
        sa.UniqueConstraint("run_id", "version", name=op.f("uq_weight_rollouts_run_id_version")),
    )
    op.create_table(
        "rollout_steps",
        sa.Column("rollout_id", sa.Integer(), nullable=False),
        sa.Column("engine", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["rollout_id"],
            ["weight_rollouts.id"],
            name=op.f("fk_rollout_steps_rollout_id_weight_rollouts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("rollout_id", "engine", name=op.f("pk_rollout_steps")),
    )


def downgrade() -> None:
    op.drop_table("rollout_steps")
    op.drop_table("weight_rollouts")
    op.drop_table("trajectories")
    op.drop_table("tasks")
    op.drop_index("ix_spans_run_id_start", table_name="spans")
    op.drop_index("ix_spans_run_id_group_id", table_name="spans")
    op.drop_table("spans")
    op.drop_index(op.f("ix_policy_changes_run_id"), table_name="policy_changes")
    op.drop_table("policy_changes")
    op.drop_table("lanes")
    op.drop_index("ix_groups_run_id_state", table_name="groups")
    op.drop_table("groups")
    op.drop_index("ix_events_run_id_kind", table_name="events")
    op.drop_table("events")
    op.drop_table("engines")
    op.drop_table("batches")
    op.drop_table("runs")
