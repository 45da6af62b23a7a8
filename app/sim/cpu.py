"""CPU as a shared resource in the simulator (processor sharing).

Model. A pool has `cores`. Consumers add demand to it: a running sandbox operation demands
`sandbox_demand` cores, a busy engine demands `engine_demand` cores for its serving loop (scheduling,
tokenising, sampling). When the demand D exceeds the cores C, everything in the pool progresses at
rate C / D instead of 1, so a turn or a tool call takes longer in proportion.

An oversubscribed pool also loses efficiency: with load L = D / C > 1 it delivers C / (1 + θ(L − 1))
core-seconds per second instead of C (θ = `thrash`: run-queue switching and cache and memory-bandwidth
contention among far more runnable threads than cores). θ = 0 is pure processor sharing.

Serving is latency-sensitive: co-located sandbox work slows it even when cores are not oversubscribed
(shared caches, memory bandwidth, run-queue jitter on the engine's step loop; the noisy-neighbour
effect). A serving stream's rate is divided by 1 + γ·min(1, sandbox demand / cores), γ = `interference`.

`LanePool` is the sandbox side of a hard serving/sandbox boundary: the sandbox cores, shared by the
four lanes (one stream each). Each lane has a guaranteed number of cores g (its weight's share of the
pool, like cgroup `cpu.weight`) and gets an allocation a of cores by weighted max-min fairness over
the lanes' demands (water-filling): a lane that wants less than its share gets what it wants and the
idle rest goes to the others in proportion to their weights (work-conserving). With
`borrow=False` a lane never gets more than g (hard per-lane partitions, g whole cores). A lane with
demand d > a runs at (a / d)·1 / (1 + θ(d / a − 1)): its own threads contend for its allocation, as
runnable threads of one cgroup do inside its share.

With a `lender` (`lanes.borrow_serving_cpus`, work-conserving lanes only) the sandbox pool also runs
on the serving cores that serving leaves idle, as lanes given the serving CPUs at a CPU weight far
below serving's do: its cores are its own plus max(0, serving cores − serving demand), so serving
always has every core it asks for, and the sandbox cores move whenever the engines' demand does. Work
on borrowed cores still slows serving as a neighbour does: a serving stream's rate is divided by
1 + γ·min(1, borrowed cores in use / serving cores), γ = the lender's `interference`.

Work runs in streams. All jobs of a stream progress at the stream's rate times its own factor (0 while
an engine is paused with `keep`). Each stream tracks the service every one of its jobs has received so
far, so a rate change costs O(streams), not O(jobs).

CPU priority by group age (`GroupedStream`, a lane's `cpu_priority`): the runtime's pinned lanes with
`order: oldest_group` run each sandbox's commands at niceness 4 × its group's age rank among the
groups with an operation running, at most 19 (app.lanes.inprocess). Modelled: inside a contended
lane, each group's operations get the lane's allocation by weighted max-min fairness over the groups,
by the kernel's CFS weight of that niceness per core of the group's demand (each operation is a
process of its own at its group's niceness), instead of alike; each group's operations share its part
as a lane's do. Where the lane is not contended every operation runs at full speed, as before.

Invariants: a job of `work` seconds never finishes sooner than `work` seconds after it starts; in a
`LanePool`, a lane with demand d gets at least min(d, g) cores and the allocations never exceed the
pool's cores (its own plus, with a lender, the lender's idle cores at that moment).
"""

from __future__ import annotations

import asyncio
import heapq
import math
import weakref
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol, TypeVar

from app.sim.clock import VirtualTimeLoop

_EPS = 1e-9
K = TypeVar("K", bound=Hashable)  # a lane's name, or a group's id


def _oversubscribed_rate(demand: float, cores: float, thrash: float) -> float:
    """Rate of each unit of `demand` sharing `cores` (1 when they suffice)."""
    if demand <= cores:
        return 1.0
    load = demand / cores
    # Fair shares of cores that themselves lose efficiency to context switches and cache thrash in
    # proportion to the excess load.
    return 1.0 / (load * (1.0 + thrash * (load - 1.0)))


class RatePool(Protocol):
    """What a stream's jobs draw on: a pool of cores, or a grouped lane for its groups' streams."""

    def change_demand(self, delta: float, stream: Stream | None = None) -> None: ...

    def stream_rate(self, stream: Stream) -> float: ...


class CpuPool:
    """Processor sharing among everything in the pool: one rate for every unit of demand."""

    def __init__(self, name: str, cores: float, thrash: float = 0.0, interference: float = 0.0) -> None:
        if not math.isfinite(cores) or cores <= 0:
            raise ValueError(f"CPU pool {name!r} needs a positive number of cores, got {cores}")
        if thrash < 0 or interference < 0:
            raise ValueError(f"CPU pool {name!r}: thrash and interference must be ≥ 0")
        self.name = name
        self.cores = cores
        self.thrash = thrash
        self.interference = interference
        self.demand = 0.0
        self.sandbox_demand = 0.0
        self.rate = 1.0
        self.serving_factor = 1.0  # slow-down of serving from co-located sandbox work
        self.streams: list[Stream] = []
        self.borrower: LanePool | None = None  # a sandbox pool running on this pool's idle cores
        self.borrowed = 0.0  # cores of this pool the borrower uses now

    def idle_cores(self) -> float:
        return self.cores - self.demand if self.demand < self.cores else 0.0

    def retime(self, change: Callable[[], None]) -> None:
        """Settle every stream's service at the current time, apply `change` to the pool, and give every
        stream its new rate: how anything that changes a pool's rates is carried out."""
        now = _now()
        for s in self.streams:
            s.settle(now)
        change()
        for s in self.streams:
            s.rate_changed(now)

    def set_borrowed(self, cores: float) -> None:
        """The borrower now uses `cores` of this pool's idle cores: serving slows as with a neighbour."""
        if cores == self.borrowed:
            return

        def lend() -> None:
            self.borrowed = cores
            self.serving_factor = self._serving_factor()

        self.retime(lend)

    def _serving_factor(self) -> float:
        neighbours = self.sandbox_demand + self.borrowed
        if self.interference and neighbours:
            return 1.0 / (1.0 + self.interference * min(1.0, neighbours / self.cores))
        return 1.0

    def stream(self, name: str, serving: bool = False) -> Stream:
        stream = Stream(self, name, serving)
        self.streams.append(stream)
        return stream

    def stream_rate(self, stream: Stream) -> float:
        return self.rate * self.serving_factor if stream.serving else self.rate

    def change_demand(self, delta: float, stream: Stream | None = None) -> None:
        """Add `delta` cores of demand; sandbox demand if it comes from a non-serving stream."""
        sandbox = stream is not None and not stream.serving
        new_demand = self.demand + delta
        if self.rate == 1.0 and new_demand <= self.cores and not (sandbox and self.interference):
            self.demand = new_demand  # nothing changes speed: the common, uncontended case
            if self.borrower is not None:
                self.borrower.lender_changed()
            return
        now = _now()
        for s in self.streams:
            s.settle(now)
        self.demand = 0.0 if abs(new_demand) < _EPS else new_demand
        if sandbox:
            self.sandbox_demand += delta
            if abs(self.sandbox_demand) < _EPS:
                self.sandbox_demand = 0.0
        self.rate = _oversubscribed_rate(self.demand, self.cores, self.thrash)
        self.serving_factor = self._serving_factor()
        for s in self.streams:
            s.rate_changed(now)
        if self.borrower is not None:
            self.borrower.lender_changed()


class LanePool(CpuPool):
    """The sandbox cores, shared by lanes with guaranteed shares; work-conserving unless `borrow` is off."""

    def __init__(
        self,
        name: str,
        cores: float,
        guarantees: Mapping[str, float],
        borrow: bool = True,
        thrash: float = 0.0,
        lender: CpuPool | None = None,
    ) -> None:
        super().__init__(name, cores, thrash)
        if not guarantees or any(not math.isfinite(g) or g <= 0 for g in guarantees.values()):
            raise ValueError(f"CPU pool {name!r}: every lane needs a positive guaranteed share")
        if sum(guarantees.values()) > cores * (1 + 1e-9):
            raise ValueError(f"CPU pool {name!r}: guarantees {dict(guarantees)} exceed {cores} cores")
        self.guarantees = dict(guarantees)
        self.borrow = borrow
        self.lanes: dict[str, Stream] = {}
        self.allocation: dict[str, float] = dict.fromkeys(guarantees, 0.0)
        self.max_borrowed = 0.0  # the most cores any lane held beyond its guarantee
        self.own_cores = cores
        self.lender = lender
        self.max_lent = 0.0  # the most of the lender's cores the lanes used at once
        if lender is not None:
            if not borrow:
                raise ValueError(f"CPU pool {name!r}: partitioned lanes cannot borrow serving cores")
            lender.borrower = self
            self.cores = cores + lender.idle_cores()

    def lender_changed(self) -> None:
        """The lender's demand moved: the cores it leaves idle, and so this pool's, follow."""
        assert self.lender is not None
        cores = self.own_cores + self.lender.idle_cores()
        if cores == self.cores:
            return

        def resize() -> None:
            self.cores = cores
            self.allocation = self._allocate()

        self.retime(resize)
        self._lend()

    def _lend(self) -> None:
        """Tell the lender how many of its cores the lanes use now (the demand beyond our own cores)."""
        if self.lender is None:
            return
        used = min(self.demand, self.cores) - self.own_cores
        used = used if used > 0.0 else 0.0
        if used > self.max_lent:
            self.max_lent = used
        self.lender.set_borrowed(used)

    def stream(self, name: str, serving: bool = False) -> Stream:
        if name not in self.guarantees:
            raise ValueError(f"CPU pool {self.name!r} has no lane {name!r}")
        stream = super().stream(name, serving)
        self.lanes[name] = stream
        return stream

    def grouped_stream(self, name: str, ranks: GroupRanks) -> GroupedStream:
        """The stream of lane `name`, shared among its groups by their CPU weights in `ranks`."""
        if name not in self.guarantees:
            raise ValueError(f"CPU pool {self.name!r} has no lane {name!r}")
        stream = GroupedStream(self, name, ranks)
        ranks.pools[self] = None
        self.streams.append(stream)
        self.lanes[name] = stream
        return stream

    def contended(self) -> bool:
        """Whether any lane wants more cores than it has now."""
        return any(s.demand > self.allocation[name] + _EPS for name, s in self.lanes.items())

    def stream_rate(self, stream: Stream) -> float:
        demand = stream.demand
        alloc = self.allocation[stream.name]
        if demand <= alloc + _EPS:
            return 1.0
        return _oversubscribed_rate(demand, alloc, self.thrash) if alloc > 0 else 0.0

    def change_demand(self, delta: float, stream: Stream | None = None) -> None:
        if stream is None:
            raise ValueError("demand in a lane pool belongs to a lane")
        new_demand = stream.demand + delta
        demand = stream.demand = 0.0 if -_EPS < new_demand < _EPS else new_demand
        old_total = self.demand
        total = old_total + delta
        total = self.demand = total if total > 0.0 else 0.0  # max(0, total), without the call
        if self.borrow and total <= self.cores and old_total <= self.cores:
            # Every lane gets all it wants before and after: no rate changes.
            name = stream.name
            self.allocation[name] = demand
            borrowed = demand - self.guarantees[name]
            if borrowed > self.max_borrowed:
                self.max_borrowed = borrowed
            if self.lender is not None and (total > self.own_cores or old_total > self.own_cores):
                self._lend()
            return
        if not self.borrow and stream.demand <= self.guarantees[stream.name] and stream.rate == 1.0:
            self.allocation[stream.name] = stream.demand
            return
        now = _now()
        for s in self.streams:
            s.settle(now)
        self.allocation = self._allocate()
        for name, alloc in self.allocation.items():
            self.max_borrowed = max(self.max_borrowed, alloc - self.guarantees[name])
        for s in self.streams:
            s.rate_changed(now)
        self._lend()

    def set_guarantees(self, weights: Mapping[str, float]) -> None:
        """New guaranteed shares: the sandbox cores split in proportion to `weights` (work-conserving
        pools only; a partition's cores are fixed)."""
        if not self.borrow:
            raise ValueError(f"CPU pool {self.name!r}: partitioned lanes have fixed cores")
        total = sum(weights.values())
        if set(weights) != set(self.guarantees) or not total > 0 or not math.isfinite(total):
            raise ValueError(f"CPU pool {self.name!r}: weights {dict(weights)} must be positive per lane")

        def reweigh() -> None:
            # Guaranteed shares are of the pool's own cores: cores borrowed from serving come and go.
            self.guarantees = {lane: self.own_cores * w / total for lane, w in weights.items()}
            self.allocation = self._allocate()

        self.retime(reweigh)

    def entitlement(self, lane: str) -> float:
        """The cores `lane` would get if it wanted every core, the other lanes' demand as it is."""
        if not self.borrow:
            return self.guarantees[lane]
        demand = self._demand()
        demand[lane] = self.cores
        return water_fill(demand, self.guarantees, self.cores)[lane]

    def _demand(self) -> dict[str, float]:
        """Each lane's demand now (0 for a lane with no stream yet)."""
        return {name: self.lanes[name].demand if name in self.lanes else 0.0 for name in self.guarantees}

    def _allocate(self) -> dict[str, float]:
        demand = self._demand()
        if not self.borrow:
            return {name: min(d, self.guarantees[name]) for name, d in demand.items()}
        return water_fill(demand, self.guarantees, self.cores)


def water_fill(demand: Mapping[K, float], weights: Mapping[K, float], cores: float) -> dict[K, float]:
    """Weighted max-min fair allocation of `cores` among `demand`: nobody gets more than it asks, and
    the cores nobody takes are split in proportion to `weights` among those that want more. Every sum runs
    in `demand`'s order (a dict, not a set: a set of names iterates in an order that changes from one
    process to the next with string hashing, and float sums in another order differ in the last bit,
    which moved a cpu-scarce simulation's event times by one ulp from one process to the next)."""
    alloc = dict.fromkeys(demand, 0.0)
    wanting = dict.fromkeys(name for name, d in demand.items() if d > 0)
    left = cores
    while wanting and left > _EPS:
        total_w = sum(weights[name] for name in wanting)
        fair = {name: left * weights[name] / total_w for name in wanting}
        sated = [name for name in wanting if demand[name] - alloc[name] <= fair[name] + _EPS]
        if not sated:
            for name in wanting:
                alloc[name] += fair[name]
            break
        for name in sated:
            left -= demand[name] - alloc[name]
            alloc[name] = demand[name]
            del wanting[name]
    return alloc


_Future = asyncio.Future
_heappush = heapq.heappush


def _now() -> float:
    return asyncio.get_running_loop().time()


class Stream:
    def __init__(self, pool: RatePool, name: str, serving: bool = False) -> None:
        self.pool = pool
        self.name = name
        self.serving = serving
        self.factor = 1.0
        self.demand = 0.0  # cores its running jobs ask for (lane pools only)
        self.rate = 1.0
        self.served = 0.0  # service each job of this stream has received since the stream began
        self._last = 0.0
        # Jobs by the service at which each finishes: a heap of those targets (floats, compared in C
        # without a tuple's steps) and, for each, its job's future or, when several share it, their
        # futures in the order they began; the same order as a heap of (target, seq, future) entries.
        self._heap: list[float] = []
        self._jobs: dict[float, Any] = {}
        self._timer: int | None = None  # token of the pending `call_fast` timer
        self._timer_when = math.inf
        self._loop: VirtualTimeLoop | None = None

    def settle(self, now: float) -> None:
        self.served += (now - self._last) * self.rate
        self._last = now

    def rate_changed(self, now: float) -> None:
        """The pool changed its rates; the pool has settled this stream at `now` already."""
        rate = self.pool.stream_rate(self) * self.factor
        if rate != self.rate:
            self.rate = rate
            self.reschedule(now)

    def reschedule(self, now: float) -> None:
        heap = self._heap
        jobs = self._jobs
        while heap:  # cancelled jobs leave lazily
            waiting = jobs[heap[0]]
            if type(waiting) is list:
                if not all(fut.done() for fut in waiting):
                    break
            elif not waiting.done():
                break
            del jobs[heapq.heappop(heap)]
        if not heap or self.rate <= 0.0:
            self._timer = None  # a pending timer becomes stale and fires for nothing
            self._timer_when = math.inf
            return
        wait = (heap[0] - self.served) / self.rate
        when = now + (wait if wait > 0.0 else 0.0)  # max(0, wait)
        if self._timer is not None and self._timer_when <= when:
            return  # a timer due no later than needed may stay: firing early only re-arms it
        assert self._loop is not None
        self._timer_when = when
        self._timer = self._loop.call_fast(when, self._fire)

    def set_factor(self, factor: float) -> None:
        now = _now()
        self.settle(now)
        self.factor = factor
        self.rate_changed(now)

    async def run(self, work: float, demand: float = 0.0, result: Any = None) -> Any:
        """Do `work` seconds of full-speed work, adding `demand` cores to the pool meanwhile; then
        return `result` (so that a simulated operation can return this coroutine itself, a frame less)."""
        loop = self._loop
        if loop is None:
            running = asyncio.get_running_loop()
            if not isinstance(running, VirtualTimeLoop):
                raise RuntimeError("simulated CPU pools run only on the virtual-time loop")
            loop = self._loop = running
        now = loop._virtual_now  # `loop.time()` without the call
        served = self.served = self.served + (now - self._last) * self.rate  # `settle`
        self._last = now
        fut: asyncio.Future[None] = _Future(loop=loop)  # `create_future` without its frame
        target = served + (work if work > 0.0 else 0.0)  # max(0, work)
        heap = self._heap
        jobs = self._jobs
        other = jobs.get(target)
        if other is None:
            jobs[target] = fut
            _heappush(heap, target)
            first = heap[0] is target
        else:  # a job began earlier with the same target: it stays ahead
            if type(other) is list:
                other.append(fut)
            else:
                jobs[target] = [other, fut]
            first = False
        if demand:
            self.pool.change_demand(demand, self)
        if first or self._timer is None:
            self.reschedule(now)
        try:
            await fut
        finally:
            if demand:
                self.pool.change_demand(-demand, self)
            if not fut.done():
                fut.cancel()  # leaves the heap lazily; the stream's timer skips it when it fires
        return result

    def _fire(self, token: int) -> None:
        if token != self._timer:
            return  # superseded by an earlier timer, or no job is waiting any more
        self._timer = None
        self._timer_when = math.inf
        assert self._loop is not None
        now = self._loop._virtual_now
        served = self.served = self.served + (now - self._last) * self.rate  # `settle`
        self._last = now
        limit = served + 1e-9 * (served if served > 1.0 else 1.0)  # served + 1e-9·max(1, served)
        heap = self._heap
        jobs = self._jobs
        while heap and heap[0] <= limit:
            waiting = jobs.pop(heapq.heappop(heap))
            if type(waiting) is list:
                for fut in waiting:
                    if not fut.done():
                        fut.set_result(None)
            elif not waiting.done():
                waiting.set_result(None)
        self.reschedule(now)  # drops the cancelled jobs now at the head


# The kernel's CFS weight of each niceness from 0 to 19 (`sched_prio_to_weight`): each level gets about
# 1.25 times less CPU than the one before when they contend.
NICE_WEIGHT = (1024, 820, 655, 526, 423, 335, 272, 215, 172, 137, 110, 87, 70, 56, 45, 36, 29, 23, 18, 15)


class GroupRanks:
    """The groups with an operation running in any lane of a pool, ranked by age (a lower group id is an
    older group: ids are given in admission order), and the CPU weight of each: the niceness `step` ×
    its rank, at most 19, as the runtime's lanes give them (app.lanes.inprocess, `NICE_STEP`)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.pools: dict[LanePool, None] = {}  # a dict: retimed in a fixed order
        self._running: dict[int, int] = {}  # group -> its lanes with demand
        self._weights: dict[int, float] | None = None

    def weight(self, group: int) -> float:
        weights = self._weights
        if weights is None:
            step, last = self.step, len(NICE_WEIGHT) - 1
            weights = self._weights = {
                g: float(NICE_WEIGHT[min(last, step * i)]) for i, g in enumerate(sorted(self._running))
            }
        return weights.get(group, float(NICE_WEIGHT[0]))

    def busy(self, group: int, busy: bool) -> None:
        """A lane of `group` gained its first running operation (`busy`) or lost its last one: when that
        changes which groups run, every rank after it moves, and so do the rates of contended lanes."""
        running = self._running
        before = running.get(group, 0)
        count = before + (1 if busy else -1)
        if count > 0:
            running[group] = count
        else:
            del running[group]
        if (before > 0) == (count > 0):
            return  # it still runs elsewhere, or already did: no rank moves
        self._weights = None
        for pool in self.pools:
            if pool.contended():
                pool.retime(_nothing)


def _nothing() -> None:
    return None


class _GroupStream(Stream):
    """One group's operations in a `GroupedStream`: a stream of its own, with the group's share's rate."""

    def __init__(self, lane: GroupedStream, group: int) -> None:
        super().__init__(lane, lane.name)
        self.group = group


class GroupedStream(Stream):
    """A lane's stream with CPU priority by group age: its pool sees one lane (its demand, its
    allocation), while its operations run in one stream per group (`for_group`), each at the rate of
    the group's part of the lane's allocation (weighted max-min by `GroupRanks.weight`) over the group's
    demand, slowed by thrash as the whole lane is. Jobs are never run on the lane stream itself."""

    def __init__(self, pool: LanePool, name: str, ranks: GroupRanks) -> None:
        super().__init__(pool, name)
        self.lane_pool = pool
        self.ranks = ranks
        # Each group's stream while any of its sandboxes holds it; those with demand, in the order they
        # gained it (rates are computed and timers armed in that order, so a seed replays exactly).
        self._groups: weakref.WeakValueDictionary[int, _GroupStream] = weakref.WeakValueDictionary()
        self._busy: dict[int, _GroupStream] = {}
        self._shares: dict[int, float] | None = None

    def for_group(self, group: int) -> Stream:
        stream = self._groups.get(group)
        if stream is None:
            stream = self._groups[group] = _GroupStream(self, group)
        return stream

    async def run(self, work: float, demand: float = 0.0, result: Any = None) -> Any:
        raise RuntimeError(f"lane {self.name!r} shares its cores by group: run work on `for_group(g)`")

    def settle(self, now: float) -> None:
        for stream in self._busy.values():
            stream.settle(now)

    def rate_changed(self, now: float) -> None:
        self.rate = self.lane_pool.stream_rate(self)
        self._shares = None
        for stream in self._busy.values():
            stream.rate_changed(now)

    # -- the pool of its group streams ---------------------------------------------------------

    def change_demand(self, delta: float, stream: Stream | None = None) -> None:
        assert isinstance(stream, _GroupStream)
        group = stream.group
        demand = stream.demand + delta
        if demand > _EPS:
            stream.demand = demand
            began = group not in self._busy
            if began:  # (its `run` settled it at this time already)
                self._busy[group] = stream
            self.lane_pool.change_demand(delta, self)  # retimes the lanes when contended
            if began:
                self.ranks.busy(group, True)
        else:
            now = _now()
            stream.settle(now)
            stream.demand = 0.0
            del self._busy[group]
            self.lane_pool.change_demand(delta, self)
            self.ranks.busy(group, False)
            if stream.rate != 1.0:  # idle: a later operation starts at whatever rate its lane gives
                stream.rate = 1.0
                stream.reschedule(now)

    def stream_rate(self, stream: Stream) -> float:
        lane_demand, alloc = self.demand, self.lane_pool.allocation[self.name]
        if lane_demand <= alloc + _EPS or not isinstance(stream, _GroupStream) or stream.demand <= 0.0:
            return 1.0
        if alloc <= 0.0:
            return 0.0
        shares = self._shares
        if shares is None:
            busy = self._busy
            # Each operation is its own process at its group's niceness, so a group weighs its
            # weight per core of demand (all alike, this is the lane's plain processor sharing).
            weight = self.ranks.weight
            shares = self._shares = water_fill(
                {g: s.demand for g, s in busy.items()},
                {g: weight(g) * s.demand for g, s in busy.items()},
                alloc,
            )
        # Its part of the lane's cores over its demand, with the lane's thrash at the lane's load.
        load = lane_demand / alloc
        share = shares.get(stream.group, 0.0) / stream.demand
        return min(1.0, share) / (1.0 + self.lane_pool.thrash * (load - 1.0))
