"""Every `python -m benchmarks.NAME` ends on a stop signal as `corral`'s commands do: one line, exit 130."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_children import left_in_session, reaped

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_script_runs_through_run_script() -> None:
    """`run_script` is what turns a stop signal into one line: a script that called `main()` itself gave
    a KeyboardInterrupt traceback on Ctrl-C and died silently on SIGTERM."""
    scripts = sorted(p for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")
    assert scripts
    for script in scripts:
        text = script.read_text()
        block = re.search(r'\nif __name__ == "__main__":\n(.*)', text, re.DOTALL)
        assert block is not None, script.name
        assert "run_script(main)" in block.group(1), script.name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["INT", "TERM", "HUP"])
def test_a_stop_signal_mid_benchmark_is_one_line_and_exit_130(sig: signal.Signals) -> None:
    """`benchmarks.scale` (a long single-process simulation, with no handling of its own) stopped by a
    signal to its process group: it printed a KeyboardInterrupt traceback (Ctrl-C) or died silently
    (SIGTERM -15, SIGHUP -1)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.scale", "--shape", "realistic", "--no-bench"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with reaped(proc):
        time.sleep(4)  # imported and simulating: the run takes tens of seconds
        assert proc.poll() is None
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert "Traceback" not in err
    assert left_in_session(proc.pid, group=True) == set()


def run_module(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", name, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_faults_refuses_a_bad_batch_count_in_one_line() -> None:
    for value in ("0", "-1", "x"):
        done = run_module("benchmarks.faults", "--batches", value)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: --batches: "), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_faults_ends_with_the_runs_own_error_when_the_run_exits_before_its_engines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `corral run` that refuses its flags exits 2 at once: the script polled for its engines for
    180 s, then raised `TimeoutError: engines not ready` without the run's error."""
    monkeypatch.syspath_prepend(str(REPO))  # benchmarks/ is imported from the checkout
    from benchmarks import faults

    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        faults.run_fault(faults.FAULTS[0], 0, tmp_path)  # --batches 0 reaches the run itself
    assert exit_info.value.code == 2
    assert time.monotonic() - started < 60
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("error: corral run exited 2 before its engines were ready")
    assert "--batches" in err[-1]


@pytest.mark.parametrize(
    ("module", "args", "flag"),
    [
        ("benchmarks.scale", ["--groups", "0"], "--groups"),
        ("benchmarks.scale", ["--group-size", "1"], "--group-size"),
        ("benchmarks.scale", ["--surplus", "-1"], "--surplus"),
        ("benchmarks.scale", ["--batches", "0"], "--batches"),
        ("benchmarks.scale", ["--repeat", "0"], "--repeat"),
        ("benchmarks.scale", ["--profile", "x"], "--profile"),
        ("benchmarks.scale", ["--groups", "10000", "--surplus", "100000"], "--groups 10000"),
        ("benchmarks.family", ["--processes", "0"], "--processes"),
        ("benchmarks.family", ["--processes", "-2"], "--processes"),
        ("benchmarks.family", ["--processes", "65"], "--processes"),
        ("benchmarks.family", ["--seed", "-1"], "--seed"),
    ],
)
def test_scale_and_family_refuse_bad_numbers_in_one_line(module: str, args: list[str], flag: str) -> None:
    """`scale --groups 0` was a pydantic traceback (exit 1); `scale --repeat 0` and `family --processes 0`
    ran as if 1 was given."""
    done = run_module(module, *args, "--no-bench" if module.endswith("scale") else "--no-peers")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {flag}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_gate_random_names_its_own_flag_for_an_unwritable_output(tmp_path: Path) -> None:
    """`--out DIR` was refused as `error: --json DIR: is a directory`: there is no --json flag."""
    done = run_module("benchmarks.gate_random", "--out", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: --out {tmp_path}: "), done.stderr
    assert "--json" not in done.stderr


def test_make_trace_help_writes_nothing_and_out_writes_the_same_trace(tmp_path: Path) -> None:
    """`make_trace --help` ignored its arguments and rewrote the tracked examples/tb-trace.jsonl."""
    tracked = REPO / "examples" / "tb-trace.jsonl"
    before = tracked.stat().st_mtime_ns
    helped = run_module("benchmarks.make_trace", "--help")
    assert helped.returncode == 0
    assert "--out" in helped.stdout
    assert tracked.stat().st_mtime_ns == before
    out = tmp_path / "trace.jsonl"
    done = run_module("benchmarks.make_trace", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == tracked.read_bytes()  # the default invocation's output, byte for byte
    assert tracked.stat().st_mtime_ns == before


@pytest.mark.parametrize(
    ("args", "flag"),
    [(["--minutes", "nan"], "--minutes"), (["--minutes", "0"], "--minutes"), (["--sse", "65"], "--sse"),
     (["--concurrent", "0"], "--concurrent"), (["--every", "inf"], "--every")],
)  # fmt: skip
def test_soak_refuses_bad_numbers_in_one_line_before_starting_a_server(args: list[str], flag: str) -> None:
    done = run_module("benchmarks.soak", *args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {flag}: "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow  # a minute: a server started, two runs, a prune, the server's stop
def test_soak_samples_a_real_server_and_prunes_what_it_kept(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    done = run_module(
        "benchmarks.soak", "--minutes", "0.2", "--idle-s", "2", "--every", "2", "--run-s", "4",
        "--keep-every", "1", "--sse", "2", "--json", str(out), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    import json

    result = json.loads(out.read_text())
    first, last = result["samples"][0], result["samples"][-1]
    assert first["fds"] > 0
    assert first["threads"] > 0
    assert last["runs_created"] >= 1
    assert last["streams_opened"] >= 1
    assert result["prune"]["rc"] == 0
    assert result["prune"]["kept"] >= 1
    assert (last["data_files"], last["events_rows"]) == (0, 0)  # every kept run pruned, files and rows
    assert result["exit_code"] == 0
