"""Lane modes of the simulator: how lanes share the sandbox cores, and lane slots that follow demand.

Sharing (`lanes.sharing` in a workload):
- `work_conserving` (default): one pool of sandbox cores, disjoint from serving (the hard boundary).
  Each lane has a guaranteed share (`lanes.weights`, default slots × per-op demand, the proportions the
  partition uses) and may use sandbox cores the others leave idle (see `app.sim.cpu.LanePool`);
- `partitioned`: each lane owns whole cores and never borrows (the strict per-lane partition).

Adaptive lanes (`lanes.adaptive`). Every `interval_s` of virtual time `AdaptiveSlots.decide` looks at
each lane. With `overload` set (default 1.0) **slots follow cores**: a lane's slots go to at most
`overload` × the cores it can get (`LanePool.entitlement`: its water-filled share if it asked for every
core, the others' demand as it is) ÷ one operation's demand, at once when they are above that (even
below the configured slots, never below 1), growing by `step` × configured while operations queue, and
shrinking by a step when nothing is queued and at most half are busy, not below min(configured, that
fit) (an idle lane below that goes back to it). In the CPU model (app.sim.cpu) a lane running more
operations than its cores thrashes: on `cpu-scarce` the exec lane's 192 slots of one core each ran on
about 15 cores at 1–3% speed. With
`overload` None the older rule holds: grow by a step only into idle cores (the sandbox pool, or the
lane's own partition, has one operation's demand idle), shrink by a step when idle, and stay within
[configured, `max_factor` × configured].

With `reweight` (work-conserving lanes only) the guaranteed shares follow measured demand too
(`AdaptiveSlots.shares`): each lane's weight becomes the cores its running and queued operations would
use, capped at an equal split of the sandbox cores and at least `min_share` of its configured share.
A lane whose queue grows because it is short of CPU, not of slots (a reset lane starved by a saturated
pool), so gets up to an equal share instead of more slots; the cap keeps one long queue (a reset or
cleanup storm) from taking the guarantee of lanes with little queued, so every lane keeps at least
min(its demand, its equal split) in proportion (max-min fairness on demand). Without the cap, queued
resets outweighed validate and cleanup on `cpu-scarce` (645 s against 587 s with it, before slots
followed cores; docs/simulator.md).

With `long_op_factor` set (default 8, work-conserving lanes) **long resets leave the reset lane**
(`LongOps`): a reset that has had 8 × the median reset's service while others queue for its slot and
the pool has no idle cores gives up its slot and finishes on a background share of the sandbox cores
(`background_share`, default 0.1), at most as many at once as that share's cores run. Resets in the
simulator are CPU work for their whole duration (`cpus.sandbox_demand.reset` cores), so a long reset
still costs CPU; what it stops doing is holding a slot ahead of the short resets queued behind it (a
lognormal tail like `cpu-scarce`'s puts three quarters of the reset CPU-seconds in the 10% of resets
over 300 s).

The decisions are pure (no clock, no I/O); `ResizableLimiter`, `LanePool.set_guarantees` and `LongOps`
carry them out.

Invariants: a lane runs at most its current slots at once, not counting operations that left it
(`ResizableLimiter.detach`; after a shrink, running operations finish and no new one starts until the
lane is under its slots again); waiters are served in FIFO order; slots stay within
[1, `max_factor` × configured] (with `overload` None, [configured, `max_factor` × configured]); the
background runs at most its own slots of long resets at once.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.core.config import LanesConfig
from app.lanes.base import LaneName
from app.lanes.inprocess import InProcessLanes
from app.sim.cpu import Stream


class LaneSharing(StrEnum):
    WORK_CONSERVING = "work_conserving"
    PARTITIONED = "partitioned"


class LaneWeights(BaseModel):
    """Guaranteed share of the sandbox cores per lane (relative weights, like cgroup `cpu.weight`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)
    reset: float = Field(gt=0, le=1e6, description="weight of the reset lane")
    exec: float = Field(gt=0, le=1e6, description="weight of the exec lane")
    validate_: float = Field(gt=0, le=1e6, alias="validate", description="weight of the validate lane")
    cleanup: float = Field(gt=0, le=1e6, description="weight of the cleanup lane")

    def by_lane(self) -> dict[str, float]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}


class AdaptiveLanesSpec(BaseModel):
    """Lane slots that follow the cores a lane can get and its queue, guaranteed shares that follow
    measured demand, and long resets that leave the reset lane (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    interval_s: float = Field(10.0, gt=0, le=3600, description="seconds between decisions")
    step: float = Field(0.25, gt=0, le=4, description="growth or shrink per decision, × configured slots")
    max_factor: float = Field(4.0, ge=1, le=64, description="largest slots, × configured slots")
    reweight: bool = Field(
        True, description="work-conserving lanes: guaranteed shares follow running + queued demand"
    )
    min_share: float = Field(
        0.25, gt=0, le=1, description="a reweighted lane keeps at least this fraction of its configured share"
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
                fit = min(high, max(1, math.floor(over * s.cores / s.op_demand)))
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
    """An asyncio semaphore whose number of slots can change while operations hold and wait for them."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a lane needs at least one slot, got {slots}")
        self.slots = slots
        self.busy = 0
        self.max_slots = slots
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._detached: set[object] = set()  # tasks whose operation left the slots

    def locked(self) -> bool:
        return self.busy >= self.slots

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def try_acquire(self) -> bool:
        """Take a slot now if `acquire` would not wait; False otherwise."""
        if self.busy < self.slots and not self._waiters:
            self.busy += 1
            return True
        return False

    async def acquire(self) -> bool:
        if self.busy < self.slots and not self._waiters:
            self.busy += 1
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # the slot is ours when this resolves: `_wake` counted it as busy
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # woken and cancelled at once: pass the slot on
            elif fut in self._waiters:  # `_wake` drops cancelled waiters it meets first
                self._waiters.remove(fut)
            raise
        return True

    def release(self) -> None:
        if self._detached and (task := asyncio.current_task()) in self._detached:
            self._detached.discard(task)  # its slot was handed on when it detached
            return
        self.busy -= 1
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
        while self._waiters and self.busy < self.slots:
            fut = self._waiters.popleft()
            if not fut.done():
                self.busy += 1
                fut.set_result(None)


class LongOps:
    """Long resets leave the reset lane (`AdaptiveLanesSpec.long_op_factor`).

    A reset that has received `factor` × the median completed reset's CPU service while others queue
    for its slot, and the sandbox pool has no idle cores to grow the lane into, gives up its slot
    (`ResizableLimiter.detach`) and finishes on the background stream, a low-weight share of the
    sandbox cores, at most `slots` at once (sized to the background's cores, so that it does not
    thrash; the others wait without using CPU, as frozen cgroups do). The decision uses only service
    received so far, as a runtime that moves a sandbox's processes into a low-weight cgroup after so
    many CPU-seconds would: deciding when the work is drawn or when its service reaches the threshold
    gives the same timeline. Only resets: an attempt has nothing invested yet when it resets, while a
    slow tool call or validation of a running attempt is on its group's critical path.
    """

    def __init__(self, lane: Stream, limiter: ResizableLimiter, background: Stream, factor: float) -> None:
        self.lane = lane
        self.limiter = limiter
        self.background = background
        self.factor = factor
        self.sizes: deque[float] = deque(maxlen=256)  # service of the last completed resets
        self.slots = ResizableLimiter(1)  # resized to the background's cores by the controller
        self.detached = 0

    def threshold(self) -> float:
        if len(self.sizes) < 16:
            return math.inf
        return self.factor * sorted(self.sizes)[len(self.sizes) // 2]

    @property
    def demand(self) -> float:
        return self.lane.demand

    async def run(self, work: float, demand: float = 0.0, result: Any = None) -> Any:
        """`Stream.run` of the reset lane's stream, for resets that may leave it."""
        stream = self.lane
        limit = self.threshold()
        if work <= limit:
            await stream.run(work, demand)
        else:
            await stream.run(limit, demand)
            pool = self.background.pool
            # Its own demand left the pool with the first part: idle cores beside it are these.
            if not self.limiter.queued or pool.cores - pool.demand - demand >= demand:
                # Nobody waits for the slot, or the lane's slots can grow into idle cores: keep it.
                await stream.run(work - limit, demand)
            else:
                self.limiter.detach()
                self.detached += 1
                await self.slots.acquire()
                try:
                    await self.background.run(work - limit, demand)
                finally:
                    self.slots.release()
        self.sizes.append(work)
        return result


class SimLanes(InProcessLanes):
    """In-process lanes (the production code) whose per-lane slot limit is a `ResizableLimiter`, so the
    simulator can resize it; the run, attach, run_op and stats logic stays `InProcessLanes`'."""

    def __init__(self, config: LanesConfig, pinned: bool) -> None:
        by_name = {LaneName(name): lane for name, lane in config.by_name().items()}
        super().__init__(
            concurrency={name: lane.slots for name, lane in by_name.items()},
            cpus={name: lane.cpus for name, lane in by_name.items()},
            pinned=pinned,
        )
        self.limiters = {name: ResizableLimiter(max(1, lane.slots)) for name, lane in by_name.items()}
        # InProcessLanes takes and returns slots through `acquire()` / `release()` on these objects;
        # a test (tests/sim/test_lanes.py) checks that resizing them bounds the running operations.
        if set(getattr(self, "_sems", {})) != set(self.limiters):
            raise RuntimeError("InProcessLanes no longer keeps one slot limiter per lane in _sems")
        self._sems = self.limiters  # type: ignore[assignment]
