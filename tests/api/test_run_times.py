"""A run's `started_at` and `ended_at` in GET /api/runs/{id} and GET /api/runs, while the run executes in
this process (its row is cached there) and after it ends."""

from __future__ import annotations

from typing import Any

import httpx
from api_support import make_run, wait_for


def test_started_and_ended_at_are_shown_as_they_happen(api: httpx.Client) -> None:
    spec = make_run(batches=2, trainer="sentinel", sentinel_step_s=0)
    run_id = api.post("/api/runs", json=spec).json()["id"]
    created = api.get(f"/api/runs/{run_id}").json()["created_at"]
    started = wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["started_at"], what="started_at")
    done = wait_for(
        lambda: (view := api.get(f"/api/runs/{run_id}").json())["state"] == "completed" and view,
        what="the run to complete",
    )
    assert done["ended_at"] is not None, "a finished run showed no ended_at until the server restarted"
    assert created <= started <= done["started_at"] <= done["ended_at"]

    def times(row: dict[str, Any]) -> tuple[float, float]:
        return row["started_at"], row["ended_at"]

    # The view reads the row cached for a run executing here, the list reads the database; once the
    # store has the end (from the run, or first from the event sink) they show the same times.
    wait_for(
        lambda: (
            times({r["id"]: r for r in api.get("/api/runs").json()}[run_id])
            == times(api.get(f"/api/runs/{run_id}").json())
        ),
        what="the list and the view to agree",
    )
