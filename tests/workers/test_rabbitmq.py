"""The same lanes on RabbitMQ: an amqp:// broker with Redis keeping results, real workers, real ops,
and the queue depth as RabbitMQ counts it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery_cluster import REDIS_URL, Workers, broker_env, parent_of
from factories import make_echo_task, redis_answers

from app.lanes.base import LaneName
from app.lanes.celery import CeleryLanes, OpRecord
from app.lanes.ops import LaneOp
from app.sandboxes.local import LocalSandboxFactory

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"


def rabbitmq_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


def start_lane_worker(workers: Workers, lane: LaneName, host: str) -> subprocess.Popen[bytes]:
    return workers.start(
        "--lane", lane.value, "--cpus", "1", "--host", host, "--concurrency", "1",
        env=broker_env(AMQP_URL, REDIS_URL),
    )  # fmt: skip


@pytest.fixture(scope="module")
def amqp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Workers]]:
    if not (rabbitmq_answers() and redis_answers()):
        pytest.skip("needs RabbitMQ on 127.0.0.1:5672 and Redis on 127.0.0.1:6379")
    host = f"q{uuid.uuid4().hex[:8]}"
    workers = Workers(tmp_path_factory.mktemp("amqp"))
    try:
        for lane in LaneName:
            start_lane_worker(workers, lane, host)
        yield host, workers
    finally:
        workers.stop()


@pytest.fixture
def amqp_host(amqp_cluster: tuple[str, Workers]) -> str:
    return amqp_cluster[0]


async def test_lane_ops_run_over_rabbitmq(amqp_host: str, base_dir: Path, task_root: Path) -> None:
    records: list[OpRecord] = []
    lanes = CeleryLanes.connect(AMQP_URL, REDIS_URL, [amqp_host], on_done=records.append)
    try:
        handle = lanes.attach(LocalSandboxFactory(base_dir).create("rabbit"))
        async with asyncio.timeout(60):
            reset = await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
            ran = await lanes.run_op(LaneOp.exec(handle, "echo hello rabbit > greeting.txt", 10))
            reward = await lanes.run_op(LaneOp.validate(handle))
            await lanes.run_op(LaneOp.cleanup(handle))
        assert (reset.exit_code, ran.exit_code, reward) == (0, 0, 1.0)
        assert [(r.op.lane.value, r.host, r.affinity) for r in records] == [
            (lane, amqp_host, (1,)) for lane in ("reset", "exec", "validate", "cleanup")
        ]
        assert lanes.stats()["exec"].queue_depth == 0
    finally:
        lanes.close()


def test_queue_depth_is_rabbitmqs_count_of_waiting_messages(amqp_host: str, base_dir: Path) -> None:
    idle = f"idle{amqp_host}"  # no worker consumes this host's queues
    lanes = CeleryLanes.connect(AMQP_URL, REDIS_URL, [idle], depth_ttl_s=0.0)
    queue = f"lane.{idle}.exec"
    try:
        handle = lanes.attach(LocalSandboxFactory(base_dir).create("waiting"))
        for _ in range(3):
            op = LaneOp.exec(handle, "true", 5)
            lanes.celery.send_task("corral.lane_op", args=[op.to_dict()], queue=queue, task_id=op.op_id)
        assert lanes.stats()["exec"].queue_depth == 3
        assert lanes.stats()["reset"].queue_depth == 0  # never declared: counted as empty
    finally:
        with lanes.celery.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)
        lanes.close()


async def test_an_op_of_a_worker_killed_mid_op_goes_to_another_worker_at_once(
    amqp_cluster: tuple[str, Workers], base_dir: Path, task_root: Path
) -> None:
    host, workers = amqp_cluster
    records: list[OpRecord] = []
    lanes = CeleryLanes.connect(AMQP_URL, REDIS_URL, [host], on_done=records.append)
    try:
        handle = lanes.attach(LocalSandboxFactory(base_dir).create("orphan"))
        await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
        [exec_worker] = [p for p in workers.procs if list(p.args)[4:6] == ["--lane", "exec"]]
        started = asyncio.Event()
        async with asyncio.timeout(60), asyncio.TaskGroup() as tg:
            slow = tg.create_task(
                lanes.run_op(LaneOp.exec(handle, "echo run >> runs.txt; sleep 2; wc -l < runs.txt", 30),
                             started.set)
            )  # fmt: skip
            await started.wait()
            os.killpg(exec_worker.pid, signal.SIGKILL)  # the whole worker: main and pool processes
            exec_worker.wait()
            replacement = start_lane_worker(workers, LaneName.EXEC, host)  # another worker of the lane
        assert parent_of(records[-1].pid) == replacement.pid  # the new worker's pool process ran it
        await lanes.run_op(LaneOp.cleanup(handle))
        # At least once: the killed run may or may not have written its line before it died.
        assert slow.result().output.strip() in ("1", "2")
    finally:
        lanes.close()
