"""A trainer that publishes the newest version a run takes: the run ends, saying why, instead of waiting
for ever for a version that no request may carry (it asked for 2**31 and the API refuses it)."""

from __future__ import annotations

import httpx
from api_support import make_run, wait_for

from app.core.config import MAX_POLICY_VERSION


def test_the_newest_version_ends_the_run_with_its_reason(api: httpx.Client) -> None:
    run = api.post("/api/runs", json=make_run(batches=None)).json()["id"]  # the API's trainer: us
    batch = api.get(f"/api/runs/{run}/batches/next", params={"timeout": 120}).json()
    assert batch["publish_version"] == 1
    published = api.post(f"/api/runs/{run}/weights", json={"version": MAX_POLICY_VERSION, "sentinel": True})
    assert published.status_code == 202, published.text
    assert api.post(f"/api/runs/{run}/batches/{batch['batch_id']}/ack").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run}").json()["state"] == "failed", what="the run to end")
    record = api.get(f"/api/runs/{run}").json()
    assert f"policy version {MAX_POLICY_VERSION} is the newest a run takes" in record["error"]
    # a trainer asking for its next batch hears how it ended, in the words its other commands use (its
    # batch endpoint said "has ended (error)", and "(failed)" once the server had restarted)
    ended = api.get(f"/api/runs/{run}/batches/next", params={"timeout": 1})
    assert ended.status_code == 409, ended.text
    assert ended.json()["detail"] == f"run {run!r} has ended (failed); no more batches"
    paused = api.post(f"/api/runs/{run}/pause")
    assert paused.status_code == 409, paused.text
    assert f"run {run!r} has ended (failed)" in paused.json()["detail"]
    # and beyond it, nothing is taken
    over = api.post(f"/api/runs/{run}/weights", json={"version": MAX_POLICY_VERSION + 1, "sentinel": True})
    assert over.status_code == 422
