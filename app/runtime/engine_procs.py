"""Embedded engine servers as child processes of `corral run`.

Invariant: every engine process started here is stopped (by PID) when the run ends, however it ends.
"""

from __future__ import annotations

import asyncio
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from app.engines.vllm import VLLMEngine
from app.runtime.config import EnginesConfig, LocalRunError


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies, even by SIGKILL, so no engine is
    orphaned (Linux prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class EngineProcesses:
    """Embedded engine servers as child processes; always stopped by PID on exit."""

    def __init__(self, config: EnginesConfig, cpus: Sequence[int], log_dir: Path) -> None:
        self.config = config
        self.cpus = list(cpus)
        self.log_dir = log_dir
        self.procs: list[tuple[subprocess.Popen[bytes], int, Path]] = []

    def start(self) -> None:
        for i in range(self.config.count):
            port = _free_port()
            log = self.log_dir / f"engine-{i}.log"
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
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
                )
            self.procs.append((proc, port, log))

    async def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            for proc, port, log in self.procs:
                while True:
                    if proc.poll() is not None:
                        tail = log.read_text(errors="replace")[-800:]
                        raise LocalRunError(f"engine on port {port} exited with {proc.returncode}:\n{tail}")
                    try:
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise LocalRunError(
                            f"engine on port {port} not healthy after {self.config.startup_timeout_s}s"
                        )
                    await asyncio.sleep(0.2)

    def clients(self) -> list[VLLMEngine]:
        return [
            VLLMEngine(f"engine-{i}", f"http://127.0.0.1:{port}", "corral-embedded", timeout_s=300.0)
            for i, (_, port, _) in enumerate(self.procs)
        ]

    def stop(self) -> None:
        for proc, _, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _, _ in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
