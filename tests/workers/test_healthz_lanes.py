"""`/healthz` of a `corral serve` with a broker asks the workers: 200 while every lane queue of
`CORRAL_LANE_HOSTS` and the `orchestrator` queue have a live worker, 503 saying which has none once its
only worker was killed (`kill -9` of its process group). Real `corral worker` and `corral serve`
processes on the real Redis, in a database of their own: the `orchestrator` queue's name is fixed, and
no other test's orchestrator worker may answer for it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
from celery_cluster import CORRAL, WORKER_CPUS, Workers, broker_env, wait_for
from factories import redis_answers

from app.lanes.base import LaneName

REDIS_URL = "redis://127.0.0.1:6379/12"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _health(url: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}/healthz", timeout=10)
    except httpx.TransportError:
        return None


def test_healthz_names_the_lane_queue_and_the_orchestrator_whose_worker_was_killed(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379 (the Celery tests need a real broker)")
    host = f"h{uuid.uuid4().hex[:8]}"  # queues of this test alone
    (tmp_path / "logs").mkdir()
    workers = Workers(tmp_path / "logs")
    worker_env = broker_env(REDIS_URL, REDIS_URL)
    by_lane = {
        lane: workers.start(
            "--lane", lane.value, "--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1", env=worker_env
        )
        for lane in LaneName
    }
    orchestrator = workers.start("--orchestrator", env=worker_env)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **worker_env,
        "CORRAL_LANE_HOSTS": host,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
        "CORRAL_OPERATOR_TOKEN": "test-operator-token",
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        serve = subprocess.Popen([str(CORRAL), "serve"], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        up = wait_for(
            lambda: (h := _health(url)) is not None and h.status_code == 200 and h,
            120,
            f"/healthz 200 with every lane worker up; serve log {log}, worker logs {workers.log_dir}",
        )
        queues = {f"lane.{host}.{lane.value}" for lane in LaneName}
        assert up.json()["lanes"] == {"ok": True, "workers": dict.fromkeys(queues, 1), "without_workers": []}
        assert up.json()["orchestrator"] == {"ok": True, "workers": 1}

        os.killpg(orchestrator.pid, signal.SIGKILL)  # a run sent to the orchestrator queue would wait
        orchestrator.wait()
        down = wait_for(
            lambda: (h := _health(url)) is not None and h.status_code == 503 and h,
            30,  # the check's cache (5 s) and one broadcast
            "/healthz 503 once the orchestrator worker is dead",
        )
        body = down.json()
        assert body["ok"] is False
        assert body["orchestrator"] == {"ok": False, "workers": 0}
        assert body["lanes"]["ok"] is True  # the lane workers live on: only the orchestrator is named

        os.killpg(by_lane[LaneName.EXEC].pid, signal.SIGKILL)  # main process and pool, as kill -9 -<pgid>
        by_lane[LaneName.EXEC].wait()
        down = wait_for(
            lambda: (h := _health(url)) is not None and h.json()["lanes"]["ok"] is False and h,
            30,
            "/healthz to name the exec queue once its worker is dead",
        )
        body = down.json()
        assert down.status_code == 503
        assert body["ok"] is False
        assert body["lanes"]["without_workers"] == [f"lane.{host}.exec"]
        assert body["lanes"]["workers"][f"lane.{host}.reset"] == 1
        assert body["database"] == {"ok": True, "held": True}
        assert body["broker"] == {"mode": "celery", "ok": True}
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        workers.stop()
