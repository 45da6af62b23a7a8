"""benchmarks/sim_vs_real.py: the real pairs' attempts replayed at their own settings, beside the real
figures, from the reports committed in docs/runs/stop45."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "runs" / "stop45"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.sim_vs_real", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_it_replays_the_real_runs_at_their_own_settings_and_prints_the_real_figures(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    for report in [*RUNS.glob("pair*-*.json"), RUNS / "pairs.json"]:
        shutil.copy(report, runs)
    done = run("--runs", str(runs), "--seeds", "1", "--json", str(tmp_path / "out.json"))
    assert done.returncode == 0, done.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    # the settings come from the full reports (the shipped config: B 4, G 4, S 2, K 2, 2 engines)
    workload = out["workload"]
    assert (workload["batch"], workload["policy"]["surplus_groups"]) == ({"groups": 4, "group_size": 4}, 2)
    assert workload["engines"]["count"] == 2
    assert workload["cpus"]["engine_demand"] == 0.5  # one serving core shared by two engines
    assert workload["trace"] == {"tasks": "as_recorded"}
    assert out["attempts"] == len((runs / "sim-vs-real-trace.jsonl").read_text().splitlines())
    for block in ("measured_demands", "default_demands", "own_attempts"):
        means = out[block]["mean_s"]
        assert set(means) == {"sync", "full"}
        assert all(len(v) == 1 and v[0] > 0 for v in means.values())
        assert out[block]["median_ratio"] == round(means["sync"][0] / means["full"][0], 3)
    assert round(out["real"]["median_ratio"], 2) == 1.63  # the committed pairs' figure (README)
    assert "real pairs" in done.stdout


def test_an_output_it_cannot_write_is_refused_before_any_simulation(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    done = run("--json", str(tmp_path / "a-file" / "x.json"), "--runs", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith("error: --json ")
    assert "seed" not in done.stdout  # nothing simulated
