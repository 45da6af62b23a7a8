"""A run that a `corral worker --orchestrator` drives, seen and steered through the API of a `corral serve`
that does not execute it, while a command's handler hangs in the worker:
- its metrics come from the worker (live: its lanes, its event sinks), with the keys of a run executing
  in the API server; before, they were a 409 "not executing in this server";
- a command whose handler hangs is a 504 naming the route that keeps its outcome ("taken"); the next
  command, which no one takes while the hung one holds the worker's command line, a 504 whose outcome
  is "not carried out"; the metrics, read on a line of their own, still answer;
- a stop is honoured all the same: the worker carries out commands on a thread of their own
  (`app.service.runner.CommandLine`), so the watcher that looks for the stop goes on. Before, the
  watcher carried them out itself, and a hung handler held the run forever;
- once it ended, its metrics are the store's.
The hang is a fault injected into the real worker's process (its pause and resume never answer), on
the real Redis in a database of its own, on SQLite and on Postgres."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
from api_support import (
    HUNG_ACT,
    TOKEN,
    fresh_redis,
    make_settings,
    orchestrator_worker,
    serving,
    twin_runs,
    wait_for,
    worker_env,
)

from app.client import CorralClient

REDIS_URL = "redis://127.0.0.1:6379/4"
TIMEOUT_S = 3.0


def test_a_stop_is_honoured_while_a_command_hangs_and_metrics_come_from_the_worker(
    tmp_path: Path, backend_url: str
) -> None:
    broker = fresh_redis(REDIS_URL)
    worker_log = tmp_path / "worker.log"
    settings = make_settings(tmp_path, backend_url, broker_url=REDIS_URL, command_timeout_s=TIMEOUT_S)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with (
            orchestrator_worker(worker_env(tmp_path, backend_url, REDIS_URL), worker_log, HUNG_ACT),
            serving(settings) as url,
            httpx.Client(base_url=url, headers=auth, timeout=60) as api,
        ):
            here, remote = twin_runs(api, worker_log)
            wait_for(
                lambda: api.get(f"/api/runs/{remote}").json()["groups"]["admitted"] > 0,
                60,
                what=f"the worker to admit groups; log {worker_log}",
            )
            assert api.get(f"/api/runs/{remote}").json()["live"] is None  # not executing in this server

            local = api.get(f"/api/runs/{here}/metrics").json()
            metrics = api.get(f"/api/runs/{remote}/metrics")
            assert metrics.status_code == 200, metrics.text
            figures = metrics.json()
            assert _keys(figures) == _keys(local)
            assert (figures["id"], figures["state"]) == (remote, "running")
            assert figures["groups_admitted"] > 0
            # what only the run's process holds: the worker's answer, not the store's
            assert set(figures["lanes"]) == {"reset", "exec", "validate", "cleanup"}
            assert figures["event_sinks"] is not None
            assert figures["trainer"]["clock"] == "wall"

            said = f"run {remote!r}'s orchestrator worker took the pause but did not answer within 3 s"
            kept = _unanswered(api, f"/api/runs/{remote}/pause", said)
            assert (kept["op"], kept["state"], kept["status"]) == ("pause", "taken", None)
            with CorralClient(url, token=TOKEN) as corral:  # the client reads it the same
                assert corral.command(remote, kept["id"]) == kept
            # the command line is still on the pause: no one takes the resume
            said = f"no orchestrator worker took the resume for run {remote!r} within 3 s"
            kept = _unanswered(api, f"/api/runs/{remote}/resume", said)
            assert (kept["op"], kept["state"], kept["status"]) == ("resume", "not carried out", None)
            assert api.get(f"/api/runs/{remote}").json()["state"] == "running"  # nothing was paused
            reading = api.get(f"/api/runs/{remote}/metrics")  # reads have a line of their own
            assert reading.status_code == 200, reading.text
            assert reading.json()["state"] == "running"
            assert reading.json()["groups_admitted"] >= figures["groups_admitted"]
            page = api.get(f"/runs/{remote}")  # the dashboard's page reads the store: it waits on no worker
            assert page.status_code == 200, page.text

            stop = api.post(f"/api/runs/{remote}/stop")
            assert stop.status_code == 202, stop.text
            wait_for(
                lambda: api.get(f"/api/runs/{remote}").json()["state"] == "stopped",
                60,
                what=f"the worker to stop the run while a command hangs; log {worker_log}",
            )
            wait_for(
                lambda: (
                    "cancelling pause from operator, still carried out at the run's end"
                    in worker_log.read_text()
                ),
                30,
                what=f"the worker to cancel the hung command at the run's end; log {worker_log}",
            )
            ended = api.get(f"/api/runs/{remote}/metrics")
            assert ended.status_code == 200, ended.text
            assert _keys(ended.json()) == _keys(local)
            assert (ended.json()["state"], ended.json()["lanes"]) == ("stopped", None)  # the store's
            assert api.post(f"/api/runs/{here}/stop").status_code == 200
    finally:
        broker.flushdb()
        broker.close()


def _keys(figures: dict[str, object]) -> tuple[list[str], list[str]]:
    trainer = figures["trainer"]
    assert isinstance(trainer, dict)
    return sorted(figures), sorted(trainer)


def _unanswered(api: httpx.Client, path: str, said: str) -> dict[str, Any]:
    """The outcome kept of the command POSTed to `path`, which the worker does not answer: a 504 that
    says `said` and names the route that keeps the outcome."""
    answer = api.post(path)
    assert answer.status_code == 504, answer.text
    detail = answer.json()["detail"]
    assert said in detail
    named = re.search(r"; its outcome is kept a day: GET (/api/runs/[^/]+/commands/[0-9a-f]{32})$", detail)
    assert named is not None, f"the 504 names no outcome route: {detail}"
    kept = api.get(named.group(1))
    assert kept.status_code == 200, kept.text
    return dict(kept.json())
