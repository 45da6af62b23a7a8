"""The paced virtual-time loop: follows the wall clock at `speed`, freezes when paused, and wakes for
work handed over from other threads."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

from app.service.paced import LAG_SLACK_S, PacedLoop


def run_on(loop: PacedLoop, coro: object) -> object:
    try:
        return loop.run_until_complete(coro)  # type: ignore[arg-type]
    finally:
        loop.close()


def test_virtual_time_runs_at_speed_times_the_wall_clock() -> None:
    loop = PacedLoop(speed=10.0)

    async def main() -> tuple[float, float]:
        wall = time.monotonic()
        await asyncio.sleep(2.0)  # virtual seconds
        return loop.time(), time.monotonic() - wall

    virtual, wall = run_on(loop, main())  # type: ignore[misc]
    assert virtual >= 2.0
    assert wall >= 0.2 - 0.01  # 2 virtual seconds at 10x take at least 0.2 wall seconds


def test_a_thread_hands_work_to_an_idle_loop() -> None:
    loop = PacedLoop()

    async def main() -> str:
        future = loop.create_future()
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(future.set_result, "woken")).start()
        return str(await asyncio.wait_for(future, 10))

    assert run_on(loop, main()) == "woken"


def test_paused_time_stands_still_while_commands_still_run() -> None:
    loop = PacedLoop(speed=10.0)

    async def main() -> tuple[float, float, bool]:
        slept = asyncio.ensure_future(asyncio.sleep(1.0))
        loop.pause()
        frozen = loop.time()
        command = loop.create_future()
        threading.Timer(0.15, lambda: loop.call_soon_threadsafe(command.set_result, True)).start()
        ran = await command  # 0.15 s of wall time is 1.5 virtual seconds, had the clock run
        during = loop.time()
        assert not slept.done()
        loop.resume()
        await slept
        return frozen, during, ran

    frozen, during, ran = run_on(loop, main())  # type: ignore[misc]
    assert ran
    assert during == frozen


def test_a_loop_behind_the_wall_clock_fires_no_timeout_before_the_work_it_guards() -> None:
    # Ten steps of one virtual second each, under a 30 s timeout. Half a wall second of busy CPU is 50
    # virtual seconds at speed 100: the loop used to jump them, firing the timeout after only one step
    # (a fault the run never had: an engine update "timed out" on an overloaded server).
    loop = PacedLoop(speed=100.0)
    steps: list[float] = []

    async def chain() -> None:
        for _ in range(10):
            await asyncio.sleep(1.0)
            steps.append(loop.time())

    async def main() -> None:
        loop.call_later(0.5, time.sleep, 0.5)  # the CPU taken by something else on the loop
        await asyncio.wait_for(chain(), timeout=30.0)

    run_on(loop, main())
    assert len(steps) == 10
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert max(gaps) <= 1.0 + 100 * LAG_SLACK_S, gaps  # a step, and at most the slack past it
    assert loop.pace()["lag_s"] > 0.3


def test_a_held_loop_stands_still_and_still_runs_commands() -> None:
    held = threading.Event()
    held.set()
    loop = PacedLoop(speed=10.0, hold=held.is_set)

    async def main() -> tuple[float, float, bool]:
        start = loop.time()
        slept = asyncio.ensure_future(asyncio.sleep(1.0))
        command = loop.create_future()
        threading.Timer(0.2, lambda: loop.call_soon_threadsafe(command.set_result, True)).start()
        ran = await command  # 2 virtual seconds, had the clock run
        during = loop.time()
        assert not slept.done()
        threading.Timer(0.1, held.clear).start()
        await slept
        return start, during, ran

    start, during, ran = run_on(loop, main())  # type: ignore[misc]
    assert ran
    assert during == start
    pace = loop.pace()
    assert 0.2 <= pace["held_s"] < 5.0
    assert pace["speed"] == 10.0


def test_a_hurried_loop_fires_its_timers_at_once_in_order_and_still_holds() -> None:
    """A stopping simulated run hurries: its clean-ups (minutes of simulated time) took minutes of wall
    time at speed 1, the run `stopping` all along."""
    holding = [False]
    loop = PacedLoop(speed=1.0, hold=lambda: holding[0])

    async def main() -> tuple[list[tuple[str, float]], float]:
        fired: list[tuple[str, float]] = []
        for name, at in (("b", 600.0), ("a", 300.0), ("c", 900.0)):
            loop.call_at(at, lambda name=name: fired.append((name, loop.time())))
        await asyncio.sleep(0.05)  # paced: 50 ms of wall time for 0.05 virtual seconds
        loop.hurry()
        wall = time.monotonic()
        await asyncio.sleep(1000.0)  # 1000 virtual seconds, after the three timers
        return fired, time.monotonic() - wall

    fired, wall = run_on(loop, main())  # type: ignore[misc]
    assert [name for name, _ in fired] == ["a", "b", "c"]
    assert [at for _, at in fired] == [300.0, 600.0, 900.0]  # each at its own time, none skipped
    assert wall < 5.0  # not 1000 s: nothing waited for in wall time

    # A hold still stops a hurried clock: the store's writer comes first.
    holding[0] = True
    loop = PacedLoop(speed=1.0, hold=lambda: holding[0])
    threading.Timer(0.3, lambda: holding.__setitem__(0, False)).start()

    async def held() -> tuple[float, float]:
        loop.hurry()
        wall = time.monotonic()
        await asyncio.sleep(100.0)
        return loop.time(), time.monotonic() - wall

    virtual, wall = run_on(loop, held())  # type: ignore[misc]
    assert virtual >= 100.0
    assert wall >= 0.25  # it waited out the hold before running on
