"""Bad input gets a clear 4xx naming the problem, never a 500: table-driven, on SQLite and Postgres."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import TOKEN, make_run, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api.body_limit import limit_for
from app.client import CorralClient
from app.service.recorder import RunRecorder
from app.service.schemas import small_workload
from app.validation import MAX_DOCUMENT_BYTES, human_bytes
from app.web.backend import MAX_REPORT_BYTES

CREATE_CASES = [
    ({"bogus": 1}, "bogus: unknown field"),
    ({"surplus_groups": -1}, "surplus_groups"),
    ({"max_staleness": -2}, "max_staleness"),
    ({"max_staleness": "3"}, "max_staleness"),
    ({"groups_per_batch": 0}, "groups_per_batch"),
    ({"batches": 0}, "batches"),
    ({"speed": 0}, "speed"),
    ({"speed": 1e-9}, "speed"),  # a stop would take years of wall time
    ({"speed": 1e9}, "speed"),
    ({"speed": "2"}, "speed"),  # strict: a JSON number, not a string of one
    ({"speed": True}, "speed"),
    ({"sentinel_step_s": "0.5"}, "sentinel_step_s"),
    ({"kind": "gpu-cluster"}, "kind"),
    ({"policy": "fastest"}, "policy"),
    ({"workload": "not a mapping"}, "workload"),
    ({"workload": {"batch": {"groups": 0}}}, "workload.batch.groups"),
    ({"workload": {"batch": {"group_size": 1}}}, "workload.batch.group_size"),
    ({"workload": {"engines": {"count": 2, "slots": 4, "bogus": 1}}}, "workload.engines.bogus"),
    ({"workload": {"trace": {"path": "/etc/passwd"}}}, "trace"),
    ({"kind": "local", "workload": {}}, "workload: for kind 'sim' only"),
    ({"config": {"batch": {"groups": 1}}}, "config: for kind 'local' only"),
    ({"kind": "local", "config": {"engines": {"count": 0}}}, "config.engines.count"),
    ({"workload": {"engines": {"count": 10**9}}}, "workload.engines.count"),
    ({"workload": {"batch": {"groups": 10**9}}}, "workload.batch.groups"),
    ({"workload": {"trajectory": {"llm_s": 1e300}}}, "workload.trajectory.llm_s"),
    # virtual time never moved on: the run spun a core, and its stop never took effect
    ({"workload": {"lanes": {"adaptive": {"interval_s": 1e-300}}}}, "workload.lanes.adaptive.interval_s"),
    ({"kind": "local", "config": {"engines": {"count": 100_000}}}, "config.engines.count"),
    ({"kind": "local", "config": {"engines": {"cpus": [4096]}}}, "config"),
    # a suite directory of the server's: the run failed and its error listed the directory's entries
    (
        {"kind": "local", "config": {"tasks": {"suite": "/etc"}}},
        "config.tasks.suite: a run created through the API cannot read or write server files",
    ),
    ({"kind": "local", "config": {"sandbox": {"base_dir": "/etc"}}}, "config.sandbox.base_dir"),
    # refused at creation, not a run that fails once started
    (
        {"kind": "local", "config": {"tasks": {"include": ["count-primes", "no-such-task"]}}},
        "config.tasks.include: unknown tasks ['no-such-task']; the built-in suite has",
    ),
    # every version the sentinel trainer publishes would be refused, until the run stalled
    (
        {"kind": "local", "trainer": "sentinel", "config": {"engines": {"sentinel": False}}},
        "config.engines.sentinel: false loads real weights, but trainer 'sentinel'",
    ),
    # (B + S) × G past the simulator's bound through the overrides: the server hung building millions
    ({"groups_per_batch": 4096, "group_size": 1024}, "(B + S) × G = (4096 + 2) × 1024"),
    ({"surplus_groups": 100_000, "group_size": 1024}, "trajectories in flight"),
    # the sync rung has no surplus: the run started with S = 0 whatever was asked (the dashboard refused it)
    (
        {"policy": "sync", "surplus_groups": 3},
        "surplus_groups: policy sync runs without surplus (S = 0), got 3",
    ),
    # a local run's config takes S up to 4,096; the override took up to 100,000
    (
        {"kind": "local", "surplus_groups": 100_000},
        "surplus_groups: a local run takes S up to 4,096, got 100,000",
    ),
    ({"name": ""}, "name"),
    ({"name": "x" * 500}, "name"),
]


@pytest.mark.parametrize(("body", "names"), CREATE_CASES)
def test_bad_run_configs_are_422_naming_the_field(
    api: httpx.Client, body: dict[str, Any], names: str
) -> None:
    answer = api.post("/api/runs", json=make_run(**body) if "kind" not in body else body)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert names in detail
    assert "\n" not in detail
    # a check across fields names its field, in our words: it said "body: Value error, surplus_groups: ..."
    assert "Value error" not in detail
    assert not detail.startswith("body:") or names.startswith("body")
    assert all(e["field"] != "body" for e in answer.json()["errors"]), answer.json()["errors"]


@pytest.mark.parametrize(
    ("content", "names"),
    [
        ("{", "JSON"),
        ('{"speed": 2', "body: not valid JSON at character 11"),  # the offset, not a field named "11"
        ('{"speed": NaN}', "speed"),
        ('{"speed": Infinity}', "speed"),
        ("[1, 2]", "body"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was FastAPI's 400, "error parsing"
        ('{"workload": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        (b'{"name": "caf\xe9"}', "not valid JSON (not UTF-8)"),  # latin-1: FastAPI's 400 too
    ],
)
def test_malformed_bodies_are_422(api: httpx.Client, content: str | bytes, names: str) -> None:
    answer = api.post("/api/runs", content=content, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text
    assert names.lower() in answer.json()["detail"].lower()


@pytest.mark.parametrize("kind", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_sent_as_something_else_says_so(api: httpx.Client, kind: str | None) -> None:
    """curl -d's default type (or none) made it "body: Input should be a valid dictionary"."""
    headers = {} if kind is None else {"Content-Type": kind}
    answer = api.post("/api/runs", content=json.dumps(make_run()), headers=headers)
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"] == (
        f"body: send it as JSON, with Content-Type: application/json (not {kind or 'none'})"
    )


@pytest.mark.parametrize("zoom", ["0", "nan", "x"])
def test_a_bad_query_on_a_dashboard_page_is_a_page(api: httpx.Client, zoom: str) -> None:
    # Typed into the address bar, it showed the API's JSON.
    run_id = api.post("/api/runs", json=make_run(batches=1)).json()["id"]
    answer = api.get(f"/runs/{run_id}", params={"zoom": zoom})
    assert answer.status_code == 422
    assert answer.headers["content-type"].startswith("text/html")
    assert '<p class="flash error" role="alert">zoom: ' in answer.text
    assert '<a href="/">Back to the runs</a>' in answer.text
    api_answer = api.get(f"/api/runs/{run_id}/timeline", params={"limit": zoom})  # the API's stays JSON
    assert api_answer.status_code == 422
    assert api_answer.json()["detail"].startswith("limit: ")


def test_an_unknown_address_is_a_page_and_the_favicon_is_served(api: httpx.Client) -> None:
    # A browser got `{"detail":"Not Found"}` for a mistyped address, and every page load logged a 404
    # for /favicon.ico.
    missing = api.get("/nope")
    wrong_method = api.get("/runs/x/stop")
    api_missing = api.get("/api/nope")
    page = api.get("/")
    icon = api.get("/favicon.ico")
    linked = api.get("/static/favicon.svg")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("text/html")
    assert '<p class="flash error" role="alert">no such page: GET /nope</p>' in missing.text
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"
    assert wrong_method.headers["content-type"].startswith("text/html")
    assert api_missing.status_code == 404
    assert api_missing.json() == {"detail": "Not Found"}  # the API's stays JSON
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in page.text
    assert icon.status_code == linked.status_code == 200
    assert icon.headers["content-type"] == linked.headers["content-type"] == "image/svg+xml"


def _runs(api: httpx.Client) -> int:
    return len(api.get("/api/runs").json())


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_past_the_cap_is_a_413_and_starts_nothing(api: httpx.Client, chunked: bool) -> None:
    # An 80 MB body (a valid run after 80 MB of spaces) was read whole, parsed and a run created: 201.
    body = b" " * (MAX_DOCUMENT_BYTES + 1) + json.dumps(make_run()).encode()
    before = _runs(api)
    content: bytes | Iterator[bytes] = body
    if chunked:  # no Content-Length: counted as it arrives
        content = iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    answer = api.post("/api/runs", content=content, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413, answer.text
    assert answer.json() == {"detail": f"request body: larger than {human_bytes(MAX_DOCUMENT_BYTES)}"}
    assert _runs(api) == before


def test_a_chunked_body_under_the_cap_reaches_the_app_whole(api: httpx.Client) -> None:
    body = json.dumps(make_run(batches=1)).encode() + b" " * 200_000
    chunks = iter([body[i : i + 4096] for i in range(0, len(body), 4096)])
    answer = api.post("/api/runs", content=chunks, headers={"Content-Type": "application/json"})
    assert answer.status_code == 201, answer.text
    api.post(f"/api/runs/{answer.json()['id']}/stop")


def test_a_report_upload_has_the_report_s_cap_not_the_json_one(api: httpx.Client) -> None:
    # 5 MB is past the JSON cap but within a report's: it reaches the route (refused there: no CSRF).
    report = b'{"policy": "full"' + b" " * 5_000_000 + b"}"
    answer = api.post("/replays", files={"report": ("r.json", report, "application/json")})
    assert answer.status_code == 403, answer.text
    assert limit_for("/replays") > MAX_REPORT_BYTES


def test_a_slow_sim_run_whose_next_timer_is_far_off_runs(api: httpx.Client) -> None:
    # At speed 0.1 a reset of 900,000 virtual seconds is 100 days of wall time away, more than the
    # selector accepts: the run failed at once with an OverflowError.
    workload = small_workload()
    workload["trajectory"].update(reset_s=900_000, timeout_s=1_000_000)
    run = api.post("/api/runs", json=make_run(speed=0.1, batches=None, workload=workload)).json()
    wait_for(lambda: api.get(f"/api/runs/{run['id']}").json()["state"] != "created", what="started")
    time.sleep(0.5)
    assert api.get(f"/api/runs/{run['id']}").json()["state"] == "running"
    assert api.post(f"/api/runs/{run['id']}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run['id']}").json()["state"] == "stopped", what="stopped")


def test_a_surplus_past_the_simulators_bound_is_refused_live(api: httpx.Client) -> None:
    # S is bounded alone (100,000), but (B + S) × G was not: 10,000 × 100 groups' trajectories were
    # admitted live, and the server stopped answering while it built them.
    run_id = api.post("/api/runs", json=make_run(batches=None, group_size=100)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    refused = api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": 10_000})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"].startswith("surplus_groups: (B + S) × G = (2 + 10000) × 100 = 1,000,200")
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["surplus_groups"] == 2
    assert api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": 3}).status_code == 200
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


def test_a_live_s_many_times_what_runs_now_is_applied_only_when_confirmed(
    api: httpx.Client, server: str
) -> None:
    # The dashboard asked for "a large change" to be ticked; the API applied an S of 100,000 typed for
    # 10 at once, and the run admitted every group's trajectories while the server stopped answering.
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    policy = api.get(f"/api/runs/{run_id}").json()["policy"]
    b, g, s = policy["groups_per_batch"], policy["group_size"], policy["surplus_groups"]
    large = 40 * (b + s)
    refused = api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": large, "max_staleness": 7})
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    lets = f"surplus_groups (S): {large:,} lets up to {(b + large) * g:,} trajectories"
    assert detail.startswith(lets), detail
    assert '"confirm_large_change": true' in detail
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["max_staleness"] != 7  # nothing was applied
    # a change that is not large needs nothing, and a large one confirmed is applied
    assert api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": s + 1}).status_code == 200
    with CorralClient(server, token=TOKEN) as client:
        answer = client.set_policy(run_id, surplus_groups=large, confirm_large_change=True)
    assert answer["policy"]["surplus_groups"] == large
    assert "confirm_large_change" not in answer["policy"]
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["surplus_groups"] == large
    refused = api.patch(f"/api/runs/{run_id}/policy", json={"confirm_large_change": True})
    assert refused.status_code == 422
    assert "at least one" in refused.json()["detail"]
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


def test_a_sync_runs_surplus_cannot_be_changed_live(api: httpx.Client) -> None:
    # The dashboard refused it; the API took it, and the sync run admitted groups beyond its batch.
    run_id = api.post("/api/runs", json=make_run(batches=None, policy="sync")).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    refused = api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": 3})
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"] == "surplus_groups: policy sync runs without surplus (S = 0), got 3"
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["surplus_groups"] == 0
    assert api.patch(f"/api/runs/{run_id}/policy", json={"surplus_groups": 0}).status_code == 200
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200


def test_commands_on_a_run_that_ended_here_say_it_has_ended(api: httpx.Client) -> None:
    # They said "run X is stopped, not executing", and "has ended (stopped)" once the server restarted.
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
    again = api.post(f"/api/runs/{run_id}/stop")  # asks for what happened: not an error
    assert again.status_code == 200, again.text
    assert again.json()["already_stopped"] is True
    assert again.json()["state"] == "stopped"
    for method, path, body in [
        ("POST", "pause", None),
        ("POST", "resume", None),
        ("POST", "weights", {"version": 99, "sentinel": True}),
        ("PATCH", "policy", {"max_staleness": 1}),
        ("POST", "engines/engine-0/drain", None),
    ]:
        answer = api.request(method, f"/api/runs/{run_id}/{path}", json=body)
        assert answer.status_code == 409, (path, answer.text)
        assert answer.json()["detail"] == f"run {run_id!r} has ended (stopped)", path


def test_an_older_version_to_an_ended_run_is_the_same_409(api: httpx.Client) -> None:
    # It was a 422 "not newer than the published version", where a newer one got 409 "has ended".
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    assert api.post(f"/api/runs/{run_id}/weights", json={"version": 5, "sentinel": True}).status_code == 202
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")
    for version in (3, 9):
        answer = api.post(f"/api/runs/{run_id}/weights", json={"version": version, "sentinel": True})
        assert answer.status_code == 409, answer.text
        assert answer.json()["detail"] == f"run {run_id!r} has ended (stopped)"


def test_stops_sent_together_all_answer_200_and_one_of_them_stopped_it(api: httpx.Client) -> None:
    # A double-click or a client's retry: the second stop of a run already stopping was a 409 ("is
    # stopping; this needs it created or running or paused"), which a script takes for a failure.
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: api.post(f"/api/runs/{run_id}/stop"), range(4)))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert sorted(a.json()["already_stopped"] for a in answers) == [False, True, True, True]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")


def test_a_stop_while_a_stopped_run_writes_its_last_events_answers_200(
    api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stopped run's loop closes before its last events are in the store, and it says `stopping`
    # until then (seconds on Postgres): a stop in that window was a 409 "is stopping, not executing".
    closing, release = threading.Event(), threading.Event()
    close = RunRecorder.close

    def slow_close(recorder: RunRecorder) -> None:
        closing.set()
        release.wait(30)
        close(recorder)

    monkeypatch.setattr(RunRecorder, "close", slow_close)
    run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
    try:
        assert api.post(f"/api/runs/{run_id}/stop").json()["already_stopped"] is False
        assert closing.wait(30), "the run's recorder was never closed"
        assert api.get(f"/api/runs/{run_id}").json()["state"] == "stopping"
        again = api.post(f"/api/runs/{run_id}/stop")
        assert again.status_code == 200, again.text
        assert again.json()["already_stopped"] is True
    finally:
        release.set()
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", what="stopped")


def test_a_stop_of_a_run_that_completed_is_refused(api: httpx.Client) -> None:
    spec = make_run(batches=1, trainer="sentinel", sentinel_step_s=0)
    run_id = api.post("/api/runs", json=spec).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "completed", what="completed")
    refused = api.post(f"/api/runs/{run_id}/stop")
    assert refused.status_code == 409, refused.text
    assert refused.json()["detail"] == f"run {run_id!r} has ended (completed)"


@pytest.fixture(scope="module")
def run_id(server: str) -> Iterator[str]:
    """One running run for the module's commands (each leaves it running)."""
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as api:
        run = api.post("/api/runs", json=make_run(batches=None)).json()
        wait_for(lambda: api.get(f"/api/runs/{run['id']}").json()["state"] == "running", what="running")
        yield run["id"]
        api.post(f"/api/runs/{run['id']}/stop")


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "names"),
    [
        ("PATCH", "policy", {"max_staleness": -1}, 422, "max_staleness"),
        ("PATCH", "policy", {"surplus_groups": -3}, 422, "surplus_groups"),
        ("PATCH", "policy", {"surplus_groups": 1.5}, 422, "surplus_groups"),
        ("PATCH", "policy", {"max_staleness": True}, 422, "max_staleness"),
        ("PATCH", "policy", {}, 422, "at least one"),
        ("PATCH", "policy", {"k": 1}, 422, "k: unknown field"),
        ("PATCH", "policy", {"pause_mode": "sleep"}, 422, "pause_mode"),
        ("PATCH", "policy", {"max_updating_engines": 0}, 422, "max_updating_engines"),
        ("POST", "weights", {"version": 0, "sentinel": True}, 422, "version"),
        ("POST", "weights", {"version": 5}, 422, "path or sentinel"),
        ("POST", "weights", {"version": 5, "path": "/x", "sentinel": True}, 422, "path or sentinel"),
        ("POST", "weights", {"version": 5, "path": "/no/such/weights"}, 422, "path"),
        ("POST", "weights", {"version": 5, "path": "data"}, 422, "must be absolute"),  # relative to what?
        ("POST", "weights", {"version": 5, "path": "./ckpt/v5"}, 422, "must be absolute"),
        ("POST", "weights", {"version": 5, "path": ""}, 422, "path"),
        ("POST", "weights", {"version": 5, "path": "/ckpt/v5\u0000x"}, 422, "path: contains a NUL character"),
        # names the OS will not look up: the server's directory check raised ENAMETOOLONG, a 500
        ("POST", "weights", {"version": 5, "path": "/" + "a" * 300}, 422, "a name in it is over 255 bytes"),
        ("POST", "weights", {"version": 5, "path": "/" + ("é" * 100 + "/") * 30}, 422, "over 4,095 bytes"),
        ("POST", "weights", {"version": 5, "path": "/" + "a/" * 2100}, 422, "path"),
        ("POST", "weights", {"version": "5", "sentinel": True}, 422, "version"),
        ("POST", "weights", {"version": 5, "sentinel": "yes"}, 422, "sentinel"),  # strict: a JSON boolean
        ("POST", "weights", {"version": 5, "sentinel": 1}, 422, "sentinel"),
        ("POST", "batches/nope/ack", None, 404, "nope"),
        ("POST", "resume", None, 409, "running"),
        ("GET", "batches/next?timeout=-1", None, 422, "timeout"),
        ("GET", "batches/next?timeout=1e9", None, 422, "timeout"),
        ("GET", "batches/next?timeout=nan", None, 422, "timeout"),
        ("GET", "rollouts/7", None, 404, "rollout 7"),
        ("GET", "rollouts/0", None, 422, "version"),
        ("GET", "timeline?since=-5", None, 422, "since"),
        ("GET", "timeline?since=100000000000000000000000", None, 422, "since"),
        ("GET", "timeline?limit=0", None, 422, "limit"),
        ("GET", "rollouts/99999999999999999999", None, 422, "version"),
        # other scripts' digits, which Python's int() takes: numbers are ASCII here as in the dashboard
        ("PATCH", "policy", {"max_staleness": "\u0663"}, 422, "max_staleness"),
        ("GET", "timeline?since=\u0663", None, 422, "since"),
        ("GET", "batches/next?timeout=\uff13", None, 422, "timeout"),
        ("GET", "rollouts/\u0663", None, 422, "version"),
    ],
)
def test_bad_commands_on_a_run(
    api: httpx.Client, run_id: str, method: str, path: str, body: Any, status: int, names: str
) -> None:
    answer = api.request(method, f"/api/runs/{run_id}/{path}", json=body)
    assert answer.status_code == status, answer.text
    assert names in answer.json()["detail"]


def test_an_older_version_is_refused_and_a_paused_run_cannot_pause(api: httpx.Client, run_id: str) -> None:
    current = api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"]
    newer = api.post(f"/api/runs/{run_id}/weights", json={"version": current + 2, "sentinel": True})
    assert newer.status_code == 202, newer.text
    older = api.post(f"/api/runs/{run_id}/weights", json={"version": current + 1, "sentinel": True})
    assert older.status_code == 422
    assert f"not newer than the published version {current + 2}" in older.json()["detail"]
    # the newest again, the same weights: a repeat (a trainer's after a 503 or no answer), nothing published
    same = api.post(f"/api/runs/{run_id}/weights", json={"version": current + 2, "sentinel": True})
    assert same.status_code == 202, same.text
    assert (same.json()["version"], same.json()["already_published"]) == (current + 2, True)
    assert api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] == current + 2
    paused = api.post(f"/api/runs/{run_id}/pause")
    assert paused.status_code == 200, paused.text
    again = api.post(f"/api/runs/{run_id}/pause")
    assert again.status_code == 409
    assert "paused" in again.json()["detail"]
    resumed = api.post(f"/api/runs/{run_id}/resume")
    assert resumed.status_code == 200, resumed.text


def test_a_version_not_newer_is_refused_in_one_plain_line(
    api: httpx.Client, run_id: str, tmp_path: Path
) -> None:
    version = api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] + 1
    body = {"version": version, "path": str(tmp_path)}  # weights on disk: the runtime's own check
    assert api.post(f"/api/runs/{run_id}/weights", json=body).status_code == 202
    (tmp_path / "other").mkdir()
    other = {"version": version, "path": str(tmp_path / "other")}  # other weights: no repeat
    again = api.post(f"/api/runs/{run_id}/weights", json=other)
    assert again.status_code == 422, again.text
    assert again.json()["detail"] == f"version: {version} is not newer than the published version {version}"


def test_the_same_weights_under_another_spelling_of_their_path_are_a_repeat(
    api: httpx.Client, run_id: str, tmp_path: Path
) -> None:
    """A trainer that retries with `/ckpt/v5/` or `/ckpt/./v5` where it first sent `/ckpt/v5` publishes
    the same weights: before, the paths were compared as strings, and the retry was refused as a
    version not newer (422), the trainer left not knowing whether its publication stood."""
    weights = tmp_path / "v5"
    weights.mkdir()
    version = api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] + 1
    first = api.post(f"/api/runs/{run_id}/weights", json={"version": version, "path": str(weights)})
    assert (first.status_code, first.json()["already_published"]) == (202, False), first.text
    for spelling in (f"{weights}/", f"{tmp_path}/./v5", f"{tmp_path}//v5//", f"{tmp_path}/v5/."):
        again = api.post(f"/api/runs/{run_id}/weights", json={"version": version, "path": spelling})
        assert again.status_code == 202, (spelling, again.text)
        assert (again.json()["version"], again.json()["already_published"]) == (version, True), spelling
    assert api.get(f"/api/runs/{run_id}").json()["live"]["trainer_version"] == version
    # `..` is not folded: through a symbolic link it names another directory (here tmp/real/v5)
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "real" / "v5").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep")
    elsewhere = {"version": version, "path": f"{tmp_path}/link/../v5"}
    other = api.post(f"/api/runs/{run_id}/weights", json=elsewhere)
    assert other.status_code == 422, other.text
    assert "not newer than the published version" in other.json()["detail"]


@pytest.mark.parametrize(
    ("actor", "status", "names"),
    [
        ("zoë".encode(), 200, "zoë"),  # UTF-8 on the wire, read as UTF-8 (not latin-1: "zoÃ«")
        ("操作员".encode(), 200, "操作员"),
        (b"caf\xe9", 422, "X-Corral-Actor: not valid UTF-8"),  # latin-1 bytes
    ],
)
def test_the_actor_header_is_read_as_utf8(
    api: httpx.Client, run_id: str, actor: bytes, status: int, names: str
) -> None:
    knobs = api.get(f"/api/runs/{run_id}").json()["policy"]
    change = {"surplus_groups": knobs["surplus_groups"] + 1}
    answer = api.patch(f"/api/runs/{run_id}/policy", json=change, headers={"X-Corral-Actor": actor})
    assert answer.status_code == status, answer.text
    if status != 200:
        assert names in answer.json()["detail"]
        return
    assert answer.json()["actor"] == names
    events = api.get(f"/api/runs/{run_id}/timeline", params={"limit": 10_000}).json()["events"]
    assert [e["actor"] for e in events if e["kind"] == "policy_changed"][-1] == names  # the audit trail


def test_the_client_sends_a_non_ascii_actor(server: str, run_id: str) -> None:
    with CorralClient(server, token=TOKEN, actor="zoë") as corral:
        assert corral.set_policy(run_id, max_staleness=2)["actor"] == "zoë"


def test_unknown_runs_are_404(api: httpx.Client) -> None:
    for method, path in [
        ("GET", "/api/runs/nope"),
        ("GET", "/api/runs/nope/timeline"),
        ("GET", "/api/runs/nope/metrics"),
        ("GET", "/api/runs/nope/commands/c1"),
        ("GET", "/api/runs/nope/batches/next?timeout=0"),
        ("POST", "/api/runs/nope/stop"),
        ("GET", "/api/runs/nope/rollouts/1"),
    ]:
        answer = api.request(method, path)
        assert answer.status_code == 404, (path, answer.text)
        assert "nope" in answer.json()["detail"]


def test_operator_actions_need_the_operator_token(server: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as anonymous:
        missing = anonymous.post("/api/runs", json=make_run())
        assert missing.status_code == 401
        assert "operator token" in missing.json()["detail"]
        wrong = anonymous.post("/api/runs", json=make_run(), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 403
        # non-ASCII bytes in the token (a pasted token, a typo): a 500 and a traceback, it was
        for token in ("Bearer tök".encode(), "Bearer tök".encode("latin-1"), f"Bearer {TOKEN}é".encode()):
            odd = anonymous.post("/api/runs/x/batches/x-b0/ack", headers={b"Authorization": token})
            assert odd.status_code == 403, odd.text
            assert odd.json()["detail"] == "the token given is not the operator token"
            assert anonymous.get("/api/runs", headers={b"Authorization": token}).status_code == 200
        assert anonymous.get("/api/runs").status_code == 200  # no view token configured: reads are open
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}) as operator:
        assert operator.post("/api/runs", json=make_run(batches=1)).status_code == 201


def test_a_view_token_guards_reads_and_gives_no_operator_rights(
    tmp_path_factory: pytest.TempPathFactory, backend_url: str
) -> None:
    from api_support import make_settings, serving

    settings = make_settings(tmp_path_factory.mktemp("view"), backend_url, view_token="viewer-token-1")
    with serving(settings) as url:
        assert httpx.get(f"{url}/api/runs").status_code == 401
        viewer = {"Authorization": "Bearer viewer-token-1"}
        assert httpx.get(f"{url}/api/runs", headers=viewer).status_code == 200
        assert httpx.get(f"{url}/api/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        assert httpx.post(f"{url}/api/runs", json=make_run(), headers=viewer).status_code == 403
        # Prometheus's figures name every run: they answered anyone while the API's reads needed the token
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert "corral_" in httpx.get(f"{url}/metrics", headers=viewer).text
        assert httpx.get(f"{url}/healthz").status_code in (200, 503)  # a probe needs no token


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
    max_leaves=8,
)
CREATE_FIELDS = [
    "name", "kind", "policy", "workload", "config", "batches", "speed", "trainer", "groups_per_batch",
    "group_size", "surplus_groups", "max_staleness", "orchestrator", "agent_gate",
]  # fmt: skip
PATCH_FIELDS = [
    "max_staleness",
    "surplus_groups",
    "max_updating_engines",
    "pause_mode",
    "agent_gate",
    "confirm_large_change",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(st.sampled_from(CREATE_FIELDS), JSON_VALUES, max_size=4))
def test_no_run_config_is_answered_with_a_500(api: httpx.Client, body: dict[str, Any]) -> None:
    answer = api.post("/api/runs", json=body)
    assert answer.status_code in (201, 422), answer.text
    if answer.status_code == 201:
        api.post(f"/api/runs/{answer.json()['id']}/stop")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    patch=st.dictionaries(st.sampled_from(PATCH_FIELDS), JSON_VALUES, max_size=3),
    weights=st.dictionaries(st.sampled_from(["version", "path", "sentinel"]), JSON_VALUES, max_size=3),
)
def test_no_live_change_is_answered_with_a_500(
    api: httpx.Client, run_id: str, patch: dict[str, Any], weights: dict[str, Any]
) -> None:
    assert api.patch(f"/api/runs/{run_id}/policy", json=patch).status_code in (200, 422)
    assert api.post(f"/api/runs/{run_id}/weights", json=weights).status_code in (202, 422)


def test_the_clients_refuse_a_body_json_cannot_carry_as_the_api_refuses_bad_input() -> None:
    # AsyncCorralClient.set_policy(run, max_staleness=nan) raised a bare ValueError from the JSON encoder
    import asyncio

    from app.client import AsyncCorralClient, CorralError

    with CorralClient("http://127.0.0.1:9", token=TOKEN) as client, pytest.raises(CorralError) as refused:
        client.set_policy("r", max_staleness=float("nan"))  # type: ignore[arg-type]
    assert refused.value.status == 422
    assert "not valid JSON" in refused.value.detail

    async def asynchronously() -> None:
        async with AsyncCorralClient("http://127.0.0.1:9", token=TOKEN) as client:
            await client.set_policy("r", agent_gate=float("inf"))

    with pytest.raises(CorralError) as refused:
        asyncio.run(asynchronously())
    assert refused.value.status == 422
