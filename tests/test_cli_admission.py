"""`corral sim --admission in_flight [--ready-surplus R]`, run for real as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from factories import make_workload_data

CORRAL = Path(sys.executable).with_name("corral")


def corral(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CORRAL), *map(str, args)], capture_output=True, text=True, timeout=120)


def make_workload_file(tmp_path: Path) -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(make_workload_data(seed=5, batches=3)))
    return path


def test_in_flight_admission_caps_only_groups_in_flight(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    workload = make_workload_file(tmp_path)
    proc = corral(
        "sim", "--workload", workload, "--json", out, "--admission", "in_flight", "--ready-surplus", "1"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["policy_config"]["admission"] == "in_flight"
    assert report["policy_config"]["ready_surplus"] == 1
    assert report["max_groups_running"] <= 2 + 2  # B + S of the workload
    assert report["max_groups_in_flight"] <= 2 + 2 + 1
    assert report["lost_groups"] == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--admission", "live", "--ready-surplus", "2"], "--ready-surplus: only with --admission in_flight"),
        (
            ["--policy", "sync", "--ready-surplus", "2"],
            "--ready-surplus: only with --admission in_flight (policy sync admits live unless told "
            "otherwise)",
        ),
        (["--admission", "sideways"], "--admission"),
        (["--admission", "in_flight", "--ready-surplus", "-1"], "--ready-surplus"),
    ],
)
def test_bad_admission_flags_are_refused(tmp_path: Path, args: list[str], needle: str) -> None:
    proc = corral("sim", "--workload", make_workload_file(tmp_path), "--json", tmp_path / "r.json", *args)
    assert proc.returncode == 2
    assert needle in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("policy", ["full", "completion"])
def test_attempts_that_take_no_time_end_the_simulation(tmp_path: Path, policy: str) -> None:
    # A trace line of zeros (which `trace import` makes of a trial whose stamps are all equal): `full`
    # admitted and completed groups without end at one instant, memory growing, and never finished.
    trace = tmp_path / "zeros.jsonl"
    line = {"task": "a", "reset_s": 0, "agent_s": 0, "validate_s": 0, "cleanup_s": 1, "reward": 1}
    trace.write_text(json.dumps(line) + "\n")
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "batches: 2\nbatch: {groups: 2, group_size: 2}\npolicy: {surplus_groups: 2, max_staleness: 2}\n"
        "engines: {count: 2, slots: 16}\ncpus: {total: 16, serving: 4}\n"
        "lanes: {reset: 8, exec: 8, validate: 4, cleanup: 4}\ntrace: zeros.jsonl\n"
    )
    out = tmp_path / "r.json"
    proc = corral("sim", "--workload", workload, "--policy", policy, "--json", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["batches"] == 2
    assert report["lost_groups"] == 0
    k, b = 2, 2
    # in flight ≤ B + S; ready ≤ (K + 1)·B
    assert report["max_groups_in_flight"] <= (2 + 2) + (k + 1) * b, report["max_groups_in_flight"]


@pytest.mark.parametrize(
    ("admission", "needle"),
    [
        ("live", "--ready-surplus: only with --admission in_flight; the workload's policy.admission is live"),
        ("attempts", "(K + 1)·B); the workload's policy.admission is attempts"),
    ],
)
def test_a_ready_surplus_refused_by_the_workload_s_admission_says_it_is_the_workload_s(
    tmp_path: Path, admission: str, needle: str
) -> None:
    """The refusal blamed the rung ("policy full admits live unless told otherwise": full admits in
    flight) or named a field of pydantic's, where the workload had set the admission."""
    path = tmp_path / "w.yaml"
    data = make_workload_data(seed=5, batches=3)
    data["policy"] = {**data.get("policy", {}), "admission": admission}
    path.write_text(json.dumps(data))
    proc = corral("sim", "--workload", path, "--json", tmp_path / "r.json", "--ready-surplus", "2")
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rung_other_than_full_says_it_runs_without_the_workload_s_admission_and_gate(
    tmp_path: Path,
) -> None:
    path = tmp_path / "w.yaml"
    data = make_workload_data(seed=5, batches=2)
    data["policy"] = {**data.get("policy", {}), "admission": "attempts", "agent_gate": 0.5}
    path.write_text(json.dumps(data))
    proc = corral("sim", "--workload", path, "--json", tmp_path / "r.json", "--policy", "completion")
    assert proc.returncode == 0, proc.stderr
    assert (
        "note: the workload's policy.admission and policy.agent_gate are full's; policy completion"
        in proc.stderr
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["policy_config"]["admission"] == "live"
    assert report["policy_config"]["agent_gate"] is None
