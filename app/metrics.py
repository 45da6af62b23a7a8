"""Prometheus metrics for Corral, fed by an event-bus sink (`MetricsSink`) and, for the gauges the event
stream does not carry (lane queue depth, groups in flight), sampled from live runs at scrape time.

Names follow Prometheus' rules: a `corral_` prefix, base units in the name (`_seconds`), `_total` on
counters (the client library appends it), no unit suffix on unitless gauges.

Multiprocess mode: when `PROMETHEUS_MULTIPROC_DIR` is set (before the metrics are built), every process
that builds `CorralMetrics` (the API, the orchestrator, Celery lane workers) writes its values to files
in that directory, and `/metrics` aggregates them with `MultiProcessCollector`: counters and histograms
are summed, `corral_groups_in_flight` and `corral_lane_queue_depth` are summed over live processes (a
process's parent calls `mark_process_dead(pid)` when it exits), and `corral_engine_weight_version`
takes the maximum.

Between runs of the whole control plane the directory must be emptied (prometheus_client's rule): a
new process whose pid a dead one had (every container start reuses its pids) opens that process's files
and counts on from its values, its live gauges included. `corral serve`, which starts first, empties
the directory's `*.db` files at its start, before any metric is built (`empty_multiprocess_dir`), but
only when it owns the directory: no other process holds it. Every process that writes there holds a
shared lock on its lock file (`LOCK_NAME`) for its life (`hold_multiprocess_dir`: `CorralMetrics`, a
Celery worker's main process), and `corral serve` empties the directory only when its exclusive lock
is granted at once; a `corral serve` restarted alone, while orchestrator workers go on, leaves the
files as they are (emptying them would take the workers' counts away).

Each `CorralMetrics` has its own registry (an app factory builds one per app, so tests can build
several); in multiprocess mode all of them write to the shared directory.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client import multiprocess as prom_multiprocess

from app.core.events import (
    BatchDelivered,
    EngineUpdateEnd,
    Envelope,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
)

COLLECTION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, float("inf"))
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, float("inf"))


LOCK_NAME = ".corral-metrics.lock"
_held: dict[str, int] = {}  # multiprocess directory -> the descriptor of its lock, held for life


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def hold_multiprocess_dir() -> None:
    """This process writes to the multiprocess directory: a shared lock on its lock file, held until the
    process exits (a forked child inherits it), so that no starting `corral serve` empties it under us.
    No-op outside multiprocess mode, or once held."""
    path = multiprocess_dir()
    if path is None or path in _held or not Path(path).is_dir():
        return
    fd = os.open(Path(path) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting `corral serve` empties the directory
    _held[path] = fd


def empty_multiprocess_dir() -> list[str] | None:
    """At `corral serve`'s start, before any metric is built: remove the directory's `*.db` files when
    this process owns it (its exclusive lock is granted at once: no other process holds it), then hold
    it as every writer does. Returns the names removed, or None where it was not emptied (not in
    multiprocess mode, no such directory, or another process holds it)."""
    path = multiprocess_dir()
    if path is None or path in _held or not Path(path).is_dir():
        return None
    fd = os.open(Path(path) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a worker (or another server) writes there now: its files stay
        os.close(fd)
        hold_multiprocess_dir()
        return None
    removed = []
    for stale in sorted(Path(path).glob("*.db")):
        stale.unlink(missing_ok=True)
        removed.append(stale.name)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held[path] = fd
    return removed


class CorralMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        hold_multiprocess_dir()
        # In multiprocess mode values live in files; the registry only matters in single-process mode.
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.trainer_idle = Counter(
            "corral_trainer_idle_seconds", "Time the trainer waited for batches", ["run"], registry=reg
        )
        self.batch_collection = Histogram(
            "corral_batch_collection_seconds",
            "Per trainer step: from asking for a batch to its delivery",
            ["run"],
            buckets=COLLECTION_BUCKETS,
            registry=reg,
        )
        self.batches = Counter("corral_batches_delivered", "Trainer batches delivered", ["run"], registry=reg)
        self.groups_in_flight = Gauge(
            "corral_groups_in_flight",
            "Groups admitted and not yet ended (running or ready), bounded by B + S",
            ["run"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.group_staleness = Histogram(
            "corral_group_staleness",
            "Staleness of delivered groups: trainer version at consume minus the oldest turn version",
            ["run"],
            buckets=STALENESS_BUCKETS,
            registry=reg,
        )
        self.engine_weight_version = Gauge(
            "corral_engine_weight_version",
            "Policy version each engine serves",
            ["run", "engine"],
            registry=reg,
            multiprocess_mode="max",
        )
        self.lane_queue_depth = Gauge(
            "corral_lane_queue_depth",
            "Sandbox operations waiting for a slot in each lane",
            ["run", "lane"],
            registry=reg,
            multiprocess_mode="livesum",
        )
        self.discarded_groups = Counter(
            "corral_discarded_groups", "Groups discarded, by reason", ["run", "reason"], registry=reg
        )
        self.events = Counter(
            "corral_events", "Run events observed by the metrics sink", ["run"], registry=reg
        )

    def sink(self, run_id: str) -> MetricsSink:
        return MetricsSink(self, run_id)

    def sample_run(self, run_id: str, live: dict[str, Any]) -> None:
        """Set the gauges the event stream does not carry from a live run's view."""
        self.groups_in_flight.labels(run_id).set(float(live.get("groups_live", 0)))
        for lane, stats in live.get("lanes", {}).items():
            self.lane_queue_depth.labels(run_id, lane).set(float(stats["queue_depth"]))
        for engine, version in live.get("engine_versions", {}).items():
            self.engine_weight_version.labels(run_id, engine).set(float(version))

    def forget_run(self, run_id: str, live: dict[str, Any]) -> None:
        """A run ended: its gauges go to zero (a finished run has nothing in flight or queued)."""
        self.groups_in_flight.labels(run_id).set(0)
        for lane in live.get("lanes", {}):
            self.lane_queue_depth.labels(run_id, lane).set(0)

    def exposition(self) -> tuple[bytes, str]:
        path = multiprocess_dir()
        if path is not None:
            registry = CollectorRegistry()
            prom_multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsSink:
    """An event-bus sink (`write_batch`) that turns one run's events into metric updates."""

    def __init__(self, metrics: CorralMetrics, run_id: str) -> None:
        self.m = metrics
        self.run_id = run_id

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        m, run = self.m, self.run_id
        m.events.labels(run).inc(len(envelopes))
        for env in envelopes:
            ev = env.event
            if isinstance(ev, BatchDelivered):
                wait = max(0.0, env.t - ev.requested_at)
                m.batch_collection.labels(run).observe(wait)
                m.trainer_idle.labels(run).inc(wait)
                m.batches.labels(run).inc()
            elif isinstance(ev, GroupDelivered):
                m.group_staleness.labels(run).observe(ev.staleness)
            elif isinstance(ev, GroupDiscarded):
                m.discarded_groups.labels(run, ev.reason).inc()
            elif isinstance(ev, EngineUpdateEnd) and ev.ok:
                m.engine_weight_version.labels(run, ev.engine).set(ev.version)
            elif isinstance(ev, GroupAdmitted):
                pass  # in flight is sampled from the scheduler (ready groups leave without an event)


def mark_process_dead(pid: int) -> None:
    """A process that contributed in multiprocess mode exited (a Celery pool process, a worker): its
    live gauges stop counting. Call it from the parent's child-exit hook; no-op outside that mode."""
    path = multiprocess_dir()
    if path is not None:
        prom_multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
