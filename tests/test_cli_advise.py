"""`corral trace import` and `corral advise` through the installed script."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from proc_children import command_line, cpu_ticks, in_session, left_in_session, parent, reaped

from app.cli.common import ProgressLines

CORRAL = Path(sys.executable).with_name("corral")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def corral(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CORRAL), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def sigterm_after(proc: subprocess.Popen[str], seconds: float) -> tuple[str, float, set[int]]:
    """SIGTERM to `proc` alone (as `kill PID` sends it) after `seconds`: its stderr, the seconds it took
    to exit, and what was left live of its session (its session is killed after)."""
    import os
    import signal
    import time

    try:
        time.sleep(seconds)
        os.kill(proc.pid, signal.SIGTERM)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        leftover = left_in_session(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return stderr, took, leftover


def simulation_workers(pid: int) -> set[int]:
    """The simulation workers of `advise` process `pid`, a session leader: the children of the fork server
    in its session. Not "whatever in the session has another parent": once `advise` has exited, and
    before the test sees it, its fork server and resource tracker linger as orphans for a moment, with a
    new parent, and CI counted them as 2 workers on one CPU."""
    session = in_session(pid)
    servers = {kid for kid in session if b"forkserver" in command_line(kid)}
    return {kid for kid in session if parent(kid) in servers}


def wait_for_busy_workers(pid: int, count: int, timeout: float = 180) -> None:
    """Block until `count` of the simulation workers of `pid` (a session leader) have each used a second
    of CPU: `advise`'s second worker idles until the current settings are simulated and their first
    round begins."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(cpu_ticks(kid) >= 100 for kid in simulation_workers(pid)) >= count:
            return
        time.sleep(0.2)
    pytest.fail(f"{count} workers of {pid} never got busy")


PROGRESS_LINE = re.compile(r"advise: \d+/\d+ simulations, \d+ s")  # off a terminal, as a log shows it


def without_progress(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not PROGRESS_LINE.fullmatch(line)]


def stopped_lines(advice: dict, json_out: str) -> list[str]:
    """What an interrupted `advise` says last: where the partial advice went, then, where the best of
    what it simulated changes anything, what to change."""
    lines = [interrupted_line(len(advice["evaluated"]), json_out)]
    if advice["changes"] and len(advice["evaluated"]) > 1:
        lines.append(f"to apply the best of them, in the workload: {flow_of(advice['changes'])}")
    return lines


def flow_of(changes: dict) -> str:
    """`policy: {admission: attempts}; lanes: {exec: 16}`: the changes as advise says them."""
    import yaml

    return "; ".join(
        f"{section}: " + yaml.safe_dump(keys, default_flow_style=True, sort_keys=False).strip()
        for section, keys in changes.items()
    )


def interrupted_line(simulated: int, json_out: str) -> str:
    """The line an interrupted `advise` ends with, having simulated `simulated` settings."""
    kept = f'{json_out} ("complete": false)'
    if simulated == 1:  # the current settings alone: no candidate to advise
        return (
            f"interrupted after only the current settings were simulated; no advice, their figures → {kept}"
        )
    return f"interrupted after {simulated} settings simulated; the best of them → {kept}"


def test_trace_import_writes_a_trace_the_simulator_replays(tmp_path: Path) -> None:
    trial = tmp_path / "run" / "hello" / "hello.1-of-1"
    trial.mkdir(parents=True)
    (trial / "results.json").write_text(
        json.dumps(
            {
                "task_id": "hello",
                "trial_name": "hello.1-of-1",
                "is_resolved": True,
                "trial_started_at": "2025-01-01T00:00:00Z",
                "agent_started_at": "2025-01-01T00:00:05Z",
                "agent_ended_at": "2025-01-01T00:03:05Z",
                "test_started_at": "2025-01-01T00:03:06Z",
                "test_ended_at": "2025-01-01T00:03:10Z",
                "trial_ended_at": "2025-01-01T00:03:20Z",
            }
        )
    )
    done = corral("trace", "import", "--format", "terminal-bench", "run", "--out", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "1 attempt of 1 task → " in done.stderr
    line = json.loads((tmp_path / "t.jsonl").read_text())
    assert line["agent_s"] == 180.0
    assert line["reward"] == 1.0


def test_bad_inputs_are_refused_in_one_line(tmp_path: Path) -> None:
    missing = corral("trace", "import", "--format", "terminal-bench", "nope", cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == "error: SOURCE nope: no such directory"  # named as the others are
    gone = corral("trace", "import", "--format", "corral-run", "nope.json", cwd=tmp_path)
    assert gone.stderr.strip() == "error: SOURCE nope.json: no such file"
    unwritable = corral("advise", "--workload", str(EXAMPLES / "small-trace.yaml"), "--json", "/proc/x.json",
                        cwd=tmp_path)  # fmt: skip
    assert unwritable.returncode == 2
    assert "--json /proc/x.json" in unwritable.stderr
    for result in (missing, unwritable):
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def corral_run_report(root: Path, *bad: object) -> Path:
    """A `corral run` report whose event log holds one finished attempt, then `bad`."""
    op = {"kind": "sandbox_op", "group_id": 0, "attempt": 0, "lane": "reset", "start": 0.0, "end": 2.0}
    events = [
        {"kind": "group_admitted", "group_id": 0, "task_index": 0, "group_size": 100, "task": "hello"},
        op,
        {**op, "lane": "exec", "start": 2.0, "end": 5.0},
        {"kind": "attempt_finished", "group_id": 0, "attempt": 0, "reward": 1.0, "error": None},
        *bad,
    ]
    report = root / "report.json"
    report.write_text(json.dumps({"event_log": events}))
    return report


MALFORMED_EVENTS = {
    "reward NaN": ({"kind": "attempt_finished", "group_id": 0, "attempt": 1, "reward": "NaN"}, "reward is"),
    "no group_id": (
        {"kind": "sandbox_op", "attempt": 1, "lane": "exec", "start": 0, "end": 1},
        "no group_id",
    ),
    "end inf": (
        {"kind": "turn", "group_id": 0, "attempt": 1, "start": 0, "end": "inf"},
        'turn end is "inf", not a finite number',
    ),
    "null": (None, "is null, not an event object"),
}


@pytest.mark.parametrize(("event", "needle"), MALFORMED_EVENTS.values(), ids=MALFORMED_EVENTS.keys())
def test_trace_import_refuses_a_malformed_event_in_one_line(
    tmp_path: Path, event: object, needle: str
) -> None:
    corral_run_report(tmp_path, event)
    done = corral(
        "trace", "import", "--format", "corral-run", "report.json", "--out", "t.jsonl", cwd=tmp_path
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert "report.json: event_log[4]" in done.stderr
    assert needle in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_trace_import_counts_what_it_skips_and_writes_nothing_negative(tmp_path: Path) -> None:
    backwards = {
        "kind": "sandbox_op",
        "group_id": 0,
        "attempt": 1,
        "lane": "reset",
        "start": 300.0,
        "end": 200.0,
    }
    finished = {"kind": "attempt_finished", "group_id": 0, "attempt": 1, "reward": 1.0, "error": None}
    corral_run_report(tmp_path, backwards, finished)
    done = corral(
        "trace", "import", "--format", "corral-run", "report.json", "--out", "t.jsonl", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "1 attempt of 1 task → " in done.stderr
    assert "(skipped 1 attempt: 1 a sandbox op ends before it starts)" in done.stderr
    line = json.loads((tmp_path / "t.jsonl").read_text())
    assert (line["reset_s"], line["agent_s"]) == (2.0, 3.0)


def cancelled(attempt: int) -> dict[str, object]:
    return {"kind": "attempt_cancelled", "group_id": 0, "attempt": attempt, "reason": "stale"}


FAILED = {"kind": "attempt_finished", "group_id": 0, "attempt": 99, "reward": 0.0, "error": "SandboxError"}
SKIP_COUNTS = {  # a count of 1 and of many for each reason a corral run's attempt is skipped
    "none": ([], "(none skipped)"),
    "one cancelled": ([cancelled(1)], "(skipped 1 attempt: 1 cancelled before it started)"),
    "many": (
        [*map(cancelled, range(1, 23)), FAILED],
        "(skipped 23 attempts: 22 cancelled before it started, 1 failed)",
    ),
    "failed": ([FAILED, {**FAILED, "attempt": 98}], "(skipped 2 attempts: 2 failed)"),
}


@pytest.mark.parametrize(("skipped", "said"), SKIP_COUNTS.values(), ids=SKIP_COUNTS.keys())
def test_trace_import_counts_skipped_attempts_in_words(
    tmp_path: Path, skipped: list[object], said: str
) -> None:
    # It said "(skipped: 22 attempt cancelled (its group was discarded))".
    corral_run_report(tmp_path, *skipped)
    done = corral(
        "trace", "import", "--format", "corral-run", "report.json", "--out", "t.jsonl", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert f"1 attempt of 1 task → t.jsonl {said}" in done.stderr


def test_trace_import_help_names_its_argument_as_the_other_commands_do() -> None:
    done = subprocess.run(
        [str(CORRAL), "trace", "import", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: corral trace import [OPTIONS] SOURCE\n" in done.stdout  # not {source}
    assert "  SOURCE <path>" in done.stdout


def test_trace_import_counts_every_trial_file_it_skips(tmp_path: Path) -> None:
    run = tmp_path / "run"
    stamps = {
        "trial_started_at": "2025-01-01T00:00:00Z",
        "agent_started_at": "2025-01-01T00:00:05Z",
        "agent_ended_at": "2025-01-01T00:03:05Z",
    }
    for name, content in {
        "good": json.dumps({"task_id": "good", "is_resolved": True, **stamps}).encode(),
        "yes": json.dumps({"task_id": "yes", "is_resolved": "yes", **stamps}).encode(),
        "truncated": b'{"task_id": "t',
        "binary": bytes(range(256)),
        "list": b"[]",
    }.items():
        (run / name).mkdir(parents=True)
        (run / name / "results.json").write_bytes(content)
    done = corral("trace", "import", "--format", "terminal-bench", "run", "--out", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    skipped = "skipped 4 trials: 1 is_resolved is not a boolean, 2 not JSON, 1 not an object"
    assert f"1 attempt of 1 task → t.jsonl ({skipped})" in done.stderr
    assert json.loads((tmp_path / "t.jsonl").read_text())["task"] == "good"
    # each reason names where to look (no trial was named: among thousands none could be found)
    assert "  not JSON: run/binary/results.json, run/truncated/results.json\n" in done.stderr
    assert "  not an object: run/list/results.json\n" in done.stderr
    assert "  is_resolved is not a boolean: run/yes\n" in done.stderr


def test_trace_import_says_what_it_assumed_and_which_attempts_outrun_the_default_agent_time(
    tmp_path: Path,
) -> None:
    """A trial whose agent crashed is imported with the time its sandbox was held, and said so; a trace
    whose attempts ran their agent longer than the simulator's default agent time (420 s) was cut short
    there without a word (6 of 38 attempts of a real-looking run failed in every replay)."""
    run = tmp_path / "run"
    trials = {
        "quick": ("2025-01-01T00:03:05Z", True),
        "crashed": (None, False),
        "long": ("2025-01-01T03:20:00.2Z", True),
    }
    for name, (agent_end, resolved) in trials.items():
        (run / name).mkdir(parents=True)
        record = {
            "task_id": name,
            "is_resolved": resolved,
            "trial_started_at": "2025-01-01T00:00:00Z",
            "agent_started_at": "2025-01-01T00:00:05Z",
            "agent_ended_at": agent_end,
            "trial_ended_at": "2025-01-01T03:30:00Z",
        }
        (run / name / "results.json").write_text(json.dumps(record))
    done = corral("trace", "import", "--format", "terminal-bench", "run", "--out", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 attempts of 3 tasks → t.jsonl (none skipped)" in done.stderr
    assert "imported 1 trial with no agent end (it crashed or was killed)" in done.stderr
    # the crashed agent held its sandbox to the trial's end, 12,595 s; the long one 11,995.2 s
    assert "note: 2 of 3 attempts ran their agent longer than 420 s" in done.stderr
    assert "unless it sets trajectory: {timeout_s: 12595} or more" in done.stderr


def test_advise_writes_its_advice(tmp_path: Path) -> None:
    done = corral(
        "advise", "--workload", str(EXAMPLES / "small-trace.yaml"), "--passes", "1", "--workers", "2",
        "--json", "advice.json", "--plot", "advice.png", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["recommended"]["batch_collection_s"] <= advice["current"]["batch_collection_s"]
    assert (tmp_path / "advice.png").stat().st_size > 0
    assert "settings simulated" in done.stderr


def test_advise_on_a_workload_that_can_fill_no_batch_says_so_and_exits_2(tmp_path: Path) -> None:
    # It exited 0 where corral sim and corral bench exit 2, printed an "advised" line the same as the
    # current one, said "(31 settings simulated)" after "none of the 31 settings simulated", and its
    # plot wrote each run's stop reason under its bar, one over the other.
    (tmp_path / "w.yaml").write_text(
        "batches: 2\nbatch: {groups: 2, group_size: 2}\ntrajectory: {p_infra_error: 0.999}\n"
    )
    done = corral(
        "advise", "--workload", "w.yaml", "--passes", "1", "--workers", "2",
        "--json", "advice.json", "--plot", "advice.png", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    said = [line for line in done.stderr.splitlines() if not line.startswith("advise: ")]
    assert [line.split(":")[0] for line in said] == ["current", "error"], said
    assert "lanes reset " in said[0]  # in words, not a Python dict
    advice = json.loads((tmp_path / "advice.json").read_text())
    n = len(advice["evaluated"])
    assert said[1].startswith(f"error: none of the {n} settings simulated delivered a batch; ")
    assert said[1].endswith("the advice's figures → advice.json")
    assert said[1].count("settings simulated") == 1
    assert advice["recommended"]["batch_collection_s"] is None
    assert (tmp_path / "advice.png").stat().st_size > 0


def test_advise_writes_a_workload_that_simulates_as_advised(tmp_path: Path) -> None:
    """The advice could not be applied as given: printed as Python dicts, with admission and the gate
    flags of `corral sim` alone, which a workload file refused (`policy.admission: Extra inputs are not
    permitted`). It now says what changes in the workload's own names and writes the workload with
    them, which `corral sim` simulates to the advised figure."""
    import shutil

    # the workload by a relative path, its trace beside it: the advised file, written elsewhere, named
    # the trace by that relative path, and `corral sim` read another file of that name, or none
    for name in ("small-trace.yaml", "small-trace.jsonl"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    done = corral(
        "advise", "--workload", "small-trace.yaml", "--passes", "1", "--workers", "2",
        "--json", "a.json", "--advised-workload", "out/advised.yaml", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    advice = json.loads((tmp_path / "a.json").read_text())
    assert (
        advice["beats_current"] is True
    )  # else this test shows nothing: small-trace's advice changes things
    changes = advice["changes"]
    assert changes
    assert set(changes) <= {"policy", "lanes", "cpus"}
    import yaml

    written = yaml.safe_load((tmp_path / "out" / "advised.yaml").read_text())
    for section, keys in changes.items():
        for key, value in keys.items():
            assert written[section][key] == value
    assert f"to apply, in the workload: {flow_of(changes)}\n" in done.stderr
    sim = corral(
        "sim", "--workload", "out/advised.yaml", "--policy", "full", "--json", "s.json", cwd=tmp_path
    )
    assert sim.returncode == 0, sim.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["batch_collection_s"]["mean"] == advice["recommended"]["batch_collection_s"]
    # and advise on the advised workload finds its own settings current
    again = corral(
        "advise", "--workload", "out/advised.yaml", "--passes", "1", "--workers", "2", "--json", "b.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    second = json.loads((tmp_path / "b.json").read_text())
    assert second["current"]["settings"] == advice["recommended"]["settings"]
    assert second["current"]["batch_collection_s"] == advice["recommended"]["batch_collection_s"]


def test_advise_with_a_trace_keeps_the_workload_s_engine_share_and_names_the_trace_it_replayed(
    tmp_path: Path,
) -> None:
    """--trace put the default llm_fraction (0.6) in place of the workload's (0.3), and the changes to
    apply said nothing of the trace: the same edits to the workload gave 111.6 s against 82.3 advised."""
    import yaml

    data = yaml.safe_load((EXAMPLES / "small-trace.yaml").read_text())
    data["trace"] = {"path": str(EXAMPLES / "small-trace.jsonl"), "llm_fraction": 0.3}
    (tmp_path / "lf.yaml").write_text(yaml.safe_dump(data))
    done = corral(
        "advise", "--workload", "lf.yaml", "--trace", str(EXAMPLES / "small-trace.jsonl"), "--passes", "1",
        "--workers", "2", "--json", "a.json", "--advised-workload", "adv.yaml", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["changes"]["trace"] == {"path": str((EXAMPLES / "small-trace.jsonl").resolve())}
    assert yaml.safe_load((tmp_path / "adv.yaml").read_text())["trace"]["llm_fraction"] == 0.3
    sim = corral("sim", "--workload", "adv.yaml", "--json", "s.json", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    mean = json.loads((tmp_path / "s.json").read_text())["batch_collection_s"]["mean"]
    assert mean == advice["recommended"]["batch_collection_s"]


def test_advise_off_a_terminal_says_how_far_it_is(tmp_path: Path) -> None:
    """Its stderr a log, not a terminal: the progress bar is off, and it said nothing for 97 s. Plain
    lines show it is alive; stdout holds the advice alone."""
    done = corral(
        "advise", "--workload", str(EXAMPLES / "small-trace.yaml"), "--passes", "1", "--workers", "2",
        "--json", "-", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if PROGRESS_LINE.fullmatch(line)]
    assert progress, done.stderr
    first = re.match(r"advise: 1/(\d+) simulations, ", progress[0])  # once the current settings are simulated
    assert first is not None, progress
    assert int(first[1]) > 1  # of the whole search, not of the current settings' round alone
    assert json.loads(done.stdout)["complete"] is True


def test_progress_lines_come_at_the_first_item_then_at_most_every_ten_seconds() -> None:
    now = [100.0]
    written: list[str] = []
    lines = ProgressLines("advise", "simulations", clock=lambda: now[0], write=written.append)
    for t, done, total in [
        (0, 0, 1),
        (2, 1, 1),
        (5, 2, 6),
        (11.9, 4, 6),
        (12, 5, 6),
        (13, 6, 11),
        (40, 48, 48),
    ]:
        now[0] = 100.0 + t
        lines(done, total)
    assert written == [
        "advise: 1/1 simulations, 2 s",
        "advise: 5/6 simulations, 12 s",
        "advise: 48/48 simulations, 40 s",
    ]


@pytest.mark.parametrize("presses", [1, 2], ids=["Ctrl-C", "Ctrl-C twice"])
def test_ctrl_c_to_the_process_group_keeps_what_advise_simulated(tmp_path: Path, presses: int) -> None:
    """Ctrl-C mid-search: the settings simulated so far are not lost. The advice from them is written
    with `"complete": false`, the exit code is 130, and no worker process is left; a second press
    while that is written does not break it."""
    import os
    import signal
    import time

    (tmp_path / "w.json").write_text(json.dumps({"batches": 3}))  # about a second a simulation
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "w.json", "--passes", "5", "--workers", "2",
         "--json", "advice.json", "--plot", "advice.png"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    time.sleep(12)  # several settings simulated by now, out of about a hundred
    for press in range(presses):
        if press:
            time.sleep(0.05)  # while the partial advice is saved
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "Task was destroyed" not in stderr
    advice = json.loads((tmp_path / "advice.json").read_text())
    assert advice["complete"] is False
    done = len(advice["evaluated"])
    assert 1 <= done < 100
    assert interrupted_line(done, "advice.json") in stderr
    assert "search interrupted" in advice["verdict"]
    assert advice["recommended"]["batch_collection_s"] <= advice["current"]["batch_collection_s"]
    assert (tmp_path / "advice.png").stat().st_size > 0
    assert left_in_session(proc.pid) == set()


def test_sigterm_to_advise_alone_keeps_what_it_simulated(tmp_path: Path) -> None:
    """SIGTERM (`timeout`, `kill PID`, a supervisor) acts as Ctrl-C, as it does for `corral run`: it
    used to kill `corral advise` silently, losing every simulation it had run."""
    (tmp_path / "w.json").write_text(json.dumps({"batches": 3}))  # about a second a simulation
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "w.json", "--passes", "5", "--workers", "2",
         "--json", "a.json"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stderr, _, leftover = sigterm_after(proc, 12)  # several settings simulated by now, of about a hundred
    assert proc.returncode == 130, stderr
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["complete"] is False
    assert without_progress(stderr) == stopped_lines(advice, "a.json")
    assert leftover == set()


def test_a_worker_killed_mid_search_is_an_error_that_keeps_what_was_simulated(tmp_path: Path) -> None:
    """A simulation worker killed on its own (the OOM killer, `kill -9`) broke the pool, and `advise`
    said "interrupted ...", exit 130, though nobody pressed Ctrl-C. It now says a worker died and how,
    keeps what was simulated as an interrupt does, names the plot it wrote too, and exits 1."""
    import os
    import signal

    (tmp_path / "w.json").write_text(json.dumps({"batches": 3}))  # about a second a simulation
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "w.json", "--passes", "5", "--workers", "2",
         "--json", "a.json", "--plot", "a.png"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(proc):
        wait_for_busy_workers(proc.pid, 2)  # the current settings done, a round under way
        os.kill(min(simulation_workers(proc.pid)), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["complete"] is False
    done = len(advice["evaluated"])
    said = without_progress(stderr)
    assert said[1:] == stopped_lines(advice, "a.json")[1:], stderr  # and what to change, if anything
    assert said[0].startswith(
        "error: a simulation worker died (SIGKILL); its work is lost; the search stopped after"
    )
    assert said[0].endswith('a.json ("complete": false) and a.png')
    assert (f"after {done} settings simulated" in said[0]) or (done == 1 and "only the current" in said[0])
    assert (tmp_path / "a.png").stat().st_size > 0
    assert left_in_session(proc.pid) == set()


@pytest.mark.parametrize("sigint", ["default", "ignored"], ids=["", "Ctrl-C ignored"])
def test_sigterm_to_advise_alone_does_not_wait_for_the_round(sigint: str, tmp_path: Path) -> None:
    """SIGTERM to the command alone (its workers do not get it) mid-round: the pool's shutdown waited
    for every queued candidate of the round (15-60 s on the default workload), whose results were then
    discarded. The queued ones are now dropped and the running ones ended: the partial advice is
    written and the command gone within seconds, no worker left. The same where SIGINT is ignored (a
    background job of a non-interactive shell), where SIGTERM killed it silently (143, nothing
    written); an ignored SIGINT stays ignored."""
    import os
    import signal
    import time

    # About 5 s a simulation: a round of surplus values (6 new ones, 2 workers) takes 15 s or more.
    (tmp_path / "w.json").write_text(json.dumps({"batches": 20}))
    ignored = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", "w.json", "--passes", "1", "--workers", "2",
         "--json", "a.json"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignored),
    )  # fmt: skip
    wait_for_busy_workers(proc.pid, 2)  # the current settings simulated: a round is under way
    if sigint == "ignored":
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None, "an ignored SIGINT ended the command"
    stderr, took, leftover = sigterm_after(proc, 0.5)
    assert proc.returncode == 130, stderr
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["complete"] is False
    assert len(advice["evaluated"]) < 7, "the round ran to its end"
    assert took < 5, f"{took:.1f} s from SIGTERM to exit"
    assert without_progress(stderr) == stopped_lines(advice, "a.json")
    assert leftover == set()


def test_closing_the_terminal_window_keeps_what_advise_simulated(tmp_path: Path) -> None:
    """A terminal window closed (or an ssh session dropped) mid-search: SIGHUP to the process group,
    and every later write to the terminal fails. It used to kill `corral advise` and its workers at
    once, losing every simulation it had run; now it ends as on Ctrl-C, with the partial advice
    written and no worker left."""
    import os
    import time

    from terminal_proc import OnTerminal

    (tmp_path / "w.json").write_text(json.dumps({"batches": 3}))  # about a second a simulation
    argv = ["advise", "--workload", "w.json", "--passes", "5", "--workers", "2", "--json", "a.json"]
    window = OnTerminal([str(CORRAL), *argv], cwd=tmp_path)
    proc = window.proc
    try:
        time.sleep(12)  # several settings simulated by now, out of about a hundred
        window.hang_up()
        proc.wait(timeout=60)
    finally:
        leftover = left_in_session(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
    assert proc.returncode == 130, window.text()
    advice = json.loads((tmp_path / "a.json").read_text())
    assert advice["complete"] is False
    assert 1 <= len(advice["evaluated"]) < 100
    assert leftover == set()


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPUs to pin to one")
def test_advise_runs_one_simulation_per_cpu_it_may_use_by_default(tmp_path: Path) -> None:
    """--help said 'default: the CPU count'; advise took os.cpu_count(), capped at 8, so under
    `taskset -c 0` (or a cpuset) it started a worker per CPU of the machine on one CPU. It now takes the
    CPUs this process may use, at most 8, and --help says so (and that --plot takes any image format)."""
    import os
    import time

    help_text = " ".join(corral("advise", "--help", cwd=tmp_path).stdout.split())
    assert "default: the CPUs this process may use, at most 8" in help_text
    assert "PNG of" not in help_text
    proc = subprocess.Popen(
        [str(CORRAL), "advise", "--workload", str(EXAMPLES / "small-trace.yaml"), "--passes", "1",
         "--json", "advice.json"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )  # fmt: skip
    most = 0
    while proc.poll() is None:
        most = max(most, len(simulation_workers(proc.pid)))
        time.sleep(0.02)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert most == 1, f"{most} worker processes on one CPU"


def test_trace_import_of_a_real_corral_run_report_names_each_attempt_by_its_task(tmp_path: Path) -> None:
    """A `corral run` report's events do not name tasks (group_admitted's task is ''): the import named
    each group's attempts 'task-<index>', one made-up task per group, so the 10 real tasks of this run
    became 40 and the simulator replayed groups, not tasks. The report's group_tasks names them."""
    report = EXAMPLES.parent / "docs" / "runs" / "pair3-full.json"
    done = corral("trace", "import", "--format", "corral-run", str(report), "--out", "t.jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    tasks = {line["task"] for line in lines}
    assert tasks <= set(json.loads(report.read_text())["group_tasks"].values())
    assert 1 < len(tasks) <= 10
    assert f"{len(lines)} attempts of {len(tasks)} tasks" in done.stderr, (len(lines), len(tasks))


def test_the_updating_engines_advise_recommends_can_be_set_in_a_workload(
    tmp_path: Path,
) -> None:
    """`advise` recommends `updating=N` (max_updating_engines), but a workload file refused
    `policy: {max_updating_engines: N}` ("Extra inputs are not permitted") and `corral sim` had no other
    way to take it, so the advice could not be checked. `corral sim` now runs such a workload exactly as
    advise simulated that candidate; here 1 engine at a time is not what `full` does by default."""
    from app.sim.advise import current_settings, evaluate
    from app.sim.workload import Workload

    base = {
        "batches": 4, "batch": {"groups": 8, "group_size": 4}, "policy": {"surplus_groups": 8},
        "engines": {"count": 4, "slots": 32, "update_s": 20},
    }  # fmt: skip
    workload = Workload.model_validate(base)
    advised = evaluate(workload, current_settings(workload).with_knob("max_updating_engines", 1))
    default = evaluate(workload, current_settings(workload))
    assert advised.batch_collection_s != default.batch_collection_s
    data = {**base, "policy": {**base["policy"], "max_updating_engines": 1}}
    (tmp_path / "w.json").write_text(json.dumps(data))
    done = corral("sim", "--workload", "w.json", "--json", "s.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["batch_collection_s"]["mean"] == advised.batch_collection_s
    assert round(sum(report["wasted_trajectory_s"].values()), 3) == advised.wasted_trajectory_s
    # And advise starts from it: the workload's own value is the current settings'.
    assert current_settings(Workload.model_validate(data)).max_updating_engines == 1


def test_progress_lines_can_hold_back_until_the_work_has_taken_a_while() -> None:
    """`trace import` of a large run said nothing for its 10 s; a quick one should still say only its
    result. With `quiet_s` the first line comes once that long has passed, then every ten seconds."""
    now = [0.0]
    written: list[str] = []
    lines = ProgressLines(
        "trace import", "results.json files", clock=lambda: now[0], write=written.append, quiet_s=5.0
    )
    for t, done in [(0.1, 1), (4.9, 900), (5.0, 1000), (9.0, 1800), (15.0, 3000), (15.5, 3100)]:
        now[0] = t
        lines(done, 30_000)
    assert written == [
        "trace import: 1000/30000 results.json files, 5 s",
        "trace import: 3000/30000 results.json files, 15 s",
    ]
