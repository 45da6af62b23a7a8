"""A database whose disk refuses writes (full, or turned read-only) is an outage the store's writers wait
out, not a refusal of the write: real SQLite and Postgres errors, each on a real file system that
refuses. (The whole run through a full disk under `corral serve`: tests/api/test_serve_disk_full.py.)"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from small_disk import small_disk
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from store_backends import POSTGRES_URL

from app.store.db import is_outage, make_engine, outage_kind


def refused_write(url: str, *setup: str, insert: str) -> DBAPIError:
    """The error of `insert`, repeated until the database refuses it, after `setup`."""
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            for statement in setup:
                c.execute(text(statement))
        for _ in range(10_000):
            try:
                with engine.begin() as c:
                    c.execute(text(insert))
            except DBAPIError as exc:
                return exc
        raise AssertionError("the database never refused the write")
    finally:
        engine.dispose()


def test_sqlite_read_only_is_waited_out(tmp_path: Path) -> None:
    database = tmp_path / "ro.db"
    make_engine(f"sqlite:///{database}").dispose()
    with make_engine(f"sqlite:///{database}").begin() as c:
        c.execute(text("CREATE TABLE t (x BLOB)"))
    exc = refused_write(f"sqlite:///file:{database}?mode=ro&uri=true", insert="INSERT INTO t VALUES (1)")
    assert "attempt to write a readonly database" in str(exc)
    assert is_outage(exc)
    assert outage_kind(exc) == "read-only"


def test_postgres_disk_full_is_waited_out(tmp_path: Path) -> None:
    """Postgres's disk_full (SQLSTATE 53100), from a tablespace on a small tmpfs."""
    root = Path(tempfile.mkdtemp(prefix="corral-pg-", dir="/tmp"))  # the postgres user must reach it
    root.chmod(0o755)
    name = root.name.replace("-", "_")
    with small_disk(root / "disk", 1) as disk:
        if subprocess.run(["chown", "postgres", str(disk)], capture_output=True, check=False).returncode:
            pytest.skip("no postgres user to own a tablespace's directory")
        admin = make_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
        try:
            try:
                with admin.connect() as c:
                    c.execute(text(f"CREATE TABLESPACE {name} LOCATION '{disk}'"))
            except DBAPIError as exc:
                pytest.skip(f"no tablespace on a local tmpfs here (Postgres elsewhere?): {exc.orig}")
            try:
                rows = "SELECT decode(repeat('ab', 65536), 'hex') FROM generate_series(1, 8)"
                create = f"CREATE TABLE {name} (x bytea) TABLESPACE {name}"
                exc = refused_write(POSTGRES_URL, create, insert=f"INSERT INTO {name} {rows}")
            finally:
                with admin.connect() as c:
                    c.execute(text(f"DROP TABLE IF EXISTS {name}"))
                    c.execute(text(f"DROP TABLESPACE {name}"))
        finally:
            admin.dispose()
    shutil.rmtree(root)
    assert getattr(exc.orig, "sqlstate", None) == "53100", exc
    assert is_outage(exc)
    assert outage_kind(exc) == "out of disk space"
