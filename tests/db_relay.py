"""A TCP relay in front of the real Postgres that a test cuts (every connection closed, new ones
refused: a database restart as its clients see it) and restores. Stopping this machine's Postgres itself
would take the rest of the suite with it. And who holds `corral serve`'s lock on a database."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from app.store.db import SERVER_LOCK_KEY, make_engine, scratch_database


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


SERVER_LOCK_HOLDER = text(
    "SELECT l.pid, a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
    "WHERE l.locktype = 'advisory' AND l.classid = :hi AND l.objid = :lo AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def server_lock_holder(engine: Engine) -> tuple[int, str] | None:
    """The backend pid and application name of the connection that holds `corral serve`'s lock on the
    database of `engine`, or None when it is free (pg_locks lists every database's locks: its alone)."""
    with engine.connect() as c:
        ids = {"hi": SERVER_LOCK_KEY >> 32, "lo": SERVER_LOCK_KEY & 0xFFFFFFFF}
        row = c.execute(SERVER_LOCK_HOLDER, ids).first()
    return None if row is None else (int(row[0]), str(row[1]))


def take_server_lock(engine: Engine, application_name: str) -> Connection:
    """A connection named `application_name` that holds `corral serve`'s lock (as another server would)."""
    named = {"application_name": application_name}
    c = make_engine(engine.url, poolclass=NullPool, connect_args=named).connect()
    assert c.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": SERVER_LOCK_KEY}).scalar()
    c.commit()
    return c
