"""Kill -9 a child process at a moment it makes observable, for tests of what a killed process leaves.
(A module of its own at the tests root, importable from every test directory.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable


def kill_when(argv: list[str], ready: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Run `argv` in a session of its own until `ready()` (polled every 0.5 ms), then kill -9 it and
    its children; raises if it ends first or `what` takes longer than `timeout_s`."""
    child = subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert child.poll() is None, f"the child ended before {what}"
            assert time.monotonic() < deadline, f"{what} took more than {timeout_s} s"
            time.sleep(0.0005)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
