"""`RunManager.delete` (the API's DELETE) and the tombstones of `app.service.retention`: an ended run's
files go with its rows; an id its database does not have keeps whatever files that id has."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.service.manager import RunManager
from app.service.retention import TOMBSTONE, MarkError, leftovers, mark, remove, run_dirs
from app.service.store import ServiceStore
from app.store.models import Run, RunState


def ended_run(store: ServiceStore, data: Path, run_id: str) -> Path:
    store.create_run(run_id, run_id, {"kind": "sim"}, {})
    store.set_state(run_id, RunState.RUNNING)
    store.set_state(run_id, RunState.STOPPED)
    with store.session() as s:
        run = s.get(Run, run_id)
        assert run is not None
        run.ended_at = datetime.now(UTC) - timedelta(days=1)
    directory = data / run_id / "offers"
    directory.mkdir(parents=True)
    (directory / "o1").write_text("x")
    return data / run_id


def test_the_api_deletes_an_ended_runs_files_and_never_those_of_an_id_it_does_not_have(
    tmp_path: Path,
) -> None:
    """A DELETE of an id this database does not have (a data directory shared with another database) removed
    that id's directory, then answered 404."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    try:
        ours = ended_run(store, tmp_path / "data", "aaaaaaaaaaaa")
        theirs = tmp_path / "data" / "bbbbbbbbbbbb"
        theirs.mkdir()
        (theirs / "kept").write_text("another database's run")
        assert manager.delete("bbbbbbbbbbbb") is False
        assert sorted(p.name for p in theirs.iterdir()) == ["kept"]  # and no tombstone left on it
        assert manager.delete("aaaaaaaaaaaa") is True
        assert not ours.exists()
    finally:
        manager.shutdown()
        store.close()


def test_a_symbolic_link_as_a_run_directory_goes_and_its_target_stays(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "weights").write_text("w")
    data = tmp_path / "data"
    data.mkdir()
    (data / "aaaaaaaaaaaa").symlink_to(target)
    dirs = run_dirs("aaaaaaaaaaaa", data, None)
    mark(dirs, "db")
    assert not (target / TOMBSTONE).exists()  # nothing written through the link
    assert remove(dirs) == []
    assert not (data / "aaaaaaaaaaaa").is_symlink()
    assert sorted(p.name for p in target.iterdir()) == ["weights"]


def test_a_directory_gone_meanwhile_counts_as_removed(tmp_path: Path) -> None:
    gone = tmp_path / "data" / "aaaaaaaaaaaa"
    assert remove([gone]) == []


def test_a_tombstone_names_its_database_by_an_id_of_its_own(tmp_path: Path) -> None:
    """Named by its URL, two databases could be one name: a SQLite `file:` URI relative to the working
    directory, a Postgres URL whose host is PGHOST's. Each database has a random id (migration 0005)."""
    one = ServiceStore(f"sqlite:///{tmp_path / 'one.db'}")
    two = ServiceStore(f"sqlite:///{tmp_path / 'two.db'}")
    try:
        first = one.instance_id()
        assert first is not None
        assert len(first) == 32
        assert first != two.instance_id()
        data = tmp_path / "data"
        (data / "aaaaaaaaaaaa").mkdir(parents=True)
        assert mark([data / "aaaaaaaaaaaa"], first, "sqlite:///one.db") == [data / "aaaaaaaaaaaa" / TOMBSTONE]
        assert leftovers(data, None, first, lambda _: False) == [data / "aaaaaaaaaaaa"]
        assert leftovers(data, None, str(two.instance_id()), lambda _: False) == []
        with pytest.raises(MarkError, match="marked for deletion by another database"):
            mark([data / "aaaaaaaaaaaa"], str(two.instance_id()))  # never marked over
        assert mark([data / "aaaaaaaaaaaa"], first) == []  # its own mark stays, and is not taken back
    finally:
        one.close()
        two.close()
    again = ServiceStore(f"sqlite:///{tmp_path / 'one.db'}")
    try:
        assert again.instance_id() == first  # the database's, not the process's
    finally:
        again.close()


def test_a_directory_that_cannot_go_gets_its_tombstone_back(tmp_path: Path) -> None:
    """The tombstone was unlinked before the directory's rmdir: a file made meanwhile (an open file's
    .nfs copy) kept the directory, and no tombstone was left for a later prune."""
    directory = tmp_path / "data" / "aaaaaaaaaaaa"
    directory.mkdir(parents=True)
    (directory / "f").write_text("x")
    mark([directory], "db")
    real_rmdir = Path.rmdir

    def late_writer(self: Path) -> None:
        (self / ".nfs0000deadbeef").write_text("held open")
        real_rmdir(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "rmdir", late_writer)
        problems = remove([directory])
    assert len(problems) == 1
    assert "Directory not empty" in problems[0]
    assert (directory / TOMBSTONE).read_text() == "db\n\n"


def test_a_run_marked_by_another_database_is_not_deleted_through_the_api(tmp_path: Path) -> None:
    """Marking that failed was logged and the rows deleted anyway: files no prune would find. Now the
    deletion is refused (the API answers 503) and the run stays whole."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    try:
        ours = ended_run(store, tmp_path / "data", "aaaaaaaaaaaa")
        (ours / TOMBSTONE).write_text("0" * 32 + "\n")  # another database's deletion, killed half-way
        with pytest.raises(MarkError, match="another database"):
            manager.delete("aaaaaaaaaaaa")
        assert store.get_run("aaaaaaaaaaaa") is not None
        assert (ours / "offers" / "o1").exists()
        assert (ours / TOMBSTONE).read_text() == "0" * 32 + "\n"
    finally:
        manager.shutdown()
        store.close()


def test_a_second_delete_leaves_the_first_ones_tombstone_for_prune(tmp_path: Path) -> None:
    """A DELETE repeated after one whose removal was cut short took the first one's tombstone back (its
    id had no row any more), and the files stayed for ever."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    try:
        ours = ended_run(store, tmp_path / "data", "aaaaaaaaaaaa")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("app.service.retention.remove", lambda dirs: ["cut short"])
            assert manager.delete("aaaaaaaaaaaa") is True
        assert (ours / TOMBSTONE).is_file()
        assert manager.delete("aaaaaaaaaaaa") is False
        assert (ours / TOMBSTONE).read_text().startswith(str(store.instance_id()))
        found = leftovers(tmp_path / "data", None, str(store.instance_id()), lambda run_id: False)
        assert found == [ours]
    finally:
        manager.shutdown()
        store.close()


def test_a_deletion_that_lost_the_race_leaves_the_winners_tombstone(tmp_path: Path) -> None:
    """Two deletions of one run (a prune and the API): the one whose rows were gone first took back the
    tombstone the other's removal relied on, so what that removal could not remove was left unmarked."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    manager = RunManager(store, tmp_path / "data", 30.0)
    try:
        ours = ended_run(store, tmp_path / "data", "aaaaaaaaaaaa")
        real_delete = store.delete_run

        def other_won(run_id: str) -> bool:
            assert real_delete(run_id)  # the other deletion's rows go first: this one finds none
            return False

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store, "delete_run", other_won)
            assert manager.delete("aaaaaaaaaaaa") is False
        assert (ours / TOMBSTONE).is_file()  # still there for the winner's removal, or the next prune
        assert leftovers(tmp_path / "data", None, str(store.instance_id()), lambda run_id: False) == [ours]
    finally:
        manager.shutdown()
        store.close()
