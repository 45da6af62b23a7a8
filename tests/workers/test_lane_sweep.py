"""A run's start sweeps its sandbox directory on each lane host (`CeleryLanes.begin_incarnation`): the
host's cleanup worker removes the sandboxes of older incarnations of the run (what a killed one left:
work directories, state files, pids cgroups, uid claims, processes) and leaves the newest incarnation's
alone; ops of an older incarnation are refused from then on. Real lane workers on the real Redis; what
is left is read from the filesystem and /proc, not from the sweep's own counts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import states
from celery.result import AsyncResult
from celery_cluster import LaneCluster, wait_for
from factories import make_echo_task
from proc_children import alive, children

from app.lanes.base import LaneName
from app.lanes.celery import LANE_SWEEP_TASK
from app.lanes.ops import LaneOp, SandboxHandle, decode_result, handle_of, incarnation_suffix
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import pids_parent, real_uid, uid_claims_dir
from app.sandboxes.local import LocalSandboxFactory, SandboxError, probe_bwrap
from workers.celery_app import LANE_OP_TASK, queue_name

RESULT_TIMEOUT_S = 60


def send(cluster: LaneCluster, op: LaneOp[Any]) -> AsyncResult:
    assert op.host is not None
    return cluster.app.send_task(
        LANE_OP_TASK, args=[op.to_dict()], queue=queue_name(op.host, op.lane), task_id=op.op_id
    )


def sweep(cluster: LaneCluster, host: str, root: Path, incarnation: int) -> AsyncResult:
    return cluster.app.send_task(
        LANE_SWEEP_TASK,
        args=[{"root": str(root), "incarnation": incarnation}],
        queue=queue_name(host, LaneName.CLEANUP),
    )


def reset(cluster: LaneCluster, handle: SandboxHandle, task_root: Path) -> None:
    envelope = send(cluster, LaneOp.reset(handle, make_echo_task(task_root))).get(timeout=RESULT_TIMEOUT_S)
    assert envelope["result"]["exit_code"] == 0


def detach(cluster: LaneCluster, handle: SandboxHandle) -> int | None:
    """Start a process in the sandbox that outlives its command; its pid as this host sees it, or None
    where none can (under bwrap the sandbox's pid namespace dies with its command's first process)."""
    marker = f"600.{uuid.uuid4().int % 10**9}"
    op = LaneOp.exec(handle, f"setsid sleep {marker} >/dev/null 2>&1 < /dev/null &", 10)
    send(cluster, op).get(timeout=RESULT_TIMEOUT_S)
    found = children(None, marker.encode())
    if "--unshare-pid" in (probe_bwrap()[0] or ()):
        assert not found
        return None
    assert len(found) == 1
    return found.pop()


def state_of(root: Path, name: str) -> dict[str, Any]:
    return dict(json.loads((root / ".corral-state" / f"{name}.json").read_text()))


def cgroups_of(name: str) -> list[Path]:
    parent = pids_parent(CGROUP_ROOT)
    return [] if parent is None else list(parent[0].glob(f"{name}-*"))


def claim(uid: int) -> str | None:
    try:
        return (uid_claims_dir() / str(uid)).read_text().strip()
    except FileNotFoundError:
        return None


def held_by(worker: int) -> set[str]:
    """The uid claims held by a lane worker: its main process (after a reset) or a pool process (during)."""
    holders = {str(worker)} | {str(pid) for pid in children(worker, b"")}
    return {p.name for p in uid_claims_dir().glob("[0-9]*") if claim(int(p.name)) in holders}


@pytest.mark.slow
def test_a_sweep_removes_an_older_incarnations_sandboxes_and_leaves_the_newest_ones_alone(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("sandbox uids need root and setpriv")
    host = lane_cluster.hosts[0]
    factory = LocalSandboxFactory(base_dir, isolation="none")
    old = [handle_of(factory.create(f"g{i}a0-1{incarnation_suffix(1)}"), host) for i in range(2)]
    for handle in old:
        reset(lane_cluster, handle, task_root)
    stray = detach(lane_cluster, old[0])  # a process a tool call left: it outlives the killed run too
    dead = {h.id: state_of(base_dir, h.id) for h in old}
    assert all(claim(s["uid"]) is not None for s in dead.values())
    assert all(cgroups_of(h.id) for h in old) or pids_parent(CGROUP_ROOT) is None
    # The run started again: its next incarnation (3) resets a sandbox of its own.
    newest = 3
    live = handle_of(factory.create(f"g5a0-2{incarnation_suffix(newest)}"), host)
    reset(lane_cluster, live, task_root)
    live_pid = detach(lane_cluster, live)

    # A sweep of an incarnation between the two, arriving late (its queue's worker was down): it removes
    # what is older than the newest incarnation seen on the host, and nothing of the newest.
    swept = sweep(lane_cluster, host, base_dir, newest - 1).get(timeout=RESULT_TIMEOUT_S)
    if stray is not None:
        wait_for(lambda: not alive(stray), 10, what="the stray process to die")
    assert not any((base_dir / name).exists() for name in dead)
    assert not list((base_dir / ".corral-state").glob("g[01]a0-*"))
    assert not any(cgroups_of(name) for name in dead)
    assert [claim(s["uid"]) for s in dead.values()] == [None, None]
    assert swept["sandboxes"] == 2
    # The newest incarnation's sandbox is untouched: its directory, state, claim and process.
    live_state = state_of(base_dir, live.id)
    assert claim(live_state["uid"]) == str(live_state["uid_holder"])
    assert live_pid is None or alive(live_pid)
    check = LaneOp.exec(live, "cat greeting.txt", 10)
    assert (
        "hello"
        in decode_result(check, send(lane_cluster, check).get(timeout=RESULT_TIMEOUT_S)["result"]).output
    )
    assert "removed what older incarnations of the run left in" in lane_cluster.workers.logs()

    # An op of the older incarnation that reaches a worker afterwards is not run.
    late = LaneOp.reset(
        handle_of(factory.create(f"g2a0-3{incarnation_suffix(1)}"), host), make_echo_task(task_root)
    )
    pending = send(lane_cluster, late)
    wait_for(lambda: pending.state == states.REVOKED, RESULT_TIMEOUT_S, what="the late reset to be refused")
    assert str(pending.result).endswith("not run")  # refused before it ran, not made and then removed
    assert not (base_dir / late.handle.id).exists()

    send(lane_cluster, LaneOp.cleanup(live)).get(timeout=RESULT_TIMEOUT_S)
    assert live_pid is None or not alive(live_pid)
    assert claim(live_state["uid"]) is None


@pytest.mark.slow
def test_a_sweep_leaves_a_uid_whose_claim_another_sandbox_took_since(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    """A lane worker restarted since the dead incarnation's reset lost its claims (they lapse with their
    holder), and another sandbox may have claimed the uid since: the sweep must not kill that one's
    processes, nor free its claim."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("sandbox uids need root and setpriv")
    host = lane_cluster.hosts[0]
    factory = LocalSandboxFactory(base_dir, isolation="none")
    old = handle_of(factory.create(f"g0a0-1{incarnation_suffix(1)}"), host)
    reset(lane_cluster, old, task_root)
    uid = state_of(base_dir, old.id)["uid"]
    (base_dir / "notes").mkdir()  # no attempt's sandbox: a sweep leaves it
    # Another sandbox's holder took the uid (as after the holder's death) and runs a process as it.
    other = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "600"],
        start_new_session=True,
    )
    try:
        (uid_claims_dir() / str(uid)).write_text(str(other.pid))
        swept = sweep(lane_cluster, host, base_dir, 2).get(timeout=RESULT_TIMEOUT_S)
        assert not (base_dir / old.id).exists()
        assert (base_dir / "notes").is_dir()
        assert swept["sandboxes"] == 1
        time.sleep(0.5)  # a kill would have landed by now
        assert other.poll() is None
        assert claim(uid) == str(other.pid)
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
        (uid_claims_dir() / str(uid)).unlink(missing_ok=True)


@pytest.mark.slow
def test_a_reset_that_a_newer_incarnation_overtook_removes_what_it_made(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    """The killed incarnation's reset was running when the sweep came: the sweep removes what it had
    made so far, and once the reset ends it removes what it made after (its state file, its uid claim)."""
    host = lane_cluster.hosts[0]
    factory = LocalSandboxFactory(base_dir, isolation="none")
    handle = handle_of(factory.create(f"g0a0-1{incarnation_suffix(4)}"), host)
    reset_worker = lane_cluster.by_lane[host, LaneName.RESET].pid
    claims_before = held_by(reset_worker)
    slow = LaneOp.reset(handle, make_echo_task(task_root, setup="sleep 3", setup_timeout_s=60.0))
    pending = send(lane_cluster, slow)
    wait_for(lambda: (base_dir / handle.id).exists(), RESULT_TIMEOUT_S, what="the reset to begin")
    sweep(lane_cluster, host, base_dir, 5).get(timeout=RESULT_TIMEOUT_S)
    wait_for(lambda: pending.state == states.REVOKED, RESULT_TIMEOUT_S, what="the overtaken reset to end")
    assert "removed" in str(pending.result)
    assert not (base_dir / handle.id).exists()
    assert not list((base_dir / ".corral-state").glob(f"{handle.id}*"))
    assert not cgroups_of(handle.id)
    assert held_by(reset_worker) == claims_before  # its uid claim released, whoever held it


def same_uid_hint(name: str) -> str:
    """Another sandbox name whose uid claim starts at `name`'s (`UidPool.claim` tries from the name's
    crc32 on): it takes `name`'s uid once that claim lapses."""
    span = 10_000  # LocalSandboxFactory's default uid span, as lane workers use it
    want = zlib.crc32(name.encode()) % span
    return next(f"g1a0-{n}" for n in range(10**6) if zlib.crc32(f"g1a0-{n}".encode()) % span == want)


@dataclass
class Restarted:
    """A sandbox reset on a host of its own, whose reset worker was then killed and started again: its
    uid claim lapsed. `workers` by lane, the reset worker the new one."""

    host: str
    lane: tuple[str, ...]
    factory: LocalSandboxFactory
    first: SandboxHandle
    uid: int
    workers: dict[str, subprocess.Popen[bytes]]


def reset_then_restart(cluster: LaneCluster, base_dir: Path, task_root: Path, *lanes: str) -> Restarted:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("sandbox uids need root and setpriv")
    host = f"u{uuid.uuid4().hex[:8]}"  # workers of its own: one of them is restarted
    lane = ("--cpus", "1", "--host", host, "--concurrency", "1", "--isolation", "none")
    workers = {name: cluster.workers.start("--lane", name, *lane) for name in ("reset", *lanes)}
    factory = LocalSandboxFactory(base_dir, isolation="none")
    first = handle_of(factory.create(f"g0a0-{uuid.uuid4().int % 10**12}"), host)
    reset(cluster, first, task_root)
    uid = state_of(base_dir, first.id)["uid"]
    assert claim(uid) == str(workers["reset"].pid)
    os.killpg(workers["reset"].pid, signal.SIGKILL)  # the reset worker dies (its claims lapse), comes back
    workers["reset"].wait()
    workers["reset"] = cluster.workers.start("--lane", "reset", *lane)
    return Restarted(host, lane, factory, first, uid, workers)


@contextlib.contextmanager
def second_takes_the_uid(
    cluster: LaneCluster, base_dir: Path, task_root: Path, at: Restarted
) -> Iterator[int]:
    """A second sandbox's reset takes the first's lapsed uid and leaves a process running as it (given
    to the block); after the block, its cleanup kills that process and frees the claim."""
    second = handle_of(at.factory.create(same_uid_hint(at.first.id)), at.host)
    marker = f"600.{uuid.uuid4().int % 10**9}"
    setup = f"setsid sleep {marker} >/dev/null 2>&1 </dev/null &"
    op = LaneOp.reset(second, make_echo_task(task_root, setup=setup))
    assert send(cluster, op).get(timeout=RESULT_TIMEOUT_S)["result"]["exit_code"] == 0
    assert state_of(base_dir, second.id)["uid"] == at.uid  # the second sandbox took the lapsed claim
    assert claim(at.uid) == str(at.workers["reset"].pid)
    (process,) = children(None, marker.encode())
    assert real_uid(process) == at.uid
    try:
        yield process
        send(cluster, LaneOp.cleanup(second)).get(timeout=RESULT_TIMEOUT_S)
        wait_for(lambda: not alive(process), 10, what="the second sandbox's process to die with its cleanup")
        assert claim(at.uid) is None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process, signal.SIGKILL)


@pytest.mark.slow
def test_a_late_cleanup_leaves_a_uid_that_another_sandbox_claimed_after_a_worker_restart(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    """A sandbox's uid claim lapses when the lane worker holding it restarts, and another sandbox's reset
    may take that uid: the first sandbox's cleanup, coming later (its run goes on), must not kill the
    second's processes, which run as that uid, nor free its claim."""
    at = reset_then_restart(lane_cluster, base_dir, task_root, "cleanup")
    with second_takes_the_uid(lane_cluster, base_dir, task_root, at) as process:
        send(lane_cluster, LaneOp.cleanup(at.first)).get(timeout=RESULT_TIMEOUT_S)
        assert not (base_dir / at.first.id).exists()
        time.sleep(0.5)  # a kill would have landed by now
        assert alive(process)
        assert claim(at.uid) == str(at.workers["reset"].pid)


@pytest.mark.slow
def test_a_sandbox_runs_nothing_as_a_uid_that_another_sandbox_claimed_after_a_worker_restart(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    """After the restart, the first sandbox's tool calls and validation would run as the uid the second
    sandbox now holds (one could signal or read the other's processes): they are refused with a
    SandboxError saying why, run nothing, and the second sandbox's process and claim stay."""
    at = reset_then_restart(lane_cluster, base_dir, task_root, "exec", "validate", "cleanup")
    with second_takes_the_uid(lane_cluster, base_dir, task_root, at) as process:
        ran = base_dir / at.first.id / "ran-as"
        with pytest.raises(SandboxError, match=rf"uid {at.uid} is no longer claimed for it .*: not run"):
            send(lane_cluster, LaneOp.exec(at.first, f"id -u > {ran}; kill -9 -1", 10)).get(
                timeout=RESULT_TIMEOUT_S
            )
        with pytest.raises(SandboxError, match="is no longer claimed for it"):
            send(lane_cluster, LaneOp.validate(at.first)).get(timeout=RESULT_TIMEOUT_S)
        assert not ran.exists()
        assert alive(process)
        assert claim(at.uid) == str(at.workers["reset"].pid)
        send(lane_cluster, LaneOp.cleanup(at.first)).get(timeout=RESULT_TIMEOUT_S)


@pytest.mark.slow
def test_a_sandbox_takes_over_its_lapsed_uid_claim_that_nobody_took(
    lane_cluster: LaneCluster, base_dir: Path, task_root: Path
) -> None:
    """After the restart nobody took the uid: the first sandbox's next tool call takes its claim over for
    the exec worker's main process (recorded in its state), runs as the uid, and from then on the claim
    is alive again: another sandbox's reset gets another uid, and the first's cleanup frees it."""
    at = reset_then_restart(lane_cluster, base_dir, task_root, "exec", "cleanup")
    envelope = send(lane_cluster, LaneOp.exec(at.first, "id -u", 10)).get(timeout=RESULT_TIMEOUT_S)
    assert envelope["result"]["output"].strip() == str(at.uid)
    assert claim(at.uid) == str(at.workers["exec"].pid)
    assert state_of(base_dir, at.first.id)["uid_holder"] == at.workers["exec"].pid
    second = handle_of(at.factory.create(same_uid_hint(at.first.id)), at.host)
    reset(lane_cluster, second, task_root)
    assert state_of(base_dir, second.id)["uid"] != at.uid
    for handle in (at.first, second):
        send(lane_cluster, LaneOp.cleanup(handle)).get(timeout=RESULT_TIMEOUT_S)
    assert claim(at.uid) is None
