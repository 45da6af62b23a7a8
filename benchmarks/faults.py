"""The faults table (README, docs/faults.md): `corral run` with each fault injected by the shell
command shown, and what the run's own report says happened after it.

    python -m benchmarks.faults [--batches 6] [--json out.json]

For each fault: start `corral run --batches N` (its own session, as from a terminal), wait for the
engines (and, for most faults, the first batch), run the command with `{run}` (the run's pid), `{e0}`,
`{e1}` (engine pids) and `{port0}`, `{port1}` (engine ports) filled in, wait for the run to end, then
read the report: when the run noticed the fault (the first `unhealthy` engine event, or the failed
update), how many batches were delivered after that, how many groups were lost (must be 0) and how
many failed. Engines are found among the run's own children only (`pgrep -P`), so other runs on the
machine are never touched. The debug routes need `CORRAL_ENGINE_DEBUG=1` (app/engines/embedded/faults.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import httpx

from app.runtime.config import MAX_RUN_BATCHES
from app.validation import int_between

CONFIG = """
seed: 3
batch: {groups: 2, group_size: 2}
policy: {surplus_groups: 2, max_staleness: 2}
engines: {count: 2, cpus: [0], slots: 4, max_tokens: 16, update_timeout_s: 3, restart_backoff_s: 0.5,
          restart_backoff_max_s: 4, health_interval_s: 1}
lanes: {cpus: [1], reset: 2, exec: 2, validate: 1, cleanup: 1}
trainer: {step_s: 0.5}
tasks: {include: [fix-off-by-one, json-transform, patch-config-sed, sort-uniq-log]}
"""
BATCH_LINE = re.compile(r"\bbatch (\d|\{)")
CURL = "curl -s -X POST -H 'content-type: application/json'"


@dataclass(frozen=True)
class Fault:
    name: str
    command: str
    after_first_batch: bool = True
    debug: bool = False
    signal_run: bool = False  # the command stops the run: count what the report says, not batches after
    turn_on_e0: bool = False  # wait until engine 0 has a turn in flight (GET /stats) before the command


FAULTS = [
    Fault(
        "engine process killed mid-turn",
        "kill -STOP {e0}; sleep 1; kill -9 {e0}",
        after_first_batch=False,
        turn_on_e0=True,
    ),
    Fault(
        "engine's child process killed",
        "kill -9 $(curl -s localhost:{port1}/debug/fault | jq .child_pid)",
        debug=True,
    ),
    Fault(
        "weight update hangs",
        CURL + ' localhost:{port1}/debug/fault -d \'{{"update": "hang"}}\'',
        after_first_batch=False,
        debug=True,
    ),
    Fault(
        "weight update fails (HTTP 500)",
        CURL + ' localhost:{port0}/debug/fault -d \'{{"update": "error"}}\'',
        after_first_batch=False,
        debug=True,
    ),
    Fault("every engine killed at once", "kill -9 {e0} {e1}"),
    Fault("Ctrl-C (SIGINT to the process group)", "kill -INT -- -{run}", signal_run=True),
    Fault("Ctrl-C twice", "kill -INT -- -{run}; sleep 0.3; kill -INT -- -{run}", signal_run=True),
]


def engines_of(run_pid: int) -> list[tuple[int, int]]:
    """(pid, port) of the run's engine processes, oldest first."""
    found = subprocess.run(
        ["pgrep", "-P", str(run_pid), "-f", "app.engines.embedded --port"], capture_output=True, text=True
    )
    pairs = []
    for pid in sorted(int(p) for p in found.stdout.split()):
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        pairs.append((pid, int(words[words.index(b"--port") + 1])))
    return pairs


def run_ended(proc: subprocess.Popen[str], lines: list[str], reader: threading.Thread, waiting: str) -> None:
    """If `corral run` has exited (a refused flag or config, a failed start), end the script with one line
    saying so and then the run's own last line of stderr: exit 2 when the run refused its input (2),
    1 otherwise. It waited out its 180 s for engines that would never start, then raised a traceback."""
    code = proc.poll()
    if code is None:
        return
    reader.join(5)
    _give_up(lines, f"corral run exited {code} {waiting}", 2 if code == 2 else 1)


def _give_up(lines: list[str], why: str, code: int) -> NoReturn:
    """End the script: `why` in one line, then the run's own last line of stderr."""
    said = [line.strip() for line in lines if line.strip()]
    print(f"error: {why}; its last line:", file=sys.stderr)
    print(said[-1] if said else "(it wrote nothing)", file=sys.stderr)
    raise SystemExit(code)


def wait_ready(
    proc: subprocess.Popen[str], lines: list[str], reader: threading.Thread, timeout_s: float = 180.0
) -> list[tuple[int, int]]:
    """The run's two engines once both answer /health; the script ends (`run_ended`) if the run exits
    first or they are not ready within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run_ended(proc, lines, reader, "before its engines were ready")
        engines = engines_of(proc.pid)
        if len(engines) == 2:
            try:
                if all(httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
                       for _, port in engines):  # fmt: skip
                    return engines
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    _give_up(lines, f"corral run's engines not ready after {timeout_s:g} s", 1)


def run_fault(fault: Fault, batches: int, tmp: Path) -> dict[str, Any]:
    config = tmp / "run.yaml"
    config.write_text(CONFIG)
    out = tmp / f"{abs(hash(fault.name))}.json"
    env = {**os.environ, **({"CORRAL_ENGINE_DEBUG": "1"} if fault.debug else {})}
    argv = [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(config),
            "--batches", str(batches), "--json", str(out)]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=env)  # fmt: skip
    lines: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        with stderr:
            lines.extend(stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        engines = wait_ready(proc, lines, reader)
        if fault.after_first_batch:
            while not any(BATCH_LINE.search(line) for line in list(lines)):
                run_ended(proc, lines, reader, "before its first batch")
                time.sleep(0.05)
        (e0, port0), (e1, port1) = engines
        while fault.turn_on_e0:
            stats = httpx.get(f"http://127.0.0.1:{port0}/stats", timeout=5).json()
            if stats["running"] + stats["queued"] > 0:
                break
            time.sleep(0.02)
        command = fault.command.format(run=proc.pid, e0=e0, e1=e1, port0=port0, port1=port1)
        subprocess.run(["bash", "-c", command], check=False, capture_output=True)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(5)
    if not out.exists():
        raise RuntimeError(f"{fault.name}: exit {code}, no report:\n{''.join(lines[-30:])}")
    report = json.loads(out.read_text())
    noticed = [e["t"] for e in report["engine_events"] if e["state"] == "unhealthy"]
    noticed += [u["t"] for u in report["update_log"] if u["phase"] == "failed"]
    at = min(noticed) if noticed else None
    after = None if at is None else sum(1 for m in report["batch_marks"] if m["delivered_s"] > at)
    return {
        "fault": fault.name,
        "command": fault.command.replace("{{", "{").replace("}}", "}"),
        "exit_code": code,
        "noticed_at_s": at,
        "batches": report["batches"],
        "batches_after_fault": after,
        "lost_groups": report["lost_groups"],
        "failed_groups": report["discarded_groups"]["failed"],
        "turn_retries": report["turn_retries"],
        "engine_restarts": report["engine_restarts"],
        "update_failures": [u.get("error") for u in report["update_log"] if u["phase"] == "failed"],
        "stop": report["stop"],
        "traceback": any("Traceback" in line for line in lines),
    }


def startup_stop_s(tmp: Path) -> float:
    """Seconds from Ctrl-C (SIGINT to the run's process group), sent while the engines are starting,
    to `corral run` exiting with its report."""
    config = tmp / "run.yaml"
    config.write_text(CONFIG)
    out = tmp / "startup.json"
    argv = [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(config),
            "--batches", "3", "--json", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        argv, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while len(engines_of(proc.pid)) < 2:
            time.sleep(0.05)
        time.sleep(0.5)
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    report = json.loads(out.read_text())
    if code != 0 or report["batches"] != 0 or report["stop"]["phase"] != "startup":
        raise RuntimeError(f"unexpected stop during start-up: exit {code}, {report['stop']}")
    return took


def main(argv: list[str] | None = None) -> None:
    from benchmarks import ScriptParser, check_outputs, save_json  # as a script (-m), it is importable

    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int_between(1, MAX_RUN_BATCHES), default=6)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default="", help="run only the faults whose name contains this")
    parser.add_argument(
        "--startup-stops", type=int_between(0, 1000), default=0, help="also time N Ctrl-Cs during start-up"
    )
    args = parser.parse_args(argv)

    check_outputs(json=args.json)
    rows = []
    with tempfile.TemporaryDirectory(prefix="corral-faults-") as tmp:
        if args.startup_stops:
            took = [startup_stop_s(Path(tmp)) for _ in range(args.startup_stops)]
            print(f"Ctrl-C during start-up, seconds to exit with the report: {[round(t, 2) for t in took]}, "
                  f"median {statistics.median(took):.2f}")  # fmt: skip
        for fault in FAULTS:
            if args.only not in fault.name:
                continue
            row = run_fault(fault, args.batches, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print()
    print("| fault | command | exit | batches | batches after it | groups lost | groups failed |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        after = "(run stopped)" if row["stop"] else row["batches_after_fault"]
        print(f"| {row['fault']} | `{row['command']}` | {row['exit_code']} | {row['batches']} | {after} | "
              f"{row['lost_groups']} | {row['failed_groups']} |")  # fmt: skip
    if args.json is not None:
        save_json(args.json, rows)


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
