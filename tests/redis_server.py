"""A `redis-server` of a test's own on a free port, stopped and started again on the same port: a Redis
restart that no other test sees (this machine's Redis on 6379 serves the rest of the suite). It keeps
nothing on disk, as the machine's does, so it comes back empty. (A module of its own at the tests root,
importable from every test directory.)"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Redis:
    """A `redis-server` of this test's own, stopped and started again on the same port."""

    def __init__(self, port: int, work: Path) -> None:
        self.port, self.work = port, work
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly",
             "no", "--dir", str(self.work)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not answer"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)

    def restart(self, down_s: float) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()
