"""Stop signals held while `corral` loads (app/early_signals.py), in this process: held, taken or
released, and a signal the process was started ignoring stays ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from app import early_signals


def test_a_held_signal_is_remembered_then_taken_and_the_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    early_signals.hold()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: held
        assert early_signals.take() == [signal.SIGINT]
        assert early_signals.take() == []
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        assert early_signals.release() == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_the_process_ignores_stays_ignored() -> None:
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        early_signals.hold()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        assert early_signals.release() == []
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# Run as `python -c` (the command process, as the console script is): which modules are still looked
# up while a Ctrl-C would raise KeyboardInterrupt, i.e. before `hold`?
WATCH_IMPORTS = """
import json, sys, _signal
found = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
            found.append(name)
        return None
sys.meta_path.insert(0, Watch())
from app.cli import main
print(json.dumps(found))
"""


def test_corral_holds_ctrl_c_before_it_imports_anything_but_its_own_first_module() -> None:
    """Until `hold`, a Ctrl-C is Python's own KeyboardInterrupt traceback (README: the first ~N ms of
    `corral run`). The entry point used to import `signal`, `threading` and `typing` (and, outside an
    editable install, `contextlib` and `pathlib`) first, about 3 ms of that window; now it holds as soon
    as its own three modules are found."""
    proc = subprocess.run(
        [sys.executable, "-c", WATCH_IMPORTS], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["app", "app.cli", "app.early_signals"]


# A Ctrl-C whose handler runs inside a finalizer: the object's `__del__` sends it and then runs code of
# its own, where Python's handler raises KeyboardInterrupt (as a press landing in the cyclic collector's
# work does). `GUARD` is how the command process guards itself; `ONCE` wraps the work as a simulation's
# callers do (the first press raises, later ones are ignored).
IN_FINALIZER = """
import os, signal, sys
from app import early_signals
if "GUARD" in sys.argv:
    early_signals.keep_ctrl_c_out_of_finalizers()

class PressedWhileFreed:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass

def work():
    PressedWhileFreed()
    for _ in range(10**6):
        pass
    print("went on")

try:
    if "ONCE" in sys.argv:
        with early_signals.interruptible_once():
            work()
            os.kill(os.getpid(), signal.SIGINT)  # a second press: ignored until the block ends
            print("second press ignored")
    else:
        work()
except KeyboardInterrupt:
    print("interrupted")
"""


def run_in_finalizer(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", IN_FINALIZER, *flags], capture_output=True, text=True, timeout=120, check=False
    )


def test_a_ctrl_c_raised_inside_a_finalizer_is_raised_again_not_lost() -> None:
    """CI, 2026-12-03: `corral bench --family` printed "Exception ignored in: BaseEventLoop.__del__ ...
    KeyboardInterrupt" and went on to its next simulation, the press gone."""
    unguarded = run_in_finalizer()
    assert unguarded.stdout.split() == ["went", "on"]  # what a user got: the press lost, a traceback
    assert "Exception ignored" in unguarded.stderr
    assert "KeyboardInterrupt" in unguarded.stderr
    guarded = run_in_finalizer("GUARD")
    assert guarded.returncode == 0, guarded.stderr
    assert guarded.stdout.split() == ["interrupted"]
    assert guarded.stderr == ""


def test_a_first_press_raised_inside_a_finalizer_still_leaves_later_ones_ignored() -> None:
    guarded = run_in_finalizer("GUARD", "ONCE")
    assert guarded.returncode == 0, guarded.stderr
    assert guarded.stdout.split() == ["interrupted"]
    assert guarded.stderr == ""
