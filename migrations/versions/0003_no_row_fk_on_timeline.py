"""no foreign key from events and spans to runs

A foreign key is checked per inserted row; on `events` and `spans` (a row or two per timeline event)
that was about 40% of the database's ingestion work. The sink creates the run row before each batch and
`RunRepo.delete` removes a run's events and spans, so the key bought nothing the code does not keep.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 22:55:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("events", "spans"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_constraint(f"fk_{table}_run_id_runs", type_="foreignkey")


def downgrade() -> None:
    for table in ("events", "spans"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.create_foreign_key(
                f"fk_{table}_run_id_runs", "runs", ["run_id"], ["id"], ondelete="CASCADE"
            )
