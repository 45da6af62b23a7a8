"""`corral prune`: retention. Deletes the runs that ended more than `--older-than-days` days ago, with
everything stored for them (events, spans, groups, trajectories, batches, rollouts, lanes, policy
changes) and their data directories, from `CORRAL_DATABASE_URL` and `CORRAL_DATA_DIR`.

Invariant: a run that has not ended (created, running, paused, stopping) is never touched: only runs
whose stored state is an end state and whose end is older than the cut-off are listed, and each
deletion checks the state again in its own transaction (`ServiceStore.delete_run`).
"""

from __future__ import annotations

import math
import shutil
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer
from pydantic import ValidationError

from app.cli.common import check_database, fail, say, settings_problem

MAX_DAYS = 36_500.0  # a century: past it, `now - days` leaves datetime's range


def prune(
    older_than_days: Annotated[
        float,
        typer.Option(
            "--older-than-days",
            help="delete the runs that ended more than this many days ago (0: every ended run)",
        ),
    ],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list them, delete nothing")] = False,
) -> None:
    """Delete ended runs older than --older-than-days and everything stored for them."""
    from app.service.compose import store_for
    from app.service.store import RunLiveError
    from app.settings import load_settings

    if not math.isfinite(older_than_days) or not 0 <= older_than_days <= MAX_DAYS:
        fail(f"--older-than-days: {older_than_days!r} is not a number of days from 0 to {MAX_DAYS:,.0f}")
    try:
        settings = load_settings()
    except ValidationError as exc:
        fail(settings_problem(exc))
    database = check_database(settings.database_url, create=False, migrate=not dry_run)
    cutoff = datetime.now(UTC) - timedelta(days=older_than_days)
    store = store_for(settings, migrate=False)
    try:
        runs = store.ended_runs(cutoff)
        deleted = 0
        for run in runs:
            ended = datetime.fromtimestamp(run.ended_at or 0.0, UTC).isoformat(timespec="seconds")
            if dry_run:
                say(f"would delete run {run.id} ({run.name}, {run.state}, ended {ended})")
                continue
            try:
                if not store.delete_run(run.id):
                    continue  # deleted meanwhile (another prune, the API)
            except RunLiveError as exc:  # only a run resumed meanwhile: it is left alone
                say(f"kept run {run.id}: {exc}")
                continue
            shutil.rmtree(settings.data_dir / run.id, ignore_errors=True)
            if settings.spill_dir is not None:
                shutil.rmtree(settings.spill_dir / run.id, ignore_errors=True)
            deleted += 1
            say(f"deleted run {run.id} ({run.name}, {run.state}, ended {ended})")
    finally:
        store.close()
    verb = "would delete" if dry_run else "deleted"
    count = len(runs) if dry_run else deleted
    typer.echo(f"{verb} {count} ended run{'s' if count != 1 else ''} from {database}")
