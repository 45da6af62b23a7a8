"""Bring a database to the newest schema: `upgrade_to_head(url)`, called by the app factory at start.

The migration scripts live in `migrations/` at the repository root (next to `alembic.ini`), so the
`alembic` command and this helper run the very same revisions.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic config for `url` that does not touch the process's logging."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"migrations not found at {MIGRATIONS_DIR}")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["url"] = url
    config.attributes["skip_logging"] = True
    return config


def upgrade_to_head(url: str) -> None:
    """Apply every migration not yet applied to the database at `url` (idempotent). A Ctrl-C meanwhile
    is a KeyboardInterrupt, the migration under way rolled back: SQLAlchemy, ending the transaction the
    interrupt cut, raised PendingRollbackError over it, which callers took for a database that cannot
    be opened (`corral serve`: exit 2, "Can't reconnect until invalid transaction is rolled back")."""
    try:
        command.upgrade(alembic_config(url), "head")
    except SQLAlchemyError as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise KeyboardInterrupt from None


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def is_known(revision: str) -> bool:
    """Is `revision` one of these migrations (not a newer Corral's)?"""
    try:
        return ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision(revision) is not None
    except CommandError:
        return False


def current_revision(engine: Engine) -> str | None:
    """The revision the database at `engine` is on; None for a database never migrated."""
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()
