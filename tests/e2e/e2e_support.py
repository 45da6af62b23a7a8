"""Helpers of the end-to-end tests: real `corral serve` and `corral worker` processes, a fresh database,
a small local run, and the checks of what the database holds afterwards.

(A module of its own, not conftest.py: `from conftest import` reaches whichever conftest pytest loaded
last, another directory's in a whole-suite run.)

Every process starts in its own session and is torn down by its own pid, with its descendants (pool
processes, embedded engines), even when the test fails: SIGTERM to its process group, then SIGKILL to
whatever of its tree is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from factories import make_local_config as make_local_config  # the e2e tests import it from here

from app.lanes.base import LaneName

CORRAL = Path(sys.executable).with_name("corral")
TOKEN = "e2e-operator-token"
POSTGRES_URL = os.environ.get("CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# A Redis database of its own: the broker's queues and op results of these tests (host names are unique
# per test, so a concurrent run of the suite never shares a lane queue; the `orchestrator` queue's name is
# fixed, and no other test's orchestrator worker, with its own entry point, may take from it).
REDIS_URL = os.environ.get("CORRAL_TEST_E2E_REDIS_URL", "redis://127.0.0.1:6379/13")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.1)


@contextmanager
def data_dir() -> Iterator[Path]:
    """A data directory sandbox uids can traverse (pytest's tmp dirs are 0700), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="corral-e2e-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- processes -----------------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    children = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@dataclass
class Procs:
    """The processes one test started, with their logs; `stop` ends every one and its descendants."""

    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with self.log(name).open("ab") as out:
            proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def tail(self, name: str, chars: int = 3000) -> str:
        path = self.log(name)
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self, name: str, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 60.0) -> int | None:
        """Signal `name`'s process group and wait; SIGKILL its tree if it outlives `timeout_s`."""
        proc = self.procs.pop(name)
        family = tree(proc.pid)
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=timeout_s)
        # Whatever of its tree outlived it (a pool process, an engine in its own session): SIGKILL.
        # The group id stays reserved while any member lives, so it still names only our processes.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in family[1:]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return proc.returncode

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout_s=20.0)


def serve_env(database_url: str, port: int, data_dir: Path, broker: str | None, host: str) -> dict[str, str]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
        "CORRAL_DATABASE_URL": database_url,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(data_dir),
        "CORRAL_ACK_TIMEOUT_S": "60",
    }
    if broker is not None:
        env.update({"CORRAL_BROKER_URL": broker, "CORRAL_RESULT_BACKEND": broker, "CORRAL_LANE_HOSTS": host})
    return env


def start_serve(procs: Procs, env: dict[str, str], name: str = "serve") -> subprocess.Popen[bytes]:
    return procs.start(name, [str(CORRAL), "serve"], env)


def healthy(url: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=5)
    except httpx.TransportError:
        return None
    return dict(answer.json()) if answer.status_code == 200 else None


def start_lane_workers(procs: Procs, host: str, broker: str) -> dict[LaneName, subprocess.Popen[bytes]]:
    """One `corral worker` per lane of `host`, each pinned to the last CPU, one pool process each, and
    the deployment's orchestrator worker (`/healthz` is 503 without one); returns once every one says it
    is ready. Returns the lane workers."""
    env = {**os.environ, "CORRAL_BROKER_URL": broker, "CORRAL_RESULT_BACKEND": broker}
    cpu = str(max(os.sched_getaffinity(0)))
    started = {}
    for lane in LaneName:
        argv = [str(CORRAL), "worker", "--lane", lane.value, "--cpus", cpu, "--host", host,
                "--concurrency", "1", "--loglevel", "info"]  # fmt: skip
        started[lane] = procs.start(f"worker-{lane.value}", argv, env)
    orchestrator = procs.start(
        "worker-orchestrator", [str(CORRAL), "worker", "--orchestrator", "--loglevel", "info"], env
    )
    for name, proc in [*((f"worker-{lane.value}", p) for lane, p in started.items()),
                       ("worker-orchestrator", orchestrator)]:  # fmt: skip
        wait_for(
            lambda name=name, proc=proc: " ready." in procs.tail(name, 100_000) or proc.poll() is not None,
            120,
            f"the {name} to be ready",
        )
        assert proc.poll() is None, procs.tail(name)
    return started


# -- what Redis and the database hold ---------------------------------------------------------------


def op_results_on(broker: str, host: str) -> list[dict[str, Any]]:
    """The lane op results the workers of `host` stored in the result backend (one per op id)."""
    import redis

    client = redis.Redis.from_url(broker)
    try:
        out = []
        for key in client.scan_iter(match="celery-task-meta-*", count=1000):
            raw = client.get(key)
            if raw is None:
                continue
            meta = json.loads(raw)
            result = meta.get("result")
            if meta.get("status") == "SUCCESS" and isinstance(result, dict) and result.get("host") == host:
                out.append(result)
        return out
    finally:
        client.close()


def unique_host() -> str:
    return f"h1-{uuid.uuid4().hex[:8]}"


@contextmanager
def processes(log_dir: Path) -> Iterator[Procs]:
    procs = Procs(log_dir)
    try:
        yield procs
    finally:
        procs.stop_all()
