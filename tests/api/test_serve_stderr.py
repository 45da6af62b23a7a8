"""`corral serve` whose standard error cannot be written: at start (a file on a full disk, a pipe whose
reader is gone, closed) it does not start, says why on standard output and exits 4; lost mid-run (the
terminal or the pipe it wrote to went away) it goes on serving, and a Ctrl-C still stops it cleanly with
every event stored. Standard input or output closed at start (app/stdio.py) is /dev/null before any file
can take its descriptor: it serves, and nothing meant for the stream lands in another file. Real
processes, a real full file system (`small_disk`), real pipes."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx
import pytest
from api_support import TOKEN, assert_stopped_with_nothing_lost, free_port, make_run, serve_env, wait_for
from small_disk import fill, small_disk

pytestmark = pytest.mark.timeout(300)

SERVE = [sys.executable, "-c", "from app.cli import main; main()", "serve"]
NOT_STARTED = "corral serve: not started: standard error cannot be written"


def serve_at_start(tmp_path: Path, stderr: int | IO[bytes], shell: str = "") -> tuple[int, str]:
    """`corral serve` with `stderr` (and its standard output a file, `shell` a redirection applied by
    sh before it starts): its exit status and what it wrote on standard output."""
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", free_port())
    argv = ["sh", "-c", f'exec "$@" {shell}', "sh", *SERVE] if shell else SERVE
    out = tmp_path / "stdout"
    with out.open("wb") as stdout:
        done = subprocess.run(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, timeout=120, check=False
        )
    return done.returncode, out.read_text()


def test_a_stderr_on_a_full_disk_is_exit_4_said_on_stdout(tmp_path: Path) -> None:
    """It exited 1 without a word: its first line's ENOSPC, then a traceback into the same full file."""
    with small_disk(tmp_path / "disk", 1) as disk:
        fill(disk)
        with (disk / "serve.err").open("ab") as stderr:
            code, said = serve_at_start(tmp_path, stderr)
    assert code == 4, said
    assert said.startswith(f"{NOT_STARTED} (No space left on device);"), said
    assert said.count("\n") == 1, said


def test_a_stderr_pipe_whose_reader_is_gone_is_exit_4(tmp_path: Path) -> None:
    read, write = os.pipe()
    os.close(read)
    try:
        code, said = serve_at_start(tmp_path, write)
    finally:
        os.close(write)
    assert code == 4, said
    assert said.startswith(f"{NOT_STARTED} (Broken pipe);"), said


def test_a_closed_stderr_is_exit_4(tmp_path: Path) -> None:
    """It served without a word (its generated operator token shown to no one), and the first file it
    opened took descriptor 2, where anything written to standard error would have gone."""
    code, said = serve_at_start(tmp_path, subprocess.DEVNULL, shell="2>&-")
    assert code == 4, said
    assert said.startswith(f"{NOT_STARTED} (it is closed);"), said
    assert not (tmp_path / "corral.db").exists()  # refused before it opened anything


def test_a_closed_stdout_takes_the_place_of_no_file(tmp_path: Path) -> None:
    """Standard output closed, standard error on a full disk: the "not started" line (written to
    standard output when standard error refuses) went into the database's lock file, which had taken
    descriptor 1 as the first file opened."""
    with open("/dev/full", "wb") as full:
        code, said = serve_at_start(tmp_path, full, shell=">&-")
    assert code == 4
    assert said == ""
    for path in tmp_path.glob("corral.db*"):
        assert b"not started" not in path.read_bytes(), path
    assert _integrity(tmp_path / "corral.db") == "ok"


@pytest.mark.parametrize("closed", [0, 1], ids=["stdin", "stdout"])
def test_a_closed_stdin_or_stdout_serves_and_stops_with_every_event_stored(
    tmp_path: Path, closed: int
) -> None:
    """`corral serve <&-` (or `>&-`). With standard output closed it ended at start in a traceback
    (uvicorn's access log asked the missing `sys.stdout` whether it is a terminal); with standard input
    closed the database's lock file took descriptor 0, which every child could inherit."""
    database = tmp_path / "corral.db"
    env = serve_env(tmp_path, f"sqlite:///{database}", free_port())
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            SERVE, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
            preexec_fn=lambda: os.close(closed),
        )  # fmt: skip
    with _client(proc, env) as api:
        wait_for(lambda: proc.poll() is not None or _answers(api), 60, what="corral serve to answer")
        assert proc.poll() is None, log.read_text()
        assert os.readlink(f"/proc/{proc.pid}/fd/{closed}") == os.devnull
        run_id = _collecting(api)
        code = _ctrl_c(proc)
    said = log.read_text()
    assert code == 0, said
    assert "Traceback" not in said
    assert_stopped_with_nothing_lost(f"sqlite:///{database}", run_id)
    assert _integrity(database) == "ok"
    assert (tmp_path / "corral.db.serve-lock").read_bytes() == b""


def _integrity(database: Path) -> str:
    db = sqlite3.connect(database)
    try:
        return str(db.execute("pragma integrity_check").fetchone()[0])
    finally:
        db.close()


def test_a_pipe_gone_mid_run_loses_no_event_and_ctrl_c_still_stops_cleanly(tmp_path: Path) -> None:
    """The terminal (or the pipe to a log collector) went away while a run collected: the stop's first
    line raised BrokenPipeError in the event loop, the runs were not told to stop first, and its
    goodbye raised again, a traceback into the dead pipe and exit 1."""
    database = tmp_path / "corral.db"
    env = serve_env(tmp_path, f"sqlite:///{database}", free_port())
    proc = subprocess.Popen(
        SERVE, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    with _client(proc, env) as api:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(b"Ctrl-C stops the server"):
                break
        wait_for(lambda: _answers(api), 60, what="corral serve to answer")
        run_id = _collecting(api)
        proc.stdout.close()  # the reader goes away: every write to the pipe from now on is EPIPE
        after = _batches(api, run_id)
        wait_for(lambda: _batches(api, run_id) >= after + 2, 120, what="2 more batches, the pipe gone")
        code = _ctrl_c(proc)
    assert code == 0
    assert_stopped_with_nothing_lost(f"sqlite:///{database}", run_id)
    db = sqlite3.connect(database)
    try:
        rows = db.execute("select seq, kind from events where run_id = ? order by seq", (run_id,)).fetchall()
    finally:
        db.close()
    assert [seq for seq, _ in rows] == list(range(len(rows)))  # no hole in the stored stream
    assert rows[-1][1] == "run_ended"


@contextmanager
def _client(proc: subprocess.Popen[bytes], env: dict[str, str]) -> Iterator[httpx.Client]:
    """An API client of the server `proc`; at the end of the block the server is killed if it is still
    there (a failed test)."""
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{env['CORRAL_PORT']}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        yield api
    finally:
        api.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _collecting(api: httpx.Client) -> str:
    """A simulated run that goes on until stopped, once it has delivered 2 batches: its id."""
    spec = make_run(batches=None, speed=10.0, trainer="sentinel", sentinel_step_s=0.2)
    run_id = str(api.post("/api/runs", json=spec).json()["id"])
    wait_for(lambda: _batches(api, run_id) >= 2, 120, what="2 batches")
    return run_id


def _ctrl_c(proc: subprocess.Popen[bytes]) -> int:
    """Ctrl-C to the server's process group; its exit status."""
    os.killpg(proc.pid, signal.SIGINT)
    return proc.wait(120)


def _answers(api: httpx.Client) -> bool:
    try:
        return api.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def _batches(api: httpx.Client, run_id: str) -> int:
    answer = api.get(f"/api/runs/{run_id}").json()
    assert answer["state"] in ("created", "running"), answer.get("error")
    return int(answer["live"]["batches"])
