"""The orchestrator task: the run lease on the real Redis, and a real `corral worker --orchestrator`
running a run's entry point from the `orchestrator` queue (a stand-in entry point: the run manager's is
tested with the service)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery_cluster import Workers, broker_env
from factories import redis_answers

from workers.celery_app import ORCHESTRATOR_TASK, make_celery
from workers.orchestrator import LeaseHeld, run_lease

# A database of its own: no other test's orchestrator worker may take these messages.
ORCH_REDIS_URL = "redis://127.0.0.1:6379/11"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379 (the Celery tests need a real broker)")
    conn = redis.Redis.from_url(ORCH_REDIS_URL)
    yield conn
    conn.close()


def test_a_live_holder_keeps_its_run_and_a_dead_holders_lease_lapses(client: redis.Redis) -> None:
    run_id = uuid.uuid4().hex
    with run_lease(client, run_id, lease_s=0.6):
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match=run_id), run_lease(client, run_id, lease_s=0.6):
            pass
        assert time.monotonic() - started >= 1.5  # it waited a whole lease period: the holder renews
    with run_lease(client, run_id, lease_s=0.6):  # released on exit: taken at once
        pass

    dead = client.lock(f"corral:orchestrator:{run_id}", timeout=0.3)
    assert dead.acquire(blocking=False)  # a holder that dies right after: nobody renews its lease
    with run_lease(client, run_id, lease_s=2.0):  # taken once the dead holder's lease lapses
        assert client.get(f"corral:orchestrator:{run_id}") != dead.local.token


def test_an_orchestrator_worker_runs_the_runs_entry_point(
    client: redis.Redis, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    entry_dir = tmp_path / "entry"
    entry_dir.mkdir()
    (entry_dir / "stub_runner.py").write_text(
        "import os\n"
        "def run(run_id, settings):\n"
        "    return {'run_id': run_id, 'pid': os.getpid(), 'database_url': settings.database_url}\n"
    )
    env = broker_env(ORCH_REDIS_URL, ORCH_REDIS_URL)
    env["PYTHONPATH"] = str(entry_dir)
    env["CORRAL_DATABASE_URL"] = f"sqlite:///{tmp_path / 'corral.db'}"
    workers = Workers(tmp_path_factory.mktemp("orch"))
    try:
        worker = workers.start("--orchestrator", "--entry", "stub_runner:run", env=env)
        app = make_celery(ORCH_REDIS_URL, ORCH_REDIS_URL)
        run_id = uuid.uuid4().hex
        result = app.send_task(ORCHESTRATOR_TASK, args=[run_id])  # routed by name to `orchestrator`
        done = result.get(timeout=60)
        app.close()
    finally:
        workers.stop()
    assert done["run_id"] == run_id
    assert done["database_url"] == env["CORRAL_DATABASE_URL"]  # the worker's own settings
    assert done["pid"] != worker.pid  # a pool process of the worker ran it
    assert client.get(f"corral:orchestrator:{run_id}") is None  # the lease went with the run


def test_a_lost_lease_is_reported_not_renewed_behind_a_new_holders_back(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    run_id = uuid.uuid4().hex
    with run_lease(client, run_id, lease_s=0.6):
        client.delete(f"corral:orchestrator:{run_id}")  # as if it had lapsed while Redis was away
        taker = client.lock(f"corral:orchestrator:{run_id}", timeout=5)
        assert taker.acquire(blocking=False)  # another orchestrator takes the run
        time.sleep(0.5)  # a renewal period passes
        assert client.get(f"corral:orchestrator:{run_id}") == taker.local.token  # still the taker's
    assert f"run {run_id}: lease lost" in caplog.text
    taker.release()


def test_a_lease_lost_with_redis_s_data_is_taken_again(
    client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # A Redis restart that keeps nothing on disk removes the key: the holder logged "lease lost" and
    # stopped renewing, so the run went on with no lease and a redelivery could start a second
    # orchestrator for it.
    run_id = uuid.uuid4().hex
    key = f"corral:orchestrator:{run_id}"
    with run_lease(client, run_id, lease_s=0.6):
        client.delete(key)  # what a Redis restart leaves
        time.sleep(0.5)  # a renewal period passes
        token = client.get(key)
        assert token is not None
        time.sleep(0.7)  # more than the lease: still held, so renewed
        assert client.get(key) == token
        with pytest.raises(LeaseHeld, match=run_id), run_lease(client, run_id, lease_s=0.6):
            pass
    assert client.get(key) is None  # released at the end
    assert f"run {run_id}: lease had lapsed (Redis restarted?); taken again" in caplog.text
    assert "lease lost" not in caplog.text


def test_an_orchestrator_worker_whose_database_cannot_be_opened_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It used to start and wait for runs it could never drive; now it refuses before connecting."""
    from app.cli import main

    monkeypatch.setenv("CORRAL_BROKER_URL", ORCH_REDIS_URL)
    monkeypatch.setenv("CORRAL_DATABASE_URL", "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/x")
    monkeypatch.setattr("sys.argv", ["corral", "worker", "--orchestrator"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "cannot open the database" in lines[0]
    assert "s3cret" not in lines[0]


@pytest.mark.parametrize(
    ("entry", "needle"),
    [("no_such_module:drive", "cannot import no_such_module"), ("os:no_such_function", "os has no")],
)
def test_an_entry_point_that_cannot_be_found_is_refused_before_the_worker_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], entry: str, needle: str
) -> None:
    """It used to start Celery and fail on the first run it was given."""
    from app.cli import main

    monkeypatch.setenv("CORRAL_BROKER_URL", ORCH_REDIS_URL)
    monkeypatch.setattr("sys.argv", ["corral", "worker", "--orchestrator", "--entry", entry])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: --entry: entry point {entry!r}: ")
    assert needle in lines[0]
