"""`corral worker`: a Celery worker for one sandbox lane of one host, or for run orchestrators.

Every flag is checked (and the process pinned) before Celery starts, so a bad flag is a one-line
refusal with exit code 2, never a traceback; so is a broker (or result backend) that does not answer
within a few seconds, which Celery would retry for many minutes.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic import ValidationError

from app.cli.common import check_database, check_run_dirs, fail, settings_problem
from app.cpulist import CpuListError, format_cpu_list, parse_cpu_list
from app.lanes.base import LaneName

if TYPE_CHECKING:
    from workers.celery_app import BrokerSettings

MAX_CONCURRENCY = 256
DEFAULT_STATE_DIR = Path("/var/tmp/corral-lane-state")


def worker(
    lane: Annotated[LaneName | None, typer.Option(help="the sandbox lane this worker serves")] = None,
    cpus: Annotated[
        str | None, typer.Option(help="CPU list the worker and its sandbox commands are pinned to, e.g. 2-3")
    ] = None,
    host: Annotated[
        str | None, typer.Option(help="host name in the queue name lane.<host>.<lane>; default: this host's")
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_CONCURRENCY,
            help="pool processes; default: one per CPU of --cpus; 1 with --orchestrator",
        ),
    ] = None,
    orchestrator: Annotated[
        bool, typer.Option("--orchestrator", help="serve the orchestrator queue instead of a lane")
    ] = False,
    isolation: Annotated[str, typer.Option(help="sandbox isolation: auto, bwrap or none")] = "auto",
    docker_image: Annotated[
        str | None, typer.Option(help="also run docker sandboxes, from this image (DOCKER_HOST's daemon)")
    ] = None,
    state_dir: Annotated[
        Path, typer.Option(help="with --docker-image: where docker sandboxes' state is kept on this host")
    ] = DEFAULT_STATE_DIR,
    entry: Annotated[
        str | None,
        typer.Option(help="with --orchestrator: the run manager's entry point, module:function"),
    ] = None,
    loglevel: Annotated[str, typer.Option(help="Celery log level")] = "INFO",
) -> None:
    """Run a Celery worker: `--lane exec --cpus 2-3` for a lane, or `--orchestrator`.

    The broker comes from CORRAL_BROKER_URL (redis:// or amqp://); results go to CORRAL_RESULT_BACKEND
    (default: the broker, when it is Redis).
    """
    # Read once, when billiard is imported: its pool processes then ignore SIGTERM and are ended with
    # SIGQUIT, so a SIGTERM to the whole worker stops it as one to its main process does (workers.main).
    os.environ["REMAP_SIGTERM"] = "SIGQUIT"
    import billiard.common  # noqa: F401

    del os.environ["REMAP_SIGTERM"]  # not passed on to what the worker starts
    from workers.celery_app import BrokerError, BrokerSettings, check_host

    if isolation not in ("auto", "bwrap", "none"):
        fail(f"--isolation: {isolation!r} is not one of auto, bwrap, none")
    if loglevel.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        fail(f"--loglevel: {loglevel!r} is not one of debug, info, warning, error, critical")
    if docker_image is None and state_dir != DEFAULT_STATE_DIR:  # it was ignored without a word
        fail("--state-dir: only with --docker-image (it is where docker sandboxes keep their state)")
    try:
        settings = BrokerSettings()
        settings.urls()
    except BrokerError as exc:
        fail(str(exc))
    except ValidationError as exc:
        fail(settings_problem(exc))
    if orchestrator:
        if lane is not None or cpus is not None:
            fail("--orchestrator: serves the orchestrator queue; drop --lane and --cpus")
        from workers.main import run_orchestrator_worker
        from workers.orchestrator import DEFAULT_ENTRY, configure

        try:
            configure(entry or DEFAULT_ENTRY)
        except ValueError as exc:
            fail(f"--entry: {exc}")
        if entry in (None, DEFAULT_ENTRY):  # the default drives runs stored in CORRAL_DATABASE_URL
            from app.settings import load_settings

            try:
                run_settings = load_settings()
            except ValidationError as exc:
                fail(settings_problem(exc))
            check_run_dirs(run_settings.data_dir, run_settings.spill_dir)
            # The broker before the database: a refusal for a broker that does not answer left a new
            # corral.db in the current directory.
            check_reachable(settings)
            check_database(run_settings.database_url)
        else:
            check_reachable(settings)
        run_orchestrator_worker(settings, concurrency or 1, entry or DEFAULT_ENTRY, loglevel.upper())
        return
    if entry is not None:
        fail("--entry: only with --orchestrator")
    if docker_image is not None and not docker_image.strip():
        fail("--docker-image: empty image name")
    if lane is None or cpus is None:
        fail("--lane and --cpus are required (or pass --orchestrator)")
    try:
        cpu_list = parse_cpu_list(cpus)
    except CpuListError as exc:
        fail(f"--cpus: {exc}")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpu_list) - allowed)
    if missing:
        fail(
            f"--cpus: CPUs {format_cpu_list(missing)} are not available here "
            f"(allowed: {format_cpu_list(sorted(allowed))})"
        )
    host_name = host if host is not None else socket.gethostname()
    try:
        check_host(host_name)
    except BrokerError as exc:
        fail(f"--host: {exc}")
    if docker_image is not None:  # made last: a refusal above leaves no directory behind
        try:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = state_dir / f".probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            fail(f"--state-dir: {state_dir} is not a writable directory ({exc.strerror})")
    check_reachable(settings)
    from workers.main import run_lane_worker

    run_lane_worker(
        settings,
        lane,
        cpu_list,
        host_name,
        concurrency or len(cpu_list),
        isolation,  # type: ignore[arg-type]
        loglevel.upper(),
        docker_image,
        state_dir,
    )


def check_reachable(settings: BrokerSettings) -> None:
    """Refuse to start, in one line, when the broker or the result backend does not answer within a
    few seconds: Celery would retry for many minutes, several lines a try, and then exit."""
    from workers.celery_app import reach_problem

    broker, backend = settings.urls()
    problem = reach_problem(broker, "CORRAL_BROKER_URL")
    if problem is None and backend != broker:
        problem = reach_problem(backend, "CORRAL_RESULT_BACKEND")
    if problem is not None:
        fail(problem)
