"""EnginePool.call's scope: `interrupt` ends a call in flight with TimeoutError, and only that."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from app.core.rollout import UpdatePlan
from app.engines.base import Engine
from app.runtime.engine_pool import EnginePool


@dataclass
class _NamedEngine:
    name: str  # the pool reads nothing else of its engines


def make_pool(*names: str) -> EnginePool:
    engines: list[Engine] = [_NamedEngine(name) for name in names]  # type: ignore[misc]
    return EnginePool(engines, slots=4, plan=UpdatePlan(list(names), rolling=False))


async def _hold(pool: EnginePool, name: str, started: asyncio.Event) -> str:
    with pool.call(name):
        started.set()
        await asyncio.sleep(60)
    return "finished"


async def call_in_flight(pool: EnginePool, name: str) -> asyncio.Task[str]:
    """A task inside a call to engine `name`, waiting there."""
    started = asyncio.Event()
    task = asyncio.create_task(_hold(pool, name, started))
    await started.wait()
    return task


def test_interrupt_ends_the_calls_in_flight_on_that_engine_with_timeout_error() -> None:
    async def main() -> None:
        pool = make_pool("e0", "e1")
        first = await call_in_flight(pool, "e0")
        other = await call_in_flight(pool, "e1")
        assert pool.interrupt("e0") == 1
        with pytest.raises(TimeoutError):
            await first
        assert not other.done()  # another engine's call goes on
        assert pool.interrupt("e0") == 0  # the ended call is no longer registered
        assert pool.interrupt("e1") == 1
        with pytest.raises(TimeoutError):
            await other

    asyncio.run(main())


def test_a_cancelled_call_stays_cancelled_and_a_finished_one_leaves_nothing_registered() -> None:
    async def main() -> None:
        pool = make_pool("e0")
        call = await call_in_flight(pool, "e0")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert pool.interrupt("e0") == 0

        with pool.call("e0"):
            await asyncio.sleep(0)
        assert pool.interrupt("e0") == 0

    asyncio.run(main())


def test_a_cancel_during_an_interruption_is_not_swallowed_as_a_timeout() -> None:
    async def main() -> None:
        pool = make_pool("e0")
        call = await call_in_flight(pool, "e0")
        pool.interrupt("e0")
        call.cancel()  # someone else cancels the task too: the cancellation wins
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(main())
