"""A virtual-time loop paced to the wall clock, for simulated runs served over the API.

The simulator's loop (app.sim.clock) jumps to the next deadline as soon as every task is blocked. A run
that waits on the outside world (a trainer polling over HTTP) cannot jump: here virtual time follows
the wall clock at `speed` virtual seconds per wall second, the loop sleeps in its selector until the
next timer is due, and other threads wake it with `call_soon_threadsafe`. `pause()` freezes the clock:
no timer fires and no simulated work progresses until `resume()`, while commands still run.

Invariant: virtual time never goes backwards, and it moves only while the loop is not paused.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from typing import Any

from app.sim.clock import VirtualTimeLoop

# The longest the selector waits in one go: the next timer of a slow run (a small `speed`) can be
# further off in wall time than the selector accepts (an OverflowError past about 24 days).
MAX_SELECT_S = 3600.0


class PacedLoop(VirtualTimeLoop):
    def __init__(self, speed: float = 1.0, start: float = 0.0) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        super().__init__(start)
        self.speed = speed
        self._paused = False
        self._anchor_wall = time.monotonic()
        self._anchor_virtual = start

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Freeze virtual time (call on the loop, e.g. through `call_soon_threadsafe`)."""
        if not self._paused:
            self._anchor_virtual = self._virtual_now  # frozen at the time callbacks see now
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._anchor_wall = time.monotonic()
            self._paused = False

    def _paced_now(self) -> float:
        if self._paused:
            return self._anchor_virtual
        return self._anchor_virtual + (time.monotonic() - self._anchor_wall) * self.speed

    def _run_once(self) -> None:
        # One iteration, as asyncio's own: wait in the selector until the next timer is due on the paced
        # clock (or another thread wakes us), fire the due timers, run what is ready. The timer heap is
        # the simulator loop's: (when, seq, TimerHandle) or (when, seq, call_fast callback).
        ready: Any = self._ready  # type: ignore[attr-defined]
        timers = self._timers
        while timers and type(timers[0][2]) is asyncio.TimerHandle and timers[0][2]._cancelled:
            heapq.heappop(timers)
        if ready or self._stopping:  # type: ignore[attr-defined]
            timeout: float | None = 0.0
        elif self._paused or not timers:
            timeout = None  # only another thread (a command) can give us work
        else:
            timeout = min(MAX_SELECT_S, max(0.0, (timers[0][0] - self._paced_now()) / self.speed))
        self._process_events(self._selector.select(timeout))  # type: ignore[attr-defined]
        now = self._paced_now()
        if now > self._virtual_now:
            self._virtual_now = now
        end = self._virtual_now + self._clock_resolution
        while timers and timers[0][0] <= end:
            _, seq, handle = heapq.heappop(timers)
            if type(handle) is asyncio.TimerHandle:
                if not handle._cancelled:
                    handle._scheduled = False  # type: ignore[attr-defined]
                    ready.append(handle)
            else:
                handle(seq)  # a `call_fast` timer of the simulated CPU pools
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()
