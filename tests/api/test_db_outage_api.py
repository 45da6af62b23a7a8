"""The API and the dashboard while Postgres is away (tests/db_relay.py): a 503 with one line and a
Retry-After, not a 500 with a traceback per request; they answer as before once it is back."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import POSTGRES_URL, TOKEN, make_settings, serving
from db_relay import CuttableRelay, postgres_answers
from sqlalchemy.engine import make_url

from app.store.db import scratch_database


def test_a_database_outage_is_a_503_that_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    if not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering (the outage tests need the real server)")
    with scratch_database("postgres", POSTGRES_URL, tmp_path) as url:
        direct = make_url(url)
        relay = CuttableRelay((direct.host or "127.0.0.1", direct.port or 5432))
        relayed = direct.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
        try:
            with (
                serving(make_settings(tmp_path, relayed)) as base,
                httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api,
            ):
                assert api.get("/api/runs").status_code == 200
                relay.cut()
                answer = api.get("/api/runs")
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == "5"
                assert answer.json()["detail"].startswith("the database is not answering (")
                page = api.get("/", headers={"Accept": "text/html"})
                assert page.status_code == 503, page.text
                assert "the database is not answering" in page.text
                assert "Traceback" not in caplog.text
                relay.restore()
                assert api.get("/api/runs").status_code == 200
                assert api.get("/", headers={"Accept": "text/html"}).status_code == 200
        finally:
            relay.cut()
