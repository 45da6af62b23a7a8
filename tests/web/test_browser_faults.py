"""The dashboard in a real browser (Debian's Chromium, driven by Playwright) while its `corral serve` is
killed and started again, and while its database is locked: the page says it is cut off, catches up
once it is back, and a control that got no answer, or a 5xx, says so instead of doing nothing.

Screenshots of each state go to $CORRAL_SCREENSHOTS when it is set, else to the test's temporary
directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from factories import take_write_lock, wait_for
from test_browser import ROOT, SHOTS_ENV, TOKEN, free_port, make_run_spec, new_page

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

sync_api = pytest.importorskip("playwright.sync_api")

# What the server logs once when a page's live stream meets the locked database
STREAM_WAITS = "a page's live stream: the database is busy (database is locked)"
# What a page must never show: a number JavaScript or Python could not make
NOT_NUMBERS = re.compile(r"\b(NaN|undefined|Infinity|inf|nan)\b")


@contextmanager
def corral_serve(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real `corral serve` in a session of its own; killed (SIGKILL to its group) if it is still up
    at the end of the block."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"], cwd=ROOT, env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{env['CORRAL_PORT']}"

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                answer = httpx.get(f"{url}/healthz", timeout=2)
            except httpx.TransportError:
                return False
            return answer.status_code == 200 and answer.json()["resuming"] == []

        wait_for(healthy, 120, what=f"corral serve to start; log {log}")
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def serve_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(free_port()),
        **extra,
    }


def shots(tmp_path: Path) -> Path:
    return Path(os.environ.get(SHOTS_ENV) or tmp_path).resolve()


def delivered(page: object) -> int:
    return int(page.locator("#batches-delivered").inner_text())  # type: ignore[attr-defined]


def test_a_run_page_says_its_server_is_gone_and_catches_up_once_it_is_back(
    browser: object, tmp_path: Path
) -> None:
    """Before, with the server killed the page went on showing the run as live, with no word of it, and
    Pause did nothing when clicked (htmx only logged its send error)."""
    env = serve_env(tmp_path)
    url = f"http://127.0.0.1:{env['CORRAL_PORT']}"
    log = tmp_path / "serve.log"
    with corral_serve(env, log) as first:
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        run_id = api.post("/api/runs", json=make_run_spec(sentinel_step_s=0.5)).json()["id"]
        page = new_page(browser, url, signed_in=True)
        page.goto(f"{url}/runs/{run_id}")
        lost = page.locator("#live-lost")
        sync_api.expect(page.locator("#run-state")).to_have_text("running")
        wait_for(lambda: delivered(page) >= 2, 60, what="2 batches on the page")
        sync_api.expect(lost).to_be_hidden()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        sync_api.expect(lost).to_be_visible()
        sync_api.expect(lost).to_contain_text("Disconnected from the server since")
        sync_api.expect(lost).to_contain_text("retrying")
        page.get_by_role("button", name="Pause").click()
        sync_api.expect(page.locator("#pause-msg")).to_have_text(
            "Not done: the server did not answer (it may be restarting). Nothing was changed; try again once "
            "this page is connected."
        )
        page.screenshot(path=str(shots(tmp_path) / "run-disconnected.png"), full_page=True)
    before = delivered(page)
    with corral_serve(env, log):
        sync_api.expect(lost).to_be_hidden(timeout=90_000)  # the stream's retries back off up to 64 s
        wait_for(lambda: delivered(page) > before, 90, what="the page to catch up with the resumed run")
        assert api.get(f"/api/runs/{run_id}").json()["state"] == "running"
        page.get_by_role("button", name="Pause").click()
        sync_api.expect(page.locator("#pause-msg")).to_contain_text("Paused")
        sync_api.expect(page.locator("#run-state")).to_have_text("paused")
        text = page.locator("main").inner_text()
        assert NOT_NUMBERS.findall(text) == [], text
        page.screenshot(path=str(shots(tmp_path) / "run-reconnected.png"), full_page=True)
        page.context.close()
        api.close()


def test_a_launch_the_locked_database_refuses_says_why(browser: object, tmp_path: Path) -> None:
    """Before, the 503 ("the database is busy") was dropped by the page's responseHandling: Launch did
    nothing, with no word of why. And the runs page's live stream ended with a traceback in the log
    ("Exception in ASGI application", "database is locked") at each of its reconnections while the
    database was locked: it now waits for the database, open."""
    env = serve_env(tmp_path, CORRAL_SQLITE_BUSY_TIMEOUT_S="1")
    url = f"http://127.0.0.1:{env['CORRAL_PORT']}"
    log = tmp_path / "serve.log"
    with corral_serve(env, log):
        page = new_page(browser, url, signed_in=True)
        page.get_by_label("Batches").fill("2")
        lock = take_write_lock(tmp_path / "corral.db")
        try:
            page.get_by_role("button", name="Launch").click()
            refused = page.locator("p[data-unanswered]")
            # a run's creation waits out the busy timeout (1 s here) for the lock before the 503
            said = "Not done: the server answered 503 (the database is busy (database is locked)"
            sync_api.expect(refused).to_contain_text(said, timeout=90_000)
            sync_api.expect(refused).to_contain_text("try again in a few seconds).")
            sync_api.expect(page.locator("#live-lost")).to_be_hidden()  # the live stream stays open
            page.screenshot(path=str(shots(tmp_path) / "launch-refused.png"), full_page=True)
            # The stream looks at the store every few seconds: CI's loaded run released the lock before
            # its next look, so the lock is held until the stream has met it.
            wait_for(lambda: STREAM_WAITS in log.read_text(), 60, what="the live stream to meet the lock")
            sync_api.expect(page.locator("#live-lost")).to_be_hidden()
        finally:
            lock.rollback()
            lock.close()
        page.get_by_role("button", name="Launch").click()
        page.wait_for_url(f"{url}/runs/*")
        page.context.close()
    text = log.read_text()
    assert STREAM_WAITS in text
    assert "Traceback" not in text


@pytest.mark.slow
def test_publish_says_why_the_full_disk_refused_the_weights(browser: object, tmp_path: Path) -> None:
    """A local run (real embedded engines) whose data directory's disk is full: Publish weights answers
    503 with the dashboard's own line, which the page's responseHandling dropped: the button did
    nothing."""
    from factories import make_local_config
    from small_disk import fill, small_disk

    with small_disk(tmp_path / "disk", 8) as disk:
        env = serve_env(tmp_path, CORRAL_DATA_DIR=str(disk / "data"))
        url = f"http://127.0.0.1:{env['CORRAL_PORT']}"
        with corral_serve(env, tmp_path / "serve.log"):
            api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
            spec = {"name": "local", "kind": "local", "config": make_local_config()}
            run_id = api.post("/api/runs", json=spec).json()["id"]
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", 120, what="the run")
            page = new_page(browser, url, signed_in=True)
            page.goto(f"{url}/runs/{run_id}")
            filler = fill(disk)
            try:
                page.get_by_role("button", name="Publish weights").click()
                sync_api.expect(page.locator("#publish-msg")).to_have_text(
                    re.compile(
                        r"^the sentinel weights of version 1 cannot be written \(\[Errno 28\] No space left"
                    )
                )
                page.screenshot(path=str(shots(tmp_path) / "publish-refused.png"), full_page=True)
            finally:
                filler.unlink()
            page.get_by_role("button", name="Publish weights").click()
            sync_api.expect(page.locator("#publish-msg")).to_contain_text("Publishing new weights")
            page.context.close()
            api.close()
