"""`GET /api/runs/{id}/rollouts/{version}`: a rollout exists only for a version that was published, and
a run executing here (answered from memory) and an ended one (from the store) answer alike."""

from __future__ import annotations

from typing import Any

import httpx
from api_support import make_run, wait_for

from app.service.rollouts import ENGINE_KEYS, ROLLOUT_KEYS
from app.service.schemas import small_workload


def test_only_published_versions_have_rollouts_and_live_and_stored_answers_agree(api: httpx.Client) -> None:
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    for version in (1, 5, 6):
        published = api.post(f"/api/runs/{run_id}/weights", json={"version": version, "sentinel": True})
        assert published.status_code == 202, published.text

    def rollout(version: int) -> dict[str, Any]:
        answer = api.get(f"/api/runs/{run_id}/rollouts/{version}")
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    wait_for(lambda: rollout(6)["state"] == "completed", what="version 6 on every engine")
    live = {v: rollout(v) for v in (1, 5, 6)}
    for never in (2, 3, 4, 7):  # never published: no rollout, live or stored
        missing = api.get(f"/api/runs/{run_id}/rollouts/{never}")
        assert missing.status_code == 404, missing.text
        assert f"rollout {never}" in missing.json()["detail"]
    assert live[6]["state"] == "completed"
    assert (live[6]["superseded"], live[5]["superseded"], live[1]["superseded"]) == (False, True, True)
    for answer in live.values():
        assert tuple(answer) == ROLLOUT_KEYS
        assert answer["actor"] == "operator"
        assert answer["path"] is None  # a sentinel
        for engine in answer["engines"]:
            assert tuple(engine) == ENGINE_KEYS
            assert engine["version"] == 6  # what the engine serves now
            assert engine["state"] == "done"

    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
    stored = {v: rollout(v) for v in (1, 5, 6)}  # the run has ended: answered from the store
    assert stored == live
    assert api.get(f"/api/runs/{run_id}/rollouts/2").status_code == 404


def test_a_rollout_under_way_when_the_run_stops_ends_cancelled(api: httpx.Client) -> None:
    """It said `running` for ever, live and stored: the engine still to update never would."""
    # An update shorter than the grace a stopping run gives updates under way (UPDATE_STOP_GRACE_S),
    # so the first engine's finishes; a longer one is abandoned (tests/runtime/test_signals.py).
    workload = {**small_workload(), "engines": {"count": 2, "slots": 4, "update_s": 3.0}}
    run_id = api.post("/api/runs", json=make_run(batches=None, workload=workload)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    paced = api.patch(f"/api/runs/{run_id}/policy", json={"max_updating_engines": 1})
    assert paced.status_code == 200, paced.text  # one engine at a time: the second waits its turn
    published = api.post(f"/api/runs/{run_id}/weights", json={"version": 1, "sentinel": True})
    assert published.status_code == 202, published.text
    assert published.json()["state"] == "running"
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 60, what="stopped")
    rollout = api.get(f"/api/runs/{run_id}/rollouts/1").json()  # from the store: the run has ended
    assert rollout["state"] == "cancelled"
    assert rollout["ended_at"] is not None
    states = sorted((e["state"], e["error"]) for e in rollout["engines"])
    assert states == [("cancelled", "run ended"), ("done", None)]  # the update under way finished
