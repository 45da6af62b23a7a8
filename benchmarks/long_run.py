"""The dashboard on a long run: a stored run of about 350,000 events and 1,250 batches.

Writes a seeded synthetic run (app.web.synthetic: `--groups` groups of 4 attempts, 4 groups a batch,
ended) into a SQLite store with the store's own sink (`SqlEventSink`, batches of 1,000 events), once
per `--db` file, then serves it as `corral serve` would after a restart (a `RunManager` over that
store, the dashboard's `ManagerRuns`) and times, `--repeat` times each, median and max:
- `GET /api/runs` (the manager's list) and `GET /` (the runs page), each from a fresh dashboard;
- `GET /runs/{id}`, the run page's first load from a fresh dashboard;
- how long the view takes to catch up with the whole stream, asked as the page's live stream asks
  (`version`, then `view`, until the view no longer says it is catching up), and then the run page
  again and a live stream tick (the named blocks one SSE message carries, from the cached view);
- the replay a restart does to resume the run (`ServiceStore.resume_point`: the whole stored stream
  read back into its ledger, its live view and its rollout log), as if the run were unfinished.
It prints the sizes of the page, of the live blocks and of the trainer block, and asserts nothing.

Run: `.venv/bin/python -m benchmarks.long_run [--groups 5000] [--repeat 3] [--db PATH]`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from fastapi import FastAPI

from app.core.events import Envelope, RunEnded
from app.service.manager import RunManager
from app.service.store import ServiceStore
from app.store.repos import EventRepo
from app.store.sink import SqlEventSink
from app.web.live import ManagerRuns
from app.web.security import AccessConfig
from app.web.synthetic import synthetic_run
from app.web.views import LIVE_BLOCKS, Dashboard, mount_dashboard, run_context
from benchmarks.render import _time

RUN_ID = "long-run"
CHUNK = 1000


def stored_run(db: Path, groups: int) -> ServiceStore:
    """The store at `db`, holding the synthetic run of `groups` groups (written on first use)."""
    store = ServiceStore(f"sqlite:///{db}")
    with store.session() as s:
        stored = EventRepo(s).count(RUN_ID)
    if stored:
        return store
    events = synthetic_run(RUN_ID, groups=groups, group_size=4, batch_groups=4)
    last = events[-1]
    events.append(Envelope(RUN_ID, last.seq + 1, last.t + 1.0, RunEnded("completed")))
    store.create_run(RUN_ID, "long synthetic run", {"kind": "sim", "speed": 100}, {})
    sink = SqlEventSink(store.engine)
    started = time.perf_counter()
    for i in range(0, len(events), CHUNK):
        sink.write_batch(events[i : i + CHUNK])
    print(f"stored {len(events):,} events in {time.perf_counter() - started:.1f} s ({db})")
    return store


def dashboard(manager: RunManager) -> tuple[Dashboard, httpx.AsyncClient]:
    app = FastAPI()
    dash = Dashboard(AccessConfig("bench-operator-token"), live=ManagerRuns(lambda: manager))
    mount_dashboard(app, dash)
    return dash, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench")


def get(path: str, manager: RunManager, fresh: bool = True, client: httpx.AsyncClient | None = None) -> str:
    """`path`'s body, from a fresh dashboard (nothing cached) unless `client` is given."""

    async def go() -> str:
        c = client if client is not None else dashboard(manager)[1]
        r = await c.get(path, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path}: {r.status_code}")
        return r.text

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db", type=Path, default=None, help="the store (kept, reused); default a temp dir")
    args = parser.parse_args()
    if not 1 <= args.groups <= 100_000 or not 1 <= args.repeat <= 100:
        parser.error("--groups must be in 1..100000 and --repeat in 1..100")
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "long.db"
        store = stored_run(db, args.groups)
        manager = RunManager(store, Path(tmp) / "data", 30.0)
        try:
            _measure(manager, args.repeat)
        finally:
            manager.shutdown()


def _measure(manager: RunManager, repeat: int) -> None:
    with manager.store.session() as s:
        events = EventRepo(s).count(RUN_ID)
    print(f"run: {events:,} events; median and max of {repeat} repeats")
    rows: list[tuple[str, Callable[[], object]]] = [
        ("GET /api/runs", manager.list),
        ("GET / (fresh)", lambda: get("/", manager)),
        (f"GET /runs/{RUN_ID} (fresh)", lambda: get(f"/runs/{RUN_ID}", manager)),
    ]
    print(f"{'':28} {'median ms':>10} {'max ms':>10} {'HTML kB':>9}")
    for name, fn in rows:
        _row(name, *_time(fn, repeat))

    # The page's live stream reads on until the view covers the whole stream: how long that takes.
    dash, client = dashboard(manager)
    live = dash.live
    assert live is not None
    started = time.perf_counter()
    view = live.view(RUN_ID)
    calls = 1
    while view is not None and view.catch_up_note is not None:
        live.version(RUN_ID)
        view = live.view(RUN_ID)
        calls += 1
    caught_up = time.perf_counter() - started
    assert view is not None
    print(f"{'catching up (all events)':28} {caught_up * 1000:10.1f} {'':>10} {'':>9}  ({calls} requests)")
    print(f"caught up: {len(view.batches):,} batches, {view.span_count:,} spans kept")
    ctx = {**run_context(view), "csrf": "x" * 32, "csrf_field": "csrf_token", "operator": True}

    def tick() -> list[str]:
        return [dash.render("run.html", ctx, b) for b in LIVE_BLOCKS]

    again = _time(lambda: get(f"/runs/{RUN_ID}", manager, client=client), repeat)
    _row(f"GET /runs/{RUN_ID} (again)", *again)
    _row("live stream tick", *_time(tick, repeat))
    trainer = dash.render("run.html", ctx, "trainer")
    print(f"trainer block: {len(trainer) / 1000:.0f} kB")
    _row("resume point (replay)", *_time(lambda: manager.store.resume_point(RUN_ID), repeat))


def _row(name: str, med: float, worst: float, out: object) -> None:
    size = "—"
    if isinstance(out, str):
        size = f"{len(out) / 1000:.0f}"
    elif isinstance(out, list) and all(isinstance(x, str) for x in out):
        size = f"{sum(len(x) for x in out) / 1000:.0f}"
    print(f"{name:28} {med * 1000:10.1f} {worst * 1000:10.1f} {size:>9}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
