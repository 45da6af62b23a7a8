"""A virtual clock for asyncio: the loop's time jumps to the next deadline whenever every task is blocked.

The production runtime runs on this loop unchanged. Nothing sleeps for real, so a simulated hour takes
as long as its events take to process, and a seed reproduces a timeline exactly (the loop's ready queue
and timer heap are deterministic for a given sequence of calls).

Invariant: virtual time never goes backwards, and it only moves when nothing is ready to run.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task is blocked and no timer is pending: the simulated system can make no progress."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Only the loop's own wake-up pipe is registered in a pure simulation; polling it on every
        # iteration would cost a system call per event for nothing.
        ready = super().select(0) if len(self.get_map()) > 1 or timeout != 0 else []
        if ready or timeout == 0:
            return ready
        assert self.loop is not None
        self.loop.jump(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = start
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now

    def jump(self, timeout: float | None) -> None:
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            # Land exactly on the next deadline so that float error never leaves a timer unfired.
            self._virtual_now = max(self._virtual_now, scheduled[0].when())
        elif timeout is None:
            raise SimulationDeadlock("every task is blocked and no timer is pending")
        else:
            self._virtual_now += timeout


def run_virtual(main: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run `main` to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
