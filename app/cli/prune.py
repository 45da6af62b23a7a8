"""`corral prune`: retention. Deletes the runs that ended more than `--older-than-days` days ago, with
everything stored for them (events, spans, groups, trajectories, batches, rollouts, lanes, policy
changes) and their data directories, from `CORRAL_DATABASE_URL` and `CORRAL_DATA_DIR` (and
`CORRAL_SPILL_DIR` when set). It also removes what an earlier deletion left on disk: a directory marked
for deletion whose run has no row any more (`app.service.retention`).

Invariants:
- a run that has not ended (created, running, paused, stopping) is never touched: only runs whose
  stored state is an end state and whose end is older than the cut-off are listed, and each deletion
  checks the state again in its own transaction (`ServiceStore.delete_run`);
- a run's rows are deleted only once each of its directories is marked for deletion, so a directory
  this process cannot change keeps its run whole, and one whose removal stops half-way (a crash, a
  file it may not remove) is finished by a later prune;
- Ctrl-C, SIGTERM and SIGHUP stop it between two runs, never inside one: what it did is said, exit 130;
- a data directory it cannot create files in is refused before anything is deleted.
"""

from __future__ import annotations

import contextlib
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError

from app import early_signals
from app.cli.common import (
    FAILED,
    check_database,
    check_run_dirs,
    database_reason,
    decimal_parser,
    fail,
    say,
    settings_problem,
    write_stdout,
)
from app.service import retention

if TYPE_CHECKING:
    from app.service.store import RunRecord, ServiceStore
    from app.settings import Settings

MAX_DAYS = 36_500.0  # a century: past it, `now - days` leaves datetime's range


def prune(
    older_than_days: Annotated[
        float,
        typer.Option(
            "--older-than-days",
            help="delete the runs that ended more than this many days ago (0: every ended run)",
            parser=decimal_parser("days", "30 or 0.5"),
        ),
    ],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list them, delete nothing")] = False,
) -> None:
    """Delete ended runs older than --older-than-days and everything stored for them."""
    from app.service.compose import store_for
    from app.settings import load_settings

    if not math.isfinite(older_than_days) or not 0 <= older_than_days <= MAX_DAYS:
        fail(f"--older-than-days: {older_than_days:g} is not a number of days from 0 to {MAX_DAYS:,.0f}")
    try:
        settings = load_settings()
    except ValidationError as exc:
        fail(settings_problem(exc))
    database = check_database(settings.database_url, create=False, migrate=not dry_run)
    if not dry_run:  # before any row goes: a directory it cannot change would outlive its rows
        check_run_dirs(*(d if d is not None and d.is_dir() else None for d in _roots(settings)))
    if not settings.data_dir.is_dir():
        say(f"note: CORRAL_DATA_DIR {settings.data_dir} does not exist: runs' files elsewhere stay there")
    cutoff = datetime.now(UTC) - timedelta(days=older_than_days)
    store = store_for(settings, migrate=False)
    stopped: list[bool] = []
    # Ctrl-C (and SIGTERM, SIGHUP) stop the work between two runs, never inside one; a second press is
    # ignored until the summary is out (landing in the store's close, it cost the count, and a traceback).
    with early_signals.interruptible_once(on_first=lambda: stopped.append(True)):
        pruned = _Prune(store, settings, database, dry_run, stopped)
        try:
            pruned.run(cutoff)
        finally:
            store.close()
        pruned.finish()


def _instance_id(store: ServiceStore, database: str, dry_run: bool) -> str:
    """The database's own id, for its tombstones (`retention`); a dry run makes none (it writes
    nothing, and finds no leftover of a database that never had one). A database prune may not write
    is refused here, before any run is touched."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return store.instance_id(create=not dry_run) or ""
    except SQLAlchemyError as exc:
        reason = database_reason(exc)
        store.close()
        fail(f"CORRAL_DATABASE_URL {database}: cannot write to the database: {reason}; nothing deleted")


def _roots(settings: Settings) -> tuple[Path, Path | None]:
    return settings.data_dir, settings.spill_dir


class _Prune:
    """One prune's work and its tally."""

    def __init__(
        self, store: ServiceStore, settings: Settings, database: str, dry_run: bool, stopped: list[bool]
    ) -> None:
        self.store = store
        self.data_dir, self.spill_dir = _roots(settings)
        self.database = database
        self.identity = _instance_id(store, database, dry_run)
        self.dry_run = dry_run
        self.stopped = stopped
        self.listed = 0
        self.deleted = 0
        self.incomplete = 0
        self.leftovers = 0

    def run(self, cutoff: datetime) -> None:
        # What earlier deletions left, found before this one's own deletions can leave anything.
        unreadable: list[str] = []
        left = retention.leftovers(self.data_dir, self.spill_dir, self.identity, self._has_run, unreadable)
        if unreadable:
            say(f"note: skipped what could not be looked at: {_first(unreadable)}")
        runs = self.store.ended_runs(cutoff)
        self.listed = len(runs)
        for run in runs:
            if self.stopped:
                return
            self._delete(run)
        for directory in left:
            if self.stopped:
                return
            if self.dry_run:
                say(f"would remove {directory}: left by the deletion of run {directory.name}")
                self.leftovers += 1
                continue
            problems = retention.remove([directory])
            if problems:
                say(f"could not remove all of {directory}, left by the deletion of run {directory.name}: "
                    f"{_first(problems)}")  # fmt: skip
                self.incomplete += 1
            else:
                say(f"removed {directory}: left by the deletion of run {directory.name}")
                self.leftovers += 1

    def _has_run(self, run_id: str) -> bool:
        return self.store.get_run(run_id) is not None

    def _unmark_if_there(self, run_id: str, made: list[Path]) -> None:
        """Take back the tombstones of a run whose deletion failed, if its row is there to say it is not
        gone (a tombstone beside a row is inert: only a run without one is a leftover)."""
        from sqlalchemy.exc import SQLAlchemyError

        with contextlib.suppress(SQLAlchemyError):
            if self._has_run(run_id):
                retention.unmark(made)

    def _delete(self, run: RunRecord) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        from app.service.store import RunLiveError

        ended = datetime.fromtimestamp(run.ended_at or 0.0, UTC).isoformat(timespec="seconds")
        what = f"run {run.id} ({run.name}, {run.state}, ended {ended})"
        if self.dry_run:
            say(f"would delete {what}")
            return
        dirs = retention.run_dirs(run.id, self.data_dir, self.spill_dir)
        try:
            made = retention.mark(dirs, self.identity, self.database)
        except retention.MarkError as exc:
            say(f"kept {what}: cannot mark its directory for deletion: {exc}")
            return
        try:
            gone = self.store.delete_run(run.id)
        except RunLiveError as exc:  # only a run resumed meanwhile: it is left alone
            retention.unmark(made)
            say(f"kept run {run.id}: {exc}")
            return
        except SQLAlchemyError as exc:
            self._unmark_if_there(run.id, made)
            reason = database_reason(exc)
            self._summary()
            fail(f"cannot delete run {run.id} from {self.database}: {reason}", FAILED)
        if not gone:  # deleted meanwhile (another prune, the API): the tombstones may serve its removal
            return
        self.deleted += 1
        problems = retention.remove(dirs)
        if problems:
            self.incomplete += 1
            say(f"deleted {what}, but not all of its files: {_first(problems)}; a later prune tries again")
        else:
            say(f"deleted {what}")

    def _summary(self) -> None:
        """The one line on standard output: what was (or would be) deleted."""
        verb = "would delete" if self.dry_run else "deleted"
        count = self.listed if self.dry_run else self.deleted
        line = f"{verb} {count} ended run{'s' if count != 1 else ''} from {self.database}"
        if self.leftovers:
            removed = "would remove" if self.dry_run else "removed"
            line += f"; {removed} {_directories(self.leftovers)} left by earlier deletions"
        write_stdout(line + "\n")

    def finish(self) -> None:
        self._summary()
        if self.stopped:
            early_signals.stopping()
            say(f"interrupted: {self.deleted} of {self.listed} ended runs deleted; the rest are untouched")
            raise typer.Exit(130)
        if self.incomplete:
            fail(f"{_directories(self.incomplete)} could not be removed "
                 "in full (above); they are marked, and a later prune removes them", FAILED)  # fmt: skip


def _first(problems: list[str]) -> str:
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more)" if more else "")


def _directories(n: int) -> str:
    return f"{n} director{'ies' if n != 1 else 'y'}"
