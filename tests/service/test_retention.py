"""`RunManager.delete` (the API's DELETE) and the tombstones of `app.service.retention`: an ended run's
files go with its rows; an id its database does not have keeps whatever files that id has."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.service.manager import RunManager
from app.service.retention import TOMBSTONE, database_identity, leftovers, mark, remove, run_dirs
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


def test_the_database_a_tombstone_names_is_one_however_its_sqlite_path_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert database_identity("sqlite:///corral.db") == database_identity(
        f"sqlite:///{tmp_path / 'corral.db'}"
    )
    assert database_identity("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    data = tmp_path / "data"
    (data / "aaaaaaaaaaaa").mkdir(parents=True)
    mark([data / "aaaaaaaaaaaa"], database_identity("sqlite:///corral.db"))
    assert leftovers(data, None, database_identity(f"sqlite:///{tmp_path}/corral.db"), lambda _: False) == [
        data / "aaaaaaaaaaaa"
    ]
    assert leftovers(data, None, database_identity("sqlite:///other.db"), lambda _: False) == []
