"""`corral serve` keeps the handles of only the latest `KEEP_ENDED_HANDLES` runs ended in it: an older
ended run answers from the store. A batch its trainer fetched and never acked before the run ended is
still handed out again, then acked, through the HTTP API, as after a restart."""

from __future__ import annotations

from pathlib import Path

import httpx
from api_support import TOKEN, free_port, make_run, serve_env, wait_for
from test_serve_restart import _healthy, corral_serve

from app.service.manager import KEEP_ENDED_HANDLES


def test_an_ended_run_whose_handle_was_let_go_hands_out_its_unacked_batch_again(tmp_path: Path) -> None:
    port = free_port()
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", port)
    url, log = f"http://127.0.0.1:{port}", tmp_path / "serve.log"
    with (
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as api,
        corral_serve(env, log),
    ):
        wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
        run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
        taken = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        assert api.post(f"/api/runs/{run_id}/stop").status_code == 200  # the trainer never acked it

        def state(run: str) -> str:
            return str(api.get(f"/api/runs/{run}").json()["state"])

        wait_for(lambda: state(run_id) == "stopped", 60, what="the run to stop")
        assert api.get(f"/api/runs/{run_id}").json()["live"] is not None  # its handle, still held
        quick = make_run(speed=1000.0, trainer="sentinel", batches=1)
        for _ in range(KEEP_ENDED_HANDLES):  # as many runs ended after it: its handle is let go
            other = api.post("/api/runs", json=quick).json()["id"]
            wait_for(lambda other=other: state(other) == "completed", 120, what=f"run {other} to complete")
        wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["live"] is None, 30,
                 what="the server to let go of the first run's handle")  # fmt: skip

        again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30})
        assert again.status_code == 200, again.text
        assert (again.json()["batch_id"], again.json()["groups"]) == (taken["batch_id"], taken["groups"])
        assert (taken["delivery"], again.json()["delivery"]) == (1, 2)
        acked = api.post(f"/api/runs/{run_id}/batches/{taken['batch_id']}/ack")
        assert (acked.status_code, acked.json()["already_acked"]) == (200, False), acked.text
        ended = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 5})
        assert ended.status_code == 409, ended.text  # nothing more: the run has ended
        offers = tmp_path / "data" / run_id / "offers" / f"{taken['batch_id']}.json"
        assert not offers.exists()  # the acked batch is not kept for the next start
