"""benchmarks/real_pairs.py reports what each run's batches held and what it lost, so a `full` that is
fast because a task never reaches a batch shows in its output and in pairs.json."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def real_pairs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    # benchmarks/ is not an installed package; it is imported from the checkout.
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import real_pairs

    return real_pairs


def reset_op(group: int, seconds: float) -> dict[str, Any]:
    return {"kind": "sandbox_op", "lane": "reset", "ok": True, "group_id": group, "start": 10.0,
            "end": 10.0 + seconds}  # fmt: skip


def make_report(**overrides: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "discarded_groups": {"failed": 1, "stale": 0},
        "discard_details": {"failed": {"task slow: set-up timed out: [corral: killed ...]": 1}},
        "group_tasks": {"0": "quick", "1": "slow", "2": "quick"},
        "tasks_by_outcome": {"delivered": {"quick": 2}, "failed": {"slow": 1}},
        "event_log": [reset_op(0, 0.5), reset_op(2, 1.5), reset_op(1, 120.0), {"kind": "turn"}],
    }
    report.update(overrides)
    return report


def test_a_task_that_never_reaches_a_batch_is_named(real_pairs: ModuleType) -> None:
    makeup = real_pairs.batch_makeup(make_report())
    assert makeup["tasks_in_batches"] == {"quick": 2}
    assert makeup["tasks_never_in_a_batch"] == ["slow"]
    assert makeup["reset_s_by_task"] == {
        "quick": {"n": 2, "median": 1.0, "max": 1.5},
        "slow": {"n": 1, "median": 120.0, "max": 120.0},
    }
    lines = real_pairs.describe_run("pair 1 full", makeup)
    assert "  failed x1: task slow: set-up timed out: [corral: killed ...]" in lines
    assert "  never in a batch: slow" in lines


def test_a_report_without_group_tasks_still_gives_its_discards(real_pairs: ModuleType) -> None:
    report = make_report()
    del report["group_tasks"]
    makeup = real_pairs.batch_makeup(report)
    assert makeup["discarded"] == {"failed": 1, "stale": 0}
    assert "tasks_in_batches" not in makeup
    assert real_pairs.describe_run("old", makeup)[1].startswith("  failed x1: task slow")
