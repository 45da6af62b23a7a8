"""The simulator's CPU priority by group age: a contended lane's cores go to its groups by the CFS weight
of niceness 4 × their age rank, as the runtime's pinned lanes with `order: oldest_group` give them."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.sim.clock import run_virtual
from app.sim.cpu import NICE_WEIGHT, GroupRanks, LanePool, Stream
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload, default_workload

Job = tuple[str, int, float, float, float]  # lane, group, start, work, demand


def finish_times(jobs: list[Job], pool: LanePool, ranks: GroupRanks | None) -> list[float]:
    """Run the jobs in `pool`'s lanes, by group (`ranks`) or alike (None); their finish times by index."""
    lanes = {lane for lane, *_ in jobs}
    if ranks is None:
        plain = {lane: pool.stream(lane) for lane in lanes}
    else:
        grouped = {lane: pool.grouped_stream(lane, ranks) for lane in lanes}

    def stream(lane: str, group: int) -> Stream:
        return plain[lane] if ranks is None else grouped[lane].for_group(group)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        done = [0.0] * len(jobs)

        async def job(i: int, lane: str, group: int, start: float, work: float, demand: float) -> None:
            await asyncio.sleep(start)
            await stream(lane, group).run(work, demand)
            done[i] = loop.time()

        async with asyncio.TaskGroup() as tg:
            for i, spec in enumerate(jobs):
                tg.create_task(job(i, *spec))
        return done

    return run_virtual(main())


def test_the_older_group_gets_the_cores_by_its_weight_and_the_younger_speeds_up_after() -> None:
    jobs: list[Job] = [("exec", 0, 0.0, 10.0, 1.0), ("exec", 1, 0.0, 10.0, 1.0)]
    alike = finish_times(jobs, LanePool("sandbox", 1, {"exec": 1.0}), None)
    by_age = finish_times(jobs, LanePool("sandbox", 1, {"exec": 1.0}), GroupRanks(4))
    assert alike == pytest.approx([20.0, 20.0])
    # Group 0 at niceness 0 against group 1 at 4: 1024 to 423 of the one core, until group 0 is done;
    # then group 1 ranks first and has the core. The core never idles, so the last finish is the same.
    older = 10.0 * (1024 + 423) / 1024
    assert by_age == pytest.approx([older, 20.0])


def test_a_lane_that_is_not_contended_runs_every_group_at_full_speed() -> None:
    jobs: list[Job] = [("exec", g, 0.0, 10.0, 1.0) for g in range(3)]
    times = finish_times(jobs, LanePool("sandbox", 4, {"exec": 4.0}), GroupRanks(4))
    assert times == pytest.approx([10.0] * 3)


def test_niceness_stops_at_19() -> None:
    ranks = GroupRanks(4)
    pool = LanePool("sandbox", 1, {"exec": 1.0})
    ranks.pools[pool] = None
    for group in range(8):
        ranks.busy(group, True)
    assert [ranks.weight(g) for g in range(8)] == [1024, 423, 172, 70, 29, 15, 15, 15]
    assert ranks.weight(7) == NICE_WEIGHT[19]
    ranks.busy(0, False)  # the oldest ends: everyone moves up a rank
    assert [ranks.weight(g) for g in range(1, 5)] == [1024, 423, 172, 70]


def test_a_group_weighs_per_operation_so_its_many_operations_are_not_squeezed() -> None:
    # Group 0 runs three operations, group 1 one, on 2 cores with ranks alike (step 0): as plain
    # processor sharing, every operation runs at 2/4 of a core.
    jobs: list[Job] = [("exec", 0, 0.0, 10.0, 1.0)] * 3 + [("exec", 1, 0.0, 10.0, 1.0)]
    times = finish_times(jobs, LanePool("sandbox", 2, {"exec": 2.0}), GroupRanks(0))
    assert times == pytest.approx([20.0] * 4)


def test_the_oversubscription_loss_applies_to_the_whole_lane() -> None:
    jobs: list[Job] = [("exec", 0, 0.0, 10.0, 1.0), ("exec", 1, 0.0, 10.0, 1.0)]
    # load 2 on one core with thrash 0.5: the lane delivers 1 / 1.5 of its core, split 1024 : 423
    times = finish_times(jobs, LanePool("sandbox", 1, {"exec": 1.0}, thrash=0.5), GroupRanks(4))
    assert times[0] == pytest.approx(10.0 * 1.5 * (1024 + 423) / 1024)


def test_a_flooded_lane_still_cannot_take_another_lanes_share() -> None:
    # The cleanup lane floods with young groups; exec (guaranteed 1 of 2 cores) keeps its core.
    jobs: list[Job] = [("exec", 0, 0.0, 10.0, 1.0)] + [("cleanup", g, 0.0, 10.0, 1.0) for g in range(1, 9)]
    times = finish_times(jobs, LanePool("sandbox", 2, {"exec": 1.0, "cleanup": 1.0}), GroupRanks(4))
    assert times[0] == pytest.approx(10.0)


jobs_strategy = st.lists(
    st.tuples(
        st.sampled_from(["exec", "reset"]),
        st.integers(0, 5),
        st.floats(0.0, 20.0),
        st.floats(0.1, 30.0),
        st.sampled_from([0.25, 1.0]),
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=60, deadline=None)
@given(jobs=jobs_strategy, cores=st.sampled_from([1.0, 2.0, 3.0]), borrow=st.booleans())
def test_alike_weights_are_plain_processor_sharing_and_no_job_beats_its_work(
    jobs: list[Job], cores: float, borrow: bool
) -> None:
    def pool() -> LanePool:
        return LanePool("sandbox", cores, {"exec": cores / 2, "reset": cores / 2}, borrow=borrow, thrash=0.3)

    alike = finish_times(jobs, pool(), GroupRanks(0))
    plain = finish_times(jobs, pool(), None)
    assert alike == pytest.approx(plain, rel=1e-6, abs=1e-6)
    by_age = finish_times(jobs, pool(), GroupRanks(4))
    for (_, _, start, work, _), end in zip(jobs, by_age, strict=True):
        assert end >= start + work - 1e-6


def with_lanes(**lanes: object) -> Workload:
    spec = default_workload().model_dump(mode="json", by_alias=True, exclude_none=True)
    spec["lanes"].update(lanes)
    spec["batches"] = 3
    return Workload.model_validate(spec)


def test_a_workload_asks_for_it_with_oldest_group_and_its_report_says_so() -> None:
    assert with_lanes(order="oldest_group").lanes.by_group_age()
    assert not with_lanes(order="oldest_group", cpu_priority=False).lanes.by_group_age()
    assert not with_lanes().lanes.by_group_age()
    with pytest.raises(ValueError, match="needs order: oldest_group"):
        with_lanes(cpu_priority=True)
    workload = with_lanes(order="oldest_group")
    report = simulate(workload, policy_for(workload, "full"), "full")
    assert report["lanes_order"] == "oldest_group"
    assert report["lanes_cpu_priority"] is True
    assert report["lost_groups"] == 0
    plain = simulate(workload, policy_for(workload, "sync"), "sync")  # unpinned: nothing to rank in
    assert plain["lanes_cpu_priority"] is False
