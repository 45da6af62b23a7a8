"""`corral advise` runs its simulations in worker processes: they must not outlive it, whatever ends it.

A SIGTERM to the command alone (not its process group, as a supervisor or `kill PID` sends it) used to
leave both workers running for a minute or more, reparented to init."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CORRAL = Path(sys.executable).with_name("corral")


def children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_advise_workers_end_with_the_command(tmp_path: Path, sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "default", "--workers", "2", "--json", "a.json"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        workers: set[int] = set()
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = {pid for pid in children(proc.pid) if alive(pid)}
        assert len(workers) >= 2, "the workers never started"
        os.kill(proc.pid, sig)  # the command alone, not its process group
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if alive(pid)], "workers outlived corral advise"
        assert not (tmp_path / "a.json").exists()
    finally:  # the command's session is its own process group: nothing of it may leak into other tests
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
