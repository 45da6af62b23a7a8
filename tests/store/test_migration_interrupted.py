"""A Ctrl-C to `corral serve`'s process group while it migrates a database (a large one takes minutes:
Alembic copies a SQLite table to alter it) ends it as an interrupt, one line and exit 130, the migration
under way rolled back and the rows all there. Before, SQLAlchemy raised PendingRollbackError over the
KeyboardInterrupt as it ended the cut transaction, and serve said `cannot open the database: Can't
reconnect until invalid transaction is rolled back`, exit 2. A real process on a real SQLite file."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from alembic import command

from app.store.migrate import alembic_config

SPANS = 600_000


def make_old_database(path: Path) -> None:
    """A database at revision 0001 whose spans table takes migration 0002 seconds to copy."""
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0001")
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO runs (id, name, state, config, policy, created_at) "
                   "VALUES ('r', 'r', 'stopped', '{}', '{}', '2026-01-01')")  # fmt: skip
        db.executemany(
            "INSERT INTO spans (run_id, seq, group_id, attempt, phase, engine, lane, version, start, "
            "\"end\", tokens, ok) VALUES ('r', ?, 0, 0, 'turn', 'e0', NULL, 0, 0.0, 1.0, 5, 1)",
            ((seq,) for seq in range(SPANS)),
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def writing(path: Path) -> bool:
    """Whether another connection holds the file's write lock (the migration's transaction)."""
    db = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        db.close()


def test_ctrl_c_during_the_migration_is_an_interrupt(tmp_path: Path) -> None:
    database = tmp_path / "corral.db"
    make_old_database(database)
    env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{database}", "CORRAL_OPERATOR_TOKEN": "t" * 16,
           "CORRAL_PORT": str(free_port()), "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    serve = subprocess.Popen(
        [str(Path(sys.executable).with_name("corral")), "serve"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not writing(database):
            assert serve.poll() is None, "serve ended before its migration was seen"
            assert time.monotonic() < deadline, "the migration was never seen"
            time.sleep(0.05)
        time.sleep(0.5)  # into the copy of spans
        os.killpg(serve.pid, signal.SIGINT)
        out, _ = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert serve.returncode == 130, out
    assert out.strip().splitlines()[-1] == "interrupted", out
    assert "cannot open the database" not in out
    with sqlite3.connect(database) as db:
        assert db.execute("SELECT count(*) FROM spans").fetchone() == (SPANS,)
