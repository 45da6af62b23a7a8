"""A restarted `corral serve` replaying the stored stream of a run it resumes does not call the celery
runs "being resumed": their orchestrator workers drive them, and the server never resumes them. They
were listed under `/healthz`'s `resuming` and shown `"resuming": true` (the dashboard hid their
controls) until the replay of the other runs was done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from api_support import TOKEN, free_port, make_run, serve_env, wait_for
from test_serve_restart import corral_serve

from app.core.events import Envelope, Event, GroupAdmitted, GroupDiscarded, RunStarted
from app.service.store import ServiceStore
from app.store.models import RunState

GROUPS = 40_000  # a stream long enough that its replay takes seconds


def _health(url: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=2)
    except httpx.TransportError:
        return None
    body: dict[str, Any] = answer.json()
    return body


def test_celery_runs_are_not_listed_as_resuming_while_other_runs_replay(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    log = tmp_path / "serve.log"
    store = ServiceStore(database)
    try:
        # A run this server drove when it was killed, with a long stored stream; then (runs are resumed
        # in id order) a celery run, which its orchestrator worker drives on
        store.create_run("a-local-1", "local", make_run(batches=None), {})
        events: list[Event] = [RunStarted(engines=("e0",))]
        for group in range(GROUPS):
            events += [GroupAdmitted(group, group, 2), GroupDiscarded(group, "cancelled")]
        sink = store.event_sink()
        for start in range(0, len(events), 5_000):
            sink.write_batch(
                [
                    Envelope("a-local-1", start + i, 1.0, ev)
                    for i, ev in enumerate(events[start : start + 5_000])
                ]
            )
        store.set_state("a-local-1", RunState.RUNNING)
        store.create_run("z-celery-1", "celery", make_run(batches=None, orchestrator="celery"), {})
        store.set_state("z-celery-1", RunState.RUNNING)
    finally:
        store.close()

    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    try:
        with corral_serve(serve_env(tmp_path, database, port), log):
            health = wait_for(lambda: _health(url), 120, what=f"corral serve to start; log: {log}")
            assert health["resuming"] == ["a-local-1"]  # replaying its stream; the celery run never
            celery = api.get("/api/runs/z-celery-1").json()
            assert "resuming" not in celery, celery
            listed = {r["id"]: r for r in api.get("/api/runs").json()}
            assert "resuming" not in listed["z-celery-1"]
            assert listed["a-local-1"]["resuming"] is True
            wait_for(lambda: (_health(url) or {}).get("resuming") == [], 120, what="the resume done")
            api.post("/api/runs/a-local-1/stop")
    finally:
        api.close()
