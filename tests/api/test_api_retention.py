"""DELETE /api/runs/{id}: an ended run goes with everything stored for it; a live run is refused (409)
and goes on untouched. On SQLite and on the real Postgres (`backend_url`)."""

from __future__ import annotations

import httpx
from api_support import make_run, wait_for


def test_an_ended_run_is_deleted_and_a_live_one_refused(api: httpx.Client) -> None:
    spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0)
    live = api.post("/api/runs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{live}").json()["live"]["batches"] >= 1, what="a first batch")
    refused = api.delete(f"/api/runs/{live}")
    assert refused.status_code == 409
    assert "stop it and wait until it has ended" in refused.json()["detail"]
    seen = api.get(f"/api/runs/{live}").json()["live"]["events"]
    wait_for(lambda: api.get(f"/api/runs/{live}").json()["live"]["events"] > seen, what="the run to go on")
    assert api.get(f"/api/runs/{live}/timeline", params={"limit": 5}).json()["events"]

    api.post(f"/api/runs/{live}/stop")
    wait_for(lambda: api.get(f"/api/runs/{live}").json()["state"] == "stopped", what="stopped")
    assert api.get(f"/api/runs/{live}/metrics").status_code == 200
    deleted = api.delete(f"/api/runs/{live}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["deleted"] is True
    assert api.get(f"/api/runs/{live}").status_code == 404
    assert api.get(f"/api/runs/{live}/timeline").status_code == 404
    assert api.get(f"/api/runs/{live}/rollouts/1").status_code == 404
    assert live not in [r["id"] for r in api.get("/api/runs").json()]
    assert api.delete(f"/api/runs/{live}").status_code == 404


def test_deleting_needs_the_operator_token(server: str) -> None:
    with httpx.Client(base_url=server, timeout=30) as anonymous:
        assert anonymous.delete("/api/runs/whatever").status_code == 401
        bad = anonymous.delete("/api/runs/whatever", headers={"Authorization": "Bearer not-the-token"})
        assert bad.status_code == 403
