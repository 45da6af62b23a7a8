"""CPU as a shared resource in the simulator (processor sharing).

Model. A pool has `cores`. Consumers add demand to it: a running sandbox operation demands
`sandbox_demand` cores, a busy engine demands `engine_demand` cores for its serving loop (scheduling,
tokenising, sampling). When the demand D exceeds the cores C, everything in the pool progresses at
rate C / D instead of 1, so a turn or a tool call takes longer in proportion. With shared CPUs there is
one pool for serving and all sandbox work; with pinned lanes serving has its own pool and each lane
has its own, so sandbox load cannot slow serving and a cleanup storm cannot slow tool calls.

An oversubscribed pool also loses efficiency: with load L = D / C > 1 it delivers C / (1 + θ(L − 1))
core-seconds per second instead of C (θ = `thrash`: run-queue switching and cache and memory-bandwidth
contention among far more runnable threads than cores). θ = 0 is pure processor sharing.

Serving is latency-sensitive: co-located sandbox work slows it even when cores are not oversubscribed
(shared caches, memory bandwidth, run-queue jitter on the engine's step loop; the noisy-neighbour
effect). A serving stream's rate is divided by 1 + γ·min(1, sandbox demand / cores), γ = `interference`.
Pinned lanes put serving in a pool with no sandbox work, so γ has no effect there.

Work runs in streams. All jobs of a stream progress at the pool's rate times the stream's own factor
(0 while an engine is paused with `keep`). Each stream tracks the service every one of its jobs has
received so far, so a rate change costs O(streams), not O(jobs).

Invariant: a job of `work` seconds never finishes sooner than `work` seconds after it starts.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class CpuPool:
    def __init__(self, name: str, cores: float, thrash: float = 0.0, interference: float = 0.0) -> None:
        if cores <= 0:
            raise ValueError(f"CPU pool {name!r} needs a positive number of cores, got {cores}")
        if thrash < 0 or interference < 0:
            raise ValueError(f"CPU pool {name!r}: thrash and interference must be ≥ 0")
        self.name = name
        self.cores = cores
        self.thrash = thrash
        self.interference = interference
        self.demand = 0.0
        self.sandbox_demand = 0.0
        self.streams: list[Stream] = []

    @property
    def rate(self) -> float:
        if self.demand <= self.cores:
            return 1.0
        load = self.demand / self.cores
        # Oversubscribed: fair shares of a pool that itself loses efficiency to context switches and
        # cache thrash in proportion to the excess load.
        return 1.0 / (load * (1.0 + self.thrash * (load - 1.0)))

    @property
    def serving_factor(self) -> float:
        """Slow-down of latency-sensitive serving from co-located sandbox work (noisy neighbours)."""
        if not self.interference or not self.sandbox_demand:
            return 1.0
        return 1.0 / (1.0 + self.interference * min(1.0, self.sandbox_demand / self.cores))

    def stream(self, name: str, serving: bool = False) -> Stream:
        stream = Stream(self, name, serving)
        self.streams.append(stream)
        return stream

    def change_demand(self, delta: float, sandbox: bool = False) -> None:
        old = (self.rate, self.serving_factor)
        new_demand = self.demand + delta
        if old == (1.0, 1.0) and new_demand <= self.cores and not (sandbox and self.interference):
            self.demand = new_demand
            return
        now = asyncio.get_running_loop().time()
        for stream in self.streams:
            stream.settle(now)
        self.demand = 0.0 if abs(new_demand) < 1e-9 else new_demand
        if sandbox:
            self.sandbox_demand += delta
            if abs(self.sandbox_demand) < 1e-9:
                self.sandbox_demand = 0.0
        rate_changed = self.rate != old[0]
        serving_changed = self.serving_factor != old[1]
        for stream in self.streams:
            if rate_changed or (serving_changed and stream.serving):
                stream.reschedule(now)


class Stream:
    def __init__(self, pool: CpuPool, name: str, serving: bool = False) -> None:
        self.pool = pool
        self.name = name
        self.serving = serving
        self.factor = 1.0
        self.served = 0.0  # service each job of this stream has received since the stream began
        self._last = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def rate(self) -> float:
        rate = self.pool.rate * self.factor
        return rate * self.pool.serving_factor if self.serving else rate

    def settle(self, now: float) -> None:
        self.served += (now - self._last) * self.rate
        self._last = now

    def reschedule(self, now: float) -> None:
        while self._heap and self._heap[0][2].done():
            heapq.heappop(self._heap)  # cancelled jobs leave lazily
        rate = self.rate
        when = None
        if self._heap and rate > 0.0:
            when = now + max(0.0, (self._heap[0][0] - self.served) / rate)
        if self._timer is not None:
            # A timer due no later than needed may stay: firing early only re-arms it. Cancelling
            # and re-creating timers on every rate change would churn the loop's timer heap.
            if when is not None and self._timer.when() <= when:
                return
            self._timer.cancel()
            self._timer = None
        if when is not None:
            self._timer = asyncio.get_running_loop().call_at(when, self._fire)

    def set_factor(self, factor: float) -> None:
        now = asyncio.get_running_loop().time()
        self.settle(now)
        self.factor = factor
        self.reschedule(now)

    async def run(self, work: float, demand: float = 0.0) -> None:
        """Do `work` seconds of full-speed work, adding `demand` cores to the pool meanwhile."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.settle(now)
        fut: asyncio.Future[None] = loop.create_future()
        entry = (self.served + max(0.0, work), next(self._seq), fut)
        heapq.heappush(self._heap, entry)
        if demand:
            self.pool.change_demand(demand, sandbox=not self.serving)
        if self._heap[0] is entry or self._timer is None:
            self.reschedule(now)
        try:
            await fut
        finally:
            if demand:
                self.pool.change_demand(-demand, sandbox=not self.serving)
            if not fut.done():
                fut.cancel()  # leaves the heap lazily; the stream's timer skips it when it fires

    def _fire(self) -> None:
        self._timer = None
        now = asyncio.get_running_loop().time()
        self.settle(now)
        eps = 1e-9 * max(1.0, self.served)
        while self._heap and (self._heap[0][0] <= self.served + eps or self._heap[0][2].done()):
            _, _, fut = heapq.heappop(self._heap)
            if not fut.done():
                fut.set_result(None)
        self.reschedule(now)
