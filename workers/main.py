"""Composition roots of the two worker kinds: a lane worker (one lane of one host, pinned to its CPUs)
and an orchestrator worker. Both are Celery prefork workers; `corral worker` calls these after it has
checked its flags."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from celery.signals import worker_ready, worker_shutting_down

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
    worker_shutting_down.connect(
        lambda how="", **_: orchestrator.say_what_a_warm_shutdown_waits_for(how), weak=False
    )
    try:
        app.worker_main([*argv, "-l", loglevel, *_QUIET])
    finally:
        if reclaimer is not None:
            reclaimer.stop()
