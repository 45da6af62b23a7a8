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
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from app.agent.loop import ShellAgent, ShellAgentConfig
from app.core.config import PolicyConfig
from app.lanes.inprocess import InProcessLanes
from app.runtime.config import LocalRunConfig, LocalRunError, load_config
from app.runtime.driver import Runtime
from app.runtime.engine_procs import EngineProcesses
from app.runtime.report import ReportStatic, build_report
from app.runtime.task_source import TaskSource, load_tasks
from app.runtime.trainer import SentinelTrainer
from app.sandboxes.local import LocalSandboxFactory
from app.tasks.spec import TaskSpec

__all__ = ["LocalRunError", "load_config", "run_local"]


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
    tasks = load_tasks(config.tasks)
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
        os.chmod(tmp, 0o711)  # sandbox uids must traverse it to reach their own work directories
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
                timeline=True,
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
    report = build_report(runtime.report_acc, ReportStatic(name, time.perf_counter() - wall))
    report["policy_config"] = policy.model_dump(mode="json")
    report["engine_versions_at_end"] = versions
    report["update_log"] = [
        {"t": round(t - state.started_at, 3), "engine": e, "version": v, "phase": p}
        for t, e, v, p in state.update_log
    ]
    report["stopped_early"] = runtime.stop_requested
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
