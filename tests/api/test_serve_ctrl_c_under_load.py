"""Ctrl-C to a `corral serve` whose store cannot keep up: a real server in its own session, real runs,
SIGINT to its process group. A probe left four simulated runs on SQLite until the store held a few
hundred thousand events: the Ctrl-C then took 52 minutes (the store writer drained thousands of offer
and ack marks, each waiting 10 s for a batch row the lagging event sink had not written), a second
Ctrl-C changed nothing, and the restart took 28 s before `/healthz` answered (each run's stored stream
was replayed first)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from api_support import TOKEN, free_port, make_run, serve_env, wait_for
from factories import take_write_lock


def _serve(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killpg below is a terminal's Ctrl-C
        )


def _health(url: str) -> dict[str, Any] | None:
    try:
        answer = httpx.get(f"{url}/healthz", timeout=5)
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _stored(db: Path) -> tuple[dict[str, str], int]:
    with sqlite3.connect(db, timeout=30) as conn:
        states = dict(conn.execute("SELECT id, state FROM runs").fetchall())
        (events,) = conn.execute("SELECT count(*) FROM events").fetchone()
    return states, events


def test_a_second_ctrl_c_stops_at_once_with_the_store_stuck_and_the_runs_resume(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    db = tmp_path / "corral.db"
    env = serve_env(tmp_path, f"sqlite:///{db}", port)
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    proc = _serve(env, log)
    restarted: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: _health(url), 60, what=f"corral serve to start; log: {log}")
        spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.0, speed=50.0)
        runs = [api.post("/api/runs", json={**spec, "name": f"load-{i}"}).json()["id"] for i in range(2)]
        wait_for(
            lambda: all(api.get(f"/api/runs/{r}").json()["live"]["batches"] >= 3 for r in runs),
            60,
            what="3 batches of each run",
        )
        # The store stops keeping up: another writer holds SQLite's write lock. The runs go on, their
        # events wait in the sinks' buffers and their offer and ack marks in the store writer.
        holder = take_write_lock(db)
        try:
            time.sleep(2)
            _, events_before = _stored(db)  # a reader is not held up by the lock
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(1)
            sent = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            # The old code went on waiting for the runs' last events and the store writer (the first
            # Ctrl-C's bound: minutes, here; the probe's 52 minutes without a bound).
            try:
                proc.wait(timeout=25)
            except subprocess.TimeoutExpired:
                said = f"a second Ctrl-C did not end corral serve within 25 s; log: {log}"
                raise AssertionError(said) from None
            took = time.monotonic() - sent
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        said = log.read_text()
        assert proc.returncode == 0, said
        assert "Traceback" not in said, said
        assert "corral serve: stopping at once" in said, said
        assert took < 15, f"{took:.1f} s from the second Ctrl-C to the exit"
        # What the store held is kept, and the runs are left as it has them: not `stopping`, which the
        # next start would end. What they published and the store did not have went to their spills.
        states, events_after = _stored(db)
        assert events_after >= events_before
        assert [states[r] for r in runs] == ["running", "running"], states
        published = {
            r: int(m.group(1))
            for r in runs
            if (m := re.search(rf"run {r}: left as the store has it \(its (\d+) events published", said))
        }

        restarted = _serve(env, log)
        started = time.monotonic()
        health = wait_for(lambda: _health(url), 60, what=f"corral serve to start again; log: {log}")
        assert set(health["resuming"]) <= set(runs), health
        assert wait_for(lambda: (h := _health(url)) is not None and h["resuming"] == [], 60, what="resumed")
        assert time.monotonic() - started < 60
        again = log.read_text()
        for run_id in runs:
            view = api.get(f"/api/runs/{run_id}").json()
            if f"run {run_id} not resumed: it had ended (stopped), as its spill says" in again:
                # Its stop had ended in memory, its end kept on disk: stored now, and not resumed
                assert view["state"] == "stopped", view
                goodbye = rf"run {run_id} \(load-\d\): stopped \(its end kept: the next start finds it ended"
                assert re.search(goodbye, said), said
            else:
                assert (view["state"], view["live"] is not None) == ("running", True), view
        # Every event each run published is stored now: what the store had, and what its spill kept
        assert set(published) == set(runs), said
        with sqlite3.connect(db, timeout=30) as conn:
            for run_id, count in published.items():
                query = "SELECT count(*) FROM events WHERE run_id = ? AND seq < ?"
                (stored,) = conn.execute(query, (run_id, count)).fetchone()
                assert stored == count, (run_id, stored, count)
    finally:
        api.close()
        for p in (proc, restarted):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
