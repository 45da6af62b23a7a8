"""The dashboard of a `corral serve` restarted after a kill -9, while it resumes a run in the background:
the runs page and the run's page say the run is being resumed, and how far the replay of its stored
stream has got, for as long as `/healthz` lists it under `resuming`; once it executes again they no
longer say so. A real server killed -9 with a real run (about 50,000 stored events); the restarted
server runs in this process, so that its replay can be held at `HOLD_AT` events while the pages are
read (a replay of 50,000 events takes about a second, and gets faster)."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from api_support import TOKEN, free_port, make_run, make_settings, serve_env, serving, wait_for
from test_serve_restart import corral_serve

from app.core.events import Envelope
from app.service.manager import ReplayProgress

STREAM_S = 15.0  # how long the run writes events before the kill: about 50,000 at this speed
HOLD_AT = 5_000  # the restarted server's replay waits here until the pages have been read


def _health(url: str) -> dict[str, object] | None:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=5)
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code in (200, 503) else None


def _row(page: str, run_id: str) -> str:
    """The runs page's row of the run."""
    found = re.search(rf'<tr data-run="{run_id}">.*?</tr>', page, re.S)
    assert found is not None, page
    return found.group(0)


def _watch(url: str, events: list[tuple[str, str]], done: threading.Event) -> None:
    """The run page's live stream (SSE): each event's name and data, until the page's Pause button
    comes (the run executes) or `done`."""
    with httpx.stream("GET", url, timeout=httpx.Timeout(120, connect=10)) as stream:
        name, data = "", []
        for line in stream.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                data.append(line.removeprefix("data:").removeprefix(" "))
            elif not line and name:
                events.append((name, "\n".join(data)))
                name, data = "", []
                if events[-1][0] == "pause_control" and 'id="pause-btn"' in events[-1][1]:
                    return
            if done.is_set():
                return


def test_the_dashboard_says_a_run_is_being_resumed_and_how_far_until_it_executes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database_url = f"sqlite:///{tmp_path / 'corral.db'}"
    env = serve_env(tmp_path, database_url, port)
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    with corral_serve(env, log) as proc:
        wait_for(lambda: _health(url), 60, what=f"corral serve to start; log: {log}")
        spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.0, speed=100.0)
        run_id = api.post("/api/runs", json=spec).json()["id"]
        time.sleep(STREAM_S)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    api.close()

    held, release = threading.Event(), threading.Event()
    count = ReplayProgress.on_envelope

    def held_replay(progress: ReplayProgress, env: Envelope) -> None:
        count(progress, env)
        if progress.replayed == HOLD_AT:
            held.set()
            release.wait(60)

    monkeypatch.setattr(ReplayProgress, "on_envelope", held_replay)
    listed: list[str] = []  # the run's row on the runs page while /healthz listed it as resuming
    pages: list[str] = []  # its page's resume note then
    replays: list[dict[str, int | None]] = []  # and the API's `replay`
    with serving(make_settings(tmp_path, database_url)) as url:
        api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        wait_for(lambda: _health(url), 60, what="corral serve to start again")
        # The run's page opened while the run is being resumed follows it live to its execution
        streamed: list[tuple[str, str]] = []
        done = threading.Event()
        watcher = threading.Thread(target=_watch, args=(f"{url}/runs/{run_id}/stream", streamed, done))
        watcher.start()
        assert held.wait(60), "the replay never reached its hold"
        try:
            for _ in range(3):
                row = _row(httpx.get(f"{url}/", timeout=30).text, run_id)
                page = httpx.get(f"{url}/runs/{run_id}", timeout=30).text
                body = api.get(f"/api/runs/{run_id}").json()
                note = re.search(r'<p class="flash" id="resume-note" role="status">(.*?)</p>', page, re.S)
                assert run_id in (_health(url) or {}).get("resuming", [])  # type: ignore[operator]
                listed.append(row)
                pages.append(note.group(1) if note else "")
                replays.append(body.get("replay") or {})
                # no Pause or Stop while it does not execute: its commands would be refused
                assert 'id="pause-btn"' not in page
                assert "Stop the run after this step" not in page
        finally:
            release.set()
        assert all("resuming" in row for row in listed), listed
        assert all(p.startswith("Being resumed after the control plane restarted") for p in pages), pages
        # how far the replay has got: "12,345 of 49,500 stored events replayed (25%)", or all of them
        assert any(re.search(r"[\d,]+ of [\d,]+ stored events replayed", p) for p in pages), pages
        assert all(r["events"] is None or 0 <= r["events_replayed"] <= r["events"] for r in replays), replays
        assert all(r["events_replayed"] == HOLD_AT and r["events"] for r in replays), replays

        wait_for(
            lambda: api.get(f"/api/runs/{run_id}").json()["live"] is not None, 60, what="the run to execute"
        )
        row = _row(httpx.get(f"{url}/", timeout=30).text, run_id)
        page = httpx.get(f"{url}/runs/{run_id}", timeout=30).text
        assert "resuming" not in row, row
        assert 'id="resume-note"' not in page
        assert 'id="run-state">running<' in page
        assert 'id="pause-btn"' in page
        assert "Stop the run after this step" in page
        watcher.join(60)
        done.set()
        summaries = [data for name, data in streamed if name == "summary"]
        assert summaries, streamed
        assert 'id="resume-note"' in summaries[0], summaries[0]  # sent as the stream opened
        assert 'id="resume-note"' not in summaries[-1], summaries[-1]  # swapped out as it executes
        assert any(name == "pause_control" and 'id="pause-btn"' in data for name, data in streamed)
        assert any(name == "stop_control" and "Stop the run after" in data for name, data in streamed)
    api.close()
