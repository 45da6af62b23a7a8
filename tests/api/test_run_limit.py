"""`CORRAL_MAX_RUNS`: the most runs a `corral serve` executes at once. Before, every `POST /api/runs` started
one more run in the server's process, without bound.
- a create past the limit is a 429 whose `detail` names the limit and how to raise it; nothing is stored;
- the dashboard's launch form says how many execute and the limit, and a launch past it is refused in
  the form (429), not a 500;
- a run counts until it has ended: once one is stopped, a create is let in again;
- concurrent creates at the limit's edge let in exactly as many as there are places.
On the real server, on SQLite and on Postgres."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from api_support import POSTGRES_URL, TOKEN, make_run, make_settings, serving, wait_for
from db_relay import postgres_answers

from app.store.db import scratch_database

LIMIT = 2


def _endless() -> dict[str, object]:
    spec = make_run(speed=1.0, trainer="sentinel")
    del spec["batches"]
    return spec


@pytest.fixture(params=["sqlite", "postgres"])
def own_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database of this test's own: the session's shared one holds other modules' runs, which a
    server started on it resumes, and those count towards its limit."""
    if request.param == "postgres" and not postgres_answers(POSTGRES_URL):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    with scratch_database(request.param, POSTGRES_URL, tmp_path) as url:
        yield url


def test_a_create_past_the_limit_is_a_429_naming_it_and_nothing_is_stored(
    tmp_path: Path, own_database: str
) -> None:
    settings = make_settings(tmp_path, own_database, max_runs=LIMIT)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serving(settings) as url, httpx.Client(base_url=url, headers=auth, timeout=60) as api:
        # at once, more than the places: exactly LIMIT are let in
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: api.post("/api/runs", json=_endless()), range(4)))
        codes = sorted(a.status_code for a in answers)
        assert codes == [201] * LIMIT + [429] * (4 - LIMIT), [a.text for a in answers]
        created = [a.json()["id"] for a in answers if a.status_code == 201]
        refused = next(a for a in answers if a.status_code == 429)
        detail = refused.json()["detail"]
        assert f"this server executes {LIMIT} runs, its limit (CORRAL_MAX_RUNS={LIMIT})" in detail
        assert "higher CORRAL_MAX_RUNS" in detail
        assert "Traceback" not in refused.text
        before = {r["id"] for r in api.get("/api/runs").json()}
        assert before == set(created)  # the refused ones were never stored

        # the dashboard: the count in the form, and a launch past the limit refused in it
        page = api.get("/")
        assert f"Runs executing in this server: {LIMIT} of at most {LIMIT}" in page.text
        assert "a launch is refused until one ends" in page.text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert csrf is not None
        launch = api.post("/runs", data={"csrf_token": csrf.group(1)}, headers={"HX-Request": "true"})
        assert launch.status_code == 429, launch.text
        assert f"(CORRAL_MAX_RUNS={LIMIT})" in launch.text
        assert 'id="launch-form"' in launch.text  # the form again, with the refusal in it
        assert {r["id"] for r in api.get("/api/runs").json()} == before

        # a run counts until it has ended; then its place is free
        assert api.post(f"/api/runs/{created[0]}/stop").status_code == 200
        wait_for(lambda: api.get(f"/api/runs/{created[0]}").json()["state"] == "stopped", 60, what="the stop")
        again = api.post("/api/runs", json=_endless())
        assert again.status_code == 201, again.text
        assert api.post("/api/runs", json=_endless()).status_code == 429
        for run_id in (created[1], again.json()["id"]):
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
