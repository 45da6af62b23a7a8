"""`corral serve` with `CORRAL_RUNS_ON_SHUTDOWN=resume`, stopped cleanly (Ctrl-C to its process group) in
the middle of a run and started again, as a `systemctl restart` or a new release would: the run is not
ended but left to the next start, with every event it published stored, and the next start resumes it.
With the default (`stop`) the same Ctrl-C ends the run `stopped`, for good."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_support import POSTGRES_URL, TOKEN, free_port, make_run, serve_env, serve_process, wait_for
from db_relay import relayed_database
from test_serve_restart import _healthy

from app.service.store import ServiceStore


def live_batches(api: httpx.Client, run_id: str) -> int:
    return int(api.get(f"/api/runs/{run_id}").json()["live"]["batches"])


def test_a_restart_with_runs_on_shutdown_resume_keeps_the_run_and_loses_no_event(
    tmp_path: Path, backend_url: str
) -> None:
    env = {**serve_env(tmp_path, backend_url, free_port()), "CORRAL_RUNS_ON_SHUTDOWN": "resume"}
    log = tmp_path / "serve.log"
    spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.05, speed=8.0)
    with serve_process(env, log) as api:
        run_id = api.post("/api/runs", json=spec).json()["id"]
        wait_for(lambda: live_batches(api, run_id) >= 3, 120, what="3 batches")
    text = log.read_text()
    assert "its runs are left to the next start, which resumes them" in text
    said = re.search(
        rf"run {run_id}: left to the next start, which resumes it \(its (\d+) events stored\)", text
    )
    assert said is not None, text[-3000:]
    assert f"run {run_id} (test-run): running (not stopped: resumed at the next start)" in text
    store = ServiceStore(backend_url, migrate=False)
    try:
        record = store.get_run(run_id)
        assert record is not None
        assert record.state == "running"  # not ended: the next start resumes it
        ledger, _ = store.ledger(run_id)
        assert ledger.gaps == 0
        kinds = [e["kind"] for e in store.timeline(run_id, -1, 1_000_000)]
        assert len(kinds) == int(said.group(1))  # every event it published is stored
        assert "run_ended" not in kinds
        before = kinds.count("batch_delivered")
        assert before >= 3

        with serve_process(env, log) as api:
            assert api.get(f"/api/runs/{run_id}").json()["state"] == "running"
            wait_for(lambda: live_batches(api, run_id) >= before + 2, 120, what="2 more batches, resumed")
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 120, what="stop")
        ledger, _ = store.ledger(run_id)
        assert ledger.gaps == 0  # the resumed stream goes on where the stored one ended
        assert not ledger.ended_twice
        assert not ledger.open_groups  # every admitted group ended: delivered or discarded
        assert ledger.lost == 0
        kinds = [e["kind"] for e in store.timeline(run_id, -1, 1_000_000)]
        assert kinds.count("run_started") == 2
        assert kinds.count("run_ended") == 1
        assert kinds.count("batch_delivered") >= before + 2
    finally:
        store.close()
    assert "Traceback" not in log.read_text()


def test_by_default_a_clean_stop_of_the_server_ends_its_runs(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    env = serve_env(tmp_path, database, free_port())
    log = tmp_path / "serve.log"
    with serve_process(env, log) as api:
        run_id = api.post("/api/runs", json=make_run(batches=None, speed=8.0)).json()["id"]
        wait_for(lambda: live_batches(api, run_id) >= 1, 120, what="a batch")
    store = ServiceStore(database, migrate=False)
    try:
        record = store.get_run(run_id)
        assert record is not None
        assert record.state == "stopped"
    finally:
        store.close()
    assert "Ctrl-C stops the server and the runs it executes" in log.read_text()


@pytest.mark.parametrize("on_shutdown", ["resume", "stop"])
def test_a_second_ctrl_c_with_the_database_away_exits_and_loses_no_event(
    tmp_path: Path, on_shutdown: str
) -> None:
    """Postgres cut away (a relay dropped) just before Ctrl-C: the server leaves the run to the next
    start (`resume`) or stops it (`stop`) while its last events cannot reach the database, and a second
    Ctrl-C ends the waits. It must exit at once, and every event the run published must be kept: stored,
    or in its spill on disk for the next start to store before it resumes the run (or finds it ended)."""
    port = free_port()
    log = tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    try:
        with relayed_database(POSTGRES_URL, tmp_path) as db:
            env = {
                **serve_env(tmp_path, db.relayed_url, port),
                "CORRAL_RUNS_ON_SHUTDOWN": on_shutdown,
                "CORRAL_STORE_OUTAGE_S": "60",  # the first Ctrl-C alone would wait the database out
            }
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-c", "from app.cli import main; main()", "serve"], env=env,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            try:
                wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log {log}")
                spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.05, speed=8.0)
                run_id = api.post("/api/runs", json=spec).json()["id"]
                wait_for(lambda: live_batches(api, run_id) >= 2, 120, what="2 batches")
                db.relay.cut()
                os.killpg(proc.pid, signal.SIGINT)
                wait_for(lambda: "corral serve: stopping:" in log.read_text(), 30, what="stopping")
                time.sleep(2)  # the waits are under way, the database still away
                assert proc.poll() is None, log.read_text()[-3000:]
                second = time.monotonic()
                os.killpg(proc.pid, signal.SIGINT)
                code = proc.wait(30)
                took = time.monotonic() - second
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            text = log.read_text()
            assert code == 0, text[-3000:]
            assert took < 15, f"{took:.1f} s after the second Ctrl-C; log:\n{text[-3000:]}"
            assert "Traceback" not in text, text[-5000:]
            said = re.search(
                rf"run {run_id}: left (?:to the next start|as the store has it)\S* .*?\(its (\d+) ", text
            )
            assert said is not None, text[-3000:]
            published = int(said.group(1))
            assert "neither stored nor kept" not in text

            db.relay.restore()
            store = ServiceStore(db.url, migrate=False)
            try:
                with serve_process(env, log) as again:
                    if again.get(f"/api/runs/{run_id}").json()["state"] == "running":
                        assert again.post(f"/api/runs/{run_id}/stop").status_code == 200
                    state = lambda: again.get(f"/api/runs/{run_id}").json()["state"]  # noqa: E731
                    wait_for(lambda: state() == "stopped", 120, what="stop")
                ledger, _ = store.ledger(run_id)
                assert ledger.gaps == 0
                assert not ledger.ended_twice
                assert ledger.lost == 0
                events = store.timeline(run_id, -1, 1_000_000)
                kinds = [e["kind"] for e in events]
                assert kinds.count("run_ended") == 1
                # Every event the first server published is stored: the first life's stream runs to
                # the count its log gave, before the next start's run_started (if it resumed the run)
                starts = [e["seq"] for e in events if e["kind"] == "run_started"]
                first_life = [e["seq"] for e in events if len(starts) < 2 or e["seq"] < starts[1]]
                assert len(first_life) >= published > 0, (len(first_life), published)
            finally:
                store.close()
    finally:
        api.close()
