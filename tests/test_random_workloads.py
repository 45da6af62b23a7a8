"""benchmarks/random_workloads.py: random workloads that are valid and repeatable, a summary computed from
the rungs it ran, and a command line that refuses bad flags and unwritable outputs before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from proc_children import command_line, in_session, left_in_session, parent, reaped

from app.sim.workload import Workload

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def rw(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is imported from the checkout
    from benchmarks import random_workloads

    return random_workloads


def test_every_drawn_workload_is_valid_and_repeats(rw: ModuleType) -> None:
    specs = [rw.random_workload(i) for i in range(300)]
    for spec in specs:
        Workload.model_validate(spec)  # raises on a workload the simulator would refuse
    assert specs[5] == rw.random_workload(5)
    assert rw.random_workload(5, seed=1) != specs[5]
    # The ranges reach both ends the benchmark is for: starved and ample sandbox cores, and serving
    # sets below and above the engines' demand.
    feats = [rw.features(spec) for spec in specs]
    assert min(f["sandbox_cores_per_trajectory"] for f in feats) < 0.1
    assert max(f["sandbox_cores_per_trajectory"] for f in feats) > 1.5
    serving = [f["serving_over_engine_demand"] for f in feats]
    assert min(serving) < 1 < max(serving)
    assert {f["max_staleness"] for f in feats} == {1, 2, 4, 6}


def row(mean: float) -> dict[str, Any]:
    return {"mean_s": float(mean)}


def test_the_summary_counts_what_the_rungs_say(rw: ModuleType) -> None:
    sized = rw.SIZED
    workloads = {
        "r0": {"rungs": {"sync": row(300), "completion": row(200), "full": row(100), "areal": row(120),
                         sized: row(90)}},
        "r1": {"rungs": {"sync": row(300), "completion": row(310), "full": row(150), "areal": row(100),
                         sized: row(99)}},
    }  # fmt: skip
    s = rw.summary(workloads)
    assert s["full_best"] == 1
    assert s["ladder_holds"] == 1  # r1: completion is slower than sync
    assert s["full_over_best_other"] == {"r0": pytest.approx(100 / 120, abs=1e-4), "r1": 1.5}
    assert s["full_over_best_other_worst"] == {"workload": "r1", "ratio": 1.5}
    assert s["full_over_sync_median"] == pytest.approx((100 / 300 + 150 / 300) / 2, abs=1e-4)
    # The sized variant is not one of the rungs `full` is judged against; it has its own line.
    assert s["variants"][sized]["full_best"] == 2
    assert s["variants"][sized]["over_best_other_worst"] == {"workload": "r1", "ratio": 0.99}


def test_the_sized_variant_moves_only_the_boundary(rw: ModuleType) -> None:
    for index in range(50):
        spec = rw.random_workload(index)
        sized = rw.sized_serving(spec)
        demand = spec["engines"]["count"] * spec["cpus"]["engine_demand"]
        assert sized["cpus"]["total"] == spec["cpus"]["total"]
        assert sized["cpus"]["serving"] >= min(demand, spec["cpus"]["total"] - 4)
        assert {k: v for k, v in sized.items() if k != "cpus"} == {
            k: v for k, v in spec.items() if k != "cpus"
        }
        Workload.model_validate(sized)


def test_a_short_run_simulates_every_rung_on_the_same_workload(rw: ModuleType) -> None:
    seen: list[str] = []
    result = rw.run(1, peers=False, batches=2, on_run=lambda label, done, total: seen.append(label))
    data = result["workloads"]["r0"]
    assert set(data["rungs"]) == {"sync", "completion", "lanes", "full", rw.SIZED, rw.BORROWING, rw.ATTEMPTS}
    assert len(seen) == 7
    for summary in data["rungs"].values():
        assert summary["lost_groups"] == 0
        assert summary["mean_s"] > 0
    assert data["spec"]["batches"] == 2
    full = data["rungs"]["full"]["mean_s"]
    best_other = min(r["mean_s"] for name, r in data["rungs"].items() if not name.startswith("full"))
    assert result["summary"]["full_best"] == (1 if full <= best_other else 0)
    sized = data["rungs"][rw.SIZED]["mean_s"]
    assert result["summary"]["variants"][rw.SIZED]["over_best_other"]["r0"] == round(sized / best_other, 4)
    borrowing = data["rungs"][rw.BORROWING]
    assert borrowing["lost_groups"] == 0
    assert result["summary"]["variants"][rw.BORROWING]["over_best_other"]["r0"] == round(
        borrowing["mean_s"] / best_other, 4
    )
    attempts = data["rungs"][rw.ATTEMPTS]
    assert attempts["lost_groups"] == 0
    assert result["summary"]["variants"][rw.ATTEMPTS]["over_best_other"]["r0"] == round(
        attempts["mean_s"] / best_other, 4
    )
    assert any("r0" in line for line in rw.lines(result))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.random_workloads", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bad_flags_and_unwritable_outputs_are_refused_before_any_work(tmp_path: Path) -> None:
    bad = run_cli("--count", "0")
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: --count")
    blocked = tmp_path / "file"
    blocked.write_text("")
    out = run_cli("--count", "1", "--json", str(blocked / "out.json"))
    assert out.returncode == 2
    assert "--json" in out.stderr
    assert "[1/" not in out.stderr  # no simulation began
    assert "Traceback" not in out.stderr


def test_the_command_writes_its_json_and_plot(tmp_path: Path) -> None:
    out = run_cli("--count", "1", "--batches", "2", "--no-peers", "--json", str(tmp_path / "r.json"),
                  "--plot", str(tmp_path / "r.png"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["summary"]["workloads"] == 1
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "full is best in" in out.stdout


STOPS = {
    "Ctrl-C": [signal.SIGINT],
    "Ctrl-C twice": [signal.SIGINT, signal.SIGINT],
    # the second lands in the pool's own waiting: "RuntimeError: release unlocked lock" (2 of 10), or a
    # hang in the pool's shutdown (1 of 35), before `map_in_workers` ignored it
    "Ctrl-C twice, 5 ms apart": [signal.SIGINT, signal.SIGINT],
    "SIGTERM": [signal.SIGTERM],  # killed it silently, -15
    "SIGHUP": [signal.SIGHUP],  # the terminal closed: killed it silently, -1
}


def stopped_mid_run(tmp_path: Path, stop: Callable[[int], None]) -> tuple[int, str]:
    """Run `benchmarks.random_workloads` with two workers in a session of its own, call `stop(its pid)`
    once it simulates, and return its exit status and stderr; also check that it wrote nothing and
    left no process behind."""
    out = tmp_path / "r.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.random_workloads", "--count", "4", "--processes", "2",
         "--json", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with reaped(proc):
        time.sleep(4)  # imports done, workers started and simulating
        assert proc.poll() is None
        # the command and its two workers (and their fork server)
        assert len(in_session(proc.pid, group=True)) >= 3
        stop(proc.pid)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err
    assert not out.exists()
    assert left_in_session(proc.pid, group=True) == set()
    return proc.returncode, err


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_stop_to_the_process_group_ends_it_in_one_line(tmp_path: Path, stop: str) -> None:
    """A Ctrl-C in a terminal signals the whole process group: the workers too. Each used to print its
    own KeyboardInterrupt traceback; now they end quietly and the command says one line. A second
    press 50 ms later at times killed it by the signal (-2); SIGTERM and SIGHUP killed it silently."""

    def signal_the_group(pid: int) -> None:
        for n, sig in enumerate(STOPS[stop]):
            if n:
                time.sleep(0.005 if "5 ms" in stop else 0.05)
            os.killpg(pid, sig)

    code, err = stopped_mid_run(tmp_path, signal_the_group)
    assert code == 130, err
    assert "interrupted: nothing written" in err


def test_a_worker_killed_mid_run_is_an_error_not_an_interrupt(tmp_path: Path) -> None:
    """A simulation worker killed on its own (the OOM killer, `kill -9`) broke the pool, and the script
    said "interrupted: nothing written", exit 130, though nobody pressed Ctrl-C. It now says that a
    worker died and how, exit 1."""

    def kill_a_worker(pid: int) -> None:
        servers = {p for p in in_session(pid, group=True) if b"forkserver" in command_line(p)}
        workers = [p for p in in_session(pid, group=True) if parent(p) in servers]
        assert workers
        os.kill(workers[0], signal.SIGKILL)

    code, err = stopped_mid_run(tmp_path, kill_a_worker)
    assert code == 1, err
    assert "error: a simulation worker died (SIGKILL); its work is lost; nothing written" in err
    assert "interrupted" not in err


def test_a_rung_that_delivered_no_batch_is_named_and_left_out_of_the_ratios(rw: ModuleType) -> None:
    """A rung with no batch has a null mean; the summary divided by it (a TypeError traceback after the
    whole run). Now its workload is named, with the rung, and the others still give their ratios."""
    workloads = {
        "r0": {"rungs": {"sync": row(300), "completion": row(200), "full": {"mean_s": None}}},
        "r1": {"rungs": {"sync": row(300), "completion": row(200), "full": row(100)}},
    }
    s = rw.summary(workloads)
    assert s["no_batch"] == {"r0": ["full"]}
    assert s["full_over_best_other"] == {"r1": 0.5}
    assert s["full_best"] == 1
    described = {name: {**data, "features": FEATURES, "findings": []} for name, data in workloads.items()}
    result = {"workloads": described, "summary": s}
    text = "\n".join(rw.lines(result))
    assert "full=no batch" in text
    assert "!!! r0: no batch delivered by full; left out of the ratios" in text
    assert "full is best in 1 of 2 workloads" in text
    # Not one workload with a mean for every rung: no ratio, and words instead of a traceback.
    nothing = rw.summary({"r0": workloads["r0"]})
    assert nothing["full_over_best_other_worst"] is None
    assert nothing["full_over_best_other_median"] is None
    result = {"workloads": {"r0": result["workloads"]["r0"]}, "summary": nothing}
    assert rw.lines(result)[-1] == "no workload of 1 has a mean for every rung: no ratio to give"


FEATURES = {"serving_over_engine_demand": 1.0, "sandbox_cores_per_trajectory": 0.5, "max_staleness": 2}


def test_a_json_that_cannot_be_written_after_the_work_is_one_line_and_kept(
    rw: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A benchmark's figures whose path stopped being writable during the run (its directory replaced
    by a file here; a full disk elsewhere): one line, exit 1, and the figures kept in the temporary
    directory, where the line says. It was a traceback, and an hour's figures were gone."""
    from benchmarks import save_json

    parent = tmp_path / "out"
    parent.write_text("")  # was a directory when the run began
    with pytest.raises(SystemExit) as ended:
        save_json(parent / "r.json", {"mean_s": 1.5})
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(
        f"error: cannot write {parent / 'r.json'}: {parent} is not a directory; written to "
    )
    kept = Path(err.strip().rsplit("written to ", 1)[1].removesuffix(" instead"))
    try:
        assert json.loads(kept.read_text()) == {"mean_s": 1.5}
    finally:
        kept.unlink()


def test_the_family_table_says_no_batch_where_a_rung_delivered_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.family import table

    result = {
        "workloads": {
            "default": {
                "rungs": {"sync": {"mean_s": None}, "full": {"mean_s": 100.0, "lower_bound_s": 80.0}}
            },
            "scarce": {
                "rungs": {"sync": {"mean_s": 250.5}, "full": {"mean_s": 200.25, "lower_bound_s": 150.0}}
            },
        }
    }
    assert table(result).splitlines()[2:] == [
        "| sync | no batch | 250.5 |",
        "| full | 100.0 | 200.2 |",
        "| lower bound (full) | 80.0 | 150.0 |",
    ]


def test_the_family_benchmark_reuses_only_rungs_of_the_same_draws(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.family import main

    seeded = tmp_path / "seed3.json"
    written = {"workloads": {"default": {"rungs": {}}}, "specs": {"default": {"seed": 3}}}
    seeded.write_text(json.dumps(written))
    assert main(["--workloads", "default", "--reuse", str(seeded)]) == 2
    assert "default were drawn with another seed than 0" in capsys.readouterr().err
    assert main(["--workloads", "default", "--seed", "4", "--reuse", str(seeded)]) == 2
    assert "another seed than 4" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["--reuse", str(broken)]) == 2
    assert "not a family JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--seed", "-1"])
    assert exit_info.value.code == 2
    assert "--seed: -1 is outside" in capsys.readouterr().err
