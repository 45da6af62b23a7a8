"""Lane workers as real processes on the real Redis: CPU pinning in the main and every pool process,
idempotent redelivery, refusal of misrouted ops, and host affinity through CeleryLanes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult
from celery_cluster import LaneCluster
from factories import make_echo_task

from app.lanes.base import LaneName
from app.lanes.celery import CeleryLanes, LaneOpTimeout, LaneStartTimeout, OpRecord
from app.lanes.ops import LaneOp, LaneOpError, decode_result, handle_of
from app.sandboxes.limits import uid_claims_dir
from app.sandboxes.local import LocalSandboxFactory, SandboxError
from workers.celery_app import LANE_OP_TASK, queue_name

RESULT_TIMEOUT_S = 60


def send(cluster: LaneCluster, op: LaneOp[Any], host: str | None = None) -> AsyncResult:
    assert op.host is not None
    return cluster.app.send_task(
        LANE_OP_TASK, args=[op.to_dict()], queue=queue_name(host or op.host, op.lane), task_id=op.op_id
    )


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def wait_for_log(cluster: LaneCluster, text: str) -> None:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while text not in cluster.workers.logs():
        if time.monotonic() > deadline:
            raise AssertionError(f"no worker logged {text!r}")
        time.sleep(0.05)


def read_text(path: Path) -> str:
    return path.read_text()


def test_every_pool_process_of_a_lane_worker_is_pinned(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    host = lane_cluster.hosts[0]
    factory = LocalSandboxFactory(base_dir)
    task = make_echo_task(task_root, setup="sleep 0.5; grep Cpus_allowed_list /proc/self/status")
    handles = [handle_of(factory.create(f"pin{i}"), host) for i in range(4)]
    resets = [LaneOp.reset(h, task) for h in handles]
    pending = [send(lane_cluster, op) for op in resets]
    envelopes = [r.get(timeout=RESULT_TIMEOUT_S) for r in pending]

    # Inside the task: each pool process runs on CPU 1 only, and both pool processes took work.
    assert {tuple(e["affinity"]) for e in envelopes} == {(1,)}
    assert len({e["pid"] for e in envelopes}) == 2
    for op, envelope in zip(resets, envelopes, strict=True):
        result = decode_result(op, envelope["result"])
        assert result.exit_code == 0
        assert "Cpus_allowed_list:\t1" in result.output  # the sandbox command too
    # From outside: the worker's main process and every pool process it forked.
    main = lane_cluster.by_lane[host, LaneName.RESET]
    pool = children(main.pid)
    assert len(pool) == 2
    assert [cpus_allowed(pid) for pid in [main.pid, *pool]] == ["1"] * 3

    # The sandboxes' uid claims are held by the worker's main process, which outlives pool processes.
    # (The claims directory is the host's: other processes' claims may sit beside these.)
    claims = [p for p in uid_claims_dir().iterdir() if p.name.isdigit() and p.read_text() == str(main.pid)]
    assert len(claims) == 4

    cleanups = [send(lane_cluster, LaneOp.cleanup(h)) for h in handles]
    for pending_cleanup in cleanups:
        pending_cleanup.get(timeout=RESULT_TIMEOUT_S)
    assert not any((base_dir / f"pin{i}").exists() for i in range(4))


def test_a_repeated_delivery_of_a_completed_op_returns_the_stored_result(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    host = lane_cluster.hosts[0]
    handle = handle_of(LocalSandboxFactory(base_dir).create("idem"), host)
    send(lane_cluster, LaneOp.reset(handle, make_echo_task(task_root))).get(timeout=RESULT_TIMEOUT_S)
    append = LaneOp.exec(handle, "echo ran >> runs.txt; wc -l < runs.txt", 10)
    first = send(lane_cluster, append).get(timeout=RESULT_TIMEOUT_S)
    send(lane_cluster, append)  # the same op id again: a redelivery
    wait_for_log(lane_cluster, f"op {append.op_id} (exec) delivered again: returning its stored result")
    count = send(lane_cluster, LaneOp.exec(handle, "wc -l < runs.txt", 10)).get(timeout=RESULT_TIMEOUT_S)
    send(lane_cluster, LaneOp.cleanup(handle)).get(timeout=RESULT_TIMEOUT_S)

    assert not first["replayed"]
    assert decode_result(append, first["result"]).output.strip() == "1"
    assert count["result"]["output"].strip() == "1"  # the repeated delivery did not run the command


def test_an_op_sent_to_another_hosts_queue_is_refused(lane_cluster: LaneCluster, base_dir: Path) -> None:
    a, b = lane_cluster.hosts
    op = LaneOp.validate(handle_of(LocalSandboxFactory(base_dir).create("lost"), b))
    with pytest.raises(LaneOpError, match=f"reached the validate worker of '{a}'"):
        send(lane_cluster, op, host=a).get(timeout=RESULT_TIMEOUT_S)


def test_an_op_under_another_task_id_is_refused(lane_cluster: LaneCluster, base_dir: Path) -> None:
    op = LaneOp.validate(handle_of(LocalSandboxFactory(base_dir).create("renamed"), lane_cluster.hosts[0]))
    pending = lane_cluster.app.send_task(
        LANE_OP_TASK, args=[op.to_dict()], queue=queue_name(lane_cluster.hosts[0], op.lane)
    )  # a fresh task id: the op could not be recognised when delivered again
    with pytest.raises(LaneOpError, match="the task id must be the op id"):
        pending.get(timeout=RESULT_TIMEOUT_S)


async def test_every_op_of_a_sandbox_lands_on_the_host_it_was_placed_on(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    records: list[OpRecord] = []
    lanes = CeleryLanes(lane_cluster.app, lane_cluster.hosts, on_done=records.append)
    factory = LocalSandboxFactory(base_dir)
    task = make_echo_task(task_root)

    starts: list[str] = []

    async def attempt(i: int) -> tuple[str, float]:
        handle = lanes.attach(factory.create(f"aff{i}"))
        assert handle.host is not None
        started = lambda: starts.append(handle.id)  # noqa: E731
        await lanes.run_op(LaneOp.reset(handle, task), started)
        await lanes.run_op(LaneOp.exec(handle, "echo hello again > greeting.txt", 10), started)
        reward = await lanes.run_op(LaneOp.validate(handle), started)
        await lanes.run_op(LaneOp.cleanup(handle), started)
        return handle.host, reward

    async with asyncio.timeout(RESULT_TIMEOUT_S):
        done = await asyncio.gather(*(attempt(i) for i in range(4)))

    assert [reward for _, reward in done] == [1.0] * 4
    assert sorted(host for host, _ in done) == sorted(lane_cluster.hosts * 2)  # placed 2 and 2
    by_sandbox: dict[str, set[str]] = {}
    for record in records:
        by_sandbox.setdefault(record.op.handle.id, set()).add(record.host)
        assert record.host == record.op.host
        assert record.affinity == (1,)
    assert len(records) == 16
    assert sorted(starts) == sorted(f"aff{i}" for i in range(4) for _ in range(4))  # once per op
    assert all(len(hosts) == 1 for hosts in by_sandbox.values())
    stats = lanes.stats()
    assert stats["exec"].completed == 4
    assert stats["exec"].busy == 0
    assert not any((base_dir / f"aff{i}").exists() for i in range(4))


def test_lane_stats_count_the_messages_waiting_in_a_hosts_queue(
    lane_cluster: LaneCluster, base_dir: Path
) -> None:
    idle_host = f"idle{lane_cluster.hosts[0]}"  # no worker consumes this host's queues
    lanes = CeleryLanes(lane_cluster.app, [idle_host], depth_ttl_s=0.0)
    cached = CeleryLanes(lane_cluster.app, [idle_host], depth_ttl_s=3600.0)
    assert cached.stats()["exec"].queue_depth == 0
    handle = lanes.attach(LocalSandboxFactory(base_dir).create("queued"))
    for _ in range(3):
        send(lane_cluster, LaneOp.exec(handle, "true", 5))
    assert lanes.stats()["exec"].queue_depth == 3
    assert cached.stats()["exec"].queue_depth == 0  # within its TTL: no broker round trip
    assert lanes.stats()["validate"].queue_depth == 0
    with lane_cluster.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue_name(idle_host, LaneName.EXEC))
    assert lanes.stats()["exec"].queue_depth == 0


def test_a_pool_process_killed_mid_op_gets_its_op_redelivered_to_a_pinned_replacement(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    host = lane_cluster.hosts[1]
    handle = handle_of(LocalSandboxFactory(base_dir).create("killed"), host)
    send(lane_cluster, LaneOp.reset(handle, make_echo_task(task_root))).get(timeout=RESULT_TIMEOUT_S)
    slow = LaneOp.exec(handle, "echo run >> runs.txt; sleep 2; wc -l < runs.txt", 30)
    pending = send(lane_cluster, slow)
    runs = base_dir / "killed" / "runs.txt"
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while not runs.exists():
        assert time.monotonic() < deadline, "the op never started"
        time.sleep(0.02)
    main = lane_cluster.by_lane[host, LaneName.EXEC]
    [victim] = children(main.pid)
    os.kill(victim, signal.SIGKILL)  # the pool process running the op, as the OOM killer would

    envelope = pending.get(timeout=RESULT_TIMEOUT_S)
    send(lane_cluster, LaneOp.cleanup(handle)).get(timeout=RESULT_TIMEOUT_S)
    assert envelope["pid"] != victim
    assert envelope["affinity"] == [1]  # the replacement pool process is pinned too
    assert decode_result(slow, envelope["result"]).output.strip() == "2"  # ran again: at least once


async def test_a_workers_error_is_raised_to_the_caller_with_its_type(
    lane_cluster: LaneCluster, base_dir: Path
) -> None:
    lanes = CeleryLanes(lane_cluster.app, lane_cluster.hosts[:1])
    handle = lanes.attach(LocalSandboxFactory(base_dir).create("unset"))
    with pytest.raises(SandboxError, match="used before reset"):
        await lanes.run_op(LaneOp.exec(handle, "true", 5))
    await lanes.run_op(LaneOp.cleanup(handle))
    assert lanes.stats()["exec"].busy == 0


async def test_a_cancelled_op_is_waited_for_when_running_and_revoked_when_queued(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    # Host b's exec worker has one pool process.
    lanes = CeleryLanes(lane_cluster.app, lane_cluster.hosts[1:], depth_ttl_s=0.0)
    handle = lanes.attach(LocalSandboxFactory(base_dir).create("cancelled"))
    await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
    started = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        running = tg.create_task(
            lanes.run_op(LaneOp.exec(handle, "sleep 1.5; echo ran >> marks.txt", 10), started.set)
        )
        async with asyncio.timeout(RESULT_TIMEOUT_S):
            await started.wait()
        # Sent only once the first has started: both sends go through threads, and sent together the
        # second could reach the broker first and run first (about 1 run in 3 here).
        queued = tg.create_task(lanes.run_op(LaneOp.exec(handle, "echo queued >> marks.txt", 10)))
        # Late acks with a prefetch of 1: the busy worker holds only the op it runs; the other waits
        # in the broker (where a revoke, or another worker, can still take it).
        await asyncio.sleep(0.3)
        assert lanes.stats()["exec"].queue_depth == 1
        running.cancel()
        queued.cancel()
    assert running.cancelled()
    assert queued.cancelled()
    # The running op's cancellation ended only once the op had: its mark is already there.
    assert read_text(base_dir / "cancelled" / "marks.txt") == "ran\n"
    # The queued op was revoked before a worker took it: it never ran, even with time to.
    marks = await lanes.run_op(LaneOp.exec(handle, "cat marks.txt", 10))
    await lanes.run_op(LaneOp.cleanup(handle))
    assert marks.output.splitlines() == ["ran"]


async def test_an_op_no_worker_starts_fails_after_the_start_timeout(
    lane_cluster: LaneCluster, base_dir: Path
) -> None:
    down = f"down{lane_cluster.hosts[0]}"  # a host whose workers are gone
    lanes = CeleryLanes(lane_cluster.app, [down], start_timeout_s=0.5)
    handle = lanes.attach(LocalSandboxFactory(base_dir).create("stranded"))
    started = time.monotonic()
    with pytest.raises(LaneStartTimeout, match="no worker started op"):
        await lanes.run_op(LaneOp.validate(handle))
    assert 0.5 <= time.monotonic() - started < 10
    assert lanes.stats()["validate"].busy == 0
    with lane_cluster.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue_name(down, LaneName.VALIDATE))


async def test_an_op_not_done_in_time_fails_with_an_op_timeout(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    patient = CeleryLanes(lane_cluster.app, lane_cluster.hosts[1:])
    hasty = CeleryLanes(lane_cluster.app, lane_cluster.hosts[1:], op_timeout_s=0.5)
    handle = patient.attach(LocalSandboxFactory(base_dir).create("slow"))
    await patient.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
    started = time.monotonic()
    with pytest.raises(LaneOpTimeout, match=r"not done in 0\.5 s"):
        await hasty.run_op(LaneOp.exec(handle, "sleep 60", 90))
    assert time.monotonic() - started < 50  # it gave up long before the op could end
    await patient.run_op(LaneOp.cleanup(handle))  # kills the sleep, still running in the exec lane
