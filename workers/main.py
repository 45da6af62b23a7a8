"""Composition roots of the two worker kinds: a lane worker (one lane of one host, pinned to its CPUs)
and an orchestrator worker. Both are Celery prefork workers; `corral worker` calls these after it has
checked its flags.

Stop signals: only a worker's main process acts on one, whether it was sent to the main process alone
(`docker stop`, `kill PID`) or to the whole process group (`kill -TERM -- -PGID`, a supervisor that
kills the group, the terminal closed). SIGTERM and SIGHUP are Celery's warm shutdown, as one Ctrl-C
is: the ops under way finish, their results are stored and their messages acked; the runs an
orchestrator worker drives are handed to the next one (`orchestrator.hand_off_runs`); then the worker
exits 0. A second Ctrl-C, or SIGQUIT, is Celery's cold shutdown. A SIGHUP ignored at start
(`nohup`) stays ignored. The pool processes ignore SIGINT, SIGTERM and SIGHUP; billiard ends them with
SIGQUIT (`REMAP_SIGTERM`, which `corral worker` sets before Celery is imported).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any, Literal
from urllib.parse import urlsplit

from billiard.common import REMAP_SIGTERM
from celery import Celery
from celery.apps.worker import _shutdown_handler
from celery.signals import worker_process_init, worker_ready, worker_shutting_down

from app import terminal
from app.lanes.base import LaneName
from workers import lane_tasks, orchestrator
from workers.celery_app import ORCHESTRATOR_QUEUE, BrokerSettings, make_celery, queue_name
from workers.sandboxes import HostSandboxes

# Gossip and mingle only slow a start and are not used: ops are routed by queue, not by worker.
_QUIET = ("--without-gossip", "--without-mingle")


def run_lane_worker(
    settings: BrokerSettings,
    lane: LaneName,
    cpus: Sequence[int],
    host: str,
    concurrency: int,
    isolation: Literal["auto", "bwrap", "none"] = "auto",
    loglevel: str = "INFO",
    docker_image: str | None = None,
    state_dir: Path | None = None,
) -> None:
    """Consume `lane.<host>.<lane>` with `concurrency` pool processes, each pinned to `cpus`. With
    `docker_image`, docker sandbox handles run too (their state kept in `state_dir`)."""
    broker, backend = settings.urls()
    queue = queue_name(host, lane)
    app = make_celery(broker, backend)
    docker = None
    if docker_image is not None:
        from app.sandboxes.docker import DockerSandboxFactory

        docker = DockerSandboxFactory(docker_image)  # its client is built lazily, in the pool process
    sandboxes = HostSandboxes(host, isolation, docker=docker, state_dir=state_dir)
    lane_tasks.configure(lane, host, cpus, sandboxes)
    name = f"{lane.value}-{os.getpid()}@{host}"
    take_stop_signals(app)
    app.worker_main(
        ["worker", "-Q", queue, "-c", str(concurrency), "-P", "prefork", "-n", name, "-l", loglevel, *_QUIET]
    )


def run_orchestrator_worker(
    settings: BrokerSettings,
    concurrency: int,
    entry: str = orchestrator.DEFAULT_ENTRY,
    loglevel: str = "INFO",
) -> None:
    """Consume the `orchestrator` queue: each task runs one run's orchestrator to its end."""
    broker, backend = settings.urls()
    orchestrator.configure(entry)
    app = make_celery(broker, backend)
    name = f"orchestrator-{os.getpid()}@%h"
    argv = ["worker", "-Q", ORCHESTRATOR_QUEUE, "-c", str(concurrency), "-P", "prefork", "-n", name]
    reclaimer = orchestrator.Reclaimer(app) if urlsplit(broker).scheme in ("redis", "rediss") else None
    if reclaimer is not None:  # once the pool is up: a reclaimed run is taken by a live worker
        worker_ready.connect(lambda **_: reclaimer.start(), weak=False)
    worker_shutting_down.connect(lambda how="", **_: orchestrator.hand_off_runs(backend, how), weak=False)
    take_stop_signals(app)
    try:
        app.worker_main([*argv, "-l", loglevel, *_QUIET])
    finally:
        if reclaimer is not None:
            reclaimer.stop()


def take_stop_signals(app: Celery) -> None:
    """Make the worker `app` will start take SIGTERM and SIGHUP as a warm shutdown in its main process,
    and ignore them in its pool processes (module docstring). Before: a SIGTERM to the process group
    killed the pool processes at once, so an op was cut off and run again by the next worker, and a run's
    orchestrator died with its unstored events while the main process said it waited for it; a SIGHUP
    restarted the worker (Celery's `execv` of itself, where stdout is not a terminal, even under
    `nohup`) after cutting off its ops the same way, or, on a terminal, killed the main process outright."""
    if REMAP_SIGTERM != "SIGQUIT":  # billiard read it before `corral worker` set it: it would end the pool
        raise RuntimeError("REMAP_SIGTERM=SIGQUIT must be set before Celery is imported")
    hangup_ignored = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    fds = terminal.terminal_fds()
    worker_process_init.connect(_pool_ignores_hangups, weak=False)

    class Worker(app.Worker):  # type: ignore[misc]
        def install_platform_tweaks(self, worker: Any) -> None:
            super().install_platform_tweaks(worker)  # SIGTERM cold (REMAP_SIGTERM), SIGHUP a restart
            warm = partial(_shutdown_handler, worker, how="Warm")
            warm(sig="SIGTERM")
            if hangup_ignored:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                return
            warm(sig="SIGHUP")
            shut_down = signal.getsignal(signal.SIGHUP)
            assert callable(shut_down)

            def hangup(signum: int, frame: FrameType | None) -> None:
                terminal.detach(fds)  # what went to the lost terminal goes to /dev/null
                shut_down(signum, frame)

            signal.signal(signal.SIGHUP, hangup)

    app.Worker = Worker


def _pool_ignores_hangups(**_: Any) -> None:
    # Celery's pool processes already ignore SIGINT, and SIGTERM under REMAP_SIGTERM
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
