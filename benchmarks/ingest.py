"""Event ingestion: events per second that `SqlEventSink.write_batch` stores into Postgres (and SQLite).

The stream is a seeded synthetic run shaped like the terminal-bench workload in docs/design.md: groups of
G=8 attempts, each a reset, 18 turns with a tool call after each, a validation and a cleanup, plus the
group's lifecycle (admitted, started/finished attempts, ready, delivered) and a batch every B=8 groups.
About 94% of the events are timeline events (turns and sandbox ops); each becomes one raw `events` row
and two `spans` rows (the phase and its queue wait), and the group/trajectory/batch projections are
upserted per batch, so the figure is the sink's whole work, not a bare insert.

Each (backend, batch size) gets a fresh, migrated database (Postgres: a scratch database on the server;
SQLite: a WAL file in a temp dir); each of `--repeats` runs ingests the whole stream of a fresh run id
through one sink on one connection, in batches of `--batch` envelopes, each batch its own transaction,
exactly as the event bus calls the sink. Envelope construction is not timed. It reports the median
(and min/max) events per wall second, and the CPU it took: this process's, and the Postgres backend's
read from /proc (so a local server only); `ev/CPU-s` is events per CPU-second of both together, a figure
that depends far less than the wall rate on what else the machine is running. It asserts nothing about
speed.

Run: `.venv/bin/python -m benchmarks.ingest [--events 60000 --batch 500 1000 2000 --repeats 5]`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import text

from app.core.events import (
    AttemptFinished,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupReady,
    SandboxOp,
    TurnDone,
)
from app.store.db import make_engine, scratch_database
from app.store.migrate import upgrade_to_head
from app.store.sink import SqlEventSink

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TIMELINE = ("turn", "sandbox_op")


def synthetic_stream(
    run_id: str, events: int, seed: int = 0, group_size: int = 8, turns: int = 18
) -> list[Envelope]:
    """At least `events` envelopes of a run, in seq order (groups run one after another; the sink does
    not care about interleaving, only about how many rows each event produces)."""
    rng = random.Random(seed)
    out: list[Envelope] = []
    t = 0.0
    ready: list[int] = []
    batch = 0

    def emit(event: Event) -> None:
        out.append(Envelope(run_id, len(out), t, event))

    group = 0
    while len(out) < events:
        emit(
            GroupAdmitted(
                group_id=group, task_index=group % 50, group_size=group_size, task=f"task-{group % 50}"
            )
        )
        for attempt in range(group_size):
            emit(AttemptStarted(group_id=group, attempt=attempt))
            for lane, n in (("reset", 1), ("turns", turns), ("validate", 1), ("cleanup", 1)):
                for k in range(n):
                    queued = t
                    start = t + rng.expovariate(20.0)
                    t = start + rng.expovariate(2.0)
                    if lane == "turns":
                        tokens = rng.randint(20, 2000)
                        emit(TurnDone(group_id=group, attempt=attempt, engine=f"e{k % 4}", version=batch,
                                      queued_at=queued, start=start, end=t, tokens=tokens))  # fmt: skip
                        queued, start = t, t + rng.expovariate(50.0)
                        t = start + rng.expovariate(3.0)
                        emit(SandboxOp(group_id=group, attempt=attempt, lane="exec", queued_at=queued,
                                       start=start, end=t))  # fmt: skip
                    else:
                        emit(SandboxOp(group_id=group, attempt=attempt, lane=lane, queued_at=queued,
                                       start=start, end=t))  # fmt: skip
            emit(AttemptFinished(group_id=group, attempt=attempt, reward=float(rng.random() < 0.5)))
        emit(GroupReady(group_id=group))
        ready.append(group)
        if len(ready) == 8:
            emit(BatchRequested(batch_index=batch))
            for gid in ready:
                emit(GroupDelivered(group_id=gid, batch_index=batch, staleness=0))
            emit(BatchDelivered(batch_index=batch, group_ids=tuple(ready), trainer_version=batch,
                                requested_at=t, ready_at=t))  # fmt: skip
            batch += 1
            ready = []
        group += 1
    return out


@dataclass
class Sample:
    events: int
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float | None  # the Postgres backend's CPU, when its /proc entry is readable

    @property
    def per_s(self) -> float:
        return self.events / self.wall_s

    @property
    def per_cpu_s(self) -> float | None:
        if self.server_cpu_s is None:
            return None
        return self.events / (self.client_cpu_s + self.server_cpu_s)


def backend_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a local process, from /proc (None when it is not readable: a remote server)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(url: str, streams: list[list[Envelope]], batch: int) -> list[Sample]:
    """One sample per stream (one run id each), written through one sink on one connection to `url`."""
    engine = make_engine(url, pool_size=1, max_overflow=0) if url.startswith("postgres") else make_engine(url)
    sink = SqlEventSink(engine)
    samples = []
    try:
        pid = None
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        for envelopes in streams:
            chunks = [envelopes[i : i + batch] for i in range(0, len(envelopes), batch)]
            server0, cpu0, t0 = backend_cpu_s(pid), time.process_time(), time.perf_counter()
            for chunk in chunks:
                sink.write_batch(chunk)
            wall, cpu, server1 = time.perf_counter() - t0, time.process_time() - cpu0, backend_cpu_s(pid)
            server = None if server0 is None or server1 is None else server1 - server0
            if pid is None:
                server = 0.0  # SQLite works inside this process: its CPU is the client's
            samples.append(Sample(len(envelopes), wall, cpu, server))
    finally:
        engine.dispose()
    if sink.written != sum(len(e) for e in streams):
        raise RuntimeError(f"sink stored {sink.written} events, expected {sum(len(e) for e in streams)}")
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=60_000, help="events per measured run")
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[500, 1000, 2000], help="envelopes per write_batch"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=["postgres", "sqlite", "both"], default="both")
    parser.add_argument("--postgres-url", default=POSTGRES_URL, help="a role that may CREATE DATABASE")
    args = parser.parse_args(argv)
    for name in ("events", "repeats"):
        if getattr(args, name) < 1:
            print(f"error: --{name} must be ≥ 1", file=sys.stderr)
            return 2
    if any(b < 1 for b in args.batch):
        print("error: --batch sizes must be ≥ 1", file=sys.stderr)
        return 2

    sample = synthetic_stream("sample", args.events)
    kinds = Counter(e.kind for e in sample)
    timeline = sum(kinds[k] for k in TIMELINE)
    share = timeline / len(sample)
    print(f"stream: {len(sample)} events per run, {share:.1%} timeline (turns, sandbox ops); "
          f"{kinds['group_admitted']} groups of 8")  # fmt: skip
    backends = ["postgres", "sqlite"] if args.backend == "both" else [args.backend]
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'backend':<9} {'batch':>6} {'median ev/s':>12} {'min':>9} {'max':>9} {'ev/CPU-s':>9} "
          f"{'client µs/ev':>12} {'server µs/ev':>12}  runs")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            for batch in args.batch:
                with scratch_database(backend, args.postgres_url, Path(tmp)) as url:
                    upgrade_to_head(url)
                    streams = [
                        synthetic_stream(uuid.uuid4().hex, args.events, seed=i) for i in range(args.repeats)
                    ]
                    samples = measure(url, streams, batch)
                rates = [x.per_s for x in samples]
                per_cpu = [x.per_cpu_s for x in samples if x.per_cpu_s is not None]
                cpu_col = f"{statistics.median(per_cpu):>9,.0f}" if per_cpu else f"{'n/a':>9}"
                client = statistics.median(1e6 * x.client_cpu_s / x.events for x in samples)
                servers = [1e6 * x.server_cpu_s / x.events for x in samples if x.server_cpu_s is not None]
                server_col = f"{statistics.median(servers):>12.1f}" if servers else f"{'n/a':>12}"
                print(f"{backend:<9} {batch:>6} {statistics.median(rates):>12,.0f} {min(rates):>9,.0f} "
                      f"{max(rates):>9,.0f} {cpu_col} {client:>12.1f} {server_col}  "
                      f"{args.repeats}")  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.1f}. ev/CPU-s: events per CPU-second of this process "
          "plus the Postgres backend serving it (what the rate would be with no CPU contention and no "
          "overlap between them)")  # fmt: skip
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
