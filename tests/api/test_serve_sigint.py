"""`corral serve --demo` as a user runs it (`make run`): an engine of the demo run killed with SIGKILL is
restarted and the demo goes on; then Ctrl-C to the whole process group ends it cleanly: exit 0 (or 130),
no traceback, the run stopped, and no engine process left behind, the restarted one included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import assert_stopped_with_nothing_lost, free_port, wait_for
from proc_children import alive, children


class Timeline:
    """A run's events read through GET /api/runs/{id}/timeline, page by page as they come."""

    def __init__(self, url: str, run_id: str) -> None:
        self.url, self.run_id = url, run_id
        self.rows: list[dict[str, Any]] = []
        self.since = -1

    def read(self) -> list[dict[str, Any]]:
        while True:
            page = httpx.get(
                f"{self.url}/api/runs/{self.run_id}/timeline", params={"since": self.since}, timeout=10
            ).json()
            self.rows += page["events"]
            if not page["events"]:
                return self.rows
            self.since = page["next"]

    def engine_back(self) -> dict[str, Any] | None:
        rows = self.read()
        return next((r for r in rows if r["kind"] == "engine_state" and r["state"] == "serving"), None)

    def batches_after(self, t: float) -> int:
        return sum(1 for r in self.read() if r["kind"] == "batch_delivered" and r["t"] > t)


@pytest.mark.slow
def test_make_run_demo_rides_out_a_dead_engine_and_ctrl_c_ends_it_cleanly(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    env = {**os.environ, "CORRAL_DATABASE_URL": database, "CORRAL_DATA_DIR": str(tmp_path / "data")}
    env.pop("CORRAL_OPERATOR_TOKEN", None)
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve", "--demo", f"--port={port}"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killpg below is a terminal's Ctrl-C
        )
    engines: set[int] = set()
    try:

        def demo_batches() -> int:
            try:
                runs = httpx.get(f"{url}/api/runs", timeout=5).json()
                if not runs:
                    return 0
                run = httpx.get(f"{url}/api/runs/{runs[0]['id']}", timeout=5).json()
                return int(run["live"]["batches"])
            except httpx.TransportError:
                return 0

        wait_for(demo_batches, 120, what="the demo's first batch")
        run_id = httpx.get(f"{url}/api/runs", timeout=5).json()[0]["id"]
        first = children(proc.pid, b"app.engines.embedded")
        assert len(first) == 2
        os.kill(min(first), signal.SIGKILL)
        timeline = Timeline(url, run_id)
        back = wait_for(timeline.engine_back, 60, what="the killed engine to serve again")
        assert back["detail"].startswith("back at version")
        wait_for(lambda: timeline.batches_after(back["t"]), 60, what="a batch after the restart")

        def engines_healthy() -> bool:  # /healthz asks the restarted engine, not its dead first client
            engines = httpx.get(f"{url}/healthz", timeout=10).json()["engines"].get(run_id, {})
            return len(engines) == 2 and all(engines.values())

        wait_for(engines_healthy, 30, what="/healthz to count the restarted engine healthy")
        engines = children(proc.pid, b"app.engines.embedded")
        assert len(engines) == 2
        assert min(first) not in engines
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    printed = log.read_text()
    assert code in (0, 130), printed
    assert "Traceback" not in printed
    assert f"run {run_id} (demo): stopped, " in printed  # what became of the run, said on the way out
    assert f"corral serve: stopped; runs and their events are kept in {database}" in printed
    assert not [pid for pid in engines | first if alive(pid)]
    assert_stopped_with_nothing_lost(database, run_id)


@pytest.mark.parametrize("presses", [1, 2], ids=["Ctrl-C", "Ctrl-C twice"])
def test_ctrl_c_as_the_demo_is_being_built_is_the_same_clean_stop(tmp_path: Path, presses: int) -> None:
    """Ctrl-C right after "Ctrl-C stops the server ...", while the application and its demo run were
    built and before the server took the signals: it was a KeyboardInterrupt there, a bare
    "interrupted", exit 130 (4 of 10 tries), at times with a "coroutine 'Server.serve' was never awaited"
    warning. It is now held, then acted on as the server starts: the same clean stop as a moment later.
    Held presses count as one: a second, taken as "stop at once" before the runs' manager existed,
    abandoned nothing and left no later press able to cut the stop short."""
    import time

    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from app.cli import main; main()", "serve", "--demo",
         f"--port={free_port()}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("Ctrl-C stops the server") for line in lines):
            assert time.monotonic() < deadline, lines
            assert proc.poll() is None, lines
            lines.append(proc.stderr.readline())
        for _ in range(presses):
            os.killpg(proc.pid, signal.SIGINT)  # at once: the demo run is being built
        _, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = "".join(lines) + rest
    assert proc.returncode == 0, said
    assert "corral serve: stopping: open requests end" in said
    assert "corral serve: stopped; runs and their events are kept in" in said
    assert "interrupted" not in said
    assert "stopping at once" not in said
    assert "Traceback" not in said
    assert "never awaited" not in said
