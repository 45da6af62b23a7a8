"""Every `python -m benchmarks.NAME` ends on a stop signal as `corral`'s commands do: one line, exit 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_children import left_in_session, reaped

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_script_runs_through_run_script() -> None:
    """`run_script` is what turns a stop signal into one line: a script that called `main()` itself gave
    a KeyboardInterrupt traceback on Ctrl-C and died silently on SIGTERM."""
    scripts = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")
    assert scripts
    for script in scripts:
        text = script.read_text()
        block = re.search(r'\nif __name__ == "__main__":\n(.*)', text, re.DOTALL)
        assert block is not None, script.name
        assert "run_script(main)" in block.group(1), script.name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["INT", "TERM", "HUP"])
def test_a_stop_signal_mid_benchmark_is_one_line_and_exit_130(sig: signal.Signals) -> None:
    """`benchmarks.scale` (a long single-process simulation, with no handling of its own) stopped by a
    signal to its process group: it printed a KeyboardInterrupt traceback (Ctrl-C) or died silently
    (SIGTERM -15, SIGHUP -1)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale", "--shape", "realistic", "--no-bench"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with reaped(proc):
        time.sleep(4)  # imported and simulating: the run takes tens of seconds
        assert proc.poll() is None
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err
    assert left_in_session(proc.pid, group=True) == set()
