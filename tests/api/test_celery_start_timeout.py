"""A celery run sent to the `orchestrator` queue while no orchestrator worker is up is ended once
`CORRAL_START_TIMEOUT_S` has passed, saying why (before, it stayed `created` for ever): `failed` with a
reason an operator can act on, or `stopped` when a stop was asked meanwhile. It is never ended while a
worker holds its lease (one has just taken it) or while orchestrator workers are live (busy ones take
it once free). On the real Redis, in a database no orchestrator worker consumes; the check's clock is
given (`check(now)`), the real server's too is waited for, never timed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import redis
from api_support import TOKEN, make_run, make_settings, serving, wait_for

from app.lanes.celery import lease_key, request_run_stop
from app.service.queued import StartTimeout, start_timeout_reason
from app.service.schemas import RunCreate
from app.service.store import ServiceStore

REDIS_URL = "redis://127.0.0.1:6379/7"  # a database of its own: no orchestrator worker consumes it
TIMEOUT_S = 600.0


def test_a_queued_celery_run_is_ended_once_its_start_timeout_passes(tmp_path: Path, redis_db: Any) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    live_workers = [0]
    watch = StartTimeout(store, redis.Redis.from_url(REDIS_URL), lambda: live_workers[0], TIMEOUT_S)
    try:
        celery = RunCreate.model_validate(make_run(trainer="sentinel", orchestrator="celery"))
        here = RunCreate.model_validate(make_run(trainer="sentinel"))
        for run_id, spec in [("queued", celery), ("stopped", celery), ("taken", celery), ("local", here)]:
            store.create_run(run_id, spec.name, spec.stored(), {})
        created = max(store.get_run(r).created_at for r in ("queued", "stopped", "taken", "local"))  # type: ignore[union-attr]
        request_run_stop(REDIS_URL, "stopped", "operator")
        taken = redis_db.lock(lease_key("taken"), timeout=60, thread_local=False)
        assert taken.acquire(blocking=False)  # as a worker's lease

        assert watch.check(created + TIMEOUT_S - 1) == []
        live_workers[0] = 1  # busy workers: they take it once one is free
        assert watch.check(created + TIMEOUT_S + 1) == []
        live_workers[0] = 0
        assert sorted(watch.check(created + TIMEOUT_S + 1)) == ["queued", "stopped"]

        queued = store.get_run("queued")
        assert queued is not None
        assert (queued.state, queued.error) == ("failed", start_timeout_reason(TIMEOUT_S))
        assert queued.error.startswith("no orchestrator worker took it within 600 s of its creation")
        stopped = store.get_run("stopped")
        assert stopped is not None
        assert (stopped.state, stopped.error) == ("stopped", "stopped before an orchestrator worker took it")
        for run_id in ("taken", "local"):  # a worker's, and one this server executes
            assert store.get_run(run_id).state == "created"  # type: ignore[union-attr]
        taken.release()
    finally:
        watch.stop()
        store.close()


def test_the_server_fails_a_celery_run_no_worker_takes_and_says_why(tmp_path: Path, redis_db: Any) -> None:
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    settings = make_settings(tmp_path, db, broker_url=REDIS_URL, start_timeout_s=1.0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(settings) as url, httpx.Client(base_url=url, headers=auth, timeout=30) as api:
        created = api.post("/api/runs", json=make_run(trainer="sentinel", orchestrator="celery"))
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        run = wait_for(
            lambda: (r := api.get(f"/api/runs/{run_id}").json())["state"] == "failed" and r,
            60,
            what="the server to end the run no orchestrator worker took",
        )
        assert run["error"] == start_timeout_reason(1.0)
        page = api.get(f"/runs/{run_id}")
        assert "Why it failed" in page.text
        assert "no orchestrator worker took it within 1 s of its creation" in re.sub(r"\s+", " ", page.text)
