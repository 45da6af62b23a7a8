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

A run's labelled series go away `RUN_SERIES_GRACE_S` after it ends (`forget_run`, then `expire` at a
later scrape or at a later run's end; a deleted run's at once): the grace lets Prometheus scrape their
last values, and a server that drives run after run does not keep every one's series for its life, scraped
or not. The `corral_runs_*` counters carry no run label
and keep the totals over every run, ended ones included. In multiprocess mode prometheus_client cannot
remove a series (the values stay in the processes' files until the directory is emptied), so the
exposition leaves out the series of runs this process saw end and expire; those of a run that ended in
another process (an orchestrator worker) stay until the control plane restarts.

Each `CorralMetrics` has its own registry (an app factory builds one per app, so tests can build
several); in multiprocess mode all of them write to the shared directory.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
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
from prometheus_client.metrics_core import Metric

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


# The per-run metrics with a second label (reason, engine, lane): their children are noted (`labelled`).
TWO_LABELS = frozenset({"corral_discarded_groups", "corral_engine_weight_version", "corral_lane_queue_depth"})
# How long a run's labelled series stay after it ends: several scrape intervals, so its last values are
# scraped before they go.
RUN_SERIES_GRACE_S = 300.0

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
    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        grace_s: float = RUN_SERIES_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        hold_multiprocess_dir()
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._expiring: dict[str, float] = {}  # ended runs -> when their series go
        self._children: dict[str, set[tuple[str, str]]] = {}  # run -> (metric, second label) it set
        self._gone: set[str] = set()  # multiprocess mode: expired runs, left out of the exposition
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
        # Totals over every run, ended ones included: they outlive the runs' own series.
        self.all_trainer_idle = Counter(
            "corral_runs_trainer_idle_seconds", "Time trainers waited for batches, all runs", registry=reg
        )
        self.all_batches = Counter(
            "corral_runs_batches_delivered", "Trainer batches delivered, all runs", registry=reg
        )
        self.all_discarded_groups = Counter(
            "corral_runs_discarded_groups", "Groups discarded by reason, all runs", ["reason"], registry=reg
        )
        self.all_events = Counter("corral_runs_events", "Run events observed, all runs", registry=reg)
        self._per_run: dict[str, Any] = {
            "corral_trainer_idle_seconds": self.trainer_idle,
            "corral_batch_collection_seconds": self.batch_collection,
            "corral_batches_delivered": self.batches,
            "corral_groups_in_flight": self.groups_in_flight,
            "corral_group_staleness": self.group_staleness,
            "corral_engine_weight_version": self.engine_weight_version,
            "corral_lane_queue_depth": self.lane_queue_depth,
            "corral_discarded_groups": self.discarded_groups,
            "corral_events": self.events,
        }

    def labelled(self, run_id: str, metric: str, second: str) -> Any:
        """The child of a two-label per-run metric, noted so that `expire` can remove it."""
        with self._lock:
            self._children.setdefault(run_id, set()).add((metric, second))
        return self._per_run[metric].labels(run_id, second)

    def sink(self, run_id: str) -> MetricsSink:
        return MetricsSink(self, run_id)

    def sample_run(self, run_id: str, live: dict[str, Any]) -> None:
        """Set the gauges the event stream does not carry from a live run's view."""
        self.groups_in_flight.labels(run_id).set(float(live.get("groups_live", 0)))
        for lane, stats in live.get("lanes", {}).items():
            self.labelled(run_id, "corral_lane_queue_depth", lane).set(float(stats["queue_depth"]))
        for engine, version in live.get("engine_versions", {}).items():
            self.labelled(run_id, "corral_engine_weight_version", engine).set(float(version))

    def forget_run(self, run_id: str, live: dict[str, Any]) -> None:
        """A run ended: its gauges go to zero (a finished run has nothing in flight or queued), and its
        series go `grace_s` from now (`expire`)."""
        self.groups_in_flight.labels(run_id).set(0)
        for lane in live.get("lanes", {}):
            self.labelled(run_id, "corral_lane_queue_depth", lane).set(0)
        with self._lock:
            self._expiring[run_id] = self._clock() + self.grace_s
        self.expire()  # those of runs ended longer ago: a server nobody scrapes kept every run's series

    def drop_run(self, run_id: str) -> None:
        """A run deleted: its series go now, whatever was left of its grace."""
        with self._lock:
            self._expiring[run_id] = float("-inf")
        self.expire()

    def expire(self) -> list[str]:
        """Remove the series of the runs whose grace after their end has passed; the runs removed."""
        now = self._clock()
        with self._lock:
            due = [run_id for run_id, at in self._expiring.items() if at <= now]
            for run_id in due:
                del self._expiring[run_id]
            children = {run_id: self._children.pop(run_id, set()) for run_id in due}
            if multiprocess_dir() is not None:  # no removal there: the exposition leaves them out
                self._gone.update(due)
                return due
        for run_id in due:
            for name, metric in self._per_run.items():
                if name not in TWO_LABELS:
                    metric.remove(run_id)
            for name, second in children[run_id]:
                self._per_run[name].remove(run_id, second)
        return due

    def exposition(self) -> tuple[bytes, str]:
        path = multiprocess_dir()
        if path is not None:
            registry = CollectorRegistry()
            files = prom_multiprocess.MultiProcessCollector(None, path=path)  # type: ignore[no-untyped-call]
            with self._lock:
                gone = frozenset(self._gone)
            registry.register(_Without(files, gone))
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Without:
    """A collector: another's families without the samples of the runs in `runs`."""

    def __init__(self, inner: Any, runs: frozenset[str]) -> None:
        self.inner = inner
        self.runs = runs

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            family.samples = [s for s in family.samples if s.labels.get("run") not in self.runs]
            yield family


class MetricsSink:
    """An event-bus sink (`write_batch`) that turns one run's events into metric updates."""

    def __init__(self, metrics: CorralMetrics, run_id: str) -> None:
        self.m = metrics
        self.run_id = run_id

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        m, run = self.m, self.run_id
        m.events.labels(run).inc(len(envelopes))
        m.all_events.inc(len(envelopes))
        for env in envelopes:
            ev = env.event
            if isinstance(ev, BatchDelivered):
                wait = max(0.0, env.t - ev.requested_at)
                m.batch_collection.labels(run).observe(wait)
                m.trainer_idle.labels(run).inc(wait)
                m.batches.labels(run).inc()
                m.all_trainer_idle.inc(wait)
                m.all_batches.inc()
            elif isinstance(ev, GroupDelivered):
                m.group_staleness.labels(run).observe(ev.staleness)
            elif isinstance(ev, GroupDiscarded):
                m.labelled(run, "corral_discarded_groups", ev.reason).inc()
                m.all_discarded_groups.labels(ev.reason).inc()
            elif isinstance(ev, EngineUpdateEnd) and ev.ok:
                m.labelled(run, "corral_engine_weight_version", ev.engine).set(ev.version)
            elif isinstance(ev, GroupAdmitted):
                pass  # in flight is sampled from the scheduler (ready groups leave without an event)


def mark_process_dead(pid: int) -> None:
    """A process that contributed in multiprocess mode exited (a Celery pool process, a worker): its
    live gauges stop counting. Call it from the parent's child-exit hook; no-op outside that mode."""
    path = multiprocess_dir()
    if path is not None:
        prom_multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
