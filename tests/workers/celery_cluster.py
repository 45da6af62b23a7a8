"""Helpers of the Celery tests: real `corral worker` processes against the real Redis on this machine.

(A module of its own, not conftest.py: `from conftest import` reaches whichever conftest pytest loaded
last, another directory's in a whole-suite run.)

The `lane_cluster` fixture (conftest.py) starts `corral worker` processes for two logical hosts (four
lanes each, every worker pinned to CPU 1), once per session; host names are unique to the session, so
tests never share a queue with anyone else's. Each worker runs in its own session and is stopped by its
own pid at the end (SIGTERM, then SIGKILL to its session if it hangs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from celery import Celery
from factories import wait_for as wait_for  # the tests here import it from this module
from redis_server import Redis as Redis
from redis_server import free_port as free_port

from app.lanes.base import LaneName

REDIS_URL = os.environ.get("CORRAL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
CORRAL = Path(sys.executable).with_name("corral")
WORKER_CPUS = "1"


def broker_env(url: str = REDIS_URL, backend: str = REDIS_URL) -> dict[str, str]:
    return {**os.environ, "CORRAL_BROKER_URL": url, "CORRAL_RESULT_BACKEND": backend}


@dataclass
class Workers:
    """`corral worker` processes this test module started, with their logs."""

    log_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        path = self.log_dir / f"worker-{len(self.procs)}.log"
        with path.open("wb") as log:
            proc = subprocess.Popen(
                [str(CORRAL), "worker", "--loglevel", "warning", *args],
                env=env or broker_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("worker-*.log")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # our own worker's session, pool processes included
                proc.wait()


@dataclass
class LaneCluster:
    hosts: tuple[str, str]
    app: Celery
    workers: Workers
    by_lane: dict[tuple[str, LaneName], subprocess.Popen[bytes]]


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
