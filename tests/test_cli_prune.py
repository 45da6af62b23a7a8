"""`corral prune --older-than-days N`: the runs that ended more than N days ago go, with their rows
and data directories; newer ones and runs that have not ended stay. Run for real, as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.service.store import ServiceStore
from app.store.models import Run, RunState

CORRAL = Path(sys.executable).with_name("corral")


def prune(tmp_path: Path, *args: str, database: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{database or tmp_path / 'corral.db'}",
           "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    return subprocess.run(
        [str(CORRAL), "prune", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def make_runs(tmp_path: Path) -> ServiceStore:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    now = datetime.now(UTC)
    for run_id, state, days in (("old", RunState.STOPPED, 30), ("recent", RunState.COMPLETED, 1),
                                ("live", RunState.RUNNING, None)):  # fmt: skip
        store.create_run(run_id, run_id, {"kind": "sim"}, {})
        store.set_state(run_id, RunState.RUNNING)
        if state is not RunState.RUNNING:
            store.set_state(run_id, state)
        with store.session() as s:
            run = s.get(Run, run_id)
            assert run is not None
            run.ended_at = None if days is None else now - timedelta(days=days)
        (tmp_path / "data" / run_id / "offers").mkdir(parents=True)
    return store


def left(store: ServiceStore, tmp_path: Path) -> set[str]:
    runs = {r.id for r in store.list_runs()}
    assert runs == {p.name for p in (tmp_path / "data").iterdir()}  # rows and directories go together
    return runs


def test_prune_deletes_the_runs_ended_before_the_cut_off_and_never_a_live_one(tmp_path: Path) -> None:
    store = make_runs(tmp_path)
    try:
        dry = prune(tmp_path, "--older-than-days", "7", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "would delete run old" in dry.stderr
        assert "would delete 1 ended run from sqlite" in dry.stdout
        assert left(store, tmp_path) == {"old", "recent", "live"}

        once = prune(tmp_path, "--older-than-days", "7")
        assert once.returncode == 0, once.stderr
        assert "deleted 1 ended run from" in once.stdout
        assert left(store, tmp_path) == {"recent", "live"}

        every = prune(tmp_path, "--older-than-days", "0")
        assert every.returncode == 0, every.stderr
        assert left(store, tmp_path) == {"live"}
    finally:
        store.close()


@pytest.mark.parametrize("days", ["nan", "inf", "-1", "36501", "x", ""])
def test_prune_refuses_a_bad_number_of_days_in_one_line(tmp_path: Path, days: str) -> None:
    proc = prune(tmp_path, "--older-than-days", days)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "--older-than-days" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
def test_prune_of_a_database_that_does_not_exist_says_so_and_makes_none(
    tmp_path: Path, dry_run: list[str]
) -> None:
    """A prune in the wrong directory (or with a mistyped URL) made a new, empty database there and said
    it deleted 0 runs from it."""
    missing = tmp_path / "nowhere" / "corral.db"
    proc = prune(tmp_path, "--older-than-days", "7", *dry_run, database=missing)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        f"error: CORRAL_DATABASE_URL sqlite:///{missing}: no database at {missing} "
        "(`corral serve` makes one)\n"
    )
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
def test_prune_leaves_a_database_that_is_not_corrals_as_it_was(tmp_path: Path, dry_run: list[str]) -> None:
    """`check_database` migrated whatever it opened: a dry run gave another program's SQLite file (and an
    empty file) Corral's tables, then said it would delete 0 runs from it."""
    import sqlite3

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as db:
        db.execute("create table notes (body text)")
    empty = tmp_path / "empty.db"
    empty.touch()
    for database in (other, empty):
        before = database.read_bytes()
        proc = prune(tmp_path, "--older-than-days", "0", *dry_run, database=database)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr == (
            f"error: CORRAL_DATABASE_URL sqlite:///{database}: not a Corral database (it has no Corral "
            "schema; `corral serve` makes one)\n"
        )
        assert database.read_bytes() == before


def test_a_dry_run_does_not_migrate_an_older_schema_and_a_real_prune_does(tmp_path: Path) -> None:
    from alembic import command

    from app.store.migrate import alembic_config, current_revision, head_revision

    url = f"sqlite:///{tmp_path / 'corral.db'}"
    ServiceStore(url).close()
    command.downgrade(alembic_config(url), "-1")
    before = (tmp_path / "corral.db").read_bytes()
    dry = prune(tmp_path, "--older-than-days", "0", "--dry-run")
    assert dry.returncode == 2, dry.stdout + dry.stderr
    assert "not this Corral's" in dry.stderr
    assert "without --dry-run" in dry.stderr
    assert (tmp_path / "corral.db").read_bytes() == before
    real = prune(tmp_path, "--older-than-days", "0")
    assert real.returncode == 0, real.stderr
    assert "deleted 0 ended runs" in real.stdout
    store = ServiceStore(url, migrate=False)
    try:
        assert current_revision(store.engine) == head_revision()
    finally:
        store.close()


def test_a_database_host_that_is_no_host_name_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "CORRAL_DATABASE_URL": "postgresql://u:secret@bad..host/x",
           "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    proc = subprocess.run(
        [str(CORRAL), "prune", "--older-than-days", "0", "--dry-run"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr == (
        "error: CORRAL_DATABASE_URL postgresql://u:***@bad..host/x: cannot open the database: its host is "
        "not a host name\n"
    )
