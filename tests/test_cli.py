"""The `corral` console script, run for real as a subprocess.

Bad input ends with exit code 2 and a one-line message naming the field (or the trace line), never a
traceback; good input writes reports with every contract key, and a seed reproduces a run exactly.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import make_workload_data
from proc_children import left_in_session

CORRAL = Path(sys.executable).with_name("corral")

REPORT_KEYS = {
    "policy",
    "batches",
    "batch_collection_s",
    "batch_interval_s",
    "trainer_idle_fraction",
    "lower_bound_s",
    "max_staleness",
    "max_groups_in_flight",
    "discarded_groups",
    "restarted_trajectories",
    "lost_groups",
    "tokens_per_s",
    "events",
    "wall_s",
}


def make_workload(**overrides: Any) -> dict[str, Any]:
    return make_workload_data(**{"seed": 5, **overrides})


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data))  # JSON is YAML; the .yaml suffix takes the YAML reader
    return path


# Where the bar is off: bench and advise count simulations, sim its batches.
PROGRESS_LINE = re.compile(r"(bench|advise): \d+/\d+ simulations, \d+ s|sim: \d+/\d+ batches, \d+ s")


def corral(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert CORRAL.exists(), f"the console script is not installed at {CORRAL}"
    return subprocess.run(
        [str(CORRAL), *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, check=False
    )


def assert_refused(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "Traceback" not in output
    assert "error:" in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


# -- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        ({"trajectory": {"llm_s": {"lognormal": {"median": 3}}}}, ["trajectory.llm_s.lognormal.p90"]),
        ({"trajectory": {"reset_s": -1}}, ["trajectory.reset_s"]),
        ({"trajectory": {"timeout_s": -5}}, ["trajectory.timeout_s"]),
        ({"trainer": {"step_s": -1}}, ["trainer.step_s"]),
        ({"engines": {"slots": 0}}, ["engines.slots"]),
        ({"policy": {"max_staleness": -1}}, ["policy.max_staleness"]),
        ({"policy": {"surplus_groups": -3}}, ["policy.surplus_groups"]),
        ({"batch": {"group_size": 1}}, ["batch.group_size"]),
        ({"cpus": {"total": 4, "serving": 2}}, ["cpus", "serving"]),
        ({"batches": 0, "speed": 3}, ["batches", "speed"]),
    ],
)
def test_bad_workload_field_is_refused_by_name(
    tmp_path: Path, overrides: dict[str, Any], needles: list[str]
) -> None:
    spec = write_yaml(tmp_path / "w.yaml", make_workload(**overrides))
    out = tmp_path / "out.json"
    assert_refused(corral("sim", "--workload", spec, "--json", out), "w.yaml", *needles)
    assert not out.exists()


def test_bad_override_flag_is_refused(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "w.yaml", make_workload())
    assert_refused(corral("sim", "--workload", spec, "--surplus", "-1"), "--surplus")
    assert_refused(corral("sim", "--workload", spec, "--max-staleness", "-1"), "--max-staleness")
    assert_refused(corral("bench", "--workload", spec, "--json", tmp_path / "b.json", "--surplus-sweep", "x"))


def good_line(task: str = "a") -> str:
    return json.dumps(
        {"task": task, "reset_s": 1, "agent_s": 5, "validate_s": 1, "cleanup_s": 1, "reward": 1}
    )


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ("", ["is empty"]),
        (good_line() + "\n{not json\n", ["line 2", "not JSON"]),
        (good_line() + "\n" + good_line().replace('"agent_s": 5, ', "") + "\n", ["line 2", "agent_s"]),
        (good_line().replace('"reset_s": 1', '"reset_s": -1') + "\n", ["line 1", "reset_s"]),
        (
            good_line() + "\n\n" + good_line().replace('"reward": 1', '"reward": 1, "x": 2') + "\n",
            ["line 3", "x"],
        ),
    ],
)
def test_bad_trace_is_refused_naming_the_line(tmp_path: Path, content: str, needles: list[str]) -> None:
    (tmp_path / "trace.jsonl").write_text(content)
    spec = write_yaml(tmp_path / "w.yaml", make_workload(trace="trace.jsonl"))
    assert_refused(corral("sim", "--workload", spec, "--json", tmp_path / "o.json"), "trace", *needles)


def test_missing_trace_file_is_refused(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "w.yaml", make_workload(trace={"path": "nowhere.jsonl"}))
    assert_refused(corral("sim", "--workload", spec), "trace.path", "nowhere.jsonl")


def test_missing_or_unreadable_workload_file_is_refused(tmp_path: Path) -> None:
    assert_refused(corral("sim", "--workload", tmp_path / "absent.yaml"), "absent.yaml")
    assert_refused(corral("bench", "--workload", tmp_path / "absent.yaml", "--json", tmp_path / "b.json"))
    (tmp_path / "broken.yaml").write_text("batch: [unclosed\n")
    assert_refused(corral("sim", "--workload", tmp_path / "broken.yaml"), "broken.yaml", "YAML")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    assert_refused(corral("sim", "--workload", tmp_path / "list.yaml"), "mapping")
    (tmp_path / "binary.yaml").write_bytes(b"seed: 1\n\xff\xfe\n")
    assert_refused(corral("sim", "--workload", tmp_path / "binary.yaml"), "binary.yaml", "UTF-8")


def test_outputs_sent_to_dev_null_are_thrown_away_and_dev_null_stays(tmp_path: Path) -> None:
    # A script that wants only the summary line: `--json /dev/null` was refused ("not a regular file"),
    # and a write that replaced it by a file (a temporary beside it, renamed) would break the machine.
    import stat

    spec = write_yaml(tmp_path / "w.yaml", make_workload())
    proc = corral("sim", "--workload", spec, "--json", "/dev/null", "--plot", "/dev/null")
    assert proc.returncode == 0, proc.stderr
    assert "→ /dev/null" in proc.stderr
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode)
    assert not Path("/dev/null.tmp").exists()


def test_dev_stdout_is_standard_output_even_a_pipe(tmp_path: Path) -> None:
    """`--json /dev/stdout | jq`: the link leads to /proc/self/fd/1, which names a pipe as `pipe:[N]`,
    and the command refused it with "/proc/PID/fd/pipe:[N]: cannot write there: No such file or
    directory". It is standard output, as `-` is; /dev/stderr, a pipe too, is refused by its own name."""
    spec = write_yaml(tmp_path / "w.yaml", make_workload())
    proc = corral("sim", "--workload", spec, "--json", "/dev/stdout", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["policy"] == "full"
    assert "→ /dev/stdout" in proc.stderr
    assert_refused(
        corral("sim", "--workload", spec, "--json", "/dev/stderr", cwd=tmp_path),
        "--json /dev/stderr",
        "not a regular file",
    )
    plot = corral("sim", "--workload", spec, "--json", "-", "--plot", "/dev/stdout", cwd=tmp_path)
    assert_refused(plot, "--plot /dev/stdout", "not written to standard output")
    trial = tmp_path / "run" / "t" / "t.1"
    trial.mkdir(parents=True)
    stamps = ("trial_started_at", "agent_started_at", "agent_ended_at", "trial_ended_at")
    record = {k: f"2025-01-01T00:00:0{i}Z" for i, k in enumerate(stamps)}
    (trial / "results.json").write_text(json.dumps({"task_id": "t", "is_resolved": True, **record}))
    trace = corral(
        "trace", "import", "--format", "terminal-bench", "run", "--out", "/dev/stdout", cwd=tmp_path
    )
    assert trace.returncode == 0, trace.stderr
    assert json.loads(trace.stdout)["agent_s"] == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "w.yaml"]


def test_a_long_sim_off_a_terminal_says_how_far_it_is(tmp_path: Path) -> None:
    """With stderr a log, `sim` printed nothing until its result: a workload of many batches (up to
    100,000) ran for minutes, or hours, without a word. It now says how far it is from 5 s on."""
    spec = tmp_path / "long.json"
    spec.write_text(json.dumps({"batches": 60}))  # about 15 s on a CI runner
    proc = corral("sim", "--workload", spec, "--json", "/dev/null", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert re.fullmatch(r"sim: \d+/60 batches, \d+ s", lines[0]), lines
    # the result, then the notes that apply (on this workload: attempts cut short)
    result = [i for i, line in enumerate(lines) if line.startswith("full: ")]
    assert len(result) == 1, lines
    assert lines[result[0]].startswith("full: 60 batches"), lines
    assert all(line.startswith("note: ") for line in lines[result[0] + 1 :]), lines


def test_unwritable_output_paths_are_refused(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "w.yaml", make_workload())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_refused(
        corral("sim", "--workload", spec, "--json", blocker / "out.json"), "cannot write", "a-file"
    )
    assert_refused(
        corral("bench", "--workload", spec, "--json", blocker / "b.json", "--surplus-sweep", "0"),
        "cannot write",
    )


# -- happy paths -------------------------------------------------------------------------------------


def test_sim_writes_every_contract_key(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "small.yaml", make_workload())
    out = tmp_path / "reports" / "sim.json"
    proc = corral("sim", "--workload", spec, "--policy", "full", "--json", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report) >= REPORT_KEYS
    assert report["policy"] == "full"
    assert report["batches"] == 2
    assert {"mean", "p50", "p90", "per_batch"} <= set(report["batch_collection_s"])
    assert len(report["batch_collection_s"]["per_batch"]) == 2
    assert "mean" in report["batch_interval_s"]
    assert {"stale", "failed", "cancelled"} <= set(report["discarded_groups"])
    assert report["lost_groups"] == 0
    assert report["max_groups_running"] <= 2 + 2  # full admits in flight: B + S caps groups running
    assert report["max_staleness"] <= 2
    assert 0 <= report["trainer_idle_fraction"] <= 1
    assert report["events"] > 0
    assert "2 batches" in proc.stderr


@pytest.mark.parametrize("policy", ["sync", "completion", "lanes"])
def test_sim_runs_every_rung(tmp_path: Path, policy: str) -> None:
    spec = write_yaml(tmp_path / "small.yaml", make_workload())
    out = tmp_path / "sim.json"
    proc = corral("sim", "--workload", spec, "--policy", policy, "--json", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["policy"] == policy
    assert report["lost_groups"] == 0


def test_sim_agent_gate_is_full_s_own_and_a_flag_sets_or_removes_it(tmp_path: Path) -> None:
    write_yaml(tmp_path / "w.yaml", make_workload_data())
    gates = {}
    for flag in ([], ["--agent-gate", "0"], ["--agent-gate", "2.5"]):
        proc = subprocess.run(
            [str(CORRAL), "sim", "--workload", "w.yaml", "--json", "r.json", *flag],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        gates[" ".join(flag)] = json.loads((tmp_path / "r.json").read_text())["agent_gate"]
    assert gates[""]["factor"] == 1.0  # full's default
    assert gates["--agent-gate 0"] is None
    assert gates["--agent-gate 2.5"]["factor"] == 2.5
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "w.yaml", "--agent-gate", "-1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--agent-gate" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sim_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "small.yaml", make_workload())
    reports = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert corral("sim", "--workload", spec, "--json", out).returncode == 0
        report = json.loads(out.read_text())
        report.pop("wall_s")
        reports.append(report)
    assert reports[0] == reports[1]
    other = write_yaml(tmp_path / "other.yaml", make_workload(seed=6))
    out = tmp_path / "other.json"
    assert corral("sim", "--workload", other, "--json", out).returncode == 0
    assert json.loads(out.read_text())["batch_collection_s"] != reports[0]["batch_collection_s"]


def test_bench_writes_ladder_sweeps_and_plot(tmp_path: Path) -> None:
    spec = write_yaml(tmp_path / "small.yaml", make_workload())
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    proc = corral(
        "bench",
        "--workload",
        spec,
        "--json",
        out,
        "--plot",
        png,
        "--surplus-sweep",
        "0,2",
        "--staleness-sweep",
        "1,2",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert set(result) >= {"workload", "policies", "sweeps"}
    assert result["workload"]["seed"] == 5
    assert set(result["policies"]) == {"sync", "completion", "lanes", "full"}
    for name, report in result["policies"].items():
        assert set(report) >= REPORT_KEYS, name
        assert report["lost_groups"] == 0
    assert [row["surplus_groups"] for row in result["sweeps"]["surplus"]] == [0, 2]
    assert len(result["sweeps"]["max_staleness"]) == 2
    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sync |" in proc.stderr
    # stderr is a pipe here, as in a log: the bar is off, so plain lines say how far it is
    progress = [line for line in proc.stderr.splitlines() if PROGRESS_LINE.fullmatch(line)]
    assert progress, proc.stderr
    assert progress[0].startswith("bench: 1/")
    # the sweeps are printed too, each row from the JSON (they were only in the JSON)
    first = result["sweeps"]["surplus"][0]
    assert f"| S = 0 | {first['batch_collection_s']:.1f} | {first['p90_s']:.1f} |" in proc.stderr
    for k in (1, 2):
        assert f"| K = {k}, S = " in proc.stderr
    assert "| without rolling |" in proc.stderr


def test_staleness_sweep_rows_name_their_k() -> None:
    from app.sim.bench import run_bench
    from app.sim.workload import Workload

    result = run_bench(Workload.model_validate(make_workload()), [], [1, 3])
    rows = result["sweeps"]["max_staleness"]
    # K is compared at the default S (2) and at the largest S of the sweep (none given: 0).
    assert [(row["max_staleness"], row["surplus_groups"]) for row in rows] == [(1, 0), (3, 0), (1, 2), (3, 2)]


@pytest.mark.parametrize(
    ("args", "presses"),
    [
        (["sim", "--workload", "w.json"], 1),
        (["sim", "--workload", "w.json"], 2),
        (["bench", "--family"], 1),
        (["bench", "--family"], 2),
        (["sim", "--workload", "w.json", "--plot", "p.png"], 1),
    ],
    ids=["sim", "sim, Ctrl-C twice", "bench --family", "bench --family, Ctrl-C twice", "sim with a plot"],
)
def test_ctrl_c_to_the_process_group_mid_simulation_ends_in_one_line(
    args: list[str], presses: int, tmp_path: Path
) -> None:
    """A Ctrl-C used to leave the virtual loop's tasks pending: thousands of "Task was destroyed" and
    "sandbox cleanup failed" lines, then a silent exit 130; a second press broke the unwinding."""
    import os
    import signal
    import time

    (tmp_path / "w.json").write_text(json.dumps({"batches": 100}))  # the default workload: about a minute
    proc = subprocess.Popen(
        [str(CORRAL), *args, "--json", "out.json"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    time.sleep(6)  # imported and simulating by now
    for press in range(presses):
        if press:
            time.sleep(0.02)  # the second press lands while the simulation unwinds
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:  # a press that is lost leaves it running: not into the next test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    # A second press used to end the exiting interpreter itself at times (killed by SIGINT, -2, which a
    # shell shows as 130 but a script's `subprocess` does not): the stop signals are ignored once the
    # command is on its way out (`early_signals.stopping`)
    assert proc.returncode == 130, stderr
    said = [line for line in stderr.splitlines() if not PROGRESS_LINE.fullmatch(line)]  # off a terminal
    # the plot asked for is not written either, and the line said only the report
    assert said == [f"interrupted; out.json{' and p.png' if '--plot' in args else ''} not written"]
    assert not (tmp_path / "out.json").exists()
    assert not (tmp_path / "p.png").exists()


def wait_for_reader(fifo: Path, proc: subprocess.Popen[str], timeout: float = 60) -> int:
    """Block until `proc` has opened `fifo` to read it; return our write end, held open (nothing is
    written), so the reader waits in its read."""
    import errno
    import os
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            if exc.errno != errno.ENXIO or time.monotonic() > deadline or proc.poll() is not None:
                raise
        time.sleep(0.05)


@pytest.mark.parametrize(
    "args",
    [
        ["sim", "--workload", "in.yaml", "--json", "out.json"],
        ["bench", "--workload", "in.yaml", "--json", "out.json"],
        ["advise", "--workload", "in.yaml", "--workers", "1", "--json", "out.json"],
        ["trace", "import", "--format", "corral-run", "in.yaml", "--out", "out.json"],
    ],
    ids=["sim", "bench", "advise", "trace import"],
)
def test_ctrl_c_while_a_command_reads_its_input_ends_in_one_line(args: list[str], tmp_path: Path) -> None:
    """The input is a pipe (`--workload <(generate)`) that has not been written yet. A Ctrl-C outside a
    simulation (reading the input, importing, loading a trace) was turned into a silent exit 130 by
    typer: no line said what happened."""
    import os
    import signal

    fifo = tmp_path / "in.yaml"
    os.mkfifo(fifo)
    # PYTHONFAULTHANDLER: a command still there 60 s after the Ctrl-C is sent SIGABRT, and its threads'
    # Python stacks are what the failure shows (it hung once in a full run, and not since).
    proc = subprocess.Popen(
        [str(CORRAL), *args],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )  # fmt: skip
    writer = wait_for_reader(fifo, proc)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: the whole process group
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGABRT)
            _, stderr = proc.communicate(timeout=30)
            pytest.fail(f"no end 60 s after the Ctrl-C; its stacks:\n{stderr}")
    finally:
        os.close(writer)
    assert proc.returncode == 130, stderr
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("interrupted"), stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.yaml"]


# A child that reads `argv[1]` with `argv[2]` while one of its own threads takes a SIGINT: Python's
# handler notes it, but the main thread's read is not interrupted, as with a Ctrl-C that lands just
# before a read begins (the race behind a hang of the FIFO test above in CI).
_MISSED_SIGNAL_CHILD = """
import signal, sys, threading, time
from pathlib import Path
from app.documents import read_document
from app.sim.traces import import_corral_run
from app.sim.workload import load_trace

def poke():
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Thread(target=poke).start()
reader = {"document": lambda p: read_document(p, "w"), "report": import_corral_run, "trace": load_trace}
try:
    reader[sys.argv[2]](Path(sys.argv[1]))
except KeyboardInterrupt:
    print("interrupted")
"""


@pytest.mark.parametrize("reader", ["document", "report", "trace"])
def test_a_signal_that_misses_the_read_of_a_pipe_still_ends_it(reader: str, tmp_path: Path) -> None:
    """A pipe's reader must act on a SIGINT that Python noted while no read was interrupted by it (it
    waited for the writer for ever)."""
    import os

    fifo = tmp_path / "in.yaml"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-c", _MISSED_SIGNAL_CHILD, str(fifo), reader],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    writer = wait_for_reader(fifo, proc)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the reader still waited on its pipe 30 s after the SIGINT")
    finally:
        os.close(writer)
    assert (proc.returncode, stdout, stderr) == (0, "interrupted\n", "")


@pytest.mark.parametrize(
    ("command", "sigint"),
    [("sim", "default"), ("sim", "ignored"), ("bench", "ignored")],
    ids=["sim", "sim, Ctrl-C ignored", "bench, Ctrl-C ignored"],
)
def test_sigterm_mid_simulation_ends_in_one_line(command: str, sigint: str, tmp_path: Path) -> None:
    """SIGTERM to `corral sim` alone acts as Ctrl-C (it killed the command silently). Also where
    SIGINT is ignored (a background job of a non-interactive shell, `bash -c 'corral sim ... & kill
    $!'`): SIGTERM killed it silently there (143), and SIGINT stays ignored."""
    import os
    import signal
    import time

    (tmp_path / "w.json").write_text(json.dumps({"batches": 100}))  # the default workload: about a minute
    ignored = signal.SIG_IGN if sigint == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen(
        [str(CORRAL), command, "--workload", "w.json", "--json", "out.json"],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, ignored),
    )  # fmt: skip
    time.sleep(6)  # imported and simulating by now
    if sigint == "ignored":
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None, "an ignored SIGINT ended the command"
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    said = [line for line in stderr.splitlines() if not PROGRESS_LINE.fullmatch(line)]  # off a terminal
    assert said == ["interrupted; out.json not written"]
    assert not (tmp_path / "out.json").exists()


def finished_attempt(group: int, attempt: int) -> list[dict[str, object]]:
    """A `corral run` event log's least finished attempt: its reset, then its finish."""
    return [
        {
            "kind": "sandbox_op",
            "group_id": group,
            "attempt": attempt,
            "lane": "reset",
            "start": 0.0,
            "end": 1.0,
        },
        {"kind": "attempt_finished", "group_id": group, "attempt": attempt, "reward": 1.0, "error": None},
    ]


def test_dash_as_the_output_means_standard_output(tmp_path: Path) -> None:
    """`--json -` (and trace import's `--out -`) was written to a file named `-`; the report now goes to
    stdout, alone, so it can be piped (`| jq`), and the summary line stays on stderr."""
    write_yaml(tmp_path / "w.yaml", make_workload(batches=1))
    proc = corral("sim", "--workload", "w.yaml", "--json", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["batches"] == 1
    assert "1 batch" in proc.stderr
    (tmp_path / "r.json").write_text(json.dumps({"event_log": finished_attempt(0, 0)}))
    proc = corral("trace", "import", "--format", "corral-run", "r.json", "--out", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["reward"] for line in proc.stdout.splitlines()] == [1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "w.yaml"]


def _limit_memory() -> None:
    """In the child: at most 3 GB of address space, so reading an endless input fails fast."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["sim", "--workload", "/dev/zero"], ["workload /dev/zero", "larger than 4 MB"]),
        (["run", "--config", "/dev/zero"], ["--config /dev/zero", "not a regular file"]),
        (["sim", "--workload", "big.yaml"], ["workload big.yaml", "larger than 4 MB"]),
        (["trace", "import", "--format", "corral-run", "/dev/zero"], ["/dev/zero", "not a JSON report"]),
        (["trace", "import", "--format", "corral-run", "big.json"], ["big.json", "larger than 2 GB"]),
        (["advise", "--workload", "w.yaml", "--trace", "/dev/zero"], ["--trace /dev/zero", "a device"]),
    ],
    ids=[
        "workload /dev/zero",
        "config /dev/zero",
        "workload of 5 MB",
        "report /dev/zero",
        "report of 2 GB",
        "advise --trace /dev/zero",
    ],
)
def test_an_endless_or_huge_input_is_refused_by_its_size(
    tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    """Every input was read whole into memory first: `--workload /dev/zero` (or a multi-GB file given by
    mistake) grew until a MemoryError traceback or the OOM killer, and a 5 MB YAML file took minutes to
    parse. A document (workload, run config, task.yaml) is now read up to 4 MB, a report up to 2 GB;
    advise's --trace may not be a device."""
    (tmp_path / "big.yaml").write_text("seed: 1\n" + ("#" * 99 + "\n") * 50_000)  # 5 MB of comments
    write_yaml(tmp_path / "w.yaml", make_workload())
    with (tmp_path / "big.json").open("wb") as f:  # sparse: 2 GB + 1 byte, no disk used
        f.write(b'{"event_log": [')
        f.truncate(2_000_000_001)
    proc = subprocess.run(
        [str(CORRAL), *args, *(["--json", "o.json"] if args[0] != "trace" else ["--out", "t.jsonl"])],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False, preexec_fn=_limit_memory,
    )  # fmt: skip
    assert_refused(proc, *needles)
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json", "big.yaml", "w.yaml"]


def _demo_serve(tmp_path: Path) -> tuple[list[str], dict[str, str], int]:
    """argv and environment of a `corral serve --demo` (simulated) kept in `tmp_path`, on a free port."""
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'corral.db'}",
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
        "CORRAL_OWNERS_DIR": str(tmp_path / "owners"),
    }
    return [str(CORRAL), "serve", "--port", str(port), "--demo", "--demo-kind", "sim"], env, port


def _wait_demo_served(proc: subprocess.Popen[Any], port: int, output: Callable[[], str]) -> None:
    """Until the server answers and its demo run is there."""
    import time

    import httpx

    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, output()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/runs", timeout=2).json():
                return
        except (httpx.TransportError, ValueError):
            pass
        assert time.monotonic() < deadline, "corral serve did not start"
        time.sleep(0.1)


def _assert_serve_stopped_cleanly(proc: subprocess.Popen[Any], stderr: str, run: str = "demo") -> None:
    """Exit 0, no traceback or error line, the run stopped, and the goodbye line last."""
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "ERROR" not in stderr, stderr
    assert f"({run}): stopped" in stderr, stderr
    assert stderr.splitlines()[-1].startswith("corral serve: stopped; runs and their events are kept"), stderr


def test_closing_the_terminal_window_of_corral_serve_stops_its_runs_cleanly(tmp_path: Path) -> None:
    """A terminal window closed (or an ssh session dropped) under `corral serve`: SIGHUP to its process
    group, and every later write to the terminal fails. It killed the server at once, its runs cut
    off mid-step (left 'running' in the store for the next start to resume) and its sandboxes left for
    the next start to sweep; it now stops as on Ctrl-C: each run stopped and stored so, exit 0."""
    import os
    import sqlite3

    from terminal_proc import OnTerminal

    argv, env, port = _demo_serve(tmp_path)
    window = OnTerminal(argv, cwd=tmp_path, env=env)
    proc = window.proc
    try:
        _wait_demo_served(proc, port, window.text)
        window.hang_up()
        proc.wait(timeout=60)
    finally:
        leftover = left_in_session(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, window.text()
    assert leftover == set()
    with sqlite3.connect(tmp_path / "corral.db") as db:
        states = [state for (state,) in db.execute("SELECT state FROM runs")]
    assert states == ["stopped"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_corral_serve_stopped_by_a_signal_says_what_became_of_its_runs(tmp_path: Path, sig: int) -> None:
    """SIGTERM (a supervisor's stop, `docker stop`, `kill PID`) to `corral serve` did stop the server and
    its runs (uvicorn's graceful shutdown), then uvicorn raised the signal again under its default
    action: the process died by it (exit -15, 143 in a shell) before the lines Ctrl-C ends with (each
    run's end state, where runs are kept). SIGTERM now ends it as Ctrl-C does."""
    import os

    argv, env, port = _demo_serve(tmp_path)
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_demo_served(proc, port, lambda: proc.communicate()[1])
        os.kill(proc.pid, sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _assert_serve_stopped_cleanly(proc, stderr)


def test_ctrl_c_twice_to_corral_serve_with_a_live_page_open_stops_at_once_cleanly(tmp_path: Path) -> None:
    """Two Ctrl-Cs to the process group within uvicorn's 0.1 s tick (a user pressing twice): uvicorn took
    the second as "force quit" and skipped the app's shutdown, so the runs were stopped only by the
    cancellation of every task at exit, under uvicorn's lifespan traceback. A dashboard page's live
    stream open meanwhile was cut off without its last message ("ASGI callable returned without
    completing response"). Now the app's shutdown runs, the stream ends cleanly, and serve says so;
    the second Ctrl-C stops it at once: the run is stopped, or, if its stop had not ended within
    the second's grace, left `running` in the store for the next start to resume."""
    import os
    import sqlite3
    import threading
    import time

    import httpx

    argv, env, port = _demo_serve(tmp_path)
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    streamed: list[int] = []

    def watch() -> None:  # the runs page, open in a browser: its live stream until the server ends it
        with httpx.stream("GET", f"http://127.0.0.1:{port}/stream", timeout=60) as response:
            streamed.append(response.status_code)
            for _ in response.iter_bytes():
                pass

    try:
        _wait_demo_served(proc, port, lambda: proc.communicate()[1])
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        deadline = time.monotonic() + 30
        while not streamed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert streamed == [200]
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.02)  # not at once: a signal still pending would absorb the second
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
        watcher.join(timeout=10)
        assert not watcher.is_alive()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "ERROR" not in stderr, stderr
    assert stderr.splitlines()[-1].startswith("corral serve: stopped; runs and their events are kept"), stderr
    assert stderr.count("corral serve: stopping: ") == 1, stderr
    assert stderr.count("corral serve: stopping at once") == 1, stderr
    with sqlite3.connect(tmp_path / "corral.db") as db:
        [state] = [state for (state,) in db.execute("SELECT state FROM runs")]
    said = {"stopped": "stopped", "running": "stopping (not stopped: resumed at the next start)"}
    assert f"(demo): {said[state]}" in stderr, stderr
    # stored stopped, it is not resumed: a run ended but still storing when the second came said it was
    [run_line] = [line for line in stderr.splitlines() if "(demo): " in line]
    assert state == "running" or "resumed at the next start" not in run_line, stderr


def test_a_trainer_long_polling_when_corral_serve_stops_is_told_so_at_once(tmp_path: Path) -> None:
    """uvicorn waits for open requests before the app's shutdown: a trainer's long-poll for the next
    batch (up to 300 s) held a Ctrl-C'd server until it timed out, with the runs still going. It now
    answers 503 (ask again once the server is back) as the server starts to stop."""
    import os
    import threading
    import time

    import httpx

    argv, env, port = _demo_serve(tmp_path)
    argv = argv[: argv.index("--demo")]
    env = {**env, "CORRAL_OPERATOR_TOKEN": "trainer-token", "CORRAL_ACK_TIMEOUT_S": "600"}
    auth = {"Authorization": "Bearer trainer-token"}
    base = f"http://127.0.0.1:{port}/api/runs"
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    answers: list[tuple[int, float]] = []
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                created = httpx.post(base, json={"name": "t", "kind": "sim"}, headers=auth, timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "corral serve did not start"
                time.sleep(0.1)
        assert created.status_code == 201, created.text
        run = created.json()["id"]
        first = httpx.get(f"{base}/{run}/batches/next", params={"timeout": 60}, headers=auth, timeout=90)
        assert first.status_code == 200, first.text

        def poll() -> None:  # the first batch is neither acked nor expired: this one waits
            from app.client import CorralClient, ServerUnavailable

            client = CorralClient(f"http://127.0.0.1:{port}", token="trainer-token", timeout_s=320)
            with client, pytest.raises(ServerUnavailable) as raised:  # the client says: ask again later
                client.next_batch(run, timeout=300)
            answers.append((raised.value.status, raised.value.retry_after_s))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        time.sleep(1.0)
        assert answers == []
        os.kill(proc.pid, signal.SIGINT)
        poller.join(timeout=60)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert answers == [(503, 5.0)], stderr
    _assert_serve_stopped_cleanly(proc, stderr, run="t")


@pytest.mark.parametrize("command", ["sim", "bench"])
def test_ctrl_c_while_the_plot_is_drawn_says_the_report_was_written(tmp_path: Path, command: str) -> None:
    """The report is written, then the plot drawn (about a second): a Ctrl-C then ended the command
    with a bare 'interrupted', though the report was there, complete."""
    import os
    import time

    write_yaml(tmp_path / "w.yaml", make_workload_data(seed=5, batches=5))
    sweeps = ["--surplus-sweep", "0", "--staleness-sweep", "2"] if command == "bench" else []
    proc = subprocess.Popen(
        [str(CORRAL), command, "--workload", "w.yaml", "--json", "r.json", "--plot", "r.png", *sweeps],
        cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (tmp_path / "r.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == "interrupted; r.json written, r.png not written", stderr
    assert "Traceback" not in stderr
    assert json.loads((tmp_path / "r.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "w.yaml"]


@pytest.mark.parametrize(
    "args",
    [
        ["sim", "--workload", "w.yaml", "--json", "-"],
        ["trace", "import", "--format", "corral-run", "r.json", "--out", "-"],
    ],
    ids=["sim --json -", "trace import --out -"],
)
def test_a_report_to_a_full_or_closed_standard_output_is_one_line(tmp_path: Path, args: list[str]) -> None:
    """`--json -` with standard output on a full disk (here /dev/full) or closed (`>&-`) ended in a
    traceback (OSError: No space left on device; 'NoneType' object has no attribute 'write'). A closed
    one is now refused before the work, a full one named when the write fails."""
    import os

    write_yaml(tmp_path / "w.yaml", make_workload(batches=1))
    (tmp_path / "r.json").write_text(json.dumps({"event_log": finished_attempt(0, 0)}))
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [str(CORRAL), *args], stdout=full, stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120,
            check=False,
        )  # fmt: skip
    assert proc.returncode == 1, proc.stderr  # after the work: the code of every output not written
    assert proc.stderr.splitlines() == [
        "error: cannot write the report to standard output: No space left on device"
    ]
    proc = subprocess.run(
        [str(CORRAL), *args], stderr=subprocess.PIPE, text=True, cwd=tmp_path, timeout=120, check=False,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"error: {args[-2]} -: standard output is closed"], proc.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["sim", "--workload", "w.yaml", "--json", "-", "--plot", "p.png"],
         "error: cannot write the plot p.png: File too large"),
        (["sim", "--workload", "w.yaml", "--json", "r.json"],
         "error: cannot write r.json: File too large; it could not be written anywhere"),
        (["trace", "import", "--format", "corral-run", "in.json", "--out", "t.jsonl"],
         "error: cannot write t.jsonl: File too large"),
        (["sim", "--workload", "w.yaml", "--json", "r/x.json"],
         "error: --json r/x.json: cannot write there: Not a directory"),
        (["sim", "--workload", "w.yaml", "--json", "-", "--plot", "r/x.png"],
         "error: --plot r/x.png: cannot write there: Not a directory"),
        (["trace", "import", "--format", "corral-run", "in.json", "--out", "r/x.jsonl"],
         "error: --out r/x.jsonl: cannot write there: Not a directory"),
    ],
    ids=["plot after", "report after", "trace after", "report before", "plot before", "trace before"],
)  # fmt: skip
def test_an_output_that_cannot_be_written_has_one_exit_code_for_each_time(
    tmp_path: Path, args: list[str], line: str
) -> None:
    """Each output (report, plot, trace) that cannot be written is one line and one exit code: 2 when
    its path is refused before the work (here a path under a regular file, `r/x.json`), as for any bad
    input; 1 when the work is done and the write fails (here a file size limit, `ulimit -f`, that the
    empty probe of the check passes). After the work a plot or a trace exited 2, a report 1."""
    import os
    import resource

    write_yaml(tmp_path / "w.yaml", make_workload(batches=1))
    (tmp_path / "r").write_text("a regular file\n")
    events = [event for g in range(10) for a in range(2) for event in finished_attempt(g, a)]
    (tmp_path / "in.json").write_text(json.dumps({"event_log": events}))
    (tmp_path / "tmp").mkdir()  # where a report not written is kept, if it can be

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    before = set(os.listdir(tmp_path))
    proc = subprocess.run(
        [str(CORRAL), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False,
        preexec_fn=limit_file_size if "too large" in line else None,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip
    assert proc.returncode == (1 if "too large" in line else 2), proc.stderr
    assert proc.stderr.splitlines() == [line], proc.stderr
    assert "Traceback" not in proc.stderr
    assert set(os.listdir(tmp_path)) == before  # nothing half-written left, here or in TMPDIR
    assert not os.listdir(tmp_path / "tmp")


@pytest.mark.parametrize(("engine_demand", "noted"), [(2.0, True), (1.0, False)])
def test_sim_notes_serving_cores_below_what_the_busy_engines_use(
    tmp_path: Path, engine_demand: float, noted: bool
) -> None:
    """On each random workload whose serving cores were fewer than its busy engines use, `full` lost to
    a rung that shares CPUs, and nothing said why. The note comes after the results."""
    write_yaml(
        tmp_path / "w.yaml",
        make_workload_data(cpus={"total": 8, "serving": 2, "engine_demand": engine_demand}),
    )
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "w.yaml", "--json", "r.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    last = proc.stderr.splitlines()[-1]
    if noted:
        assert last.startswith("note: cpus.serving is 2 cores, below the 4 that 2 busy engines use"), last
        assert "`corral advise` sweeps the split" in last
    else:
        assert "note:" not in proc.stderr, proc.stderr
        assert last.startswith("full: 2 batches"), last


@pytest.mark.parametrize("down", [True, False])
def test_sim_notes_attempts_cut_short_by_the_run(tmp_path: Path, down: bool) -> None:
    """With every engine down for the whole run, each attempt ran out of its agent time without a turn,
    and the simulator fails it; the batches still came, so the summary line alone looked healthy."""
    faults = [{"kind": "engine_down", "engine": e, "at_s": 0.0, "for_s": 1e6} for e in (0, 1)] if down else []
    write_yaml(tmp_path / "w.yaml", make_workload_data(faults=faults))
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "w.yaml", "--json", "r.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    if down:
        played = report["attempts_played"]
        assert report["attempts_cut_short"] == played > 0
        note = f"note: full: {played:,} of {played:,} attempts (100%) ran out of their 60 s (trajectory."
        assert note in proc.stderr, proc.stderr
        assert "fail (reward 0)" in proc.stderr
    else:
        assert report["attempts_cut_short"] == 0
        assert "ran out of" not in proc.stderr, proc.stderr


def _sim_mean_and_last_line(tmp_path: Path, name: str, data: dict[str, Any]) -> tuple[float, str]:
    write_yaml(tmp_path / f"{name}.yaml", data)
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", f"{name}.yaml", "--json", f"{name}.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / f"{name}.json").read_text())
    return report["batch_collection_s"]["mean"], proc.stderr.splitlines()[-1]


@pytest.mark.parametrize(("total", "noted"), [(10, True), (40, False)])
def test_sim_notes_spare_serving_cores_while_lanes_queue_for_cores(
    tmp_path: Path, total: int, noted: bool
) -> None:
    """A random workload with more serving cores than its engines use and too few sandbox cores made
    `full` slower than `completion`, and nothing said why. The note names the spare cores and the lane
    queues' share of the trainer's wait, only where the lanes asked for every sandbox core; and what
    it suggests, lending the idle serving cores to the lanes, makes that run faster."""
    data = make_workload_data(
        cpus={"total": total, "serving": 6},
        batch={"groups": 4, "group_size": 2},
        lanes={"reset": 4, "exec": 4, "validate": 4, "cleanup": 4},
        trajectory={"tool_s": 3, "validate_s": 4},
    )
    mean, last = _sim_mean_and_last_line(tmp_path, "pinned", data)
    if not noted:  # 34 sandbox cores: the lanes never asked for them all
        assert last.startswith("full: 2 batches"), last
        return
    assert last.startswith(
        "note: cpus.serving is 6 cores, 2 more than the 4 that 2 busy engines use "
        "(2 × cpus.engine_demand 2), while lane queues"
    ), last
    assert " held the trainer for " in last, last
    assert "`lanes.borrow_serving_cpus: true` lends the cores the engines leave idle" in last, last
    data["lanes"]["borrow_serving_cpus"] = True
    borrowing, last = _sim_mean_and_last_line(tmp_path, "borrowing", data)
    assert last.startswith("full: 2 batches"), last  # the note is not given where its advice is taken
    assert borrowing < 0.8 * mean, (borrowing, mean)


def test_a_file_named_as_a_built_in_workload_is_read_and_said_so(tmp_path: Path) -> None:
    # A file `default` in the current directory was read instead of the built-in, without a word.
    write_yaml(tmp_path / "default", make_workload_data())
    proc = subprocess.run(
        [str(CORRAL), "sim", "--workload", "default", "--json", "r.json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        proc.stderr.splitlines()[0]
        == "note: reading the file default, not the built-in workload 'default' of that name"
    )
    assert json.loads((tmp_path / "r.json").read_text())["batches"] == make_workload_data()["batches"]


def test_a_ctrl_c_that_cuts_an_import_short_while_the_plot_is_drawn_is_an_interrupt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Seen on a slow machine: the Ctrl-C landed in matplotlib's C extension's initialisation, which
    # raised ImportError "initialization failed" from it, and the command ended with that traceback.
    import typer

    from app.cli.common import write_plot

    def draw(path: Path) -> None:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    report = tmp_path / "r.json"
    with pytest.raises(typer.Exit) as ended:
        write_plot(draw, tmp_path / "p.png", written=report)
    assert ended.value.exit_code == 130
    assert (
        capsys.readouterr().err.strip() == f"interrupted; {report} written, {tmp_path / 'p.png'} not written"
    )

    def broken(path: Path) -> None:
        raise ImportError("no module named matplotlib")  # not an interrupt: it stays what it is

    with pytest.raises(ImportError, match="no module named"):
        write_plot(broken, tmp_path / "p.png", written=report)


def test_the_serving_note_counts_one_core_as_one() -> None:
    """`cpus: {total: 5, serving: 1}` gave `cpus.serving is 1 cores`."""
    from app.cli.sim import serving_note
    from app.sim.workload import Workload

    note = serving_note(Workload.model_validate({"cpus": {"total": 5, "serving": 1}}))
    assert note is not None
    assert note.startswith("note: cpus.serving is 1 core, below the 16 that 8 busy engines use")


def test_a_trainer_that_never_waited_gets_no_serving_note() -> None:
    """A workload whose every duration is 0 said "lane queues held the trainer for 0.0 s of its 0.0 s
    wait"."""
    from app.cli.sim import serving_note
    from app.sim.workload import Workload

    spec = Workload.model_validate({"cpus": {"total": 64, "serving": 32}})
    report = {"wait_attribution": {"total_s": 0.0, "phases": {"lane_queue": 0.0, "model_turn": 0.0}}}
    assert serving_note(spec, report) is None
    only_lanes = {"wait_attribution": {"total_s": 3.0, "phases": {"lane_queue": 3.0}}, "lanes": {}}
    assert serving_note(spec, only_lanes) is None  # max() of no other phase raised ValueError


@pytest.mark.parametrize("args", [[], ["trace"]])
def test_no_command_prints_the_help_as_help(args: list[str], tmp_path: Path) -> None:
    """`corral` or `corral trace` alone: the help, laid out as `--help` lays it out (it was squashed into
    one `error:` line), and exit code 2 (no command was run)."""
    proc = corral(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"Usage: corral{' ' if args else ''}{' '.join(args)} [OPTIONS] COMMAND")
    assert "\nCommands:\n" in proc.stderr
    assert "error:" not in proc.stderr
