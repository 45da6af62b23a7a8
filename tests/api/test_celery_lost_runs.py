"""A celery run whose orchestrator task a Redis restart took (a Redis that keeps nothing on disk comes back
empty) is sent to the `orchestrator` queue again by `corral serve`, once, and runs. Before, a run still
queued behind a busy orchestrator worker when Redis restarted stayed `created` for ever (the start
timeout waits on while workers are live), and a driven run whose worker died after such a restart was
never reclaimed. A real `corral worker --orchestrator`, the server in a thread, on a `redis-server` of
the test's own; the delivered batches are read from the stored stream, not the run's counters."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis as redis_py
from api_support import TOKEN, make_run, make_settings, orchestrator_worker, serving, wait_for, worker_env
from redis_server import Redis

from app.core.events import BatchDelivered, Envelope
from app.service.queued import LOST_CHECKS, LostRuns
from app.service.store import ServiceStore


def stored_batches(database_url: str, run_id: str) -> list[int]:
    """The indices of the run's `batch_delivered` events, in the stored stream's order."""
    store = ServiceStore(database_url, migrate=False)
    found: list[int] = []

    def note(env: Envelope) -> None:
        if isinstance(env.event, BatchDelivered):
            found.append(env.event.batch_index)

    try:
        store.ledger(run_id, note)
    finally:
        store.close()
    return found


def test_a_queued_celery_run_lost_in_a_redis_restart_is_sent_again_and_runs_once(
    redis: Redis, tmp_path: Path
) -> None:
    url = f"redis://127.0.0.1:{redis.port}/0"
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    settings = make_settings(tmp_path, db, broker_url=url)
    log = tmp_path / "worker.log"
    with orchestrator_worker(worker_env(tmp_path, db, url), log), serving(settings) as base:
        api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        endless = make_run(speed=1.0, trainer="sentinel", orchestrator="celery", batches=None)
        busy = api.post("/api/runs", json=endless).json()["id"]
        wait_for(lambda: api.get(f"/api/runs/{busy}").json()["state"] == "running", 120, what=f"log {log}")
        queued = api.post("/api/runs", json={**endless, "batches": 3}).json()["id"]
        broker = redis_py.Redis.from_url(url)
        try:
            wait_for(lambda: broker.llen("orchestrator") == 1, 30, what="the second run to wait in its queue")
        finally:
            broker.close()

        redis.restart(1.0)  # back empty: the queued run's task is gone
        assert api.post(f"/api/runs/{busy}/stop").status_code == 202  # the worker is free for it
        wait_for(lambda: api.get(f"/api/runs/{busy}").json()["state"] == "stopped", 120, what=f"log {log}")
        wait_for(
            lambda: api.get(f"/api/runs/{queued}").json()["state"] == "completed",
            180,
            what=f"the lost run to be sent again and completed (log {log})",
        )
        api.close()
    assert stored_batches(db, queued) == [0, 1, 2]  # each batch once
    store = ServiceStore(db, migrate=False)
    try:
        assert store.ledger(queued)[0].lost == 0
    finally:
        store.close()


def test_only_a_suspect_missing_from_the_broker_check_after_check_is_sent_again_and_only_once() -> None:
    epoch: list[str | None] = ["a"]
    held, leased, sent = {"queued"}, {"driven"}, []
    lost = LostRuns(lambda: epoch[0], lambda: set(held), lambda run: run in leased, sent.append)
    runs = ["queued", "driven", "gone"]
    for _ in range(LOST_CHECKS - 1):
        assert lost.check(runs) == []  # at the first check, every run not ended is a suspect
    assert lost.check(runs) == ["gone"]
    for _ in range(LOST_CHECKS):
        assert lost.check(runs) == []  # sent once; and the others were found where they should be
    held.clear()
    leased.clear()
    for _ in range(LOST_CHECKS):
        assert lost.check(runs) == []  # no restart since: nothing is suspected
    epoch[0] = None
    assert lost.check(runs) == []  # the broker away: nothing decided
    epoch[0] = "b"  # restarted
    for _ in range(LOST_CHECKS - 1):
        assert lost.check([*runs, "new"]) == []
    assert sorted(lost.check(["queued", "driven", "gone"])) == ["driven", "gone", "queued"]  # "new" ended
    assert sent[0] == "gone"
    assert sorted(sent[1:]) == ["driven", "gone", "queued"]
