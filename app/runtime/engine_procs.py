"""Embedded engine servers as child processes of `corral run` (or of a local run in `corral serve`), and
their restarts.

Invariants:
- every engine process runs in its own session (so a terminal's Ctrl-C, sent to the run's process
  group, does not reach it: the run owns its shutdown) and gets SIGTERM if the run dies, even by
  SIGKILL (PR_SET_PDEATHSIG);
- every engine process started here, and every process in its process group, is stopped (by process
  group id) when the run ends, however it ends, and before a restart replaces it;
- `restart` is the runtime's `EngineSupervisor`: it starts a fresh process on a fresh port and returns
  a fresh client only once the engine answers its health check;
- with `exits_at_start_ok`, an engine that dies before it first answers does not fail the start-up:
  `wait_healthy` returns without it and names it in `exited_at_start`, for the runtime to restart.

Test-only: with `CORRAL_ENGINE_DEBUG=1`, the engines named in `CORRAL_ENGINE_DEBUG_FAIL_START` (a comma
list, `*` for all) exit at every start instead of serving (docs/faults.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from app.children import die_with_parent, signal_name
from app.engines.vllm import VLLMEngine
from app.runtime.config import EnginesConfig, LocalRunError
from app.runtime.engine_pool import EngineFaultConfig

_STOP_GRACE_S = 10.0
# How long `exit_status` waits for a process the kernel is ending (PF_EXITING) to be done
EXITING_WAIT_S = 0.5
_PF_EXITING = 0x4  # the kernel's flag on a task in do_exit (linux/sched.h), in /proc/<pid>/stat


def _exiting(pid: int) -> bool:
    """Whether the kernel is ending process `pid` (killed, its files closing) and it is not yet a zombie
    that can be waited for: its flags in /proc/<pid>/stat (field 9) hold PF_EXITING."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    try:
        return bool(int(fields[6]) & _PF_EXITING)  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return False


TURN_TIMEOUT_S = 300.0
DEBUG_FLAG = "CORRAL_ENGINE_DEBUG"
DEBUG_FAIL_START = "CORRAL_ENGINE_DEBUG_FAIL_START"


def fault_config(engines: EnginesConfig) -> EngineFaultConfig:
    """How the runtime supervises these engines (`corral run`'s and a local service run's)."""
    return EngineFaultConfig(
        update_timeout_s=engines.update_timeout_s,
        health_timeout_s=engines.health_timeout_s,
        health_interval_s=engines.health_interval_s,
        health_misses=engines.health_misses,
        restart_backoff_s=engines.restart_backoff_s,
        restart_backoff_max_s=engines.restart_backoff_max_s,
        turn_retries=engines.turn_retries,
        max_restarts=engines.max_restarts,
    )


def _fails_on_purpose(name: str) -> bool:
    """Test-only: should engine `name` exit at every start (see the module docstring)?"""
    if os.environ.get(DEBUG_FLAG) != "1":
        return False
    names = os.environ.get(DEBUG_FAIL_START, "").split(",")
    return name in names or "*" in names


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@dataclass
class EngineProcess:
    name: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    starts: int = 1
    log_from: int = 0  # where this start's output begins in `log` (a restart appends to it)

    def last_said(self, most: int = 300) -> str:
        """The last line this start of the engine wrote (a traceback's last line names the error), cut to
        `most` characters; "" when it wrote nothing."""
        try:
            with self.log.open("rb") as f:
                f.seek(self.log_from)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        last = lines[-1] if lines else ""
        return last if len(last) <= most else last[: most - 1] + "…"

    @property
    def pid(self) -> int:
        return self.proc.pid


class EngineProcesses:
    """Embedded engine servers as child processes; each in its own session, stopped by process group."""

    def __init__(
        self, config: EnginesConfig, cpus: Sequence[int], log_dir: Path, *, exits_at_start_ok: bool = False
    ) -> None:
        self.config = config
        self.cpus = list(cpus)
        self.log_dir = log_dir
        self.engines: dict[str, EngineProcess] = {}
        self.exits_at_start_ok = exits_at_start_ok
        self.exited_at_start: dict[str, str] = {}  # engine -> how it died before it first answered

    def _spawn(self, name: str, port: int, log: Path) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "app.engines.embedded",
            "--port", str(port),
            "--cpus", ",".join(str(c) for c in self.cpus),
            "--layers", str(self.config.layers),
            "--hidden", str(self.config.hidden),
            "--seed", "0",
        ]  # fmt: skip
        if self.config.sentinel:
            argv.append("--sentinel")
        if _fails_on_purpose(name):
            argv = [
                sys.executable,
                "-c",
                f"raise SystemExit('{name}: start fails on purpose ({DEBUG_FAIL_START})')",
            ]
        with log.open("ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def start(self) -> None:
        """Start every engine (returns at once; `wait_healthy` waits for them)."""
        for i in range(self.config.count):
            name = f"engine-{i}"
            port = _free_port()
            log = self.log_dir / f"{name}.log"
            self.engines[name] = EngineProcess(name, port, log, self._spawn(name, port, log), 1, _size(log))

    async def _wait_one(
        self, engine: EngineProcess, client: httpx.AsyncClient, exit_ok: bool = False
    ) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            if engine.proc.poll() is not None:
                if exit_ok:
                    self.exited_at_start[engine.name] = (
                        f"exited with {engine.proc.returncode} during start-up"
                    )
                    return
                said = engine.last_said()
                raise LocalRunError(
                    f"{engine.name} (port {engine.port}) exited with {engine.proc.returncode}"
                    + (f": {said}" if said else "")
                )
            try:
                if (await client.get(f"http://127.0.0.1:{engine.port}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise LocalRunError(
                    f"{engine.name} (port {engine.port}) not healthy after {self.config.startup_timeout_s}s"
                )
            await asyncio.sleep(0.2)

    async def wait_healthy(self) -> None:
        """Wait for every engine to answer /health (or, with `exits_at_start_ok`, to die: see
        `exited_at_start`); `LocalRunError` names the first that did neither in time."""
        try:
            async with httpx.AsyncClient(timeout=2.0) as client, asyncio.TaskGroup() as tg:
                for engine in self.engines.values():
                    tg.create_task(self._wait_one(engine, client, self.exits_at_start_ok))
        except* LocalRunError as group:
            raise group.exceptions[0] from None

    def client(self, name: str) -> VLLMEngine:
        engine = self.engines[name]
        url = f"http://127.0.0.1:{engine.port}"
        return VLLMEngine(name, url, "corral-embedded", timeout_s=TURN_TIMEOUT_S)

    def clients(self) -> list[VLLMEngine]:
        return [self.client(name) for name in self.engines]

    async def restart(self, name: str) -> VLLMEngine:
        """Kill what is left of `name` (its whole process group), start it again on a fresh port and
        return a client once it is healthy. Raises `LocalRunError` if it does not come up."""
        engine = self.engines[name]
        await self._kill(engine)
        port = _free_port()
        with engine.log.open("ab") as out:
            out.write(f"\n--- corral run: restart {engine.starts} of {name} on port {port} ---\n".encode())
        begins = _size(engine.log)
        # Popen runs here, on the run's main thread, so that PDEATHSIG follows the run itself.
        proc = self._spawn(name, port, engine.log)
        fresh = EngineProcess(name, port, engine.log, proc, engine.starts + 1, begins)
        self.engines[name] = fresh
        try:
            async with httpx.AsyncClient(timeout=2.0) as client:
                await self._wait_one(fresh, client)
        except BaseException:
            await self._kill(fresh)
            raise
        return self.client(name)

    def exit_status(self, name: str) -> str | None:
        engine = self.engines.get(name)
        if engine is None:
            return None
        code = engine.proc.poll()
        if code is None and _exiting(engine.pid):
            # Killed and on its way out: its sockets close (the turn that saw it fail) before it can be
            # waited for, so a poll just then read it as running (a loaded CI machine did). It is done
            # within milliseconds.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = engine.proc.wait(EXITING_WAIT_S)
        if code is None:
            return None
        return f"exited with {code}" + (f" ({signal_name(code)})" if code < 0 else "")

    async def _kill(self, engine: EngineProcess) -> None:
        _signal_group(engine.pid, signal.SIGKILL)
        await asyncio.to_thread(engine.proc.wait)  # SIGKILL cannot be ignored: this returns promptly

    def pids(self) -> dict[str, int]:
        return {name: e.pid for name, e in self.engines.items()}

    def stop(self) -> None:
        """Stop every engine and its process group: SIGTERM, then SIGKILL after a grace period."""
        for engine in self.engines.values():
            if engine.proc.poll() is None:
                _signal_group(engine.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_S
        for engine in self.engines.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                engine.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            # Whatever is left in the group (the engine's own children) goes too.
            _signal_group(engine.pid, signal.SIGKILL)
            engine.proc.wait()

    def kill_now(self) -> None:
        """SIGKILL every engine's process group at once (a second Ctrl-C while `stop` waits)."""
        for engine in self.engines.values():
            _signal_group(engine.pid, signal.SIGKILL)

    @property
    def procs(self) -> list[tuple[subprocess.Popen[bytes], int, Path]]:
        """(process, port, log) per engine, in engine order (what start-up progress reads)."""
        return [(e.proc, e.port, e.log) for e in self.engines.values()]
