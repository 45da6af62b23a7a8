"""What a lane op costs over Celery: round-trip time of one `exec` op through `InProcessLanes` and through
`CeleryLanes` (real `corral worker` processes on this machine's Redis), on the same LocalSandbox.

Each measurement runs `--ops` exec ops of `--command` one after another on one sandbox (reset before,
cleanup after, not timed) and reports the median, p90 and max round trip in milliseconds, and the
ratio of the medians. Celery's figure includes publishing, the worker's pick-up (prefetch 1, late ack),
the worker rebuilding the sandbox from its handle and host state, the result backend write, and the
client's polling (5 ms, doubling to 200 ms). It asserts nothing about speed.

Run: `.venv/bin/python -m benchmarks.celery_lanes [--ops 200 --command true --cpus 1]`
(needs Redis on 127.0.0.1:6379).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from app.lanes.base import LaneName, Lanes
from app.lanes.celery import CeleryLanes
from app.lanes.inprocess import InProcessLanes
from app.lanes.ops import LaneOp
from app.sandboxes.local import LocalSandboxFactory
from app.tasks.spec import TaskSpec

REDIS_URL = "redis://127.0.0.1:6379/0"


async def round_trips(lanes: Lanes, base_dir: Path, task: TaskSpec, ops: int, command: str) -> list[float]:
    handle = lanes.attach(LocalSandboxFactory(base_dir).create(f"bench-{uuid.uuid4().hex[:6]}"))
    await lanes.run_op(LaneOp.reset(handle, task))
    times = []
    try:
        for _ in range(ops):
            started = time.perf_counter()
            result = await lanes.run_op(LaneOp.exec(handle, command, 30))
            times.append(time.perf_counter() - started)
            if result.exit_code != 0:
                raise RuntimeError(f"{command!r} failed: {result.output}")
    finally:
        await lanes.run_op(LaneOp.cleanup(handle))
    return times


def start_workers(host: str, cpus: str) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "CORRAL_BROKER_URL": REDIS_URL, "CORRAL_RESULT_BACKEND": REDIS_URL}
    corral = str(Path(sys.executable).with_name("corral"))
    return [
        subprocess.Popen(
            [corral, "worker", "--lane", lane.value, "--cpus", cpus, "--host", host, "--concurrency", "1",
             "--loglevel", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        for lane in LaneName
    ]  # fmt: skip


def stop_workers(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return f"{name:<11} median {statistics.median(ms):7.2f} ms   p90 {p90:7.2f} ms   max {ms[-1]:7.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--command", default="true")
    parser.add_argument("--cpus", default="1", help="CPU list of the lanes (both kinds)")
    args = parser.parse_args()
    cpus = tuple(int(c) for c in args.cpus.split(","))
    base_dir = Path(tempfile.mkdtemp(prefix="corral-bench-", dir="/tmp"))
    base_dir.chmod(0o711)
    root = base_dir / "task"
    root.mkdir()
    task = TaskSpec(name="bench", instruction="", root=root, validation="true")
    host = f"bench{uuid.uuid4().hex[:6]}"
    procs = start_workers(host, args.cpus)
    try:
        inproc = InProcessLanes(dict.fromkeys(LaneName, 1), dict.fromkeys(LaneName, cpus))
        local = asyncio.run(round_trips(inproc, base_dir, task, args.ops, args.command))
        celery = CeleryLanes.connect(REDIS_URL, REDIS_URL, [host])
        try:
            remote = asyncio.run(round_trips(celery, base_dir, task, args.ops, args.command))
        finally:
            celery.close()
    finally:
        stop_workers(procs)
        shutil.rmtree(base_dir, ignore_errors=True)
    print(f"{args.ops} sequential exec ops of {args.command!r}, lanes on CPUs {args.cpus}")
    print(summary("in-process", local))
    print(summary("celery", remote))
    print(f"median ratio celery / in-process: {statistics.median(remote) / statistics.median(local):.2f}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
