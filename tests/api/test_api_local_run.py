"""A local run through the API: the embedded default (embedded engine processes, local sandboxes in
pinned lanes, a built-in task) driven by the service, fed to the client, and every engine process
stopped when the run ends."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from api_support import wait_for
from factories import make_local_config

from app.client import CorralClient


@pytest.mark.slow
def test_a_local_run_delivers_batches_to_an_external_trainer(server: str, backend_url: str) -> None:
    if backend_url.startswith("postgresql"):
        pytest.skip("one backend is enough for the real engines; the API is the same")
    with CorralClient(server, token="test-operator-token", timeout_s=30) as corral:
        run_id = corral.create_run(name="local", kind="local", config=make_local_config(), batches=2)["id"]
        for step in range(2):
            batch = corral.next_batch(run_id, timeout=240)
            assert batch is not None
            assert batch.index == step
            turns = [t for g in batch.groups for tr in g["trajectories"] for t in tr["turns"]]
            assert turns
            assert all("weight_version" in t for t in turns)
            rollout = corral.publish(run_id, batch.publish_version, sentinel=True)
            assert [e["engine"] for e in rollout["engines"]] == ["engine-0"]
            corral.ack(run_id, batch.batch_id)
            if step == 0:
                # A local run's config takes S up to 4,096; a live change took up to 100,000 (100,061
                # groups admitted, both engines down, the event sink full, the server would not stop).
                refused = httpx.patch(
                    f"{server}/api/runs/{run_id}/policy",
                    json={"surplus_groups": 100_000},
                    headers={"Authorization": "Bearer test-operator-token"},
                    timeout=30,
                )
                assert refused.status_code == 422, refused.text
                assert (
                    refused.json()["detail"] == "surplus_groups: a local run takes S up to 4,096, got 100,000"
                )
                assert corral.run(run_id)["policy"]["surplus_groups"] == 1
            if step == 0:  # the engines hold their turns while paused, and take them up again
                assert corral.pause(run_id)["state"] == "paused"
                assert corral.run(run_id)["state"] == "paused"
                assert corral.resume(run_id)["state"] == "running"
        wait_for(lambda: corral.run(run_id)["state"] == "completed", 120, what="the run to complete")
        health = httpx.get(f"{server}/healthz", timeout=10).json()
        assert run_id not in health["engines"]  # ended: its engines are gone, not reported
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _embedded_engines_of(os.getpid()):
        time.sleep(0.2)
    assert not _embedded_engines_of(os.getpid())


def _embedded_engines_of(parent: int) -> list[int]:
    """Embedded engine processes whose parent is this test process (the server runs in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == parent and b"app.engines.embedded" in cmd:
            found.append(int(entry))
    return found


@pytest.mark.slow
def test_a_sentinel_publication_to_engines_of_real_weights_is_refused_up_front(
    server: str, backend_url: str
) -> None:
    """Engines of real weights (engines.sentinel: false) refuse every sentinel checkpoint, one by one,
    until the run stalls K versions behind: the publication is turned away before any is written."""
    if backend_url.startswith("postgresql"):
        pytest.skip("one backend is enough for the real engines; the API is the same")
    config = make_local_config()
    config["engines"] = {**config["engines"], "sentinel": False}  # type: ignore[dict-item]
    auth = {"Authorization": "Bearer test-operator-token"}
    with httpx.Client(base_url=server, headers=auth, timeout=30) as api:
        created = api.post("/api/runs", json={"name": "real", "kind": "local", "config": config})
        assert created.status_code == 201, created.text
        run_id = created.json()["id"]
        try:
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", 240, "running")
            refused = api.post(f"/api/runs/{run_id}/weights", json={"version": 1, "sentinel": True})
            assert refused.status_code == 422, refused.text
            detail = refused.json()["detail"]
            assert detail.startswith("sentinel: ")
            assert "config.engines.sentinel: false" in detail
            assert "\n" not in detail
            run = api.get(f"/api/runs/{run_id}").json()
            assert run["live"]["trainer_version"] == 0  # nothing was published
            assert api.get(f"/api/runs/{run_id}/rollouts/1").status_code == 404
        finally:
            api.post(f"/api/runs/{run_id}/stop")
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 120, "stopped")
