"""`early_signals.guard_forks`: one Ctrl-C to a process group that forks all the time is one signal for
the process, not one more for each child caught between its fork and its `setsid` (which wrote it to
the loop's wake-up fd). A real process, a real group SIGINT; without the guard the same process counts
several, so the check can fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("fork_signals_proc.py")
ROOT = SCRIPT.parent.parent


def sigints_counted(mode: str) -> int:
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # the forks are under way
        os.killpg(child.pid, signal.SIGINT)  # Ctrl-C: the whole group
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    counts = [line.split()[1] for line in out.splitlines() if line.startswith("count ")]
    assert len(counts) == 1, out
    return int(counts[0])


def test_one_group_sigint_is_one_signal_with_the_guard() -> None:
    assert sigints_counted("guard") == 1


def test_without_the_guard_children_add_signals() -> None:
    # What the guard prevents, shown on the same process: several children write the one SIGINT to
    # the shared wake-up fd (4 or 5 counted here, on 2 cores).
    assert sigints_counted("noguard") > 1
