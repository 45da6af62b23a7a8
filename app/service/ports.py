"""The ports a service-run drives, built per run kind (the composition root of a run inside `corral serve`).

- `sim`: the simulator's engines, sandboxes and CPU pools (app.sim) on a `PacedLoop`, whose virtual
  clock follows the wall clock at `speed`, so API clients see a run unfold in real time;
- `local`: the embedded default of `corral run` — embedded engine processes, local sandboxes in pinned
  lanes, the built-in tasks and the shell agent — from the same building blocks as app.runtime.local.
  Its engines are supervised as `corral run`'s are: the `EngineProcesses` restart a dead one on a fresh
  port (`supervisor`) with the run config's health watch and backoff (`faults`); a sim run has neither
  (the simulator injects its own faults).
  Its lanes come from the lanes factory (`lanes_for(settings)`: in-process lanes without a broker,
  Celery lanes on `CORRAL_LANE_HOSTS` with one); a sim run's lanes are always in-process.

Invariant: whatever `open_ports` starts (engine processes, clients) is stopped when its context exits,
however the run ended; a restarted engine's process too (the clients of restarts belong to the runtime
that asked for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.config import AdmissionMode, LanesConfig, PolicyConfig
from app.engines.base import Engine
from app.lanes.adaptive import LaneAdapter, lane_adapter
from app.lanes.base import Lanes
from app.lanes.inprocess import InProcessLanes
from app.runtime.engine_pool import EngineFaultConfig, EngineSupervisor
from app.runtime.ports import AttemptSource
from app.service.schemas import RunCreate, RunKind, TrainerKind
from app.settings import Settings

if TYPE_CHECKING:  # the docker SDK only where a run uses it
    from app.sandboxes.docker import DockerSandboxFactory
    from app.sandboxes.local import LocalSandboxFactory

# A run's lanes from its lane config and whether they are pinned (app.lanes.choose.choose_lanes).
LanesFactory = Callable[[LanesConfig, bool], Lanes]


@dataclass
class RunPorts:
    engines: Sequence[Engine]
    engine_slots: int
    lanes: Lanes
    source: AttemptSource
    # where sentinel weights are written (local runs); set exactly when the engines load weights from
    # disk, so that a publication without a path is refused (`Runtime.weights_from_disk`)
    weights_dir: Path | None
    supervisor: EngineSupervisor | None = None  # restarts a dead engine (local runs' engine processes)
    faults: EngineFaultConfig | None = None  # health watch, restart backoff, update timeout (local runs)
    # engines that died before they first answered: the run starts without them and restarts them
    down_at_start: dict[str, str] = field(default_factory=dict)
    lane_adapter: LaneAdapter | None = None  # adaptive lanes of a local run (app.lanes.adaptive)


def run_policy(spec: RunCreate) -> PolicyConfig:
    """The run's policy: the ladder rung, B/G/S/K from the workload or config, then the overrides."""
    if spec.kind is RunKind.SIM:
        assert spec.workload is not None
        base = spec.workload.policy_settings(spec.policy.value)  # as `corral sim` runs it
    else:
        config = spec.config
        assert config is not None
        base = config.policy_settings()
    policy = PolicyConfig.ladder(spec.policy.value, **{**base, **spec.overrides()})
    if policy.admission is not AdmissionMode.IN_FLIGHT:
        return policy
    if "ready_surplus" in spec.model_fields_set:
        return policy.with_changes(ready_surplus=spec.ready_surplus)
    if spec.trainer is TrainerKind.EXTERNAL:  # a stalled trainer must not let ready groups pile up
        return policy.with_changes(ready_surplus=policy.groups_per_batch + policy.surplus_groups)
    return policy


def lanes_for(settings: Settings) -> LanesFactory:
    """The lanes of `corral serve`'s (or an orchestrator worker's) local runs, as its settings say."""
    from app.lanes.choose import choose_lanes

    def make(config: LanesConfig, pinned: bool) -> Lanes:
        return choose_lanes(config, pinned, settings.broker_url, settings.result_backend, settings.lane_hosts)

    return make


@asynccontextmanager
async def open_ports(
    spec: RunCreate, policy: PolicyConfig, work_dir: Path, lanes: LanesFactory | None = None
) -> AsyncIterator[RunPorts]:
    """`lanes`: how a local run gets its lanes (default: in-process, from the run's lane config)."""
    if spec.kind is RunKind.SIM:
        yield _sim_ports(spec, policy)
        return
    async with _local_ports(spec, policy, work_dir, lanes or InProcessLanes.from_config) as ports:
        yield ports


def _sim_ports(spec: RunCreate, policy: PolicyConfig) -> RunPorts:
    from app.sim.adapters import SimEngine, SimLaneCpus, SimSource, lane_cpu_split
    from app.sim.cpu import CpuPool, Stream
    from app.sim.workload import TrajectorySource

    workload = spec.workload
    assert workload is not None
    cpus = workload.cpus
    split = lane_cpu_split(workload)
    streams: dict[str, Stream]
    if policy.pinned_lanes:
        serving = CpuPool("serving", cpus.serving, cpus.thrash)
        streams = {lane: CpuPool(lane, len(ids), cpus.thrash).stream(lane) for lane, ids in split.items()}
    else:
        serving = CpuPool("shared", cpus.total, cpus.thrash, cpus.interference)
        streams = dict.fromkeys(split, serving.stream("sandboxes"))
    demand = cpus.sandbox_demand.by_lane()
    lane_cpus = SimLaneCpus(**{lane: (streams[lane], demand[lane]) for lane in split})
    engines = [
        SimEngine(f"engine-{i}", serving, workload.engines.update_s, workload.engines.tokens_per_s,
                  cpus.engine_demand)
        for i in range(workload.engines.count)
    ]  # fmt: skip
    slots = workload.lanes.slots()
    lane_config = LanesConfig.model_validate(
        {
            **{lane: {"slots": slots[lane], "cpus": split[lane]} for lane in slots},
            "serving_cpus": tuple(range(cpus.serving)),
        }
    )
    return RunPorts(
        engines=engines,
        engine_slots=workload.engines.slots,
        lanes=InProcessLanes.from_config(lane_config, policy.pinned_lanes),
        # Uncached: the run goes on until stopped, and a cache of every draw grows with it.
        source=SimSource(TrajectorySource(workload, cache=False), lane_cpus, record=True),
        weights_dir=None,
    )


@asynccontextmanager
async def _local_ports(
    spec: RunCreate, policy: PolicyConfig, work_dir: Path, make_lanes: LanesFactory
) -> AsyncIterator[RunPorts]:
    from app.agent.loop import ShellAgent, ShellAgentConfig
    from app.lanes.ops import incarnation_suffix
    from app.runtime.engine_procs import EngineProcesses, fault_config
    from app.runtime.local import make_sandbox_factory
    from app.runtime.task_source import TaskSource, load_tasks
    from app.sandboxes import leftovers
    from app.sandboxes.local import LocalSandboxFactory, scratch_base

    config = spec.config
    assert config is not None
    tasks = load_tasks(config.tasks)
    serving_cpus = config.engines.cpus if policy.pinned_lanes else sorted(os.sched_getaffinity(0))
    if config.sandbox.base_dir:
        sandboxes = Path(config.sandbox.base_dir)
    else:
        sandboxes = await asyncio.to_thread(scratch_base, work_dir / "sandboxes", work_dir.name)
    # A scratch base in <tmp> is this run's alone: it goes whole when the run is over.
    scratch = not config.sandbox.base_dir and sandboxes != work_dir / "sandboxes"
    await asyncio.to_thread(_make_work_dirs, work_dir, sandboxes)
    engines = EngineProcesses(config.engines, serving_cpus, work_dir, exits_at_start_ok=True)
    clients: list[Engine] = []
    lanes: Lanes | None = None
    factory: LocalSandboxFactory | DockerSandboxFactory | None = None
    try:
        lanes = make_lanes(config.lane_config(), policy.pinned_lanes)
        # On the run's own thread, not a worker thread: a start-up cancelled (the run stopped while
        # starting) cannot leave a spawn in progress behind the cleanup's `stop`, and each engine's
        # parent-death signal follows the run's thread (see engine_procs._die_with_parent).
        engines.start()
        await engines.wait_healthy()
        clients = list(engines.clients())
        factory = await make_sandbox_factory(config, policy, sandboxes)
        # On lane hosts (Celery lanes) a killed predecessor's sandboxes have no owner that the next
        # start of a process would sweep: this start sweeps them there (`CeleryLanes.begin_incarnation`).
        # Local sandboxes only in the run's own sandbox directory: one the config names may hold other
        # runs' sandboxes, which a sweep would take for a killed incarnation's (their numbers are older
        # than this start's). Docker sandboxes by their containers' run label (the run's id).
        suffix = ""
        begin = getattr(lanes, "begin_incarnation", None)
        if begin is not None and isinstance(factory, LocalSandboxFactory) and not config.sandbox.base_dir:
            suffix = incarnation_suffix(await asyncio.to_thread(begin, factory.base_dir))
        elif begin is not None and not isinstance(factory, LocalSandboxFactory):
            factory.run = work_dir.name
            suffix = incarnation_suffix(await asyncio.to_thread(begin, None, factory.run))
        agent = ShellAgent(ShellAgentConfig(max_tokens=config.engines.max_tokens))
        yield RunPorts(
            engines=clients,
            engine_slots=config.engines.slots,
            lanes=lanes,
            source=TaskSource(tasks, factory, agent, config.seed, suffix),
            weights_dir=work_dir / "weights",
            supervisor=engines,
            faults=fault_config(config.engines),
            down_at_start=dict(engines.exited_at_start),
            lane_adapter=lane_adapter(policy.adaptive_lanes, lanes, config.lanes.cpus),
        )
    finally:
        for client in clients:
            await client.aclose()
        await asyncio.to_thread(engines.stop)
        close = getattr(lanes, "close", None)  # Celery lanes hold broker connections
        if close is not None:
            close()
        if factory is not None:
            factory.close()  # a docker factory holds its daemon's connections
        if scratch:  # the run is over: its sandboxes cleaned up, its engines stopped
            with contextlib.suppress(OSError):
                await asyncio.to_thread(leftovers.rmtree, sandboxes)


def _make_work_dirs(work_dir: Path, sandboxes: Path) -> None:
    work_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(work_dir, 0o711)  # sandbox uids must traverse it to reach their own work directories
    sandboxes.mkdir(parents=True, exist_ok=True)
