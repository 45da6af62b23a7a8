"""A long-lived `corral serve` under several fast simulated runs: is every event they published stored?

Starts `corral serve` as its own process group (SQLite in a temp dir by default, or --database-url),
creates one simulated run per `--speeds` entry with the built-in trainer, lets them run `--seconds`,
stops them over the API (or not: `--ctrl-c-live`), then presses Ctrl-C (SIGINT to the server's process
group) and times the exit.

The account is kept apart from the code it checks: what each run published is the sequence number of its
last event as the API's live view gives it just after the run ended (`live.last_seq`, so events number
0..last_seq), and what was stored is read straight from the database afterwards (`count(*)` and `max(seq)`
of the `events` table, and the run's row). A hole is a sequence number below the highest stored that is
not stored. While the runs go, it prints each run's events, batches and pace every `--every` seconds.

    python -m benchmarks.long_serve [--seconds 240] [--speeds 100 20 20 20] [--json report.json]

Before the fix of 2026-12-03, 240 s of the default lost 55% of the events (384,734 of 851,804 stored,
3,000 in holes), left all four runs `running` in the store, and the server did not exit within 180 s of
the Ctrl-C. It asserts nothing; it prints what it saw and exits 1 when an event or an end state is lost.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from app.store.db import make_engine
from benchmarks import check_outputs, save_json

TOKEN = "bench-operator-token"
ENDED = ("stopped", "completed", "failed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _wait_healthy(url: str, server: subprocess.Popen[bytes], log_path: Path) -> float:
    started = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.TransportError:
            pass
        if time.monotonic() - started > 120 or server.poll() is not None:
            raise SystemExit(f"corral serve did not start; see {log_path}")
        time.sleep(0.2)


def _stored(url: str, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    engine = make_engine(url, sqlite_begin="DEFERRED")
    out = {}
    try:
        with engine.connect() as c:
            for rid in run_ids:
                count, top = c.execute(
                    text("SELECT count(*), max(seq) FROM events WHERE run_id = :r"), {"r": rid}
                ).one()
                state = c.execute(text("SELECT state FROM runs WHERE id = :r"), {"r": rid}).scalar_one()
                ended = c.execute(
                    text("SELECT count(*) FROM events WHERE run_id = :r AND kind = 'run_ended'"), {"r": rid}
                ).scalar_one()
                out[rid] = {"stored": count, "max_seq": top, "state": state, "ended_events": ended}
    finally:
        engine.dispose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=240.0, help="how long the runs go (wall)")
    parser.add_argument("--speeds", type=float, nargs="+", default=[100.0, 20.0, 20.0, 20.0])
    parser.add_argument("--every", type=float, default=20.0, help="seconds between progress lines")
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in a temp dir")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument(
        "--ctrl-c-live",
        action="store_true",
        help="press Ctrl-C while the runs go, without stopping them first (what each published is then "
        "unknown: the check is for holes, and for each run's end stored)",
    )
    args = parser.parse_args()
    if not (0 < args.seconds < math.inf and 0 < args.every < math.inf) or not all(
        0.01 <= s <= 1000 for s in args.speeds
    ):
        parser.error("--seconds and --every must be finite and > 0, and each speed within 0.01..1000")
    check_outputs(json=args.json)  # refused now, not after the whole run

    tmp = Path(tempfile.mkdtemp(prefix="corral-long-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    db_url = args.database_url or f"sqlite:///{tmp / 'corral.db'}"
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": db_url,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp / "data"),
    }
    # The server has a session of its own (a Ctrl-C here is sent to it below, as the measurement):
    # a SIGTERM to this script unwinds it too, so the `finally` below takes the server down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_path = tmp / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-c", "from app.cli import main; main()", "serve"],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        _wait_healthy(url, server, log_path)
        runs = []
        for i, speed in enumerate(args.speeds):
            spec = {
                "name": f"long-{i}",
                "kind": "sim",
                "speed": speed,
                "trainer": "sentinel",
                "sentinel_step_s": 0.5,
            }
            runs.append(httpx.post(f"{url}/api/runs", json=spec, headers=headers, timeout=60).json()["id"])
        print(
            f"corral serve on {url} ({db_url.split(':')[0]}), {len(runs)} simulated runs at speeds "
            f"{', '.join(f'{s:g}' for s in args.speeds)} for {args.seconds:g} s; log {log_path}"
        )
        started = time.monotonic()
        while (left := args.seconds - (time.monotonic() - started)) > 0:
            time.sleep(min(args.every, left))
            try:
                views = [httpx.get(f"{url}/api/runs/{r}", timeout=60).json() for r in runs]
            except httpx.HTTPError as exc:
                print(f"{time.monotonic() - started:6.0f} s  GET failed: {exc!r}")
                continue
            cells = []
            for v in views:
                live = v.get("live") or {}
                pace = live.get("pace") or {}
                cells.append(
                    f"{live.get('events', 0):>7} ev {live.get('batches', 0):>5} b "
                    f"x{pace.get('effective_speed', 0):.0f}"
                )
            print(
                f"{time.monotonic() - started:6.0f} s  rss {_rss_mb(server.pid):5.0f} MB  "
                + " | ".join(cells)
            )
        published: dict[str, dict[str, Any]] = {
            r: {"last_seq": None, "state": "running", "pace": None} for r in runs
        }
        for r in [] if args.ctrl_c_live else runs:
            httpx.post(f"{url}/api/runs/{r}/stop", headers=headers, timeout=120)
        for r in [] if args.ctrl_c_live else runs:
            deadline = time.monotonic() + 300
            while True:
                view = httpx.get(f"{url}/api/runs/{r}", timeout=60).json()
                if view["state"] in ENDED or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            live = view.get("live") or {}
            published[r] = {
                "last_seq": live.get("last_seq"),
                "state": view["state"],
                "pace": live.get("pace"),
            }
        rss = _rss_mb(server.pid)
        sigint = time.monotonic()
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(600)
            exit_s: float | None = time.monotonic() - sigint
        except subprocess.TimeoutExpired:
            exit_s = None
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    stored = _stored(db_url, runs)
    lost = False
    rows = []
    for r in runs:
        last = published[r]["last_seq"]
        s = stored[r]
        holes = (s["max_seq"] + 1 - s["stored"]) if s["max_seq"] is not None else 0
        missing = (last + 1 - s["stored"]) if last is not None else None
        lost |= bool(missing) or holes > 0 or s["state"] not in ENDED or not s["ended_events"]
        rows.append(
            {
                "run": r,
                "published": None if last is None else last + 1,
                **s,
                "holes": holes,
                "missing": missing,
                "pace": published[r]["pace"],
            }
        )
        print(
            f"run {r}: published {rows[-1]['published']}, stored {s['stored']}, holes {holes}, "
            f"missing {missing}, stored state {s['state']}, pace {published[r]['pace']}"
        )
    print(
        f"server RSS at the end {rss:.0f} MB; exit after Ctrl-C: "
        + (f"{exit_s:.1f} s" if exit_s is not None else "none within 600 s (killed)")
    )
    if args.json is not None:
        figures = {
            "seconds": args.seconds,
            "speeds": args.speeds,
            "runs": rows,
            "rss_mb": rss,
            "exit_after_sigint_s": exit_s,
            "load_average": os.getloadavg()[0],
        }
        save_json(args.json, figures)
    sys.exit(1 if lost else 0)


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
