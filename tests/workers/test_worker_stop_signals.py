"""A stop signal sent to a whole `corral worker` (its process group: `kill -TERM -- -PGID`, a supervisor
that kills the group, the terminal window closed) stops it as one sent to its main process does: a warm
shutdown, the op or run under way finishing where it runs, once, and the worker exiting 0. A SIGHUP
ignored at start (`nohup`) stays ignored.

Before, the pool processes died of the group's SIGTERM or SIGHUP at once: the op was cut off, put back
in its queue and run again by the next worker (a tool call run twice), with a `WorkerLostError`
traceback in the log; a SIGHUP where stdout is not a terminal (a log file, `nohup`) also made Celery
restart the worker with `execv`, and the run an orchestrator worker drove died with its unstored events
while the worker said it waited for it.

Real workers on a `redis-server` of this test's own (the `orchestrator` queue's name is fixed), real
signals; the run's entry point is a stand-in that waits to be let go."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from celery_cluster import CORRAL, WORKER_CPUS, Redis, broker_env, wait_for
from factories import make_echo_task
from redis import Redis as RedisClient
from terminal_proc import OnTerminal
from test_broker_restart import _lanes_on
from test_orchestrator_reclaim import STUB, _send

from app.lanes.celery import CeleryLanes
from app.lanes.ops import LaneOp, SandboxHandle
from app.sandboxes.base import ExecResult
from app.sandboxes.local import LocalSandboxFactory
from workers.celery_app import ORCHESTRATOR_QUEUE

# How each stop reaches the worker: the signal, to its process group, and where its output goes
STOPS = {
    "SIGTERM to the group": (signal.SIGTERM, "file"),
    "SIGHUP to the group, output to a file": (signal.SIGHUP, "file"),
    "SIGHUP to the group, its terminal gone": (signal.SIGHUP, "terminal"),
}


class Worker:
    """A `corral worker` in a session of its own, its output to a log file, or on a terminal window of its
    own (`OnTerminal`, which `hang_up` closes); `nohup`: SIGHUP ignored from its start."""

    def __init__(self, log: Path, args: list[str], env: dict[str, str], output: str, nohup: bool) -> None:
        argv = [str(CORRAL), "worker", "--loglevel", "warning", *args]
        self.log, self.window = log, None
        if output == "terminal":
            self.window = OnTerminal(argv, env=env)
            self.proc = self.window.proc
            return
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                preexec_fn=(lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if nohup else None,
            )  # fmt: skip

    def hang_up(self) -> None:
        """The window closed (the kernel sends SIGHUP to the worker's process group), or, where its output
        goes to a file, the shell that started it sends SIGHUP to it as it exits."""
        if self.window is not None:
            self.window.hang_up()
        else:
            os.killpg(self.proc.pid, signal.SIGHUP)

    def stop_with(self, sig: signal.Signals) -> None:
        if sig is signal.SIGHUP:
            self.hang_up()
        else:
            os.killpg(self.proc.pid, sig)

    def logs(self) -> str:
        if self.window is not None:
            return self.window.text()
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> None:
        if self.window is not None:
            self.window.hang_up()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@contextlib.contextmanager
def workers_here(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(*args: str, env: dict[str, str], output: str = "file", nohup: bool = False) -> Worker:
        worker = Worker(tmp_path / f"worker-{len(started)}.log", list(args), env, output, nohup)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.close()


@dataclass
class OpUnderWay:
    """An exec op started on a one-slot exec worker (the only one of its host), with its lanes."""

    lanes: CeleryLanes
    handle: SandboxHandle
    worker: Worker
    op: asyncio.Task[ExecResult]
    runs: Path  # a line per time the op started


@contextlib.asynccontextmanager
async def op_under_way(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path, output: str = "file", nohup: bool = False
) -> AsyncIterator[OpUnderWay]:
    url, host, _, lanes = _lanes_on(redis, tmp_path)
    env = broker_env(url, url)
    one_slot = ("--cpus", WORKER_CPUS, "--host", host, "--concurrency", "1")
    with workers_here(tmp_path) as start:
        try:
            for lane in ("reset", "cleanup"):
                start("--lane", lane, *one_slot, env=env)
            worker = start("--lane", "exec", *one_slot, env=env, output=output, nohup=nohup)
            handle = lanes.attach(LocalSandboxFactory(base_dir).create("op"))
            await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
            runs = base_dir / "op" / "runs.txt"
            command = "echo run >> runs.txt; sleep 3; echo done"
            op = asyncio.create_task(lanes.run_op(LaneOp.exec(handle, command, 120)))
            await asyncio.to_thread(wait_for, runs.exists, 60, "the op to start")
            yield OpUnderWay(lanes, handle, worker, op, runs)
            await lanes.run_op(LaneOp.cleanup(handle))
        finally:
            lanes.close()


@pytest.mark.parametrize("stop", list(STOPS))
async def test_a_lane_worker_stopped_whole_finishes_its_op_once_and_exits_0(
    stop: str, redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    sig, output = STOPS[stop]
    async with op_under_way(redis, tmp_path, base_dir, task_root, output=output) as u:
        u.worker.stop_with(sig)
        # No other exec worker: the op ends on the one stopped, or never
        assert (await asyncio.wait_for(u.op, 120)).output.strip() == "done"
        assert await asyncio.to_thread(u.worker.proc.wait, 60) == 0, u.worker.logs()
        assert u.runs.read_text() == "run\n"  # run once, not cut off and run again
        assert u.lanes.stats()["exec"].resent == 0
        assert "Traceback" not in u.worker.logs(), u.worker.logs()
        assert "Restarting celery worker" not in u.worker.logs()


async def test_a_lane_worker_started_under_nohup_ignores_sighup(
    redis: Redis, tmp_path: Path, base_dir: Path, task_root: Path
) -> None:
    """Celery replaced the ignored SIGHUP with its restart (stdout is nohup's file, not a terminal): the
    closed terminal's SIGHUP cut the op off and restarted the worker."""
    async with op_under_way(redis, tmp_path, base_dir, task_root, nohup=True) as u:
        u.worker.hang_up()
        await asyncio.wait_for(u.op, 120)
        after = await u.lanes.run_op(LaneOp.exec(u.handle, "echo after", 30))  # the same worker takes more
        assert after.output.strip() == "after"
        assert u.runs.read_text() == "run\n"
        assert u.worker.proc.poll() is None
        assert "Restarting celery worker" not in u.worker.logs()


@pytest.mark.parametrize("stop", list(STOPS))
def test_an_orchestrator_worker_stopped_whole_lets_its_run_end_where_it_runs(
    stop: str, redis: Redis, tmp_path: Path
) -> None:
    """The run goes on in its pool process while the worker waits for it (as it said it would: before,
    the pool process was already dead); once it ends, its message is acked and the worker exits 0."""
    sig, output = STOPS[stop]
    url, run_id = f"redis://127.0.0.1:{redis.port}/0", uuid.uuid4().hex
    (tmp_path / "entry").mkdir()
    (tmp_path / "entry" / "stub_runner.py").write_text(
        STUB.replace(
            'return {"run_id": run_id, "pid"', '(here / f"{run_id}.ended").touch()\n    return {"pid"'
        )
    )
    env = {
        **broker_env(url, url),
        "STUB_RUN": run_id,
        "STUB_DIR": str(tmp_path),
        "PYTHONPATH": str(tmp_path / "entry"),
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
    }
    starts, ended = tmp_path / f"{run_id}.starts", tmp_path / f"{run_id}.ended"
    client = RedisClient.from_url(url)
    with workers_here(tmp_path) as start:
        try:
            stopped = start("--orchestrator", "--entry", "stub_runner:run", env=env, output=output)
            _send(run_id, env, url)
            wait_for(starts.exists, 120, f"the worker to take the run ({tmp_path})")

            stopped.stop_with(sig)
            if output == "file":
                wait_for(
                    lambda: f"waiting for the runs this worker drives to end: {run_id}" in stopped.logs(),
                    60,
                    f"the worker to say which run it waits for ({stopped.log})",
                )
            (tmp_path / f"{run_id}.go").touch()
            assert stopped.proc.wait(timeout=120) == 0, stopped.logs()
            assert ended.exists(), stopped.logs()  # the run ended in the pool process that drove it
            assert len(starts.read_text().split()) == 1
            assert client.llen(ORCHESTRATOR_QUEUE) == 0  # not put back for another worker to drive again
            assert not [raw for raw in client.hvals("unacked") if run_id.encode() in raw]
            assert "Traceback" not in stopped.logs(), stopped.logs()
        finally:
            (tmp_path / f"{run_id}.go").touch()
            client.close()
