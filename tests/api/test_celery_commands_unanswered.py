"""An operator's command to a celery-orchestrated run whose orchestrator worker does not answer, through
the real API on the real Redis (no worker runs here: the run is a stored row in the state a worker
would have left it in). Before, every such command was a 409 "not executing in this server"; now it
goes through the run's command channel (app.service.channel) and, unanswered, ends in words:
- never taken (no worker drives the run): 504, nothing done, and the command is taken back off the
  run's list (no worker carries it out later); its outcome, "not carried out", kept under the route the
  504 names;
- taken and not answered in time: 504, saying it may still be carried out; its outcome "taken" until
  the worker answers (then the worker's answer);
- the run's metrics, unanswered: 504 naming no outcome (a read keeps none), and a queued run's a 409;
- a run still queued: 409 at once, as a run whose engines are starting refuses;
- the result backend down: 503 with Retry-After, and the dashboard says the same words."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
from api_support import TOKEN, free_port, make_run, make_settings, serving

from app.service.channel import RunInbox, commands_key, outcome_key
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.models import RunState

REDIS_URL = "redis://127.0.0.1:6379/8"  # a database of its own: no orchestrator worker consumes it
TIMEOUT_S = 1.0


def stored_celery_run(db: str, state: RunState) -> str:
    """A celery run's row as its worker leaves it (no worker runs: it stays so)."""
    spec = RunCreate.model_validate(make_run(trainer="sentinel", orchestrator="celery"))
    store = ServiceStore(db)
    try:
        run_id = f"r{state.value}"
        store.create_run(run_id, spec.name, spec.stored(), {})
        if state is not RunState.CREATED:
            store.set_state(run_id, state)
    finally:
        store.close()
    return run_id


def kept_route(detail: str, run_id: str) -> str:
    """The id of the command whose outcome route a 504's `detail` names."""
    named = re.search(rf"GET /api/runs/{run_id}/commands/([0-9a-f]{{32}})$", detail)
    assert named is not None, f"the 504 names no outcome route: {detail}"
    return named.group(1)


def assert_outcome(kept: dict[str, Any], command_id: str, run_id: str, op: str, state: str) -> None:
    said = (kept["id"], kept["run_id"], kept["op"], kept["actor"], kept["state"])
    assert said == (command_id, run_id, op, "operator", state), kept


def api_client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)


def test_a_command_no_worker_takes_is_a_504_and_is_taken_back(
    tmp_path: Path, redis_db: Any, backend_url: str
) -> None:
    db = backend_url
    settings = make_settings(tmp_path, db, broker_url=REDIS_URL, command_timeout_s=TIMEOUT_S)
    with serving(settings) as url, api_client(url) as api:
        running = stored_celery_run(db, RunState.RUNNING)
        answer = api.patch(f"/api/runs/{running}/policy", json={"max_staleness": 3})
        assert answer.status_code == 504, answer.text
        command_id = kept_route(answer.json()["detail"], running)
        assert answer.json()["detail"] == (
            f"no orchestrator worker took the policy for run {running!r} within 1 s, so nothing was done: "
            "is the worker driving it alive (GET /healthz, `orchestrator`), and not still busy with an "
            f"earlier command? Try again; its outcome is kept a day: GET /api/runs/{running}/commands/"
            f"{command_id}"
        )
        assert redis_db.llen(commands_key(running)) == 0  # no worker carries it out later
        kept = api.get(f"/api/runs/{running}/commands/{command_id}")
        assert kept.status_code == 200, kept.text
        assert_outcome(kept.json(), command_id, running, "policy", "not carried out")
        assert kept.json()["detail"] == "no worker took it within 1 s; it was taken back"
        assert 86000 < redis_db.ttl(outcome_key(command_id)) <= 86400  # kept a day

        # A worker that takes the command and does not answer (hung on its run's loop, say)
        def take() -> None:
            redis_db.blpop([commands_key(running)], timeout=30)

        taker = threading.Thread(target=take)
        taker.start()
        answer = api.post(f"/api/runs/{running}/pause")
        taker.join()
        assert answer.status_code == 504, answer.text
        command_id = kept_route(answer.json()["detail"], running)
        assert answer.json()["detail"] == (
            f"run {running!r}'s orchestrator worker took the pause but did not answer within 1 s; it may "
            f"still carry it out: see GET /api/runs/{running}; its outcome is kept a day: "
            f"GET /api/runs/{running}/commands/{command_id}"
        )
        kept = api.get(f"/api/runs/{running}/commands/{command_id}")
        assert kept.status_code == 200, kept.text
        assert_outcome(kept.json(), command_id, running, "pause", "taken")
        assert kept.json()["detail"] == "not answered within 1 s; it may still be carried out"
        # The worker answers late: its answer is the outcome, and the API's "taken" never overwrites it
        inbox = RunInbox(redis_db, running)
        inbox.answer({"id": command_id, "op": "pause", "actor": "operator"}, 200, {"state": "paused"})
        kept = api.get(f"/api/runs/{running}/commands/{command_id}").json()
        assert_outcome(kept, command_id, running, "pause", "answered")
        assert (kept["status"], kept["body"], kept["detail"]) == (200, {"state": "paused"}, None)

        # Unknown, another run's, and not an id: 404, 404, 422
        for path, said in (
            (f"/api/runs/{running}/commands/nope", 404),
            (f"/api/runs/other/commands/{command_id}", 404),
            (f"/api/runs/{running}/commands/no%20id", 422),
        ):
            answer = api.get(path)
            assert answer.status_code == said, (path, answer.text)
        assert api.get(f"/api/runs/{running}/commands/nope").json()["detail"] == (
            f"run {running!r} has no command 'nope' kept: the outcome of a command sent to a run's "
            "orchestrator worker is kept a day; reads (metrics), and commands to a run executing in this "
            "server, keep none"
        )

        # Its metrics: asked of the worker, unanswered a 504 that names no outcome (none is kept)
        answer = api.get(f"/api/runs/{running}/metrics")
        assert answer.status_code == 504, answer.text
        assert answer.json()["detail"] == (
            f"no orchestrator worker took the metrics for run {running!r} within 1 s, so nothing was done: "
            "is the worker driving it alive (GET /healthz, `orchestrator`), and not still busy with an "
            "earlier command? Try again"
        )
        assert len(redis_db.keys("corral:command:*")) == 2  # the policy's and the pause's: none for it

        queued = stored_celery_run(db, RunState.CREATED)
        answer = api.post(f"/api/runs/{queued}/weights", json={"version": 2, "sentinel": True})
        assert answer.status_code == 409, answer.text
        assert answer.json()["detail"] == (
            f"run {queued} is created (waiting for an orchestrator worker to take it); this needs it "
            "running or paused"
        )
        assert redis_db.llen(commands_key(queued)) == 0
        answer = api.get(f"/api/runs/{queued}/metrics")
        assert answer.status_code == 409, answer.text
        assert answer.json()["detail"] == (
            f"run {queued} is created (waiting for an orchestrator worker to take it); this needs it taken "
            "by one"
        )

        # The dashboard's controls take the same way, and say the same
        page = api.get(f"/runs/{running}")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert token is not None, "the run page of a running celery run has no form"
        answer = api.post(
            f"/runs/{running}/policy",
            data={"csrf_token": token.group(1), "max_staleness": "4"},
            headers={"HX-Request": "true"},
        )
        assert answer.status_code == 504, answer.text
        assert "no orchestrator worker took the policy" in answer.text
        assert f"its outcome is kept a day: GET /api/runs/{running}/commands/" in answer.text


def test_a_result_backend_that_does_not_answer_is_a_503(tmp_path: Path, redis_db: Any) -> None:
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    settings = make_settings(tmp_path, db, broker_url=REDIS_URL, result_backend=dead, command_timeout_s=5.0)
    with serving(settings) as url, api_client(url) as api:
        running = stored_celery_run(db, RunState.RUNNING)
        for answer in (
            api.post(f"/api/runs/{running}/engines/engine-0/drain"),
            api.post(f"/api/runs/{running}/stop"),
        ):
            assert answer.status_code == 503, answer.text
            assert answer.headers["Retry-After"] == "5"
            detail = json.loads(answer.text)["detail"]
            assert (
                f"could not be sent to run {running!r}'s orchestrator worker: the result backend " in detail
            )
            assert detail.endswith("try again in a few seconds")


def test_a_server_without_a_broker_says_it_cannot_reach_the_worker(tmp_path: Path) -> None:
    # A `corral serve` started without CORRAL_BROKER_URL on the database of a celery run: its stop was a
    # 500 (the broker's URL missing), its other commands "not executing in this server".
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    with serving(make_settings(tmp_path, db)) as url, api_client(url) as api:
        running = stored_celery_run(db, RunState.RUNNING)
        said = (
            f"run {running!r} is driven by an orchestrator worker, and this server has no broker to reach "
            "it: set CORRAL_BROKER_URL (and CORRAL_RESULT_BACKEND) as the worker has them"
        )
        for answer in (api.post(f"/api/runs/{running}/stop"), api.post(f"/api/runs/{running}/resume")):
            assert answer.status_code == 409, answer.text
            assert answer.json()["detail"] == said
