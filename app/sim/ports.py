"""The simulated ports of one run: CPU pools, engines, lanes and attempt source, wired for a policy.

CPU pools by policy and `lanes.sharing` (the model is in app.sim.cpu):
- shared CPUs (`pinned_lanes` off): one pool of `cpus.total` cores for serving and every sandbox
  operation, with serving interference; lanes have no slot limit;
- pinned lanes: serving gets `cpus.serving` cores of its own (the hard boundary) and the rest form
  the sandbox pool. `work_conserving`: one `LanePool` whose lanes are guaranteed their weight's share
  and borrow idle cores (with `lanes.borrow_serving_cpus`, idle serving cores too, serving first);
  `partitioned`: each lane owns whole cores (`lane_cpu_split`) and never borrows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from app.core.config import LanesConfig, PolicyConfig
from app.lanes.adaptive import AdaptiveLanesSpec, AdaptiveSlots, LaneSample, resize_lanes
from app.lanes.base import LaneName
from app.lanes.inprocess import NICE_STEP, InProcessLanes
from app.runtime.driver import RunState, Runtime
from app.sim.adapters import SimEngine, SimLaneCpus, lane_cpu_split
from app.sim.cpu import CpuPool, GroupRanks, LanePool, Stream
from app.sim.lanes import LaneSharing, LongOps
from app.sim.workload import Workload

BACKGROUND = "background"  # the sandbox pool's share for long resets (app.sim.lanes.LongOps)


@dataclass
class SimPorts:
    serving: CpuPool
    sandbox: LanePool | None
    engines: list[SimEngine]
    lanes: InProcessLanes
    lane_cpus: SimLaneCpus
    controller: AdaptiveSlots | None
    interval_s: float
    configured_guarantees: dict[str, float] = field(default_factory=dict)
    slot_log: list[tuple[float, dict[str, int]]] = field(default_factory=list)

    def lane_report(self) -> dict[str, Any]:
        """Extras for the run report: the sharing mode, and the lanes' slots as adapted."""
        out: dict[str, Any] = {}
        if self.sandbox is not None:
            out["lane_sharing"] = "work_conserving" if self.sandbox.borrow else "partitioned"
            out["lane_guaranteed_cores"] = {k: round(v, 3) for k, v in self.configured_guarantees.items()}
            out["lane_max_borrowed_cores"] = round(self.sandbox.max_borrowed, 3)
            if self.sandbox.lender is not None:
                out["lane_max_serving_cores_used"] = round(self.sandbox.max_lent, 3)
        else:
            out["lane_sharing"] = "shared"
        out["lanes_order"] = self.lanes.order.value
        out["lanes_cpu_priority"] = self.lane_cpus.by_group()
        if self.controller is not None:
            out["lane_slots"] = {
                lane.value: {
                    "configured": self.controller.configured[lane.value],
                    "final": limiter.slots,
                    "max": limiter.max_slots,
                }
                for lane, limiter in self.lanes.limiters.items()
            }
            out["lane_slot_changes"] = len(self.slot_log)
            if isinstance(self.lane_cpus.reset[0], LongOps):
                out["lane_long_resets"] = self.lane_cpus.reset[0].detached
            if self.sandbox is not None and self.controller.spec.reweight and self.sandbox.borrow:
                out["lane_final_guarantees"] = {k: round(v, 3) for k, v in self.sandbox.guarantees.items()}
        return out


def lane_guarantees(workload: Workload) -> dict[str, float]:
    """Guaranteed cores per lane in the work-conserving pool: the sandbox cores split by weight."""
    free = workload.cpus.total - workload.cpus.serving
    if workload.lanes.weights is not None:
        weights = workload.lanes.weights.by_lane()
    else:
        demand = workload.cpus.sandbox_demand.by_lane()
        weights = {lane: n * max(demand[lane], 1e-3) for lane, n in workload.lanes.slots().items()}
    total = sum(weights.values())
    return {lane: free * w / total for lane, w in weights.items()}


def build_ports(workload: Workload, policy: PolicyConfig) -> SimPorts:
    cpus = workload.cpus
    split = lane_cpu_split(workload)
    streams: dict[str, Stream] = {}
    sandbox: LanePool | None = None
    adaptive = workload.lanes.adaptive or (AdaptiveLanesSpec() if policy.adaptive_lanes else None)
    if policy.pinned_lanes:
        borrowing = workload.lanes.borrow_serving_cpus
        # Lanes on the serving cores slow serving as neighbours do (γ); without them nothing co-locates.
        serving = CpuPool("serving", cpus.serving, cpus.thrash, cpus.interference if borrowing else 0.0)
        if workload.lanes.sharing is LaneSharing.PARTITIONED:
            guarantees = {lane: float(len(ids)) for lane, ids in split.items()}
            sandbox = LanePool("sandbox", sum(guarantees.values()), guarantees, False, cpus.thrash)
        else:
            guarantees = lane_guarantees(workload)
            if adaptive is not None and adaptive.long_op_factor is not None:
                share = adaptive.background_share
                guarantees = {lane: g * (1 - share) for lane, g in guarantees.items()}
                guarantees[BACKGROUND] = share * (cpus.total - cpus.serving)
            lender = serving if borrowing else None
            sandbox = LanePool("sandbox", cpus.total - cpus.serving, guarantees, True, cpus.thrash, lender)
        if workload.lanes.by_group_age():
            ranks = GroupRanks(NICE_STEP)
            streams = {lane: sandbox.grouped_stream(lane, ranks) for lane in split}
        else:
            streams = {lane: sandbox.stream(lane) for lane in split}
    else:
        serving = CpuPool("shared", cpus.total, cpus.thrash, cpus.interference)
        shared = serving.stream("sandboxes")
        streams = dict.fromkeys(split, shared)
    demand = cpus.sandbox_demand.by_lane()
    lane_cpus = SimLaneCpus(**{lane: (streams[lane], demand[lane]) for lane in split})
    engines = [
        SimEngine(
            f"engine-{i}",
            serving,
            workload.engines.update_s,
            workload.engines.tokens_per_s,
            cpus.engine_demand,
            faults=[f for f in workload.faults if f.engine == i],
        )
        for i in range(workload.engines.count)
    ]
    slots = workload.lanes.slots()
    lane_config = LanesConfig.model_validate(
        {
            **{lane: {"slots": slots[lane], "cpus": split[lane]} for lane in slots},
            "serving_cpus": tuple(range(cpus.serving)),
            "order": workload.lanes.order,
        }
    )
    # Simulated sandboxes have no niceness to set: the CPU model gives the priority (GroupedStream).
    lanes = InProcessLanes.from_config(lane_config, policy.pinned_lanes, cpu_priority=False)
    controller = AdaptiveSlots(slots, adaptive) if adaptive is not None and policy.pinned_lanes else None
    interval = adaptive.interval_s if adaptive is not None else 0.0
    configured = {lane: g for lane, g in sandbox.guarantees.items() if lane != BACKGROUND} if sandbox else {}
    if sandbox is not None and BACKGROUND in sandbox.guarantees and adaptive is not None:
        assert adaptive.long_op_factor is not None
        long = LongOps(
            streams["reset"],
            lanes.limiters[LaneName.RESET],
            sandbox.stream(BACKGROUND),
            adaptive.long_op_factor,
        )
        lane_cpus = dataclasses.replace(lane_cpus, reset=(long, demand["reset"]))
    return SimPorts(serving, sandbox, engines, lanes, lane_cpus, controller, interval, configured)


async def run_adapting(runtime: Runtime, ports: SimPorts, batches: int) -> RunState:
    """Run the runtime; with adaptive lanes, resize lane slots every interval beside it."""
    if ports.controller is None:
        return await runtime.run(batches=batches)

    async def adapt() -> None:
        assert ports.controller is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(ports.interval_s)
            samples = _samples(ports)
            pool = ports.sandbox
            if ports.controller.spec.reweight and pool is not None and pool.borrow:
                shares = ports.controller.shares(samples, ports.configured_guarantees)
                if BACKGROUND in pool.guarantees:
                    share = ports.controller.spec.background_share
                    shares[BACKGROUND] = sum(shares.values()) * share / (1 - share)
                pool.set_guarantees(shares)
                if ports.controller.spec.overload is not None:
                    samples = _samples(ports)  # the cores each lane can get under its new share
            decided = ports.controller.decide(samples)
            long = ports.lane_cpus.reset[0]
            if isinstance(long, LongOps) and pool is not None:
                fit = pool.entitlement(BACKGROUND) * (ports.controller.spec.overload or 1.0)
                long.slots.resize(max(1, math.floor(fit / max(ports.lane_cpus.reset[1], 1e-3))))
            limiters = {lane.value: limiter for lane, limiter in ports.lanes.limiters.items()}
            changed = {lane: decided[lane] for lane in resize_lanes(limiters, decided)}
            if changed:
                ports.slot_log.append((loop.time(), changed))

    async with asyncio.TaskGroup() as tg:
        ticker = tg.create_task(adapt())
        try:
            return await runtime.run(batches=batches)
        finally:
            ticker.cancel()


def _samples(ports: SimPorts) -> dict[str, LaneSample]:
    pool = ports.sandbox
    assert pool is not None
    samples = {}
    for lane, limiter in ports.lanes.limiters.items():
        stream, demand = getattr(ports.lane_cpus, lane.value)
        # Headroom: idle sandbox cores, or with partitions the lane's own idle cores.
        idle = pool.cores - pool.demand if pool.borrow else pool.guarantees[lane.value] - stream.demand
        samples[lane.value] = LaneSample(
            limiter.slots, limiter.busy, limiter.queued, idle, demand, pool.entitlement(lane.value)
        )
    return samples
