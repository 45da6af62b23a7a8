"""API fixtures: a real `corral serve` app (uvicorn on a loopback port, in a thread) on a fresh database.

Every test that takes `backend_url` runs twice: on SQLite and on the real Postgres (one fresh database
per backend per test session, `app.store.db.scratch_database`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from app.api.app import create_app
from app.settings import Settings
from app.store.db import scratch_database

TOKEN = "test-operator-token"
POSTGRES_URL = os.environ.get("CORRAL_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def backend_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scratch_database(request.param, POSTGRES_URL, tmp_path_factory.mktemp("db")) as url:
        yield url


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
def serving(settings: Settings) -> Iterator[str]:
    """The app on uvicorn in a thread for the block's duration; yields its base URL."""
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_level="warning")
    )
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, backend_url: str) -> Iterator[str]:
    """One server per test module and backend; tests share it through runs of their own."""
    with serving(make_settings(tmp_path_factory.mktemp("serve"), backend_url)) as url:
        yield url


@pytest.fixture
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        yield client


def wait_for(check: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def make_run(**overrides: Any) -> dict[str, Any]:
    """A simulated run's config: the small default workload, paced 5x faster than the wall clock."""
    spec: dict[str, Any] = {"name": "test-run", "kind": "sim", "speed": 5.0, "batches": 4}
    spec.update(overrides)
    return spec
