"""`corral prune --older-than-days N`: the runs that ended more than N days ago go, with their rows
and data directories; newer ones and runs that have not ended stay. Run for real, as a subprocess."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
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


def ended_runs(tmp_path: Path, count: int, files: int = 0) -> ServiceStore:
    """`count` runs that ended 30 days ago (12-hex ids, as the service makes), each with a data directory
    of `files` files."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    ended = datetime.now(UTC) - timedelta(days=30)
    for i in range(count):
        run_id = f"{i:012x}"
        store.create_run(run_id, f"run{i}", {"kind": "sim"}, {})
        store.set_state(run_id, RunState.RUNNING)
        store.set_state(run_id, RunState.STOPPED)
        with store.session() as s:
            run = s.get(Run, run_id)
            assert run is not None
            run.ended_at = ended
        directory = tmp_path / "data" / run_id
        directory.mkdir(parents=True)
        for j in range(files):
            (directory / f"f{j}").write_bytes(b"x")
    return store


def whole(store: ServiceStore, tmp_path: Path) -> set[str]:
    """The runs left, checked whole: each has its row and its directory, unmarked, with all its files;
    no directory is left without its row."""
    from app.service.retention import TOMBSTONE

    runs = {r.id for r in store.list_runs(limit=10_000)}
    dirs = {p.name for p in (tmp_path / "data").iterdir()}
    assert dirs == runs
    for run_id in runs:
        assert not (tmp_path / "data" / run_id / TOMBSTONE).exists()
    return runs


RUNS = 40


def prune_stopped(tmp_path: Path, *stops: tuple[int, float]) -> subprocess.CompletedProcess[str]:
    """`corral prune` of `RUNS` ended runs in a session of its own, sent each (signal, then a pause) of
    `stops` to its process group once the first run is deleted; its output, once it has ended."""
    env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
           "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    args = [str(CORRAL), "prune", "--older-than-days", "7"]
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # the first run deleted: the work is under way
        assert first.startswith("deleted run "), first
        for sig, pause_s in stops:
            os.killpg(proc.pid, sig)
            time.sleep(pause_s)
        out, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out, first + rest)


def check_stopped(done: subprocess.CompletedProcess[str], store: ServiceStore, tmp_path: Path) -> None:
    """A prune stopped between two runs: what is left is whole, and it said how many it deleted."""
    deleted = RUNS - len(whole(store, tmp_path))
    assert done.returncode == 130, done.stderr
    assert 0 < deleted < RUNS
    assert "Traceback" not in done.stderr
    runs = "run" if deleted == 1 else "runs"
    assert done.stdout == f"deleted {deleted} ended {runs} from sqlite:///{tmp_path / 'corral.db'}\n"
    said = f"interrupted: {deleted} of {RUNS} ended runs deleted; the rest are untouched"
    assert done.stderr.splitlines()[-1] == said


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_ends_prune_between_two_runs_and_says_what_it_did(tmp_path: Path, sig: int) -> None:
    """A Ctrl-C to the process group (and SIGTERM, SIGHUP) landed between a run's rows and its files: in
    3 of 7 tries a run's rows were gone and its directory half-deleted, never to be removed; SIGTERM and
    SIGHUP killed prune without a word."""
    store = ended_runs(tmp_path, RUNS, files=300)
    try:
        check_stopped(prune_stopped(tmp_path, (sig, 0.0)), store, tmp_path)
        again = prune(tmp_path, "--older-than-days", "7")
        assert again.returncode == 0, again.stderr
        assert whole(store, tmp_path) == set()
    finally:
        store.close()


def test_prune_removes_what_an_earlier_deletion_left_and_nothing_else(tmp_path: Path) -> None:
    """A deletion cut short after its rows (kill -9, a file it could not remove) left its marked directory
    behind, and no later prune looked at directories without rows."""
    from app.service.retention import TOMBSTONE

    store = ended_runs(tmp_path, 2)
    data = tmp_path / "data"
    ours = f"{store.instance_id()}\nsqlite:///...\n"
    (data / "aaaaaaaaaaaa" / "offers").mkdir(parents=True)  # marked, its rows gone: left behind
    (data / "aaaaaaaaaaaa" / TOMBSTONE).write_text(ours)
    (data / "bbbbbbbbbbbb").mkdir()  # not marked: another database's run, perhaps; never ours to take
    (data / "000000000000" / TOMBSTONE).write_text(ours)  # marked, but its run is still there: a run
    try:
        dry = prune(tmp_path, "--older-than-days", "7", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert f"would remove {data / 'aaaaaaaaaaaa'}: left by the deletion of run aaaaaaaaaaaa" in dry.stderr
        assert dry.stdout.endswith("; would remove 1 directory left by earlier deletions\n")
        assert (data / "aaaaaaaaaaaa").exists()
        real = prune(tmp_path, "--older-than-days", "7")
        assert real.returncode == 0, real.stderr
        database = f"sqlite:///{tmp_path / 'corral.db'}"
        summary = f"deleted 2 ended runs from {database}; removed 1 directory left by earlier deletions\n"
        assert real.stdout == summary
        assert {p.name for p in data.iterdir()} == {"bbbbbbbbbbbb"}
        assert store.list_runs() == []
    finally:
        store.close()


@pytest.mark.parametrize("has_id", [True, False])
def test_a_read_only_database_is_one_line_and_keeps_every_run_whole(tmp_path: Path, has_id: bool) -> None:
    """A database prune may read but not write ended in a traceback (OperationalError); the URI form made a
    directory named 'file:' in the working directory. A database without its id yet is refused before
    any run is touched (exit 2); one with it fails at its first deletion (exit 1)."""
    store = ended_runs(tmp_path, 2, files=2)
    if has_id:
        store.instance_id()
    env = {**os.environ, "CORRAL_DATA_DIR": str(tmp_path / "data"),
           "CORRAL_DATABASE_URL": f"sqlite:///file:{tmp_path / 'corral.db'}?mode=ro&uri=true"}  # fmt: skip
    shown = "sqlite:///file%3A" + str(tmp_path / "corral.db") + "?mode=ro&uri=true"  # as SQLAlchemy shows it
    try:
        proc = subprocess.run(
            [str(CORRAL), "prune", "--older-than-days", "0"], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert "Traceback" not in proc.stderr
        if has_id:
            assert proc.returncode == 1, proc.stderr
            assert proc.stderr.splitlines()[-1] == (
                f"error: cannot delete run 000000000000 from {shown}: attempt to write a readonly database"
            )
            assert proc.stdout == f"deleted 0 ended runs from {shown}\n"
        else:
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr == (
                f"error: CORRAL_DATABASE_URL {shown}: cannot write to the database: attempt to write a "
                "readonly database; nothing deleted\n"
            )
            assert proc.stdout == ""
        assert not (tmp_path / "file:").exists()
        assert whole(store, tmp_path) == {"000000000000", "000000000001"}
    finally:
        store.close()


def test_a_data_directory_prune_cannot_change_is_refused_before_any_row_goes(tmp_path: Path) -> None:
    """Its rows were deleted, the directories stayed (rmtree's errors ignored), and it said 'deleted'."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a read-only bind mount (permission bits do not stop root)")
    store = ended_runs(tmp_path, 2, files=2)
    data, view = tmp_path / "data", tmp_path / "ro"
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(data), str(view)], capture_output=True, check=False)
    if mounted.returncode != 0:
        store.close()
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True, capture_output=True)
        env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
               "CORRAL_DATA_DIR": str(view)}  # fmt: skip
        proc = subprocess.run(
            [str(CORRAL), "prune", "--older-than-days", "0"], env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert (
            proc.stderr == f"error: CORRAL_DATA_DIR: cannot create files in {view}: Read-only file system\n"
        )
        assert whole(store, tmp_path) == {"000000000000", "000000000001"}
    finally:
        subprocess.run(["umount", str(view)], check=False)
        store.close()


def test_a_summary_that_cannot_be_written_is_one_line_after_the_work(tmp_path: Path) -> None:
    store = ended_runs(tmp_path, 1)
    env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
           "CORRAL_DATA_DIR": str(tmp_path / "data")}  # fmt: skip
    try:
        with open("/dev/full", "w") as full:
            proc = subprocess.run(
                [str(CORRAL), "prune", "--older-than-days", "0"], env=env, stdout=full,
                stderr=subprocess.PIPE, text=True, timeout=120, check=False,
            )  # fmt: skip
        assert proc.returncode == 1
        assert proc.stderr.splitlines()[-1] == (
            "error: cannot write the report to standard output: No space left on device"
        )
        assert whole(store, tmp_path) == set()
    finally:
        store.close()


@pytest.mark.parametrize("days", ["1_0", " 7 ", "1e400", "+"])
def test_days_are_a_plain_decimal_number(tmp_path: Path, days: str) -> None:
    proc = prune(tmp_path, "--older-than-days", days, "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert f"{days!r}" in proc.stderr
    assert "number of days" in proc.stderr


def chattr(flag: str, path: Path) -> bool:
    """`chattr +i/-i path` (an immutable file: not even root removes it); False where it cannot be."""
    if os.geteuid() != 0:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False).returncode == 0


def test_a_removal_cut_short_keeps_its_tombstone_and_the_next_prune_finishes_it(tmp_path: Path) -> None:
    """rmtree removed the tombstone with the rest, so the directory a file it could not remove kept was
    no later prune's: 'a later prune tries again' was not true."""
    from app.service.retention import TOMBSTONE

    store = ended_runs(tmp_path, 2, files=3)
    stuck = tmp_path / "data" / "000000000000" / "offers" / "o1"
    stuck.parent.mkdir()
    stuck.write_text("x")
    if not chattr("+i", stuck):
        store.close()
        pytest.skip("needs root and a file system with immutable files (chattr +i)")
    try:
        first = prune(tmp_path, "--older-than-days", "0")
        assert first.returncode == 1, first.stderr
        assert "deleted run 000000000000 (run0, stopped, ended" in first.stderr
        assert "but not all of its files" in first.stderr
        assert (tmp_path / "data" / "000000000000" / TOMBSTONE).is_file()
        assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["000000000000"]
        chattr("-i", stuck)
        second = prune(tmp_path, "--older-than-days", "0")
        assert second.returncode == 0, second.stderr
        assert f"removed {tmp_path / 'data' / '000000000000'}: left by the deletion of run" in second.stderr
        assert list((tmp_path / "data").iterdir()) == []
    finally:
        chattr("-i", stuck)
        store.close()


def test_a_tombstone_of_another_database_is_never_taken(tmp_path: Path) -> None:
    """Two databases, one data directory: a tombstone left on database A's run (a prune killed between
    marking and deleting) was taken by database B's prune, which has no row for it, and A's files went."""
    from app.service.retention import TOMBSTONE

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    store_a = ended_runs(a, 1, files=2)
    store_b = ServiceStore(f"sqlite:///{b / 'corral.db'}")
    mark = a / "data" / "000000000000" / TOMBSTONE
    mark.write_text(f"{store_a.instance_id()}\n")
    try:
        env = {**os.environ, "CORRAL_DATABASE_URL": f"sqlite:///{b / 'corral.db'}",
               "CORRAL_DATA_DIR": str(a / "data")}  # fmt: skip
        proc = subprocess.run(
            [str(CORRAL), "prune", "--older-than-days", "0"], env=env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == f"deleted 0 ended runs from sqlite:///{b / 'corral.db'}\n"
        assert sorted(p.name for p in (a / "data" / "000000000000").iterdir()) == [TOMBSTONE, "f0", "f1"]
        # A's own prune: its run still has its row, so the run is deleted as a run, files and all.
        own = prune(a, "--older-than-days", "0")
        assert own.returncode == 0, own.stderr
        assert list((a / "data").iterdir()) == []
    finally:
        store_a.close()
        store_b.close()


@pytest.mark.parametrize("gap_s", [0.002, 0.005, 0.02])
def test_ctrl_c_twice_still_says_what_prune_did(tmp_path: Path, gap_s: float) -> None:
    """A second press a few ms after the first landed as the store closed: no count on stdout, just
    'interrupted', and 2 of 3 times SQLAlchemy's 'Exception closing connection' traceback."""
    store = ended_runs(tmp_path, RUNS, files=300)
    try:
        check_stopped(prune_stopped(tmp_path, (signal.SIGINT, gap_s), (signal.SIGINT, 0.0)), store, tmp_path)
    finally:
        store.close()


def test_an_entry_prune_may_not_look_at_is_skipped_with_a_note(tmp_path: Path) -> None:
    """A root-owned lost+found (mode 700) in a data directory on its own volume made a prune run as
    another user end in a PermissionError traceback, --dry-run too."""
    from app.service.retention import leftovers

    if os.geteuid() != 0:
        pytest.skip("needs root, to look as another user at a directory only root may read")
    # Under /tmp itself: pytest's own directories are only root's, so another user could not even look in
    base = Path(tempfile.mkdtemp(prefix="corral-prune-", dir="/tmp"))
    base.chmod(0o755)
    data = base / "data"
    (data / "lost+found").mkdir(parents=True, mode=0o700)
    data.chmod(0o755)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's result goes through the pipe
        try:
            os.setgid(65534)
            os.setuid(65534)
            seen: list[str] = []
            found = leftovers(data, None, "db", lambda run_id: False, seen)
            os.write(write, repr((found, seen)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(child, 0)
    shutil.rmtree(base)
    assert answer == repr(([], [f"{data / 'lost+found'}: Permission denied"]))
