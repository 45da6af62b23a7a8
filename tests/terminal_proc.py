"""A command in a terminal window of its own, for tests of what happens when the window closes.

`OnTerminal` starts a command in a new session whose controlling terminal is a pseudo-terminal, with
its standard input, output and error on it, and reads what it writes there. `hang_up` closes the
window: the kernel hangs the terminal up, sends SIGHUP (and SIGCONT) to its foreground process group,
and every later write to it fails with EIO.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import termios
import threading
import time
from collections.abc import Sequence
from pathlib import Path


class OnTerminal:
    def __init__(
        self, argv: Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.lines: list[tuple[float, str]] = []
        self._master, slave = pty.openpty()
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=slave,
                stdout=slave,
                stderr=slave,
                cwd=cwd,
                start_new_session=True,  # then the terminal becomes the new session's controlling one
                preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
                env={**(env if env is not None else os.environ), "COLUMNS": "200"},
            )
        finally:
            os.close(slave)
        self._open = True
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # Polls rather than blocks: a read blocked on the terminal's master side would keep it open
        # after `hang_up` closed it, and the kernel would hang nothing up.
        pending = b""
        while self._open:
            if not select.select([self._master], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(self._master, 4096)
            except OSError:  # EIO: nobody holds the other side any more
                break
            if not chunk:
                break
            pending += chunk
            *whole, pending = pending.split(b"\n")
            for line in whole:
                self.lines.append((time.monotonic(), line.decode(errors="replace").rstrip("\r")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def hang_up(self) -> None:
        """Close the window."""
        if self._open:
            self._open = False
            self._reader.join()
            os.close(self._master)
