"""Prometheus multiprocess mode under a real Celery worker: a killed pool process's live gauges stop
counting (its replacement sweeps them), while its counters keep counting."""

from __future__ import annotations

import fcntl
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from celery_cluster import Workers, broker_env
from factories import redis_answers
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from app.metrics import LOCK_NAME
from workers.celery_app import ORCHESTRATOR_TASK, make_celery

REDIS_DB = "redis://127.0.0.1:6379/12"  # its own database: no other orchestrator worker takes these

STUB = """
import os
from app.metrics import CorralMetrics

def run(run_id, settings):
    metrics = CorralMetrics()
    metrics.groups_in_flight.labels(run_id).set(5)
    metrics.batches.labels(run_id).inc()
    return {"pid": os.getpid()}
"""


def sample(prom_dir: Path, name: str) -> float:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(prom_dir))
    return sum(s.value for metric in registry.collect() for s in metric.samples if s.name == name)


def test_a_killed_pool_process_stops_counting_in_live_gauges(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "metrics_stub.py").write_text(STUB)
    env = broker_env(REDIS_DB, REDIS_DB)
    env.update(PYTHONPATH=str(tmp_path / "entry"), PROMETHEUS_MULTIPROC_DIR=str(prom_dir))
    env["CORRAL_DATABASE_URL"] = f"sqlite:///{tmp_path / 'corral.db'}"
    workers = Workers(tmp_path / "logs")
    (tmp_path / "logs").mkdir()
    app = make_celery(REDIS_DB, REDIS_DB)
    try:
        workers.start("--orchestrator", "--entry", "metrics_stub:run", env=env)
        first = app.send_task(ORCHESTRATOR_TASK, args=[uuid.uuid4().hex]).get(timeout=60)["pid"]
        assert sample(prom_dir, "corral_groups_in_flight") == 5
        os.kill(first, signal.SIGKILL)  # as the OOM killer would: nothing runs in the dying process
        deadline = time.monotonic() + 30
        while (prom_dir / f"gauge_livesum_{first}.db").exists():
            assert time.monotonic() < deadline, workers.logs()
            time.sleep(0.1)
        assert sample(prom_dir, "corral_groups_in_flight") == 0  # the dead process no longer counts
        assert sample(prom_dir, "corral_batches_delivered_total") == 1  # its counter still does
        # The worker holds the directory, so a `corral serve` starting now would leave its files.
        fd = os.open(prom_dir / LOCK_NAME, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        app.close()
        workers.stop()
