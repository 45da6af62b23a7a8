"""A TCP relay in front of the real Postgres that a test cuts (every connection closed, new ones
refused: a database restart as its clients see it) and restores. Stopping this machine's Postgres itself
would take the rest of the suite with it."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from app.store.db import scratch_database


class CuttableRelay:
    """Relays 127.0.0.1:`port` to `target`; `cut()` drops every connection and refuses new ones until
    `restore()`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen()
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def postgres_answers(url_text: str) -> bool:
    url = make_url(url_text)
    try:
        socket.create_connection((url.host or "127.0.0.1", url.port or 5432), timeout=2).close()
    except OSError:
        return False
    return True


@dataclass
class RelayedDatabase:
    url: str  # straight to the server
    relayed_url: str  # through the relay
    relay: CuttableRelay


@contextlib.contextmanager
def relayed_database(postgres_url: str, tmp_path: Path) -> Iterator[RelayedDatabase]:
    """A scratch database on the server of `postgres_url`, and a relay to it (cut at the end); skips the
    test when no Postgres answers."""
    if not postgres_answers(postgres_url):
        pytest.skip("no Postgres answering (the outage tests need the real server)")
    with scratch_database("postgres", postgres_url, tmp_path) as url:
        direct = make_url(url)
        relay = CuttableRelay((direct.host or "127.0.0.1", direct.port or 5432))
        relayed = direct.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
        try:
            yield RelayedDatabase(url, relayed, relay)
        finally:
            relay.cut()
