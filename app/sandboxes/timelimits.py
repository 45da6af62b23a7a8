"""Time limits that count the time a command was given, not the time it queued for a CPU.

A task's set-up limit (`timeouts.setup_s`) is there to stop set-ups that hang or run away, and its
author measured it on a machine where the set-up had a CPU. Under contention (two dozen set-ups and the
tool calls of other sandboxes sharing the lanes' cores) a CPU-bound set-up that needs 3 CPU-seconds can
sit runnable for minutes, and a wall-clock limit then kills work that would finish: the tasks with
costly set-ups drop out of the batches, a bias a trainer feels.

*Given time* is wall time minus the time the command's threads sat runnable, waiting for a CPU (the
kernel's per-thread `run_delay`, `/proc/<tid>/schedstat`). Sleeping, waiting for I/O or for a child
counts in full, so a hung set-up (a `sleep`, a stuck download) is killed at its limit as before; only
the queueing that other work on the same CPUs causes is not counted.

The kernel adds to a thread's `run_delay` only when the thread gets a CPU, so a starved thread's wait
shows late, in one jump. Given time is therefore settled only at a sample where none of the command's
threads is runnable (all asleep, blocked or gone): then every wait since the last settled sample has
been reported, and that window of wall time W, with `cpu` run time and `wait` run-queue wait, counts
`max(W − wait, W·cpu/(cpu + wait))` clamped to [0, W] (W when nothing ran or waited: asleep). That is
exact for one runnable thread at a time (a shell running one step after another), and for threads
running in parallel the fraction of their demand that the CPUs served. While some thread is runnable
the open window counts only what was surely given, `min(cpu, W·cpu/(cpu + wait))`: a CPU-bound set-up
starved of CPU is charged its CPU time.

Threads are found through the exec's pids cgroup leaf (every process it started, also those that
called setsid) or, where no pids cgroup is writable, by a scan of /proc for the command's session (a
process that left the session is then not seen). What is not seen is not subtracted, so at a settled
sample a miss makes the limit stricter, toward wall time; the run and wait of a thread between its last
sample and its exit are lost the same way (in an open window the lost run time makes it laxer, and the
backstop still holds). Where `/proc/<pid>/schedstat` does not exist (a kernel without
CONFIG_SCHED_INFO) given time is wall time.

Invariants:
- given time never exceeds wall time, at any sample; it counts only CPU time while the command is
  runnable throughout;
- a limit counted in given time also kills at `backstop` × the limit of wall time, so a busy loop that
  is starved of CPU ends too;
- a lane not in `TimeLimits.given_lanes` keeps the plain wall-clock limit.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from app.sandboxes.limits import after_comm, listed_ids

PROC = Path("/proc")
# Set-ups and validation: infrastructure steps whose outcome must not depend on how busy the host is.
# Tool calls keep wall time: the agent phase (`timeouts.agent_s`) is a wall-clock budget of the task.
GIVEN_LANES = frozenset({"reset", "validate"})


class TimeLimitError(ValueError):
    """A time-limit setting out of range."""


@dataclass(frozen=True)
class TimeLimits:
    """How a sandbox measures its commands' limits, per lane."""

    given_lanes: frozenset[str] = field(default=GIVEN_LANES)
    backstop: float = 10.0  # kill at this multiple of a given-time limit in wall time, whatever else
    sample_s: float = 1.0  # seconds between samples of a command's threads

    def __post_init__(self) -> None:
        if not (math.isfinite(self.backstop) and self.backstop >= 1):
            raise TimeLimitError(f"backstop must be a finite number >= 1, got {self.backstop}")
        if not (math.isfinite(self.sample_s) and self.sample_s > 0):
            raise TimeLimitError(f"sample_s must be a finite number > 0, got {self.sample_s}")

    @classmethod
    def wall(cls) -> TimeLimits:
        """Every limit in wall time (the behaviour before given time)."""
        return cls(given_lanes=frozenset())

    def counts_given(self, lane: str) -> bool:
        return lane in self.given_lanes


def charge(interval_s: float, cpu_s: float, wait_s: float) -> float:
    """The given time of one sampling interval (see the module docstring)."""
    if interval_s <= 0:
        return 0.0
    demand = cpu_s + wait_s
    if demand <= 0:
        return interval_s
    counted = max(interval_s - wait_s, interval_s * cpu_s / demand)
    return min(interval_s, max(0.0, counted))


@functools.cache
def schedstat_available(proc: Path = PROC) -> bool:
    return (proc / "self" / "schedstat").exists()


def leaf_threads(leaf: Path) -> list[int]:
    """Every thread in a cgroup and the groups below it (v1 `tasks`, v2 `cgroup.threads`)."""
    return listed_ids(leaf, "tasks" if (leaf / "tasks").exists() else "cgroup.threads")


def session_threads(session: int, proc: Path = PROC) -> list[int]:
    """Every thread of the processes in `session` (a scan of /proc: the fallback without cgroups)."""
    found: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(after_comm(stat).split()[3]) != session:  # state ppid pgrp sid
                continue
            found.extend(int(t.name) for t in (entry / "task").iterdir())
        except (OSError, ValueError, IndexError):
            continue
    return found


class GivenClock:
    """Integrates one command's given time from samples of its threads' scheduler statistics."""

    def __init__(
        self,
        threads: Callable[[], Iterable[int]],
        proc: Path = PROC,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threads = threads
        self.proc = proc
        self.now = now
        self.available = schedstat_available(proc)
        self.given_s = 0.0
        self.cpu_s = 0.0
        self.wait_s = 0.0
        self._settled_s = 0.0
        self._window = (0.0, 0.0, 0.0)  # wall, cpu, wait since the last settled sample
        self._at = now()
        self._seen: dict[int, tuple[int, int]] = {}

    def sample(self) -> float:
        """Read the threads now and add the interval since the last sample; returns given time."""
        now = self.now()
        interval = now - self._at
        self._at = now
        cpu_ns = wait_ns = 0
        runnable = False
        if self.available:
            seen: dict[int, tuple[int, int]] = {}
            for tid in self.threads():
                try:
                    fields = (self.proc / str(tid) / "schedstat").read_text().split()
                    ran, waited = int(fields[0]), int(fields[1])
                    stat = (self.proc / str(tid) / "stat").read_text()
                except (OSError, ValueError, IndexError):
                    continue  # exited since it was listed
                runnable = runnable or after_comm(stat).startswith("R")
                before_ran, before_waited = self._seen.get(tid, (0, 0))
                # A thread first seen now was born since the last sample: all its time is new.
                cpu_ns += max(0, ran - before_ran)
                wait_ns += max(0, waited - before_waited)
                seen[tid] = (ran, waited)
            self._seen = seen
        cpu, wait = cpu_ns / 1e9, wait_ns / 1e9
        self.cpu_s += cpu
        self.wait_s += wait
        wall_w, cpu_w, wait_w = self._window
        wall_w, cpu_w, wait_w = wall_w + interval, cpu_w + cpu, wait_w + wait
        if runnable:
            # A runnable thread's latest wait is not reported yet: count only what was surely given.
            self._window = (wall_w, cpu_w, wait_w)
            surely = min(cpu_w, wall_w * cpu_w / (cpu_w + wait_w)) if cpu_w > 0 else 0.0
            self.given_s = self._settled_s + surely
        else:
            self._settled_s += charge(wall_w, cpu_w, wait_w)
            self._window = (0.0, 0.0, 0.0)
            self.given_s = self._settled_s
        return self.given_s
