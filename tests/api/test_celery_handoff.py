"""A `corral worker --orchestrator` stopped (SIGTERM to its whole process group: a supervisor, `docker
stop`, a rolling deploy) while it drives a run without `batches`: the worker hands the run off, storing
every event it published, and exits 0 in seconds; the run stays `running`, its task back in the
`orchestrator` queue, and the next orchestrator worker resumes it where it stood. Before, the warm
shutdown waited for the run to end, which an unbounded run never does: the worker never exited, until
a SIGKILL lost the run's unstored events and left it undriven until its lease lapsed. Real processes on
the real Redis, in a database of their own (the `orchestrator` queue's name is fixed)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, answers, celery_serve_env, fresh_redis, make_run, orchestrator_worker, wait_for
from factories import redis_answers
from test_serve_restart import corral_serve

from app.service.store import ServiceStore
from workers.celery_app import ORCHESTRATOR_QUEUE

REDIS_URL = "redis://127.0.0.1:6379/3"


def test_an_orchestrator_worker_stopped_hands_its_unbounded_run_to_the_next_worker(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    client = fresh_redis(REDIS_URL)
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    env, port = celery_serve_env(tmp_path, db, REDIS_URL)
    first_log, second_log = tmp_path / "worker-1.log", tmp_path / "worker-2.log"
    url = f"http://127.0.0.1:{port}"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)

    def delivered() -> int:  # groups, as the store counts them (the run executes in a worker)
        return int(api.get(f"/api/runs/{run_id}").json()["groups"]["delivered"])

    try:
        with corral_serve(env, tmp_path / "serve.log"):
            wait_for(lambda: answers(url), 120, what="corral serve to answer")
            with orchestrator_worker(env, first_log) as first:
                spec = make_run(speed=4.0, trainer="sentinel", sentinel_step_s=0.05, orchestrator="celery")
                del spec["batches"]  # it goes on until stopped
                run_id = api.post("/api/runs", json=spec).json()["id"]
                wait_for(lambda: delivered() >= 4, 120, what=f"4 groups delivered; log {first_log}")
                os.killpg(first.pid, signal.SIGTERM)
                assert first.wait(60) == 0, first_log.read_text()[-3000:]
            text = first_log.read_text()
            assert f"run {run_id}: this worker shuts down; the run is left to another orchestrator" in text
            assert f"run {run_id}: left to the next start, which resumes it (its" in text
            assert "Traceback" not in text
            assert api.get(f"/api/runs/{run_id}").json()["state"] == "running"
            assert client.llen(ORCHESTRATOR_QUEUE) == 1  # sent again, for the next worker
            handed_at = delivered()

            with orchestrator_worker(env, second_log):
                wait_for(lambda: delivered() >= handed_at + 4, 180, what=f"4 more groups; log {second_log}")
                assert api.post(f"/api/runs/{run_id}/stop").status_code == 202
                wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 120,
                         what="the stop")  # fmt: skip
        store = ServiceStore(db, migrate=False)
        try:
            ledger, _ = store.ledger(run_id)
            assert ledger.gaps == 0  # every event of the first worker's stored, the second's after them
            assert not ledger.ended_twice
            assert not ledger.open_groups
            assert ledger.lost == 0
            kinds = [e["kind"] for e in store.timeline(run_id, -1, 1_000_000)]
            assert kinds.count("run_started") == 2
            assert kinds.count("run_ended") == 1
        finally:
            store.close()
    finally:
        api.close()
        client.close()
