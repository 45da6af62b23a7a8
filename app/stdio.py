"""Standard input, output and error closed when the command starts (`<&-`, `>&-`, `2>&-`).

A closed descriptor among 0, 1 and 2 is the lowest free one, so the first file the process opens takes
its number: `corral serve`'s database lock file became its standard input, and with standard output
closed its one-line "not started" went into that lock file. Whatever is written to the stream later (a
line on standard output, a C library's message on standard error, a child that inherits it) would go
into that file. So the command's first act (`fill_closed`, before any file is opened) opens /dev/null
on each closed one and remembers which were closed.

Invariants: after `fill_closed`, descriptors 0, 1 and 2 are open and inheritable, and no file the
process opens later takes one of them. Closed at start still means closed to the command: output asked
for on standard output (`--json -`) is refused (`closed_at_start`), and `corral serve` with standard
error closed does not start. Python's `sys.stdin` and `sys.stdout`, None for a closed descriptor,
become files on /dev/null, so a library that writes there or asks `isatty` (uvicorn's access log) runs
as usual; `sys.stderr` stays None (`app.cli.common.stderr_lost`).

Imports nothing the interpreter has not loaded at start-up: it runs right after `early_signals.hold`.
"""

from __future__ import annotations

import os
import sys

_closed: list[int] = []


def fill_closed() -> None:
    """Open /dev/null on each of descriptors 0, 1 and 2 that is closed (once per process)."""
    if _closed:
        return
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _closed.append(fd)
    for fd in _closed:
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: `fd`, those below it are open
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)  # a child that inherits the stream gets /dev/null too, not a closed fd
    if 0 in _closed and sys.stdin is None:
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own, never closed)
    if 1 in _closed and sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115


def closed_at_start(fd: int) -> bool:
    """Was descriptor `fd` closed when the command started (`fill_closed` put /dev/null there)?"""
    return fd in _closed
