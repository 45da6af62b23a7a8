"""Draining an engine from outside the run: no new turn and no update on it, turns in flight finish,
and it comes back to serve at the newest version."""

from __future__ import annotations

import httpx
from api_support import make_run, wait_for


def test_a_drained_engine_takes_no_new_turns_and_comes_back(api: httpx.Client) -> None:
    spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0)
    run_id = api.post("/api/runs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["live"]["batches"] >= 1, what="a batch")
    drained = api.post(f"/api/runs/{run_id}/engines/engine-0/drain", headers={"X-Corral-Actor": "ops"})
    assert drained.status_code == 200, drained.text
    assert drained.json()["state"] in ("draining", "updating")
    last = api.post(f"/api/runs/{run_id}/engines/engine-1/drain")
    assert last.status_code == 409
    assert "last one serving" in last.json()["detail"]
    at = api.get(f"/api/runs/{run_id}").json()["live"]["batches"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["live"]["batches"] >= at + 3, what="3 batches")

    events = api.get(f"/api/runs/{run_id}/timeline", params={"limit": 10_000}).json()["events"]
    mark = next(e for e in events if e["kind"] == "engine_state" and e["state"] == "draining")
    later_turns = [e for e in events if e["kind"] == "turn" and e["start"] > mark["t"]]
    assert later_turns
    assert {e["engine"] for e in later_turns} == {"engine-1"}
    updates = [e for e in events if e["kind"] == "engine_update_begin" and e["t"] > mark["t"]]
    assert updates
    assert {e["engine"] for e in updates} == {"engine-1"}
    assert "drained by ops" in mark["detail"]

    back = api.post(f"/api/runs/{run_id}/engines/engine-0/serve")
    assert back.status_code == 200, back.text
    newest = api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"]
    wait_for(
        lambda: api.get(f"/api/runs/{run_id}").json()["live"]["engine_versions"]["engine-0"] >= newest,
        what="engine-0 brought to the newest version",
    )
    assert api.post(f"/api/runs/{run_id}/engines/engine-0/serve").status_code == 409  # not drained
    assert api.post(f"/api/runs/{run_id}/engines/engine-9/drain").status_code == 404
    api.post(f"/api/runs/{run_id}/stop")


def test_the_pace_of_rollouts_is_set_live_and_audited(api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    paced = api.patch(
        f"/api/runs/{run_id}/policy",
        json={"max_updating_engines": 2, "pause_mode": "wait"},
        headers={"X-Corral-Actor": "ops"},
    )
    assert paced.status_code == 200, paced.text
    assert paced.json()["policy"]["max_updating_engines"] == 2
    rollout = api.post(f"/api/runs/{run_id}/weights", json={"version": 1, "sentinel": True}).json()
    assert rollout["max_updating_engines"] == 2
    assert rollout["pause_mode"] == "wait"
    assert {e["state"] for e in rollout["engines"]} == {"updating"}  # both at once, as paced
    done = wait_for(
        lambda: (r := api.get(f"/api/runs/{run_id}/rollouts/1").json())["state"] == "completed" and r,
        what="the rollout to complete",
    )
    assert {e["state"] for e in done["engines"]} == {"done"}
    assert all(e["ended_s"] >= e["began_s"] >= 0 for e in done["engines"])  # seconds into the run
    events = api.get(f"/api/runs/{run_id}/timeline", params={"limit": 10_000}).json()["events"]
    changes = {(e["field"], e["new"], e["actor"]) for e in events if e["kind"] == "policy_changed"}
    assert {("max_updating_engines", 2, "ops"), ("pause_mode", "wait", "ops")} <= changes
    api.post(f"/api/runs/{run_id}/stop")
