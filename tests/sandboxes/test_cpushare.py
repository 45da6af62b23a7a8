"""Work-conserving lane shares on this machine's real cgroups: a flooded lane keeps the other lane's
share, and an idle lane's CPU goes to the busy one."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from app.sandboxes import cpushare

pytestmark = pytest.mark.skipif(
    cpushare.share_method() is None, reason="no writable cpu cgroup controller on this host"
)
CPU = max(os.sched_getaffinity(0))
SPIN = ["sh", "-c", "while :; do :; done"]
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime


def spin(placement: cpushare.SharePlacement | None) -> subprocess.Popen[bytes]:
    def preexec() -> None:
        os.sched_setaffinity(0, {CPU})
        if placement is not None:
            placement.apply(os.getpid())

    return subprocess.Popen(SPIN, preexec_fn=preexec)


def measure(procs: dict[str, list[subprocess.Popen[bytes]]], seconds: float = 2.0) -> dict[str, float]:
    time.sleep(0.3)  # let the scheduler settle
    before = {lane: sum(cpu_seconds(p.pid) for p in ps) for lane, ps in procs.items()}
    time.sleep(seconds)
    after = {lane: sum(cpu_seconds(p.pid) for p in ps) for lane, ps in procs.items()}
    return {lane: (after[lane] - before[lane]) / seconds for lane in procs}


def stop(procs: dict[str, list[subprocess.Popen[bytes]]]) -> None:
    for ps in procs.values():
        for p in ps:
            p.kill()
            p.wait()


def test_a_flooded_lane_does_not_push_the_other_below_its_share():
    exec_lane = cpushare.prepare_share("test-exec", 100)
    cleanup_lane = cpushare.prepare_share("test-cleanup", 100)
    assert exec_lane is not None
    assert cleanup_lane is not None
    assert cpushare.read_weight(exec_lane) == 100
    shared = {"exec": [spin(exec_lane)], "cleanup": [spin(cleanup_lane) for _ in range(4)]}
    try:
        with_shares = measure(shared)
    finally:
        stop(shared)
    # Without lane groups the five spinners split the CPU evenly: exec would get a fifth.
    flat = {"exec": [spin(None)], "cleanup": [spin(None) for _ in range(4)]}
    try:
        without = measure(flat)
    finally:
        stop(flat)
    share = with_shares["exec"] / (with_shares["exec"] + with_shares["cleanup"])
    flat_share = without["exec"] / (without["exec"] + without["cleanup"])
    assert share > 0.4, (with_shares, without)
    assert flat_share < 0.3, (with_shares, without)


def test_an_idle_lane_leaves_its_cpu_to_the_busy_one():
    exec_lane = cpushare.prepare_share("test-exec", 400)
    cleanup_lane = cpushare.prepare_share("test-cleanup", 100)
    contended = {"exec": [spin(exec_lane)], "cleanup": [spin(cleanup_lane) for _ in range(2)]}
    try:
        both = measure(contended)
    finally:
        stop(contended)
    alone = {"cleanup": [spin(cleanup_lane) for _ in range(2)]}
    try:
        cleanup_alone = measure(alone)
    finally:
        stop(alone)
    # Weight 400 against 100: the cleanup lane gets about a fifth under contention, and the whole CPU
    # (what the rest of the machine leaves) when the exec lane is idle.
    assert both["exec"] > 2 * both["cleanup"], both
    assert cleanup_alone["cleanup"] > 2 * both["cleanup"], (both, cleanup_alone)


@pytest.mark.parametrize("weight", [0, -1, 10_001])
def test_weights_out_of_range_are_refused(weight):
    with pytest.raises(cpushare.ShareError, match="weight must be in"):
        cpushare.prepare_share("test-exec", weight)
