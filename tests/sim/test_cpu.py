"""The simulator's CPU model: processor sharing, oversubscription loss, serving interference, pauses."""

from __future__ import annotations

import asyncio

import pytest

from app.sim.clock import SimulationDeadlock, run_virtual
from app.sim.cpu import CpuPool, LanePool


def finish_times(
    jobs: list[tuple[str, float, float]], pool: CpuPool, pause: tuple[float, float] | None = None
):
    """Run (stream, work, demand) jobs from t=0; return their finish times by index."""
    streams = {name: pool.stream(name, serving=name.startswith("serve")) for name, _, _ in jobs}

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        done = [0.0] * len(jobs)

        async def job(i: int, name: str, work: float, demand: float) -> None:
            await streams[name].run(work, demand)
            done[i] = loop.time()

        async with asyncio.TaskGroup() as tg:
            for i, (name, work, demand) in enumerate(jobs):
                tg.create_task(job(i, name, work, demand))
            if pause is not None:
                loop.call_at(pause[0], streams["serve"].set_factor, 0.0)
                loop.call_at(pause[1], streams["serve"].set_factor, 1.0)
        return done

    return run_virtual(main())


def test_processor_sharing_slows_everyone_in_proportion() -> None:
    pool = CpuPool("p", cores=1)
    # Two 10 s jobs each wanting a core on one core: both run at half speed; a free-riding
    # 5 s job in the same pool also runs at half speed.
    assert finish_times([("sb", 10, 1), ("sb", 10, 1), ("sb2", 5, 0)], pool) == pytest.approx([20, 20, 10])


def test_oversubscription_loses_efficiency() -> None:
    pool = CpuPool("p", cores=1, thrash=0.5)
    # load 2: rate = 1 / (2 * 1.5) = 1/3
    assert finish_times([("sb", 10, 1), ("sb", 10, 1)], pool) == pytest.approx([30, 30])


def test_sandbox_work_slows_serving_through_interference() -> None:
    alone = finish_times([("serve", 10, 0)], CpuPool("p", cores=4, interference=0.5))
    crowded = finish_times([("serve", 10, 0), ("sb", 100, 2)], CpuPool("p", cores=4, interference=0.5))
    assert alone == pytest.approx([10])
    # Sandbox load 2 of 4 cores: serving runs at 1 / (1 + 0.5 * 0.5) = 0.8.
    assert crowded[0] == pytest.approx(12.5)


def test_paused_stream_freezes_and_resumes_without_losing_work() -> None:
    times = finish_times([("serve", 10, 0)], CpuPool("p", cores=1), pause=(4.0, 9.0))
    assert times == pytest.approx([15.0])


def test_pool_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="positive"):
        CpuPool("p", cores=0)
    with pytest.raises(ValueError, match="≥ 0"):
        CpuPool("p", cores=1, thrash=-1)


def test_virtual_clock_reports_a_deadlock() -> None:
    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(SimulationDeadlock):
        run_virtual(stuck())


def run_borrowing(
    engine: tuple[float, float, float] | None,
    lanes: list[tuple[float, float, float]],
    interference: float = 0.0,
) -> tuple[list[float], float | None, LanePool]:
    """An engine job (start, work, demand) on a 4-core serving pool and lane jobs (start, work, demand) on a
    2-core sandbox pool that borrows serving's idle cores; returns the lane jobs' and the engine job's
    finish times, and the sandbox pool."""
    serving = CpuPool("serving", 4, interference=interference)
    sandbox = LanePool("sandbox", 2, {"exec": 2.0}, lender=serving)
    serve, lane = serving.stream("engine", serving=True), sandbox.stream("exec")

    async def main() -> tuple[list[float], float | None]:
        loop = asyncio.get_running_loop()
        done = [0.0] * len(lanes)
        served: list[float] = []

        async def job(i: int, start: float, work: float, demand: float) -> None:
            await asyncio.sleep(start)
            await lane.run(work, demand)
            done[i] = loop.time()

        async def engine_job(start: float, work: float, demand: float) -> None:
            await asyncio.sleep(start)
            serving.change_demand(demand)
            await serve.run(work)
            serving.change_demand(-demand)
            served.append(loop.time())

        async with asyncio.TaskGroup() as tg:
            for i, spec in enumerate(lanes):
                tg.create_task(job(i, *spec))
            if engine is not None:
                tg.create_task(engine_job(*engine))
        return done, (served[0] if served else None)

    done, served = run_virtual(main())
    return done, served, sandbox


def test_lanes_borrow_the_serving_cores_serving_leaves_idle() -> None:
    # Four one-core jobs on 2 sandbox cores and 4 idle serving cores: each runs at full speed.
    done, _, sandbox = run_borrowing(None, [(0, 10, 1)] * 4)
    assert done == pytest.approx([10] * 4)
    assert sandbox.max_lent == pytest.approx(2.0)
    # Without a lender the same jobs share 2 cores (half speed, and the oversubscription loss is off).
    alone = finish_times([("sb", 10, 1)] * 4, LanePool("sandbox", 2, {"sb": 2.0}))
    assert alone == pytest.approx([20] * 4)


def test_serving_takes_its_cores_back_and_is_never_slowed_below_them() -> None:
    # Lanes want 6 cores; serving starts a 3-core job at t = 4 for 10 s: the lanes drop to 2 + 1 cores.
    done, served, sandbox = run_borrowing((4, 10, 3), [(0, 30, 6)])
    assert served == pytest.approx(14)  # serving ran at full speed: it had every core it asked for
    # The lane job: 4 s at full speed (6 cores), 10 s at 3/6, then full speed: 4 + 5 = 9 s of work by
    # t = 14, the remaining 21 s at full speed.
    assert done == pytest.approx([35])
    assert sandbox.max_lent == pytest.approx(4.0)
    assert sandbox.cores == pytest.approx(6.0)  # all 4 serving cores idle again


def test_borrowed_cores_slow_serving_as_neighbours_do() -> None:
    # γ = 0.5 and 1 borrowed core in use out of 4 serving cores: serving runs at 1 / (1 + 0.5 / 4).
    _, served, _ = run_borrowing((0, 9, 1), [(0, 100, 3)], interference=0.5)
    assert served == pytest.approx(9 * (1 + 0.5 * 1 / 4))


def test_partitioned_lanes_cannot_borrow() -> None:
    with pytest.raises(ValueError, match="cannot borrow"):
        LanePool("sandbox", 2, {"exec": 2.0}, borrow=False, lender=CpuPool("serving", 4))
