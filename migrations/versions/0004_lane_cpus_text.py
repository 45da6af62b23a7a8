"""a lane's CPU set as text

`lanes.cpus` was a VARCHAR(200): a cpulist of a large host that is not one range ("0,2,4,...,254") runs
past it, and Postgres refuses the row. The dashboard now records each run's lane CPU sets as the run
starts, so after a restart an ended run's lanes show them; any length is kept.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 13:15:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("lanes") as batch_op:
        batch_op.alter_column("cpus", existing_type=sa.String(200), type_=sa.Text(), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("lanes") as batch_op:
        batch_op.alter_column("cpus", existing_type=sa.Text(), type_=sa.String(200), existing_nullable=False)
