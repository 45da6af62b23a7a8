"""Group timelines in reports and their plot."""

from __future__ import annotations

from pathlib import Path

from factories import make_workload_data

from app.plots import plot_timeline
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
