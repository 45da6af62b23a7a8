"""The agent-phase gate (app.runtime.gate): who enters, in what order, and what a cancel leaves."""

from __future__ import annotations

import asyncio
import math

import pytest

from app.lanes.base import LaneName
from app.runtime.gate import AgentGate


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_gate(slots: int = 2, factor: float = 1.0) -> tuple[AgentGate, Clock, list[int]]:
    clock, exec_slots = Clock(), [slots]
    return AgentGate(factor, lambda: exec_slots[0], clock), clock, exec_slots


def entering(gate: AgentGate, names: str, entered: list[str]) -> list[asyncio.Task[None]]:
    """An attempt for each of `names` (one letter each), in that order, that enters the gate and then
    writes its name in `entered`."""

    async def attempt(name: str) -> None:
        await gate.enter(name)
        entered.append(name)

    return [asyncio.create_task(attempt(n)) for n in names]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_until_a_tool_call_ends_one_attempt_enters_per_exec_slot() -> None:
    async def main() -> None:
        gate, _, _ = make_gate(slots=2)
        entered: list[str] = []
        tasks = entering(gate, "abcd", entered)
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


@pytest.mark.parametrize("factor", [-1.0, -0.0001, math.inf, -math.inf, math.nan])
def test_a_factor_that_is_not_a_number_from_zero_up_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="number ≥ 0"):
        make_gate(factor=factor)
    gate, _, _ = make_gate()
    with pytest.raises(ValueError, match="number ≥ 0"):
        gate.set_factor(factor)
    assert gate.factor == 1.0  # a refused change changes nothing


def test_factor_zero_holds_the_gate_open_and_still_counts_who_is_inside() -> None:
    async def main() -> None:
        gate, _, _ = make_gate(slots=1, factor=0.0)
        for name in "abcde":  # 1 exec slot, yet nobody waits
            await asyncio.wait_for(gate.enter(name), 1)
        report = gate.report()
        assert report["entered"] == 5
        assert report["max_inside"] == 5
        assert report["waited"] == 0
        assert report["final_limit"] is None  # open: no limit
        assert math.isinf(gate.limit())
        gate.leave("a")
        assert gate.report()["max_inside"] == 5

    asyncio.run(main())


def test_a_live_change_of_the_factor_opens_and_closes_the_gate() -> None:
    """Opened (0), every attempt waiting enters at once; closed again (a positive factor), the attempts
    still inside count against the new limit, so the next arrival waits until enough have left."""

    async def main() -> None:
        gate, clock, _ = make_gate(slots=1)
        entered: list[str] = []
        tasks = entering(gate, "abc", entered)
        await _settle()
        assert entered == ["a"]
        clock.t = 2.0
        gate.set_factor(0.0)
        await _settle()
        assert entered == ["a", "b", "c"]  # the waiting let in, in their order
        assert gate.report()["waited"] == 2
        assert gate.report()["wait_s_max"] == pytest.approx(2.0)
        gate.set_factor(2.0)  # 2 × 1 slot: three inside, so the next waits
        tasks += entering(gate, "d", entered)
        await _settle()
        assert entered == ["a", "b", "c"]
        gate.leave("a")  # two still inside: no room yet
        await _settle()
        assert entered == ["a", "b", "c"]
        gate.leave("b")
        await asyncio.gather(*tasks)
        assert entered == ["a", "b", "c", "d"]
        assert gate.report()["factor"] == 2.0

    asyncio.run(main())


def test_opening_the_gate_with_nobody_waiting_changes_only_the_factor() -> None:
    async def main() -> None:
        gate, _, _ = make_gate(slots=1)
        await gate.enter("a")
        gate.set_factor(0.0)
        await asyncio.wait_for(gate.enter("b"), 1)  # would have waited with the factor at 1
        assert gate.report()["waited"] == 0

    asyncio.run(main())


def test_lanes_without_readable_slots_get_no_gate() -> None:
    assert AgentGate.for_lanes(1.0, object(), Clock()) is None
    assert AgentGate.for_lanes(None, object(), Clock()) is None


def test_a_policy_factor_of_zero_gives_an_open_gate_where_slots_can_be_read() -> None:
    """A run whose gate an operator opened (0) and that was restarted gets its gate back, open."""

    class Limiter:
        slots = 2

    lanes = type("Lanes", (), {"limiters": {LaneName.EXEC: Limiter()}})()
    gate = AgentGate.for_lanes(0.0, lanes, Clock())
    assert gate is not None
    assert gate.factor == 0.0
    assert math.isinf(gate.limit())
    assert AgentGate.for_lanes(None, lanes, Clock()) is None


def test_a_runtime_whose_lanes_cannot_have_a_gate_reports_none_in_its_policy() -> None:
    """Celery lanes expose no slots: the run has no gate, and its RunStarted policy and report say so
    instead of the 1.0 that `full` asked for."""
    from runtime_fakes import FakeEngine, FakeSource, FakeTrainer

    from app.core.config import PolicyConfig
    from app.lanes.inprocess import InProcessLanes
    from app.runtime.driver import Runtime

    class NoSlots:
        """Lanes that run operations but show no slots, as Celery's."""

        def __init__(self) -> None:
            self._lanes = InProcessLanes(
                concurrency=dict.fromkeys(LaneName, 8), cpus=dict.fromkeys(LaneName), pinned=False
            )

        def __getattr__(self, name: str) -> object:
            if name == "limiters":
                raise AttributeError(name)
            return getattr(self._lanes, name)

    def runtime(lanes: object) -> Runtime:
        policy = PolicyConfig.ladder("full", groups_per_batch=2, group_size=2, surplus_groups=2)
        assert policy.agent_gate == 1.0
        return Runtime(
            policy,
            engines=[FakeEngine("engine-0")],
            engine_slots=4,
            lanes=lanes,  # type: ignore[arg-type]
            source=FakeSource(),
            trainer=FakeTrainer(),
        )

    with_slots = runtime(NoSlots()._lanes)
    assert with_slots.gate is not None
    assert with_slots.policy.agent_gate == 1.0
    without = runtime(NoSlots())
    assert without.gate is None
    assert without.policy.agent_gate is None
    assert without.gate_report() == {"agent_gate": None}
