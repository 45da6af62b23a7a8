"""this database's own random id

A run directory's tombstone (`app.service.retention`) names the database whose deletion left it, so
that only a prune on that database takes it. A URL names a database only roughly (a SQLite `file:` URI
relative to the working directory, a Postgres host left to PGHOST, two hosts' `localhost`), so the
database carries an id of its own: one row at most, made when first asked for
(`ServiceStore.instance_id`), not here, so that `alembic upgrade --sql` does not give every database
its script runs on one id.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 00:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "instance",
        sa.Column("key", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("id", sa.String(32), nullable=False),
        sa.CheckConstraint("key = 1", name=op.f("ck_instance_one_row")),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_instance")),
    )


def downgrade() -> None:
    op.drop_table("instance")
