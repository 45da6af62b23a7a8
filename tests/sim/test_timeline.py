"""Group timelines in reports and their plot."""

from __future__ import annotations

from pathlib import Path

from factories import make_workload_data

from app.plots import plot_timeline, timeline_figure
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload


def test_timeline_rows_account_for_every_group_in_order(tmp_path: Path) -> None:
    workload = Workload.model_validate(make_workload_data(batches=3))
    report = simulate(workload, policy_for(workload, "full"), "full", timeline=True)
    rows = report["groups_timeline"]
    assert len(rows) == report["admitted_groups"]
    assert sum(r["outcome"] == "delivered" for r in rows) == report["delivered_groups"]
    for row in rows:
        assert row["ended_s"] is not None
        assert row["admitted_s"] <= row["ended_s"]
        if row["outcome"] == "delivered":
            assert row["admitted_s"] <= row["completed_s"] <= row["ended_s"]
            assert row["batch"] is not None
    assert [m["batch"] for m in report["batch_marks"]] == list(range(report["batches"]))
    out = tmp_path / "timeline.png"
    plot_timeline(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reports_leave_the_timeline_out_unless_asked() -> None:
    workload = Workload.model_validate(make_workload_data(batches=1))
    assert "groups_timeline" not in simulate(workload, policy_for(workload, "sync"), "sync")


def test_the_timeline_title_counts_batches_and_says_when_none_came() -> None:
    """A `corral run` stopped during start-up: its plot said `0 batches, mean collection 0.0 s` (the
    report's mean of no batch, now null), and one batch was `1 batches`."""
    workload = Workload.model_validate(make_workload_data(batches=1))
    report = simulate(workload, policy_for(workload, "full"), "full", timeline=True)
    mean = report["batch_collection_s"]["mean"]
    title = timeline_figure(report).axes[0].get_title()
    assert title.startswith(f"full: 1 batch, mean collection {mean:.1f} s; ")
    stopped = {**report, "batches": 0, "batch_collection_s": {"mean": None, "per_batch": []},
               "groups_timeline": [], "batch_marks": [], "update_log": []}  # fmt: skip
    title = timeline_figure(stopped).axes[0].get_title()
    assert title.startswith("full: no batch delivered; ")
    assert "0.0 s" not in title
