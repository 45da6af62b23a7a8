"""`corral run`: the production runtime on the real clock, with real engines, sandboxes and tasks.

The embedded default on one machine: embedded torch engines (separate processes, pinned to the serving
CPUs when lanes are pinned), local sandboxes whose lanes are pinned to the other CPUs, the built-in
task suite and the shell agent. The trainer here publishes a new sentinel-weights version every step,
so rolling publication is exercised for real; the GRPO training loop replaces it later.

Invariants: every engine process this module starts is stopped (by PID) when the run ends, however it
ends; every sandbox is cleaned up by the runtime.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.console import Console

from app.agent.loop import ShellAgent, ShellAgentConfig
from app.core.config import LanesConfig, PolicyConfig
from app.engines.embedded.weights import save_sentinel
from app.engines.vllm import VLLMEngine
from app.lanes.inprocess import InProcessLanes
from app.runtime.context import Agent
from app.runtime.driver import Runtime
from app.runtime.ports import TrainingBatch
from app.runtime.report import build_report
from app.runtime.timeline import batch_marks, group_timeline
from app.sandboxes.base import Sandbox
from app.sandboxes.local import LocalSandboxFactory
from app.tasks.loader import TaskError, builtin_suite_path, load_suite
from app.tasks.spec import TaskSpec


class LocalRunError(RuntimeError):
    """The run cannot start or went wrong in a way the operator must fix; the message says what."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    groups: int = Field(4, ge=1, description="B")
    group_size: int = Field(4, ge=2, description="G")


class PolicyKnobs(_Strict):
    surplus_groups: int = Field(2, ge=0, description="S")
    max_staleness: int = Field(2, ge=0, description="K")
    max_updating_engines: int = Field(1, ge=1)


class EnginesConfig(_Strict):
    count: int = Field(2, ge=1, description="embedded engine processes")
    cpus: list[int] = Field(default_factory=lambda: [0], description="serving CPU set (pinned policies)")
    slots: int = Field(8, ge=1, description="concurrent turns per engine")
    layers: int = Field(2, ge=1)
    hidden: int = Field(64, ge=8)
    max_tokens: int = Field(32, ge=1, description="tokens generated per turn (real CPU work)")
    sentinel: bool = Field(True, description="weight updates swap only a marker tensor")
    startup_timeout_s: float = Field(60.0, gt=0)


class LocalLanesConfig(_Strict):
    cpus: list[int] = Field(default_factory=lambda: [1], description="CPU set of the sandbox lanes")
    reset: int = Field(2, ge=1)
    exec: int = Field(2, ge=1)
    validate_: int = Field(1, ge=1, alias="validate")
    cleanup: int = Field(1, ge=1)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class TrainerConfig(_Strict):
    step_s: float = Field(1.0, ge=0, description="seconds per (sentinel) trainer step")


class TasksConfig(_Strict):
    suite: str = Field("builtin", description="'builtin' or a directory of task directories")
    include: list[str] = Field(default_factory=list, description="task names to use; empty: all")


class SandboxConfig(_Strict):
    isolation: str = Field("auto", pattern="^(auto|bwrap|none)$")
    base_dir: str | None = Field(None, description="where work directories go; default: a temp dir")


class LocalRunConfig(_Strict):
    seed: int = 0
    batches: int = Field(3, ge=1, description="trainer steps when neither --batches nor --duration is given")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    policy: PolicyKnobs = Field(default_factory=PolicyKnobs)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    lanes: LocalLanesConfig = Field(default_factory=LocalLanesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    def lane_config(self) -> LanesConfig:
        """The four lanes, all on `lanes.cpus`, kept off the serving CPUs (validated by the core)."""
        cpus = tuple(self.lanes.cpus)
        return LanesConfig.model_validate(
            {
                "reset": {"slots": self.lanes.reset, "cpus": cpus},
                "exec": {"slots": self.lanes.exec, "cpus": cpus},
                "validate": {"slots": self.lanes.validate_, "cpus": cpus},
                "cleanup": {"slots": self.lanes.cleanup, "cpus": cpus},
                "serving_cpus": tuple(self.engines.cpus),
            }
        )

    @model_validator(mode="after")
    def _cpus_usable(self) -> LocalRunConfig:
        try:
            self.lane_config()
        except ValidationError as exc:
            raise ValueError(f"engines.cpus / lanes.cpus: {exc.errors()[0]['msg']}") from None
        available = os.sched_getaffinity(0)
        for name, cpus in (("engines.cpus", self.engines.cpus), ("lanes.cpus", self.lanes.cpus)):
            if not cpus:
                raise ValueError(f"{name} must list at least one CPU")
            missing = sorted(set(cpus) - available)
            if missing:
                raise ValueError(f"{name}: CPUs {missing} are not available here (have {sorted(available)})")
        return self


def load_config(path: Path) -> LocalRunConfig:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise LocalRunError(f"cannot read run config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise LocalRunError(f"{path}: not valid YAML: {exc}") from None
    try:
        return LocalRunConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise LocalRunError(f"{path}: {problems}") from None


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


class SentinelTrainer:
    """Publishes a new sentinel-weights directory each step (the write-up's rollout-mechanism test)."""

    def __init__(self, step_s: float, weights_dir: Path) -> None:
        self.step_s = step_s
        self.weights_dir = weights_dir
        self.rewards: list[float] = []

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        self.rewards.extend(r for g in batch.batch.groups for r in g.rewards)
        await asyncio.sleep(self.step_s)
        path = self.weights_dir / f"v{version}"
        await asyncio.to_thread(save_sentinel, path, float(version))
        return str(path)


class TaskSource:
    """Group n works on a task drawn by a seeded shuffle of the suite; each attempt gets its own sandbox."""

    def __init__(
        self, tasks: Sequence[TaskSpec], factory: LocalSandboxFactory, agent: Agent, seed: int
    ) -> None:
        self.tasks = list(tasks)
        self.factory = factory
        self.agent = agent
        self.seed = seed

    def task_for(self, task_index: int) -> TaskSpec:
        rng = random.Random(f"{self.seed}:{task_index}")
        return self.tasks[rng.randrange(len(self.tasks))]

    def make_attempt(
        self, group_id: int, task_index: int, attempt: int
    ) -> tuple[Agent, TaskSpec | None, Sandbox]:
        return (
            self.agent,
            self.task_for(task_index),
            self.factory.create(f"g{group_id}a{attempt}-{time.monotonic_ns()}"),
        )


def _tasks(config: TasksConfig) -> list[TaskSpec]:
    path = builtin_suite_path() if config.suite == "builtin" else Path(config.suite)
    try:
        suite = load_suite(path)
    except TaskError as exc:
        raise LocalRunError(str(exc)) from None
    if config.include:
        known = {t.name for t in suite}
        unknown = sorted(set(config.include) - known)
        if unknown:
            raise LocalRunError(f"tasks.include: unknown tasks {unknown}; the suite has {sorted(known)}")
        suite = [t for t in suite if t.name in config.include]
    if not suite:
        raise LocalRunError(f"no tasks in {path}")
    return suite


def run_local(
    config_path: Path,
    policy_name: str,
    duration_s: float | None = None,
    batches: int | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    config = load_config(config_path)
    policy = PolicyConfig.ladder(
        policy_name,
        groups_per_batch=config.batch.groups,
        group_size=config.batch.group_size,
        surplus_groups=config.policy.surplus_groups,
        max_staleness=config.policy.max_staleness,
        max_updating_engines=config.policy.max_updating_engines,
    )
    if duration_s is None and batches is None:
        batches = config.batches
    tasks = _tasks(config.tasks)
    return asyncio.run(_run(config, policy, policy_name, tasks, duration_s, batches, console))


async def _run(
    config: LocalRunConfig,
    policy: PolicyConfig,
    name: str,
    tasks: list[TaskSpec],
    duration_s: float | None,
    batches: int | None,
    console: Console | None,
) -> dict[str, Any]:
    wall = time.perf_counter()
    all_cpus = sorted(os.sched_getaffinity(0))
    serving_cpus = config.engines.cpus if policy.pinned_lanes else all_cpus
    lane_cpus = tuple(config.lanes.cpus)
    with tempfile.TemporaryDirectory(prefix="corral-run-") as tmp:
        work = Path(config.sandbox.base_dir) if config.sandbox.base_dir else Path(tmp) / "sandboxes"
        work.mkdir(parents=True, exist_ok=True)
        weights = Path(tmp) / "weights"
        engines = EngineProcesses(config.engines, serving_cpus, Path(tmp))
        try:
            engines.start()
            await engines.wait_healthy()
            clients = engines.clients()
            lanes = InProcessLanes.from_config(config.lane_config(), policy.pinned_lanes)
            factory = LocalSandboxFactory(work, isolation=config.sandbox.isolation)  # type: ignore[arg-type]
            agent = ShellAgent(ShellAgentConfig(max_tokens=config.engines.max_tokens))
            trainer = SentinelTrainer(config.trainer.step_s, weights)

            def on_event(kind: str, data: dict[str, object]) -> None:
                if console is not None and kind in {"batch", "engine_updated", "group_discarded"}:
                    console.print(f"[{time.perf_counter() - wall:7.1f}s] {kind} {data}", highlight=False)

            runtime = Runtime(
                policy=policy,
                engines=clients,
                engine_slots=config.engines.slots,
                lanes=lanes,
                source=TaskSource(tasks, factory, agent, config.seed),
                trainer=trainer,
                on_event=on_event,
            )
            loop = asyncio.get_running_loop()

            def stop_on_signal() -> None:
                if console is not None:
                    console.print("stopping: finishing the current step, cleaning up, writing the report")
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)  # a second signal stops at once
                runtime.request_stop()

            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop_on_signal)
            # The control plane (this thread: routing turns, forking sandbox commands that pin
            # themselves to the lanes) stays on the serving CPUs, off the lanes' CPUs, as in
            # benchmarks/lane_isolation.py.
            os.sched_setaffinity(0, serving_cpus)
            try:
                state = await runtime.run(batches=batches, duration_s=duration_s)
                versions = {c.name: await c.weight_version() for c in clients}
            finally:
                os.sched_setaffinity(0, all_cpus)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
                for client in clients:
                    await client.aclose()
        finally:
            engines.stop()
    report = build_report(name, runtime.scheduler, state, lanes, None, time.perf_counter() - wall)
    report["policy_config"] = policy.model_dump(mode="json")
    report["engine_versions_at_end"] = versions
    report["update_log"] = [
        {"t": round(t - state.started_at, 3), "engine": e, "version": v, "phase": p}
        for t, e, v, p in state.update_log
    ]
    report["stopped_early"] = runtime.stop_requested
    report["groups_timeline"] = group_timeline(runtime.scheduler, state)
    report["batch_marks"] = batch_marks(state)
    report["cpus"] = {
        "serving": list(serving_cpus),
        "lanes": list(lane_cpus) if policy.pinned_lanes else None,
    }
    report["sandbox_isolation"] = getattr(factory, "isolation", None)
    report["turn_latency_s"] = _turn_latency(state)
    return report


def _turn_latency(state: Any) -> dict[str, float]:
    busy = sum(e.busy_s for e in state.engines.values())
    turns = sum(e.turns for e in state.engines.values())
    return {"mean": round(busy / turns, 4) if turns else 0.0}
