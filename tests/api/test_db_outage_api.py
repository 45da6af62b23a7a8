"""The API and the dashboard while Postgres is away (tests/db_relay.py), or SQLite stays locked by
another writer: a 503 with one line and a Retry-After, not a 500 with a traceback per request; they
answer as before once it is back."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from api_support import POSTGRES_URL, TOKEN, make_run, make_settings, serving
from db_relay import postgres_answers, relayed_database

from app.api.app import create_app
from app.store.db import scratch_database


def test_a_database_outage_is_a_503_that_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with (
        relayed_database(POSTGRES_URL, tmp_path) as db,
        serving(make_settings(tmp_path, db.relayed_url)) as base,
        httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api,
    ):
        assert api.get("/api/runs").status_code == 200
        db.relay.cut()
        answer = api.get("/api/runs")
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "5"
        assert answer.json()["detail"].startswith("the database is not answering (")
        page = api.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 503, page.text
        assert "the database is not answering" in page.text
        assert "Traceback" not in caplog.text
        db.relay.restore()
        assert api.get("/api/runs").status_code == 200
        assert api.get("/", headers={"Accept": "text/html"}).status_code == 200


def test_sqlite_locked_past_its_busy_timeout_is_a_503_that_says_so(tmp_path: Path) -> None:
    """Another connection holds SQLite's write lock for longer than the store's busy timeout (30 s): a
    request that needs the store answers 503 "busy" with a Retry-After (the API's JSON, the dashboard's
    page), not a 500, and answers as before once the lock is let go."""
    db = tmp_path / "corral.db"
    with (
        serving(make_settings(tmp_path, f"sqlite:///{db}")) as base,
        httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90) as api,
    ):
        assert api.get("/api/runs").status_code == 200
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        answers: dict[str, httpx.Response] = {}

        def ask(name: str, path: str, accept: str) -> None:
            answers[name] = api.get(path, headers={"Accept": accept})

        asks = [
            threading.Thread(target=ask, args=("api", "/api/runs", "application/json")),
            threading.Thread(target=ask, args=("page", "/", "text/html")),
        ]
        started = time.monotonic()
        try:
            for t in asks:
                t.start()
            for t in asks:
                t.join(90)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        waited = time.monotonic() - started
        answer = answers["api"]
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "5"
        assert answer.json()["detail"].startswith("the database is busy (database is locked)")
        page = answers["page"]
        assert page.status_code == 503, page.text
        assert page.headers["retry-after"] == "5"
        assert "the database is busy" in page.text
        assert "Traceback" not in page.text
        assert waited >= 25, f"answered after {waited:.1f} s: the busy timeout (30 s) was not waited out"
        assert api.get("/api/runs").status_code == 200
        assert api.get("/", headers={"Accept": "text/html"}).status_code == 200


def test_a_write_on_locked_sqlite_waits_the_busy_timeout_it_is_given(tmp_path: Path) -> None:
    """With `CORRAL_SQLITE_BUSY_TIMEOUT_S=1`, creating a run on a locked database still took 30 s to be
    refused: the store tried the write again for a fixed 30 s, whatever the busy timeout said."""
    db = tmp_path / "corral.db"
    with (
        serving(make_settings(tmp_path, f"sqlite:///{db}", sqlite_busy_timeout_s=1.0)) as base,
        httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90) as api,
    ):
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        try:
            answer = api.post("/api/runs", json=make_run())
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        waited = time.monotonic() - started
        assert answer.status_code == 503, answer.text
        assert answer.json()["detail"].startswith("the database is busy (database is locked)")
        assert waited < 20, f"answered after {waited:.1f} s: longer than the 1 s busy timeout allows"


def test_every_pooled_connection_in_use_is_a_503_that_says_so(tmp_path: Path) -> None:
    """68 simulated runs launched at once took every connection of the store's pool (5 and 10 more):
    a request that waited 30 s for one was a 500 with a traceback. Now a 503 "busy" with a Retry-After
    (the API's JSON, the dashboard's page), as for SQLite locked."""
    if not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering")
    with scratch_database("postgres", POSTGRES_URL, tmp_path) as url:
        settings = make_settings(tmp_path, url)
        app = create_app(settings)
        with (
            serving(settings, app) as base,
            httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=90) as api,
        ):
            assert api.get("/api/runs").status_code == 200
            engine = app.state.manager.store.engine
            held = [engine.connect() for _ in range(engine.pool.size() + engine.pool._max_overflow)]
            try:
                with ThreadPoolExecutor(2) as pool:  # each waits out the pool's 30 s: both at once
                    asked = pool.submit(api.get, "/api/runs")
                    shown = pool.submit(api.get, "/", headers={"Accept": "text/html"})
                    answer, page = asked.result(), shown.result()
            finally:
                for conn in held:
                    conn.close()
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "5"
            assert answer.json()["detail"].startswith(
                "the database is busy (every connection of its pool in use"
            )
            assert page.status_code == 503, page.text
            assert "the database is busy" in page.text
            assert api.get("/api/runs").status_code == 200
