"""A command whose handler hangs in a `corral worker --orchestrator` does not leave its thread behind once
the run has ended: the worker cancels it, answers it as an ended run's (409), and the pool process's
threads do not pile up run after run. Before, each run that ended with a command hung left its command
line running forever (a daemon thread holding the run's handle, its loop and a Redis connection): one
more thread in the pool process for every such run it had driven.
The hang is a fault injected into the real worker's process (its pause never answers), on the real Redis
in a database of its own."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from api_support import (
    HUNG_ACT,
    TOKEN,
    fresh_redis,
    make_run,
    make_settings,
    orchestrator_worker,
    serving,
    wait_for,
    worker_env,
)

REDIS_URL = "redis://127.0.0.1:6379/6"
TIMEOUT_S = 2.0
RUNS = 3


def _threads(worker_pid: int) -> int:
    """The threads of the worker's one pool process (`--concurrency 1`, the orchestrator's default)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    assert len(children) == 1, children
    return len(list(Path(f"/proc/{children[0]}/task").iterdir()))


def _settled_threads(worker_pid: int) -> int:
    """`_threads`, once it has stayed the same for a second (the run's task is winding up)."""
    deadline = time.monotonic() + 20
    last = _threads(worker_pid)
    while time.monotonic() < deadline:
        time.sleep(1)
        now, last = last, _threads(worker_pid)
        if now == last:
            break
    return last


def test_a_hung_command_is_cancelled_at_the_runs_end_and_threads_do_not_pile_up(
    tmp_path: Path, backend_url: str
) -> None:
    spec = make_run(speed=1.0, trainer="sentinel", orchestrator="celery")
    del spec["batches"]  # until stopped
    broker = fresh_redis(REDIS_URL)
    worker_log = tmp_path / "worker.log"
    settings = make_settings(tmp_path, backend_url, broker_url=REDIS_URL, command_timeout_s=TIMEOUT_S)
    threads = []
    try:
        with (
            orchestrator_worker(worker_env(tmp_path, backend_url, REDIS_URL), worker_log, HUNG_ACT) as worker,
            serving(settings) as url,
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as api,
        ):
            for _ in range(RUNS):
                run_id = api.post("/api/runs", json=spec).json()["id"]
                wait_for(
                    lambda run_id=run_id: api.get(f"/api/runs/{run_id}").json()["state"] == "running",
                    120,
                    what=f"the worker to run {run_id}; log {worker_log}",
                )
                hung = api.post(f"/api/runs/{run_id}/pause")
                assert hung.status_code == 504, hung.text
                assert "took the pause but did not answer" in hung.json()["detail"]
                command_id = hung.json()["detail"].rsplit("/", 1)[1]
                assert api.post(f"/api/runs/{run_id}/stop").status_code == 202
                wait_for(
                    lambda run_id=run_id: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped",
                    60,
                    what=f"the worker to stop {run_id}; log {worker_log}",
                )
                # the hung command is cancelled once the run has ended, and answered as an ended run's
                kept = wait_for(
                    lambda run_id=run_id, command_id=command_id: (
                        (got := api.get(f"/api/runs/{run_id}/commands/{command_id}").json())["state"]
                        == "answered"
                        and got
                    ),
                    30,
                    what=f"the hung pause of {run_id} to be cancelled; log {worker_log}",
                )
                assert kept["status"] == 409, kept
                assert "has ended (stopped)" in kept["body"]["detail"]
                assert "cancelled" in kept["body"]["detail"]
                if not threads:
                    threads.append(_settled_threads(worker.pid))
                else:
                    # Back to the first run's threads once this one has wound up: a thread a hung command
                    # left behind never goes. (Read once settled for a second, CI once got 1, 5 and 1:
                    # the second run was still winding up under load.)
                    back = f"the pool process's threads back to {threads[0]}; log {worker_log}"
                    wait_for(lambda: _threads(worker.pid) == threads[0], 60, what=back)
                    threads.append(_threads(worker.pid))
        text = worker_log.read_text()
        assert "left behind" not in text, text
    finally:
        broker.flushdb()
        broker.close()
