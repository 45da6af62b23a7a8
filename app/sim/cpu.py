"""CPU as a shared resource in the simulator (processor sharing).

Model. A pool has `cores`. Consumers add demand to it: a running sandbox operation demands
`sandbox_demand` cores, a busy engine demands `engine_demand` cores for its serving loop (scheduling,
tokenising, sampling). When the demand D exceeds the cores C, everything in the pool progresses at
rate C / D instead of 1, so a turn or a tool call takes longer in proportion. With shared CPUs there is
one pool for serving and all sandbox work; with pinned lanes serving has its own pool and each lane
has its own, so sandbox load cannot slow serving and a cleanup storm cannot slow tool calls.

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
    def __init__(self, name: str, cores: float) -> None:
        if cores <= 0:
            raise ValueError(f"CPU pool {name!r} needs a positive number of cores, got {cores}")
        self.name = name
        self.cores = cores
        self.demand = 0.0
        self.streams: list[Stream] = []
        self.busy_core_s = 0.0
        self._last = 0.0

    @property
    def rate(self) -> float:
        return 1.0 if self.demand <= self.cores else self.cores / self.demand

    def stream(self, name: str) -> Stream:
        stream = Stream(self, name)
        self.streams.append(stream)
        return stream

    def change_demand(self, delta: float) -> None:
        old_rate = self.rate
        now = asyncio.get_running_loop().time()
        self.busy_core_s += min(self.demand, self.cores) * (now - self._last)
        self._last = now
        if old_rate == 1.0 and self.demand + delta <= self.cores:
            self.demand += delta
            return
        for stream in self.streams:
            stream.settle(now)
        self.demand += delta
        if abs(self.demand) < 1e-9:
            self.demand = 0.0
        if self.rate != old_rate:
            for stream in self.streams:
                stream.reschedule(now)


class Stream:
    def __init__(self, pool: CpuPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self.factor = 1.0
        self.served = 0.0  # service each job of this stream has received since the stream began
        self._last = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def rate(self) -> float:
        return self.pool.rate * self.factor

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
            if when is not None and self._timer.when() == when:
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
            self.pool.change_demand(demand)
        if self._heap[0] is entry or self._timer is None:
            self.reschedule(now)
        try:
            await fut
        finally:
            if demand:
                self.pool.change_demand(-demand)
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
