"""this database's own random id

A run directory's tombstone (`app.service.retention`) names the database whose deletion left it, so
that only a prune on that database takes it. A URL names a database only roughly (a SQLite `file:` URI
relative to the working directory, a Postgres host left to PGHOST, two hosts' `localhost`), so the
database carries an id of its own: one row, made here.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 00:50:00
"""

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    instance = op.create_table("instance", sa.Column("id", sa.String(32), primary_key=True))
    op.bulk_insert(instance, [{"id": uuid.uuid4().hex}])


def downgrade() -> None:
    op.drop_table("instance")
