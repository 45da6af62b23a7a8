"""Engines and sessions for a database URL: SQLite (the embedded default) or Postgres (psycopg 3).

The URL is always a parameter; process settings are read elsewhere (the app factory) and passed in.
SQLite connections get foreign keys, WAL and a busy timeout, and real transactions: pysqlite's own
transaction handling is turned off so that `BEGIN` and SAVEPOINT behave as on Postgres (the tests roll
each test back through a savepoint on both backends). Transactions begin IMMEDIATE: a deferred one that
reads and then writes while the event sink commits fails at once with "database is locked" (SQLite
cannot upgrade a stale read snapshot), whereas an immediate one waits its turn (busy timeout). An engine
that only reads may pass `sqlite_begin="DEFERRED"` so its readers never wait for a writer.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool, StaticPool

DEFAULT_DATABASE_URL = "sqlite:///./corral.db"

# A database that stops answering (Postgres restarted, a failover) is waited out this long by a run's
# writers before a write counts as failed; what they have to write meanwhile stays buffered. The default
# of `CORRAL_STORE_OUTAGE_S`, passed in as `outage_s`.
OUTAGE_S = 60.0
OUTAGE_RETRY_MAX_S = 2.0
# How long one SQLite transaction waits for the file's writer lock before it fails as busy (an outage):
# the default of `CORRAL_SQLITE_BUSY_TIMEOUT_S`, passed in as `busy_timeout_s`
SQLITE_BUSY_TIMEOUT_S = 30.0
# What a SQLite WAL file is cut back to once checkpointed: without a limit it stays as large as the largest
# transaction since the server started (240 MiB for good after deleting a run of 780,000 events)
WAL_SIZE_LIMIT = 64 * 2**20

log = logging.getLogger(__name__)
T = TypeVar("T")

# JSON columns hold strict JSON on both backends (Postgres refuses NaN; SQLite would store it)
_strict_json = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode


def make_engine(
    url: str, sqlite_begin: str = "IMMEDIATE", busy_timeout_s: float = SQLITE_BUSY_TIMEOUT_S, **kwargs: Any
) -> Engine:
    """An Engine for `url`; `postgresql://` is read as psycopg 3 (`postgresql+psycopg://`).
    `sqlite_begin` (IMMEDIATE or DEFERRED) is how SQLite transactions begin, `busy_timeout_s` how long
    one waits for another writer's lock; see the module doc."""
    kwargs.setdefault("json_serializer", _strict_json)
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        if sqlite_begin not in ("IMMEDIATE", "DEFERRED"):
            raise ValueError(f"sqlite_begin must be IMMEDIATE or DEFERRED, not {sqlite_begin!r}")
        return _sqlite_engine(parsed, sqlite_begin, busy_timeout_s, **kwargs)
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _sqlite_engine(url: Any, begin: str, busy_timeout_s: float, **kwargs: Any) -> Engine:
    memory = sqlite_file(url) is None
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("check_same_thread", False)
    if memory:
        kwargs.setdefault("poolclass", StaticPool)
    engine = create_engine(url, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves, below
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql(f"BEGIN {begin}")

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that never expire loaded objects on commit (views read them after the commit)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def scratch_database(backend: str, postgres_url: str, tmp_dir: Path) -> Iterator[str]:
    """Yield the URL of a new, empty database and drop it afterwards (tests and benchmarks).

    `backend` "sqlite": a file under `tmp_dir`; "postgres": `CREATE DATABASE corral_test_<hex>` on the
    server of `postgres_url` (a role allowed to create databases), dropped even if still in use.
    """
    if backend == "sqlite":
        yield f"sqlite:///{tmp_dir / f'corral-{uuid.uuid4().hex[:8]}.db'}"
        return
    if backend != "postgres":
        raise ValueError(f"backend must be sqlite or postgres, not {backend!r}")
    name = f"corral_test_{uuid.uuid4().hex[:12]}"
    admin = make_engine(postgres_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as c:
                c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def is_outage(exc: BaseException) -> bool:
    """Is `exc` the database being away or busy rather than refusing the write: a connection lost or
    refused, Postgres starting up or shutting down (SQLSTATE classes 08 and 57P), SQLite still locked
    by other writers when its busy timeout ran out (several runs' writers at once on a busy machine),
    every connection of the engine's pool still in use when its wait ran out (dozens of runs at once),
    or the database's disk full or turned read-only (`_disk_refused`)? Either way the failed
    transaction stored nothing, and trying it again is safe."""
    from sqlalchemy.exc import DBAPIError

    if _pool_busy(exc):
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if _sqlite_busy(exc) or _disk_refused(exc):
        return True
    if exc.connection_invalidated:
        return True
    code = getattr(exc.orig, "sqlstate", "")  # psycopg's; None for a failure of the connection itself
    if code is None:
        # libpq gives a refused connection no code, and neither a server that refuses this client (a
        # database dropped, a wrong password): those are not waited on.
        return not any(refusal in str(exc.orig) for refusal in _NOT_AN_OUTAGE)
    return str(code).startswith(("08", "57P"))


_NOT_AN_OUTAGE = ("does not exist", "authentication failed", "password")
_SQLITE_BUSY = ("database is locked", "database table is locked", "database is busy")


def _sqlite_busy(exc: BaseException) -> bool:
    import sqlite3

    orig = getattr(exc, "orig", None)
    return isinstance(orig, sqlite3.OperationalError) and str(orig).startswith(_SQLITE_BUSY)


# SQLite's primary result codes for a disk that refuses the write: SQLITE_READONLY (a file or a file
# system turned read-only) and SQLITE_FULL ("database or disk is full"); Postgres's SQLSTATE disk_full
_SQLITE_DISK_CODES = {8: "read-only", 13: "out of disk space"}
_POSTGRES_DISK_FULL = "53100"


def _disk_refused(exc: BaseException) -> str | None:
    """How the database's disk refused a write ("out of disk space", "read-only"), or None. The write is
    waited out as an outage: a run's events are held (buffer, then spill) until space is freed, where
    they used to be counted failed and dropped, 500 events at a time, for as long as the disk was full."""
    import sqlite3

    orig = getattr(exc, "orig", None)
    if isinstance(orig, sqlite3.Error):
        return _SQLITE_DISK_CODES.get(getattr(orig, "sqlite_errorcode", 0) & 0xFF)
    if getattr(orig, "sqlstate", None) == _POSTGRES_DISK_FULL:
        return "out of disk space"
    return None


def _pool_busy(exc: BaseException) -> bool:
    """The pool's wait for a free connection ran out (SQLAlchemy's TimeoutError): no connection was
    taken, so nothing was sent to the database."""
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    return isinstance(exc, PoolTimeout)


def outage_kind(exc: BaseException) -> str:
    """How an outage is said: the database is "busy" (SQLite locked, or its pool in use), "out of disk
    space", "read-only" or "not answering"."""
    if _sqlite_busy(exc) or _pool_busy(exc):
        return "busy"
    return _disk_refused(exc) or "not answering"


def outage_reason(exc: BaseException) -> str:
    """The driver's words for a database that is away, on one line and at most 200 characters."""
    if _pool_busy(exc):
        said = str(exc).split(" (Background on this error at:")[0]
        return " ".join(f"every connection of its pool in use ({said})".split())[:200]
    return " ".join(str(getattr(exc, "orig", exc)).split())[:200]


def through_outage(write: Callable[[], T], what: str, outage_s: float | None = None) -> T:
    """`write()`, tried again while the database is away (`is_outage`), for at most `outage_s`
    (default `OUTAGE_S`); then (or on any other error) its error is raised. `write` must be safe to
    repeat: a failed transaction stored nothing."""
    outage_s = OUTAGE_S if outage_s is None else outage_s
    delay, deadline = 0.1, None
    while True:
        try:
            result = write()
        except Exception as exc:
            if not is_outage(exc):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + outage_s
                log.warning(
                    "%s: the database is %s (%s); trying again for %.0f s",
                    what,
                    outage_kind(exc),
                    outage_reason(exc),
                    outage_s,
                )
            if now >= deadline:
                raise
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, OUTAGE_RETRY_MAX_S)
            continue
        if deadline is not None:
            log.warning("%s: the database answers again", what)
        return result


# One `corral serve` per database: it resumes every unfinished run it finds there, so a second one on the
# same database drove the first one's runs too (two timelines written into one event stream).
# The Postgres advisory lock a serving process holds: "corralsv" (not migrations/env.py's "corral", which
# each start's migration takes, this one's included)
SERVER_LOCK_KEY = 0x636F7272616C7376
# How often a serving process checks that the connection holding its Postgres lock is alive and holds
# it (one indexed read of pg_locks), and, once it is lost, tries to take it again
HOLD_CHECK_S = 1.0
# The holding connection's own bounds: a connection attempt, and a peer that stopped answering (no
# answer to a query or to TCP keepalives for this long means the connection is lost)
HOLD_CONNECT_S = 5
HOLD_UNANSWERED_S = 10


class DatabaseHeld(RuntimeError):
    """Another serving process holds the database."""


class DatabaseHold:
    """Held by a serving process for its life: a Postgres session-level advisory lock on a connection of
    its own, or an exclusive `flock` on `<SQLite file>.serve-lock`. Either goes with the process, however
    it ends (kill -9 included), so a restart after a crash is never refused.

    A Postgres lock also goes with its connection: Postgres restarted, the backend terminated, the
    network cut. `watch` checks the connection every `HOLD_CHECK_S` and takes the lock again as soon as
    the database answers; `held` is false meanwhile. A connection the server still keeps for this
    process (a cut it has not noticed yet) is recognised by its application name and terminated, so
    this process never mistakes its own old session for another server. If another process took the
    lock in between, `watch` calls `on_taken` with a line saying who holds it: that process has resumed
    this one's runs, and this one must stop writing to them. A SQLite flock cannot be lost."""

    def __init__(self, url: str) -> None:
        import fcntl

        self._connection: Any = None
        self._file: Any = None
        self._engine: Engine | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.held = True  # false while a lost Postgres lock is not yet taken again
        self.application_name = ""  # of the holding Postgres connection
        self._token = ""  # its part that no other process has
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            database = sqlite_file(parsed)
            if database is None:
                return  # a database of this process alone
            path = database.with_name(database.name + ".serve-lock")
            self._file = path.open("a+")
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._file.close()
                raise DatabaseHeld(f"its lock {path} is held") from None
            return
        # A name no other process has, up to Postgres's 63 characters: the token comes first
        self._token = f"corral-serve {uuid.uuid4().hex[:12]}"
        self.application_name = f"{self._token} pid {os.getpid()} {socket.gethostname()}"[:63]
        connect_args = {
            "application_name": self.application_name,
            "connect_timeout": HOLD_CONNECT_S,
            "keepalives": 1,
            "keepalives_idle": HOLD_CONNECT_S,
            "keepalives_interval": 1,
            "keepalives_count": HOLD_CONNECT_S,
            "tcp_user_timeout": HOLD_UNANSWERED_S * 1000,
        }
        self._engine = make_engine(url, poolclass=NullPool, connect_args=connect_args)
        if not self._take():
            row = self._holder_row()
            self._engine.dispose()
            raise DatabaseHeld(f"the advisory lock {SERVER_LOCK_KEY} is held" + _held_by(row))

    def _take(self) -> bool:
        """Connect and try the lock: whether it is held now (the connection is kept only then)."""
        assert self._engine is not None
        connection = self._engine.connect()
        try:
            held = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": SERVER_LOCK_KEY})
            taken = bool(held.scalar())
            connection.commit()  # the lock is the session's, not the transaction's
        except BaseException:
            _close_quietly(connection)
            raise
        if not taken:
            _close_quietly(connection)
            return False
        self._connection = connection
        return True

    def _holder_row(self) -> Any:
        assert self._engine is not None
        with self._engine.connect() as connection:
            return connection.execute(_HOLDER, _lock_ids()).first()

    def watch(self, on_taken: Callable[[str], None], check_s: float = HOLD_CHECK_S) -> None:
        """Check the hold every `check_s` on a daemon thread until `release` (Postgres only); `on_taken`
        is called once, on that thread, if another process took the lock."""
        if self._engine is None:
            return

        def loop() -> None:
            while not self._stop.wait(check_s):
                taken = self.check()
                if taken is not None:
                    on_taken(taken)
                    return

        self._watcher = threading.Thread(target=loop, name="corral-database-hold", daemon=True)
        self._watcher.start()

    def check(self) -> str | None:
        """One check: the lock still held, or taken again if the database answers; None, or the line
        that says who took it meanwhile."""
        if self._engine is None:
            return None
        if self._connection is not None:
            try:
                still = self._connection.execute(_HELD, _lock_ids()).scalar()
                self._connection.commit()
            except SQLAlchemyError as exc:
                still, reason = False, outage_reason(exc)
            else:
                reason = "the lock is no longer on it"
            if still:
                return None
            _close_quietly(self._connection)
            self._connection, self.held = None, False
            log.warning(
                "corral serve: the connection holding this database was lost (%s): taking it again as soon "
                "as the database answers; another corral serve could start meanwhile",
                reason,
            )
        try:
            if self._take():
                self.held = True
                log.warning("corral serve: the database is held again (advisory lock %d)", SERVER_LOCK_KEY)
                return None
            row = self._holder_row()
        except SQLAlchemyError:
            return None  # still away: the next check tries again
        if row is None:
            return None  # let go between the two queries: the next check takes it
        pid, name, _ = row
        if (name or "").startswith(self._token):
            # This process's own old session, which the server has not yet seen is gone (a cut network)
            with contextlib.suppress(SQLAlchemyError), self._engine.connect() as connection:
                connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            log.warning("corral serve: ended this process's old session %d, which still held the lock", pid)
            return None
        return (
            "another process took this database while the connection holding it was lost: the advisory "
            f"lock {SERVER_LOCK_KEY} is held" + _held_by(row)
        )

    def release(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(HOLD_CONNECT_S + HOLD_UNANSWERED_S)
        if self._connection is not None:
            _close_quietly(self._connection)  # the session's advisory locks go with it
        if self._engine is not None:
            self._engine.dispose()
        if self._file is not None:
            self._file.close()  # and the flock with the file


def sqlite_file(url: Any) -> Path | None:
    """The file of a SQLite URL, given as a path or as a `file:` URI (`?uri=true`: its path, not the text
    `file:/…`, which named a lock file in a directory `file:` that does not exist); None in memory."""
    database = url.database or ""
    if url.query.get("uri"):
        if url.query.get("mode") == "memory":
            return None
        parsed = urlparse(database)
        if parsed.scheme == "file":
            database = unquote(parsed.path)
    if database in ("", ":memory:"):
        return None
    return Path(database)


def in_memory_sqlite(url: str) -> bool:
    """Whether a SQLite URL names a database in memory (`sqlite://`, `:memory:` or a `file:` URI with
    `mode=memory`), which lives only as long as its connection; False for one it cannot parse."""
    try:
        return sqlite_file(make_url(url)) is None
    except ArgumentError:
        return False


def _held_by(row: Any) -> str:
    """` by …` naming the Postgres backend of a `_HOLDER` row, or nothing when none holds the lock now."""
    if row is None:
        return ""
    pid, name, address = row
    return f" by Postgres backend {pid} ({name or 'no application name'}, from {address or 'a socket'})"


def _close_quietly(connection: Any) -> None:
    with contextlib.suppress(SQLAlchemyError):  # a connection the database dropped: nothing held
        connection.close()


def _lock_ids() -> dict[str, int]:
    """A bigint advisory key as pg_locks shows it: its high and low 32 bits."""
    return {"hi": SERVER_LOCK_KEY >> 32, "lo": SERVER_LOCK_KEY & 0xFFFFFFFF}


# pg_locks lists every database's locks: this one's alone
_LOCK_ROW = (
    "l.locktype = 'advisory' AND l.classid = :hi AND l.objid = :lo AND l.objsubid = 1 AND l.granted "
    "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_HELD = text(f"SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE {_LOCK_ROW} AND l.pid = pg_backend_pid())")
_HOLDER = text(
    "SELECT l.pid, a.application_name, host(a.client_addr) FROM pg_locks l "
    f"LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE {_LOCK_ROW}"
)
