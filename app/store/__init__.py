"""Corral's state in a database: SQLite (the embedded default) or Postgres, through SQLAlchemy 2.

- `models`: the typed ORM tables (runs, policy changes, tasks, groups, trajectories, spans, events,
  batches, engines, weight rollouts and their per-engine steps, lanes);
- `db`: `make_engine(url)` and sessions; `scratch_database` for tests and benchmarks;
- `migrate`: `upgrade_to_head(url)`, the Alembic revisions in `migrations/` that the app factory applies;
- `repos`: repositories over a Session (the caller owns the transaction; they never commit);
- `sink`: `SqlEventSink`, the event bus sink that stores the typed event stream and projects it into
  the tables above, one transaction per batch.

Importing this package pulls in SQLAlchemy; `app.core` and `app.sim` never import it.
"""
