"""The agent-phase gate: attempts enter their agent phase only while the exec lane can serve them.

An attempt's agent time (`timeout_s`, `TaskSpec.agent_timeout_s`) starts when its reset ends. When more
attempts are in their agent phase than the exec lane's slots serve, their tool calls queue, the agents'
clocks run while they wait, and attempts are cut short: on the simulator's `cpu-scarce` workload 92% of
`full`'s attempts ran out of time (docs/simulator.md, "The agent-phase gate"). The gate holds an attempt
whose reset is done, its sandbox ready and its clock not started, until

    attempts in their agent phase < factor × exec slots ÷ tool share

where *exec slots* is the exec lane's current slots (adaptive lanes resize them to the cores the lane
can get) and *tool share* is the measured share of agent-phase time spent running tool calls, not
counting time queued for an exec slot (the share the phase would have with no queue). Until a tool
call has finished the share is taken as 1, so the first attempts enter at most one per exec slot.
With room, attempts enter in the order they reached the gate. An attempt with nothing in its agent
phase always enters, so the gate cannot stall a run. The driver lets an attempt whose reset failed or
timed out past the gate at once (`Runtime.reset_then_enter`): its agent only reports the failure.

A factor of 0 holds the gate open: every attempt waiting enters at once and none waits while it is 0.
The factor can change while the run goes on (`set_factor`, an operator's `PATCH .../policy`); the gate
counts who is inside whatever the factor, so a positive factor set after 0 closes it again at once.

The gate needs lanes whose slots it can read (`limiters`: the simulator's and the in-process lanes);
with Celery lanes the policy's gate is off (`AgentGate.for_lanes` gives None).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from typing import Any

from app.lanes.base import LaneName

# A tool share below this is taken as this: an attempt that makes almost no tool calls still counts.
MIN_TOOL_SHARE = 0.02


class AgentGate:
    """Admission to the agent phase. `enter` after the reset, `leave` when the agent phase ends (at
    validation, or when the attempt ends some other way); `exec_done` after every exec operation."""

    def __init__(self, factor: float, exec_slots: Callable[[], int], now: Callable[[], float]) -> None:
        self.factor = _checked(factor)
        self._slots = exec_slots
        self._now = now
        self._inside: dict[object, float] = {}  # token -> when it entered
        self._entered_sum = 0.0  # sum of the entry times of those inside
        self._done_s = 0.0  # agent-phase time of the phases that ended
        self._run_s = 0.0  # exec operations' running time
        self._queued_s = 0.0  # exec operations' time queued for a slot
        self._waiting: deque[tuple[object, asyncio.Future[None]]] = deque()
        self._since: dict[object, float] = {}  # waiting token -> when it reached the gate
        self._last = 0.0  # the clock at the gate's last change: its report is read after the run
        # Figures for the report
        self.entered = 0
        self.waited = 0
        self.wait_s = 0.0
        self.wait_s_max = 0.0
        self.max_waiting = 0
        self.max_inside = 0

    @classmethod
    def for_lanes(cls, factor: float | None, lanes: object, now: Callable[[], float]) -> AgentGate | None:
        """The gate for `lanes`, or None: no factor, or lanes whose exec slots cannot be read."""
        limiters: Any = getattr(lanes, "limiters", None)
        if factor is None or not limiters or LaneName.EXEC not in limiters:
            return None
        limiter = limiters[LaneName.EXEC]
        return cls(factor, lambda: int(limiter.slots), now)

    def tool_share(self, now: float | None = None) -> float:
        """The share of agent-phase time spent running tool calls, queueing for them left out, at `now`
        (default: the clock's time)."""
        if self._run_s <= 0:
            return 1.0
        now = self._now() if now is None else now
        phase = self._done_s + len(self._inside) * now - self._entered_sum - self._queued_s
        return 1.0 if phase <= 0 else min(1.0, max(MIN_TOOL_SHARE, self._run_s / phase))

    def limit(self, now: float | None = None) -> float:
        """How many attempts may be in their agent phase at `now` (infinite while the gate is open)."""
        if self.factor == 0:
            return math.inf
        return self.factor * self._slots() / self.tool_share(now)

    def set_factor(self, factor: float) -> None:
        """Change the factor live: those waiting that the new limit has room for enter now (all of them
        for 0); those inside stay inside, and a lower limit holds the next arrivals until enough leave."""
        self.factor = _checked(factor)
        self._last = self._now()
        self._let_in()

    def _has_room(self) -> bool:
        return not self._inside or len(self._inside) < self.limit()

    def _admit(self, token: object) -> None:
        self._last = now = self._now()
        self._inside[token] = now
        self._entered_sum += now
        self.entered += 1
        self.max_inside = max(self.max_inside, len(self._inside))

    async def enter(self, token: object) -> None:
        """Return once `token`'s attempt may start its agent phase."""
        if not self._waiting and self._has_room():
            self._admit(token)
            return
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((token, future))
        self._since[token] = self._now()
        self.max_waiting = max(self.max_waiting, len(self._since))
        try:
            await future
        except asyncio.CancelledError:
            self._since.pop(token, None)  # cancelled while waiting: `_let_in` skips its done future
            if token in self._inside:  # let in, then cancelled before it ran
                self.leave(token)
            raise

    def leave(self, token: object) -> None:
        """`token`'s agent phase ended (a no-op for a token not inside)."""
        entered = self._inside.pop(token, None)
        if entered is None:
            return
        self._entered_sum -= entered
        self._last = now = self._now()
        self._done_s += now - entered
        self._let_in()

    def exec_done(self, queued_s: float, run_s: float) -> None:
        """An exec operation ended after `queued_s` waiting for a slot and `run_s` running."""
        self._queued_s += queued_s
        self._run_s += run_s
        self._last = self._now()
        self._let_in()

    def _let_in(self) -> None:
        while self._waiting and self._has_room():
            token, future = self._waiting.popleft()
            if future.done():
                continue
            waited = self._now() - self._since.pop(token)
            self.waited += waited > 0
            self.wait_s += waited
            self.wait_s_max = max(self.wait_s_max, waited)
            self._admit(token)
            future.set_result(None)

    def report(self) -> dict[str, Any]:
        """The run report's `agent_gate`."""
        return {
            "factor": self.factor,
            "entered": self.entered,
            "waited": self.waited,
            "wait_s_mean": round(self.wait_s / self.entered, 3) if self.entered else 0.0,
            "wait_s_max": round(self.wait_s_max, 3),
            "max_waiting": self.max_waiting,
            "max_inside": self.max_inside,
            "final_limit": None if self.factor == 0 else round(self.limit(self._last), 1),  # None: open
            "tool_share": round(self.tool_share(self._last), 4),
        }


def _checked(factor: float) -> float:
    if not math.isfinite(factor) or factor < 0:
        raise ValueError(f"agent gate factor must be a number ≥ 0 (0: open), not {factor!r}")
    return factor
