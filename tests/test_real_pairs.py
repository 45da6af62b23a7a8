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


def run(mean: float) -> dict[str, Any]:
    return {"mean_s": mean, "p90_s": 2 * mean}


def test_a_variant_gets_its_ratio_to_full_per_pair_and_a_median(
    real_pairs: ModuleType, tmp_path: Path
) -> None:
    pairs = [
        {"pair": 1, "full": run(20.0), "sync": run(30.0), "variant": {"label": "fifo", **run(25.0)}},
        {"pair": 2, "full": run(20.0), "sync": run(40.0), "variant": {"label": "fifo", **run(18.0)}},
        {"pair": 3, "full": run(10.0), "sync": run(15.0), "variant": {"label": "fifo", **run(30.0)}},
        {"pair": 4, "full": run(10.0), "sync": run(15.0)},  # interrupted before its variant ran
    ]
    summary = real_pairs.summarise(pairs)
    assert [p.get("ratio_variant_over_full") for p in pairs] == [1.25, 0.9, 3.0, None]
    assert summary["variant"] == "fifo"
    assert summary["median_ratio_variant_over_full"] == 1.25
    assert summary["full_faster_than_variant_in"] == 2
    assert summary["median_ratio_sync_over_full"] == 1.5
    real_pairs.plot(summary, tmp_path / "pairs.png")  # a pair without its variant plots two bars
    assert (tmp_path / "pairs.png").stat().st_size > 0
    assert "median_ratio_variant_over_full" not in real_pairs.summarise(pairs[3:])


def test_a_variant_names_a_config_that_exists(real_pairs: ModuleType, tmp_path: Path) -> None:
    config = tmp_path / "fifo.yaml"
    config.write_text("seed: 0\n")
    assert real_pairs.variant_arg(f"fifo={config}") == ("fifo", config)
    for bad, needle in (
        ("fifo", "LABEL=CONFIG"),
        ("=x.yaml", "LABEL=CONFIG"),
        ("fifo=/no/such.yaml", "no config"),
    ):
        with pytest.raises(real_pairs.argparse.ArgumentTypeError, match=needle):
            real_pairs.variant_arg(bad)
