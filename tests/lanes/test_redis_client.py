"""`redis_client`: every Redis client Corral makes beside Celery's waits at most its timeout to connect
and for each answer, and talks to the real Redis."""

from __future__ import annotations

import pytest
from factories import redis_answers

from app.lanes.redis_client import COMMAND_TIMEOUT_S, LEASE_TIMEOUT_S, redis_client


@pytest.mark.parametrize("timeout_s", [COMMAND_TIMEOUT_S, LEASE_TIMEOUT_S])
def test_a_client_has_its_timeouts_and_answers(timeout_s: float | None) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    client = redis_client("redis://127.0.0.1:6379/7", timeout_s)
    try:
        options = client.connection_pool.connection_kwargs
        assert options["socket_timeout"] == timeout_s
        assert options["socket_connect_timeout"] == timeout_s
        assert options["db"] == 7
        assert client.ping()
    finally:
        client.close()
