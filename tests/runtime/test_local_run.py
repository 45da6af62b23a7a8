"""`corral run` for real: embedded engine processes, bwrap/local sandboxes, built-in tasks, weights
published every trainer step, one engine at a time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_children import children

from app.runtime.config import LocalRunError, load_config
from app.runtime.local import run_local
from app.sandboxes import leftovers
from app.sim.traces import import_corral_run

CONFIG = """
seed: 3
batch: {groups: 1, group_size: 2}
policy: {surplus_groups: 1, max_staleness: 2}
engines: {count: 2, cpus: [0], slots: 4, max_tokens: 8}
lanes: {cpus: [1], reset: 2, exec: 2, validate: 1, cleanup: 1}
trainer: {step_s: 0.2}
tasks: {include: [fix-off-by-one, json-transform, patch-config-sed, sort-uniq-log]}
"""


def write_config(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def updates_by_engine(report: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for entry in report["update_log"]:
        if entry["phase"] == "end":
            out.setdefault(entry["engine"], []).append(entry["version"])
    return out


@pytest.mark.slow
def test_full_run_publishes_weights_one_engine_at_a_time_without_restarts(tmp_path: Path) -> None:
    report = run_local(write_config(tmp_path), "full", batches=3)
    assert report["batches"] == 3
    assert report["restarted_trajectories"] == 0
    assert report["lost_groups"] == 0
    assert report["max_engines_updating"] == 1
    # Updates never overlap: each begin is followed by the same engine's end before another begin.
    log = report["update_log"]
    for begin, end in zip(log[::2], log[1::2], strict=True):
        assert (begin["phase"], end["phase"]) == ("begin", "end")
        assert begin["engine"] == end["engine"]
    # Each engine's version advanced, in order, to the versions the trainer published.
    versions = updates_by_engine(report)
    assert versions["engine-0"] == sorted(versions["engine-0"])
    assert max(v for vs in versions.values() for v in vs) >= 2
    assert report["turns"] > 0
    assert report["tokens_per_s"] > 0
    assert set(report["lanes"]) == {"reset", "exec", "validate", "cleanup"}
    # `full` adapts its lanes in real time: slots start at the config's, within [configured, 4×].
    slots = report["lane_slots"]
    assert {lane: s["configured"] for lane, s in slots.items()} == {"reset": 2, "exec": 2, "validate": 1,
                                                                    "cleanup": 1}  # fmt: skip
    assert all(s["configured"] <= s["final"] <= s["max"] <= 4 * s["configured"] for s in slots.values())
    # full's agent-phase gate runs in real runs too: every attempt that finished its reset entered it.
    gate = report["agent_gate"]
    assert gate["factor"] == 1.0
    assert gate["entered"] >= 2 * report["delivered_groups"]
    assert 1 <= gate["max_inside"] <= gate["entered"]
    # Every group's task is named, and the delivered ones are counted per task.
    assert report["sandbox_time_limits"] == {"mode": "given", "backstop": 10.0}
    assert set(report["group_tasks"].values()) <= {"fix-off-by-one", "json-transform", "patch-config-sed",
                                                   "sort-uniq-log"}  # fmt: skip
    assert sum(report["tasks_by_outcome"]["delivered"].values()) == report["delivered_groups"]
    # The report keeps its event stream, gap-free, and `corral trace import` reads it back.
    assert [e["seq"] for e in report["event_log"]] == list(range(len(report["event_log"])))
    assert report["event_log_dropped"] == 0
    (tmp_path / "report.json").write_text(json.dumps(report))
    imported = import_corral_run(tmp_path / "report.json")
    assert len(imported.records) >= report["delivered_groups"] * 2
    finished = [r for r in imported.records if not r.get("censored")]
    assert len(finished) >= report["delivered_groups"] * 2
    assert all(r["reset_s"] >= 0 and r["agent_s"] > 0 for r in finished)
    assert all(r["reset_s"] + r["agent_s"] > 0 for r in imported.records)  # cut short: what it had run


@pytest.mark.slow
def test_sync_run_restarts_in_flight_work_on_update(tmp_path: Path) -> None:
    report = run_local(write_config(tmp_path), "sync", batches=2)
    assert report["batches"] == 2
    assert report["lost_groups"] == 0
    assert report["cpus"]["lanes"] is None  # shared CPUs in the sync rung
    assert "lane_slots" not in report  # nothing to adapt: unpinned lanes have no slot limits
    assert report["agent_gate"] is None  # only full has an agent-phase gate


def test_bad_run_configs_are_refused_with_the_field_named(tmp_path: Path) -> None:
    bad = write_config(tmp_path, CONFIG.replace("lanes: {cpus: [1]", "lanes: {cpus: [0]"))
    with pytest.raises(LocalRunError, match="shares CPUs \\[0\\] with serving"):
        load_config(bad)
    bad = write_config(tmp_path, CONFIG + "\nbogus: 1\n")
    with pytest.raises(LocalRunError, match="bogus"):
        load_config(bad)
    bad = write_config(tmp_path, CONFIG.replace("group_size: 2", "group_size: 1"))
    with pytest.raises(LocalRunError, match="group_size"):
        load_config(bad)
    with pytest.raises(LocalRunError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    knob = "max_staleness: 2}"
    bad = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, adaptive_lanes: sometimes}"))
    with pytest.raises(LocalRunError, match=r"policy\.adaptive_lanes"):
        load_config(bad)
    off = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, adaptive_lanes: false}"))
    assert load_config(off).policy_settings()["adaptive_lanes"] is False
    assert "adaptive_lanes" not in load_config(write_config(tmp_path)).policy_settings()  # the rung decides
    # The agent-phase gate: 0 turns it off, a factor sets it, a non-number or a negative is refused.
    gate_off = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, agent_gate: 0}"))
    assert load_config(gate_off).policy_settings()["agent_gate"] is None
    gate = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, agent_gate: 0.5}"))
    assert load_config(gate).policy_settings()["agent_gate"] == 0.5
    assert "agent_gate" not in load_config(write_config(tmp_path)).policy_settings()
    for value in (".nan", "-1", "many"):
        bad = write_config(tmp_path, CONFIG.replace(knob, f"max_staleness: 2, agent_gate: {value}}}"))
        with pytest.raises(LocalRunError, match=r"policy\.agent_gate"):
            load_config(bad)
    attempts = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, admission: attempts}"))
    assert load_config(attempts).policy_settings()["admission"] == "attempts"
    assert "admission" not in load_config(write_config(tmp_path)).policy_settings()
    bad = write_config(tmp_path, CONFIG.replace(knob, "max_staleness: 2, admission: tokens}"))
    with pytest.raises(LocalRunError, match=r"policy\.admission"):
        load_config(bad)
    for bad_sandbox in (
        "sandbox: {time_limits: cpu}",
        "sandbox: {backstop: 0.5}",
        "sandbox: {backstop: .nan}",
    ):
        field = bad_sandbox.split("{")[1].split(":")[0]
        with pytest.raises(LocalRunError, match=f"sandbox.{field}"):
            load_config(write_config(tmp_path, CONFIG + bad_sandbox + "\n"))


def test_engines_of_real_weights_are_refused_since_the_trainer_publishes_only_sentinel_weights(
    tmp_path: Path,
) -> None:
    # Each engine refused every sentinel version and served on at version 0: once K versions behind,
    # no turn could run and the run stalled.
    bad = write_config(tmp_path, CONFIG.replace("max_tokens: 8}", "max_tokens: 8, sentinel: false}"))
    with pytest.raises(LocalRunError) as refused:
        load_config(bad)
    assert str(refused.value) == (
        f"{bad}: engines.sentinel: false loads real weights, but corral run's trainer publishes sentinel "
        "weights the engines refuse (every version, so the run would stall once they are K versions "
        "behind); set engines.sentinel: true"
    )
    good = write_config(tmp_path, CONFIG.replace("max_tokens: 8}", "max_tokens: 8, sentinel: true}"))
    assert load_config(good).engines.sentinel


def test_cli_run_refuses_unknown_task_without_traceback(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, CONFIG.replace("include: [fix-off-by-one", "include: [no-such-task"))
    proc = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(cfg), "--json",
         str(tmp_path / "out.json"), "--batches", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "no-such-task" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out.json").exists()


def one_task_config(tmp_path: Path, setup: str, engines: int = 2) -> Path:
    """A run config whose suite is one task with this set-up command."""
    task = tmp_path / "suite" / "one"
    task.mkdir(parents=True)
    (task / "task.yaml").write_text(f"instruction: say hi\nsetup: {setup}\nvalidation: {{command: 'true'}}\n")
    return write_config(tmp_path, CONFIG.replace(
        "tasks: {include: [fix-off-by-one, json-transform, patch-config-sed, sort-uniq-log]}",
        f"tasks: {{suite: {tmp_path / 'suite'}}}",
    ).replace("engines: {count: 2", f"engines: {{count: {engines}"))  # fmt: skip


@pytest.mark.slow
def test_cli_run_whose_every_group_fails_stops_with_its_report(tmp_path: Path) -> None:
    """A task whose set-up always fails: every group is discarded as failed. The run used to admit and
    fail groups for ever; now it stops after 100 in a row with none completed, writes its report with
    the reason under `error`, and `corral run` exits 1 naming it."""
    cfg = one_task_config(tmp_path, "exit 3")
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(cfg), "--json",
         str(out), "--batches", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "101 groups in a row failed and none completed" in proc.stderr
    report = json.loads(out.read_text())
    assert "101 groups in a row failed" in report["error"]
    assert report["batches"] == 0
    assert report["discarded_groups"]["failed"] >= 101
    assert report["lost_groups"] == 0


@pytest.mark.slow
def test_cli_run_that_delivers_no_batch_has_no_mean_and_every_reader_says_so(tmp_path: Path) -> None:
    """A run stopped before its first batch (here: set-ups that outlast --duration). Its report gave a
    mean batch collection time of 0.0, as if batches came instantly; a mean over nothing is null, and
    the summary line, the dashboard's replay of the report and `corral trace import` say so in words."""
    cfg = one_task_config(tmp_path, "sleep 60", engines=1)
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(cfg), "--json",
         str(out), "--plot", str(plot), "--duration", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "full: no batch delivered, " in proc.stderr
    assert "mean" not in proc.stderr.splitlines()[-1]
    report = json.loads(out.read_text())
    assert report["batches"] == 0
    assert report["batch_collection_s"] == {"mean": None, "p50": None, "p90": None, "per_batch": []}
    assert report["batch_interval_s"] == {"mean": None}
    assert report["mean_reward"] is None
    assert plot.stat().st_size > 0  # its title says no batch was delivered (tests/sim/test_timeline.py)
    # The dashboard's replay of the report: no figure of 0.0 s, the words instead.
    from app.web.backend import ReplayStore
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    replays = ReplayStore()
    view = replays.view(replays.add_file(out))
    assert view is not None
    assert view.mean_collection_s is None
    page = Dashboard(AccessConfig(None, None)).render(
        "run.html", {**run_context(view), "csrf": "", "csrf_field": ""}
    )
    assert "<dt>mean batch collection</dt><dd>—</dd>" in page
    assert "No batch was delivered." in page
    # `corral trace import` of it: no attempt finished, and it says so in one line.
    imported = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "trace", "import", "--format",
         "corral-run", str(out), "--out", str(tmp_path / "t.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert imported.returncode == 2
    assert "no finished attempt" in imported.stderr
    assert "Traceback" not in imported.stderr


def embedded_engine_pids(parent: int | None = None) -> set[int]:
    """Live embedded engine processes (of `parent` only, when given: other tests may run engines too)."""
    return children(parent, b"app.engines.embedded\0--port")


@pytest.mark.slow
@pytest.mark.parametrize("closed", [None, 0, 1], ids=["open", "stdin closed", "stdout closed"])
def test_sigint_stops_cleanly_and_still_writes_the_report(tmp_path: Path, closed: int | None) -> None:
    """Also with standard input or output closed at start (`<&-`, `>&-`): the run goes on with /dev/null
    there (app/stdio.py). Before, the first file or socket it opened took the descriptor (asyncio's
    epoll with standard output closed), where a write meant for the stream would have gone."""
    out = tmp_path / "report.json"
    config = str(write_config(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", config,
         "--json", str(out), "--duration", "600"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=None if closed is None else lambda: os.close(closed),
    )  # fmt: skip
    # Wait until the first batch is delivered, so the stop lands in the middle of real work.
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if " delivered: " in line:
            break
    # This run's engines (not every engine on the machine: other tests may start and stop theirs)
    ours = embedded_engine_pids(proc.pid)
    assert ours, "".join(seen)
    if closed is not None:
        assert os.readlink(f"/proc/{proc.pid}/fd/{closed}") == os.devnull
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(seen) + rest
    assert "Traceback" not in rest
    report = json.loads(out.read_text())
    assert report["stopped_early"] is True
    assert report["batches"] >= 1
    assert report["lost_groups"] == 0
    assert report["admitted_groups"] == report["delivered_groups"] + sum(report["discarded_groups"].values())
    assert not ours & embedded_engine_pids()  # every engine this run started is gone


@pytest.mark.slow
def test_engines_die_with_a_killed_run(tmp_path: Path) -> None:
    config = str(write_config(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", config,
         "--json", str(tmp_path / "r.json"), "--duration", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    said: list[str] = []  # what the run printed, for the message of a failed assertion
    for line in proc.stderr:
        said.append(line)
        if " delivered: " in line:
            break
    started = embedded_engine_pids(parent=proc.pid)
    assert len(started) == 2, "".join(said[-30:])
    proc.kill()
    proc.wait(timeout=30)
    proc.stderr.close()
    deadline = time.monotonic() + 30
    while embedded_engine_pids() & started and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not embedded_engine_pids() & started
    # What the killed run left (its work directory at least) is swept here, as the next corral start
    # would; left, it made that start's first line a sweep report in whichever test came next.
    swept = leftovers.sweep(leftovers.owners_dir())
    assert any(f"dead corral process {proc.pid} left behind" in line for line in swept), swept
