"""Deleting a run that ended before a restart of `corral serve`, while a trainer's long-poll is open on
the batch it kept: the poll answers 404 at once, as it does for a run that ended in the same server. It
ran its full timeout and answered 204: the gateway of the ended run's kept batches was never told."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from api_support import make_run, stored_run, wait_for
from test_serve_restart import _healthy, _on_sqlite, corral_serve

POLL_S = 20  # the long-poll's timeout; the 404 comes long before it


def test_deleting_a_run_ended_before_a_restart_ends_a_long_poll_on_its_kept_batch(tmp_path: Path) -> None:
    env, url, log, api = _on_sqlite(tmp_path)
    database = env["CORRAL_DATABASE_URL"]
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            kept = tmp_path / "data" / run_id / "offers" / f"{batch['batch_id']}.json"
            wait_for(kept.exists, what="the unacked offer kept on disk")
            first.send_signal(signal.SIGINT)  # Ctrl-C: the run is stopped, its batch never acked
            assert first.wait(60) in (0, -signal.SIGINT, 130), log.read_text()[-2000:]
        assert stored_run(database, run_id).state == "stopped"

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to restart; log: {log}")
            again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 1})
            assert again.status_code == 200, again.text
            assert again.json()["batch_id"] == batch["batch_id"]  # leased to us now, not acked

            def poll() -> tuple[httpx.Response, float]:
                began = time.monotonic()
                with httpx.Client(base_url=url, timeout=POLL_S + 30) as trainer:
                    answer = trainer.get(f"/api/runs/{run_id}/batches/next", params={"timeout": POLL_S})
                return answer, time.monotonic() - began

            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(poll)
                time.sleep(1.0)  # the poll is open, waiting on the leased batch
                deleted = api.delete(f"/api/runs/{run_id}")
                assert deleted.status_code == 200, deleted.text
                answer, took = waiting.result(POLL_S + 30)
            assert answer.status_code == 404, answer.text
            assert answer.json()["detail"] == f"no run {run_id!r} (deleted)"
            assert took < POLL_S / 2
            assert api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 1}).status_code == 404
    finally:
        api.close()
