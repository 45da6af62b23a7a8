"""Deleting a run's files with its rows, so that neither outlives the other unnoticed.

A run's rows go in one transaction (`ServiceStore.delete_run`); its directories (under the data
directory, and under the spill directory when one is set) go after, file by file, which a crash, a
`kill -9` or a file the process may not remove can stop half-way. So before the rows go, each of the
run's directories is marked with a tombstone file. A directory that holds a tombstone and whose run
has no row any more is what a deletion left behind, and the next `corral prune` removes it; one whose
run still has its row (the deletion never happened, or was refused) is left alone, since the run is
still there. A directory without a tombstone is never removed for lack of a row: a data directory
shared by two servers with different databases holds the other's runs.

Invariant: `corral prune` deletes no row while one of its run's directories could not be marked
(`mark` raises first), so a read-only data directory keeps both the rows and the files. The API's
deletion (`Manager.delete`) goes on and logs it, as it always removed what it could.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

TOMBSTONE = ".corral-deleted"


def run_dirs(run_id: str, data_dir: Path, spill_dir: Path | None) -> list[Path]:
    """The run's directories that exist, the spill's first (the data directory, removed last, keeps
    its tombstone until the rest has gone)."""
    roots = dict.fromkeys(root for root in (spill_dir, data_dir) if root is not None)  # one, if the same
    return [root / run_id for root in roots if (root / run_id).is_dir()]


def mark(dirs: Iterable[Path]) -> None:
    """A tombstone in each of `dirs`; OSError (and the tombstones made so far taken back) when one
    cannot be made: the rows must then stay."""
    made: list[Path] = []
    try:
        for directory in dirs:
            stone = directory / TOMBSTONE
            stone.touch()
            made.append(stone)
    except OSError:
        unmark(made)
        raise


def unmark(dirs_or_stones: Iterable[Path]) -> None:
    """Take the tombstones back (the run's deletion was refused: it is still there)."""
    for path in dirs_or_stones:
        stone = path if path.name == TOMBSTONE else path / TOMBSTONE
        with contextlib.suppress(OSError):
            stone.unlink()


def remove(dirs: Iterable[Path]) -> list[str]:
    """Remove `dirs` (tombstone last, with its directory); what could not be removed, in words (empty:
    everything went). A failure leaves the tombstone, so a later prune tries again."""
    problems: list[str] = []

    def failed(function: Callable[..., object], path: str, info: tuple[type, BaseException, object]) -> None:
        exc = info[1]
        problems.append(f"{path}: {getattr(exc, 'strerror', None) or exc}")

    for directory in dirs:
        shutil.rmtree(directory, onerror=failed)
    return problems


def leftovers(data_dir: Path, spill_dir: Path | None, has_run: Callable[[str], bool]) -> list[Path]:
    """The tombstoned directories whose run has no row any more: what deletions left behind."""
    found: list[Path] = []
    for root in dict.fromkeys(root for root in (spill_dir, data_dir) if root is not None):
        if not root.is_dir():
            continue
        for directory in sorted(root.iterdir()):
            if (directory / TOMBSTONE).is_file() and not has_run(directory.name):
                found.append(directory)
    return found
