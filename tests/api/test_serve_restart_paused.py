"""An operator's pause outlives a crash: a run paused when its `corral serve` (or its orchestrator
worker) was killed with SIGKILL comes back paused after the restart, starting no turn until it is
resumed. It came back `running`, collecting again, as if nobody had paused it."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
from api_support import make_run, stored_run, wait_for
from test_serve_restart import _healthy, _on_sqlite, corral_serve

PAUSED_LOOK_S = 3.0  # how long a paused run is watched for work it should not do


def _live(api: httpx.Client, run_id: str) -> dict[str, Any]:
    view: dict[str, Any] = api.get(f"/api/runs/{run_id}").json()
    return view


def _work(live: dict[str, Any]) -> tuple[int, int]:
    """What a run that starts turns moves: its groups admitted and its batches."""
    return live["groups_admitted"], live["batches"]


def test_a_run_paused_at_a_kill_9_comes_back_paused(tmp_path: Path) -> None:
    env, url, log, api = _on_sqlite(tmp_path)
    database = env["CORRAL_DATABASE_URL"]
    spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.05, speed=8.0)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=spec).json()["id"]
            wait_for(lambda: (_live(api, run_id)["live"] or {}).get("batches", 0) >= 1, 60, "a batch")
            paused = api.post(f"/api/runs/{run_id}/pause")
            assert paused.status_code == 200, paused.text
            wait_for(lambda: stored_run(database, run_id).state == "paused", what="the pause stored")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to restart; log: {log}")
            view = wait_for(lambda: (v := _live(api, run_id))["state"] != "created" and v, 60, "its start")
            assert view["state"] == "paused", view
            before = _work(view["live"])
            time.sleep(PAUSED_LOOK_S)
            view = _live(api, run_id)
            assert view["state"] == "paused"
            assert _work(view["live"]) == before  # no group admitted, no batch collected
            assert stored_run(database, run_id).state == "paused"
            listed = {r["id"]: r["state"] for r in api.get("/api/runs").json()}
            assert listed[run_id] == "paused"

            resumed = api.post(f"/api/runs/{run_id}/resume")
            assert resumed.status_code == 200, resumed.text
            wait_for(lambda: _work(_live(api, run_id)["live"])[1] > before[1], 60, "a batch after the resume")
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
            wait_for(lambda: _live(api, run_id)["state"] == "stopped", 60, "stopped")
    finally:
        api.close()
