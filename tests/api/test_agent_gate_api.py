"""The agent-phase gate (app.runtime.gate) through the API: set at launch (`agent_gate`, 0: none), changed
live (`PATCH .../policy`, 0: open) on a run that has one, refused on a run that has none; on SQLite and
Postgres."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from api_support import TOKEN, make_run, make_settings, serving, wait_for
from fastapi import FastAPI

from app.api.app import create_app
from app.client import CorralClient
from app.runtime.gate import AgentGate


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, backend_url: str) -> Iterator[tuple[FastAPI, str]]:
    """The served app, so that a test can look at a run's runtime."""
    settings = make_settings(tmp_path_factory.mktemp("serve"), backend_url, max_runs=1000)
    served = create_app(settings)
    with serving(settings, served) as url:
        yield served, url


@pytest.fixture(scope="module")
def server(app: tuple[FastAPI, str]) -> str:  # the `api` fixture's server: this module's app
    return app[1]


def gate_of(app: tuple[FastAPI, str], run_id: str) -> AgentGate | None:
    handle = app[0].state.manager.get(run_id)
    assert handle is not None
    assert handle.runtime is not None
    return handle.runtime.gate


@pytest.fixture(scope="module")
def gated_run(server: str) -> Iterator[str]:
    """One running run of policy full (a gate of factor 1) for the module's refused changes."""
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
        run_id = running(api)
        yield run_id
        api.post(f"/api/runs/{run_id}/stop")


def running(api: httpx.Client, **spec: Any) -> str:
    answer = api.post("/api/runs", json=make_run(batches=None, **spec))
    assert answer.status_code == 201, answer.text
    run_id = str(answer.json()["id"])
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    return run_id


def test_a_run_launched_with_an_agent_gate_runs_with_it(api: httpx.Client, app: tuple[FastAPI, str]) -> None:
    run_id = running(api, agent_gate=2.5)
    got = api.get(f"/api/runs/{run_id}").json()
    assert got["config"]["agent_gate"] == 2.5
    assert got["policy"]["agent_gate"] == 2.5
    gate = gate_of(app, run_id)
    assert gate is not None
    assert gate.factor == 2.5
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200

    off = running(api, agent_gate=0)  # 0: no gate, on full too
    assert api.get(f"/api/runs/{off}").json()["policy"]["agent_gate"] is None
    assert gate_of(app, off) is None
    assert api.post(f"/api/runs/{off}/stop").status_code == 200


def test_the_gate_opens_and_closes_live_and_each_change_is_an_event(
    api: httpx.Client, app: tuple[FastAPI, str]
) -> None:
    run_id = running(api)  # full: a gate of factor 1
    gate = gate_of(app, run_id)
    assert gate is not None
    assert gate.factor == 1.0
    opened = api.patch(f"/api/runs/{run_id}/policy", json={"agent_gate": 0})
    assert opened.status_code == 200, opened.text
    assert opened.json()["policy"]["agent_gate"] == 0
    assert gate.factor == 0  # open: nobody waits
    with CorralClient(app[1], token=TOKEN) as corral:
        assert corral.set_policy(run_id, agent_gate=3)["policy"]["agent_gate"] == 3
    assert gate.factor == 3
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["agent_gate"] == 3  # stored
    events = api.get(f"/api/runs/{run_id}/timeline", params={"limit": 10_000}).json()["events"]
    changes = [(e["field"], e["old"], e["new"]) for e in events if e["kind"] == "policy_changed"]
    assert changes == [("agent_gate", 1.0, 0.0), ("agent_gate", 0.0, 3.0)]
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
    # the ended run's, from the store
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["agent_gate"] == 3


@pytest.mark.parametrize("spec", [{"policy": "sync"}, {"agent_gate": 0}], ids=["sync", "launched without"])
def test_a_run_without_a_gate_refuses_a_live_change_of_it(api: httpx.Client, spec: dict[str, Any]) -> None:
    run_id = running(api, **spec)
    refused = api.patch(f"/api/runs/{run_id}/policy", json={"agent_gate": 1})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"] == (
        f"agent_gate: run {run_id} has no agent-phase gate (it started without one, or its lanes are "
        "Celery's); set agent_gate when launching"
    )
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["agent_gate"] is None
    assert api.patch(f"/api/runs/{run_id}/policy", json={"max_staleness": 3}).status_code == 200
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


@pytest.mark.parametrize(
    "content",
    [
        '{"agent_gate": -1}',
        '{"agent_gate": 1e9}',
        '{"agent_gate": 1000.5}',
        '{"agent_gate": "abc"}',
        '{"agent_gate": "2"}',
        '{"agent_gate": true}',
        '{"agent_gate": NaN}',  # Python's JSON parser takes these tokens: refused as numbers
        '{"agent_gate": Infinity}',
        '{"agent_gate": -Infinity}',
    ],
)
def test_a_bad_agent_gate_is_a_422_naming_it_at_launch_and_live(
    api: httpx.Client, gated_run: str, content: str
) -> None:
    headers = {"Content-Type": "application/json"}
    created = api.post("/api/runs", content=content, headers=headers)
    assert created.status_code == 422, created.text
    assert created.json()["detail"].startswith("agent_gate"), created.text
    patched = api.patch(f"/api/runs/{gated_run}/policy", content=content, headers=headers)
    assert patched.status_code == 422, patched.text
    assert patched.json()["detail"].startswith("agent_gate"), patched.text
    assert api.get(f"/api/runs/{gated_run}").json()["policy"]["agent_gate"] == 1.0
