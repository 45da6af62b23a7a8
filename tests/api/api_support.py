"""Helpers of the API tests: settings, a real app served by uvicorn in a thread, waiting, run specs.

(A module of its own, not conftest.py: `from conftest import` reaches whichever conftest pytest loaded
last, another directory's in a whole-suite run.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from factories import wait_for as wait_for  # the tests here import it from this module
from fastapi import FastAPI

from app.api.app import create_app
from app.service.store import RunRecord, ServiceStore
from app.settings import Settings

TOKEN = "test-operator-token"
POSTGRES_URL = os.environ.get("CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_env(
    tmp_path: Path, database_url: str, port: int, base: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a `corral serve` subprocess on `database_url` and `port`, with its data under
    `tmp_path` and the test operator token; on top of `base` (default: this process's environment)."""
    return {
        **(dict(os.environ) if base is None else base),
        "CORRAL_DATABASE_URL": database_url,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }


def worker_env(tmp_path: Path, database_url: str, redis_url: str) -> dict[str, str]:
    """The environment of a `corral worker --orchestrator` on `database_url`, with `redis_url` as its
    broker and result backend and its data under `tmp_path`."""
    return {
        **os.environ,
        "CORRAL_BROKER_URL": redis_url,
        "CORRAL_RESULT_BACKEND": redis_url,
        "CORRAL_DATABASE_URL": database_url,
        "CORRAL_DATA_DIR": str(tmp_path / "worker-data"),
    }


WORKER_PROGRAM = "from app.cli import main; main()"
# `corral`'s main in a worker whose pause and resume handlers never answer
HUNG_ACT = """
import asyncio
import app.service.commands as commands

async def hang(handle, action, actor, command_id=""):
    await asyncio.sleep(3600)

commands.act = hang
from app.cli import main
main()
"""


@contextmanager
def orchestrator_worker(
    env: dict[str, str], log_path: Path, program: str = WORKER_PROGRAM
) -> Iterator[subprocess.Popen[bytes]]:
    """A real `corral worker --orchestrator` with `env`, its output in `log_path`, for the block's
    duration; then stopped through its own session (SIGTERM, SIGKILL after 30 s), pool processes too.
    `program`: the Python that starts it (`corral`'s main, after a fault it injects, say)."""
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-c", program, "worker", "--orchestrator", "--loglevel", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        yield worker
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()


def fresh_redis(url: str) -> redis.Redis:
    """A client of the Redis database `url`, emptied; the test is skipped without a Redis."""
    from factories import redis_answers

    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    client = redis.Redis.from_url(url)
    client.flushdb()
    return client


def make_settings(tmp_path: Path, database_url: str, **overrides: Any) -> Settings:
    fields: dict[str, Any] = {
        "database_url": database_url,
        "operator_token": TOKEN,
        "data_dir": tmp_path / "data",
        "port": free_port(),
        "ack_timeout_s": 30.0,
    }
    fields.update(overrides)
    return Settings(**fields)


@contextmanager
def serving(settings: Settings, app: FastAPI | None = None) -> Iterator[str]:
    """The app (`app`, or one made from `settings`) on uvicorn in a thread for the block's duration;
    yields its base URL."""
    app = create_app(settings) if app is None else app
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="corral-serve-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{settings.port}"
    finally:
        server.should_exit = True
        thread.join(60)


def make_run(**overrides: Any) -> dict[str, Any]:
    """A simulated run's config: the small default workload, paced 5x faster than the wall clock."""
    spec: dict[str, Any] = {"name": "test-run", "kind": "sim", "speed": 5.0, "batches": 4}
    spec.update(overrides)
    return spec


def twin_runs(api: httpx.Client, worker_log: Path) -> tuple[str, str]:
    """Two simulated runs that go on until stopped, once they run: one executing in the server `api`
    speaks to, and its twin, which an orchestrator worker (its log in `worker_log`) drives."""
    spec = make_run(speed=1.0, trainer="sentinel")
    del spec["batches"]
    here = api.post("/api/runs", json=spec).json()["id"]
    remote = api.post("/api/runs", json={**spec, "orchestrator": "celery"}).json()["id"]
    for run_id in (here, remote):
        wait_for(
            lambda run_id=run_id: api.get(f"/api/runs/{run_id}").json()["state"] == "running",
            120,
            what=f"run {run_id} to run; log {worker_log}",
        )
    return here, remote


def stored_run(database_url: str, run_id: str) -> RunRecord:
    """A run's row as the store holds it, read with a store of its own (the server's is elsewhere)."""
    store = ServiceStore(database_url, migrate=False)
    try:
        record = store.get_run(run_id)
    finally:
        store.close()
    assert record is not None, f"no stored run {run_id!r}"
    return record


def assert_stopped_with_nothing_lost(database_url: str, run_id: str) -> None:
    """The run is stored as stopped, and its stored stream accounts for every group it admitted."""
    store = ServiceStore(database_url, migrate=False)
    try:
        record = store.get_run(run_id)
        assert record is not None, f"no stored run {run_id!r}"
        assert record.state == "stopped"
        ledger, _ = store.ledger(run_id)
        assert ledger.lost == 0
    finally:
        store.close()


@contextmanager
def serve_process(env: dict[str, str], log: Path, killed: bool = False) -> Iterator[httpx.Client]:
    """A real `corral serve` in a session of its own, ended by Ctrl-C (to its process group) at the end
    of the block, which must exit 0, or `killed` (SIGKILL); yields an API client holding the operator
    token."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"], env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{env['CORRAL_PORT']}"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    try:

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                answer = api.get("/healthz")
            except httpx.TransportError:
                return False
            return answer.status_code == 200 and answer.json()["resuming"] == []

        wait_for(healthy, 120, what=f"corral serve to start; log {log}")
        yield api
        if not killed:
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        api.close()


def celery_serve_env(tmp_path: Path, database_url: str, redis_url: str) -> tuple[dict[str, str], int]:
    """`serve_env` on a free port for a `corral serve` and its orchestrator workers on `redis_url` (broker
    and result backend), with a lane host of its own name: the environment, and the port."""
    port = free_port()
    env = {
        **serve_env(tmp_path, database_url, port),
        "CORRAL_BROKER_URL": redis_url,
        "CORRAL_RESULT_BACKEND": redis_url,
        "CORRAL_LANE_HOSTS": f"h-{port}",
    }
    return env, port


def answers(url: str) -> bool:
    """Whether a server answers /healthz at all (503 while no lane worker of its lane hosts is up)."""
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code in (200, 503)
    except httpx.TransportError:
        return False
