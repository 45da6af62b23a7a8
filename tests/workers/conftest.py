"""Fixtures of the Celery tests; the helpers they use live in celery_cluster.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery_cluster import REDIS_URL, WORKER_CPUS, LaneCluster, Workers
from factories import redis_answers

from app.lanes.base import LaneName
from workers.celery_app import make_celery


@pytest.fixture(scope="session")
def lane_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaneCluster]:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379 (the Celery tests need a real broker)")
    prefix = uuid.uuid4().hex[:8]
    hosts = (f"a{prefix}", f"b{prefix}")
    workers = Workers(tmp_path_factory.mktemp("workers"))
    by_lane = {}
    try:
        for host in hosts:
            for lane in LaneName:
                concurrency = "2" if lane is LaneName.RESET else "1"
                by_lane[host, lane] = workers.start(
                    "--lane", lane.value, "--cpus", WORKER_CPUS, "--host", host, "--concurrency", concurrency
                )
        app = make_celery(REDIS_URL, REDIS_URL)
        yield LaneCluster(hosts, app, workers, by_lane)
        app.close()
    finally:
        workers.stop()
