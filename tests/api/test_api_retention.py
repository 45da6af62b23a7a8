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


def test_a_long_poll_open_across_the_delete_answers_404_at_once(api: httpx.Client) -> None:
    """It waited out its timeout for a batch nobody could ack any more, then answered 204."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    run = api.post("/api/runs", json=make_run(batches=None)).json()["id"]  # the API's trainer: us
    taken = api.get(f"/api/runs/{run}/batches/next", params={"timeout": 120})
    assert taken.status_code == 200, taken.text  # leased to us and never acked
    api.post(f"/api/runs/{run}/stop")
    wait_for(lambda: api.get(f"/api/runs/{run}").json()["state"] == "stopped", what="stopped")
    with (
        httpx.Client(base_url=api.base_url, timeout=60) as poller,
        ThreadPoolExecutor(1) as pool,
    ):
        asked = time.monotonic()
        poll = pool.submit(poller.get, f"/api/runs/{run}/batches/next", params={"timeout": 40})
        time.sleep(1.0)
        assert api.delete(f"/api/runs/{run}").status_code == 200
        answer = poll.result()
        waited = time.monotonic() - asked
    assert answer.status_code == 404, answer.text
    assert answer.json()["detail"] == f"no run {run!r} (deleted)"
    assert waited < 25  # answered at the delete, not at its 40 s timeout nor when the 30 s lease ends


def test_a_simulated_run_stopped_at_its_start_ends_in_seconds(api: httpx.Client) -> None:
    """B = 32 groups of G = 8 at speed 1, stopped 3 s in: it stayed `stopping` for about 4 minutes while
    its 768 simulated resets and clean-ups drained in wall time. A stopping run's clock now hurries."""
    import time

    workload = {"trajectory": {"reset_s": {"uniform": [5, 60]}}}
    run = api.post("/api/runs", json=make_run(speed=1.0, batches=None, workload=workload)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run}").json()["state"] == "running", what="running")
    time.sleep(3.0)
    asked = time.monotonic()
    assert api.post(f"/api/runs/{run}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run}").json()["state"] == "stopped", 120, what="stopped")
    assert time.monotonic() - asked < 30  # 68 s without the hurry here; 4 minutes at the default reset times
    record = api.get(f"/api/runs/{run}").json()
    assert record["live"]["groups_live"] == 0
