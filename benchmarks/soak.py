"""A soak of `corral serve`: does a server left running hold more and more of anything?

Starts `corral serve` (or `corral serve --demo`) as its own process group on SQLite in a temp dir, then
for `--minutes` keeps it busy the way an operator's would be, and every `--every` seconds samples, from
outside the server (/proc, the database file, the data directory):

- the server's RSS, open file descriptors (and how many are sockets), threads, and descendant processes;
- the database's size on disk (file, WAL and shared memory) and its rows in `events`, `runs`, `rollouts`;
- the files and bytes under the data directory (kept batches, spills, sentinel weights) and the files
  left in the server's own temporary directory (`TMPDIR`, one of its own).

The load (`--mode api`): `--concurrent` simulated runs at a time, one in two with the built-in
sentinel trainer and the others with an external trainer this script plays (takes each batch, acks it,
publishes the next version as a sentinel); each runs `--run-s` seconds, is stopped, waits to end and
is deleted over the API (one in `--keep-every` is kept instead, and pruned at the end with `corral
prune`).
`--mode demo` serves `--demo` (the embedded engines and local sandboxes of `make run`) and stops and
deletes nothing. In both, `--sse` clients open and close the dashboard's live streams (`/stream` and a
live run's `/runs/{id}/stream`) one after another, each kept open for 0.1–2 s, and a few stay open
for a while (half of the clients are httpx, half `curl --max-time`); after the load, an idle spell
shows what the server keeps once nothing is asked of it.

    python -m benchmarks.soak --minutes 10 [--mode api|demo] [--json soak.json] [--plot soak.png]

It asserts nothing: it prints a line per sample, a table of the first, middle and last samples, and
exits 0.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import ScriptParser, check_outputs, write_results

TOKEN = "soak-operator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ENDED = ("stopped", "completed", "failed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> list[int]:
    """Every process under `pid`, from the kernel's children lists of each of its threads."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                kids = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for kid in map(int, kids):
                found.append(kid)
                todo.append(kid)
    return found


def process_figures(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds, sockets among them, threads and descendant processes of `pid`."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    fds = sockets = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        with contextlib.suppress(OSError):  # closed since the listing
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "fds": fds,
        "sockets": sockets,
        "threads": int(status["Threads"]),
        "children": len(descendants(pid)),
    }


def tree_figures(root: Path) -> tuple[int, int]:
    """Files and bytes under `root`."""
    files = size = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
            files += 1
    return files, size


def database_figures(db: Path) -> dict[str, float]:
    """The SQLite database's bytes on disk and its rows in the tables that grow with a run."""
    size = sum(p.stat().st_size for p in db.parent.glob(db.name + "*") if p.is_file())
    wal = db.parent / (db.name + "-wal")
    rows: dict[str, float] = {
        "db_mib": size / 2**20,
        "wal_mib": wal.stat().st_size / 2**20 if wal.exists() else 0,
    }
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
            for table in ("events", "spans", "trajectories", "weight_rollouts", "batches"):
                rows[f"{table}_rows"] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    except sqlite3.Error:
        pass  # locked for longer than the timeout: the next sample counts them
    return rows


class Load:
    """The runs and the live-stream clients that keep the server busy, each in a thread of its own."""

    def __init__(self, url: str, args: Any) -> None:
        self.url, self.args = url, args
        self.stop = threading.Event()
        self.counts = {"runs_created": 0, "runs_deleted": 0, "streams_opened": 0, "batches_acked": 0}
        self.live_runs: list[str] = []
        self.kept: list[str] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def count(self, name: str, by: int = 1) -> None:
        with self.lock:
            self.counts[name] += by

    def note(self, what: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append(what)

    def run_slot(self, slot: int) -> None:
        """Run after run: create, let it go `run_s` (playing its trainer if external), stop, delete."""
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=120) as client:
            while not self.stop.is_set():
                external = slot % 2 == 1
                spec = {
                    "name": f"soak-{slot}",
                    "kind": "sim",
                    "speed": self.args.speed,
                    "trainer": "external" if external else "sentinel",
                    "sentinel_step_s": 0.2,
                }
                answer = client.post("/api/runs", json=spec)
                if answer.status_code != 201:
                    self.note(f"create: {answer.status_code} {answer.text[:200]}")
                    self.stop.wait(5)
                    continue
                run = answer.json()["id"]
                self.count("runs_created")
                with self.lock:
                    self.live_runs.append(run)
                until = time.monotonic() + self.args.run_s
                version = 0
                while time.monotonic() < until and not self.stop.is_set():
                    if not external:
                        self.stop.wait(min(1.0, until - time.monotonic()))
                        continue
                    got = client.get(f"/api/runs/{run}/batches/next", params={"timeout": 2})
                    if got.status_code != 200:
                        continue
                    batch = got.json()
                    client.post(f"/api/runs/{run}/batches/{batch['batch_id']}/ack")
                    self.count("batches_acked")
                    version += 1
                    client.post(f"/api/runs/{run}/weights", json={"version": version, "sentinel": True})
                with self.lock:
                    self.live_runs.remove(run)
                client.post(f"/api/runs/{run}/stop")
                deadline = time.monotonic() + 300
                while client.get(f"/api/runs/{run}").json()["state"] not in ENDED:
                    if time.monotonic() > deadline:
                        self.note(f"run {run} did not end within 300 s of its stop")
                        break
                    time.sleep(0.5)
                if self.counts["runs_created"] % self.args.keep_every == 0:
                    with self.lock:
                        self.kept.append(run)
                    continue
                gone = client.delete(f"/api/runs/{run}")
                if gone.status_code == 200:
                    self.count("runs_deleted")
                else:
                    self.note(f"delete {run}: {gone.status_code} {gone.text[:200]}")

    def stream_client(self, seed: int) -> None:
        """Open a live stream, read it for 0.1-2 s (a few: 20-60 s), close it; again and again."""
        rng = random.Random(seed)
        while not self.stop.is_set():
            with self.lock:
                runs = list(self.live_runs)
            path = f"/runs/{rng.choice(runs)}/stream" if runs and rng.random() < 0.7 else "/stream"
            hold = rng.uniform(20, 60) if rng.random() < 0.02 else rng.uniform(0.1, 2.0)
            until = time.monotonic() + hold
            if seed % 2:  # curl cut off by --max-time, as a script or a terminal would do it
                command = ["curl", "-sSN", "-o", "/dev/null", "--max-time", f"{hold:.2f}"]
                done = subprocess.run(
                    [*command, "-H", f"Authorization: Bearer {TOKEN}", self.url + path],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                self.count("streams_opened")
                if done.returncode not in (0, 28):  # 28: cut off at --max-time
                    self.note(f"curl {path}: exit {done.returncode} {done.stderr.strip()[:200]}")
                    self.stop.wait(1)
                continue
            try:
                timeout = httpx.Timeout(10, read=60)  # a quiet stream pings every 15 s
                with (
                    httpx.Client(base_url=self.url, headers=AUTH, timeout=timeout) as client,
                    client.stream("GET", path) as answer,
                ):
                    self.count("streams_opened")
                    for _ in answer.iter_bytes():
                        if time.monotonic() > until or self.stop.is_set():
                            break
            except httpx.HTTPError as exc:
                self.note(f"stream {path}: {exc!r}")
                self.stop.wait(1)

    def demo_run(self) -> None:
        """The demo's run, as a live run for the stream clients."""
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as client:
            while not self.stop.is_set():
                runs = [r["id"] for r in client.get("/api/runs").json() if r["state"] == "running"]
                with self.lock:
                    self.live_runs[:] = runs
                self.stop.wait(5)


def start_server(tmp: Path, args: Any) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    port = free_port()
    (tmp / "tmp").mkdir()
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp / 'corral.db'}",
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp / "data"),
        "TMPDIR": str(tmp / "tmp"),
    }
    if args.store_buffer:
        env["CORRAL_STORE_BUFFER"] = str(args.store_buffer)
    command = [sys.executable, "-c", "from app.cli import main; main()", "serve"]
    with (tmp / "serve.log").open("wb") as log:
        server = subprocess.Popen(
            [*command, *(["--demo"] if args.mode == "demo" else [])],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
            cwd=tmp,
        )
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return server, url, env
        except httpx.TransportError:
            pass
        if time.monotonic() - started > 300 or server.poll() is not None:
            raise SystemExit(f"error: corral serve did not start; see {tmp / 'serve.log'}")
        time.sleep(0.5)


COLUMNS = (
    ("t_s", "t (s)", "{:.0f}"),
    ("rss_mib", "RSS MiB", "{:.1f}"),
    ("fds", "fds", "{:.0f}"),
    ("sockets", "sockets", "{:.0f}"),
    ("threads", "threads", "{:.0f}"),
    ("children", "children", "{:.0f}"),
    ("db_mib", "db MiB", "{:.2f}"),
    ("wal_mib", "WAL MiB", "{:.2f}"),
    ("events_rows", "events", "{:.0f}"),
    ("spans_rows", "spans", "{:.0f}"),
    ("weight_rollouts_rows", "rollouts", "{:.0f}"),
    ("data_files", "data files", "{:.0f}"),
    ("tmp_files", "tmp files", "{:.0f}"),
    ("runs_created", "runs", "{:.0f}"),
    ("streams_opened", "streams", "{:.0f}"),
)


def line(sample: dict[str, Any]) -> str:
    return "  ".join(
        f"{title} {fmt.format(sample[key])}" if isinstance(sample.get(key), int | float) else f"{title} -"
        for key, title, fmt in COLUMNS
    )


def draw(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    keys = ("rss_mib", "fds", "threads", "children", "db_mib", "events_rows", "data_files", "tmp_files")
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 1.6 * len(keys)), sharex=True)
    t = [s["t_s"] / 60 for s in samples]
    for ax, key in zip(axes, keys, strict=True):
        ax.plot(t, [s.get(key) for s in samples], lw=1)
        ax.set_ylabel(key, fontsize=8)
        if result.get("load_ended_s") is not None:
            ax.axvline(result["load_ended_s"] / 60, color="grey", ls="--", lw=0.8)
    axes[-1].set_xlabel("minutes (dashed: the load stops)")
    fig.suptitle(f"corral serve soak ({result['mode']}, {result['minutes']:g} min)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long the load goes")
    parser.add_argument("--idle-s", type=float, default=60.0, help="the idle spell after the load")
    parser.add_argument("--mode", choices=("api", "demo"), default="api")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--concurrent", type=int, default=2, help="api: runs at a time")
    parser.add_argument("--run-s", type=float, default=30.0, help="api: each run's wall seconds")
    parser.add_argument("--speed", type=float, default=20.0, help="api: each run's simulated speed")
    parser.add_argument("--keep-every", type=int, default=5, help="api: keep one run in N, pruned at the end")
    parser.add_argument("--sse", type=int, default=4, help="live-stream clients at a time")
    parser.add_argument("--store-buffer", type=int, default=0, help="CORRAL_STORE_BUFFER (0: its default)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    bounds = {
        "--minutes": (args.minutes, 0.1, 24 * 60),
        "--idle-s": (args.idle_s, 0, 3600),
        "--every": (args.every, 1, 600),
        "--concurrent": (args.concurrent, 1, 8),
        "--run-s": (args.run_s, 1, 86400),
        "--speed": (args.speed, 0.01, 1000),
        "--keep-every": (args.keep_every, 1, 1_000_000),
        "--sse": (args.sse, 0, 64),
        "--store-buffer": (args.store_buffer, 0, 10_000_000),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high:  # NaN too
            parser.error(f"{flag}: {value:g} is outside {low:g}..{high:g}")
    check_outputs(json=args.json, plot=args.plot)

    tmp = Path(tempfile.mkdtemp(prefix="corral-soak-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    server, url, env = start_server(tmp, args)
    print(f"corral serve{' --demo' if args.mode == 'demo' else ''} on {url}, pid {server.pid}; in {tmp}",
          file=sys.stderr)  # fmt: skip
    load = Load(url, args)
    threads = [threading.Thread(target=load.stream_client, args=(i,), daemon=True) for i in range(args.sse)]
    if args.mode == "api":
        threads += [
            threading.Thread(target=load.run_slot, args=(i,), daemon=True) for i in range(args.concurrent)
        ]
    else:
        threads.append(threading.Thread(target=load.demo_run, daemon=True))
    samples: list[dict[str, Any]] = []
    started = time.monotonic()
    load_ended: float | None = None

    def sample() -> None:
        s: dict[str, Any] = {"t_s": time.monotonic() - started}
        s.update(process_figures(server.pid))
        s.update(database_figures(tmp / "corral.db"))
        s["data_files"], s["data_bytes"] = tree_figures(tmp / "data")
        s["tmp_files"], _ = tree_figures(tmp / "tmp")
        with load.lock:
            s.update(load.counts)
        samples.append(s)
        print(line(s), file=sys.stderr, flush=True)

    result: dict[str, Any] = {"mode": args.mode, "minutes": args.minutes, "samples": samples}
    try:
        for thread in threads:
            thread.start()
        end = started + args.minutes * 60
        while time.monotonic() < end:
            sample()
            time.sleep(max(0.0, min(args.every, end - time.monotonic())))
        load.stop.set()
        for thread in threads:
            thread.join(timeout=400)
        load_ended = time.monotonic() - started
        idle_end = time.monotonic() + args.idle_s
        while time.monotonic() < idle_end:
            time.sleep(max(0.0, min(args.every, idle_end - time.monotonic())))
            sample()
        if args.mode == "api" and load.kept:
            pruned = subprocess.run(
                [sys.executable, "-c", "from app.cli import main; main()", "prune", "--older-than-days", "0"],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            result["prune"] = {"kept": len(load.kept), "rc": pruned.returncode, "out": pruned.stdout.strip()}
            time.sleep(2)
            sample()
    finally:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(240)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    result["load_ended_s"] = load_ended
    result["exit_code"] = server.returncode
    result["errors"] = load.errors
    result["load_average"] = os.getloadavg()[0]
    result["dir"] = str(tmp)
    picks = [samples[0], samples[len(samples) // 2], samples[-1]] if samples else []
    print("\n| " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|" + " --- |" * len(COLUMNS))
    for s in picks:
        print("| " + " | ".join(fmt.format(s.get(k, float("nan"))) for k, _, fmt in COLUMNS) + " |")
    if "prune" in result:
        print(f"prune: {result['prune']}")
    print(f"server exit {server.returncode}; {len(load.errors)} load errors; log {tmp / 'serve.log'}")
    for error in load.errors[:10]:
        print(f"  {error}")
    write_results(result, args.json, args.plot, draw)
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
