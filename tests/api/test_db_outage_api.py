"""The API and the dashboard while Postgres is away (tests/db_relay.py): a 503 with one line and a
Retry-After, not a 500 with a traceback per request; they answer as before once it is back."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from api_support import POSTGRES_URL, TOKEN, make_settings, serving
from db_relay import relayed_database


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
