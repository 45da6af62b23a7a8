"""A process's children as /proc shows them, for tests that kill real processes (engines) and check what
is left. (A module of its own at the tests root, importable from every test directory.)"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from app.sandboxes.limits import after_comm


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return after_comm(raw).split()


def children(parent: int | None, marker: bytes) -> set[int]:
    """Live children of `parent` (with None: live processes of any parent) whose command line contains
    `marker`."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is None or fields[0] in "ZX" or marker not in command_line(int(entry)):
            continue
        if parent is None or int(fields[1]) == parent:
            found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """`pid` runs (a zombie has ended: whoever adopted it reaps it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in "ZX"


def in_session(sid: int, *, group: bool = False) -> set[int]:
    """Live processes (zombies left out) of session `sid`, or of process group `sid` with `group`.
    `pgrep -s` counts zombies, and here nothing reaps an orphan: a worker that had ended counted as left
    behind."""
    field = 2 if group else 3  # pgrp, session
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is not None and fields[0] not in "ZX" and int(fields[field]) == sid:
            found.add(int(entry))
    return found


def left_in_session(sid: int, *, group: bool = False, wait_s: float = 5.0) -> set[int]:
    """What is still live of session (or group) `sid` after up to `wait_s`: its pool's helpers end as
    they read end-of-file from the command that exited, a moment after it."""
    import time

    deadline = time.monotonic() + wait_s
    while (left := in_session(sid, group=group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def cpu_ticks(pid: int) -> int:
    """User plus system CPU time of `pid` in clock ticks (1/100 s), 0 if it is gone."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[11]) + int(fields[12])


def parent(pid: int) -> int:
    """The parent of `pid`, 0 if it is gone."""
    fields = _stat_fields(pid)
    return 0 if fields is None else int(fields[1])


def command_line(pid: int) -> bytes:
    """The command line of `pid`, its arguments separated by NUL; empty if it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@contextlib.contextmanager
def reaped(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """`proc`, a session leader (`start_new_session=True`), killed with its process group when the block
    ends with it still running: a stop the test sent and the process lost, or an assertion that failed
    before the test waited for it, must not leave it running into the next test."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
