"""A run whose orchestrator is a real `corral worker --orchestrator` on the real Redis: the API sends
it to the `orchestrator` queue, the worker drives it to its end, and the API reads its account from the
database."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, make_run, make_settings, orchestrator_worker, serving, wait_for, worker_env
from factories import redis_answers

from app.service.store import ServiceStore

REDIS_URL = "redis://127.0.0.1:6379/14"  # a database of its own: no other test's worker takes these


def test_a_celery_orchestrated_run_completes_and_is_accounted(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    settings = make_settings(tmp_path, db, broker_url=REDIS_URL)
    with (
        orchestrator_worker(worker_env(tmp_path, db, REDIS_URL), tmp_path / "worker.log"),
        serving(settings) as url,
    ):
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        spec = make_run(batches=2, trainer="sentinel", sentinel_step_s=0, orchestrator="celery")
        created = api.post("/api/runs", json=spec)
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        assert created.json()["live"] is None  # not executing in the API server
        wait_for(
            lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "completed",
            120,
            what=f"the worker to complete the run; log {tmp_path / 'worker.log'}",
        )
        groups = api.get(f"/api/runs/{run_id}").json()["groups"]  # from the store's projection
        assert groups["open"] == 0
        assert groups["delivered"] == 4
        external = api.post("/api/runs", json=make_run(orchestrator="celery"))
        assert external.status_code == 422
        assert "sentinel trainer only" in external.json()["detail"]
        api.close()
    store = ServiceStore(db, migrate=False)
    try:
        ledger, _ = store.ledger(run_id)
        assert ledger.lost == 0
        assert ledger.delivered_count == 4
    finally:
        store.close()


def test_celery_without_a_broker_is_refused(api: httpx.Client) -> None:
    answer = api.post("/api/runs", json=make_run(trainer="sentinel", orchestrator="celery"))
    assert answer.status_code == 422
    assert "CORRAL_BROKER_URL" in answer.json()["detail"]
