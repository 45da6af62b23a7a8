"""`corral serve`: the API on http://HOST:PORT with the embedded default (SQLite, in-process lanes).

`--demo` also starts a demo run collecting batches with the built-in sentinel trainer: embedded engines,
local sandboxes and the built-in tasks (`--demo-kind local`, the default), or a simulated workload
(`--demo-kind sim`). The URL and the operator token are printed at start, and the demo run's
dashboard page once it is created; a token generated here (CORRAL_OPERATOR_TOKEN unset) lasts as long
as the process.

Ctrl-C (or SIGTERM) stops every run and flushes its events (app.api.graceful), within a bound
(app.service.manager's `SHUTDOWN_BOUND_S`, after `STOP_WAIT_S` for open requests); a second one stops at
once, leaving the runs not yet stopped as stored. After that, or a crash (kill -9), the next start
resumes the runs that were executing.

One `corral serve` per database (`hold_database`): a second one is refused at start. On Postgres the hold
is a lock on a connection of its own; if that connection is lost (Postgres restarted, the backend
terminated), the hold is taken again as soon as the database answers, `/healthz` failing meanwhile. If
another `corral serve` took the database in between, this one stops at once, writing nothing more, and
exits with status 3 (`_database_taken`).

A standard error it cannot write at start (a full disk, a pipe whose reader is gone, closed) is status 4
and one line on standard output: not started (`_not_started`). Lost while it serves, it serves on.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from app.cli.common import (
    check_database,
    check_run_dirs,
    fail,
    on_stdout,
    say,
    settings_problem,
    stderr_lost,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from fastapi import FastAPI

    from app.service.schemas import RunCreate
    from app.store.db import DatabaseHold

log = logging.getLogger(__name__)


def serve(
    host: Annotated[
        str | None, typer.Option(help="address to listen on; default CORRAL_HOST or 127.0.0.1")
    ] = None,
    port: Annotated[
        int | None, typer.Option(min=1, max=65535, help="port; default CORRAL_PORT or 8000")
    ] = None,
    demo: Annotated[bool, typer.Option("--demo", help="start a demo run collecting batches")] = False,
    demo_kind: Annotated[str, typer.Option(help="demo run: local (embedded engines) or sim")] = "local",
) -> None:
    """Serve the control plane: runs, the trainer API, /metrics, /healthz and the docs at /docs."""
    if (lost := stderr_lost()) is not None:  # before it opens a file, which would take descriptor 2
        _not_started(lost)
    from app.api.app import create_app
    from app.api.graceful import GracefulServer, held_stops
    from app.settings import load_settings

    overrides: dict[str, object] = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    try:
        settings = load_settings(**overrides)
    except ValidationError as exc:
        fail(settings_problem(exc, {name: f"--{name}" for name in overrides}))
    if demo_kind not in ("local", "sim"):
        fail(f"--demo-kind: {demo_kind!r} is not one of local, sim")
    if demo_kind != "local" and not demo:  # it was ignored without a word, and no demo run started
        fail(f"--demo-kind {demo_kind}: only with --demo (it picks the demo run's kind)")
    from app.engines.embedded.__main__ import port_problem

    # Before the database, the demo run and its engines: uvicorn would find it only after all of them.
    named = {  # where each came from: its flag, else its setting (the default when that is unset too)
        name: f"--{name}" if given is not None or f"CORRAL_{name.upper()}" not in os.environ
        else f"CORRAL_{name.upper()}"
        for name, given in (("host", host), ("port", port))
    }  # fmt: skip
    problem = port_problem(settings.host, settings.port, named["host"], named["port"])
    if problem is not None:
        fail(problem)
    check_run_dirs(settings.data_dir, settings.spill_dir)
    spec = None
    if demo:
        spec = demo_run(demo_kind)
    holds: list[DatabaseHold] = []

    def take_hold(shown: str) -> None:  # before the migration: a refused server has migrated nothing
        holds.append(hold_database(settings.database_url, shown))

    database = check_database(settings.database_url, before_writing=take_hold)
    hold = holds[0]
    url = f"http://{settings.host}:{settings.port}"
    say(f"corral serve: {url}  (docs {url}/docs, metrics {url}/metrics)")
    if (lost := stderr_lost()) is not None:  # nothing it says would be seen: the token, a warning
        _not_started(lost)
    lanes = "in-process"
    if settings.broker_url:
        lanes = f"celery on {settings.broker_url}, hosts {settings.lane_hosts}"
    say(f"database: {database}; lanes: {lanes}")
    if settings.operator_token_generated:
        say(f"operator token (generated for this process): {settings.operator_token}")
    else:
        say("operator token: from CORRAL_OPERATOR_TOKEN")
    from app.metrics import empty_multiprocess_dir, multiprocess_dir

    emptied = empty_multiprocess_dir()  # before create_app builds the metrics
    if emptied is not None:
        say(f"metrics: emptied {multiprocess_dir()} ({len(emptied)} files of the previous run)")
    elif multiprocess_dir() is not None:
        say(f"metrics: {multiprocess_dir()} left as is (other processes write there, or it does not exist)")
    until = "; the demo run collects batches until then" if spec is not None else ""
    with held_stops() as early:  # a Ctrl-C from the line below on is the server's clean stop
        if settings.keeps_runs:
            say(f"Ctrl-C stops the server; its runs are left to the next start, which resumes them{until}")
        else:
            say(f"Ctrl-C stops the server and the runs it executes{until}")
        app = create_app(settings, demo=spec, hold=hold)
        hold.watch(on_taken=_database_taken)
        if spec is not None:
            _say_demo_page(app, spec, url)
        # Not uvicorn.run: a second Ctrl-C there skips the app's shutdown, which stops the runs.
        server = GracefulServer(
            app,
            on_stop=app.state.stopping.set,
            on_force=lambda: _abandon(app),
            early=early,
            keep_runs=settings.keeps_runs,
            host=settings.host,
            port=settings.port,
            log_level="warning",
        )
        server.run()
    _say_goodbye(app, database)
    hold.release()
    # The interpreter's last garbage collection walks every object the runs left (events buffered for
    # a store far behind, their live views): after a second Ctrl-C under load the process spent 12 s
    # and more in it after the goodbye line. Nothing left needs collecting: the process is ending.
    gc.freeze()


def hold_database(url: str, shown: str) -> DatabaseHold:
    """The database, held for this process's life: a second `corral serve` on it would resume and drive
    this one's runs too, writing two timelines into each run's one event stream."""
    from app.store.db import DatabaseHeld, DatabaseHold

    try:
        return DatabaseHold(url)
    except OSError as exc:  # a SQLite file's lock beside it, in a directory it cannot write
        fail(f"CORRAL_DATABASE_URL {shown}: cannot open the database: cannot lock it: {exc}")
    except DatabaseHeld as exc:
        fail(
            f"CORRAL_DATABASE_URL {shown}: another corral serve is using this database ({exc}); one "
            "corral serve per database: stop that one first, or give this one a database of its own"
        )


# The exit status of a server that lost its database to another `corral serve` (2 is a refusal at start)
EXIT_DATABASE_TAKEN = 3


# The exit status of a server that did not start because its standard error cannot be written
EXIT_STDERR_LOST = 4


def _not_started(why: str) -> NoReturn:
    """Standard error cannot be written (`why`): the server does not start, since its every word (the
    generated operator token, a warning, what became of its runs) would be lost. One line on standard
    output (where it can be written), exit status 4."""
    on_stdout(
        f"corral serve: not started: standard error cannot be written ({why}); give it one that can be "
        "(a terminal, a file on a disk with room, a pipe that is read)"
    )
    raise typer.Exit(EXIT_STDERR_LOST)


def _database_taken(reason: str) -> None:
    """Another `corral serve` took the database while this one's hold was lost: it has resumed this one's
    runs and drives them now. Any write from here (a run's next event, even the events and end state a
    clean stop stores) would go into streams that process writes, so this process ends at once, as a
    kill -9 would: nothing more is written, its engines end with it, and its sandboxes are removed by the
    next local run started on this host. One line in the log (stderr) says why; exit status 3."""
    log.error("corral serve: stopped at once, writing nothing more: %s; that one drives the runs now", reason)
    for handler in [*logging.getLogger().handlers, logging.lastResort]:
        if handler is not None:
            handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_DATABASE_TAKEN)


def _say_demo_page(app: FastAPI, spec: RunCreate, url: str) -> None:
    """Once the app has started (the demo run is created then): the demo run's dashboard page."""
    from contextlib import asynccontextmanager

    started = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[Any]:
        async with started(served) as state:
            run_id = getattr(app.state, "demo_run", None)
            if run_id is None:  # runs resumed here: no demo run is added to them
                say(f"demo run: not started (runs resumed here); the runs page: {url}/")
            else:
                kind = f"{spec.kind.value}, {spec.trainer.value} trainer"
                say(f"demo run {run_id}: {kind}; open {url}/runs/{run_id} (API: {url}/api/runs/{run_id})")
            yield state

    app.router.lifespan_context = lifespan


def _abandon(app: FastAPI) -> None:
    manager = getattr(app.state, "manager", None)
    if manager is not None:
        manager.abandon()


def _say_goodbye(app: FastAPI, database: str) -> None:
    """After Ctrl-C: what became of each run this server executed, and where it is kept."""
    from app.store.models import TERMINAL_RUN_STATES

    manager = getattr(app.state, "manager", None)
    for handle in [] if manager is None else list(manager.handles.values()):
        view = handle.recorder.view
        state = handle.state.value
        if not handle.done.is_set():
            # Ended, its thread still storing (a second Ctrl-C): its end state was stored, or its end is
            # kept on disk for the next start, so it is not resumed there, as this line used to say of it.
            if handle.state in TERMINAL_RUN_STATES:
                state += " (its last events may not all be stored)"
            elif manager is not None and handle.run_id in manager.ends_kept:
                state = "stopped (its end kept: the next start finds it ended and does not resume it)"
            else:
                state += " (not stopped: resumed at the next start)"
        say(f"run {handle.run_id} ({handle.spec.name}): {state}, {view.batches} batches")
    say(f"corral serve: stopped; runs and their events are kept in {database}")


def demo_run(kind: str) -> RunCreate:
    from app.runtime.config import LocalRunError, default_config_path, load_config
    from app.service.schemas import RunCreate, RunKind, TrainerKind

    if kind == "sim":
        return RunCreate(name="demo", kind=RunKind.SIM, trainer=TrainerKind.SENTINEL)
    try:
        config = load_config(default_config_path().with_name("demo.yaml"))
    except LocalRunError as exc:
        fail(str(exc))
    return RunCreate(name="demo", kind=RunKind.LOCAL, config=config, trainer=TrainerKind.SENTINEL)
