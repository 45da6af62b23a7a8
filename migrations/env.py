"""Alembic environment for Corral's store.

The database URL comes from, in order: a connection handed over in `config.attributes["connection"]`,
`config.attributes["url"]` (what `app.store.migrate.upgrade_to_head` sets), `-x url=...` on the
command line, the `sqlalchemy.url` main option, `CORRAL_DATABASE_URL`, and finally the embedded default
`sqlite:///./corral.db`. On Postgres the migration holds an advisory lock, so an API process and an
orchestrator starting together do not both create the schema.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text

from app.store.db import DEFAULT_DATABASE_URL, make_engine
from app.store.models import Base

config = context.config
if config.config_file_name is not None and not config.attributes.get("skip_logging"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata
MIGRATION_LOCK = 0x636F7272616C  # "corral"


def database_url() -> str:
    return str(
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("CORRAL_DATABASE_URL")
        or DEFAULT_DATABASE_URL
    )


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )


def run_migrations_offline() -> None:
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK})
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:
        _run(given)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            _run(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
