"""The agent-phase gate (app.runtime.gate): who enters, in what order, and what a cancel leaves."""

from __future__ import annotations

import asyncio
import math

import pytest

from app.runtime.gate import AgentGate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_gate(slots: int = 2, factor: float = 1.0) -> tuple[AgentGate, Clock, list[int]]:
    clock, exec_slots = Clock(), [slots]
    return AgentGate(factor, lambda: exec_slots[0], clock), clock, exec_slots


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_until_a_tool_call_ends_one_attempt_enters_per_exec_slot() -> None:
    async def main() -> None:
        gate, _, _ = make_gate(slots=2)
        entered: list[str] = []

        async def attempt(name: str) -> None:
            await gate.enter(name)
            entered.append(name)

        tasks = [asyncio.create_task(attempt(n)) for n in "abcd"]
        await _settle()
        assert entered == ["a", "b"]
        gate.leave("a")
        await _settle()
        assert entered == ["a", "b", "c"]  # first come, first in
        gate.leave("zz")  # never inside: nothing changes
        await _settle()
        assert entered == ["a", "b", "c"]
        gate.leave("b")
        gate.leave("c")
        await asyncio.gather(*tasks)
        assert entered == ["a", "b", "c", "d"]

    asyncio.run(main())


def test_the_limit_follows_the_measured_tool_share_without_queueing() -> None:
    """Two attempts spent 10 s each in their agent phase, 1 s of it running a tool call and 4 s
    queued for one: the share is 2 / (20 - 8) = 1/6, so 2 exec slots admit 12."""
    gate, clock, slots = make_gate(slots=2)

    async def main() -> None:
        await gate.enter("a")
        await gate.enter("b")
        clock.t = 10.0
        gate.exec_done(queued_s=4.0, run_s=1.0)
        gate.exec_done(queued_s=4.0, run_s=1.0)
        gate.leave("a")
        gate.leave("b")

    asyncio.run(main())
    assert gate.tool_share() == pytest.approx(1 / 6)
    assert gate.limit() == pytest.approx(12.0)
    slots[0] = 5  # adaptive lanes resized the exec lane
    assert gate.limit() == pytest.approx(30.0)
    assert gate.report()["entered"] == 2


def test_a_share_is_never_taken_as_zero() -> None:
    gate, clock, _ = make_gate(slots=1)

    async def main() -> None:
        await gate.enter("a")
        clock.t = 1e6
        gate.exec_done(queued_s=0.0, run_s=1e-9)

    asyncio.run(main())
    assert math.isfinite(gate.limit())
    assert gate.limit() == pytest.approx(50.0)  # 1 slot ÷ MIN_TOOL_SHARE


def test_with_nothing_inside_an_attempt_always_enters() -> None:
    """Even when the limit is below one (a tiny factor), the gate cannot stall a run."""

    async def main() -> None:
        gate, _, _ = make_gate(slots=1, factor=0.01)
        await asyncio.wait_for(gate.enter("a"), 1)
        waiting = asyncio.create_task(gate.enter("b"))
        await _settle()
        assert not waiting.done()
        gate.leave("a")
        await asyncio.wait_for(waiting, 1)

    asyncio.run(main())


def test_a_cancel_while_waiting_or_just_let_in_leaves_no_place_taken() -> None:
    async def main() -> None:
        gate, clock, _ = make_gate(slots=1)
        await gate.enter("a")
        b = asyncio.create_task(gate.enter("b"))
        c = asyncio.create_task(gate.enter("c"))
        await _settle()
        b.cancel()  # cancelled while waiting
        await asyncio.gather(b, return_exceptions=True)
        clock.t = 3.0
        gate.leave("a")  # c is let in (b's place in the queue is skipped) ...
        c.cancel()  # ... and cancelled before it ran: its place is given back
        await asyncio.gather(c, return_exceptions=True)
        assert c.cancelled()
        await asyncio.wait_for(gate.enter("d"), 1)  # room again
        report = gate.report()
        assert report["max_waiting"] == 2
        assert report["waited"] == 1  # c, who waited 3 s
        assert report["wait_s_max"] == pytest.approx(3.0)
        assert report["max_inside"] == 1

    asyncio.run(main())


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf, math.nan])
def test_a_factor_that_is_not_a_positive_number_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="positive number"):
        make_gate(factor=factor)


def test_lanes_without_readable_slots_get_no_gate() -> None:
    assert AgentGate.for_lanes(1.0, object(), Clock()) is None
    assert AgentGate.for_lanes(None, object(), Clock()) is None
