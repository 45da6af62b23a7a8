"""A SQLite database's WAL file is cut back once checkpointed, whatever the largest transaction was."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from app.store import db


def test_the_wal_shrinks_back_after_a_large_deletion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Deleting a run of 780,000 events (`corral prune`, DELETE /api/runs/{id}) left a 240 MiB WAL file
    # beside the database for as long as the server ran: SQLite reuses a WAL from its start after a
    # checkpoint but never truncates it unless a journal_size_limit is set.
    monkeypatch.setattr(db, "WAL_SIZE_LIMIT", 2**20)
    path = tmp_path / "corral.db"
    engine = db.make_engine(f"sqlite:///{path}")
    wal = tmp_path / "corral.db-wal"
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE rows (id INTEGER PRIMARY KEY, body TEXT)"))
        with engine.begin() as conn:
            conn.execute(
                text("INSERT INTO rows (body) VALUES (:b)"), [{"b": "x" * 1000} for _ in range(8000)]
            )
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM rows"))
        largest = wal.stat().st_size
        assert largest > 4 * 2**20
        for i in range(3):  # the server's next writes: the WAL, checkpointed at the deletion, is reset
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO rows (body) VALUES (:b)"), {"b": str(i)})
        assert wal.stat().st_size <= 2**20
    finally:
        engine.dispose()
