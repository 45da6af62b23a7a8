"""Lanes ordered oldest group first: the slot queue, the niceness the lanes hand to sandboxes, and, on
this machine's real processes, the CPU an older group's command gets against a younger one's."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest
from factories import make_echo_task
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.config import LaneOrder
from app.lanes.adaptive import ResizableLimiter
from app.lanes.base import LaneName
from app.lanes.inprocess import MAX_NICE, NICE_STEP, InProcessLanes
from app.lanes.ops import LaneOp
from app.sandboxes.base import ExecResult
from app.sandboxes.local import LocalSandboxFactory
from app.sim.clock import run_virtual
from app.tasks.spec import TaskSpec

ROOT = os.geteuid() == 0


def lanes_of(order: LaneOrder, cpu_priority: bool = False, **slots: int) -> InProcessLanes:
    concurrency = {lane: slots.get(lane.value, 4) for lane in LaneName}
    return InProcessLanes(concurrency, dict.fromkeys(LaneName), True, order, cpu_priority)


@settings(max_examples=200, deadline=None)
@given(
    slots=st.integers(1, 3),
    waiters=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30),
)
def test_waiters_take_slots_lowest_order_first_then_by_arrival_and_cancelled_ones_take_none(
    slots: int, waiters: list[tuple[int, bool]]
) -> None:
    """`waiters` arrive in turn while every slot is held; those marked True are cancelled before any
    slot frees. The rest get slots in (order, arrival) order, never more at once than `slots`."""
    limiter = ResizableLimiter(slots)
    woken: list[int] = []
    peak = [0]

    async def wait(i: int, order: int) -> None:
        await limiter.acquire(order)
        woken.append(i)
        peak[0] = max(peak[0], limiter.busy)
        await asyncio.sleep(1)
        limiter.release()

    async def main() -> None:
        for _ in range(slots):
            assert limiter.try_acquire()
        tasks = []
        for i, (order, _) in enumerate(waiters):
            tasks.append(asyncio.create_task(wait(i, order)))
            await asyncio.sleep(0)
        for task, (_, cancel) in zip(tasks, waiters, strict=True):
            if cancel:
                task.cancel()
        await asyncio.sleep(0)
        for _ in range(slots):
            limiter.release()
        await asyncio.gather(*tasks, return_exceptions=True)

    run_virtual(main())
    kept = [(order, i) for i, (order, cancel) in enumerate(waiters) if not cancel]
    assert woken == [i for _, i in sorted(kept)]
    assert peak[0] <= slots
    assert limiter.busy == 0
    assert limiter.queued == 0
    assert limiter.try_acquire()  # nothing left in the queue holds a free slot back


class _Box:
    """A sandbox whose reset takes 10 virtual seconds and logs its name; it records its niceness."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name
        self.nices: list[int] = []

    async def reset(self, task: object, cpus: object = None) -> ExecResult:
        self.log.append(self.name)
        await asyncio.sleep(10)
        return ExecResult(0, "")

    async def cleanup(self, cpus: object = None) -> None:
        pass

    def set_nice(self, nice: int) -> None:
        self.nices.append(nice)


TASK = TaskSpec(name="t", instruction="", root=Path("."), validation="true")


def reset_order(order: LaneOrder, groups: list[int]) -> list[str]:
    """One reset slot: group 7's reset takes it, then resets of `groups` queue in that order."""
    lanes = lanes_of(order, reset=1)
    log: list[str] = []

    async def main() -> None:
        first = lanes.attach(_Box(log, "g7"))  # type: ignore[arg-type]
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lanes.run_op(LaneOp.reset(first, TASK), group=7))
            await asyncio.sleep(1)
            for i, group in enumerate(groups):
                handle = lanes.attach(_Box(log, f"g{group}-{i}"))  # type: ignore[arg-type]
                tg.create_task(lanes.run_op(LaneOp.reset(handle, TASK), group=group))
                await asyncio.sleep(0)

    run_virtual(main())
    return log


def test_oldest_group_lanes_run_an_older_groups_queued_op_first_and_fifo_lanes_do_not() -> None:
    groups = [9, 8, 9, 2]
    assert reset_order(LaneOrder.OLDEST_GROUP, groups) == ["g7", "g2-3", "g8-1", "g9-0", "g9-2"]
    assert reset_order(LaneOrder.FIFO, groups) == ["g7", "g9-0", "g8-1", "g9-2", "g2-3"]


def test_running_groups_get_a_niceness_by_age_that_follows_them_as_older_ones_finish() -> None:
    lanes = lanes_of(LaneOrder.OLDEST_GROUP, cpu_priority=True)
    log: list[str] = []
    boxes = {group: _Box(log, f"g{group}") for group in (3, 5, 1)}
    seen: dict[str, dict[int, int]] = {}

    def now() -> dict[int, int]:
        return {group: box.nices[-1] for group, box in boxes.items() if box.nices}

    async def main() -> None:
        handles = {group: lanes.attach(box) for group, box in boxes.items()}  # type: ignore[arg-type]
        async with asyncio.TaskGroup() as tg:
            tg.create_task(lanes.run_op(LaneOp.reset(handles[3], TASK), group=3))
            await asyncio.sleep(1)
            tg.create_task(lanes.run_op(LaneOp.reset(handles[5], TASK), group=5))
            await asyncio.sleep(1)
            seen["3 and 5"] = now()
            tg.create_task(lanes.run_op(LaneOp.reset(handles[1], TASK), group=1))
            await asyncio.sleep(1)
            seen["1, 3 and 5"] = now()
            await asyncio.sleep(7.5)  # 3's reset ends at 10 s
            seen["1 and 5"] = now()

    run_virtual(main())
    assert seen["3 and 5"] == {3: 0, 5: NICE_STEP}
    assert seen["1, 3 and 5"] == {3: NICE_STEP, 5: 2 * NICE_STEP, 1: 0}
    assert seen["1 and 5"] == {3: NICE_STEP, 5: NICE_STEP, 1: 0}  # 3 left; 5 moved up


def test_the_niceness_stops_at_the_kernels_maximum_and_fifo_lanes_renice_nothing() -> None:
    for order, expected in ((LaneOrder.OLDEST_GROUP, MAX_NICE), (LaneOrder.FIFO, None)):
        lanes = lanes_of(order, cpu_priority=True, reset=20)
        boxes = [_Box([], str(g)) for g in range(10)]

        async def main(lanes: InProcessLanes = lanes, boxes: list[_Box] = boxes) -> None:
            async with asyncio.TaskGroup() as tg:
                for group, box in enumerate(boxes):
                    tg.create_task(lanes.run_op(LaneOp.reset(lanes.attach(box), TASK), group=group))  # type: ignore[arg-type]

        run_virtual(main())
        assert lanes.cpu_priority is (order is LaneOrder.OLDEST_GROUP)
        youngest = boxes[-1].nices
        assert (max(youngest) if youngest else None) == expected


# -- real processes ----------------------------------------------------------------------------------


needs_root = pytest.mark.skipif(not ROOT, reason="lowering a niceness again needs root (CAP_SYS_NICE)")
# A command that prints its niceness, then how many loop rounds it ran in 2 s of wall time.
SPIN_2S = "nice; end=$(( ${EPOCHREALTIME/./} + 2000000 )); n=0; while (( ${EPOCHREALTIME/./} < end )); do n=$((n+1)); done; echo $n"  # noqa: E501


@pytest.mark.skipif(shutil.which("nice") is None, reason="no nice(1) here")
def test_a_local_sandbox_starts_its_commands_at_its_niceness_and_renices_a_running_one(
    base_dir: Path, task_root: Path
) -> None:
    sandbox = LocalSandboxFactory(base_dir, isolation="none").create("g1a0-ns")

    async def main() -> tuple[str, str, list[int]]:
        await sandbox.reset(make_echo_task(task_root))
        sandbox.set_nice(6)
        started = (await sandbox.exec("nice", 10)).output.strip()
        sandbox.set_nice(0 if ROOT else 6)
        back = (await sandbox.exec("nice", 10)).output.strip()
        # a running command follows a later set_nice: it reports its niceness a second after it
        running = asyncio.create_task(sandbox.exec("sleep 1; nice", 10))
        await asyncio.sleep(0.3)
        sandbox.set_nice(11)
        later = (await running).output.strip()
        await sandbox.cleanup()
        return started, back, [int(later)]

    started, back, later = asyncio.run(main())
    assert started == "6"
    assert back == ("0" if ROOT else "6")
    assert later == [11]


@needs_root
def test_on_one_cpu_the_older_groups_command_gets_more_cpu_than_the_younger_ones(
    base_dir: Path, task_root: Path
) -> None:
    """Two real sandboxes of groups 1 and 2 spin at once in one exec lane pinned to one CPU: lanes
    ordered oldest group first run group 2's at niceness 4, about 2.4 times less CPU; FIFO lanes split
    it evenly. Figures are ratios of loop rounds, side by side in one run."""
    cpu = max(os.sched_getaffinity(0))
    factory = LocalSandboxFactory(base_dir, isolation="none")

    def race(order: LaneOrder) -> dict[int, tuple[int, int]]:
        concurrency = dict.fromkeys(LaneName, 2)
        lanes = InProcessLanes(concurrency, dict.fromkeys(LaneName, (cpu,)), True, order, True)

        async def one(group: int) -> tuple[int, int]:
            sandbox = factory.create(f"g{group}a0-{order.value}")
            handle = lanes.attach(sandbox)
            try:
                await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)), group=group)
                result = await lanes.run_op(LaneOp.exec(handle, SPIN_2S, 30), group=group)
            finally:
                await lanes.run_op(LaneOp.cleanup(handle), group=group)
            nice, rounds = result.output.split()
            return int(nice), int(rounds)

        async def main() -> dict[int, tuple[int, int]]:
            older, younger = await asyncio.gather(one(1), one(2))
            return {1: older, 2: younger}

        return asyncio.run(main())

    ordered, fifo = race(LaneOrder.OLDEST_GROUP), race(LaneOrder.FIFO)
    assert (ordered[1][0], ordered[2][0]) == (0, NICE_STEP)
    assert (fifo[1][0], fifo[2][0]) == (0, 0)
    ordered_ratio = ordered[1][1] / ordered[2][1]
    fifo_ratio = fifo[1][1] / fifo[2][1]
    print(f"older/younger loop rounds: oldest_group {ordered_ratio:.2f}, fifo {fifo_ratio:.2f}")
    assert ordered_ratio > 1.5  # the kernel's weights give about 2.4
    assert ordered_ratio > 1.3 * fifo_ratio


def test_a_run_config_s_lane_order_reaches_its_lanes_and_fifo_is_the_default() -> None:
    import yaml

    from app.runtime.config import LocalRunConfig, default_config_path

    data = yaml.safe_load(default_config_path().read_text())
    shipped = LocalRunConfig.model_validate(data)
    assert shipped.lane_config().order is LaneOrder.FIFO
    assert InProcessLanes.from_config(shipped.lane_config(), pinned=True).cpu_priority is False
    data["lanes"]["order"] = "oldest_group"
    config = LocalRunConfig.model_validate(data).lane_config()
    ordered = InProcessLanes.from_config(config, pinned=True)
    assert ordered.order is LaneOrder.OLDEST_GROUP
    assert ordered.cpu_priority is ROOT  # where this process may raise a niceness again
    assert InProcessLanes.from_config(config, pinned=False).cpu_priority is False  # unpinned: none
