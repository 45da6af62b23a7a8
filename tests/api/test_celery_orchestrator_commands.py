"""An operator's commands reach a run that a `corral worker --orchestrator` drives, through the API and the
dashboard of a `corral serve` that does not execute it, and answer as they do for a run executing in
that server: the same statuses, the same bodies, the same refusal words. Before, pause, resume, policy,
weights and engine commands of such a run were all a 409 "not executing in this server", and the
dashboard's controls said the same. Real processes on the real Redis, in a database of their own (the
`orchestrator` queue's name is fixed: no other test's worker may take the run)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from api_support import TOKEN, make_settings, orchestrator_worker, serving, twin_runs, wait_for, worker_env
from factories import redis_answers

from app.service.channel import commands_key, reply_key
from app.service.runner import NOT_CARRIED_OUT

REDIS_URL = "redis://127.0.0.1:6379/9"


def test_commands_reach_a_celery_run_and_answer_as_for_a_run_executing_here(tmp_path: Path) -> None:
    if not redis_answers():
        pytest.skip("no Redis answering on 127.0.0.1:6379")
    broker = redis.Redis.from_url(REDIS_URL)
    broker.flushdb()  # nothing left of an earlier run of this test for the worker to take
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    worker_log = f"; log {tmp_path / 'worker.log'}"
    settings = make_settings(tmp_path, db, broker_url=REDIS_URL, command_timeout_s=60.0)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with (
            orchestrator_worker(worker_env(tmp_path, db, REDIS_URL), tmp_path / "worker.log"),
            serving(settings) as url,
            httpx.Client(base_url=url, headers=auth, timeout=90) as api,
        ):
            here, remote = twin_runs(api, tmp_path / "worker.log")
            assert api.get(f"/api/runs/{remote}").json()["live"] is None  # not executing in this server

            ids: dict[str, list[str | None]] = {here: [], remote: []}
            said = {
                run_id: [_answer(api, run_id, *ask, ids[run_id]) for ask in ASKS] for run_id in (here, remote)
            }
            for ask, at_here, at_remote in zip(ASKS, said[here], said[remote], strict=True):
                assert at_remote == at_here, f"{ask}: {at_remote} (celery) != {at_here} (in-process)"
            statuses = [answer[0] for answer in said[remote]]
            assert statuses == [200, 422, 200, 409, 200, 200, 409, 202, 422, 422, 200, 200, 200, 409, 404]
            assert said[remote][0][1]["policy"]["max_staleness"] == 3
            assert said[remote][2][1] == {"id": "mine", "state": "paused", "actor": "operator"}
            assert said[remote][7][2] == 1000  # the rollout's version
            # Each command carried out answers its id; a celery run's is its command channel's, the id
            # its kept outcome is found by
            assert [i is not None for i in ids[remote]] == [s < 300 for s in statuses]
            kept_policy = api.get(f"/api/runs/{remote}/commands/{ids[remote][0]}").json()
            assert (kept_policy["state"], kept_policy["body"]["command_id"]) == ("answered", ids[remote][0])
            stored = api.get(f"/api/runs/{remote}").json()["policy"]
            assert (stored["max_staleness"], stored["surplus_groups"], stored["max_updating_engines"]) == (
                3,
                2,
                2,
            )

            # A command whose sender stopped waiting is not carried out, ever
            ghost = {"id": "ghost", "op": "pause", "args": {}, "actor": "ghost", "deadline": time.time() - 1}
            broker.rpush(commands_key(remote), json.dumps(ghost))

            # The dashboard's controls, on the celery run's page
            page = api.get(f"/runs/{remote}")
            assert "Stop the run after this step" in page.text
            assert 'id="policy-form"' in page.text
            assert 'id="publish-btn"' in page.text
            token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
            assert token is not None
            form = {"csrf_token": token.group(1)}
            htmx = {"HX-Request": "true"}
            policy = api.post(f"/runs/{remote}/policy", data={**form, "surplus_groups": "3"}, headers=htmx)
            assert policy.status_code == 200, policy.text
            assert "Applied S = 3." in policy.text
            assert api.get(f"/api/runs/{remote}").json()["policy"]["surplus_groups"] == 3
            assert broker.exists(reply_key("ghost")) == 0
            kept = api.get(f"/api/runs/{remote}/commands/ghost").json()  # the worker says why
            assert (kept["op"], kept["actor"], kept["state"], kept["status"]) == (
                "pause",
                "ghost",
                "not carried out",
                None,
            )
            assert kept["detail"] == NOT_CARRIED_OUT
            assert api.get(f"/api/runs/{remote}").json()["state"] == "running"  # the ghost's pause: not done
            publish = api.post(f"/runs/{remote}/publish", data=form, headers=htmx)
            assert publish.status_code == 200, publish.text
            assert "Publishing new weights" in publish.text
            drained = api.post(f"/runs/{remote}/engines/engine-0/drain", data=form, headers=htmx)
            assert drained.status_code == 200, drained.text
            assert "engine-0 is out of rotation" in drained.text
            paused = api.post(f"/runs/{remote}/pause", data=form, headers=htmx)
            assert paused.status_code == 200, paused.text
            again = api.post(f"/runs/{remote}/pause", data=form, headers=htmx)
            assert again.status_code == 409, again.text
            assert f"refused: run {remote} is paused; this needs it running" in again.text
            assert api.post(f"/runs/{remote}/resume", data=form, headers=htmx).status_code == 200
            stop = api.post(f"/runs/{remote}/stop", data=form, headers=htmx)
            assert stop.status_code == 200, stop.text
            wait_for(
                lambda: api.get(f"/api/runs/{remote}").json()["state"] == "stopped",
                60,
                what=f"the worker to stop the run{worker_log}",
            )
            ended = api.post(f"/api/runs/{remote}/pause")
            assert ended.status_code == 409, ended.text
            assert ended.json()["detail"] == f"run {remote!r} has ended (stopped)"
            assert api.post(f"/api/runs/{here}/stop").status_code == 200
    finally:
        broker.flushdb()
        broker.close()


# Each command, and its answer made comparable between two runs: the run's id as "mine", and of an
# answer that carries the run's progress (an engine's version, a rollout's times) only what both share
ASKS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("PATCH", "/policy", {"max_staleness": 3, "surplus_groups": 2}),
    ("PATCH", "/policy", {"surplus_groups": 10**6}),  # past the simulator's bound: 422
    ("POST", "/pause", None),
    ("POST", "/pause", None),  # paused already: 409
    ("PATCH", "/policy", {"max_updating_engines": 2}),  # paused runs take policy changes
    ("POST", "/resume", None),
    ("POST", "/resume", None),  # running already: 409
    ("POST", "/weights", {"version": 1000, "sentinel": True}),
    ("POST", "/weights", {"version": 5, "sentinel": True}),  # not newer: 422
    ("POST", "/weights", {"version": 1001, "path": "/no/such/dir"}),  # 422
    ("POST", "/engines/engine-1/drain", None),
    ("POST", "/engines/engine-1/drain", None),  # drained already: the same view
    ("POST", "/engines/engine-1/serve", None),
    ("POST", "/engines/engine-1/serve", None),  # not drained: 409
    ("POST", "/engines/nope/drain", None),  # 404
]


def _answer(
    api: httpx.Client, run_id: str, method: str, path: str, body: dict[str, Any] | None, ids: list[str | None]
) -> Any:
    """The answer made comparable; its command's id (each is new) goes to `ids`."""
    answer = api.request(method, f"/api/runs/{run_id}{path}", json=body)
    text = answer.text.replace(run_id, "mine")
    data = json.loads(text)
    ids.append(data.pop("command_id", None))
    assert ids[-1] is None or re.fullmatch("[0-9a-f]{32}", ids[-1]), ids[-1]
    if path == "/weights" and answer.status_code == 202:
        assert answer.headers["Location"] == f"/api/runs/{run_id}/rollouts/{data['version']}"
        return answer.status_code, sorted(data), data["version"]
    if "/engines/" in path and answer.status_code == 200:
        return answer.status_code, sorted(data), data["engine"]  # its state: updating, or draining
    return answer.status_code, data
