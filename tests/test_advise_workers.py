"""`corral advise` runs its simulations in worker processes: they must not outlive it, whatever ends it.

A SIGTERM to the command alone (not its process group, as a supervisor or `kill PID` sends it) used to
leave both workers running for a minute or more, reparented to init. A SIGKILL to it left the workers
of its fork server running for good (`app.children._let_the_fork_server_go`). A Ctrl-C while the fork
server was still importing the simulator printed its KeyboardInterrupt traceback after the one line.
The resource tracker, a helper of the pool, printed a "leaked semaphore" warning after a SIGKILL and
tracebacks after a SIGHUP to the process group (`app.children._start_tracker`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from proc_children import alive, command_line, in_session

CORRAL = Path(sys.executable).with_name("corral")
PROGRESS = re.compile(r"advise: \d+/\d+ simulations, \d+ s")


@contextlib.contextmanager
def advising(
    tmp_path: Path, stderr: int, ignored: signal.Signals | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`corral advise` on the default workload with 2 workers, in a session of its own (its process
    group), started ignoring `ignored`: killed whole afterwards, so nothing of it leaks into other
    tests."""
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "default", "--workers", "2", "--json", "a.json"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=None if ignored is None else lambda: signal.signal(ignored, signal.SIG_IGN),
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def busy_workers(proc: subprocess.Popen[bytes]) -> set[int]:
    """The processes of `proc`'s session but itself, once its workers have started. The simulation
    workers are the fork server's children; with the fork server and the resource tracker, which are
    the command's own, they make its session: at least 4."""
    deadline = time.monotonic() + 60
    workers: set[int] = set()
    while len(workers) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
        workers = in_session(proc.pid) - {proc.pid}
    assert len(workers) >= 4, f"the workers never started: {workers}"
    return workers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_advise_workers_end_with_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    with advising(tmp_path, subprocess.DEVNULL) as proc:
        workers = busy_workers(proc)
        os.kill(proc.pid, sig)  # the command alone, not its process group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if alive(pid)], "workers outlived corral advise"
        written = tmp_path / "a.json"
        if sig == signal.SIGKILL:
            assert not written.exists()
        elif written.exists():  # SIGTERM acts as Ctrl-C: what was simulated is kept, marked incomplete
            assert json.loads(written.read_text())["complete"] is False


def test_sigkill_to_advise_leaves_no_warning_from_its_helpers(tmp_path: Path) -> None:
    """kill -9 of the command: its helpers end quietly. The resource tracker removed the pool's
    semaphores, as is its job, and printed a two-line UserWarning about '5 leaked semaphore objects'."""
    with advising(tmp_path, subprocess.PIPE) as proc:
        busy_workers(proc)
        os.kill(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=30)  # to end of file: every helper holding stderr has ended
    assert not [line for line in stderr.decode().splitlines() if not PROGRESS.fullmatch(line)]


def test_sighup_to_the_process_group_is_one_line(tmp_path: Path) -> None:
    """SIGHUP to the whole process group (a terminal closed, here with stderr to a log): the command
    ends as on Ctrl-C. The resource tracker died of it, and the command's cleanup printed "process died
    unexpectedly, relaunching" and one KeyError traceback per semaphore from the new tracker."""
    with advising(tmp_path, subprocess.PIPE) as proc:
        busy_workers(proc)
        os.killpg(proc.pid, signal.SIGHUP)
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130
    lines = [line for line in stderr.decode().splitlines() if not PROGRESS.fullmatch(line)]
    assert lines[0].startswith("interrupted"), lines
    # then at most what the best of it changes: nothing else, no warning, no traceback
    assert len(lines) <= 2, lines
    assert all(line.startswith("to apply the best of them, in the workload: ") for line in lines[1:]), lines


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_a_signal_the_command_ignores_leaves_its_workers_running(tmp_path: Path, sig: signal.Signals) -> None:
    """Started ignoring SIGINT (a background job of a script) or SIGHUP (`nohup`), the command goes on
    when the signal comes to its process group. Its workers ended on it, and the command, its workers
    lost, ended as interrupted after the simulations done so far."""
    with advising(tmp_path, subprocess.PIPE, ignored=sig) as proc:
        workers = busy_workers(proc)
        os.killpg(proc.pid, sig)
        time.sleep(2)
        assert proc.poll() is None, proc.communicate()[1].decode()
        assert all(alive(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGTERM)  # which still acts as Ctrl-C
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130, stderr.decode()


def test_ctrl_c_while_the_fork_server_starts_is_one_line(tmp_path: Path) -> None:
    with advising(tmp_path, subprocess.PIPE) as proc:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if any(b"forkserver" in command_line(pid) for pid in in_session(proc.pid)):
                break
            time.sleep(0.005)
        # The fork server has just started: it spends the next few hundred ms importing the simulator.
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert stderr.decode().splitlines() == [
            "interrupted before the current settings were simulated; a.json not written"
        ]


def _ended(code: str, kill: bool = False) -> SimpleNamespace:
    """A real process that ran `code` and has ended, as a pool keeps it (`exitcode`, `pid`). A separate
    interpreter, not a fork: a fork of the test process, with the threads earlier tests left, hung in CI
    before it ran its target (`join` gave None after 10 s, and Python's exit then waited for it)."""
    proc = subprocess.Popen([sys.executable, "-c", code])
    if kill:
        proc.kill()
    try:
        proc.wait(timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
    return SimpleNamespace(pid=proc.pid, exitcode=proc.returncode)


def test_a_worker_killed_by_a_signal_is_named_before_one_whose_status_was_lost() -> None:
    """What `advise` says broke its pool, from its workers' real exit codes: one killed (SIGKILL) and one
    that the fork server reports as 255 (its status not passed on). CI's run named "exit status 255",
    the other worker, where a worker had been killed with SIGKILL."""
    from app.children import _lost_worker

    unknown = _ended("import os; os._exit(255)")
    killed = _ended("import time; time.sleep(60)", kill=True)
    ended = _ended("import os; os._exit(130)")  # a stop signal's exit: not a loss
    assert (unknown.exitcode, killed.exitcode, ended.exitcode) == (255, -signal.SIGKILL, 130)
    pool = SimpleNamespace(_processes={p.pid: p for p in (unknown, killed, ended)})
    assert _lost_worker(pool) == "SIGKILL"  # type: ignore[arg-type]
    assert _lost_worker(SimpleNamespace(_processes={unknown.pid: unknown})) == "exit status 255"  # type: ignore[arg-type]
    assert _lost_worker(SimpleNamespace(_processes={ended.pid: ended})) is None  # type: ignore[arg-type]
