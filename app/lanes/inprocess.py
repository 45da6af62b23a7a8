"""In-process lanes: one bounded pool per lane, each with its own CPU set.

Invariant: at most `limiters[lane].slots` operations of a lane run at once (`concurrency[lane]` unless
adaptive lanes resized it, app.lanes.adaptive). An operation waits for a slot in FIFO order, or, with
`order` `oldest_group`, behind the queued operations of older groups only. With
`pinned=False` there is one shared, unbounded pool and no CPU set, which is the ablation baseline
("shared CPUs").

CPU priority (`cpu_priority`, with `oldest_group`): the groups with an operation running are ranked by
age, and a sandbox that can (`set_nice`, local sandboxes) runs its commands at niceness
`NICE_STEP` × its group's rank, at most `MAX_NICE`: the oldest running group's work at 0. The ranks
are set again whenever an operation starts or ends, so a group moves up as older ones finish. Sandbox
work of one lane shares the lane's CPU share (`app.sandboxes.cpushare`) by these nice values, so an old
group's set-ups are not slowed by every younger group's; lowering a niceness needs CAP_SYS_NICE, so the
runtime turns this on only where it has that (`may_raise_priority`).

A `LaneOp` runs through `app.lanes.ops.execute_op` on the live sandbox object that `attach` registered
under the op's handle (this process is the only host); the registration ends with the sandbox's
cleanup op, or with `forget` for a sandbox on which no op ever started (nothing to clean up).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from app.core.config import LaneOrder, LanesConfig
from app.lanes.adaptive import ResizableLimiter
from app.lanes.base import LaneName, LaneSlot, LaneStats
from app.lanes.ops import LaneOp, LaneOpError, SandboxHandle, execute_op, handle_of, local_host
from app.sandboxes.base import Sandbox

T = TypeVar("T")

# A younger running group's sandbox commands run this much nicer per older running group: the kernel
# weighs nice n against nice 0 at about 1.25^-n, so one step is about 2.4 times less CPU.
NICE_STEP = 4
MAX_NICE = 19


def may_raise_priority() -> bool:
    """Whether this process may lower a niceness again (CAP_SYS_NICE, taken here as running as root):
    without it a group niced while young would stay so once it is the oldest."""
    return os.geteuid() == 0


class InProcessLanes:
    def __init__(
        self,
        concurrency: Mapping[LaneName, int],
        cpus: Mapping[LaneName, tuple[int, ...] | None],
        pinned: bool = True,
        order: LaneOrder = LaneOrder.FIFO,
        cpu_priority: bool = False,
    ) -> None:
        self.pinned = pinned
        self.order = order
        # Both are a lane technique: unpinned lanes (the ablation baseline) share CPUs as they come.
        self.cpu_priority = cpu_priority and pinned and order is LaneOrder.OLDEST_GROUP
        self._by_group = pinned and order is LaneOrder.OLDEST_GROUP
        # op id -> (group, the sandbox's `set_nice`) of each running op whose sandbox can be reniced
        self._niceable: dict[str, tuple[int, Callable[[int], None]]] = {}
        self._cpus = dict(cpus)
        # One resizable slot limit per lane: adaptive lanes (app.lanes.adaptive) resize them.
        self.limiters = {lane: ResizableLimiter(max(1, concurrency[lane])) for lane in LaneName}
        self._configured = {lane: max(1, concurrency[lane]) for lane in LaneName}
        self._stats = {lane: LaneStats() for lane in LaneName}
        self._host = local_host()
        self._live: dict[str, Sandbox] = {}
        self._untouched: set[str] = set()  # attached sandboxes on which no op has started yet

    def describe(self) -> dict[str, dict[str, object]]:
        """Each lane's slots now, its configured slots and its CPU set (None: unpinned), for the
        dashboard's lanes panel."""
        return {
            lane.value: {
                "slots": self.limiters[lane].slots,
                "configured": self._configured[lane],
                "cpus": self._cpus.get(lane),
                "order": self.order.value,
                "cpu_priority": self.cpu_priority,
            }
            for lane in LaneName
        }

    @classmethod
    def from_config(
        cls, config: LanesConfig, pinned: bool, cpu_priority: bool | None = None
    ) -> InProcessLanes:
        """Lanes as `config` describes them; CPU priority (with `oldest_group`) by default wherever this
        process may raise a niceness again."""
        if cpu_priority is None:
            cpu_priority = may_raise_priority()
        lanes = {LaneName(name): lane for name, lane in config.by_name().items()}
        return cls(
            concurrency={name: lane.slots for name, lane in lanes.items()},
            cpus={name: lane.cpus for name, lane in lanes.items()},
            pinned=pinned,
            order=config.order,
            cpu_priority=cpu_priority,
        )

    def _enter_now(self, lane: LaneName, stats: LaneStats) -> bool:
        """Take a slot of `lane` if one is free and nobody queues before us, keeping its stats as
        `_enter` would (a wait of 0); False when the op must queue (then `_enter`)."""
        if self.pinned:
            if not self.limiters[lane].try_acquire():
                return False
            if stats.queue_depth >= stats.max_queue_depth:
                stats.max_queue_depth = stats.queue_depth + 1
        stats.busy += 1
        if stats.busy > stats.max_busy:
            stats.max_busy = stats.busy
        return True

    async def _enter(self, lane: LaneName, stats: LaneStats, group: int = 0) -> None:
        """Take a slot of `lane` (in the lanes' `order`), keeping its stats."""
        if self.pinned:
            loop = asyncio.get_running_loop()
            queued_at = loop.time()
            stats.queue_depth += 1
            if stats.queue_depth > stats.max_queue_depth:
                stats.max_queue_depth = stats.queue_depth
            try:
                await self.limiters[lane].acquire(group if self._by_group else 0)
            finally:
                stats.queue_depth -= 1
            waited = loop.time() - queued_at
            stats.wait_s_total += waited
            if waited > stats.wait_s_max:
                stats.wait_s_max = waited
        stats.busy += 1
        if stats.busy > stats.max_busy:
            stats.max_busy = stats.busy

    def _leave(self, lane: LaneName, stats: LaneStats) -> None:
        stats.busy -= 1
        stats.completed += 1
        if self.pinned:
            self.limiters[lane].release()

    async def run(self, lane: LaneName, op: Callable[[LaneSlot], Awaitable[T]]) -> T:
        stats = self._stats[lane]
        if not self._enter_now(lane, stats):
            await self._enter(lane, stats)
        try:
            return await op(LaneSlot(lane, self._cpus.get(lane) if self.pinned else None))
        finally:
            self._leave(lane, stats)

    def attach(self, sandbox: Sandbox) -> SandboxHandle:
        handle = handle_of(sandbox, self._host)
        self._live[handle.id] = sandbox
        self._untouched.add(handle.id)
        return handle

    def forget(self, handle: SandboxHandle) -> bool:
        """Drop a sandbox on which no op ever started (its attempt ended while its reset still queued):
        it holds nothing, so it needs no cleanup op. False, and nothing dropped, once one has started."""
        if handle.id not in self._untouched:
            return False
        self._untouched.discard(handle.id)
        self._live.pop(handle.id, None)
        return True

    async def run_op(self, op: LaneOp[T], on_start: Callable[[], None] | None = None, group: int = 0) -> T:
        sandbox = self._live.get(op.handle.id)
        if sandbox is None:
            raise LaneOpError(f"op {op.name.value} on sandbox {op.handle.id!r}: not attached to these lanes")

        lane = op.name
        stats = self._stats[lane]
        # `run`, without its closure and slot object, and without a coroutine of its own to take a free
        # slot (this is the simulator's hot path)
        pinned = self.pinned
        limiter = self.limiters[lane]
        try:
            # `_enter_now` inline: a free slot, nobody queued before us
            if pinned and not limiter.try_acquire():
                await self._enter(lane, stats, group)
            else:
                if pinned and stats.queue_depth >= stats.max_queue_depth:
                    stats.max_queue_depth = stats.queue_depth + 1
                stats.busy += 1
                if stats.busy > stats.max_busy:
                    stats.max_busy = stats.busy
            niced = False
            try:
                self._untouched.discard(op.handle.id)
                if on_start is not None:
                    on_start()
                if self.cpu_priority and (set_nice := getattr(sandbox, "set_nice", None)) is not None:
                    self._niceable[op.op_id] = (group, set_nice)
                    niced = True
                    self._rank()
                return await execute_op(op, sandbox, self._cpus.get(lane) if pinned else None)
            finally:  # `_leave`
                if niced:
                    del self._niceable[op.op_id]
                    self._rank()
                stats.busy -= 1
                stats.completed += 1
                if pinned:
                    limiter.release()
        finally:
            if lane is LaneName.CLEANUP:
                self._live.pop(op.handle.id, None)

    def _rank(self) -> None:
        """Give every running op's sandbox the niceness of its group's rank among the running groups."""
        running = self._niceable.values()
        rank = {group: i for i, group in enumerate(sorted({group for group, _ in running}))}
        for group, set_nice in running:
            set_nice(min(MAX_NICE, NICE_STEP * rank[group]))

    def stats(self) -> dict[str, LaneStats]:
        return {lane.value: s for lane, s in self._stats.items()}
