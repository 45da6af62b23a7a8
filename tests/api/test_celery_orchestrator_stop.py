"""An operator stops a run that a `corral worker --orchestrator` drives, through the API of a `corral serve`
that does not execute it: 202, the worker stops it (live groups `cancelled`, the run `stopped`), and a
second stop is a 200 with `already_stopped`. Before, every stop of such a run was a 409 "not executing
in this server", and a run without `batches` went on until its worker was killed (whose run the next
worker then resumed). Real processes on the real Redis, in a database of their own (the `orchestrator`
queue's name is fixed: no other test's worker may take the run)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, answers, celery_serve_env, make_run, orchestrator_worker, wait_for
from factories import redis_answers
from test_serve_restart import corral_serve

REDIS_URL = "redis://127.0.0.1:6379/15"


def test_a_run_an_orchestrator_worker_drives_is_stopped_through_the_api(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    env, port = celery_serve_env(tmp_path, db, REDIS_URL)
    serve_log = tmp_path / "serve.log"
    with orchestrator_worker(env, tmp_path / "worker.log"), corral_serve(env, serve_log):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(url), 120, what=f"corral serve to answer; log {serve_log}")
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        spec = make_run(speed=1.0, trainer="sentinel", orchestrator="celery")
        del spec["batches"]  # it goes on until stopped
        run_id = api.post("/api/runs", json=spec).json()["id"]
        wait_for(
            lambda: api.get(f"/api/runs/{run_id}").json()["groups"]["admitted"] > 0,
            120,
            what=f"the worker to drive the run; log {tmp_path / 'worker.log'}",
        )

        stop = api.post(f"/api/runs/{run_id}/stop")
        assert stop.status_code == 202, stop.text
        said = {"id": run_id, "state": "running", "actor": "operator", "already_stopped": False}
        assert stop.json() == said
        wait_for(
            lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped",
            60,
            what=f"the worker to stop the run; log {tmp_path / 'worker.log'}",
        )
        groups = api.get(f"/api/runs/{run_id}").json()["groups"]
        assert groups["open"] == 0
        again = api.post(f"/api/runs/{run_id}/stop")
        assert again.status_code == 200, again.text
        assert again.json()["already_stopped"] is True
        api.close()
