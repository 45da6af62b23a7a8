"""An operator's command answers with its id (`command_id`), and the events it published carry it, so a
client finds in the run's events what its command did."""

from __future__ import annotations

import re
from typing import Any

import httpx
from api_support import make_run, wait_for

from app.service.schemas import small_workload

COMMAND_ID = re.compile(r"^[0-9a-f]{32}$")


def events_of(api: httpx.Client, run_id: str, command_id: str) -> list[dict[str, Any]]:
    events = api.get(f"/api/runs/{run_id}/timeline", params={"limit": 10_000}).json()["events"]
    return [e for e in events if e.get("command_id") == command_id]


def test_each_command_answers_its_id_and_its_events_carry_it(api: httpx.Client) -> None:
    workload = {**small_workload(), "engines": {"count": 2, "slots": 4, "update_s": 0.5}}
    run_id = api.post("/api/runs", json=make_run(batches=None, workload=workload)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    knobs = api.get(f"/api/runs/{run_id}").json()["policy"]
    answers = []

    change = {"surplus_groups": knobs["surplus_groups"] + 1, "max_staleness": knobs["max_staleness"] + 1}
    policy = api.patch(f"/api/runs/{run_id}/policy", json=change)
    assert policy.status_code == 200, policy.text
    assert policy.json()["id"] == run_id  # the run's id stays where it was
    answers.append(policy.json())
    changed = events_of(api, run_id, policy.json()["command_id"])
    assert sorted((e["kind"], e["field"], e["new"]) for e in changed) == [
        ("policy_changed", "max_staleness", change["max_staleness"]),
        ("policy_changed", "surplus_groups", change["surplus_groups"]),
    ]

    published = api.post(f"/api/runs/{run_id}/weights", json={"version": 1, "sentinel": True})
    assert published.status_code == 202, published.text
    assert published.json()["version"] == 1
    answers.append(published.json())
    (event,) = events_of(api, run_id, published.json()["command_id"])
    assert (event["kind"], event["version"]) == ("version_published", 1)

    for action, state in (("drain", "draining"), ("serve", "serving")):
        rotated = api.post(f"/api/runs/{run_id}/engines/engine-0/{action}")
        assert rotated.status_code == 200, rotated.text
        answers.append(rotated.json())
        (event,) = events_of(api, run_id, rotated.json()["command_id"])
        assert (event["kind"], event["engine"], event["state"]) == ("engine_state", "engine-0", state)

    for action in ("pause", "resume"):  # a change of the run's state, not an event: the id alone
        acted = api.post(f"/api/runs/{run_id}/{action}")
        assert acted.status_code == 200, acted.text
        answers.append(acted.json())

    ids = [answer["command_id"] for answer in answers]
    assert all(COMMAND_ID.match(i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
