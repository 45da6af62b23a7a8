"""The sandbox tests' docker fixtures (tests/sandboxes/conftest.py: the daemon that answers, or a private
dockerd, and the busybox image built for it) for tests in other directories, which that conftest does not
reach. A test module binds the fixture to its own name: `docker_client = docker_fixtures.docker_client`.
Also `docker_env`, the environment that points a `corral` process at that daemon, and `DaemonProxy`: a
daemon socket that goes away and comes back, for outages."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import threading
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "corral_sandbox_fixtures", Path(__file__).resolve().parent / "sandboxes" / "conftest.py"
)
assert _spec is not None
assert _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)
docker_client = _fixtures.docker_client
TEST_IMAGE = _fixtures.TEST_IMAGE


def docker_env(client: Any) -> dict[str, str]:
    """The environment that points a `corral` process at the fixture's daemon (a unix socket)."""
    return {**os.environ, "DOCKER_HOST": f"unix://{client.api._custom_adapter.socket_path}"}


class DaemonProxy:
    """A socket in front of the real daemon that goes away and comes back, as a restarted dockerd's does
    (its open connections are cut too)."""

    def __init__(self, path: Path, target: str) -> None:
        self.path = path
        self.target = target
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._stop = threading.Event()

    def up(self) -> None:
        self._stop.clear()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen()
        listener.settimeout(0.1)
        self._socks.append(listener)
        self._spawn(self._accept, listener)

    def down(self) -> None:
        self._stop.set()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join()
        self._socks, self._threads = [], []
        self.path.unlink(missing_ok=True)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args)
        self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn = listener.accept()[0]
            except (TimeoutError, OSError):
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.target)
            self._socks += [conn, upstream]
            self._spawn(self._pump, conn, upstream)
            self._spawn(self._pump, upstream, conn)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
