"""Lane modes of the simulator: work-conserving sharing with guarantees, hard partitions, and lane
slots that adapt (app.sim.lanes, app.sim.cpu.LanePool)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.lanes.adaptive import AdaptiveLanesSpec, AdaptiveSlots, LaneSample, ResizableLimiter
from app.sim.clock import run_virtual
from app.sim.cpu import LanePool, water_fill
from app.sim.lanes import LongOps

LANES = ("reset", "exec", "validate", "cleanup")


def make_pool(borrow: bool = True, **overrides: Any) -> LanePool:
    guarantees = overrides.pop("guarantees", {"reset": 1.0, "exec": 2.0, "validate": 0.5, "cleanup": 0.5})
    return LanePool("sandbox", overrides.pop("cores", 4.0), guarantees, borrow, overrides.pop("thrash", 0.0))


def finish_times(pool: LanePool, jobs: list[tuple[str, float, float]]) -> list[float]:
    """Run (lane, work, demand) jobs from t=0 on the pool; return their finish times."""
    streams = {lane: pool.stream(lane) for lane in pool.guarantees}

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        done = [0.0] * len(jobs)

        async def job(i: int, lane: str, work: float, demand: float) -> None:
            await streams[lane].run(work, demand)
            done[i] = loop.time()

        async with asyncio.TaskGroup() as tg:
            for i, (lane, work, demand) in enumerate(jobs):
                tg.create_task(job(i, lane, work, demand))
        return done

    return run_virtual(main())


@settings(max_examples=200, deadline=None)
@given(
    demand=st.fixed_dictionaries({lane: st.floats(0, 50) for lane in LANES}),
    weights=st.fixed_dictionaries({lane: st.floats(0.1, 10) for lane in LANES}),
    cores=st.floats(1, 64),
)
def test_water_fill_guarantees_shares_and_conserves_work(
    demand: dict[str, float], weights: dict[str, float], cores: float
) -> None:
    alloc = water_fill(demand, weights, cores)
    total_w = sum(weights.values())
    assert sum(alloc.values()) <= cores + 1e-6
    for lane in LANES:
        assert alloc[lane] <= demand[lane] + 1e-6  # nobody gets more than it asks
        guaranteed = min(demand[lane], cores * weights[lane] / total_w)
        assert alloc[lane] >= guaranteed - 1e-6  # nobody gets less than its share
    # Work-conserving: cores stay idle only when every lane has all it asked for.
    if sum(alloc.values()) < cores - 1e-6:
        assert all(alloc[lane] >= demand[lane] - 1e-6 for lane in LANES)


def test_a_flooded_lane_cannot_push_another_below_its_share() -> None:
    # exec is guaranteed 2 of 4 cores. A cleanup storm of 40 cores' demand arrives with one exec job.
    alone = finish_times(make_pool(), [("exec", 10, 2)])
    storm = finish_times(make_pool(), [("exec", 10, 2)] + [("cleanup", 10, 1)] * 40)
    assert alone[0] == pytest.approx(10)
    assert storm[0] == pytest.approx(10)  # exec keeps its 2 cores, so its job is not slowed


def test_work_conserving_lanes_use_idle_cores_and_partitions_do_not() -> None:
    # One reset job wanting 4 cores; reset is guaranteed 1 core and the other lanes are idle.
    shared = finish_times(make_pool(borrow=True), [("reset", 10, 4)])
    walled = finish_times(make_pool(borrow=False), [("reset", 10, 4)])
    assert shared[0] == pytest.approx(10)
    assert walled[0] == pytest.approx(40)


def test_lane_pool_refuses_guarantees_beyond_its_cores() -> None:
    with pytest.raises(ValueError, match="exceed"):
        make_pool(guarantees={"reset": 3.0, "exec": 3.0})
    with pytest.raises(ValueError, match="positive"):
        make_pool(guarantees={"reset": 0.0})


def test_resizable_limiter_bounds_running_ops_and_serves_fifo() -> None:
    limiter = ResizableLimiter(2)
    order: list[int] = []
    peak = {"running": 0, "max": 0}

    async def op(i: int) -> None:
        await limiter.acquire()
        peak["running"] += 1
        peak["max"] = max(peak["max"], peak["running"])
        order.append(i)
        await asyncio.sleep(1.0)
        peak["running"] -= 1
        limiter.release()

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(6):
                tg.create_task(op(i))
            await asyncio.sleep(0.5)
            assert peak["max"] == 2
            limiter.resize(3)  # grows at once: one more waiter starts
            await asyncio.sleep(0)
            assert peak["running"] == 3
            limiter.resize(1)  # shrinks as running ops finish

    run_virtual(main())
    assert order == list(range(6))
    assert limiter.busy == 0
    assert limiter.max_slots == 3


def test_cancelled_waiter_leaves_the_queue_and_keeps_no_slot() -> None:
    limiter = ResizableLimiter(1)

    async def main() -> None:
        await limiter.acquire()
        waiter = asyncio.get_running_loop().create_task(limiter.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        limiter.release()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert limiter.busy == 0
        assert limiter.queued == 0

    run_virtual(main())


@settings(max_examples=200, deadline=None)
@given(
    configured=st.integers(1, 64),
    slots_factor=st.floats(1, 4),
    busy=st.integers(0, 256),
    queued=st.integers(0, 500),
    idle=st.floats(-10, 100),
    op_demand=st.floats(0, 2),
)
def test_adaptive_slots_stay_in_bounds_and_grow_only_into_idle_cores(
    configured: int, slots_factor: float, busy: int, queued: int, idle: float, op_demand: float
) -> None:
    spec = AdaptiveLanesSpec(overload=None)  # slots between configured and max_factor × configured
    controller = AdaptiveSlots({"reset": configured}, spec)
    slots = max(configured, int(configured * slots_factor))
    sample = LaneSample(slots, min(busy, slots), queued, idle, op_demand)
    new = controller.decide({"reset": sample})["reset"]
    low, high = controller.bounds("reset")
    assert low <= new <= high
    if new > slots:
        assert queued > 0
        assert idle >= op_demand
    if queued > 0 and idle >= op_demand and slots < high:
        assert new > slots


def test_reweighting_moves_the_guarantee_to_the_lane_with_queued_work() -> None:
    controller = AdaptiveSlots({"reset": 4, "exec": 8}, AdaptiveLanesSpec(min_share=0.25))
    samples = {
        "reset": LaneSample(slots=4, busy=4, queued=40, idle_cores=0.0, op_demand=0.5),
        "exec": LaneSample(slots=8, busy=8, queued=0, idle_cores=0.0, op_demand=1.0),
    }
    shares = controller.shares(samples, {"reset": 1.0, "exec": 7.0})
    # reset's 44 queued or running resets would use 22 cores; capped at an equal split of the 8 cores.
    assert shares == {"reset": 4.0, "exec": 4.0}
    idle = {lane: LaneSample(s.slots, 0, 0, 8.0, s.op_demand) for lane, s in samples.items()}
    assert controller.shares(idle, {"reset": 1.0, "exec": 7.0}) == {"reset": 0.25, "exec": 1.75}
    # The default (min_share 1) only raises: reset gets its equal split, exec keeps its configured 7.
    default = AdaptiveSlots({"reset": 4, "exec": 8}, AdaptiveLanesSpec())
    assert default.shares(samples, {"reset": 1.0, "exec": 7.0}) == {"reset": 4.0, "exec": 7.0}
    assert default.shares(idle, {"reset": 1.0, "exec": 7.0}) == {"reset": 1.0, "exec": 7.0}


def test_new_guarantees_take_effect_at_once_and_partitions_refuse_them() -> None:
    pool = make_pool(cores=4.0, guarantees={"reset": 1.0, "exec": 3.0})
    streams = {lane: pool.stream(lane) for lane in pool.guarantees}

    async def main() -> float:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(streams["exec"].run(100, 8))  # exec floods the pool
            job = tg.create_task(streams["reset"].run(10, 4))
            await asyncio.sleep(5)  # reset has 1 core of the 4 it wants: 1.25 s of work done
            pool.set_guarantees({"reset": 1.0, "exec": 1.0})  # now 2 cores: half speed
            await job
            return loop.time()

    assert run_virtual(main()) == pytest.approx(5 + (10 - 1.25) / 0.5)
    with pytest.raises(ValueError, match="fixed"):
        make_pool(borrow=False).set_guarantees({"reset": 1, "exec": 1, "validate": 1, "cleanup": 1})


def test_in_process_lanes_are_bounded_by_their_resizable_limiters() -> None:
    from app.core.config import LanesConfig
    from app.lanes.base import LaneName, LaneSlot
    from app.lanes.inprocess import InProcessLanes

    config = LanesConfig.model_validate(
        {
            **{lane: {"slots": 2, "cpus": (1,)} for lane in LANES},
            "serving_cpus": (0,),
        }
    )
    lanes = InProcessLanes.from_config(config, pinned=True)
    running = {"now": 0, "max": 0}

    async def op(slot: LaneSlot) -> None:
        running["now"] += 1
        running["max"] = max(running["max"], running["now"])
        await asyncio.sleep(1.0)
        running["now"] -= 1

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for _ in range(12):
                tg.create_task(lanes.run(LaneName.EXEC, op))
            await asyncio.sleep(0.5)
            assert running["now"] == 2
            lanes.limiters[LaneName.EXEC].resize(5)
            await asyncio.sleep(0)
            assert running["now"] == 5

    run_virtual(main())
    assert running["max"] == 5
    assert lanes.stats()["exec"].completed == 12


@settings(max_examples=200, deadline=None)
@given(
    configured=st.fixed_dictionaries({lane: st.floats(0.25, 16) for lane in LANES}),
    busy=st.fixed_dictionaries({lane: st.integers(0, 64) for lane in LANES}),
    storm=st.integers(0, 100_000),
    demand=st.floats(0.1, 2),
)
def test_a_reweighted_cleanup_storm_cannot_push_exec_below_its_demand_or_equal_split(
    configured: dict[str, float], busy: dict[str, int], storm: int, demand: float
) -> None:
    cores = sum(configured.values())
    controller = AdaptiveSlots(dict.fromkeys(LANES, 64), AdaptiveLanesSpec())
    samples = {
        lane: LaneSample(64, busy[lane], storm if lane == "cleanup" else 0, 0.0, demand) for lane in LANES
    }
    weights = controller.shares(samples, configured)
    equal = cores / len(LANES)
    for lane in LANES:
        floor = controller.spec.min_share * configured[lane]
        assert floor - 1e-9 <= weights[lane] <= max(floor, equal) + 1e-9  # nobody's weight passes its split
    # The pool's guarantees after `set_guarantees`, then what exec gets while cleanup floods the pool.
    guarantees = {lane: cores * w / sum(weights.values()) for lane, w in weights.items()}
    asks = {lane: busy[lane] * demand for lane in LANES} | {"cleanup": (busy["cleanup"] + storm) * demand}
    alloc = water_fill(asks, guarantees, cores)
    # Weights sum to at most (1 + min_share) × cores, so exec keeps that fraction of its fair claim.
    fair = max(controller.spec.min_share * configured["exec"], min(equal, asks["exec"]))
    assert alloc["exec"] >= min(asks["exec"], fair / (1 + controller.spec.min_share)) - 1e-6


@settings(max_examples=300, deadline=None)
@given(
    configured=st.integers(1, 256),
    slots=st.integers(1, 1024),
    busy=st.integers(0, 1024),
    queued=st.integers(0, 500),
    cores=st.floats(0, 300),
    op_demand=st.floats(0.01, 4),
    overload=st.floats(1, 4),
)
def test_slots_that_follow_cores_never_want_more_than_the_lane_can_get(
    configured: int, slots: int, busy: int, queued: int, cores: float, op_demand: float, overload: float
) -> None:
    controller = AdaptiveSlots({"reset": configured}, AdaptiveLanesSpec(overload=overload))
    _, high = controller.bounds("reset")
    slots = min(slots, high)
    sample = LaneSample(slots, min(busy, slots), queued, 0.0, op_demand, cores)
    new = controller.decide({"reset": sample})["reset"]
    fit = max(1, math.floor(overload * cores / op_demand))
    assert 1 <= new <= min(high, fit)  # below the configured slots when the cores are short
    if new > slots:
        # A queue grows the lane; an idle lane goes back to its configured slots if its cores allow.
        assert queued > 0 or new == min(configured, fit)
    if queued > 0 and slots < min(high, fit):
        assert new > slots  # a queue grows the lane up to what its cores run


def test_an_oversubscribed_lane_shrinks_to_its_cores_and_regrows_with_them() -> None:
    controller = AdaptiveSlots({"exec": 192}, AdaptiveLanesSpec())
    # 192 tool calls of one core each on the 15 cores exec can get: each would run at 1/13 speed.
    crowded = LaneSample(192, 192, 50, 0.0, 1.0, 15.0)
    assert controller.decide({"exec": crowded})["exec"] == 15
    # The other lanes go quiet: exec can get 32 cores, and grows by a step (48) up to them.
    assert controller.decide({"exec": LaneSample(15, 15, 50, 17.0, 1.0, 32.0)})["exec"] == 32


@pytest.mark.parametrize(("op_demand", "cores"), [(5e-324, 15.0), (1.0, math.inf)])
def test_an_operation_that_needs_next_to_no_core_lets_a_lane_grow_to_its_bound(
    op_demand: float, cores: float
) -> None:
    # `cpus.sandbox_demand: {reset: 5e-324}` passes the workload's checks (≥ 0): cores / demand was
    # infinite, and its floor raised OverflowError out of `corral sim` as a traceback.
    controller = AdaptiveSlots({"reset": 8}, AdaptiveLanesSpec())
    _, high = controller.bounds("reset")
    assert controller.decide({"reset": LaneSample(8, 8, 50, 0.0, op_demand, cores)})["reset"] > 8
    assert controller.decide({"reset": LaneSample(high, high, 50, 0.0, op_demand, cores)})["reset"] == high


def test_a_detached_operation_hands_its_slot_on_and_its_release_gives_back_nothing() -> None:
    limiter = ResizableLimiter(1)
    started: list[str] = []

    async def long_op() -> None:
        await limiter.acquire()
        started.append("long")
        await asyncio.sleep(1)
        limiter.detach()
        await asyncio.sleep(100)
        limiter.release()

    async def short_op(name: str) -> None:
        await limiter.acquire()
        started.append(name)
        await asyncio.sleep(1)
        limiter.release()

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(long_op())
            await asyncio.sleep(0)
            tg.create_task(short_op("a"))
            tg.create_task(short_op("b"))
            await asyncio.sleep(1.5)
            assert started == ["long", "a"]  # the long op left the slot; `a` took it
            assert limiter.busy == 1
            await asyncio.sleep(1)
            assert started == ["long", "a", "b"]  # one slot still: b waited for a
        assert limiter.busy == 0

    run_virtual(main())


def _long_resets(cores: float, works: list[float], slots: int) -> tuple[list[float], LongOps]:
    """Resets of `works` seconds (one core each) through a reset lane of `slots` slots on a pool of
    `cores` cores, with long resets leaving the lane; their finish times."""
    pool = LanePool("sandbox", cores, {"reset": cores * 0.9, "background": cores * 0.1}, True, 0.0)
    limiter = ResizableLimiter(slots)
    long = LongOps(pool.stream("reset"), limiter, pool.stream("background"), factor=4.0)
    long.slots.resize(2)
    for _ in range(16):
        long.record(1.0)  # the median reset so far: 1 s, so 4 s of service is long

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        done = [0.0] * len(works)

        async def reset(i: int) -> None:
            await limiter.acquire()
            try:
                await long.run(works[i], 1.0)
            finally:
                limiter.release()
            done[i] = loop.time()

        async with asyncio.TaskGroup() as tg:
            for i in range(len(works)):
                tg.create_task(reset(i))
                await asyncio.sleep(0)
        return done

    return run_virtual(main()), long


def test_a_long_reset_leaves_its_slot_when_others_queue_and_the_cores_are_busy() -> None:
    # One slot, a 1-core pool: a 100 s reset first, then two 1 s resets queued behind it.
    done, long = _long_resets(1.0, [100.0, 1.0, 1.0], slots=1)
    assert long.detached == 1
    # After 4 s of service the slot goes to the next reset, which gets the reset lane's 0.9 core.
    assert done[1] == pytest.approx(4 + 1 / 0.9)
    assert done[2] == pytest.approx(4 + 2 / 0.9)
    assert done[0] == pytest.approx(102.0)  # on the background share: the core never idles
    # Nobody waiting: the long reset keeps its slot and runs through.
    done, long = _long_resets(1.0, [100.0], slots=1)
    assert long.detached == 0
    assert done[0] == pytest.approx(100.0)
