"""`corral serve` with `CORRAL_RESUME_RUNS=false` after a kill -9: the runs the crash left unfinished
are not resumed, and an operator can still stop them (ended `stopped` in the store, their open groups
discarded `orphaned`) and then delete them. A run left `stopping` could be neither stopped (409 "not
executing in this server", where a stop of a stopping run answers 200 `already_stopped`) nor deleted
(409 "is stopping"); one left `running`, the same."""

from __future__ import annotations

import signal
from pathlib import Path

from api_support import make_run, stored_run, wait_for
from test_serve_restart import _healthy, _on_sqlite, corral_serve

from app.service.store import ServiceStore
from app.store.models import RunState


def test_runs_a_crash_left_unfinished_and_not_resumed_can_be_stopped_and_deleted(tmp_path: Path) -> None:
    env, url, log, api = _on_sqlite(tmp_path)
    database = env["CORRAL_DATABASE_URL"]
    store = ServiceStore(database, migrate=False)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            spec = make_run(batches=None, speed=8.0)
            stopping, running = (api.post("/api/runs", json=spec).json()["id"] for _ in range(2))
            for run_id in (stopping, running):
                wait_for(lambda run_id=run_id: store.resume_point(run_id).open_groups, 60, "groups stored")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        # The crash came as one of them was stopping (a stop's last steps take seconds, not an instant)
        store.set_state(stopping, RunState.STOPPING)

        with corral_serve({**env, "CORRAL_RESUME_RUNS": "false"}, log):
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to restart; log: {log}")
            assert api.get(f"/api/runs/{stopping}").json()["state"] == "stopping"
            refused = api.delete(f"/api/runs/{stopping}")
            assert refused.status_code == 409, refused.text  # not ended: stop it first

            stop = api.post(f"/api/runs/{stopping}/stop")
            assert stop.status_code == 200, stop.text
            assert (stop.json()["state"], stop.json()["already_stopped"]) == ("stopped", True)
            stop = api.post(f"/api/runs/{running}/stop")
            assert stop.status_code == 200, stop.text
            assert (stop.json()["state"], stop.json()["already_stopped"]) == ("stopped", False)
            again = api.post(f"/api/runs/{running}/stop")
            assert (again.status_code, again.json()["already_stopped"]) == (200, True)
            for run_id in (stopping, running):
                assert stored_run(database, run_id).state == "stopped"
                ledger, _ = store.ledger(run_id)
                assert not ledger.open_groups  # those in flight at the crash: discarded, `orphaned`
                assert ledger.lost == 0
                paused = api.post(f"/api/runs/{run_id}/pause")
                assert paused.status_code == 409, paused.text
                assert "has ended (stopped)" in paused.json()["detail"]
                deleted = api.delete(f"/api/runs/{run_id}")
                assert deleted.status_code == 200, deleted.text
                assert api.get(f"/api/runs/{run_id}").status_code == 404
    finally:
        store.close()
        api.close()
