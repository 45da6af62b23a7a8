"""Lane slots that adapt to measured demand: the pure controller, the resizable slot limit, and the
adapter that carries the controller out in real time for in-process lanes.

The controller (`AdaptiveSlots.decide`) sees each lane as a `LaneSample` (slots, busy, queued, the
idle cores it could still use, one operation's demand in cores, and the cores it could get at most) and
returns new slots per lane. Two rules:
- with `overload` set (the simulator's default, app.sim.lanes) **slots follow cores**: at most
  `overload` × the cores the lane can get ÷ one operation's demand, growing by `step` × configured while
  operations queue, shrinking by a step when nothing queues and at most half are busy;
- with `overload` None **slots grow into idle cores**: a lane whose operations queue gains up to a step
  of slots while its CPUs have at least one operation's demand idle, and loses a step when nothing
  queues and at most half are busy, within [configured, `max_factor` × configured].

**Real lanes** (`LaneAdapter`, used by `corral run` and a `corral serve` local run when the policy has
`adaptive_lanes` and pinned lanes) use the second rule, since a real host cannot ask the kernel what a
lane *would* get. Every `interval_s` of wall time the adapter reads, from `/proc/stat`, how much of the
lanes' CPU set sat idle since the last decision (idle and iowait time: a tool call waiting on its disk
leaves the CPU to others), and estimates one operation's demand as the busy cores divided by the mean
number of operations running on them (sampled every `tick_s`): lanes share one CPU set, so one
estimate serves all four. A lane grows only while it queues *and* the CPUs have room for one more
operation of that demand. So sandbox work that sleeps or waits (a tool call blocked on a download, a
reset unpacking from a slow disk) gets more slots, and CPU-bound work on saturated CPUs does not: more
runnable processes on busy cores only slow each other down. The busy cores count whatever else runs
on those CPUs too, which makes the estimate of demand higher and growth more cautious, never bolder.

Invariants: a lane runs at most its current slots at once, not counting operations that left it
(`ResizableLimiter.detach`; after a shrink, running operations finish and no new one starts until the
lane is under its slots again); waiters are served lowest `order` first (a lane ordered oldest group
first passes the group's admission number; FIFO lanes pass 0), in arrival order among equals; slots
stay within
[1, `max_factor` × configured] (with `overload` None, [configured, `max_factor` × configured]); the
decisions are pure (no clock, no I/O): `ResizableLimiter.resize` carries them out.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


# Real lanes sample their busy operations this often (`LaneAdapter.tick_s`), so no decision comes sooner;
# the shortest interval between decisions, also in the simulator, where 1e-300 s never moved its virtual
# time on (a `corral sim` hung, a served run spun a core and never took its stop).
TICK_S = 0.25


class AdaptiveLanesSpec(BaseModel):
    """Lane slots that follow the cores a lane can get and its queue, guaranteed shares that follow
    measured demand, and long resets that leave the reset lane (app.sim.lanes)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)
    interval_s: float = Field(10.0, ge=TICK_S, le=3600, description="seconds between decisions")
    # step 1 and max_factor 16 (were 0.25 and 4): with slots following cores, the cores a lane can get
    # bound its slots, and a lane configured far below its demand (3 reset slots for 48 groups) grew
    # too slowly and too little; measured on the workload family and on random workloads in
    # docs/simulator.md ("Adaptive lane slots").
    step: float = Field(1.0, gt=0, le=4, description="growth or shrink per decision, × configured slots")
    max_factor: float = Field(16.0, ge=1, le=64, description="largest slots, × configured slots")
    reweight: bool = Field(
        True, description="work-conserving lanes: guaranteed shares follow running + queued demand"
    )
    # 1 (was 0.25): reweighting raises a queueing lane's guarantee, never lowers one below its configured
    # share. Lower, the gate's short exec queue read as little demand, a reset storm took exec's cores,
    # and full on cpu-scarce cut more attempts short (docs/simulator.md, "Adaptive lane slots").
    min_share: float = Field(
        1.0, gt=0, le=1, description="a reweighted lane keeps at least this fraction of its configured share"
    )
    overload: float | None = Field(
        1.0,
        ge=1,
        le=1e6,
        description="slots follow cores: at most this × the cores a lane can get, in operations' demand "
        "(None: slots never go below the configured ones)",
    )
    long_op_factor: float | None = Field(
        8.0,
        gt=1,
        le=1e6,
        description="work-conserving lanes: a reset that has run this × the median reset while others "
        "queue leaves the reset lane's slots and finishes on the background share (None: never)",
    )
    background_share: float = Field(
        0.1, gt=0, le=0.9, description="guaranteed fraction of the sandbox cores for long resets"
    )


@dataclass(frozen=True)
class LaneSample:
    """What the controller sees of one lane at a decision."""

    slots: int
    busy: int
    queued: int
    idle_cores: float  # cores the lane could still use without oversubscribing its CPUs
    op_demand: float  # cores one more running operation would use
    cores: float = math.inf  # cores the lane would get if it asked for all (`LanePool.entitlement`)


class AdaptiveSlots:
    """The pure controller: configured slots in, new slots per lane out."""

    def __init__(self, configured: Mapping[str, int], spec: AdaptiveLanesSpec) -> None:
        self.configured = dict(configured)
        self.spec = spec

    def bounds(self, lane: str) -> tuple[int, int]:
        base = self.configured[lane]
        return base, max(base, math.floor(base * self.spec.max_factor))

    def decide(self, samples: Mapping[str, LaneSample]) -> dict[str, int]:
        decided: dict[str, int] = {}
        for lane, s in samples.items():
            low, high = self.bounds(lane)
            step = max(1, round(self.configured[lane] * self.spec.step))
            slots = s.slots
            over = self.spec.overload
            if over is not None and s.op_demand > 0:
                # Slots follow cores: more operations than the lane's cores run only thrash (cpu.py).
                # Capped before the floor: a tiny demand (or unbounded cores) makes the ratio infinite.
                fit = max(1, math.floor(min(over * s.cores / s.op_demand, high)))
                if slots > fit:
                    slots = fit
                elif s.queued > 0:
                    slots = min(fit, slots + min(step, s.queued))
                elif s.busy * 2 <= slots:
                    slots = max(min(low, fit), slots - step)
                decided[lane] = slots
                continue
            if s.queued > 0 and s.idle_cores >= s.op_demand:
                # Room for at least one more operation; never grow past what the idle cores can run.
                room = step if s.op_demand * step <= s.idle_cores else math.floor(s.idle_cores / s.op_demand)
                slots = min(high, slots + min(step, max(1, room), s.queued))
            elif s.queued == 0 and s.busy * 2 <= s.slots:
                slots = max(low, slots - step)
            decided[lane] = min(high, max(low, slots))
        return decided

    def shares(self, samples: Mapping[str, LaneSample], configured: Mapping[str, float]) -> dict[str, float]:
        """Guaranteed cores by measured demand: a lane's weight is the cores its running and queued
        operations would use, at most an equal split of the configured cores, and never below
        `min_share` of its configured guarantee."""
        equal = sum(configured.values()) / len(configured)
        return {
            lane: max(self.spec.min_share * configured[lane], min(equal, (s.busy + s.queued) * s.op_demand))
            for lane, s in samples.items()
        }


class ResizableLimiter:
    """An asyncio semaphore whose number of slots can change while operations hold and wait for them.
    Waiters are woken lowest `order` first, and in arrival order among equal orders."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a lane needs at least one slot, got {slots}")
        self.slots = slots
        self.busy = 0
        self.max_slots = slots
        # A heap of (order, arrival, future). A cancelled waiter stays in it until `_wake` meets it:
        # removing it at once would cost O(n) per cancellation, and a stop cancels thousands.
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._queued = 0  # waiters neither woken nor through their cancellation
        self._detached: set[object] = set()  # tasks whose operation left the slots

    def locked(self) -> bool:
        return self.busy >= self.slots

    @property
    def queued(self) -> int:
        return self._queued

    def try_acquire(self) -> bool:
        """Take a slot now if `acquire` would not wait; False otherwise."""
        if self.busy < self.slots and not self._queued:
            self.busy += 1
            return True
        return False

    async def acquire(self, order: int = 0) -> bool:
        if self.busy < self.slots and not self._queued:
            self.busy += 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (order, next(self._arrivals), fut))
        self._queued += 1
        try:
            await fut  # the slot is ours when this resolves: `_wake` counted it as busy
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # woken and cancelled at once: pass the slot on
            else:
                self._queued -= 1
                self._wake()  # a free slot may have passed over this waiter while it counted as queued
            raise
        return True

    def release(self) -> None:
        if self._detached and (task := asyncio.current_task()) in self._detached:
            self._detached.discard(task)  # its slot was handed on when it detached
            return
        self.busy -= 1
        if self._queued:
            self._wake()

    def detach(self) -> None:
        """The calling task's operation stops counting toward the slots (its slot goes to the next
        waiter); its `release` later gives back nothing."""
        self._detached.add(asyncio.current_task())
        self.busy -= 1
        self._wake()

    def resize(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a lane needs at least one slot, got {slots}")
        self.slots = slots
        self.max_slots = max(self.max_slots, slots)
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters and self.busy < self.slots:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():  # a cancelled waiter leaves `_queued` itself, in `acquire`
                self.busy += 1
                self._queued -= 1
                fut.set_result(None)
        if not self._queued:
            waiters.clear()  # every waiter left is cancelled and already uncounted


def resize_lanes(limiters: Mapping[str, ResizableLimiter], decided: Mapping[str, int]) -> dict[str, int]:
    """Carry out a decision: resize each lane whose slots it changed; returns those lanes' old slots."""
    old = {lane: limiters[lane].slots for lane, n in decided.items() if limiters[lane].slots != n}
    for lane in old:
        limiters[lane].resize(decided[lane])
    return old


# Real lanes: decisions every 2 s of wall time, a step of half the configured slots (at least one), up
# to 4× the configured slots, growth only into idle cores (`overload` None); no reweighting and no long
# resets, which need the simulator's knowledge of every lane's demand.
REAL_ADAPTIVE = AdaptiveLanesSpec(
    interval_s=2.0, step=0.5, max_factor=4.0, reweight=False, overload=None, long_op_factor=None
)

PROC_STAT = Path("/proc/stat")


def read_cpu_times(cpus: Sequence[int], path: Path = PROC_STAT) -> tuple[float, float]:
    """(idle, total) jiffies summed over `cpus` from `/proc/stat`; idle counts idle and iowait."""
    wanted = {f"cpu{n}" for n in cpus}
    idle = total = 0.0
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name not in wanted:
            continue
        values = [float(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal [guest guest_nice, already in user and nice]
        idle += values[3] + (values[4] if len(values) > 4 else 0.0)
        total += sum(values[:8])
    return idle, total


class CpuIdleMeter:
    """Idle cores of a CPU set since the previous reading (the first reading covers nothing: 0)."""

    def __init__(self, cpus: Sequence[int], path: Path = PROC_STAT) -> None:
        if not cpus:
            raise ValueError("an idle meter needs at least one CPU")
        self.cpus = tuple(cpus)
        self.path = path
        self._last = read_cpu_times(self.cpus, path)

    def idle_cores(self) -> float:
        idle, total = read_cpu_times(self.cpus, self.path)
        d_idle, d_total = idle - self._last[0], total - self._last[1]
        self._last = (idle, total)
        if d_total <= 0:
            return 0.0
        return len(self.cpus) * min(1.0, max(0.0, d_idle / d_total))


@dataclass
class LaneAdapter:
    """Carries `AdaptiveSlots` out on real lanes, in wall time (module docstring)."""

    limiters: Mapping[str, ResizableLimiter]
    meter: CpuIdleMeter
    spec: AdaptiveLanesSpec = REAL_ADAPTIVE
    tick_s: float = TICK_S
    clock: Callable[[], float] = time.monotonic
    controller: AdaptiveSlots = field(init=False)
    slot_log: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    op_demand: float = 1.0  # the latest estimate of one operation's cores
    # called as on_change(lane, old, new, why) for each lane a decision resized (the runtime publishes it)
    on_change: Callable[[str, int, int, str], None] | None = None
    _busy_samples: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.controller = AdaptiveSlots({lane: lim.slots for lane, lim in self.limiters.items()}, self.spec)

    def sample_busy(self) -> None:
        self._busy_samples.append(sum(lim.busy for lim in self.limiters.values()))

    def decide(self) -> dict[str, int]:
        """One decision from the CPU readings and busy samples since the last; resizes and returns the
        lanes whose slots changed."""
        idle = self.meter.idle_cores()
        busy_ops = sum(self._busy_samples) / len(self._busy_samples) if self._busy_samples else 0.0
        self._busy_samples.clear()
        if busy_ops >= 0.5:  # too few operations ran to say what one costs: keep the last estimate
            cores_used = max(0.0, len(self.meter.cpus) - idle)
            self.op_demand = min(float(len(self.meter.cpus)), max(0.05, cores_used / busy_ops))
        samples = {
            lane: LaneSample(lim.slots, lim.busy, lim.queued, idle, self.op_demand)
            for lane, lim in self.limiters.items()
        }
        decided = self.controller.decide(samples)
        old_slots = resize_lanes(self.limiters, decided)
        changed = {lane: decided[lane] for lane in old_slots}
        for lane, old in old_slots.items():
            if self.on_change is not None:
                s, n = samples[lane], decided[lane]
                why = (
                    f"{s.queued} queued, {idle:.2f} idle cores, ~{self.op_demand:.2f} cores an operation"
                    if n > old
                    else f"nothing queued, {s.busy} of {old} busy"
                )
                self.on_change(lane, old, n, why)
        if changed:
            self.slot_log.append((self.clock(), changed))
        return changed

    async def run(self) -> None:
        """Decide every `spec.interval_s` until cancelled, sampling busy operations every `tick_s`. A
        CPU reading that fails ends the adapting, never the run: the lanes keep the slots they have."""
        ticks = max(1, round(self.spec.interval_s / self.tick_s))
        try:
            self.meter.idle_cores()  # start the first interval now
            while True:
                for _ in range(ticks):
                    await asyncio.sleep(self.tick_s)
                    self.sample_busy()
                self.decide()
        except (OSError, ValueError, IndexError) as exc:
            log.warning("adaptive lanes stopped, the lanes keep their slots: %s: %s", self.meter.path, exc)

    def report(self) -> dict[str, Any]:
        """The lanes' slots as adapted, in the simulator's report fields."""
        return {
            "lane_slots": {
                lane: {
                    "configured": self.controller.configured[lane],
                    "final": lim.slots,
                    "max": lim.max_slots,
                }
                for lane, lim in self.limiters.items()
            },
            "lane_slot_changes": len(self.slot_log),
            "lane_op_demand_cores": round(self.op_demand, 3),
        }


def lane_adapter(
    adaptive: bool, lanes: object, cpus: Sequence[int], stat: Path = PROC_STAT
) -> LaneAdapter | None:
    """The real-time adapter for `lanes` when the policy adapts them and they can be resized (in-process
    pinned lanes with a CPU set); None otherwise (Celery lanes keep their workers' concurrency)."""
    limiters = getattr(lanes, "limiters", None)
    if not adaptive or not limiters or not cpus or not getattr(lanes, "pinned", False):
        return None
    try:
        meter = CpuIdleMeter(cpus, stat)
    except (OSError, ValueError, IndexError) as exc:  # no /proc/stat here (or not one we can read)
        log.warning("lanes keep their configured slots: cannot read CPU time from %s: %s", stat, exc)
        return None
    return LaneAdapter({str(getattr(k, "value", k)): v for k, v in limiters.items()}, meter)
