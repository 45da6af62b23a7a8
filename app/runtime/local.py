"""`corral run`: the production runtime on the real clock, with real engines, sandboxes and tasks.

The embedded default on one machine: embedded torch engines (separate processes, pinned to the serving
CPUs when lanes are pinned), local sandboxes whose lanes are pinned to the other CPUs, the built-in
task suite and the shell agent. The trainer here publishes a new sentinel-weights version every step,
so rolling publication is exercised for real; the GRPO training loop replaces it later.

Stopping (SIGINT from a terminal's Ctrl-C, SIGTERM, or SIGHUP when the terminal goes away): the first
signal ends the run after the current trainer step (during start-up: at once); a second one stops at
once. Either way the report is written and says where the stop landed (`stop`). After a hangup, what
would have gone to the lost terminal goes to /dev/null (a write there fails, which would end the
shutdown before the report is written). A SIGHUP ignored at start (`nohup`) stays ignored. Engines
and sandbox commands run in their own sessions, so a Ctrl-C sent to the terminal's process group
reaches only this process, which owns their shutdown.

Invariants: every engine process this module starts is stopped (by process group) when the run ends,
however it ends; every sandbox is cleaned up by the runtime; a run that is stopped still returns a
report, with `lost_groups` 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console

from app import early_signals, terminal
from app.agent.loop import ShellAgent, ShellAgentConfig
from app.core.config import PolicyConfig
from app.core.events import Envelope
from app.lanes.adaptive import lane_adapter
from app.lanes.inprocess import InProcessLanes
from app.runtime.config import LocalRunConfig, LocalRunError, load_config
from app.runtime.driver import RunState, Runtime, cannot_proceed, without_event_records
from app.runtime.driver import log as runtime_log
from app.runtime.engine_procs import EngineProcesses, fault_config
from app.runtime.progress import RunProgress
from app.runtime.report import ReportStatic, build_report
from app.runtime.task_source import TaskSource, load_tasks
from app.runtime.trainer import SentinelTrainer
from app.sandboxes import leftovers
from app.sandboxes.cpushare import ShareError
from app.sandboxes.limits import SandboxLimitError
from app.sandboxes.local import LocalSandboxFactory, SandboxError
from app.sandboxes.timelimits import TimeLimits
from app.tasks.spec import TaskSpec

if TYPE_CHECKING:
    from app.sandboxes.docker import DockerSandboxFactory

__all__ = ["LocalRunError", "load_config", "run_local"]

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_VERSION_QUERY_S = 5.0
# The runtime's logger in `corral run`: its progress lines say engines' states, so it drops the records
# that say them again (`without_event_records`); without a console it is the runtime's own
RUN_LOG = logging.getLogger("app.runtime.local.run")
_PRINTED = {"batch", "engine_updated", "group_discarded", "engine_state", "engine_update_failed"}


class _StopSignals:
    """Counts stop signals and acts on them: the first asks for a stop after the current step (or
    cancels start-up), the second cancels the run at once. Later ones are only acknowledged."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.count = 0
        self.first_at: float | None = None
        self.phase_at_first = "startup"
        self.updating_at_first: list[str] = []
        self.runtime: Runtime | None = None
        self.task: asyncio.Future[Any] | None = None  # what a stop cancels: start-up, then the run
        self.engines: EngineProcesses | None = None
        self.shutting_down = False  # the engines are being stopped: a second signal kills them
        self.hung_up = False
        self._terminal_fds = terminal.terminal_fds()  # where the terminal is, told before it can hang up

    def early(self, signum: int, frame: FrameType | None) -> None:
        """Before the event loop runs: remember the signal; start-up then ends at once."""
        self.on_signal(signum)

    def on_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP and not self.hung_up:
            self.hung_up = True
            terminal.detach(self._terminal_fds)  # app.terminal: else the next line would fail the run
        self.fire()

    def fire(self) -> None:
        self.count += 1
        runtime = self.runtime
        if self.count == 1:
            self.first_at = time.monotonic()
            if runtime is not None:
                self.phase_at_first = runtime.phase
                self.updating_at_first = sorted(runtime.plan.updating)
        if runtime is None or runtime.phase == "startup":
            if self.count == 1:  # a second press said this line again
                self.say("stopping: start-up abandoned, stopping the engines, writing the report")
            else:
                self.say("already stopping; the report is on its way")
            if self.task is not None:
                self.task.cancel()
        elif self.count == 1:
            self.say(
                "stopping: finishing the current step, cleaning up, writing the report "
                "(Ctrl-C again to stop at once)"
            )
            runtime.request_stop()
        elif self.count == 2:
            self.say("stopping at once: cancelling every attempt, cleaning up, writing the report")
            if self.task is not None:
                self.task.cancel()
        else:
            self.say("already stopping; the report is on its way")
        if self.count >= 2 and self.shutting_down and self.engines is not None:
            self.engines.kill_now()  # no grace period for the engines either

    def report(self) -> dict[str, Any] | None:
        if self.count == 0:
            return None
        return {
            "signals": self.count,
            "phase": self.phase_at_first,
            "engines_updating": self.updating_at_first,
            "forced": self.count >= 2,
            "hung_up": self.hung_up,  # SIGHUP: the terminal went away, its output went to /dev/null
        }


def _stop_signals() -> list[signal.Signals]:
    """The stop signals this process acts on: all but one it ignores (SIGHUP under `nohup`)."""
    return [sig for sig in _STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN]


def run_local(
    config_path: Path,
    policy_name: str,
    duration_s: float | None = None,
    batches: int | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    def say(text: str) -> None:
        if console is not None:
            console.print(text, highlight=False, markup=False)

    stop = _StopSignals(say)
    previous = {sig: signal.signal(sig, stop.early) for sig in _stop_signals()}
    for _ in early_signals.take():  # a Ctrl-C while corral was still loading stops the start-up too
        stop.fire()
    if early_signals.is_command_process():
        leftovers.declare_owner()  # remove what a killed earlier run left (logged); track our own
    try:
        config = load_config(config_path)
        policy = PolicyConfig.ladder(policy_name, **config.policy_settings())
        if duration_s is None and batches is None:
            batches = config.batches
        tasks = load_tasks(config.tasks)
        return asyncio.run(_run(config, policy, policy_name, tasks, duration_s, batches, console, stop))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _run(
    config: LocalRunConfig,
    policy: PolicyConfig,
    name: str,
    tasks: list[TaskSpec],
    duration_s: float | None,
    batches: int | None,
    console: Console | None,
    stop: _StopSignals,
) -> dict[str, Any]:
    wall = time.perf_counter()
    loop = asyncio.get_running_loop()
    taken = _stop_signals()
    for sig in taken:
        loop.add_signal_handler(sig, stop.on_signal, sig)
    all_cpus = sorted(os.sched_getaffinity(0))
    serving_cpus = config.engines.cpus if policy.pinned_lanes else all_cpus
    lane_cpus = tuple(config.lanes.cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="corral-run-") as tmp:
            os.chmod(tmp, 0o711)  # sandbox uids must traverse it to reach their own work directories
            owner = leftovers.current()
            if owner is not None:  # if this process is killed, the next start removes the directory
                owner.add_dir(Path(tmp))
            work = Path(config.sandbox.base_dir) if config.sandbox.base_dir else Path(tmp) / "sandboxes"
            work.mkdir(parents=True, exist_ok=True)
            weights = Path(tmp) / "weights"
            # An engine that dies before it first answers is restarted by the runtime, as later.
            engines = EngineProcesses(config.engines, serving_cpus, Path(tmp), exits_at_start_ok=True)
            stop.engines = engines
            lanes = InProcessLanes.from_config(config.lane_config(), policy.pinned_lanes)
            factory = await make_sandbox_factory(config, policy, work)
            agent = ShellAgent(ShellAgentConfig(max_tokens=config.engines.max_tokens))
            trainer = SentinelTrainer(config.trainer.step_s, weights)

            progress = RunProgress(console, batches)
            event_log = EventLog()

            source = TaskSource(tasks, factory, agent, config.seed)
            runtime: Runtime | None = None
            try:
                if not stop.count:  # else it said "start-up abandoned" already: no "starting" after it
                    pinned, niced = policy.pinned_lanes, lanes.cpu_priority
                    progress.starting(config, serving_cpus, pinned_lanes=pinned, cpu_priority=niced)
                engines.start()  # returns at once; a stop during start-up stops them again
                runtime = Runtime(
                    policy=policy,
                    engines=engines.clients(),
                    engine_slots=config.engines.slots,
                    lanes=lanes,
                    source=source,
                    trainer=trainer,
                    faults=fault_config(config.engines),
                    supervisor=engines,
                    timeline=True,
                    lane_adapter=lane_adapter(policy.adaptive_lanes, lanes, lane_cpus),
                    weights_from_disk=True,  # embedded engines, through the vLLM client
                    # the progress lines show engines' states: their log records would say them twice
                    logger=without_event_records(RUN_LOG) if console is not None else runtime_log,
                )
                stop.runtime = runtime
                trainer.stopping = lambda: runtime is not None and runtime.stop_requested
                runtime.bus.observe(progress.on_envelope, "progress")
                runtime.bus.subscribe(event_log.on_envelope)
                state = await _start_and_collect(
                    runtime, engines, stop, serving_cpus, all_cpus, batches, duration_s, progress
                )
                versions = await _engine_versions(runtime)
            finally:
                if runtime is not None:
                    for client in runtime.pool.by_name.values():
                        await client.aclose()
                stop.shutting_down = True
                await asyncio.to_thread(engines.stop)  # the loop keeps taking signals meanwhile
                factory.close()  # a docker factory holds its daemon's connections
    finally:
        for sig in taken:
            loop.remove_signal_handler(sig)
            # Until run_local returns, a late signal is acknowledged, never a KeyboardInterrupt that
            # would lose the report (asyncio's removal put the default handler back).
            signal.signal(sig, stop.early)
    assert runtime is not None
    report = build_report(runtime.report_acc, ReportStatic(name, time.perf_counter() - wall))
    report["policy_config"] = policy.model_dump(mode="json")
    report["engine_versions_at_end"] = versions
    report["published_version"] = runtime.plan.target
    report.update(fault_report(state, runtime))
    report.update(runtime.gate_report())
    report["stopped_early"] = stop.count > 0 or runtime.stop_requested
    report["stop"] = stop.report()
    report["cpus"] = {
        "serving": list(serving_cpus),
        "lanes": list(lane_cpus) if policy.pinned_lanes else None,
        "lanes_borrow_serving": policy.pinned_lanes and config.lanes.borrow_serving_cpus,
        "lanes_order": config.lanes.order.value if policy.pinned_lanes else None,
        "lanes_cpu_priority": lanes.cpu_priority,
    }
    report["sandbox_isolation"] = getattr(factory, "isolation", None)
    report["sandbox_time_limits"] = {"mode": config.sandbox.time_limits, "backstop": config.sandbox.backstop}
    report.update(task_report(report.get("groups_timeline", []), source))
    report["engines_given_up"] = dict(state.given_up)
    if state.error is not None:
        report["error"] = state.error
    if state.given_up and state.given_up.keys() == runtime.pool.by_name.keys():
        report["error"] = "every engine was given up (engines.max_restarts): " + "; ".join(
            f"{name}: {why}" for name, why in state.given_up.items()
        )
    report["turn_latency_s"] = _turn_latency(state)
    if runtime.lane_adapter is not None:
        report.update(runtime.lane_adapter.report())
    report.update(event_log.as_report())
    return report


async def make_sandbox_factory(
    config: LocalRunConfig, policy: PolicyConfig, base_dir: Path
) -> LocalSandboxFactory | DockerSandboxFactory:
    """`sandbox_factory` from a running loop: docker sandboxes' check of the daemon (up to 10 s) runs in
    a thread, so signals and, in `corral serve`, requests are still served meanwhile."""
    if config.sandbox.docker_image is not None:
        return await asyncio.to_thread(sandbox_factory, config, policy, base_dir)
    return sandbox_factory(config, policy, base_dir)


def sandbox_factory(
    config: LocalRunConfig, policy: PolicyConfig, base_dir: Path
) -> LocalSandboxFactory | DockerSandboxFactory:
    """The sandboxes a run config asks for: `corral run`'s and a `corral serve` local run's alike.
    Pinned policies put each lane's processes in a cpu group of its weight (`lanes.weights`), yielding
    to serving where the lanes borrow its CPUs; the others share the CPUs as they come. What this host
    cannot give (isolation, cgroups, a safe uid claims directory; for docker sandboxes a daemon that
    answers and has the image) is a `LocalRunError`, said before any engine starts."""
    if config.sandbox.docker_image is not None:
        from app.sandboxes.docker import DockerSandboxFactory  # the docker SDK only where it is used

        docker = DockerSandboxFactory(config.sandbox.docker_image)
        try:
            docker.check()
        except SandboxError as exc:
            docker.close()
            raise LocalRunError(f"sandbox.docker_image: {exc}") from None
        return docker
    try:
        return LocalSandboxFactory(
            base_dir,
            isolation=config.sandbox.isolation,  # type: ignore[arg-type]
            lane_weights=config.lanes.weights.by_lane() if policy.pinned_lanes else None,
            borrow_serving=policy.pinned_lanes and config.lanes.borrow_serving_cpus,
            time_limits=time_limits(config),
        )
    except (SandboxError, SandboxLimitError, ShareError) as exc:
        raise LocalRunError(f"sandboxes: {exc}") from None


def time_limits(config: LocalRunConfig) -> TimeLimits:
    if config.sandbox.time_limits == "wall":
        return TimeLimits.wall()
    return TimeLimits(backstop=config.sandbox.backstop)


def task_report(timeline: list[dict[str, Any]], source: TaskSource) -> dict[str, Any]:
    """Each group's task by name, and per outcome how many groups of each task ended so (`delivered`:
    in a trainer batch), so that a task that never reaches a batch shows."""
    names: dict[str, str] = {}
    by_outcome: dict[str, dict[str, int]] = {}
    for row in timeline:
        name = source.task_for(row["task"]).name
        names[str(row["group"])] = name
        counts = by_outcome.setdefault(row["outcome"], {})
        counts[name] = counts.get(name, 0) + 1
    ordered = {o: dict(sorted(c.items())) for o, c in sorted(by_outcome.items())}
    return {"group_tasks": names, "tasks_by_outcome": ordered}


class EventLog:
    """The run's event stream kept for its report (replays, `corral trace import`), up to a cap."""

    MAX_EVENTS = 500_000

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.dropped = 0

    def on_envelope(self, env: Envelope) -> None:
        if len(self.rows) < self.MAX_EVENTS:
            self.rows.append(env.to_dict())
        else:
            self.dropped += 1

    def as_report(self) -> dict[str, Any]:
        return {"event_log": self.rows, "event_log_dropped": self.dropped}


async def _start_and_collect(
    runtime: Runtime,
    engines: EngineProcesses,
    stop: _StopSignals,
    serving_cpus: list[int],
    all_cpus: list[int],
    batches: int | None,
    duration_s: float | None,
    progress: RunProgress,
) -> RunState:
    """Wait for the engines, then run; a stop during start-up returns the empty state at once."""
    if stop.count:
        return runtime.state
    stop.task = startup = asyncio.ensure_future(progress.wait_for_engines(engines))
    try:
        await startup
    except asyncio.CancelledError:
        if stop.count == 0:
            raise  # not ours: the caller is being cancelled
        return runtime.state
    for name, detail in engines.exited_at_start.items():
        progress.line(f"{name} {detail}: the run starts without it and restarts it")
        runtime.engine_down_at_start(name, detail)
    # The control plane (this thread: routing turns, forking sandbox commands that pin themselves to
    # the lanes) stays on the serving CPUs, off the lanes' CPUs, as in benchmarks/lane_isolation.py.
    os.sched_setaffinity(0, serving_cpus)
    try:
        stop.task = collecting = asyncio.ensure_future(runtime.run(batches=batches, duration_s=duration_s))
        if stop.count:  # a signal landed between start-up and here
            collecting.cancel()
        try:
            return await collecting
        except asyncio.CancelledError:
            if stop.count == 0:
                raise
            return runtime.state
        except Exception as exc:  # groups that all fail end the run; its report says why
            cause = cannot_proceed(exc)
            if cause is None:
                raise
            progress.line(f"the run stopped: {cause}")
            runtime.state.error = str(cause)
            return runtime.state
    finally:
        os.sched_setaffinity(0, all_cpus)


async def _engine_versions(runtime: Runtime) -> dict[str, int | None]:
    """Each engine's committed version at the end; None for one that does not answer."""
    versions: dict[str, int | None] = {}
    for name, client in runtime.pool.by_name.items():
        versions[name] = None
        if name in runtime.plan.down:
            continue
        with contextlib.suppress(Exception):  # a report must not fail on a dying engine
            async with asyncio.timeout(_VERSION_QUERY_S):
                versions[name] = await client.weight_version()
    return versions


def fault_report(state: RunState, runtime: Runtime) -> dict[str, Any]:
    """What engine faults did to the run, times in seconds from its start."""
    t0 = state.started_at
    failures = iter(state.update_failures)
    log = []
    for t, engine, version, phase in state.update_log:
        entry: dict[str, Any] = {"t": round(t - t0, 3), "engine": engine, "version": version, "phase": phase}
        if phase == "failed":
            entry["error"] = next(failures)[3]
        log.append(entry)
    return {
        "update_log": log,
        "engine_events": [
            {"t": round(t - t0, 3), "engine": engine, "state": s, "detail": detail}
            for t, engine, s, detail in state.engine_events
        ],
        "engine_restarts": {name: rec.restarts for name, rec in state.engines.items()},
        "engines_down_at_end": sorted(runtime.plan.down),
        "turn_retries": state.turn_retries,
        "all_engines_down_s": round(state.all_down_s, 3),
    }


def _turn_latency(state: Any) -> dict[str, float]:
    busy = sum(e.busy_s for e in state.engines.values())
    turns = sum(e.turns for e in state.engines.values())
    return {"mean": round(busy / turns, 4) if turns else 0.0}
