"""benchmarks/lane_order.py: the three lane orders on one seed's draws, a summary computed from its runs,
and a command line that refuses bad seeds and unwritable outputs before any work."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def lo(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is imported from the checkout
    from benchmarks import lane_order

    return lane_order


def test_one_seed_runs_each_variant_and_the_summary_is_their_ratio(lo: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "order.json"
    assert lo.main(["--workload", "design", "--seeds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["runs"]
    assert row["seed"] == 2
    assert [row[v]["lanes_cpu_priority"] for v in ("fifo", "queue", "cpu_priority")] == [False, False, True]
    ratio = row["cpu_priority"]["mean_s"] / row["fifo"]["mean_s"]
    assert result["summary"]["cpu_priority"]["median_ratio_to_fifo"] == pytest.approx(ratio, abs=1e-4)
    assert result["summary"]["cpu_priority"]["faster_on"] == int(ratio < 1.0)


def test_seeds_and_outputs_are_checked_before_any_work(
    lo: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert lo.seed_range("1-3") == [1, 2, 3]
    assert lo.seed_range("4") == [4]
    for bad in ("x", "3-1", "-2"):
        with pytest.raises(SystemExit) as exit_:
            lo.main(["--seeds", bad])
        assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        lo.main(["--seeds", "1", "--json", "/proc/no/such.json"])
    assert exit_.value.code == 2
    assert "--json /proc/no/such.json" in capsys.readouterr().err


def test_ctrl_c_keeps_the_seeds_done(tmp_path: Path) -> None:
    """Ctrl-C, as a terminal sends it (to the process group), after the first seed: it was a traceback
    that lost the seed; the seeds done are written, marked interrupted, exit 130."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "order.json"
    args = ["--workload", "design", "--seeds", "1-5", "--json", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.lane_order", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # blocks until the first seed is done
    assert first.startswith("[1/5] seed 1:"), first
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted after" in err
    result = json.loads(out.read_text())
    assert result["interrupted"] is True
    assert 1 <= len(result["runs"]) < 5
    assert result["summary"]["cpu_priority"]["seeds"] == len(result["runs"])
