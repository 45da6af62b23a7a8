"""Set-up limits in given time, with real processes: a set-up starved of CPU by busy processes on its
core is not killed although its wall time passes the limit, while a hung one (asleep) is, and a
starved busy loop ends at the wall-clock backstop. Each for the pids-cgroup way of finding the
command's threads and for the /proc session scan used where no cgroup is writable."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import make_echo_task
from test_local import ISOLATIONS

from app.sandboxes.local import LocalSandboxFactory
from app.sandboxes.timelimits import GivenClock, TimeLimitError, TimeLimits, charge, session_threads
from app.tasks.spec import TaskSpec

CPU = max(os.sched_getaffinity(0))
HOGS = 8
# About 0.2 CPU-seconds of Python: with 8 busy processes on its core it gets at most 1/9 of it.
WORK = "python3 -c 'x = 0\nfor i in range(3_000_000): x += i\nprint(x)'"
LIMIT_S = 1.0


@pytest.fixture
def starved_cpu() -> Iterator[int]:
    """`HOGS` busy processes on one CPU, each in its own session (so autogroup gives each the weight a
    sandbox command, also in a session of its own, has)."""
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {CPU}),
        )
        for _ in range(HOGS)
    ]
    try:
        yield CPU
    finally:
        for hog in hogs:
            hog.send_signal(signal.SIGKILL)
            hog.wait()


def make_task(task_root: Path, setup: str) -> TaskSpec:
    return dataclasses.replace(make_echo_task(task_root, setup=setup), setup_timeout_s=LIMIT_S)


def make_factory(
    base_dir: Path, isolation: str, use_cgroups: bool, limits: TimeLimits
) -> LocalSandboxFactory:
    return LocalSandboxFactory(base_dir, isolation=isolation, use_cgroups=use_cgroups, time_limits=limits)  # type: ignore[arg-type]


@pytest.fixture(params=ISOLATIONS)
def isolation(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[True, False], ids=["pids-cgroup", "session-scan"])
def use_cgroups(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def test_a_starved_set_up_that_would_finish_is_not_killed(
    base_dir: Path, task_root: Path, isolation: str, use_cgroups: bool, starved_cpu: int
) -> None:
    sb = make_factory(base_dir, isolation, use_cgroups, TimeLimits()).create("pytest-starved")
    result = await sb.reset(make_task(task_root, WORK), cpus=[starved_cpu])
    assert result.duration_s > LIMIT_S, "not starved: the test proves nothing"
    assert not result.timed_out, result.output
    assert result.exit_code == 0
    assert result.output.strip() == str(sum(range(3_000_000)))
    await sb.cleanup()


async def test_the_same_set_up_under_a_wall_clock_limit_is_killed(
    base_dir: Path, task_root: Path, starved_cpu: int
) -> None:
    sb = make_factory(base_dir, "none", True, TimeLimits.wall()).create("pytest-starved-wall")
    result = await sb.reset(make_task(task_root, WORK), cpus=[starved_cpu])
    assert result.timed_out
    assert result.exit_code is None
    assert "killed at its 1 s wall-clock limit" in result.output
    await sb.cleanup()


async def test_a_hung_set_up_is_killed_at_its_limit(
    base_dir: Path, task_root: Path, isolation: str, use_cgroups: bool, starved_cpu: int
) -> None:
    # Asleep, it waits for no CPU: given time runs at wall speed, and the limit fires long before the
    # backstop (10x), also on a busy core.
    sb = make_factory(base_dir, isolation, use_cgroups, TimeLimits()).create("pytest-hung")
    result = await sb.reset(make_task(task_root, "echo started; sleep 600"), cpus=[starved_cpu])
    assert result.timed_out
    assert result.exit_code is None
    assert result.output.startswith("started\n")
    assert "killed after its 1 s limit of given time" in result.output
    await sb.cleanup()


async def test_a_starved_busy_loop_ends_at_the_backstop(
    base_dir: Path, task_root: Path, use_cgroups: bool, starved_cpu: int
) -> None:
    # At most 1/9 of a core: by 2 s of wall time it was given well under 1 s, so the backstop fires.
    limits = TimeLimits(backstop=2.0)
    sb = make_factory(base_dir, "none", use_cgroups, limits).create("pytest-spin")
    result = await sb.reset(make_task(task_root, "while :; do :; done"), cpus=[starved_cpu])
    assert result.timed_out
    assert "killed at the wall-clock backstop, 2x its 1 s limit of given time" in result.output
    await sb.cleanup()


async def test_tool_calls_keep_wall_clock_limits(base_dir: Path, task_root: Path, starved_cpu: int) -> None:
    sb = make_factory(base_dir, "none", True, TimeLimits()).create("pytest-exec-wall")
    await sb.reset(make_task(task_root, ""))
    result = await sb.exec(WORK, timeout_s=LIMIT_S, cpus=[starved_cpu])
    assert result.timed_out
    assert "wall-clock limit" in result.output
    await sb.cleanup()


async def test_validation_counts_given_time(base_dir: Path, task_root: Path, starved_cpu: int) -> None:
    task = dataclasses.replace(make_task(task_root, ""), validation=WORK, validation_timeout_s=LIMIT_S)
    sb = make_factory(base_dir, "none", True, TimeLimits()).create("pytest-validate")
    await sb.reset(task)
    assert await sb.validate(cpus=[starved_cpu]) == 1.0
    await sb.cleanup()


# -- the clock on its own -----------------------------------------------------------------------------


def test_charge_counts_what_the_cpu_gave() -> None:
    assert charge(1.0, 0.0, 0.0) == 1.0  # asleep: counts in full (a hung set-up)
    assert charge(1.0, 0.25, 0.75) == 0.25  # one thread, runnable throughout, served a quarter
    assert charge(1.0, 0.25, 0.25) == 0.75  # slept half, then waited as long as it ran
    assert charge(1.0, 1.0, 3.0) == 0.25  # four threads in parallel, a quarter of their demand served
    assert charge(1.0, 2.0, 0.0) == 1.0  # two threads, both served: never more than wall time
    assert charge(0.0, 1.0, 1.0) == 0.0


def write_thread(proc: Path, tid: int, ran_ns: int, waited_ns: int, state: str) -> None:
    (proc / str(tid)).mkdir(parents=True, exist_ok=True)
    (proc / str(tid) / "schedstat").write_text(f"{ran_ns} {waited_ns} 1\n")
    (proc / str(tid) / "stat").write_text(f"{tid} (python3 (x)) {state} 1 {tid} {tid} 0 -1\n")


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def fake_proc(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "schedstat").write_text("0 0 0\n")
    return proc


def test_a_thread_that_only_waited_is_given_nothing(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path)
    clock = GivenClock(lambda: [7], proc=proc)
    write_thread(proc, 7, 0, 10**12, "S")  # waited 1000 s: more than any interval
    assert clock.sample() == 0.0
    write_thread(proc, 7, 0, 2 * 10**12, "S")
    assert clock.sample() == 0.0
    assert clock.wait_s == 2000.0


def test_a_runnable_thread_is_charged_its_cpu_time_until_its_wait_is_reported(tmp_path: Path) -> None:
    # The kernel reports a starved thread's wait only when it next runs: until the thread is seen
    # asleep, only its run time counts, however long the samples are apart.
    proc, now = fake_proc(tmp_path), FakeTime()
    clock = GivenClock(lambda: [7], proc=proc, now=now)
    now.t += 1.0
    write_thread(proc, 7, 10**7, 0, "R")  # ran 10 ms, no wait reported yet
    assert clock.sample() == pytest.approx(0.01)
    now.t += 5.0
    write_thread(proc, 7, 2 * 10**7, 10**6, "R")
    assert clock.sample() == pytest.approx(0.02)
    # Asleep now, and it reports the wait of the whole 7 s but its run time: settled, exactly that.
    now.t += 1.0
    write_thread(proc, 7, 3 * 10**7, 7 * 10**9 - 3 * 10**7, "S")
    assert clock.sample() == pytest.approx(0.03)
    # Then asleep for 2 s: counted in full.
    now.t += 2.0
    assert clock.sample() == pytest.approx(2.03)


def test_an_asleep_command_is_given_wall_time(tmp_path: Path) -> None:
    proc, now = fake_proc(tmp_path), FakeTime()
    write_thread(proc, 7, 10**6, 0, "S")
    clock = GivenClock(lambda: [7], proc=proc, now=now)
    now.t += 1.5
    assert clock.sample() == pytest.approx(1.5)
    now.t += 1.0
    assert clock.sample() == pytest.approx(2.5)
    assert clock.cpu_s == pytest.approx(0.001)


def test_parallel_threads_count_the_served_fraction_of_their_demand(tmp_path: Path) -> None:
    proc, now = fake_proc(tmp_path), FakeTime()
    clock = GivenClock(lambda: [7, 8, 9, 10], proc=proc, now=now)
    now.t += 4.0
    for tid in (7, 8, 9, 10):  # four threads, each ran 1 s and waited 3 s, all asleep now
        write_thread(proc, tid, 10**9, 3 * 10**9, "S")
    assert clock.sample() == pytest.approx(1.0)  # a quarter of the 4 s


def test_without_schedstat_given_time_is_wall_time(tmp_path: Path) -> None:
    proc = tmp_path / "proc"  # no self/schedstat: a kernel without CONFIG_SCHED_INFO
    write_thread(proc, 7, 0, 10**12, "R")
    now = FakeTime()
    clock = GivenClock(lambda: [7], proc=proc, now=now)
    assert not clock.available
    now.t += 3.0
    assert clock.sample() == 3.0
    assert clock.wait_s == 0.0


def test_the_session_scan_finds_a_process_and_its_threads() -> None:
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert proc.pid in session_threads(proc.pid)
        assert os.getpid() not in session_threads(proc.pid)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    ("field", "value"),
    [("backstop", 0.5), ("backstop", float("nan")), ("sample_s", 0.0), ("sample_s", float("inf"))],
)
def test_bad_settings_are_refused(field: str, value: float) -> None:
    with pytest.raises(TimeLimitError, match=field):
        TimeLimits(**{field: value})
