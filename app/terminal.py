"""The terminal a command writes to, and what becomes of that output once the terminal goes away.

Closing a terminal window or losing an ssh session hangs the terminal up: the kernel sends SIGHUP to
its foreground process group, and from then on every write to it fails with EIO. A command that stops
cleanly on SIGHUP (as on Ctrl-C) would still die at its first progress line, before its report is
written. So a command notes which of its standard output and error are a terminal when it starts (a
hung-up terminal no longer says it is one) and, on SIGHUP, points those at /dev/null.
"""

from __future__ import annotations

import contextlib
import os


def terminal_fds() -> list[int]:
    """Standard output and error, where they are a terminal now."""
    fds = []
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                fds.append(fd)
    return fds


def detach(fds: list[int]) -> None:
    """The terminal behind `fds` hung up: what went to it goes to /dev/null from now on. Only system
    calls: safe in a signal handler."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in fds:
                os.dup2(devnull, fd)
        finally:
            os.close(devnull)
