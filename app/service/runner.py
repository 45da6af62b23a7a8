"""The run manager's entry point for a Celery orchestrator worker (`workers.orchestrator` calls it).

`run_orchestrator(run_id, settings)` drives one stored run in this process until it ends: from its
start, or resumed (a redelivered task after a worker died: the groups its predecessor left open are
discarded as `orphaned`, see app.service.manager). The worker's task holds the run's lease meanwhile,
so no two processes drive one run. An operator's stop (`POST /api/runs/{id}/stop` to any `corral serve`)
reaches it as a key in the result backend's Redis (`app.lanes.celery.run_stop_key`), looked for every
`STOP_CHECK_S`: the run is stopped as one executing in the API server would be.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import redis

from app.lanes.celery import broker_urls, run_stop_key
from app.lanes.redis_client import COMMAND_TIMEOUT_S, redis_client
from app.metrics import CorralMetrics
from app.service.compose import manager_for, store_for
from app.service.handle import RunHandle, RunNotLiveError
from app.settings import Settings
from app.store.models import TERMINAL_RUN_STATES, RunState

log = logging.getLogger(__name__)

STOP_CHECK_S = 1.0


def run_orchestrator(run_id: str, settings: Settings) -> dict[str, Any]:
    store = store_for(settings)
    try:
        record = store.get_run(run_id)
        if record is None:
            raise LookupError(f"no run {run_id!r} in {settings.database_url}")
        if RunState(record.state) in TERMINAL_RUN_STATES:
            return {"run_id": run_id, "state": record.state, "batches": None}  # a redelivery after its end
        manager = manager_for(settings, store, CorralMetrics())
        handle = manager.adopt(run_id)
        _join_unless_stopped(handle, settings)
        manager.shutdown()
        return {"run_id": run_id, "state": handle.state.value, "batches": handle.recorder.view.batches}
    finally:
        store.close()


def _join_unless_stopped(handle: RunHandle, settings: Settings) -> None:
    """Wait for the run's end, stopping it once an operator asks (`run_stop_key`; with no broker, as
    when this is called outside a worker, nobody can ask)."""
    if settings.broker_url is None:
        handle.join()
        return
    _, backend = broker_urls(settings.broker_url, settings.result_backend)
    client = redis_client(backend, COMMAND_TIMEOUT_S)
    asked = False
    try:
        while not handle.join(STOP_CHECK_S):
            if asked:
                continue
            try:
                actor = client.get(run_stop_key(handle.run_id))
            except redis.RedisError as exc:  # fault tolerance: the run goes on; asked again next check
                log.warning("run %s: could not look for a stop request: %r", handle.run_id, exc)
                continue
            if actor is None:
                continue
            who = actor.decode(errors="replace") if isinstance(actor, bytes) else str(actor)
            log.warning("run %s: stopped by %s", handle.run_id, who)
            asked = True
            with contextlib.suppress(RunNotLiveError):  # it ended meanwhile
                handle.submit(handle.stop)
    finally:
        client.close()
