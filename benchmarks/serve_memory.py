"""Memory of `corral serve` as a simulated run's stream grows: where it goes, per run.

Builds the service as `corral serve` does (a `RunManager` over a SQLite `ServiceStore`, with
Prometheus metrics), creates simulated runs with the built-in sentinel trainer (a published version
per batch, as a trainer would), and at each mark of the first run's stream (events published) prints
the process's RSS, what tracemalloc holds, and the sizes of the per-run structures that could grow
with the stream: the recorder's recent events (`RecentEvents`), rollout log (`RolloutLog`) and live
view (`LiveView`), the runtime's own state (scheduler, ledger, report accumulator, weights map), the
gateway, the Prometheus series, and the store writes queued (`writes`: the offers and acks the
manager mirrors into the store, one at a time). At the end it stops the runs and prints what an
ended run still holds, and the allocation sites tracemalloc found growing most between the first and
the last mark.

Run: `.venv/bin/python -m benchmarks.serve_memory [--events 200000] [--speed 100] [--others 3]
[--no-tracemalloc] [--dashboard] [--ended 0]`. `--others` adds runs at speed 20, as the probe that
found the growth did; `--ended` then runs that many short runs (2 batches) one after another, and
prints how many ended runs' handles the server still holds and their size; `--dashboard` also builds
the dashboard's read model of the first run (app/web's `ManagerRuns.view`) at each mark and prints the
size of its per-run cache. It asserts nothing about the figures.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import CollectorRegistry
from sqlalchemy.exc import OperationalError

from app.metrics import CorralMetrics
from app.service.handle import RunHandle
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore

ATOMS = (str, bytes, int, float, bool, type(None))


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def deep_size(root: object, stop: Iterable[object] = ()) -> int:
    """Bytes of `root` and of the plain data it reaches (containers, dataclasses, __slots__ objects),
    never through a module, a function, a class or an object in `stop`."""
    seen = {id(s) for s in stop}
    total = 0
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type) or (callable(obj) and not hasattr(obj, "__dict__")):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, ATOMS):
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset) or type(obj).__name__ == "deque":
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("app."):
            todo.append(vars(obj))
        elif hasattr(obj, "__slots__"):
            todo.extend(getattr(obj, s) for s in type(obj).__slots__ if hasattr(obj, s))
    return total


def run_parts(handle: RunHandle) -> dict[str, int]:
    """Bytes of each per-run structure that could grow with the stream."""
    rec = handle.recorder
    parts = {
        "recent_events": deep_size(rec.recent, [rec.recent._lock]),
        "rollout_log": deep_size(rec.rollouts),
        "live_view": deep_size(rec.view),
        "gateway": deep_size(handle.gateway._offers) + deep_size(handle.gateway._restored),
    }
    runtime = handle.runtime
    if runtime is not None:
        stop = [runtime.bus, runtime.lanes, runtime.pool, runtime.source, runtime.trainer, handle.loop]
        parts["runtime"] = deep_size(runtime, stop)
    return parts


def series(metrics: CorralMetrics) -> int:
    return sum(len(family.samples) for family in metrics.registry.collect())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=200_000, help="stream length of the first run")
    parser.add_argument("--marks", type=int, default=4, help="measurements along the way")
    parser.add_argument("--speed", type=float, default=100.0, help="the first run's speed")
    parser.add_argument("--others", type=int, default=0, help="more runs at speed 20")
    parser.add_argument("--no-tracemalloc", action="store_true", help="RSS and sizes only (faster)")
    parser.add_argument("--dashboard", action="store_true", help="also measure the dashboard's run cache")
    parser.add_argument("--ended", type=int, default=0, help="then this many short runs, one after another")
    args = parser.parse_args(argv)
    if (
        not 1_000 <= args.events <= 100_000_000
        or not 1 <= args.marks <= 100
        or not 0 <= args.others <= 16
        or not 0 <= args.ended <= 1000
    ):
        said = "--events 1000 … 100,000,000, --marks 1 … 100, --others 0 … 16, --ended 0 … 1000"
        print(said, file=sys.stderr)
        return 2
    trace = not args.no_tracemalloc
    if trace:
        tracemalloc.start(8)
    with tempfile.TemporaryDirectory(prefix="corral-serve-memory-") as tmp:
        store = ServiceStore(f"sqlite:///{Path(tmp) / 'corral.db'}")
        metrics = CorralMetrics(CollectorRegistry())
        manager = RunManager(store, Path(tmp) / "data", 60.0, metrics)
        gc.collect()
        base_rss = rss_mib()
        print(f"before any run: rss {base_rss:.1f} MiB")
        spec = {"name": "probe", "kind": "sim", "trainer": "sentinel", "sentinel_step_s": 0.2}
        first = manager.create(RunCreate.model_validate({**spec, "speed": args.speed}))
        others = [
            manager.create(RunCreate.model_validate({**spec, "speed": 20.0})) for _ in range(args.others)
        ]
        handle = manager.handles[first]
        dashboard = None
        if args.dashboard:
            from app.web.live import ManagerRuns

            dashboard = ManagerRuns(lambda: manager)
        marks = [args.events * (i + 1) // args.marks for i in range(args.marks)]
        header = f"{'events':>9} {'wall s':>7} {'RSS MiB':>8} {'traced MiB':>10} {'series':>6} {'writes':>6}"
        names = ["recent_events", "rollout_log", "live_view", "runtime", "gateway"]
        names += ["dashboard"] if args.dashboard else []
        print(header + "".join(f" {n + ' KiB':>18}" for n in names))
        started = time.monotonic()
        first_snap = None
        last_snap = None
        for mark in marks:
            while handle.recorder.view.events < mark and not handle.done.is_set():
                time.sleep(0.2)
            manager.sample_metrics()
            parts = run_parts(handle)
            if dashboard is not None:
                try:
                    dashboard.view(first)
                except OperationalError as exc:  # SQLite busy under the run's writes: measured next time
                    print(f"dashboard view not built: {exc.orig}")
                entry = dashboard._cache[first]
                parts["dashboard"] = deep_size(entry, [entry.lock])
            traced = tracemalloc.get_traced_memory()[0] / 2**20 if trace else float("nan")
            queued = len(manager._writer._queue) + len(manager._writer._first)
            print(
                f"{handle.recorder.view.events:>9,} {time.monotonic() - started:>7.0f} {rss_mib():>8.1f} "
                f"{traced:>10.1f} {series(metrics):>6} {queued:>6}"
                + "".join(f" {parts.get(n, 0) / 1024:>18.0f}" for n in names),
                flush=True,
            )
            if trace:
                snap = tracemalloc.take_snapshot()
                first_snap = first_snap or snap
                last_snap = snap
        for run_id in [first, *others]:
            live = manager.handles[run_id]
            live.submit(live.stop).result(10)
        for run_id in [first, *others]:
            manager.handles[run_id].join(120)
        short = []  # short runs ended one after another: what the server keeps of each ended run
        for _ in range(args.ended):
            short.append(manager.create(RunCreate.model_validate({**spec, "speed": 100.0, "batches": 2})))
            manager.handles[short[-1]].join(120)
        gc.collect()
        manager.sample_metrics()
        ended = sum(deep_size(manager.handles[r].recorder) for r in [first, *others] if r in manager.handles)
        held = [h for h in manager.handles.values() if h.done.is_set()]
        parts = sum(sum(run_parts(h).values()) for h in held)
        print(
            f"ended: rss {rss_mib():.1f} MiB, series {series(metrics)}, "
            f"handles held {len(manager.handles)}, their recorders {ended / 2**20:.1f} MiB"
        )
        traced = f", traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB" if trace else ""
        print(
            f"after {len(short) + 1 + len(others)} runs ended: rss {rss_mib():.1f} MiB{traced}, handles held "
            f"{len(held)}, their recorders, live views, rollout logs, gateways and runtimes "
            f"{parts / 2**20:.1f} MiB"
        )
        if trace and first_snap is not None and last_snap is not None and first_snap is not last_snap:
            print("growth between the first and the last mark, by allocation site:")
            for stat in last_snap.compare_to(first_snap, "lineno")[:12]:
                frame = stat.traceback[0]
                where = frame.filename.split("site-packages/")[-1]
                size, blocks = stat.size_diff / 1024, stat.count_diff
                print(f"  {size:>10.0f} KiB  {blocks:>8} blocks  {where}:{frame.lineno}")
        manager.shutdown(5)
        store.close()
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
