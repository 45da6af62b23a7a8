"""API fixtures: a real `corral serve` app (uvicorn on a loopback port, in a thread) on a fresh database.

Every test that takes `backend_url` runs twice: on SQLite and on the real Postgres (one fresh database
per backend per test session, `app.store.db.scratch_database`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from api_support import POSTGRES_URL, TOKEN, make_settings, serving

from app.store.db import scratch_database


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def backend_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scratch_database(request.param, POSTGRES_URL, tmp_path_factory.mktemp("db")) as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, backend_url: str) -> Iterator[str]:
    """One server per test module and backend; tests share it through runs of their own (as many as
    they start: the limit on runs executing at once has a test of its own, test_run_limit)."""
    settings = make_settings(tmp_path_factory.mktemp("serve"), backend_url, max_runs=1000)
    with serving(settings) as url:
        yield url


@pytest.fixture
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        yield client


@pytest.fixture
def redis_db(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A client of the test module's own Redis database (its `REDIS_URL`), empty before and after the
    test; the test is skipped without a Redis."""
    from factories import redis_answers

    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    client = redis.Redis.from_url(request.module.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()
