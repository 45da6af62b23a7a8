"""The simulator's CPU model: processor sharing, oversubscription loss, serving interference, pauses."""

from __future__ import annotations

import asyncio

import pytest

from app.sim.clock import SimulationDeadlock, run_virtual
from app.sim.cpu import CpuPool


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
