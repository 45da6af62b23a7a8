from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from app.cpulist import CpuListError, format_cpu_list, parse_cpu_list
from app.sandboxes import cpuset
from app.sandboxes.cpuset import CpuPinError, pin, read_cpus_allowed

ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", [0]), ("0-3", [0, 1, 2, 3]), ("0-2,5,7-8", [0, 1, 2, 5, 7, 8]), ("1,3\n", [1, 3])],
)
def test_cpu_list_round_trip(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0,,1"])
def test_bad_cpu_lists_are_refused(text: str) -> None:
    with pytest.raises(CpuListError):
        parse_cpu_list(text)


def test_read_cpus_allowed_matches_affinity() -> None:
    assert read_cpus_allowed(os.getpid()) == tuple(ALLOWED)


@pytest.mark.parametrize("cpu", [ALLOWED[0], ALLOWED[-1]])
def test_pin_default_method_is_read_back(sleeper: subprocess.Popen[bytes], cpu: int) -> None:
    method = pin(sleeper.pid, [cpu])
    assert method in {"cgroup1", "cgroup2", "affinity"}
    assert method == cpuset.detect_method() or method == "affinity"
    assert read_cpus_allowed(sleeper.pid) == (cpu,)


def test_pin_affinity_method(sleeper: subprocess.Popen[bytes]) -> None:
    assert pin(sleeper.pid, [ALLOWED[-1]], method="affinity") == "affinity"
    assert read_cpus_allowed(sleeper.pid) == (ALLOWED[-1],)


def test_cgroup_pin_survives_the_process_widening_its_affinity(sleeper: subprocess.Popen[bytes]) -> None:
    if cpuset.detect_method() == "affinity" or len(ALLOWED) < 2:
        pytest.skip(f"no writable cpuset cgroup here (method {cpuset.detect_method()}) or a single CPU")
    assert pin(sleeper.pid, [ALLOWED[-1]]) in {"cgroup1", "cgroup2"}
    # Affinity alone could be widened by the process itself; the cgroup caps it.
    with pytest.raises(OSError, match="Invalid argument"):
        os.sched_setaffinity(sleeper.pid, [ALLOWED[0]])
    assert read_cpus_allowed(sleeper.pid) == (ALLOWED[-1],)


def test_children_started_after_the_pin_inherit_it() -> None:
    proc = subprocess.Popen(
        ["bash", "-c", "read -r _; sleep 60 & echo $!; wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pin(proc.pid, [ALLOWED[-1]])
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.close()
        child = int(proc.stdout.readline())
        assert read_cpus_allowed(child) == (ALLOWED[-1],)
    finally:
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_pin_rejects_cpus_that_do_not_exist(sleeper: subprocess.Popen[bytes]) -> None:
    with pytest.raises(CpuPinError, match="not online"):
        pin(sleeper.pid, [4096])
    with pytest.raises(CpuPinError, match="empty"):
        pin(sleeper.pid, [])
