"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) against a live
`corral serve` (uvicorn in a subprocess) with a simulated run in progress, paced to the wall clock.

The run: 3 engines that take 1.5 s to load weights, trajectories of a few seconds, and the built-in
sentinel trainer with a 30 s step, so after its first batch no version is published but ours while
collection goes on. Screenshots of the runs page and the run page go to $CORRAL_SCREENSHOTS when it is
set (`make screenshots` sets it to docs/screenshots/, the README's), else to the test's temporary
directory, so a test run leaves the committed ones alone.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TOKEN = "browser-operator-token"
ROOT = Path(__file__).resolve().parents[2]
SHOTS_ENV = "CORRAL_SCREENSHOTS"

if not os.path.exists(CHROMIUM):
    pytest.skip("no /usr/bin/chromium (scripts/test-setup.sh installs it)", allow_module_level=True)
if not (ROOT / "node_modules" / "htmx.org").is_dir():
    pytest.skip("no node_modules/htmx.org (make install runs npm ci)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_run_spec(update_s: float = 1.5, llm_s: float = 0.8, **overrides: object) -> dict[str, object]:
    workload = {
        "seed": 1,
        "batches": 1000,
        "batch": {"groups": 2, "group_size": 2},
        "policy": {"surplus_groups": 4, "max_staleness": 2},
        "engines": {"count": 3, "slots": 4, "update_s": update_s},
        "cpus": {"total": 8, "serving": 2},
        "lanes": {"reset": 4, "exec": 4, "validate": 2, "cleanup": 2},
        "trajectory": {
            "reset_s": {"uniform": [0.1, 0.4]},
            "turns": {"uniform": [3, 6]},
            "llm_s": {"uniform": [0.2, llm_s]},
            "tool_s": 0.2,
            "validate_s": 0.2,
            "cleanup_s": 0.1,
            "timeout_s": 120,
        },
    }
    spec: dict[str, object] = {
        "name": "browser-demo",
        "kind": "sim",
        "trainer": "sentinel",
        "sentinel_step_s": 30.0,
        "workload": workload,
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`corral serve`'s app on uvicorn in a subprocess, on a fresh SQLite database."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp / 'corral.db'}",
        "CORRAL_DATA_DIR": str(tmp / "data"),
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_RESUME_RUNS": "false",
    }
    cmd = [sys.executable, "-m", "uvicorn", "--factory", "app.api.app:create_app",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
    log = (tmp / "server.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {(tmp / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code in (200, 503):
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start within 60 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def api(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def run_id(api: httpx.Client) -> str:
    created = api.post("/api/runs", json=make_run_spec())
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def new_page(browser: object, server: str, signed_in: bool) -> object:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(server + "/")
    if signed_in:
        page.get_by_label("Operator token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_load_state()
    return page


def span_count(page: object) -> int:
    return int(page.locator("#timeline-svg").get_attribute("data-spans") or 0)  # type: ignore[attr-defined]


def engine_versions(page: object) -> dict[str, tuple[int, str]]:
    """Each engine row's version and state, read in one go (a live update may swap the rows)."""
    rows = page.evaluate(  # type: ignore[attr-defined]
        """() => Array.from(document.querySelectorAll('#engines tr[data-engine]')).map(r => [
            r.dataset.engine,
            r.querySelector('.engine-version').innerText,
            r.querySelector('.state').innerText])"""
    )
    return {name: (int(version.lstrip("v")), state) for name, version, state in rows}


def test_runs_page_lists_the_run(browser: object, server: str, run_id: str) -> None:
    page = new_page(browser, server, signed_in=True)
    row = page.locator(f'tr[data-run="{run_id}"]')
    sync_api.expect(row).to_contain_text("running")
    assert page.title() == "Corral — runs"
    sync_api.expect(page.locator("#runs")).to_contain_text("browser-demo")
    page.context.close()


def test_a_run_launched_from_the_form_runs_and_stops_from_its_page(
    browser: object, server: str, run_id: str, api: httpx.Client
) -> None:
    page = new_page(browser, server, signed_in=True)
    page.get_by_label("Policy").select_option("lanes")
    page.get_by_label("S (surplus groups)").fill("1")
    page.get_by_label("Agent gate").fill("2.5")  # lanes has none of its own
    page.get_by_label("Batches").fill("50")
    page.get_by_role("button", name="Launch").click()
    page.wait_for_url(f"{server}/runs/*")
    launched = page.url.rsplit("/", 1)[1]
    assert launched != run_id
    run = api.get(f"/api/runs/{launched}").json()
    assert (run["config"]["policy"], run["policy"]["surplus_groups"]) == ("lanes", 1)
    assert run["policy"]["agent_gate"] == 2.5
    sync_api.expect(page.locator("#current-gate")).to_have_text("2.5")
    page.get_by_role("button", name="Stop the run after this step").click()
    sync_api.expect(page.locator("#stop-msg")).to_contain_text("Stopping")
    deadline = time.monotonic() + 30
    while api.get(f"/api/runs/{launched}").json()["state"] not in ("stopped", "completed"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    sync_api.expect(page.locator("#run-state")).to_have_text("stopped")
    sync_api.expect(page.locator("#stop-msg")).to_have_count(0)  # 'Stopping ...' stayed under the badge
    # The live controls go as the run ends (the stream swaps them out), and stay gone on a reload.
    for _ in range(2):
        for name in ("Stop the run after this step", "Publish weights", "Apply live"):
            sync_api.expect(page.get_by_role("button", name=name)).to_have_count(0)
        sync_api.expect(page.locator("#policy-final")).to_be_visible()
        page.reload()
    page.context.close()


def test_a_run_paused_through_the_api_is_resumed_and_paused_again_from_its_page(
    browser: object, server: str, api: httpx.Client
) -> None:
    # A run paused through the API (POST /api/runs/{id}/pause) showed nothing on its page to resume
    # it with: an operator at the browser could not. Its page now offers Resume (live, without a
    # reload), and a running run Pause.
    created = api.post("/api/runs", json=make_run_spec(name="pause-demo"))
    assert created.status_code == 201, created.text
    paused_id = str(created.json()["id"])

    def state() -> str:
        return str(api.get(f"/api/runs/{paused_id}").json()["state"])

    def wait_state(want: str) -> None:
        deadline = time.monotonic() + 30
        while state() != want:
            assert time.monotonic() < deadline, f"the run did not become {want}: {state()}"
            time.sleep(0.2)

    wait_state("running")
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{paused_id}")
    pause, resume = page.get_by_role("button", name="Pause"), page.get_by_role("button", name="Resume")
    sync_api.expect(pause).to_have_count(1)
    sync_api.expect(resume).to_have_count(0)
    assert api.post(f"/api/runs/{paused_id}/pause").status_code == 200
    sync_api.expect(resume).to_have_count(1)  # swapped in by the live stream
    sync_api.expect(pause).to_have_count(0)
    sync_api.expect(page.locator("#run-state")).to_have_text("paused")
    sync_api.expect(page.locator("#paused-note")).to_be_visible()

    resume.click()
    sync_api.expect(page.locator("#pause-msg")).to_contain_text("Resumed")
    wait_state("running")
    sync_api.expect(page.locator("#run-state")).to_have_text("running")
    sync_api.expect(pause).to_have_count(1)

    pause.click()
    sync_api.expect(page.locator("#pause-msg")).to_contain_text("Paused")
    wait_state("paused")
    sync_api.expect(resume).to_have_count(1)
    page.reload()
    sync_api.expect(resume).to_have_count(1)

    # A stopped run offers neither.
    page.get_by_role("button", name="Stop the run after this step").click()
    wait_state("stopped")
    sync_api.expect(page.locator("#run-state")).to_have_text("stopped")
    sync_api.expect(page.locator("#stop-msg")).to_have_count(0)  # 'Stopping ...' stayed under the badge
    sync_api.expect(page.locator("#pause-msg")).to_have_count(0)  # so could 'Paused: ...'
    sync_api.expect(pause).to_have_count(0)
    sync_api.expect(resume).to_have_count(0)
    page.context.close()


def test_timeline_bars_grow_without_a_reload(browser: object, server: str, run_id: str) -> None:
    page = new_page(browser, server, signed_in=False)
    page.goto(f"{server}/runs/{run_id}")
    assert page.title() == f"Corral — run {run_id}"
    page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
    sync_api.expect(page.locator("#timeline-svg rect.sp").first).to_be_visible()
    first = span_count(page)
    deadline = time.monotonic() + 20
    while span_count(page) <= first and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert span_count(page) > first
    assert page.locator("#timeline-svg rect.sp").count() > first
    assert page.evaluate("window.__loadedOnce") is True
    width = float(page.locator("#timeline-svg").get_attribute("width") or 0)
    page.get_by_role("link", name="zoom in on time").click()
    sync_api.expect(page.locator("#zoom-label")).to_have_text("Zoom ×2")
    zoomed = float(page.locator("#timeline-svg").get_attribute("width") or 0)
    assert zoomed > 1.5 * width  # time stretched (the gutter is not)
    assert page.evaluate("document.getElementById('tl-scroll').scrollWidth") > width
    assert page.evaluate("window.__loadedOnce") is True  # zoomed in place, no navigation
    page.context.close()


def test_the_timeline_legend_fits_the_page_without_scrolling(
    browser: object, server: str, run_id: str
) -> None:
    # At 1400 px the legend was one line wider than its box, clipped behind a horizontal scroll bar.
    page = new_page(browser, server, signed_in=False)
    page.goto(f"{server}/runs/{run_id}")
    legend = page.locator(".legend")
    sync_api.expect(legend).to_contain_text("batch delivered")
    assert page.evaluate("(e) => e.scrollWidth <= e.clientWidth", legend.element_handle())
    right = page.evaluate("(e) => e.getBoundingClientRect().right", legend.element_handle())
    for label in ("reset", "cleanup", "weights published", "policy version changes"):
        item = legend.get_by_text(label, exact=False).first
        sync_api.expect(item).to_be_visible()
        assert page.evaluate("(e) => e.getBoundingClientRect().right", item.element_handle()) <= right
    page.context.close()


# The lines each element's text takes (distinct tops of its text's boxes), for those that take more than one.
WRAPPED = """(els) => els.map(e => {
    const range = document.createRange(); range.selectNodeContents(e);
    const tops = new Set(Array.from(range.getClientRects()).map(r => Math.round(r.top)));
    return [e.innerText, tops.size];
}).filter(([, lines]) => lines > 1)"""


def test_numbers_with_units_and_badges_do_not_wrap_in_a_narrow_window(
    browser: object, server: str, run_id: str
) -> None:
    # At 800 px the critical path's waits read "0.6" over "s", and badges "✓" over "completed".
    context = browser.new_context(viewport={"width": 800, "height": 1200})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.goto(f"{server}/runs/{run_id}")
    sync_api.expect(page.locator("#wait td.num").first).to_be_visible(timeout=60_000)
    assert page.locator("#wait td.num, #run-state").evaluate_all(WRAPPED) == []
    page.goto(f"{server}/")
    assert page.locator(".badge").evaluate_all(WRAPPED) == []
    context.close()


def test_publish_weights_moves_engines_one_by_one(
    browser: object, server: str, run_id: str, api: httpx.Client
) -> None:
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run_id}")
    sync_api.expect(page.locator("#engines tr[data-engine]")).to_have_count(3)
    # Wait for the sentinel trainer's first step to settle: every engine on the same version.
    deadline = time.monotonic() + 30
    while len({v for v, _ in engine_versions(page).values()}) != 1 and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    before = max(v for v, _ in engine_versions(page).values())
    page.get_by_role("button", name="Publish weights").click()
    target = before + 1
    seen: list[tuple[int, ...]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        versions = engine_versions(page)
        state = tuple(sorted(v for v, _ in versions.values()))
        if not seen or seen[-1] != state:
            seen.append(state)
        assert sum("updating" in s for _, s in versions.values()) <= 1, versions  # one at a time
        if all(v >= target for v, _ in versions.values()):
            break
        page.wait_for_timeout(100)
    done = [sum(v >= target for v in state) for state in seen]
    assert done[-1] == 3, seen
    assert {1, 2} <= set(done), seen  # the page showed one, then two engines on the new version
    assert done == sorted(done), seen
    live = api.get(f"/api/runs/{run_id}").json()["live"]
    assert all(v >= target for v in live["engine_versions"].values())
    page.context.close()


def policy_page(browser: object, server: str, run_id: str, api: httpx.Client, knob: str) -> tuple[Any, Any]:
    """The run's page, signed in, and the run's `knob` (a policy field) as the API says it is."""
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run_id}")
    return page, api.get(f"/api/runs/{run_id}").json()["policy"][knob]


def test_changing_k_in_the_form_changes_it_in_the_api(
    browser: object, server: str, run_id: str, api: httpx.Client
) -> None:
    page, current = policy_page(browser, server, run_id, api, "max_staleness")
    new = current + 3
    page.get_by_label("K (staleness bound)").fill(str(new))
    page.get_by_role("button", name="Apply live").click()
    sync_api.expect(page.locator("#current-k")).to_have_text(str(new))
    sync_api.expect(page.locator("#policy-k")).to_have_text(str(new))  # the head line, which stayed put
    sync_api.expect(page.locator("#audit")).to_contain_text(f"set max_staleness from {current} to {new}")
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["max_staleness"] == new
    page.context.close()


def test_opening_the_agent_gate_in_the_form_opens_it_in_the_api(
    browser: object, server: str, run_id: str, api: httpx.Client
) -> None:
    page, current = policy_page(browser, server, run_id, api, "agent_gate")
    sync_api.expect(page.locator("#current-gate")).to_have_text(f"{current:g}")
    for typed, shown in (("0", "0 (open)"), (f"{current:g}", f"{current:g}")):  # opened, then closed again
        page.get_by_label("Agent gate").fill(typed)
        page.get_by_role("button", name="Apply live").click()
        sync_api.expect(page.locator("#current-gate")).to_have_text(shown)
        assert api.get(f"/api/runs/{run_id}").json()["policy"]["agent_gate"] == float(typed)
    sync_api.expect(page.locator("#audit")).to_contain_text(f"set agent_gate from {current} to 0.0")
    page.context.close()


def test_a_large_change_is_confirmed_once_and_the_box_unticks_itself(
    browser: object, server: str, api: httpx.Client
) -> None:
    """Ticked for one large S, the box stayed ticked, and the next large S went through unconfirmed
    (898 groups admitted into a paused run)."""
    created = api.post("/api/runs", json=make_run_spec(name="large-change"))
    assert created.status_code == 201, created.text
    run = created.json()["id"]
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run}")
    try:
        api.post(f"/api/runs/{run}/pause")  # B = 2, G = 2, S = 4: 12 trajectories; no group admitted now
        box = page.locator("#p-large")
        for wanted in (40, 400):  # 84, then 804 trajectories: each over 4 times what runs
            page.get_by_label("S (surplus groups)").fill(str(wanted))
            page.get_by_role("button", name="Apply live").click()
            sync_api.expect(page.locator("#policy-msg")).to_contain_text("a large change")
            # htmx drops a submit while the form's last request is still finishing (it swaps first)
            sync_api.expect(page.locator("#policy-form")).not_to_have_class(re.compile("htmx-request"))
            box.check()
            page.get_by_role("button", name="Apply live").click()
            sync_api.expect(page.locator("#policy-msg")).to_have_text(f"Applied S = {wanted}.")
            # the run is paused: no later event brings the page its new S (the second stayed 40)
            sync_api.expect(page.locator("#current-s")).to_have_text(str(wanted))
            sync_api.expect(box).not_to_be_checked()
        assert api.get(f"/api/runs/{run}").json()["policy"]["surplus_groups"] == 400
    finally:
        api.post(f"/api/runs/{run}/stop")
        page.context.close()


def test_the_policy_form_changes_only_what_was_typed_in_it(
    browser: object, server: str, api: httpx.Client
) -> None:
    """The form, filled in as the page loaded, was sent whole: changing K alone there set S back to the
    page's 4 after the API had set it to 8."""
    created = api.post("/api/runs", json=make_run_spec(name="form-fields"))
    assert created.status_code == 201, created.text
    run = created.json()["id"]
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run}")

    def policy() -> tuple[int, int]:
        got = api.get(f"/api/runs/{run}").json()["policy"]
        return got["max_staleness"], got["surplus_groups"]

    def apply(field: str, value: int, said: str) -> None:
        sync_api.expect(page.locator("#policy-form")).not_to_have_class(re.compile("htmx-request"))
        page.get_by_label(field).fill(str(value))
        page.get_by_role("button", name="Apply live").click()
        sync_api.expect(page.locator("#policy-msg")).to_have_text(said)

    try:
        api.post(f"/api/runs/{run}/pause")  # no admission while S moves
        assert policy() == (2, 4)
        assert api.patch(f"/api/runs/{run}/policy", json={"surplus_groups": 8}).status_code == 200
        sync_api.expect(page.locator("#current-s")).to_have_text("8")
        sync_api.expect(page.locator("#policy-s")).to_have_text("8")  # and the page's head line
        # the field follows the policy the stream brings: it showed the page's 4 beside "Now: S = 8"
        sync_api.expect(page.get_by_label("S (surplus groups)")).to_have_value("8")
        apply("K (staleness bound)", 3, "Applied K = 3.")
        assert policy() == (3, 8)
        apply("S (surplus groups)", 4, "Applied S = 4.")  # the page's first value: a change now
        assert policy() == (3, 4)
        # once applied, what a field holds is what it shows: S typed and applied is not sent again
        apply("S (surplus groups)", 5, "Applied S = 5.")
        assert api.patch(f"/api/runs/{run}/policy", json={"surplus_groups": 7}).status_code == 200
        sync_api.expect(page.locator("#current-s")).to_have_text("7")
        apply("K (staleness bound)", 4, "Applied K = 4.")
        assert policy() == (4, 7)
    finally:
        api.post(f"/api/runs/{run}/stop")
        page.context.close()


def test_the_timeline_s_window_links_redraw_it_in_place_and_follow_the_run(
    browser: object, server: str, run_id: str
) -> None:
    page = new_page(browser, server, signed_in=False)
    page.goto(f"{server}/runs/{run_id}")
    page.evaluate("window.__loadedOnce = true")
    sync_api.expect(page.locator("#timeline-svg rect.sp").first).to_be_visible()
    page.get_by_role("link", name="last 5 min").click()
    sync_api.expect(page.locator("#timeline")).to_have_attribute("data-window", "300")
    sync_api.expect(page.get_by_role("link", name="last 5 min")).to_have_class(re.compile(r"\bcurrent\b"))
    # zooming keeps the window, and the live refreshes after it keep both
    page.get_by_role("link", name="zoom in on time").click()
    sync_api.expect(page.locator("#zoom-label")).to_have_text("Zoom ×2")
    zoom_in = page.get_by_role("link", name="zoom in on time").get_attribute("href") or ""
    assert "window=300" in zoom_in
    spans = span_count(page)
    deadline = time.monotonic() + 20
    while span_count(page) == spans and time.monotonic() < deadline:
        page.wait_for_timeout(250)
    assert page.locator("#timeline").get_attribute("data-window") == "300"
    assert page.locator("#timeline").get_attribute("data-zoom") == "2"
    page.get_by_role("link", name="whole run").click()
    sync_api.expect(page.locator("#timeline")).to_have_attribute("data-window", "")
    assert page.evaluate("window.__loadedOnce") is True  # all in place, no navigation
    page.context.close()


def test_a_live_stream_lost_while_the_server_answers_is_not_called_a_lost_server(
    browser: object, server: str, run_id: str
) -> None:
    """The stream fails alike when the server is gone and when it answers the stream 503 (its database
    away): the page said "Disconnected from the server" either way. It now asks /healthz, and says what
    it found (tests/web/test_browser_faults.py kills the server for the other case)."""
    page: Any = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run_id}")
    lost = page.locator("#live-lost")
    sync_api.expect(lost).to_be_hidden()
    page.evaluate("document.dispatchEvent(new Event('htmx:sseError'))")  # as htmx does on a failed stream
    sync_api.expect(lost).to_contain_text("Live updates stopped at")
    sync_api.expect(lost).to_contain_text("the server answers, but not its live stream")
    page.context.close()


def test_a_missing_group_s_page_fits_a_narrow_window(browser: object, server: str, run_id: str) -> None:
    """The 404 page quotes the group id typed into the URL: 300 digits made an 800 px page 2,700 px wide."""
    context = browser.new_context(viewport={"width": 800, "height": 600})  # type: ignore[attr-defined]
    page = context.new_page()
    try:
        answer = page.goto(f"{server}/runs/{run_id}/groups/{'9' * 300}")
        assert answer is not None
        assert answer.status == 404
        sync_api.expect(page.locator(".flash.error")).to_contain_text(f"has no group {'9' * 300}")
        assert page.evaluate("document.documentElement.scrollWidth") <= 800
    finally:
        context.close()


@pytest.mark.parametrize("path", ["/", "/runs/{run}", "/runs/{run}/groups/0"])
def test_a_phone_sized_window_scrolls_the_page_down_only(
    browser: object, server: str, run_id: str, path: str
) -> None:
    """At 390 px (a phone held upright), signed in: before, the launch form made the runs page 442 px
    wide, and the run page was 749 px wide (the wait bar's fixed 720 px, the timeline's window buttons,
    the legend's long items, the engines table's buttons). Wide tables and the timeline scroll in their
    own boxes; the page itself only scrolls down."""
    context = browser.new_context(viewport={"width": 390, "height": 844})  # type: ignore[attr-defined]
    page = context.new_page()
    page.set_default_timeout(20_000)
    try:
        page.goto(server + "/")
        page.get_by_label("Operator token").fill(TOKEN)
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_load_state()
        page.goto(server + path.format(run=run_id))
        if path == "/runs/{run}":
            sync_api.expect(page.locator("#wait td.num").first).to_be_visible(timeout=60_000)
            sync_api.expect(page.locator("#engines button").first).to_be_visible()
        wide = page.evaluate(
            """() => [document.documentElement.scrollWidth, document.documentElement.clientWidth]"""
        )
        assert wide[0] <= wide[1], f"{path}: the page is {wide[0]} px wide in a {wide[1]} px window"
    finally:
        context.close()


def test_an_action_without_the_operator_token_is_refused(
    browser: object, server: str, run_id: str, api: httpx.Client
) -> None:
    page = new_page(browser, server, signed_in=False)
    page.goto(f"{server}/runs/{run_id}")
    before = api.get(f"/api/runs/{run_id}").json()["policy"]["max_staleness"]
    page.get_by_label("K (staleness bound)").fill(str(before + 7))
    page.get_by_role("button", name="Apply live").click()
    sync_api.expect(page.locator("#policy-msg")).to_contain_text("refused: acting needs the operator token")
    page.get_by_role("button", name="Publish weights").click()
    sync_api.expect(page.locator("#publish-msg")).to_contain_text("refused: acting needs the operator token")
    assert api.get(f"/api/runs/{run_id}").json()["policy"]["max_staleness"] == before
    page.context.close()


def test_actions_are_reachable_from_the_keyboard(browser: object, server: str, run_id: str) -> None:
    page = new_page(browser, server, signed_in=True)
    page.goto(f"{server}/runs/{run_id}")
    reached = set()
    for _ in range(60):
        page.keyboard.press("Tab")
        label = page.evaluate("document.activeElement && (document.activeElement.innerText || '')")
        reached.add(label.strip())
    assert {"Publish weights", "Apply live", "Zoom in", "Zoom out"} <= reached
    page.context.close()


def test_screenshots_of_a_run_in_full_swing(
    browser: object, server: str, api: httpx.Client, tmp_path: Path
) -> None:
    """A second run with a quick trainer, screenshotted once it has delivered batches (for the README)."""
    shots = Path(os.environ.get(SHOTS_ENV) or tmp_path).resolve()
    spec = make_run_spec(update_s=0.4, llm_s=0.5, name="screenshot-demo", sentinel_step_s=0.5, speed=4.0)
    created = api.post("/api/runs", json=spec)
    assert created.status_code == 201, created.text
    run = str(created.json()["id"])
    deadline = time.monotonic() + 60
    while api.get(f"/api/runs/{run}").json()["live"]["batches"] < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
    page = new_page(browser, server, signed_in=True)
    sync_api.expect(page.locator(f'tr[data-run="{run}"]')).to_contain_text("running")
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "runs.png"), full_page=True)
    page.goto(f"{server}/runs/{run}")
    sync_api.expect(page.locator("#timeline-svg rect.sp").first).to_be_visible()
    page.get_by_label("K (staleness bound)").fill("3")
    page.get_by_role("button", name="Apply live").click()
    sync_api.expect(page.locator("#audit")).to_contain_text("set max_staleness")
    page.screenshot(path=str(shots / "run.png"), full_page=True)
    # a group's label on the timeline opens its page: each attempt's turns and lane operations
    label = page.locator("#timeline-svg a text.glink").first
    group = label.text_content()
    assert group is not None
    label.click()
    sync_api.expect(page.locator("h1")).to_contain_text(f"Group {group[1:]}")
    sync_api.expect(page.locator("section.attempt").first).to_contain_text("model turn")
    page.screenshot(path=str(shots / "group.png"), full_page=True)
    page.context.close()
    assert (shots / "runs.png").stat().st_size > 0
    assert (shots / "run.png").stat().st_size > 0
    assert (shots / "group.png").stat().st_size > 0
