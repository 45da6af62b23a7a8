"""A run's labelled Prometheus series go once the run has ended and its grace has passed; the totals
over every run stay. In multiprocess mode (no removal there) the exposition leaves them out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from app.core.events import BatchDelivered, EngineUpdateEnd, Envelope, Event, GroupDelivered, GroupDiscarded
from app.metrics import CorralMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def feed(metrics: CorralMetrics, run_id: str) -> None:
    events: list[Event] = [
        GroupDelivered(0, 0, 1, (1.0, 0.0)),
        GroupDiscarded(1, "stale", ""),
        BatchDelivered(0, (0,), 0, 1.0, 2.0, (1,)),
        EngineUpdateEnd("engine-0", 1),
    ]
    metrics.sink(run_id).write_batch([Envelope(run_id, i, 3.0, ev) for i, ev in enumerate(events)])
    live = {"groups_live": 2, "lanes": {"exec": {"queue_depth": 3}}, "engine_versions": {"engine-0": 1}}
    metrics.sample_run(run_id, live)


def series(metrics: CorralMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = metrics.exposition()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def runs_in(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    return {dict(labels)["run"] for _, labels in samples if "run" in dict(labels)}


def test_an_ended_runs_series_go_after_the_grace_and_the_totals_stay() -> None:
    # Every run's series stayed for the server's life: 46 samples a run, ended ones included.
    clock = Clock()
    metrics = CorralMetrics(CollectorRegistry(), grace_s=60.0, clock=clock)
    feed(metrics, "old")
    feed(metrics, "live")
    metrics.forget_run("old", {"lanes": {"exec": {}}})
    clock.now += 59.0
    assert metrics.expire() == []
    assert runs_in(series(metrics)) == {"old", "live"}  # within the grace: its last values are scraped
    clock.now += 2.0
    assert metrics.expire() == ["old"]
    samples = series(metrics)
    assert runs_in(samples) == {"live"}
    assert samples[("corral_runs_batches_delivered_total", ())] == 2
    assert samples[("corral_runs_discarded_groups_total", (("reason", "stale"),))] == 2
    assert samples[("corral_runs_events_total", ())] == 8
    assert samples[("corral_runs_trainer_idle_seconds_total", ())] == 4.0  # 2 s a run
    assert metrics.expire() == []


SCRAPER = """
from app.metrics import CorralMetrics
from test_metrics import Clock, feed
clock = Clock()
m = CorralMetrics(grace_s=0.0, clock=clock)
feed(m, "old")
feed(m, "live")
m.forget_run("old", {})
m.expire()
print(m.exposition()[0].decode())
"""


def test_in_multiprocess_mode_an_expired_run_is_left_out_of_the_exposition(tmp_path: Path) -> None:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parent)}
    text = subprocess.run(
        [sys.executable, "-W", "error", "-c", SCRAPER], env=env, check=True, timeout=60, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    runs = {
        s.labels["run"] for f in text_string_to_metric_families(text) for s in f.samples if "run" in s.labels
    }
    assert runs == {"live"}
    assert "corral_runs_batches_delivered_total 2.0" in text


def test_a_server_nobody_scrapes_keeps_only_the_series_of_runs_ended_within_the_grace() -> None:
    # Only a scrape removed expired series: with no Prometheus, 200 runs ended one after another
    # (100 of them deleted) left all 200 runs' series in the registry (46 samples a run).
    clock = Clock()
    metrics = CorralMetrics(CollectorRegistry(), grace_s=60.0, clock=clock)
    for i in range(200):
        feed(metrics, f"r{i}")
        metrics.forget_run(f"r{i}", {"lanes": {"exec": {}}})
        if i % 2:
            metrics.drop_run(f"r{i}")
        clock.now += 10.0
    runs = {
        labels["run"]
        for family in metrics.registry.collect()
        for name, labels, _ in (s[:3] for s in family.samples)
        if "run" in labels
    }
    assert runs == {f"r{i}" for i in range(194, 200, 2)}  # ended within the last 60 s, not deleted
