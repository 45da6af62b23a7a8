"""A Redis restart under running lane ops: the workers reconnect, an op that ends while Redis is down has
its result stored once it is back, and the run's client waits the outage out instead of failing the op.
The test runs its own `redis-server` on a free port (this machine's Redis on 6379 serves the rest of the
suite), keeping nothing on disk, as the machine's does. Also here, as it loses ops the same way: a worker
killed whole with an op it had started; and, as they need a Redis of their own to hand out its unacked
messages again, revoked ops delivered to a worker that never heard of the revoke."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import states
from celery.result import AsyncResult
from celery_cluster import WORKER_CPUS, Redis, Workers, broker_env, wait_for
from factories import make_echo_task
from proc_children import reaped
from redis import Redis as RedisClient

from app.lanes import lost_ops
from app.lanes.base import LaneName
from app.lanes.celery import LANE_OP_TASK, CeleryLanes, LaneStartTimeout, lane_queue
from app.lanes.ops import LaneOp, SandboxHandle
from app.sandboxes.local import LocalSandboxFactory
from workers.celery_app import make_celery


def _lanes_on(redis: Redis, tmp_path: Path, **options: Any) -> tuple[str, str, Workers, CeleryLanes]:
    """The Redis URL, a host name of this test's own, its workers (none started yet) and its lanes."""
    url, host = f"redis://127.0.0.1:{redis.port}/0", f"r{uuid.uuid4().hex[:8]}"
    (tmp_path / "logs").mkdir()
    return url, host, Workers(tmp_path / "logs"), CeleryLanes(make_celery(url, url), (host,), **options)


async def _slow_op_started(
    lanes: CeleryLanes, sandbox: Path, task_root: Path, sleep_s: float
) -> tuple[Any, asyncio.Task[Any], Path]:
    """A sandbox at `sandbox`, reset, and an exec op in it that writes a line to `runs.txt` each time
    it starts, sleeps `sleep_s` and says done; returned once it has started."""
    handle = lanes.attach(LocalSandboxFactory(sandbox.parent).create(sandbox.name))
    await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
    command = f"echo run >> runs.txt; sleep {sleep_s:g}; echo done"
    op = asyncio.create_task(lanes.run_op(LaneOp.exec(handle, command, 120)))
    runs = sandbox / "runs.txt"
    deadline = time.monotonic() + 60
    while not runs.exists():
        assert time.monotonic() < deadline, "the op never started"
        await asyncio.sleep(0.02)
    return handle, op, runs


@pytest.mark.parametrize(
    ("op_s", "down_s"),
    [(4, 2), (1, 4)],
    ids=["redis-back-before-the-op-ends", "redis-down-as-the-op-ends"],
)
async def test_lane_ops_go_on_through_a_redis_restart(
    op_s: int, down_s: int, redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    # With Celery's defaults, an op that ended while Redis was down lost its result (the worker tried
    # to store it once: "Exception raised outside body: ConnectionError"), and the client's poll raised
    # redis' ConnectionError, failing the attempt.
    url, host, workers, lanes = _lanes_on(redis, tmp_path)
    try:
        procs = [
            workers.start("--lane", lane, "--cpus", WORKER_CPUS, "--host", host, env=broker_env(url, url))
            for lane in ("reset", "exec", "cleanup")
        ]
        handle = lanes.attach(LocalSandboxFactory(base_dir).create("restart"))
        await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
        slow = asyncio.create_task(
            lanes.run_op(LaneOp.exec(handle, f"echo started > started.txt; sleep {op_s}; echo done", 60))
        )
        started = base_dir / "restart" / "started.txt"
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline, "the op never started"
            await asyncio.sleep(0.02)
        await asyncio.to_thread(redis.restart, down_s)  # it comes back empty: nothing on disk

        assert (await asyncio.wait_for(slow, 120)).output.strip() == "done"
        after = await lanes.run_op(LaneOp.exec(handle, "echo after", 30))  # sent once Redis is back
        assert after.output.strip() == "after"
        await lanes.run_op(LaneOp.cleanup(handle))
        assert [p.poll() for p in procs] == [None, None, None], workers.logs()
    finally:
        lanes.close()
        workers.stop()


async def test_an_op_still_queued_when_redis_comes_back_empty_is_sent_again_and_none_runs_twice(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    # One exec slot: a slow op runs while a second waits in Redis. Redis keeps nothing on disk, so the
    # restart took the waiting op with it, and its attempt waited for ever (a run stuck at B + S). The
    # running op's STARTED mark went too: it must not be taken for lost and run a second time.
    url, host, workers, lanes = _lanes_on(redis, tmp_path, depth_ttl_s=0.0)
    try:
        env = broker_env(url, url)
        one_slot = ("--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1")
        procs = [workers.start("--lane", lane, *one_slot, env=env) for lane in ("reset", "exec", "cleanup")]
        handle, slow, runs = await _slow_op_started(lanes, base_dir / "lost", task_root, sleep_s=6)
        deadline = time.monotonic() + 60
        queued = asyncio.create_task(lanes.run_op(LaneOp.exec(handle, "echo run >> queued-runs.txt", 30)))
        while lanes.stats()["exec"].queue_depth != 1:
            assert time.monotonic() < deadline, "the second op never waited in its queue"
            await asyncio.sleep(0.05)
        await asyncio.to_thread(redis.restart, 1.0)  # back empty: the queued op's message is gone

        assert (await asyncio.wait_for(slow, 120)).output.strip() == "done"
        await asyncio.wait_for(queued, 120)
        assert runs.read_text() == "run\n"  # the running op was found with its worker, not sent again
        assert (base_dir / "lost" / "queued-runs.txt").read_text() == "run\n"
        assert lanes.stats()["exec"].resent == 1
        await lanes.run_op(LaneOp.cleanup(handle))
        assert [p.poll() for p in procs] == [None, None, None], workers.logs()
    finally:
        lanes.close()
        workers.stop()


def test_lane_stats_keep_their_last_counts_while_redis_is_away(
    redis: Redis, base_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A run view (GET /api/runs/{id}, the dashboard) asks the lanes for their queue depths: with Redis
    # away that call waited 6 s for kombu's reconnection loop and raised OperationalError (a 500).
    import app.lanes.celery as celery_lanes

    monkeypatch.setattr(celery_lanes, "DEPTH_RETRY_S", 0.0)  # ask the broker again at every call
    url = f"redis://127.0.0.1:{redis.port}/0"
    host = f"q{uuid.uuid4().hex[:8]}"  # no worker serves it: what is sent stays queued
    app = make_celery(url, url)
    lanes = CeleryLanes(app, (host,), depth_ttl_s=0.0)
    try:
        handle = lanes.attach(LocalSandboxFactory(base_dir).create("queued"))
        for _ in range(2):
            op = LaneOp.exec(handle, "true", 5)
            app.send_task(LANE_OP_TASK, args=[op.to_dict()], queue=lane_queue(host, LaneName.EXEC))
        assert lanes.stats()["exec"].queue_depth == 2
        redis.stop()
        assert lanes.stats()["exec"].queue_depth == 2  # the last count stands
        assert lanes.stats()["exec"].max_queue_depth == 2
        assert caplog.text.count("lane queue depths: the broker cannot be reached") == 1  # said once
        redis.start()  # back, empty: nothing on disk
        assert lanes.stats()["exec"].queue_depth == 0
    finally:
        lanes.close()


@dataclass
class KilledWorker:
    url: str
    host: str
    workers: Workers
    lanes: CeleryLanes
    handle: Any
    op: asyncio.Task[Any]  # the exec op, started on the killed worker
    runs: Path  # a line per time the op started


@pytest.fixture
async def killed_worker(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[KilledWorker]:
    """An exec op started on a one-slot worker, whose whole worker (main process and pool) is then
    killed with SIGKILL, as `kill -9 -<pgid>` does."""
    monkeypatch.setattr(lost_ops, "HOLDER_CHECK_S", 1.0)  # checks each second, not each 10 s
    url, host, workers, lanes = _lanes_on(redis, tmp_path)
    try:
        env = broker_env(url, url)
        one_slot = ("--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1")
        for lane in ("reset", "cleanup"):
            workers.start("--lane", lane, *one_slot, env=env)
        doomed = workers.start("--lane", "exec", *one_slot, env=env)
        handle, op, runs = await _slow_op_started(lanes, base_dir / "killed", task_root, sleep_s=4)
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        yield KilledWorker(url, host, workers, lanes, handle, op, runs)
        await lanes.run_op(LaneOp.cleanup(handle))
    finally:
        lanes.close()
        workers.stop()


async def test_an_op_whose_worker_was_killed_whole_is_sent_again(killed_worker: KilledWorker) -> None:
    # Its message stayed in Redis's unacked ones, delivered again only after the 4 h visibility timeout:
    # the attempt waited that long, and a stop of the run waited on it until the server gave up.
    k = killed_worker
    k.workers.start("--lane", "exec", "--cpus", WORKER_CPUS, "--host", k.host, env=broker_env(k.url, k.url))
    assert (await asyncio.wait_for(k.op, 120)).output.strip() == "done"
    assert k.runs.read_text() == "run\nrun\n"  # killed half-way once, then run whole
    assert k.lanes.stats()["exec"].resent == 1
    client = RedisClient.from_url(k.url)
    assert not [raw for raw in client.hvals("unacked") if b"sleep 4" in raw]  # not delivered again in 4 h
    client.close()


async def test_a_cancelled_op_whose_worker_was_killed_is_not_waited_for(killed_worker: KilledWorker) -> None:
    # Cancelled (the run stopping), it was waited for 60 s (cancel_grace_s) though nothing could end
    # it, and `corral serve` gave up on the run after 30 s: the run was left `stopping`.
    await asyncio.sleep(0.5)
    began = time.monotonic()
    killed_worker.op.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(killed_worker.op, 120)
    assert time.monotonic() - began < 15  # a ping's time, not cancel_grace_s


def redeliver_unacked(url: str) -> None:
    """What Redis's transport does with the unacked messages once the visibility timeout (4 h) has passed,
    done now: kombu's own `restore_visible`, under a timeout of 0, puts them back in their queues."""
    app = make_celery(url, url)
    app.conf.broker_transport_options = {"visibility_timeout": 0}
    try:
        with app.connection_for_write() as conn:
            conn.default_channel.qos.restore_visible(num=100)
    finally:
        app.close()


async def test_a_cancelled_op_whose_worker_was_killed_is_not_run_when_redis_delivers_it_again(
    killed_worker: KilledWorker,
) -> None:
    # The cancellation ended its attempt, but its message stayed among Redis's unacked ones: 4 h later
    # Redis handed it out again and the worker that replaced the killed one ran it (its revoke was
    # broadcast before that worker started), on a sandbox whose attempt had ended.
    k = killed_worker
    await asyncio.sleep(0.5)
    k.op.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(k.op, 120)
    client = RedisClient.from_url(k.url)
    try:
        [message] = [raw for raw in client.hvals("unacked") if b"sleep 4" in raw]  # still there
        result = AsyncResult(json.loads(message)[0]["headers"]["id"], app=k.lanes.celery)
        k.workers.start(
            "--lane", "exec", "--cpus", WORKER_CPUS, "--host", k.host, env=broker_env(k.url, k.url)
        )
        await asyncio.to_thread(redeliver_unacked, k.url)
        await asyncio.to_thread(wait_for, lambda: result.state in states.READY_STATES, 60, "the redelivery")
        assert result.state == states.REVOKED
        assert k.runs.read_text() == "run\n"  # started once, on the killed worker, never again
        # acked, just after its state was stored (a loaded machine saw the state before the ack)
        await asyncio.to_thread(
            wait_for, lambda: not [raw for raw in client.hvals("unacked") if b"sleep 4" in raw], 30, "the ack"
        )
    finally:
        client.close()


async def test_an_op_revoked_while_its_host_had_no_worker_is_not_run_by_the_worker_started_later(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    # The op waited in the queue of a lane with no worker and failed with LaneStartTimeout (revoked):
    # the exec worker started afterwards never got the revoke and ran it, after its attempt had ended.
    url, host, workers, lanes = _lanes_on(redis, tmp_path)
    hasty = CeleryLanes(lanes.celery, (host,), start_timeout_s=1.0)
    try:
        env = broker_env(url, url)
        one_slot = ("--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1")
        for lane in ("reset", "cleanup"):
            workers.start("--lane", lane, *one_slot, env=env)
        sandbox = base_dir / "late"
        handle = lanes.attach(LocalSandboxFactory(sandbox.parent).create(sandbox.name))
        await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
        with pytest.raises(LaneStartTimeout):
            await hasty.run_op(LaneOp.exec(handle, "echo run >> runs.txt", 30))
        workers.start("--lane", "exec", *one_slot, env=env)
        # One slot, first in first out: once this op is done, the revoked one ahead of it was taken.
        after = await asyncio.wait_for(lanes.run_op(LaneOp.exec(handle, "echo after", 30)), 120)
        assert after.output.strip() == "after"
        assert not (sandbox / "runs.txt").exists()
        await lanes.run_op(LaneOp.cleanup(handle))
    finally:
        hasty.close()
        lanes.close()
        workers.stop()


THIEF = """
import sys, time
from kombu import Connection
with Connection(sys.argv[1]) as conn:
    queue = conn.SimpleQueue(sys.argv[2])
    queue.get(block=True, timeout=60)  # taken, never acked: as a worker killed before it starts the op
    print("taken", flush=True)
    time.sleep(3600)
"""


@contextlib.contextmanager
def _thief(url: str, queue: str) -> Iterator[subprocess.Popen[str]]:
    """A consumer of `queue` that takes one message, says `taken`, never acks it and waits to be killed;
    killed on the way out if the test did not."""
    import sys

    argv = [sys.executable, "-c", THIEF, url, queue]
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    with popen as thief, reaped(thief):
        yield thief


async def _reset_without_exec_worker(
    url: str, host: str, workers: Workers, lanes: CeleryLanes, sandbox: Path, task_root: Path
) -> tuple[dict[str, str], tuple[str, ...], Path, SandboxHandle]:
    """Reset and cleanup workers of one slot on `host`, no exec worker yet, and a sandbox at `sandbox`,
    reset: returns the workers' environment, their one-slot options, the sandbox and its handle."""
    env = broker_env(url, url)
    one_slot = ("--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1")
    for lane in ("reset", "cleanup"):
        workers.start("--lane", lane, *one_slot, env=env)
    handle = lanes.attach(LocalSandboxFactory(sandbox.parent).create(sandbox.name))
    await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
    return env, one_slot, sandbox, handle


async def _took_it(thief: subprocess.Popen[str]) -> None:
    """Wait until the thief took its message, then kill it whole."""
    assert thief.stdout is not None
    assert (await asyncio.to_thread(thief.stdout.readline)).strip() == "taken"
    os.killpg(thief.pid, signal.SIGKILL)
    thief.wait()


async def test_an_op_taken_by_a_worker_killed_before_it_started_it_is_sent_again(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker killed whole after it took an op and before it marked the op STARTED left the message
    # among Redis's unacked ones, held by nobody: with a live worker on its queue the attempt waited
    # start_timeout_s (900 s) and failed with LaneStartTimeout (a user's kill -9 of a whole exec worker).
    monkeypatch.setattr(lost_ops, "HOLDER_CHECK_S", 1.0)  # checks each second, not each 10 s
    url, host, workers, lanes = _lanes_on(redis, tmp_path)
    try:
        env, one_slot, sandbox, handle = await _reset_without_exec_worker(
            url, host, workers, lanes, base_dir / "taken", task_root
        )
        with _thief(url, lane_queue(host, LaneName.EXEC)) as thief:
            cmd = "echo run >> runs.txt; echo done"
            op = asyncio.create_task(lanes.run_op(LaneOp.exec(handle, cmd, 60)))
            await _took_it(thief)
        client = RedisClient.from_url(url)
        assert [raw for raw in client.hvals("unacked") if b"runs.txt" in raw]  # left there, held by nobody
        workers.start("--lane", "exec", *one_slot, env=env)
        assert (await asyncio.wait_for(op, 120)).output.strip() == "done"
        assert (sandbox / "runs.txt").read_text() == "run\n"  # run once
        assert lanes.stats()["exec"].resent == 1
        assert not [raw for raw in client.hvals("unacked") if b"runs.txt" in raw]  # not delivered again
        client.close()
        await lanes.run_op(LaneOp.cleanup(handle))
    finally:
        lanes.close()
        workers.stop()


async def test_a_cancelled_op_taken_by_a_worker_killed_before_it_started_it_is_never_run(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    # Cancelled while a consumer killed whole held it unstarted, its message stayed among Redis's unacked
    # ones: handed out again after the visibility timeout, the exec worker started since then ran it.
    url, host, workers, lanes = _lanes_on(redis, tmp_path)
    try:
        env, one_slot, sandbox, handle = await _reset_without_exec_worker(
            url, host, workers, lanes, base_dir / "dropped", task_root
        )
        with _thief(url, lane_queue(host, LaneName.EXEC)) as thief:
            op = asyncio.create_task(lanes.run_op(LaneOp.exec(handle, "echo run >> runs.txt", 60)))
            assert thief.stdout is not None
            assert (await asyncio.to_thread(thief.stdout.readline)).strip() == "taken"
            op.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(op, 120)
        workers.start("--lane", "exec", *one_slot, env=env)
        await asyncio.to_thread(redeliver_unacked, url)
        # One slot, first in first out: once this op is done, the cancelled one ahead of it was taken.
        after = await asyncio.wait_for(lanes.run_op(LaneOp.exec(handle, "echo after", 30)), 120)
        assert after.output.strip() == "after"
        assert not (sandbox / "runs.txt").exists()
        client = RedisClient.from_url(url)
        assert not [raw for raw in client.hvals("unacked") if b"runs.txt" in raw]  # acked
        client.close()
        await lanes.run_op(LaneOp.cleanup(handle))
    finally:
        lanes.close()
        workers.stop()


async def test_an_op_cancelled_while_redis_is_down_ends_cancelled_and_says_it_could_not_record_it(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The revoke's record (`corral:cancelled:<id>`) could not be written, and redis's ConnectionError
    # replaced the cancellation: a run stopping during a Redis outage ended failed, not stopped.
    url, host, workers, lanes = _lanes_on(redis, tmp_path, cancel_grace_s=2.0)
    try:
        env = broker_env(url, url)
        for lane in ("reset", "exec", "cleanup"):
            workers.start("--lane", lane, "--cpus", WORKER_CPUS, "--host", host, env=env)
        _, op, _ = await _slow_op_started(lanes, base_dir / "down", task_root, 30)
        await asyncio.to_thread(redis.stop)
        began = time.monotonic()
        op.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(op, 120)
        assert time.monotonic() - began < 30  # cancel_grace_s and the revoke's tries (7 s here)
        assert any("could not record its cancellation" in r.getMessage() for r in caplog.records)
    finally:
        lanes.close()
        workers.stop()
