"""A database whose schema a newer Corral made (a revision these migrations do not know: the binary rolled
back, or a database shared with a newer deployment) is refused by every command that opens it, in one
line that says so, exit 2, and is left as it was. `prune --dry-run` told the operator to migrate it by
running without --dry-run, which failed with alembic's "Can't locate revision"; `serve` said only that.
Real processes, on SQLite and on the real Postgres."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from app.store.db import make_engine, scratch_database
from app.store.migrate import current_revision, upgrade_to_head

CORRAL = Path(sys.executable).with_name("corral")
POSTGRES_URL = os.environ.get("CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
@pytest.mark.parametrize(
    "args", [["serve"], ["prune", "--older-than-days", "1"], ["prune", "--older-than-days", "1", "--dry-run"]]
)
def test_a_newer_corrals_schema_is_one_line_and_left_alone(
    backend: str, args: list[str], tmp_path: Path
) -> None:
    with scratch_database(backend, POSTGRES_URL, tmp_path) as url:
        upgrade_to_head(url)
        engine = make_engine(url)
        try:
            with engine.begin() as conn:
                conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
            env = {**os.environ, "CORRAL_DATABASE_URL": url, "CORRAL_OPERATOR_TOKEN": "t" * 16,
                   "CORRAL_PORT": str(free_port()), "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
            done = subprocess.run(
                [str(CORRAL), *args], env=env, capture_output=True, text=True, timeout=120, check=False
            )
            said = (done.stdout + done.stderr).strip().splitlines()
            assert done.returncode == 2, said
            assert said == [said[0]], said
            assert said[0].startswith("error: CORRAL_DATABASE_URL"), said
            assert "revision 9999, which this Corral does not know" in said[0]
            assert "a newer Corral's" in said[0]
            assert current_revision(engine) == "9999"
        finally:
            engine.dispose()
