"""lean timeline keys: spans keyed by (run_id, seq, phase), no per-kind or per-start index

Fewer index entries per timeline event: ingestion writes one `events` row and one or two `spans` rows
per turn or sandbox op, and every index is written per row. Timeline reads go by seq (the keys); the
per-group index on spans stays for a group's drill-down.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 22:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index("ix_events_run_id_kind", table_name="events")
    op.drop_index("ix_spans_run_id_start", table_name="spans")
    with op.batch_alter_table("spans") as batch_op:
        batch_op.drop_constraint("uq_spans_run_id_seq_phase", type_="unique")
        batch_op.drop_constraint("pk_spans", type_="primary")
        batch_op.drop_column("id")
        batch_op.create_primary_key("pk_spans", ["run_id", "seq", "phase"])


def downgrade() -> None:
    # back to a surrogate id: Postgres numbers existing rows with a bigserial; on SQLite the id becomes
    # the rowid alias when the batch copies the table, so existing rows get numbers too
    with op.batch_alter_table("spans") as batch_op:
        batch_op.drop_constraint("pk_spans", type_="primary")
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE spans ADD COLUMN id BIGSERIAL NOT NULL")
    else:
        with op.batch_alter_table("spans") as batch_op:
            batch_op.add_column(sa.Column("id", sa.Integer(), nullable=True))
    with op.batch_alter_table("spans") as batch_op:
        batch_op.create_primary_key("pk_spans", ["id"])
        batch_op.create_unique_constraint("uq_spans_run_id_seq_phase", ["run_id", "seq", "phase"])
    op.create_index("ix_spans_run_id_start", "spans", ["run_id", "start"], unique=False)
    op.create_index("ix_events_run_id_kind", "events", ["run_id", "kind"], unique=False)
