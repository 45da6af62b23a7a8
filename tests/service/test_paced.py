"""The paced virtual-time loop: follows the wall clock at `speed`, freezes when paused, and wakes for
work handed over from other threads."""

from __future__ import annotations

import asyncio
import threading
import time

from app.service.paced import PacedLoop


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
