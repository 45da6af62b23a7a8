"""Smoke test of the lane-isolation benchmark: real engines, real sandbox load, tiny settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1 (serving and lane CPU sets)"
)


def _running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "Z (zombie)" not in status


def test_core_function_reports_positive_latencies(monkeypatch: pytest.MonkeyPatch) -> None:
    # benchmarks/ is not an installed package; it is imported from the checkout.
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.lane_isolation import CONFIGS, LOADED, BenchConfig, run_benchmark

    seen: list[tuple[str, int]] = []
    report = run_benchmark(
        BenchConfig(rounds=1, turns=4, warmup_turns=1, layers=1, hidden=32, max_tokens=8, load_mib=16),
        on_turn=lambda name, round_index: seen.append((name, round_index)),
    )

    assert set(report) >= {"settings", "machine", "summary", "inflation_ratio", "target", "rounds"}
    assert sorted(seen) == sorted((name, 0) for name in CONFIGS for _ in range(4))
    for name in CONFIGS:
        row = report["summary"][name]
        assert row["turns"] == 4
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert all(x > 0 for x in report["latencies_ms"][name][0])
    for name in LOADED:
        assert report["summary"][name]["p99_inflation"] > 0
    assert report["inflation_ratio"] > 0
    assert report["target"]["met"] == (report["target"]["pinned_p99_inflation"] <= 1.15)
    # The engines this run started are gone.
    pids = [engine["pid"] for engine in report["engines"].values()]
    assert len(pids) == 2
    assert not any(_running(pid) for pid in pids)
