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

The controller, its spec and `ResizableLimiter` live in app.lanes.adaptive, which real in-process lanes
use too (with the idle-cores rule, in wall time). The decisions are pure (no clock, no I/O);
`ResizableLimiter`, `LanePool.set_guarantees` and `LongOps` carry them out.

Invariants: a lane runs at most its current slots at once, not counting operations that left it
(`ResizableLimiter.detach`; after a shrink, running operations finish and no new one starts until the
lane is under its slots again); waiters are served in FIFO order; slots stay within
[1, `max_factor` × configured] (with `overload` None, [configured, `max_factor` × configured]); the
background runs at most its own slots of long resets at once.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Coroutine
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.lanes.adaptive import ResizableLimiter
from app.sim.cpu import CpuPool, Stream


class LaneSharing(StrEnum):
    WORK_CONSERVING = "work_conserving"
    PARTITIONED = "partitioned"


class LaneWeights(BaseModel):
    """Guaranteed share of the sandbox cores per lane (relative weights, like cgroup `cpu.weight`)."""

    # At least 1e-6: a weight of 1e-320 against 1e6 gave its lane a share of 0 cores (a crash).
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)
    reset: float = Field(ge=1e-6, le=1e6, strict=True, description="weight of the reset lane")
    exec: float = Field(ge=1e-6, le=1e6, strict=True, description="weight of the exec lane")
    validate_: float = Field(
        ge=1e-6, le=1e6, strict=True, alias="validate", description="weight of the validate lane"
    )
    cleanup: float = Field(ge=1e-6, le=1e6, strict=True, description="weight of the cleanup lane")

    def by_lane(self) -> dict[str, float]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}


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
        self._sorted: list[float] = []  # the same, in order: the median without a sort per reset
        self.slots = ResizableLimiter(1)  # resized to the background's cores by the controller
        self.detached = 0

    def record(self, work: float) -> None:
        """A reset of `work` seconds of service completed: it joins the window the median is taken from."""
        ordered = self._sorted
        if len(self.sizes) == self.sizes.maxlen:
            del ordered[bisect.bisect_left(ordered, self.sizes[0])]  # the oldest leaves the window
        self.sizes.append(work)
        bisect.insort(ordered, work)

    def threshold(self) -> float:
        ordered = self._sorted
        if len(ordered) < 16:
            return math.inf
        return self.factor * ordered[len(ordered) // 2]

    @property
    def demand(self) -> float:
        return self.lane.demand

    async def run(
        self, work: float, demand: float = 0.0, result: Any = None, lane: Stream | None = None
    ) -> Any:
        """`Stream.run` of the reset lane's stream (or of `lane`, a group's part of it, when the lane
        shares its cores by group age), for resets that may leave it."""
        stream = self.lane if lane is None else lane
        limit = self.threshold()
        if work <= limit:
            await stream.run(work, demand)
        else:
            await stream.run(limit, demand)
            pool = self.background.pool
            assert isinstance(pool, CpuPool)
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
        self.record(work)
        return result


class GroupLongOps:
    """`LongOps` for one group's resets, where the reset lane shares its cores by group age
    (app.sim.cpu.GroupedStream): they run in the group's stream of the lane until they leave it."""

    __slots__ = ("lane", "long")

    def __init__(self, long: LongOps, lane: Stream) -> None:
        self.long = long
        self.lane = lane

    def run(self, work: float, demand: float = 0.0, result: Any = None) -> Coroutine[Any, Any, Any]:
        return self.long.run(work, demand, result, self.lane)
