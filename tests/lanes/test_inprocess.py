"""In-process lanes: bounded concurrency per lane, FIFO order, the lane's CPU set, and the figures."""

from __future__ import annotations

import asyncio

from app.lanes.base import LaneName, LaneSlot
from app.lanes.inprocess import InProcessLanes
from app.sim.clock import run_virtual


def make_lanes(pinned: bool = True, **concurrency: int) -> InProcessLanes:
    slots = {lane: concurrency.get(lane.value, 2) for lane in LaneName}
    cpus = {lane: (i + 1,) for i, lane in enumerate(LaneName)}
    return InProcessLanes(slots, cpus, pinned=pinned)


def test_a_lane_runs_at_most_its_slots_in_fifo_order_and_reports_waits() -> None:
    lanes = make_lanes(exec=2)
    started: list[int] = []
    running = [0]
    peak = [0]

    async def op(i: int, slot: LaneSlot) -> tuple[int, ...] | None:
        started.append(i)
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(10)
        running[0] -= 1
        return slot.cpus

    async def main() -> list[tuple[int, ...] | None]:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(lanes.run(LaneName.EXEC, lambda s, i=i: op(i, s))) for i in range(5)]
        return [t.result() for t in tasks]

    cpus = run_virtual(main())
    assert peak[0] == 2
    assert started == [0, 1, 2, 3, 4]
    assert cpus == [(2,)] * 5  # the exec lane's own CPU set
    stats = lanes.stats()["exec"]
    assert stats.completed == 5
    assert stats.max_queue_depth == 3
    assert stats.wait_s_max == 20  # the fifth op waited for two rounds of 10 s
    assert stats.wait_s_mean == (0 + 0 + 10 + 10 + 20) / 5
    assert stats.busy == 0
    assert stats.queue_depth == 0


def test_lanes_are_independent_a_cleanup_storm_does_not_hold_exec() -> None:
    lanes = make_lanes(cleanup=1, exec=1)
    finished: dict[str, float] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def work(label: str, lane: LaneName, seconds: float) -> None:
            async def op(slot: LaneSlot) -> None:
                await asyncio.sleep(seconds)

            await lanes.run(lane, op)
            finished[label] = loop.time()

        async with asyncio.TaskGroup() as tg:
            for i in range(10):
                tg.create_task(work(f"cleanup{i}", LaneName.CLEANUP, 5))
            tg.create_task(work("exec", LaneName.EXEC, 1))

    run_virtual(main())
    assert finished["exec"] == 1
    assert finished["cleanup9"] == 50


def test_unpinned_lanes_have_no_cpu_set_and_no_bound() -> None:
    lanes = make_lanes(pinned=False, exec=1)
    peak = [0, 0]

    async def op(slot: LaneSlot) -> tuple[int, ...] | None:
        peak[0] += 1
        peak[1] = max(peak[1], peak[0])
        await asyncio.sleep(1)
        peak[0] -= 1
        return slot.cpus

    async def main() -> list[tuple[int, ...] | None]:
        return list(await asyncio.gather(*(lanes.run(LaneName.EXEC, op) for _ in range(4))))

    assert run_virtual(main()) == [None] * 4
    assert peak[1] == 4


def test_a_cancelled_waiter_leaves_the_queue_and_frees_nothing_it_did_not_take() -> None:
    lanes = make_lanes(exec=1)

    async def main() -> int:
        async def hold(slot: LaneSlot) -> None:
            await asyncio.sleep(10)

        first = asyncio.ensure_future(lanes.run(LaneName.EXEC, hold))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(lanes.run(LaneName.EXEC, hold))
        await asyncio.sleep(1)
        second.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
        return lanes.stats()["exec"].queue_depth

    assert run_virtual(main()) == 0


class _Box:
    """A sandbox whose operations take virtual seconds and say what ran."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    async def reset(self, task: object, cpus: object = None) -> object:
        self.log.append(f"reset {self.name}")
        await asyncio.sleep(10)
        return None

    async def cleanup(self, cpus: object = None) -> None:
        self.log.append(f"cleanup {self.name}")


def test_a_sandbox_on_which_no_op_started_is_forgotten_without_cleanup() -> None:
    """Its attempt ended while its reset still queued: it holds nothing. One whose reset started is not
    forgotten (its cleanup op must run), and a forgotten one can take no more ops."""
    from pathlib import Path

    from app.lanes.ops import LaneOp, LaneOpError
    from app.tasks.spec import TaskSpec

    lanes = make_lanes(reset=1)
    log: list[str] = []
    task = TaskSpec(name="t", instruction="", root=Path("."), validation="true")
    first, second = (lanes.attach(_Box(log, name)) for name in ("a", "b"))  # type: ignore[arg-type]
    answers: dict[str, object] = {}

    async def main() -> None:
        running = asyncio.create_task(lanes.run_op(LaneOp.reset(first, task)))
        queued = asyncio.create_task(lanes.run_op(LaneOp.reset(second, task)))
        await asyncio.sleep(1)  # a's reset runs; b's waits for the lane's one slot
        queued.cancel()
        running.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        answers["a"], answers["b"] = lanes.forget(first), lanes.forget(second)
        await lanes.run_op(LaneOp.cleanup(first))
        try:
            await lanes.run_op(LaneOp.cleanup(second))
        except LaneOpError as exc:
            answers["b after"] = str(exc)

    run_virtual(main())
    assert answers["a"] is False
    assert answers["b"] is True
    assert "not attached" in str(answers["b after"])
    assert log == ["reset a", "cleanup a"]  # b never ran anything
