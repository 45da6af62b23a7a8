"""A real `corral run` in its own process group, watched from outside: its stderr lines, every process
it starts (found in /proc, remembered by pid and start time), its engines' ports. For the fault and
signal tests (tests/runtime/test_faults.py, tests/runtime/test_signals.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from terminal_proc import OnTerminal

# Small and fast: 2 engines, B = 2 groups of G = 2, quick built-in tasks, short trainer steps.
FAST_CONFIG = """
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


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time in clock ticks, state) of `pid`, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                kids.setdefault(stat[0], []).append(int(entry))
    return kids


def _catches(pid: int, sig: int) -> bool:
    """Does process `pid` have a handler of its own for `sig` (its SigCgt mask in /proc)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"non-finite number {name} in the report")

    return json.loads(text, parse_constant=refuse)


@dataclass
class CorralRun:
    """`corral run` started in a new session, so `os.killpg(pid, SIGINT)` is a terminal's Ctrl-C."""

    tmp: Path
    args: list[str]
    config: str = FAST_CONFIG
    env: dict[str, str] = field(default_factory=dict)
    lines: list[tuple[float, str]] = field(default_factory=list)
    seen: dict[int, tuple[int, str]] = field(default_factory=dict)  # pid -> (start time, cmdline)
    proc: subprocess.Popen[str] | None = None
    started: float = 0.0
    # On a terminal of its own (a pseudo-terminal it controls, stdin, stdout and stderr on it), as in a
    # terminal window: `hang_up` then closes the window.
    terminal: bool = False

    def __post_init__(self) -> None:
        self.report_path = self.tmp / "report.json"
        config = self.tmp / "run.yaml"
        config.write_text(self.config)
        argv = [sys.executable, "-c", "from app.cli import main; main()", "run", "--config", str(config),
                "--json", str(self.report_path), *self.args]  # fmt: skip
        self.started = time.monotonic()
        env = {**os.environ, **self.env}
        self._done = threading.Event()
        if self.terminal:
            self._window = OnTerminal(argv, env=env)
            self.proc = self._window.proc  # type: ignore[assignment]
            self.lines = self._window.lines  # read by the window
        else:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env=env,
            )
            threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def wait_holding(self, timeout_s: float = 30.0) -> float:
        """Wait until the entry point holds stop signals (`early_signals.hold`, Corral's first line: it
        catches SIGTERM, which Python does not) and return when that was seen. Before it a Ctrl-C lands
        in the interpreter's own start-up (Python's "Fatal Python error: init_import_site", not
        Corral's), which takes well over 0.1 s on a loaded machine."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if _catches(self.pid, signal.SIGTERM):
                return time.monotonic()
            assert self.proc is not None
            assert self.proc.poll() is None, "corral ended before it held stop signals"
            time.sleep(0.002)
        raise AssertionError(f"corral did not hold stop signals within {timeout_s:.0f} s")

    def hang_up(self) -> None:
        """Close the run's terminal window (app.terminal): SIGHUP to its process group."""
        self._window.hang_up()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stderr is not None
        with self.proc.stderr:
            for line in self.proc.stderr:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    def _watch(self) -> None:
        while not self._done.is_set():
            self.scan()
            time.sleep(0.05)

    def scan(self) -> None:
        """Remember every live descendant of the run."""
        kids = _children()
        todo = list(kids.get(self.pid, []))
        while todo:
            pid = todo.pop()
            stat = _stat(pid)
            if stat is not None and self.seen.get(pid, (stat[1], ""))[0] == stat[1]:
                # Read again each time: a child seen between fork and exec shows its parent's cmdline.
                self.seen[pid] = (stat[1], _cmdline(pid) or self.seen.get(pid, (0, ""))[1])
            todo.extend(kids.get(pid, []))

    # -- waiting ----------------------------------------------------------------------------------

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_line(self, pattern: str | re.Pattern[str], timeout_s: float = 60.0, count: int = 1) -> None:
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for _, line in list(self.lines) if regex.search(line)) >= count:
                return
            assert self.proc is not None
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader catch up, then give up
                if sum(1 for _, line in list(self.lines) if regex.search(line)) >= count:
                    return
                raise AssertionError(f"run ended before {regex.pattern!r}:\n{self.text()}")
            time.sleep(0.05)
        raise AssertionError(f"no {regex.pattern!r} within {timeout_s}s:\n{self.text()}")

    def engine_pids(self, timeout_s: float = 30.0, count: int = 2) -> list[int]:
        """The engine server processes (children of the run), in start order."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.scan()
            pids = sorted(
                (pid for pid, (_, cmd) in self.seen.items() if "app.engines.embedded" in cmd and _stat(pid)),
                # start time, then pid: engines spawned within one clock tick (10 ms) tie on start time,
                # and `scan` meets them in reverse; the run spawns them in order, so pids break the tie
                key=lambda pid: (self.seen[pid][0], pid),
            )
            if len(pids) >= count:
                return pids[-count:]
            time.sleep(0.05)
        raise AssertionError(f"fewer than {count} engines within {timeout_s}s:\n{self.text()}")

    def engine_port(self, pid: int) -> int:
        words = _cmdline(pid).split()
        return int(words[words.index("--port") + 1])

    def wait_engines_ready(self, timeout_s: float = 60.0) -> list[int]:
        pids = self.engine_pids()
        deadline = time.monotonic() + timeout_s
        for pid in pids:
            url = f"http://127.0.0.1:{self.engine_port(pid)}/health"
            while True:
                try:
                    if httpx.get(url, timeout=1.0).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"engine {pid} not ready:\n{self.text()}"
                time.sleep(0.05)
        return pids

    def wait_turn_in_flight(self, pid: int, timeout_s: float = 60.0) -> None:
        """Until engine `pid` has a turn running or queued (the run is past its start-up)."""
        url = f"http://127.0.0.1:{self.engine_port(pid)}/stats"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = httpx.get(url, timeout=5).json()
            if stats["running"] + stats["queued"] > 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"no turn on engine {pid} within {timeout_s}s:\n{self.text()}")

    # -- ending ---------------------------------------------------------------------------------------

    def ctrl_c(self) -> None:
        """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
        os.killpg(self.pid, signal.SIGINT)

    def finish(self, timeout_s: float = 90.0) -> dict[str, Any]:
        """Wait for the run to exit 0 without a traceback; return its report (strict JSON)."""
        assert self.proc is not None
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self._done.set()
        time.sleep(0.1)  # the reader thread drains the pipe
        out = self.text()
        assert code == 0, f"exit {code}:\n{out}"
        assert "Traceback" not in out, out
        report = _strict_json(self.report_path.read_text())
        assert report["lost_groups"] == 0, out
        assert report["admitted_groups"] == report["delivered_groups"] + sum(
            report["discarded_groups"].values()
        ), out
        return dict(report)

    def leftovers(self, timeout_s: float = 15.0) -> list[str]:
        """Processes the run started that are still alive (same pid and start time), after a grace
        period for what the run's exit orphaned to be reaped."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = []
            for pid, (start, cmd) in self.seen.items():
                stat = _stat(pid)
                if stat is not None and stat[1] == start and stat[2] != "Z":
                    alive.append(f"{pid} {cmd}")
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)

    def kill(self) -> None:
        """Test cleanup: SIGKILL the run's group and every descendant seen."""
        self._done.set()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()
        for pid, (start, _) in self.seen.items():
            stat = _stat(pid)
            if stat is not None and stat[1] == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def engine_events(report: dict[str, Any], engine: str) -> list[str]:
    return [e["state"] for e in report["engine_events"] if e["engine"] == engine]


def is_finite_number(x: object) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)
