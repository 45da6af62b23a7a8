"""Corral's own redis-py clients, with their timeouts in one place.

Celery and kombu make their own connections to the broker and the result backend; these are the
clients Corral makes beside them: `/healthz`'s ping of a Redis broker, a run's stop asked and looked for,
the broker's run_id (a restart seen), an orchestrator's lease and its reclaim of orphaned runs, and the
API's start timeout of runs no worker took (a run's command channel uses redis.asyncio instead:
app/service/channel.py). Each waits at most its timeout to connect and for each answer, so a Redis that
is away or hung is an error where it is caught, not a thread stuck on a socket; only the lease's client
waits as long as it takes.
"""

from __future__ import annotations

from redis import Redis

# How long a client waits to connect, and for each answer, by what it is for
HEALTH_TIMEOUT_S = 1.0  # /healthz's ping of the broker: a health check answers quickly or says no
COMMAND_TIMEOUT_S = 2.0  # a run's stop asked and looked for, the broker's run_id read
# an orchestrator's reclaim of orphaned runs, the API's start timeout of queued runs: a hung Redis waits
# for the next period
RECLAIM_TIMEOUT_S = 5.0
LEASE_TIMEOUT_S = None  # an orchestrator's run lease: redis-py's default, no bound


def redis_client(url: str, timeout_s: float | None) -> Redis:
    """A client of the Redis at `url` (redis:// or rediss://) that waits at most `timeout_s` to connect and
    for each answer (None: no bound)."""
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
