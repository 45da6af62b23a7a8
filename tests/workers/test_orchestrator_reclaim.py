"""A run whose whole orchestrator worker dies (`kill -9` of its process group) is driven again by another
orchestrator worker once its lease lapses, not after the broker's visibility timeout (4 h on Redis: the
run sat `running` with nothing driving it). Real `corral worker --orchestrator` processes on the real
Redis, in a database of their own (the `orchestrator` queue's name is fixed); the run's entry point is a
stand-in that says where it runs and waits to be let go (the run manager's is tested with the service).
The task is sent from a process of its own: no Celery app or broker connection in pytest's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis
from celery_cluster import Workers, broker_env, wait_for
from factories import redis_answers

from workers.celery_app import ORCHESTRATOR_TASK

REDIS_URL = "redis://127.0.0.1:6379/10"

STUB = """
import os, time
from pathlib import Path

def run(run_id, settings):
    if run_id != os.environ["STUB_RUN"]:  # a run an earlier test left in the queue: not waited on
        return {"run_id": run_id, "skipped": True}
    here = Path(os.environ["STUB_DIR"])
    with (here / f"{run_id}.starts").open("a") as out:
        out.write(f"{os.getpid()}\\n")
    while not (here / f"{run_id}.go").exists():
        time.sleep(0.1)
    return {"run_id": run_id, "pid": os.getpid()}
"""

SEND = (
    "import sys\n"
    "from workers.celery_app import make_celery\n"
    "app = make_celery(sys.argv[1], sys.argv[1])\n"
    "app.send_task(sys.argv[2], args=[sys.argv[3]])\n"
    "app.close()\n"
)


def _stub_run(tmp_path: Path) -> tuple[str, dict[str, str], Path]:
    """A run id for the stand-in entry point, the workers' environment, and the file of its starts."""
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379 (the Celery tests need a real broker)")
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "stub_runner.py").write_text(STUB)
    run_id = uuid.uuid4().hex
    env = {
        **broker_env(REDIS_URL, REDIS_URL),
        "STUB_RUN": run_id,
        "PYTHONPATH": str(tmp_path / "entry"),
        "STUB_DIR": str(tmp_path),
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
    }
    return run_id, env, tmp_path / f"{run_id}.starts"


def _send(run_id: str, env: dict[str, str], url: str = REDIS_URL) -> None:
    """Send the run to the orchestrator queue of the Redis at `url`, from a process of its own."""
    subprocess.run([sys.executable, "-c", SEND, url, ORCHESTRATOR_TASK, run_id], env=env, check=True)


def _starts(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_run_whose_orchestrator_worker_was_killed_whole_is_driven_again(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run_id, env, starts = _stub_run(tmp_path)
    workers = Workers(tmp_path_factory.mktemp("orch-logs"))
    client = redis.Redis.from_url(REDIS_URL)
    try:
        first = workers.start("--orchestrator", "--entry", "stub_runner:run", env=env)
        _send(run_id, env)
        wait_for(lambda: len(_starts(starts)) == 1, 120, f"a worker to take it ({workers.log_dir})")

        os.killpg(first.pid, signal.SIGKILL)  # main process and pool: its message stays unacked in Redis
        first.wait()
        workers.start("--orchestrator", "--entry", "stub_runner:run", env=env)
        wait_for(  # its lease lapses 30 s after its last renewal; the new worker looks at its start
            lambda: len(_starts(starts)) == 2,
            150,
            f"another orchestrator worker to drive the run again ({workers.log_dir})",
        )
        first_pid, second_pid = _starts(starts)
        assert first_pid != second_pid
        assert f"run {run_id}: the orchestrator worker that took it is gone" in workers.logs()

        (tmp_path / f"{run_id}.go").touch()  # the run ends: its message is acked, its lease released
        wait_for(
            lambda: not any(run_id.encode() in raw for raw in client.hvals("unacked")),
            60,
            "the run's message to be acked",
        )
        wait_for(lambda: client.get(f"corral:orchestrator:{run_id}") is None, 30, "the lease to go")
        assert len(_starts(starts)) == 2  # driven once more, not twice
    finally:
        (tmp_path / f"{run_id}.go").touch()
        workers.stop()
        client.close()


def test_ctrl_c_to_an_orchestrator_worker_says_which_run_it_waits_for_and_twice_hands_it_over(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A first Ctrl-C waits for the run in progress (Celery's warm shutdown), which a run without
    `batches` never ends by itself: the worker says which run and the ways out (before: a bare "Warm
    shutdown", then nothing). A second Ctrl-C leaves the run to another worker."""
    run_id, env, starts = _stub_run(tmp_path)
    workers = Workers(tmp_path_factory.mktemp("orch-logs"))
    try:
        first = workers.start("--orchestrator", "--entry", "stub_runner:run", env=env)
        _send(run_id, env)
        wait_for(lambda: len(_starts(starts)) == 1, 120, f"a worker to take it ({workers.log_dir})")

        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C in its terminal: the whole process group
        wait_for(
            lambda: f"waiting for the runs this worker drives to end: {run_id}" in workers.logs(),
            60,
            f"the worker to say which run it waits for ({workers.log_dir})",
        )
        assert first.poll() is None  # waiting, as Celery's warm shutdown does
        workers.start("--orchestrator", "--entry", "stub_runner:run", env=env)
        os.killpg(first.pid, signal.SIGINT)  # again: the run goes back to the queue
        first.wait(timeout=60)
        wait_for(lambda: len(_starts(starts)) == 2, 150, f"the other worker to drive it ({workers.log_dir})")
    finally:
        (tmp_path / f"{run_id}.go").touch()
        workers.stop()
