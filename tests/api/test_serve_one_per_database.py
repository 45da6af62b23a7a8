"""One `corral serve` per database. A second one started on a database a live one serves is refused in
one line (exit 2), and the first goes on alone; after the first is killed (`kill -9`), a new one starts
and resumes its runs. Before, the second resumed every unfinished run of the first and drove it too: two
processes wrote two timelines into each run's one event stream. Real processes, on SQLite and on the
real Postgres."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from alembic import command
from api_support import POSTGRES_URL, TOKEN, free_port, make_run, serve_env, wait_for
from db_relay import postgres_answers, relayed_database, server_lock_holder, take_server_lock
from sqlalchemy.pool import NullPool

from app.store.db import DatabaseHold, make_engine, scratch_database
from app.store.migrate import alembic_config, current_revision


def _start(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_second_corral_serve_on_a_served_database_is_refused(backend: str, tmp_path: Path) -> None:
    if backend == "postgres" and not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    procs: list[subprocess.Popen[bytes]] = []
    with scratch_database(backend, POSTGRES_URL, tmp_path) as db:
        try:
            first_port, second_port = free_port(), free_port()
            first = _start(serve_env(tmp_path, db, first_port), tmp_path / "first.log")
            procs.append(first)
            first_url = f"http://127.0.0.1:{first_port}"
            wait_for(lambda: _answers(first_url), 120, what=f"the first server; log {tmp_path / 'first.log'}")
            api = httpx.Client(base_url=first_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            spec = make_run(speed=1.0, trainer="sentinel")
            del spec["batches"]  # it goes on until stopped
            run_id = api.post("/api/runs", json=spec).json()["id"]
            api.close()

            second = _start(serve_env(tmp_path, db, second_port), tmp_path / "second.log")
            procs.append(second)
            assert second.wait(timeout=120) == 2  # before: it served on, and drove the first one's run
            said = (tmp_path / "second.log").read_text().strip().splitlines()
            assert len(said) == 1, said
            assert "another corral serve is using this database" in said[0]
            assert "CORRAL_DATABASE_URL" in said[0]
            assert httpx.get(f"{first_url}/api/runs/{run_id}", timeout=10).json()["live"] is not None

            first.kill()  # kill -9: what it held goes with it
            first.wait()
            third = _start(serve_env(tmp_path, db, second_port), tmp_path / "third.log")
            procs.append(third)
            third_url = f"http://127.0.0.1:{second_port}"
            wait_for(
                lambda: _answers(third_url) and httpx.get(f"{third_url}/healthz").json()["resuming"] == [],
                120,
                what=f"a server after the first one's death; log {tmp_path / 'third.log'}",
            )
            assert httpx.get(f"{third_url}/api/runs/{run_id}", timeout=10).json()["live"] is not None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_refused_corral_serve_leaves_the_schema_as_it_found_it(backend: str, tmp_path: Path) -> None:
    """A newer Corral started while the older one still serves its database (an upgrade begun before the
    stop) is refused, and has not migrated the schema under the server using it: it did, then said no."""
    if backend == "postgres" and not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    with scratch_database(backend, POSTGRES_URL, tmp_path) as db:
        command.upgrade(alembic_config(db), "0004")
        held = DatabaseHold(db)  # as the older server holds it
        try:
            log = tmp_path / "second.log"
            assert _start(serve_env(tmp_path, db, free_port()), log).wait(timeout=120) == 2
        finally:
            held.release()
        said = log.read_text().strip().splitlines()
        assert len(said) == 1, said
        assert "another corral serve is using this database" in said[0]
        engine = make_engine(db)
        try:
            assert current_revision(engine) == "0004"
        finally:
            engine.dispose()


def test_a_sqlite_uri_database_is_held_as_its_file(tmp_path: Path) -> None:
    """`sqlite:///file:/abs/c.db?uri=true` names the file c.db: its server holds it, and a second one on
    the file's plain path is refused. Before, the lock file was looked for in a directory `file:` that
    does not exist, and the first server ended in a traceback (after migrating the database)."""
    database = tmp_path / "c.db"
    port = free_port()
    first = _start(serve_env(tmp_path, f"sqlite:///file:{database}?uri=true", port), tmp_path / "first.log")
    try:
        log = tmp_path / "first.log"
        wait_for(lambda: first.poll() is not None or _answers(f"http://127.0.0.1:{port}"), 120, what=str(log))
        assert first.poll() is None, log.read_text()[-2000:]
        second = _start(serve_env(tmp_path, f"sqlite:///{database}", free_port()), tmp_path / "second.log")
        assert second.wait(timeout=120) == 2
        assert "another corral serve is using this database" in (tmp_path / "second.log").read_text()
    finally:
        first.kill()
        first.wait()
    assert (tmp_path / "c.db.serve-lock").exists()


@pytest.mark.parametrize("taken_meanwhile", [False, True])
def test_a_lost_hold_is_taken_again_or_the_server_stops(taken_meanwhile: bool, tmp_path: Path) -> None:
    """The connection that holds a serving process's Postgres lock is lost (Postgres restarted: the
    relay cut). Once the database answers again the server holds it again, and a second `corral serve`
    is refused as before (before: the lock was gone for good, and the second served beside the first).
    If another process took the lock meanwhile, the first stops at once, exit 3, saying who holds it."""
    procs: list[subprocess.Popen[bytes]] = []
    with relayed_database(POSTGRES_URL, tmp_path) as db:
        straight = make_engine(db.url, poolclass=NullPool)
        other = None
        try:
            port = free_port()
            first = _start(serve_env(tmp_path, db.relayed_url, port), tmp_path / "first.log")
            procs.append(first)
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _answers(url), 120, what=f"the first server; log {tmp_path / 'first.log'}")
            assert server_lock_holder(straight) is not None

            db.relay.cut()  # as a Postgres restart: every connection through it closed, new ones refused
            wait_for(lambda: server_lock_holder(straight) is None, 30, what="the lock let go")
            if taken_meanwhile:
                other = take_server_lock(straight, "another corral serve")
            time.sleep(2)  # a few of the holder's checks while the database does not answer
            db.relay.restore()

            if taken_meanwhile:
                assert first.wait(timeout=60) == 3  # before: it served on, beside the lock's new holder
                lines = (tmp_path / "first.log").read_text().splitlines()
                said = [line for line in lines if "stopped at once" in line]
                assert len(said) == 1, said
                assert "another process took this database" in said[0]
                assert "(another corral serve, from 127.0.0.1)" in said[0]
                return
            wait_for(
                lambda: server_lock_holder(straight) is not None,
                60,
                what=f"the lock taken again; log {tmp_path / 'first.log'}",
            )
            wait_for(lambda: _answers(url), 60, what="/healthz ok again")
            assert httpx.get(f"{url}/healthz", timeout=10).json()["database"] == {"ok": True, "held": True}
            second = _start(serve_env(tmp_path, db.url, free_port()), tmp_path / "second.log")
            procs.append(second)
            assert second.wait(timeout=120) == 2
            assert "another corral serve is using this database" in (tmp_path / "second.log").read_text()
            assert first.poll() is None
            said = (tmp_path / "first.log").read_text()
            assert "the connection holding this database was lost" in said
            assert "the database is held again" in said
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            if other is not None:
                other.close()
            straight.dispose()
