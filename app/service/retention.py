"""Deleting a run's files with its rows, so that neither outlives the other unnoticed.

A run's rows go in one transaction (`ServiceStore.delete_run`); its directories (under the data
directory, and under the spill directory when one is set) go after, file by file, which a crash, a
`kill -9` or a file the process may not remove can stop half-way. So before the rows go, each of the
run's directories is marked with a tombstone file naming the database by its own random id
(`ServiceStore.instance_id`, in the one-row table of migration 0005: a URL names a database only
roughly). A directory
whose tombstone names this database and whose run has no row in it any more is what a deletion left
behind, and the next `corral prune` removes it. One whose run still has its row (the
deletion never happened, or was refused) is left alone, and so is one whose tombstone names another
database: a data directory shared by two servers with different databases holds the other's runs, and
only that database can say whether a run is gone. A directory without a tombstone is never removed for
lack of a row.

Invariants:
- no row is deleted while one of its run's directories could not be marked (`mark` raises first), by
  `corral prune` or the API (`RunManager.delete`), so a read-only data directory keeps both the rows
  and the files; a directory marked by another database's deletion is not marked over;
- only a run this database has is marked, and a deletion takes back only the tombstones it made, and
  only while the run's row is there to say it is not gone (a tombstone beside a row is inert; one
  taken from a run another deletion removed meanwhile left that removal's leftovers unmarked);
- the tombstone is the last thing removed from a directory, and is put back if the directory itself
  cannot go, so a removal that stopped half-way leaves it for the next prune;
- a run directory that is a symbolic link is never followed: the link goes, what it points to stays.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

TOMBSTONE = ".corral-deleted"


class MarkError(OSError):
    """A run directory that could not be marked for deletion: the run's rows must stay. `foreign`: it
    is marked by another database's deletion already (a retry will not do), else the disk refused."""

    foreign = False


def _named(stone: Path) -> str | None:
    """The database id a tombstone names (its first line), or None where it names none."""
    try:
        first = stone.read_text(errors="replace").partition("\n")[0].strip()
    except FileNotFoundError:
        return None
    return first or None


def _roots(data_dir: Path, spill_dir: Path | None) -> list[Path]:
    """Where runs' directories are: the spill's first, then the data directory (one, if the same)."""
    return list(dict.fromkeys(root for root in (spill_dir, data_dir) if root is not None))


def run_dirs(run_id: str, data_dir: Path, spill_dir: Path | None) -> list[Path]:
    """The run's directories that exist (a symbolic link counts, as itself), the spill's first."""
    return [p for root in _roots(data_dir, spill_dir) if (p := root / run_id).is_symlink() or p.is_dir()]


def mark(dirs: Iterable[Path], database: str, shown: str = "") -> list[Path]:
    """A tombstone naming `database` (its id; `shown`, the URL with any password hidden, on a second line
    for whoever looks) in each of `dirs`, none in a symbolic link's target; returns those it made, for
    `unmark`. `MarkError` (an OSError), and the ones made so far taken back, when one cannot be made
    or another database's deletion marked the directory already: the rows must then stay."""
    made: list[Path] = []
    try:
        for directory in dirs:
            if directory.is_symlink():
                continue
            stone = directory / TOMBSTONE
            named = _named(stone)
            if named is not None and named != database:
                refused = MarkError(f"{directory} is marked for deletion by another database ({named})")
                refused.foreign = True
                raise refused
            stone.write_text(f"{database}\n{shown}\n")
            if named is None:
                made.append(stone)  # one this database had put there before stays (its run is gone)
    except OSError as exc:
        unmark(made)
        if isinstance(exc, MarkError):
            raise
        raise MarkError(f"{directory}: {exc.strerror or exc}") from exc
    return made


def unmark(stones: Iterable[Path]) -> None:
    """Take back the tombstones `mark` made (the run's deletion was refused, or never happened: it is
    still there)."""
    for stone in stones:
        with contextlib.suppress(OSError):
            stone.unlink()


def remove(dirs: Iterable[Path]) -> list[str]:
    """Remove `dirs`: everything in each but its tombstone, then the tombstone and the directory (a
    symbolic link: the link alone). What could not be removed, in words (empty: everything went; what
    is gone already counts as removed). A failure leaves the tombstone, so a later prune tries again."""
    problems: list[str] = []

    def failed(path: str | os.PathLike[str], exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):  # gone meanwhile (another prune, the API)
            problems.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")

    for directory in dirs:
        before = len(problems)
        try:
            if directory.is_symlink():
                directory.unlink()
                continue
            children = [child for child in directory.iterdir() if child.name != TOMBSTONE]
        except OSError as exc:
            failed(directory, exc)
            continue
        for child in children:
            try:
                if child.is_dir() and not child.is_symlink():
                    _rmtree(child, failed)
                else:
                    child.unlink()
            except OSError as exc:
                failed(child, exc)
        if len(problems) > before:
            continue  # the tombstone stays
        stone = directory / TOMBSTONE
        try:
            kept = stone.read_bytes() if stone.exists() else None
            stone.unlink(missing_ok=True)
        except OSError as exc:
            failed(directory, exc)
            continue
        try:
            directory.rmdir()
        except OSError as exc:  # a file made meanwhile (an open file's .nfs copy): the tombstone goes back
            failed(directory, exc)
            if kept is not None and not isinstance(exc, FileNotFoundError):
                with contextlib.suppress(OSError):
                    stone.write_bytes(kept)
    return problems


def _rmtree(path: Path, failed: Callable[[str, BaseException], None]) -> None:
    """`shutil.rmtree`, each failure handed to `failed` and the rest removed (`onexc` from 3.12, where
    `onerror` is deprecated)."""
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=lambda _fn, p, exc: failed(p, exc))
    else:

        def onerror(_fn: Any, p: str, info: tuple[type, BaseException, Any]) -> None:
            failed(p, info[1])

        shutil.rmtree(path, onerror=onerror)


def leftovers(
    data_dir: Path,
    spill_dir: Path | None,
    database: str,
    has_run: Callable[[str], bool],
    unreadable: list[str] | None = None,
) -> list[Path]:
    """The directories whose tombstone names `database` and whose run has no row any more: what
    deletions left behind. An entry that cannot be looked at (a root-owned `lost+found`, a stale
    mount) is skipped, and named in `unreadable`."""
    found: list[Path] = []
    for root in _roots(data_dir, spill_dir):
        try:
            entries = sorted(root.iterdir()) if root.is_dir() else []
        except OSError as exc:
            if unreadable is not None:
                unreadable.append(f"{root}: {exc.strerror or exc}")
            continue
        for directory in entries:
            try:
                stone = directory / TOMBSTONE
                if directory.is_symlink() or not stone.is_file():
                    continue
                named = _named(stone)
            except OSError as exc:
                if unreadable is not None:
                    unreadable.append(f"{directory}: {exc.strerror or exc}")
                continue
            if named == database and not has_run(directory.name):
                found.append(directory)
    return found
