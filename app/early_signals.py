"""Stop signals (SIGINT, SIGTERM) that arrive before a command is ready to act on them.

`corral`'s entry point calls `hold` before its heavy imports (when it runs as the command, not when a
test runner imports it: `is_command_process`), so a Ctrl-C in the first second is
remembered instead of raising `KeyboardInterrupt` in the middle of an import. Then exactly one of:
- `take`: the command handles the remembered signals itself (`corral run` stops its start-up and still
  writes its report);
- `release`: the default handlers come back and the caller learns what was held (every other command
  then ends as if interrupted: exit 130).

This module imports only the standard library: it must be cheap enough to run first.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_held: list[int] = []
_previous: dict[int, Any] = {}


def _remember(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def is_command_process() -> bool:
    """Is this process the `corral` command itself (its console script, or `python -c`), rather than
    a program that imports it (a test runner): only then does it take over process-wide things."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return path is None or Path(path).stem == "corral"


def hold() -> None:
    """Remember stop signals from now on instead of acting on them. A signal this process was started
    ignoring (a shell's background job ignores SIGINT) stays ignored."""
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current in (signal.SIG_IGN, _remember):
            continue
        _previous[sig] = signal.signal(sig, _remember)


def take() -> list[int]:
    """The signals held so far (forgotten here: the caller now owns them); holding goes on."""
    taken = list(_held)
    _held.clear()
    return taken


def release() -> list[int]:
    """Put the handlers back as they were before `hold`; return the signals held meanwhile."""
    for sig, handler in _previous.items():
        if signal.getsignal(sig) is _remember:
            signal.signal(sig, handler)
    _previous.clear()
    return take()


@contextmanager
def interruptible_once(on_first: Callable[[], None] | None = None) -> Iterator[None]:
    """Ctrl-C acts once; further presses (users press it twice) are ignored until the block ends, so
    that what the block does after the first (unwinding a simulation, writing what was computed so
    far) is not broken half-way. The first press raises KeyboardInterrupt, or calls `on_first` instead
    (to stop at a safe point of the caller's choosing). Only where Ctrl-C would raise
    KeyboardInterrupt anyway: in the main thread (only it gets signals), under Python's default handler
    (not when SIGINT is ignored, nor under a handler of the caller's own)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def first(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if on_first is None:
            raise KeyboardInterrupt
        on_first()

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
