"""A process's children as /proc shows them, for tests that kill real processes (engines) and check what
is left. (A module of its own at the tests root, importable from every test directory.)"""

from __future__ import annotations

import os
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
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if fields is None or fields[0] in "ZX" or marker not in cmd:
            continue
        if parent is None or int(fields[1]) == parent:
            found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    """`pid` runs (a zombie has ended: whoever adopted it reaps it)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in "ZX"
