import asyncio
import html
import itertools
import json
import re
import threading
from dataclasses import replace
from typing import Any

import httpx
import pytest
from factories import make_workload_data
from fastapi import FastAPI, Request

from app.core.events import Envelope, PolicyChanged
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload
from app.web.backend import ActionRefused
from app.web.readmodel import GroupRow, RunMeta, view_from_events
from app.web.security import AccessConfig
from app.web.synthetic import synthetic_run
from app.web.timeline import MAX_GROUPS
from app.web.views import (
    Dashboard,
    Feed,
    _changes,
    make_router,
    mount_dashboard,
    parse_policy_form,
    run_context,
)

OPERATOR = "operator-token-123"


class FakeRuns:
    """A RunsBackend over an in-memory event list: actions append the events a run would publish."""

    def __init__(self, events):
        self.events = list(events)
        self.calls = []

    def run_ids(self):
        return ["live-1"]

    def view(self, run_id):
        if run_id != "live-1":
            return None
        return view_from_events(run_id, self.events, RunMeta(state="running", started_at=1796047380.0))

    def summaries(self):
        return [self.view("live-1").summary()]

    def version(self, run_id):
        return len(self.events)

    def _append(self, event):
        last = self.events[-1]
        self.events.append(Envelope("live-1", last.seq + 1, last.t + 0.1, event))

    async def launch(self, form, actor):
        if form.get("groups_per_batch") == "0":
            raise ValueError("groups_per_batch: must be at least 1")
        self.calls.append(("launch", dict(form)))
        return "live-1"

    async def publish(self, run_id, actor):
        self.calls.append(("publish", run_id))

    async def set_policy(self, run_id, changes, actor, large=False):
        for name, value in changes.items():
            self._append(PolicyChanged(name, None, value, actor))
        self.calls.append(("policy", dict(changes), *(["large"] if large else [])))

    async def pause(self, run_id, actor):
        self.calls.append(("pause", run_id))

    async def resume(self, run_id, actor):
        raise ActionRefused(f"run {run_id} is running; this needs it paused")

    async def stop(self, run_id, actor):
        raise ActionRefused("the run has ended")


class OneRun:
    """A read-only RunsBackend over one fixed view; with `hold`, its first `view` call waits for
    `release` (a slow build)."""

    def __init__(self, view, hold=False):
        self._view = view
        self.entered = threading.Event()
        self.release = threading.Event()
        self.hold = hold

    def run_ids(self):
        return [self._view.run_id]

    def view(self, run_id):
        if run_id != self._view.run_id:
            return None
        if self.hold and not self.entered.is_set():
            self.entered.set()
            self.release.wait(5)
        return self._view

    def summaries(self):
        return [self._view.summary()]

    def version(self, run_id):
        return 0


def make_queued_view(queued):
    """A live run's view with `queued` open groups admitted after its own, none started yet."""
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    view = view_from_events("live-1", events, RunMeta(state="running"))
    extra = [GroupRow(10_000 + i, task="t", admitted=view.now + i / 100) for i in range(queued)]
    return replace(view, source="live", now=view.now + queued / 100, groups=view.groups + extra)


def make_client(view_token=None, live=None):
    app = FastAPI()
    dash = Dashboard(AccessConfig(OPERATOR, view_token), live=live)
    events = synthetic_run(groups=6, group_size=2, batch_groups=2)
    dash.replays.add({"policy": "full", "event_log": [e.to_dict() for e in events]}, "a replay")
    mount_dashboard(app, dash)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")
    return client, dash


async def csrf_of(client, path="/"):
    page = await client.get(path)
    assert page.status_code == 200
    return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)


async def sign_in(client):
    token = await csrf_of(client)
    r = await client.post("/login", data={"csrf_token": token, "token": OPERATOR})
    assert r.status_code == 303
    return token


async def test_runs_page_lists_live_runs_and_replays_with_labelled_fields():
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        r = await client.get("/")
    assert r.status_code == 200
    assert "<title>Corral — runs</title>" in r.text
    assert 'href="/runs/live-1"' in r.text
    assert 'href="/runs/replay-1"' in r.text
    rows = {m[0]: m[1] for m in re.findall(r'<tr data-run="([^"]+)">(.*?)</tr>', r.text, re.S)}
    assert '<td class="num">2026-11-30 14:03:00</td>' in rows["live-1"]  # started (UTC), stored runs
    assert '<td class="num">—</td>' in rows["replay-1"]  # a replay has no start time to show
    for field_id in re.findall(r'<input id="([^"]+)"', r.text):
        assert f'for="{field_id}"' in r.text  # every visible input has a label
    assert "corral_csrf" in r.headers["set-cookie"]


async def test_the_launch_form_says_it_launches_a_simulated_run():
    # The runs page's form launched a simulated run (the live backend's default) and said nothing of it:
    # next to the demo's local run, a first-time user took it for a real one.
    runs = FakeRuns(synthetic_run(groups=2, group_size=2, batch_groups=1))
    runs.launch_defaults = {"kind": "sim", "trainer": "sentinel"}
    client, _ = make_client(live=runs)
    async with client:
        page = (await client.get("/")).text
    assert 'id="launch-kind">A simulated run:' in page
    assert "&#34;kind&#34;: &#34;local&#34;" in page or '"kind": "local"' in page
    runs.launch_defaults = {"kind": "local"}
    client, _ = make_client(live=runs)
    async with client:
        assert 'id="launch-kind"' not in (await client.get("/")).text


async def test_run_page_and_blocks_render():
    client, _ = make_client()
    async with client:
        page = await client.get("/runs/replay-1")
        block = await client.get("/runs/replay-1/block/timeline", params={"zoom": 2})
        zoomed = await client.get("/runs/replay-1", params={"zoom": 4})
        missing = await client.get("/runs/nope")
        bad_block = await client.get("/runs/replay-1/block/nope")
    assert page.status_code == 200
    assert "Why did the trainer wait?" in page.text
    assert "The trainer waited" in page.text
    assert page.text.count('class="sp"') > 100
    assert block.status_code == 200
    assert "<html" not in block.text
    assert block.text.strip().startswith('<svg xmlns="http://www.w3.org/2000/svg" id="timeline-svg"')
    assert "Zoom ×4" in zoomed.text
    assert 'href="/runs/replay-1?zoom=8"' in zoomed.text  # zoom in, without JavaScript too
    assert (missing.status_code, bad_block.status_code) == (404, 404)


ZOOM_PATHS = ["/runs/replay-1", "/runs/replay-1/block/timeline"]


BAD_ZOOMS = ["nan", "NaN", "inf", "-inf", "1e309", "-1", "0", "0.5", "65", "x", ""]
BAD_WIDTHS = ["nan", "inf", "-1", "0", "399", "8001", "1e9", "1.5", "x", ""]
BAD_WINDOWS = ["nan", "inf", "-300", "0", "9.9", "31536001", "x"]


@pytest.mark.parametrize("path", ZOOM_PATHS)
@pytest.mark.parametrize(
    ("name", "value"),
    [("zoom", z) for z in BAD_ZOOMS]
    + [("width", w) for w in BAD_WIDTHS]
    + [("window", w) for w in BAD_WINDOWS],
)
async def test_a_bad_zoom_width_or_window_is_a_422_not_a_500(path, name, value):
    client, _ = make_client()
    async with client:
        r = await client.get(path, params={name: value})
    assert r.status_code == 422
    assert name in r.text


@pytest.mark.parametrize("path", ZOOM_PATHS)
@pytest.mark.parametrize("zoom", ["1", "1.5", "64"])
async def test_every_zoom_the_links_make_is_accepted(path, zoom):
    client, _ = make_client()
    async with client:
        r = await client.get(path, params={"zoom": zoom})
    assert r.status_code == 200


@pytest.mark.parametrize("path", ZOOM_PATHS)
async def test_the_timeline_is_drawn_at_the_width_the_page_asks_for(path):
    client, _ = make_client()
    async with client:
        default = await client.get(path)
        wide = await client.get(path, params={"width": 1600, "zoom": 1})
    assert 'width="1100"' in default.text
    assert 'width="1600" height=' in wide.text


@pytest.mark.parametrize("path", ZOOM_PATHS)
async def test_the_timeline_s_window_links_each_show_their_last_seconds(path):
    client, _ = make_client()
    async with client:
        whole = await client.get(path)
        last = await client.get(path, params={"window": 60, "zoom": 2})
    assert whole.status_code == last.status_code == 200
    assert "last 60 s:" in last.text
    assert "last 60 s:" not in whole.text
    if path == "/runs/replay-1":  # the page's links keep the zoom and mark the window shown
        assert 'data-window="60"' not in whole.text  # 60 s is no link the page offers
        for seconds in ("", "300", "900", "3600"):
            assert f'data-window="{seconds}"' in whole.text
        assert re.search(r'class="button current" data-window=""', whole.text)
        assert 'href="/runs/replay-1?zoom=2&amp;window=300"' in last.text


async def test_the_run_page_explains_every_discard_reason():
    client, _ = make_client()
    async with client:
        page = (await client.get("/runs/replay-1")).text
    for reason in ("stale", "failed", "cancelled", "zero_variance", "orphaned"):
        assert re.search(rf"[✗■] {reason}</b>: \w", page), reason


async def test_a_run_with_more_groups_than_the_cap_renders_the_cap_and_says_how_many_are_left_out():
    view = make_queued_view(MAX_GROUPS + 500)
    client, _ = make_client(live=OneRun(view))
    async with client:
        page = await client.get("/runs/live-1")
        block = await client.get("/runs/live-1/block/timeline", params={"zoom": 2})
    left_out = len(view.groups) - MAX_GROUPS
    for r in (page, block):
        assert r.status_code == 200
        assert r.text.count('<g class="grp"') == MAX_GROUPS
        assert f"{left_out} left out ({left_out} of them not started yet)" in r.text
    assert len(page.content) < 2_000_000


async def test_a_slow_run_page_does_not_hold_up_other_requests():
    live = OneRun(make_queued_view(0), hold=True)
    client, _ = make_client(live=live)
    async with client, asyncio.TaskGroup() as tg:
        page = tg.create_task(client.get("/runs/live-1"))
        assert await asyncio.to_thread(live.entered.wait, 5)
        other = await client.get("/vendor/unknown")  # an async route, on the event loop
        page_still_building = not page.done()
        live.release.set()
    assert other.status_code == 404
    assert page_still_building
    assert page.result().status_code == 200


async def test_actions_need_csrf_and_the_operator_token():
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await csrf_of(client)
        no_csrf = await client.post("/runs/live-1/policy", data={"max_staleness": "5"})
        no_operator = await client.post(
            "/runs/live-1/policy", data={"csrf_token": token, "max_staleness": "5"}
        )
        bearer_no_csrf = await client.post(
            "/runs/live-1/publish", headers={"Authorization": f"Bearer {OPERATOR}"}, data={}
        )
        await sign_in(client)
        ok = await client.post(
            "/runs/live-1/policy",
            data={"csrf_token": token, "max_staleness": "5"},
            headers={"HX-Request": "true"},
        )
        after = await client.get("/runs/live-1/block/policy")
    assert no_csrf.status_code == 403
    assert "CSRF" in no_csrf.text
    assert no_operator.status_code == 403
    assert "operator token" in no_operator.text
    assert bearer_no_csrf.status_code == 403
    assert ok.status_code == 200
    assert live.calls == [("policy", {"max_staleness": 5})]
    assert ok.text == '<p class="flash info" role="status">Applied K = 5.</p>'
    assert 'id="current-k">5<' in after.text
    assert "set max_staleness from None to 5" in after.text


async def test_bad_policy_values_and_refused_actions_say_why():
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await sign_in(client)
        bad = await client.post(
            "/runs/live-1/policy",
            data={"csrf_token": token, "max_staleness": "nan"},
            headers={"HX-Request": "true"},
        )
        refused = await client.post("/runs/live-1/stop", data={"csrf_token": token})
        replay = await client.post("/runs/replay-1/publish", data={"csrf_token": token})
        launch_bad = await client.post("/runs", data={"csrf_token": token, "groups_per_batch": "0"})
        launch_ok = await client.post("/runs", data={"csrf_token": token, "groups_per_batch": "2"})
    assert bad.status_code == 422
    assert "max_staleness (K): expected a whole number" in bad.text
    assert refused.status_code == 409
    assert "the run has ended" in refused.text
    assert replay.status_code == 409
    assert "read-only" in replay.text
    assert launch_bad.status_code == 422
    assert "groups_per_batch" in launch_bad.text
    assert launch_ok.status_code == 303
    assert launch_ok.headers["location"] == "/runs/live-1"


async def test_a_live_s_many_times_what_runs_now_is_applied_only_when_ticked_as_a_large_change():
    """S = 100,000 typed for 10 on a run of B = 2, G = 2 was applied at once: 200,004 trajectories
    admitted, and the whole server stalled for minutes."""
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await sign_in(client)
        policy = (await client.get("/runs/live-1")).text
        assert 'name="large" type="checkbox"' in policy
        ask = {"csrf_token": token, "surplus_groups": "100000"}
        htmx = {"HX-Request": "true"}
        unticked = await client.post("/runs/live-1/policy", data=ask, headers=htmx)
        small = await client.post(
            "/runs/live-1/policy", data={"csrf_token": token, "surplus_groups": "3"}, headers=htmx
        )
        ticked = await client.post("/runs/live-1/policy", data={**ask, "large": "1"}, headers=htmx)
    assert unticked.status_code == 422
    assert "surplus_groups (S): 100,000 lets up to 200,004 trajectories run at once" in unticked.text
    assert "a large change" in unticked.text
    assert small.status_code == 200
    assert ticked.status_code == 200
    # the tick goes on to the server, which refuses a large S unconfirmed whichever door it comes through
    assert live.calls == [("policy", {"surplus_groups": 3}), ("policy", {"surplus_groups": 100_000}, "large")]


async def test_a_policy_field_left_as_the_page_showed_it_changes_nothing():
    """The form is filled in with the policy as the page loaded and was sent whole: S set to 8 through the
    API meanwhile went back to the 4 the page showed when the operator changed only K."""
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await sign_in(client)
        page = (await client.get("/runs/live-1")).text
        form = dict(re.findall(r'<input[^>]*name="(\w+_shown)" value="([^"]*)"', page))
        assert set(form) == {"max_staleness_shown", "surplus_groups_shown"}
        shown = {"csrf_token": token, **form, "surplus_groups": form["surplus_groups_shown"]}
        htmx = {"HX-Request": "true"}
        k_only = await client.post("/runs/live-1/policy", data={**shown, "max_staleness": "7"}, headers=htmx)
        untouched = await client.post(
            "/runs/live-1/policy",
            data={**shown, "max_staleness": form["max_staleness_shown"]},
            headers=htmx,
        )
    assert k_only.status_code == 200
    assert k_only.text == '<p class="flash info" role="status">Applied K = 7.</p>'
    assert untouched.status_code == 422
    assert "a field left as it shows is no change" in untouched.text
    assert live.calls == [("policy", {"max_staleness": 7})]


def test_a_large_change_is_one_that_multiplies_the_trajectories_in_flight():
    from app.web.views import large_change

    policy = {"groups_per_batch": 4, "group_size": 8, "surplus_groups": 12}  # 128 in flight
    assert large_change(policy, {"surplus_groups": 60}) is None  # 512: 4×
    assert large_change(policy, {"surplus_groups": 61}) is not None
    assert large_change(policy, {"max_staleness": 1000}) is None
    assert (
        large_change({"groups_per_batch": 1, "group_size": 2, "surplus_groups": 0}, {"surplus_groups": 32})
        is None
    )
    assert large_change({}, {"surplus_groups": 10**5}) is None  # a run whose B and G the page does not know


async def test_a_refused_action_without_javascript_links_back_to_its_run():
    # The error page of a policy form posted without htmx linked only to the runs page.
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await sign_in(client)
        bad = await client.post("/runs/live-1/policy", data={"csrf_token": token, "max_staleness": "-1"})
        client.cookies.delete("corral_token")
        unsigned = await client.post("/runs/live-1/policy", data={"csrf_token": token, "max_staleness": "1"})
    assert bad.status_code == 422
    assert "max_staleness (K): must be between" in bad.text
    for page in (bad, unsigned):
        main = re.search(r'<main id="main">.*?</main>', page.text, re.S).group(0)
        assert '<a href="/runs/live-1">Back to the run</a>' in main
    header = re.search(r'<header class="top">.*?</header>', unsigned.text, re.S).group(0)
    assert 'name="next" value="/runs/live-1"' in header  # signing in there returns to the run


@pytest.mark.parametrize("path", ["/runs/%00", "/runs/a%0Ab", "/runs/replay-1/block/%1B"])
async def test_an_unknown_run_id_with_control_characters_is_shown_escaped(path):
    # GET /runs/%00 put a raw NUL into the page's title and body ("no run \0").
    client, _ = make_client()
    async with client:
        page = await client.get(path)
    assert page.status_code == 404
    assert not any(c in page.text for c in "\x00\x1b")
    assert "a\nb" not in page.text
    assert re.search(r"<title>Corral — no (run|block) (\\x00|a\\nb|\\x1b)</title>", page.text), page.text


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/", "/\\evil.example/"])
async def test_sign_in_never_redirects_off_site(target):
    client, _ = make_client()
    async with client:
        token = await csrf_of(client)
        r = await client.post("/login", data={"csrf_token": token, "token": OPERATOR, "next": target})
    assert r.status_code == 303
    assert r.headers["location"] == "/"


@pytest.mark.parametrize("view_token", [None, "viewer-token-1"])
async def test_the_login_url_typed_in_shows_the_sign_in_page(view_token):
    # GET /login was a 405 (only the form's POST existed): a user typing the URL got no way to sign in.
    client, _ = make_client(view_token=view_token)
    async with client:
        page = await client.get("/login", params={"next": "/runs/replay-1"})
        assert page.status_code == 200
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        signed = await client.post(
            "/login", data={"csrf_token": token, "token": OPERATOR, "next": "/runs/replay-1"}
        )
        off_site = await client.get("/login", params={"next": "//evil.example/"})
    assert '<form method="post" action="/login">' in page.text
    assert 'name="next" value="/runs/replay-1"' in page.text
    assert signed.status_code == 303
    assert signed.headers["location"] == "/runs/replay-1"
    assert off_site.status_code == 200
    assert 'name="next" value="/"' in off_site.text


async def test_signing_in_from_the_header_returns_to_the_page_it_was_on():
    # The header's form had no `next`: signing in on a run's page landed on the runs page; and a wrong
    # token on /login?next=... re-rendered the form with next="/", losing the page again.
    client, _ = make_client()
    async with client:
        page = await client.get("/runs/replay-1", params={"zoom": "2"})
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
        header = re.search(r'<header class="top">.*?</header>', page.text, re.S).group(0)
        nxt = html.unescape(re.search(r'name="next" value="([^"]*)"', header).group(1))
        signed = await client.post("/login", data={"csrf_token": token, "token": OPERATOR, "next": nxt})
        client.cookies.delete("corral_token")
        wrong = await client.post(
            "/login", data={"csrf_token": token, "token": "guess-guess", "next": "/runs/replay-1"}
        )
        tabbed = await client.post(
            "/login", data={"csrf_token": token, "token": OPERATOR, "next": "/\t/evil.example/"}
        )
    assert nxt == "/runs/replay-1?zoom=2"
    assert signed.status_code == 303
    assert signed.headers["location"] == "/runs/replay-1?zoom=2"
    assert wrong.status_code == 403
    form = re.search(r'<main id="main">.*?</main>', wrong.text, re.S).group(0)
    assert 'name="next" value="/runs/replay-1"' in form
    assert tabbed.headers["location"] == "/"


async def test_view_token_protects_reading():
    client, _ = make_client(view_token="viewer-token-1")
    async with client:
        denied = await client.get("/")
        bearer = await client.get("/", headers={"Authorization": "Bearer viewer-token-1"})
        token = re.search(r'name="csrf_token" value="([^"]+)"', denied.text).group(1)
        wrong = await client.post("/login", data={"csrf_token": token, "token": "guess-guess"})
        login = await client.post(
            "/login", data={"csrf_token": token, "token": "viewer-token-1", "next": "/"}
        )
        after = await client.get("/runs/replay-1")
    assert denied.status_code == 401
    assert "Sign in" in denied.text
    assert bearer.status_code == 200
    assert wrong.status_code == 403
    assert login.status_code == 303
    assert after.status_code == 200


async def test_an_operator_loads_a_report_as_a_replay():
    client, dash = make_client()
    report = {"policy": "sync", "event_log": [e.to_dict() for e in synthetic_run(groups=4, batch_groups=2)]}
    async with client:
        token = await csrf_of(client)
        anonymous = await client.post(
            "/replays", data={"csrf_token": token}, files={"report": ("r.json", json.dumps(report))}
        )
        await sign_in(client)
        ok = await client.post(
            "/replays", data={"csrf_token": token}, files={"report": ("r.json", json.dumps(report))}
        )
        bad = await client.post(
            "/replays", data={"csrf_token": token}, files={"report": ("r.json", b"{nope")}
        )
        deep = await client.post(  # json.loads recursed past Python's limit: a 500
            "/replays",
            data={"csrf_token": token},
            files={"report": ("r.json", b"[" * 100_000 + b"]" * 100_000)},
        )
    assert anonymous.status_code == 403
    assert ok.status_code == 303
    assert ok.headers["location"] == "/runs/replay-2"
    assert bad.status_code == 422
    assert "not JSON" in bad.text
    assert deep.status_code == 422
    assert "nested too deeply" in deep.text
    assert dash.replays.view("replay-2").label == "r.json"


def test_the_tokens_chart_skips_steps_without_a_rate():
    # A step with no turns since the last one (or delivered in the same instant) has no rate: the chart
    # got a label for every step and a value for the others only, and the run page was a 500.
    view = view_from_events("r", synthetic_run(groups=6, group_size=2, batch_groups=2))
    assert len(view.batches) >= 3
    assert all(b.tokens_per_s is not None for b in view.batches)
    batches = [replace(view.batches[0], tokens_per_s=None), *view.batches[1:]]
    chart = str(run_context(replace(view, batches=batches))["tokens_chart"])
    assert f"<title>{batches[0].index}: " not in chart
    assert all(f"<title>{b.index}: " in chart for b in batches[1:])


def _report_with(change):
    report = {"policy": "full", "event_log": [e.to_dict() for e in synthetic_run(groups=4, batch_groups=2)]}
    change(report)
    return report


def _first(report, kind):
    return next(e for e in report["event_log"] if e["kind"] == kind)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda r: r["event_log"].insert(1, 7), "event_log"),
        (lambda r: _first(r, "group_admitted").update(task=5), "event_log[2].task: expected str"),
        (lambda r: _first(r, "turn").update(group_id="x"), ".group_id: expected int"),
        (lambda r: _first(r, "sandbox_op").update(ok=1), ".ok: expected bool"),
        (lambda r: r.update(lanes="exec"), "not a report's shape"),
        (lambda r: r.update(policy_config=3), "not a report's shape"),
        (lambda r: r.update(event_log=None, groups_timeline=[{"group": 0, "admitted_s": "x"}]), "admitted_s"),
        (
            lambda r: r.update(event_log=None, groups_timeline=[], batch_marks=[{"batch": 0}]),
            "not a report's",
        ),
    ],
)
async def test_a_report_of_the_wrong_shape_is_a_422_naming_what(change, names):
    # Each was taken, or failed in the middle, and the load or every view of the replay was a 500.
    client, dash = make_client()
    async with client:
        token = await csrf_of(client)
        await sign_in(client)
        answer = await client.post(
            "/replays",
            data={"csrf_token": token},
            files={"report": ("r.json", json.dumps(_report_with(change)))},
        )
    assert answer.status_code == 422, answer.text
    assert names in html.unescape(answer.text)
    assert dash.replays.run_ids() == ["replay-1"]


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
async def test_a_report_with_a_non_finite_number_is_refused(number):
    # json.loads took them: an event at t = Infinity made the run page a 500 (NaN pixels).
    client, dash = make_client()
    log = [e.to_dict() for e in synthetic_run(groups=4, batch_groups=2)]
    text = json.dumps({"policy": "full", "event_log": log}).replace('"t": 0.0', f'"t": {number}', 1)
    async with client:
        token = await csrf_of(client)
        await sign_in(client)
        answer = await client.post("/replays", data={"csrf_token": token}, files={"report": ("r.json", text)})
    assert answer.status_code == 422
    assert f"report: {number} is" in answer.text
    assert dash.replays.run_ids() == ["replay-1"]


@pytest.mark.parametrize("number", ["1e308", "-2e15", "10000000000000000000000000000000"])
async def test_a_report_with_a_number_beyond_any_run_is_refused(number):
    # Two batch times of 1e308 were accepted; their mean overflowed (fsum) and the run page was a 500.
    client, dash = make_client()
    text = json.dumps({"groups_timeline": [], "batch_collection_s": {"per_batch": ["X", "X"]}})
    async with client:
        token = await csrf_of(client)
        await sign_in(client)
        answer = await client.post(
            "/replays", data={"csrf_token": token}, files={"report": ("r.json", text.replace('"X"', number))}
        )
    assert answer.status_code == 422, answer.text
    assert f"report: {number} is beyond any run" in answer.text
    assert dash.replays.run_ids() == ["replay-1"]


async def test_a_report_with_an_integer_too_long_for_python_is_a_422():
    # json.loads raised a plain ValueError for an integer of more than 4,300 digits: the load was a 500.
    client, dash = make_client()
    log = [e.to_dict() for e in synthetic_run(groups=4, batch_groups=2)]
    text = json.dumps({"policy": "full", "event_log": log}).replace('"t": 0.0', '"t": 1' + "0" * 5000, 1)
    async with client:
        token = await csrf_of(client)
        await sign_in(client)
        answer = await client.post("/replays", data={"csrf_token": token}, files={"report": ("r.json", text)})
    assert answer.status_code == 422, answer.text
    assert "report: a number has more than 4300 digits" in answer.text
    assert dash.replays.run_ids() == ["replay-1"]


@pytest.mark.parametrize(
    ("form", "message"),
    [
        ({}, "policy: set K, S or the agent gate"),
        ({"max_staleness": "-1"}, "max_staleness (K): must be between"),
        # the bound the API holds to, not a million (a K of 50,000 passed here, then failed in the API)
        ({"max_staleness": "50000"}, "max_staleness (K): must be between 0 and 10,000, got 50,000"),
        ({"surplus_groups": "100001"}, "surplus_groups (S): must be between 0 and 100,000, got 100,001"),
        ({"surplus_groups": "1e9"}, "surplus_groups (S): expected a whole number"),
        ({"surplus_groups": "inf"}, "surplus_groups (S): expected a whole number"),
        # int() takes other scripts' digits, '_' and '+': these were applied as K = 3 and S = 1000
        ({"max_staleness": "\u0663"}, "max_staleness (K): expected a whole number, got '\u0663'"),  # Arabic 3
        ({"max_staleness": "\uff13"}, "max_staleness (K): expected a whole number, got '\uff13'"),  # wide 3
        ({"surplus_groups": "\u0967\u0968"}, "surplus_groups (S): expected a whole number"),  # Devanagari 12
        ({"surplus_groups": "1_000"}, "surplus_groups (S): expected a whole number, got '1_000'"),
        ({"surplus_groups": "+3"}, "surplus_groups (S): expected a whole number, got '+3'"),
        ({"agent_gate": "-1"}, "agent_gate (agent gate): must be between 0 and 1,000, got -1"),
        ({"agent_gate": "2e3"}, "agent_gate (agent gate): must be between 0 and 1,000, got 2e3"),
        # float() takes all of these
        ({"agent_gate": "nan"}, "agent_gate (agent gate): expected a number, got 'nan'"),
        ({"agent_gate": "-inf"}, "agent_gate (agent gate): expected a number, got '-inf'"),
        ({"agent_gate": "1e400"}, "agent_gate (agent gate): expected a number, got '1e400'"),  # inf
        ({"agent_gate": "1_0"}, "agent_gate (agent gate): expected a number, got '1_0'"),
        ({"agent_gate": "\u0663"}, "agent_gate (agent gate): expected a number, got '\u0663'"),
        ({"agent_gate": "+3"}, "agent_gate (agent gate): expected a number, got '+3'"),
    ],
)
def test_policy_form_refuses_bad_values(form, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_policy_form(form)


def test_policy_form_takes_the_agent_gate_as_a_number() -> None:
    assert parse_policy_form({"agent_gate": "0"}) == {"agent_gate": 0.0}
    assert parse_policy_form({"agent_gate": " 2.5 ", "max_staleness": "3"}) == {
        "max_staleness": 3,
        "agent_gate": 2.5,
    }
    assert parse_policy_form({"agent_gate": "1e3"}) == {"agent_gate": 1000.0}


async def test_the_policy_form_changes_the_agent_gate_and_the_page_shows_it():
    live = FakeRuns(synthetic_run(groups=4, group_size=2, batch_groups=2))
    client, _ = make_client(live=live)
    async with client:
        token = await sign_in(client)
        before = await client.get("/runs/live-1")
        ok = await client.post(
            "/runs/live-1/policy",
            data={"csrf_token": token, "agent_gate": "0.5"},
            headers={"HX-Request": "true"},
        )
        after = await client.get("/runs/live-1")
        opened = await client.post(
            "/runs/live-1/policy",
            data={"csrf_token": token, "agent_gate": "0"},
            headers={"HX-Request": "true"},
        )
        block = await client.get("/runs/live-1/block/policy")
    # a run that started without a gate offers no field for one, and says it has none
    assert 'id="p-gate"' not in before.text
    assert '<b>agent gate</b> = <span id="current-gate">off</span>' in before.text
    assert ok.status_code == 200
    assert ok.text == '<p class="flash info" role="status">Applied agent gate = 0.5.</p>'
    assert live.calls == [("policy", {"agent_gate": 0.5}), ("policy", {"agent_gate": 0.0})]
    assert '<span id="current-gate">0.5</span>' in after.text
    assert (
        'id="p-gate" name="agent_gate" type="number" min="0" max="1000" step="any" value="0.5"' in after.text
    )
    assert opened.text == '<p class="flash info" role="status">Applied agent gate = 0.</p>'
    assert '<span id="current-gate">0 (open)</span>' in block.text
    assert "set agent_gate from None to 0.0" in block.text


class FakeRequest:
    def __init__(self, polls):
        self.polls = polls

    async def is_disconnected(self):
        self.polls -= 1
        return self.polls < 0


async def test_the_live_stream_sends_blocks_only_when_the_run_changes():
    keys = iter([1, 1, 2, 2])
    feed = Feed(lambda: next(keys), lambda: [("engines", "<p>x</p>")])
    sent = [msg async for msg in _changes(FakeRequest(4), [feed], 0.0)]
    assert sent == [{"event": "engines", "data": "<p>x</p>"}] * 2


async def test_the_live_stream_renders_its_blocks_off_the_event_loop():
    loop_thread = threading.get_ident()
    feed = Feed(lambda: 1, lambda: [("engines", str(threading.get_ident()))])
    sent = [msg async for msg in _changes(FakeRequest(1), [feed], 0.0)]
    assert sent
    assert int(sent[0]["data"]) != loop_thread


async def test_a_slow_feed_sends_its_last_change_once_its_interval_has_passed():
    version = [0]

    def key():
        version[0] += 1  # the run changes at every poll
        return version[0]

    fast = Feed(key, lambda: [("engines", "")])
    slow = Feed(key, lambda: [("timeline", "")], min_interval_s=0.05)
    sent = [m["event"] async for m in _changes(FakeRequest(10), [fast, slow], 0.02)]
    assert sent.count("engines") == 10
    assert 2 <= sent.count("timeline") <= 5  # held back to one per 50 ms, never dropped for good


async def test_the_wait_panel_names_the_phase_made_slow_in_a_simulated_replay():
    from factories import make_workload_data

    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    # 60 s: longer than an attempt's model turns (about 40 s here), so the reset holds every batch
    # even when full's adaptive lanes keep resets from queueing (at 30 s the model turns came first).
    workload = Workload.model_validate(make_workload_data(trajectory={"reset_s": 60}))
    envelopes = []
    policy = policy_for(workload, "full")
    report = await asyncio.to_thread(simulate, workload, policy, "full", events=envelopes.append)
    report["event_log"] = [e.to_dict() for e in envelopes]
    client, dash = make_client()
    run_id = dash.replays.add(report, "slow reset")
    async with client:
        block = await client.get(f"/runs/{run_id}/block/wait")
    assert block.status_code == 200
    rows = re.findall(r"<tr><td>([^<]+)</td><td class=\"num\">", block.text)
    assert rows[0] == "sandbox resets"  # the largest share comes first
    assert re.search(r"The trainer waited [\d.]+ s over 2 batches: [\d.]+ s on sandbox resets,", block.text)


@pytest.mark.parametrize(
    "state", ["serving", "updating", "unhealthy", "draining", "paused", "restarting", "given_up", "stopped"]
)
def test_every_engine_state_has_a_marker_in_the_engines_table(state):
    # An ended run shows its engines `stopped`, which had no marker (nor `restarting`, `given_up`): a bare
    # word among the others' symbols. Each state the runtime, the service or the read model sets has one.
    from pathlib import Path

    css = (Path(__file__).resolve().parents[2] / "app" / "web" / "static" / "dashboard.css").read_text()
    assert f".state.{state}::before {{ content: " in css


@pytest.mark.parametrize(
    ("state", "badge"),
    [
        ("running", "live"),
        ("stopping", "live"),
        ("paused", "paused"),
        ("completed", "completed"),
        ("stopped", "stopped"),
        ("failed", "failed"),
        ("ended (completed)", "completed"),
        ("ended (duration)", "completed"),
        ("ended (stopped)", "stopped"),
        ("ended (error)", "failed"),
    ],
)
def test_each_outcome_of_a_run_has_its_own_badge(state, badge):
    # Failed, completed and stopped runs shared one grey 'ended' badge on the runs list and the run page.
    from pathlib import Path

    view = view_from_events("r", synthetic_run(groups=2, group_size=2, batch_groups=1), RunMeta(state=state))
    assert view.badge == badge
    css = (Path(__file__).resolve().parents[2] / "app" / "web" / "static" / "dashboard.css").read_text()
    assert re.search(rf"\.badge\.{badge} \{{ background: #[0-9a-f]{{6}};", css)
    assert f".badge.{badge}::before {{ content: " in css
    page = Dashboard(AccessConfig(None, None)).render("runs.html", {"runs": [view], "launch": {}}, "runs")
    assert f'<span class="badge {badge}">{state}</span>' in page


CONTROL_NAMES = ("stop_control", "publish_control", "policy_control", "pause_control")
LIVE_CONTROLS = (
    "Stop the run after this step",
    "Publish weights",
    "Apply live",
    'id="policy-form"',
    ">Pause<",
)


async def live_run_page(state: str) -> tuple[str, dict[str, str]]:
    """The run page of a live run in `state`, signed in, and its control blocks as the stream sends them."""
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    view = replace(view_from_events("live-1", events, RunMeta(state=state)), source="live")
    client, _ = make_client(live=OneRun(view))
    async with client:
        await sign_in(client)
        page = await client.get("/runs/live-1")
        assert page.status_code == 200
        names = (*CONTROL_NAMES, "pause_answer")
        blocks = {name: (await client.get(f"/runs/live-1/block/{name}")).text for name in names}
    return page.text, blocks


@pytest.mark.parametrize("state", ["completed", "stopped", "failed", "ended (stopped)"])
async def test_an_ended_run_offers_no_live_controls_and_shows_its_final_policy(state):
    # An ended run's page still offered 'Stop the run after this step', 'Publish weights' and the
    # policy form's 'Apply live', each refused once pressed.
    page, blocks = await live_run_page(state)
    for gone in LIVE_CONTROLS:
        assert gone not in page
    assert 'id="policy-final"' in page
    assert 'Final: <b>K</b> = <span id="current-k">3</span>' in page
    assert "<form" not in "".join(blocks.values())
    assert 'id="policy-final"' in blocks["policy_control"]


async def test_a_running_run_offers_its_live_controls():
    page, blocks = await live_run_page("running")
    for shown in LIVE_CONTROLS:
        assert shown in page
    assert 'id="policy-final"' not in page
    assert 'Now: <b>K</b> = <span id="current-k">3</span>' in page
    assert all("<form" in blocks[name] for name in CONTROL_NAMES)


async def test_a_paused_run_offers_resume_and_its_other_live_controls():
    # A run paused through the API showed no way to resume it: the page had no Resume (nor Pause).
    page, blocks = await live_run_page("paused")
    assert 'id="resume-btn"' in page
    assert 'action="/runs/live-1/resume"' in blocks["pause_control"]
    assert 'id="paused-note"' in page
    assert 'id="pause-btn"' not in page
    for shown in ("Stop the run after this step", "Publish weights", "Apply live"):
        assert shown in page  # a paused run takes a new version, a policy change and a stop


async def test_pause_and_resume_reach_the_backend_and_say_what_happened():
    runs = FakeRuns(synthetic_run(groups=2, group_size=2, batch_groups=1))
    client, _ = make_client(live=runs)
    async with client:
        token = await sign_in(client)
        headers = {"HX-Request": "true"}
        paused = await client.post("/runs/live-1/pause", data={"csrf_token": token}, headers=headers)
        assert paused.status_code == 200
        assert "Paused" in paused.text
        resumed = await client.post("/runs/live-1/resume", data={"csrf_token": token}, headers=headers)
        assert resumed.status_code == 409  # FakeRuns: the run is not paused
        assert "refused: run live-1 is running" in html.unescape(resumed.text)
        replay = await client.post("/runs/replay-1/pause", data={"csrf_token": token}, headers=headers)
        assert replay.status_code == 409
        anonymous, _ = make_client(live=runs)
        async with anonymous:
            denied = await anonymous.post(
                "/runs/live-1/pause", data={"csrf_token": await csrf_of(anonymous)}, headers=headers
            )
        assert denied.status_code == 403
    assert runs.calls == [("pause", "live-1")]


async def live_stream(backend: Any) -> Any:
    """The run page's live stream of run live-1 over `backend`, polled without pause, its client never
    leaving."""
    router = make_router(Dashboard(AccessConfig(None, None), live=backend, stream_interval_s=0.0))
    stream = next(r.endpoint for r in router.routes if getattr(r, "path", "") == "/runs/{run_id}/stream")

    async def receive():
        await asyncio.sleep(3600)  # the client never leaves

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/runs/live-1/stream",
        "headers": [],
        "query_string": b"",
    }
    return await stream(Request(scope, receive), "live-1")


async def test_the_live_stream_sends_pause_or_resume_when_the_run_s_state_changes():
    # The stream re-sent the controls only when a run began stopping or ended: a run paused through the
    # API kept showing Pause (and a resumed one Resume) until a reload.
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    versions = itertools.count()

    class Switching(OneRun):
        state = "running"

        def view(self, run_id):
            return replace(view_from_events("live-1", events, RunMeta(state=self.state)), source="live")

        def version(self, run_id):
            return next(versions)  # a change at every poll

    backend = Switching(None)
    response = await live_stream(backend)
    pauses, answers, summaries = [], [], 0
    async for msg in response.body_iterator:
        summaries += msg["event"] == "summary"
        if msg["event"] == "pause_answer":
            answers.append((len(pauses), msg["data"]))
        if msg["event"] == "pause_control":
            pauses.append(msg["data"])
        if len(pauses) == 4:
            break
        if summaries == 3:  # three polls at one state: the control went once
            summaries = 0
            flip = {"running": "paused", "paused": "running"}
            backend.state = flip[backend.state] if len(pauses) < 3 else "stopped"
    assert ["pause-btn" in d for d in pauses] == [True, False, True, False]
    assert ["resume-btn" in d for d in pauses] == [False, True, False, False]
    # Pause's and Resume's answer area goes as the run ends, not as it pauses or resumes (that swap
    # would clear an answer as it comes).
    assert [(shown, 'id="pause-msg"' in d) for shown, d in answers] == [(3, False)]


async def test_a_run_deleted_while_its_page_is_open_says_so():
    """Its page went on reading "✓ completed", and only a reload said the run was gone."""
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    versions = itertools.count()

    class Deleted(OneRun):
        gone = False

        def view(self, run_id):
            return (
                None if self.gone else replace(view_from_events("live-1", events, RunMeta()), source="live")
            )

        def version(self, run_id):
            return next(versions)

    backend = Deleted(None)
    response = await live_stream(backend)
    summaries = []

    async def read() -> None:
        async for msg in response.body_iterator:
            if msg["event"] == "summary":
                summaries.append(msg["data"])
                backend.gone = True
            if len(summaries) == 2:
                return

    await asyncio.wait_for(read(), 10)  # before, nothing more came
    assert 'id="run-state"' in summaries[0]
    assert 'id="run-gone"' in summaries[1]
    assert "Run live-1 was deleted" in summaries[1]


@pytest.mark.parametrize(("state", "message"), [("running", ""), ("stopping", "Stopping"), ("stopped", None)])
async def test_the_stop_message_goes_with_the_stop_control(state, message):
    # 'Stopping after the current trainer step.' (the stop form's answer) stayed under the stopped badge:
    # its area lay outside the block the stream swaps as the run ends.
    page, blocks = await live_run_page(state)
    assert page.count('id="stop-msg"') == (0 if message is None else 1)
    shown = re.search(r'<div id="stop-msg" aria-live="polite">(.*?)</div>', blocks["stop_control"], re.S)
    if message is None:
        assert shown is None
    else:
        assert message in shown.group(1)


@pytest.mark.parametrize("state", ["running", "stopping", "stopped"])
@pytest.mark.parametrize(
    ("area", "block"), [("publish-msg", "publish_control"), ("policy-msg", "policy_control")]
)
async def test_a_publish_or_policy_answer_goes_with_its_control(state, area, block):
    # 'Publishing v7 ...' and 'K = 3 ...' stayed on the page of a run that had ended, as the stop's
    # answer did: their areas lay outside the blocks the stream swaps as the run stops or ends.
    page, blocks = await live_run_page(state)
    live = state == "running"
    assert page.count(f'id="{area}"') == int(live)
    assert (f'id="{area}"' in blocks[block]) is live


@pytest.mark.parametrize(
    ("state", "live"),
    [("running", True), ("paused", True), ("stopping", False), ("stopped", False), ("failed", False)],
)
async def test_the_pause_or_resume_answer_goes_as_the_run_stops_or_ends(state, live):
    # 'Paused: ...' or 'Resumed.' (the Pause / Resume forms' answer) could stay on the page of a run
    # that had ended, as the stop's answer did: its area lay outside every block the stream swaps.
    page, blocks = await live_run_page(state)
    assert page.count('id="pause-msg"') == int(live)
    assert ('id="pause-msg"' in blocks["pause_answer"]) is live
    assert 'id="pause-msg"' not in blocks["pause_control"]  # swapped as it pauses: it would clear it


@pytest.mark.parametrize(("state", "source"), [("failed", "live"), ("stopped", "live"), ("replay", "replay")])
def test_an_ended_run_with_nothing_to_show_does_not_say_yet(state, source):
    # A failed run with no batch said 'No batch delivered yet.', each trainer chart 'no data yet' and
    # its audit 'No change yet.', as if more would come.
    events = synthetic_run(groups=4, group_size=2, batch_groups=2)
    view = replace(
        view_from_events("live-1", events, RunMeta(state=state)),
        source=source,
        batches=[],
        staleness={},
        attribution=None,
        audit=[],
        engines=[],
        lanes=[],
    )
    page = Dashboard(AccessConfig(None, None)).render(
        "run.html", {**run_context(view), "csrf": "", "csrf_field": ""}
    )
    assert " yet" not in re.sub(r"<script.*?</script>", "", page, flags=re.S)
    for said in ("No batch was delivered", "No change was made", "No engine was seen", "No lane was used"):
        assert f"{said}." in page
    if source == "live":
        assert page.count(">no data</text>") == 5
    running = replace(view, state="running", source="live")
    assert "No batch delivered yet." in Dashboard(AccessConfig(None, None)).render(
        "run.html", {**run_context(running), "csrf": "", "csrf_field": ""}
    )


async def test_a_stopping_run_says_so_and_offers_no_live_controls():
    # A run asked to stop still offered 'Stop the run after this step' (a second stop changes nothing),
    # 'Publish weights' and 'Apply live' (a stopping run takes no new version and no policy change: a
    # 409 once pressed).
    page, blocks = await live_run_page("stopping")
    for gone in LIVE_CONTROLS:
        assert gone not in page
    assert 'id="stopping-note"' in page
    assert 'id="stopping-note"' in blocks["stop_control"]
    assert 'id="policy-stopping"' in page
    assert "<form" not in "".join(blocks.values())


def test_the_trainer_charts_say_what_their_axes_count_and_idle_is_a_percentage():
    # The staleness histogram's bars were labelled 0, 1, 2 like the per-step charts beside it, with
    # nothing saying one axis counts trainer steps and the other versions behind; the idle chart ran
    # from 0 to 1 while the summary above it said 91%.
    view = view_from_events(
        "r", synthetic_run(groups=6, group_size=2, batch_groups=2), RunMeta(state="running")
    )
    html = Dashboard(AccessConfig(None, None)).render("run.html", run_context(view), "trainer")
    charts = dict(re.findall(r'aria-label="([^"]+)"(.*?)</svg>', html, re.DOTALL))
    assert ">trainer step</text>" in charts["batch collection time per step"]
    assert ">trainer step</text>" in charts["tokens/s per step"]
    assert ">versions behind (bar height: groups)</text>" in charts["staleness of delivered groups"]
    idle = charts["trainer idle fraction, last 10 batches"]
    assert ">100%</text>" in idle
    assert ">0 s</text>" in idle
    assert ">run time at each batch</text>" in idle
    # The lower bound's label sat beside its line, over the last bars (docs/screenshots/run.png); it is
    # in the title row now, above every bar, after a sample of the dashed line.
    collection = charts["batch collection time per step"]
    bound = re.search(r'<text [^>]*y="([\d.]+)"[^>]*fill="#b00020"[^>]*>lower bound', collection)
    assert bound is not None
    tops = [float(y) for y in re.findall(r'<rect [^>]*y="([\d.]+)"', collection)]
    assert tops
    assert float(bound.group(1)) < min(tops)
    assert re.search(r'<line [^>]*y1="10.5"[^>]*stroke="#b00020"[^>]*stroke-dasharray', collection)
    last = view.batches[-1].idle_fraction
    assert f"{view.batches[-1].delivered:.1f} s: {100 * last:.3g}%</title>" in idle


def _staleness_chart(staleness: dict[int, int]) -> tuple[list[tuple[float, str]], list[str]]:
    """The run page's staleness chart for a run whose delivered groups were `staleness` versions behind:
    its x-axis tick labels (x, text), left to right, and its bars' hover titles."""
    from app.web import charts

    view = view_from_events(
        "r", synthetic_run(groups=6, group_size=2, batch_groups=2), RunMeta(state="running")
    )
    context = run_context(replace(view, staleness=staleness))
    page = Dashboard(AccessConfig(None, None)).render("run.html", context, "trainer")
    chart = dict(re.findall(r'aria-label="([^"]+)"(.*?)</svg>', page, re.DOTALL))[
        "staleness of delivered groups"
    ]
    ticks = re.findall(rf'<text x="([\d.]+)" y="{charts.H - charts.PAD_B + 11}"[^>]*>([^<]+)</text>', chart)
    return [(float(x), text) for x, text in ticks], re.findall(r"<rect [^>]*><title>([^<]+)</title>", chart)


def test_a_wide_staleness_range_is_binned_on_an_even_axis_with_tick_labels_that_do_not_overlap():
    # After K was raised to 10000 delivered staleness ran from 0 to 116: the chart drew a bar for each
    # of the ~40 numbers present, three tall ones a few pixels wide at the far left, and (past 24 bars)
    # no tick label at all, only "versions behind".
    from app.web import charts

    staleness = {0: 900, 1: 1500, 2: 1200} | {v: 300 // v for v in range(3, 117, 3)} | {116: 1}
    ticks, bars = _staleness_chart(staleness)
    assert len(ticks) >= 4
    values = [int(text) for _, text in ticks]
    steps = {b - a for a, b in itertools.pairwise(values)}
    assert values[0] == 0
    assert len(steps) == 1  # evenly spaced
    assert values[-1] <= 116 < values[-1] + 2 * steps.pop()
    for (x1, t1), (x2, t2) in itertools.pairwise(ticks):
        assert x2 - x1 >= (charts._label_width(t1) + charts._label_width(t2)) / 2 + 2, f"{t1} runs into {t2}"
    assert len(bars) <= charts.MAX_BINS
    assert sum(int(title.rsplit(": ", 1)[1].replace(",", "")) for title in bars) == sum(staleness.values())
    assert bars[-1] == "115–119: 1"  # a bin's title names the numbers it counts


def test_a_narrow_staleness_range_has_a_bar_and_a_label_for_every_number_present_or_not():
    # A number no group was delivered at is an empty bar: 0 and 3 were drawn side by side, like 0 and 1.
    ticks, bars = _staleness_chart({0: 5, 3: 2})
    assert [text for _, text in ticks] == ["0", "1", "2", "3"]
    assert bars == ["0: 5", "1: 0", "2: 0", "3: 2"]


def test_a_chart_s_top_value_is_written_level_with_the_top():
    # The top value was written 8 px below the top, so a point at 100% idle sat above its '100%'.
    from app.web import charts

    svg = charts.line_chart("idle", [(1.0, 100.0), (2.0, 50.0)], "%", top=100.0)
    top = float(re.search(r'<text [^>]*y="([\d.]+)"[^>]*>100%</text>', svg).group(1))
    dot = float(re.search(r'<circle cx="[\d.]+" cy="([\d.]+)"[^>]*><title>1.0 s: 100%', svg).group(1))
    assert dot == charts.PAD_T
    assert 0 < top - dot < 5  # a 10 px label's middle, on the line
    assert f'y1="{charts.PAD_T}" x2="{charts.W - charts.PAD_R}" y2="{charts.PAD_T}" stroke="#e6e6e6"' in svg


def test_a_long_run_s_per_step_chart_labels_every_nth_step_without_overlap():
    # Past 24 trainer steps the batch collection and tokens/s charts dropped every label: a 670-batch
    # run's charts said only "trainer step" under a wall of bars.
    from app.web import charts

    labels = [str(i) for i in range(670)]
    svg = charts.bar_chart("collection time per step", labels, [1.0] * 670, " s", x_label="trainer step")
    ticks = re.findall(rf'<text x="([\d.]+)" y="{charts.H - charts.PAD_B + 11}"[^>]*>([^<]+)</text>', svg)
    assert len(ticks) >= 5
    assert ticks[0][1] == "0"
    for (x1, t1), (x2, t2) in itertools.pairwise((float(x), t) for x, t in ticks):
        assert x2 - x1 >= (charts._label_width(t1) + charts._label_width(t2)) / 2 + 2, f"{t1} runs into {t2}"
    few = charts.bar_chart("t", ["0", "1", "2"], [1.0, 2.0, 3.0])
    assert len(re.findall(rf'y="{charts.H - charts.PAD_B + 11}"', few)) == 3  # all fit: each labelled
    # every label inside the chart: the last of a long run's was cut at the right edge (1079 for 10989)
    wide = charts.bar_chart("t", [str(i) for i in range(10_101)], [1.0] * 10_101)  # 10098 was at x 349.5
    for x, text in re.findall(
        rf'<text x="([\d.]+)" y="{charts.H - charts.PAD_B + 11}"[^>]*>([^<]+)</text>', wide
    ):
        half = 5.04 * len(text) / 2  # the tick labels' 9 px font
        assert half <= float(x) <= charts.W - half, text


@pytest.fixture
def outage_view():
    """A simulated run with every engine down from 10 s to 25 s, mid-turn (simulated outside the test's
    event loop)."""
    down = [{"kind": "engine_down", "engine": e, "at_s": 10.0, "for_s": 15.0} for e in (0, 1)]
    workload = Workload.model_validate(make_workload_data(batches=6, faults=down))
    envelopes: list[Envelope] = []
    # No agent-phase gate: the figures below are those of every attempt in its agent phase at once.
    simulate(workload, policy_for(workload, "full", agent_gate=None), "full", events=envelopes.append)
    return view_from_events("live-1", envelopes, RunMeta(state="running"))


async def test_the_run_page_names_an_engine_outage_on_the_critical_path(outage_view):
    # The wait the outage caused read as model turns and engine-slot waits.
    client, _ = make_client(live=OneRun(outage_view))
    async with client:
        page = (await client.get("/runs/live-1")).text
    assert re.search(r"<td>engine outages</td><td class=\"num\">18\.5</td>", page)
    assert re.search(r"engine outages \(18\.5 s\)", page)  # batch 0: who held it, and by what


def long_run_events(batches=5000):
    """A small synthetic run followed by `batches` more trainer steps (waits of 1 to 7 s) and a policy
    change every other step: the stream of a long run, as far as the live blocks are concerned."""
    from app.core.events import BatchDelivered, BatchRequested

    events = synthetic_run(groups=6, group_size=2, batch_groups=2)
    seq, t = events[-1].seq, events[-1].t
    first = max(e.event.batch_index for e in events if e.event.kind == "batch_delivered") + 1
    for i in range(first, first + batches):
        wait = 1.0 + i % 7
        events.append(Envelope("synthetic", seq + 1, t, BatchRequested(i)))
        events.append(Envelope("synthetic", seq + 2, t + wait, BatchDelivered(i, (), i, t, t + wait)))
        seq, t = seq + 2, t + wait + 2.0
        if i % 2:
            seq += 1
            events.append(Envelope("synthetic", seq, t, PolicyChanged("max_staleness", i, i + 1, "operator")))
    return events


def test_a_long_run_s_live_blocks_and_charts_stay_small_and_say_how_they_bucket():
    # The trainer block drew a bar (or a point) per trainer step in each chart and was re-sent every
    # 0.5 s: 756 KB at 1,260 batches. Its charts bucket steps now (at most MAX_BARS bars: each the mean
    # of k steps, a tick at their max), and the audit lists its latest rows.
    from app.web import charts
    from app.web.readmodel import AUDIT_KEPT
    from app.web.views import LIVE_BLOCKS

    view = view_from_events("synthetic", long_run_events(), RunMeta(state="running"))
    assert len(view.batches) > 5000
    dash = Dashboard(AccessConfig(None, None))
    ctx = run_context(view)
    blocks = {b: dash.render("run.html", ctx, b) for b in LIVE_BLOCKS}
    assert len(blocks["trainer"]) < 60_000
    assert sum(len(html) for html in blocks.values()) < 80_000
    found = dict(re.findall(r'aria-label="([^"]+)"(.*?)</svg>', blocks["trainer"], re.DOTALL))
    # k steps a bar, k as small as the series' buckets allow: a power of 2 past 200 steps
    k, _ = view.trend.collection.marks(charts.MAX_BARS)
    assert -(-len(view.batches) // charts.MAX_BARS) <= k < 2 * -(-len(view.batches) // charts.MAX_BARS)
    collection = found[f"batch collection time per step: a bar is the mean of {k} steps, its tick their max"]
    assert f"trainer step ({k} a bar: the mean; a tick at the max)" in collection
    bars = re.findall(r"<rect [^>]*><title>([^<]+)</title>", collection)
    assert len(bars) == -(-len(view.batches) // k) <= charts.MAX_BARS
    head = view.batches[:k]
    mean, most = charts._num(sum(b.wait_s for b in head) / k), charts._num(max(b.wait_s for b in head))
    assert bars[0] == f"{head[0].index}–{head[-1].index}: mean {mean} s, max {most} s"
    assert f"tokens/s per step: a bar is the mean of {k} steps" in blocks["trainer"]
    idle = found[f"trainer idle fraction, last 10 batches: a point is the mean of {k} batches"]
    assert len(re.findall("<circle", idle)) <= charts.MAX_POINTS
    assert len(view.audit) == AUDIT_KEPT < view.audit_total
    assert f'id="audit-kept">(the latest {AUDIT_KEPT} of {view.audit_total})' in blocks["policy"]
    assert blocks["policy"].count("<li>") == AUDIT_KEPT


def test_the_idle_chart_follows_the_last_batches_so_a_late_change_shows():
    """The chart was the whole run's idle fraction: after S and K were cut late in a run, its batches
    took twice as long and the line moved from 56% to 59%."""
    from app.web.readmodel import BatchRow
    from app.web.views import rolling_idle

    # 30 batches of 1 s wait and 1 s step (50% idle), then 10 of 3 s wait and 1 s step (75%)
    batches, t = [], 0.0
    for i, wait in enumerate([1.0] * 30 + [3.0] * 10):
        batches.append(BatchRow(i, t, t + wait, wait))
        t += wait + 1.0
    points = rolling_idle(batches)
    assert len(points) == 40
    assert [t for t, _ in points] == [b.delivered for b in batches]
    assert points[0][1] == 100.0  # the first batch: asked for and waited on, nothing else yet
    assert points[29][1] == pytest.approx(100 * 10 / 19)  # 10 waits of 1 s in the 19 s from the 21st ask
    assert points[-1][1] == pytest.approx(100 * 30 / 39)  # the last 10: 30 s of waiting in 39 s
    cumulative = sum(b.wait_s for b in batches) / batches[-1].delivered
    assert points[-1][1] > 100 * cumulative + 10  # the whole run's figure lags it


def test_a_run_admitting_by_attempts_says_so_beside_its_policy():
    """Its B + S counts attempts, (B + S)·G of them in flight: the policy line says so, as a simulated
    run's report gives it; a run admitting by groups shows the line as before."""
    from app.web.readmodel import view_from_report

    workload = Workload.model_validate(make_workload_data(batches=2))
    dash = Dashboard(AccessConfig(None, None))
    lines = {}
    for mode in ("attempts", "in_flight"):
        report = simulate(workload, policy_for(workload, "full", admission=mode), "full")
        page = dash.render("run.html", run_context(view_from_report(f"replay-{mode}", report)))
        lines[mode] = re.search(r'<p class="policy">(.*?)</p>', page, re.DOTALL).group(1)
    assert "admission by attempts ((B + S)·G in flight)" in lines["attempts"]
    assert "admission" not in lines["in_flight"]


def test_the_policy_line_gives_the_agent_gate_of_a_run_that_has_one():
    """`full` has the gate (factor 1 unless told otherwise): the line under the run's title gives it
    beside S and K; a run without one (another rung, or `agent_gate` 0 at launch) leaves it out."""
    from app.web.readmodel import view_from_report

    workload = Workload.model_validate(make_workload_data(batches=2))
    dash = Dashboard(AccessConfig(None, None))
    lines = {}
    for label, policy in {
        "full": policy_for(workload, "full"),
        "factor 2.5": policy_for(workload, "full", agent_gate=2.5),
        "none": policy_for(workload, "full", agent_gate=None),
        "sync": policy_for(workload, "sync"),
    }.items():
        report = simulate(workload, policy, "full")
        page = dash.render("run.html", run_context(view_from_report(f"replay-{label}", report)))
        lines[label] = re.search(r'<p class="policy">(.*?)</p>', page, re.DOTALL).group(1)
    assert '<b>agent gate</b> <span id="policy-gate">1</span>' in lines["full"]
    assert '<span id="policy-gate">2.5</span>' in lines["factor 2.5"]
    assert "agent gate" not in lines["none"]
    assert "agent gate" not in lines["sync"]


def test_the_lanes_card_says_whom_the_lanes_serve_first_when_they_say_it():
    """Live lanes give their order (`lanes.order`): one line under the Lanes table, not a column that
    repeats it per lane; a replayed run, whose lanes do not say it, has no such line."""
    from dataclasses import replace

    from app.web.live import lane_order_text
    from app.web.readmodel import view_from_report

    workload = Workload.model_validate(make_workload_data(batches=2))
    view = view_from_report("replay-lanes", simulate(workload, policy_for(workload, "full"), "full"))
    dash = Dashboard(AccessConfig(None, None))
    assert 'id="lanes-order"' not in dash.render("run.html", run_context(view))
    served = lane_order_text("oldest_group", True)
    assert served == "oldest group first (its queued work and, by niceness, CPU time)"
    live = replace(view, lanes=[replace(lane, order=served) for lane in view.lanes])
    page = dash.render("run.html", run_context(live))
    assert re.search(
        r'id="lanes-order"[^>]*>Served: oldest group first \(its queued work and, by niceness, CPU time\)\.',
        page,
    )
    assert lane_order_text("oldest_group", False) == "oldest group first (its queued work only)"
    assert lane_order_text("fifo", True) == "first come, first served"
    assert lane_order_text(None, True) is None


def test_a_negative_zero_gate_is_zero():
    """-0 passed `0 <= value`, and the dashboard said "Applied agent gate = -0." and stored -0.0."""
    import math

    from app.core.config import PolicyConfig
    from app.web.views import parse_policy_form

    assert math.copysign(1.0, parse_policy_form({"agent_gate": "-0"})["agent_gate"]) == 1.0
    gate = PolicyConfig(agent_gate=-0.0).agent_gate
    assert gate is not None
    assert math.copysign(1.0, gate) == 1.0


def test_the_reward_chart_draws_each_step_s_mean_and_says_its_learning_signal():
    from app.web.readmodel import BatchRow
    from app.web.views import reward_chart

    rows = [
        BatchRow(0, 0.0, 5.0, 5.0, mean_reward=0.25, trainable=0.5),
        BatchRow(1, 5.0, 7.0, 2.0),  # a batch of a report from before rewards were kept: left out
        BatchRow(2, 7.0, 9.0, 2.0, mean_reward=1.0, trainable=0.0),
    ]
    svg = reward_chart(rows, "no data yet")
    assert svg.count("<rect") == 2
    assert "step 0: mean reward 0.25; 50% of its groups with a learning signal" in svg
    assert "step 2: mean reward 1; 0% of its groups with a learning signal" in svg
    assert "no data yet" in reward_chart(rows[1:2], "no data yet")
    # Rewards in [-1, 1]: one step below 0 replaced the whole chart with a note (a live run has no
    # report to look at). A negative mean hangs below a 0 line; the axis runs down to it.
    import re

    signed = reward_chart(
        [BatchRow(0, 0.0, 1.0, 1.0, mean_reward=-0.5), BatchRow(1, 1.0, 2.0, 1.0, mean_reward=0.5)], ""
    )
    bars = [
        tuple(map(float, m))
        for m in re.findall(r'<rect x="[^"]+" y="([^"]+)" width="[^"]+" height="([^"]+)"', signed)
    ]
    assert len(bars) == 2
    (neg_y, neg_h), (pos_y, pos_h) = bars
    assert neg_h == pytest.approx(pos_h)
    assert neg_h > 0
    assert neg_y == pytest.approx(pos_y + pos_h)  # one starts where the other ends: at the 0 line
    zero = re.search(r'<text x="[^"]+" y="([^"]+)"[^>]*>0</text>', signed)
    assert zero is not None
    assert float(zero.group(1)) - 3.5 == pytest.approx(neg_y, abs=0.1)
    assert ">-0.5</text>" in signed
    assert ">0.5</text>" in signed
    assert "step 0: mean reward -0.5" in signed


def test_the_reward_chart_of_a_long_run_still_says_its_learning_signal():
    # Past 100 steps a bar is several steps, and its hover said only their rewards' mean and max: the
    # learning-signal share, what the chart is for, was gone from every long run's chart.
    from app.web.readmodel import BatchRow
    from app.web.views import reward_chart

    rows = [
        BatchRow(i, i, i + 1.0, 1.0, mean_reward=0.5, trainable=0.25 if i % 2 else 0.75) for i in range(150)
    ]
    rows[11] = replace(rows[11], trainable=0.0)
    svg = reward_chart(rows, "no data yet")
    assert "a bar is the mean of 2 steps" in svg
    assert "0–1: mean 0.5, max 0.5; 50% of their groups with a learning signal (the lowest step 25%)" in svg
    assert "10–11: mean 0.5, max 0.5; 38% of their groups with a learning signal (the lowest step 0%)" in svg
    assert svg.count("of their groups with a learning signal") == 75


async def test_a_group_s_page_lists_each_attempt_s_turns_and_sandbox_operations_in_order():
    # The timeline showed a group's spans only as hovers on slivers; an operator asking why one attempt
    # took long had no list of its turns, versions and lane operations.
    client, dash = make_client()
    view = dash.find("replay-1")[1]
    group = next(g for g in view.groups if g.outcome == "delivered")
    async with client:
        run = (await client.get("/runs/replay-1")).text
        page = await client.get(f"/runs/replay-1/groups/{group.group_id}")
        missing = await client.get("/runs/replay-1/groups/99999")
        bad = await client.get("/runs/replay-1/groups/g1")
        no_run = await client.get(f"/runs/nope/groups/{group.group_id}")
        huge = await client.get(f"/runs/replay-1/groups/{'9' * 5000}")  # more digits than int() takes
    assert f'<a href="/runs/replay-1/groups/{group.group_id}">' in run  # the timeline's label links it
    assert page.status_code == 200
    assert f"<h1>Group {group.group_id} " in page.text
    assert f"in batch {group.batch}" in page.text
    trajs = [t for (gid, _), t in sorted(view.trajectories.items()) if gid == group.group_id]
    assert page.text.count('class="card attempt"') == len(trajs) == 2
    sections = page.text.split('class="card attempt"')[1:]
    for traj, section in zip(trajs, sections, strict=True):
        assert f'<dd class="reward">{traj.reward:g}</dd>' in section
        turns = sum(1 for x in traj.spans if x.phase == "model_turn")
        assert f'<dd class="turns">{turns}</dd>' in section
        # versions as the timeline marks them: "2" beside "model turns 1" read as two versions
        shown = ", ".join(f"v{v}" for _, v in traj.versions)
        assert f'<dd class="versions">{shown}</dd>' in section
        assert re.search(rf"<dt>policy versions?</dt><dd class=\"versions\">{shown}</dd>", section)
        assert section.count('class="span-row"') == len(traj.spans)
        row = r'<tr class="span-row"><td class="num">\d+</td><td>[^<]*</td><td class="num">([0-9.]+)'
        starts = [float(m) for m in re.findall(row, section)]
        assert starts == sorted(starts)
        assert "model turn" in section
        assert "exec lane" in section  # a tool call's lane and status
    assert missing.status_code == 404
    assert "run replay-1 has no group 99999" in missing.text
    assert 'href="/runs/replay-1"' in missing.text  # back to the run
    assert bad.status_code == 404
    assert "a group is a whole number" in bad.text
    assert no_run.status_code == 404
    assert huge.status_code == 404
    assert f"run replay-1 has no group {'9' * 5000}" in huge.text  # it said "a group is a whole number"


async def test_a_group_no_longer_kept_says_where_its_events_are():
    events = synthetic_run(groups=12, group_size=2, batch_groups=2)
    view = replace(view_from_events("live-1", events, RunMeta(state="running")), source="live")
    first = view.groups[0].group_id
    client, _ = make_client(live=OneRun(replace(view, groups=view.groups[1:], dropped_groups=1)))
    async with client:
        gone = await client.get(f"/runs/live-1/groups/{first}")
        kept = await client.get(f"/runs/live-1/groups/{view.groups[1].group_id}")
    assert gone.status_code == 404
    assert "(groups no longer kept: 1); GET /api/runs/live-1/timeline has every event" in gone.text
    assert kept.status_code == 200
    assert "A snapshot: reload for what happened since." in kept.text


async def test_a_group_s_page_says_a_failure_s_score_the_clean_up_after_a_finish_and_how_long_one_runs():
    # A failed attempt read "reward 0" as a real zero score; "took 11.1 s" left out a clean-up that ran
    # to 52.7 s without saying so; an attempt still running said only "in progress".
    from app.web.readmodel import Span, Trajectory

    events = synthetic_run(groups=4, group_size=3, batch_groups=2)
    view = replace(view_from_events("live-1", events, RunMeta(state="running")), source="live")
    gid = view.groups[0].group_id
    trajs = {
        (gid, 0): Trajectory(
            gid,
            0,
            [Span(1.0, 4.0, "model_turn"), Span(4.0, 9.0, "validate")],
            error="SimInfraError",
            reward=0.0,
            started=1.0,
            finished=4.0,
        ),
        (gid, 1): Trajectory(
            gid,
            1,
            [Span(1.0, 11.0, "model_turn"), Span(11.0, 52.7, "cleanup")],
            reward=1.0,
            started=1.0,
            finished=11.0,
        ),
        (gid, 2): Trajectory(gid, 2, [Span(2.0, 30.0, "model_turn")], started=2.0),
    }
    others = {k: t for k, t in view.trajectories.items() if k[0] != gid}
    client, _ = make_client(live=OneRun(replace(view, trajectories={**others, **trajs}, now=62.0)))
    async with client:
        page = await client.get(f"/runs/live-1/groups/{gid}")
    assert page.status_code == 200
    failed, done, running = page.text.split('class="card attempt"')[1:]
    assert '0 <small class="muted">(it failed: the score of a failure)</small>' in failed
    assert "SimInfraError" in failed
    assert '<dd class="took">3.0 s <small class="muted">(clean-up until 9.0 s)</small>' in failed
    assert '<dd class="reward">1</dd>' in done
    assert '<dd class="took">10.0 s <small class="muted">(clean-up until 52.7 s)</small>' in done
    assert "in progress since 2.0 s: 60.0 s at 62.0 s" in running
    assert '<dd class="took">—</dd>' in running


def test_the_duration_chart_counts_completed_groups_by_whole_seconds_from_admission():
    # The timeline shows each group, not how many ran long: the spread that S has to cover.
    from app.web.views import duration_chart

    events = synthetic_run(groups=6, group_size=2, batch_groups=2)
    view = view_from_events("replay-1", events, RunMeta(state="running"))
    groups = [
        GroupRow(1, admitted=0.0, ready=3.2, outcome="delivered"),
        GroupRow(2, admitted=1.0, ready=4.9, outcome="delivered"),
        GroupRow(3, admitted=2.0, ready=9.5, outcome="ready"),
        GroupRow(4, admitted=2.0, outcome="in flight"),  # not completed: left out
    ]
    svg = duration_chart(replace(view, groups=groups), "no data yet")
    assert "<title>3: 2</title>" in svg  # 3.2 and 3.9 s
    assert "<title>7: 1</title>" in svg  # 7.5 s
    assert svg.count("<rect") == 5  # 3 to 7 s, one bar a second: from the least, not from 0
    assert "the latest groups kept" not in svg
    kept = duration_chart(replace(view, groups=groups, dropped_groups=3), "")
    assert "group time, admission to completion (the latest groups kept)" in kept
    assert "no data yet" in duration_chart(replace(view, groups=groups[3:]), "no data yet")
