"""A virtual-time loop paced to the wall clock, for simulated runs served over the API.

The simulator's loop (app.sim.clock) jumps to the next deadline as soon as every task is blocked. A run
that waits on the outside world (a trainer polling over HTTP) cannot jump: here virtual time follows
the wall clock at `speed` virtual seconds per wall second, the loop sleeps in its selector until the
next timer is due, and other threads wake it with `call_soon_threadsafe`. `pause()` freezes the clock:
no timer fires and no simulated work progresses until `resume()`, while commands still run.

The clock keeps `speed` only while the process keeps up. Two things slow it, and `pace()` says by how
much:
- **lag:** a loop that falls behind the wall clock (the CPU is busy) by more than `LAG_SLACK_S` does not
  jump over its due timers to catch up: virtual time goes to the next timer, and the time lost is not
  owed. A jump of a few virtual minutes would fire timeouts (an engine update's, a batch wait's) before
  the work they guard, which is itself on later timers, could run: faults the run never had.
- **hold:** `hold()`, when given, is asked each iteration; while it is true virtual time stands still
  as when paused (commands still run). A run's store sets it when its writer falls far behind
  (`RunRecorder.backlogged`): the simulation waits for the database rather than the database losing
  its events.

`hurry()` ends the pacing for good: from then on each timer fires as soon as nothing else is ready, as
in the simulator. A stopping run calls it, since what is left is simulated clean-up nobody waits on: at
`speed` 1 a run stopped seconds after it started stayed `stopping` for about 4 minutes (its 768
simulated resets and clean-ups draining in wall time), holding a place among the runs at once.

Invariant: virtual time never goes backwards, and it moves only while the loop is neither paused nor
held; until `hurry()` it runs past a timer that has not fired by `LAG_SLACK_S` × `speed` at most.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from typing import Any

from app.sim.clock import VirtualTimeLoop

# The longest the selector waits in one go: the next timer of a slow run (a small `speed`) can be
# further off in wall time than the selector accepts (an OverflowError past about 24 days).
MAX_SELECT_S = 3600.0
# How often a held loop asks again whether it may go on.
HOLD_POLL_S = 0.05
# How far (in wall seconds) the clock may run past a due timer before it counts as lagging: the selector
# wakes up to a millisecond late, and that much is not lost.
LAG_SLACK_S = 0.02


class PacedLoop(VirtualTimeLoop):
    _one_heap = True  # `call_fast` timers share `_timers`, which this `_run_once` reads alone

    def __init__(
        self, speed: float = 1.0, start: float = 0.0, hold: Callable[[], bool] | None = None
    ) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        super().__init__(start)
        self.speed = speed
        self.hold = hold
        self._paused = False
        self._held_since: float | None = None  # wall time the current hold began
        self._anchor_wall = time.monotonic()
        self._anchor_virtual = start
        self._first_wall: float | None = None  # the first and the latest turn of the loop
        self._last_wall = 0.0
        self._start_virtual = start
        self._paused_s = 0.0  # wall seconds of the ended pauses; `_held_s` of the ended holds
        self._held_s = 0.0
        self._lag_s = 0.0
        self._paused_since: float | None = None  # wall time the current pause began
        self._hurrying = False

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Freeze virtual time (call on the loop, e.g. through `call_soon_threadsafe`)."""
        if not self._paused:
            self._anchor_virtual = self._virtual_now  # frozen at the time callbacks see now
            self._paused = True
            self._paused_since = time.monotonic()

    def resume(self) -> None:
        if self._paused:
            now = time.monotonic()
            self._anchor_wall = now
            self._paused = False
            if self._paused_since is not None:
                self._paused_s += now - self._paused_since
                self._paused_since = None

    def hurry(self) -> None:
        """Stop pacing: each timer fires as soon as nothing else is ready (module doc). Call on the loop,
        as `pause`; a pause or a hold still stops the clock."""
        self._hurrying = True

    def pace(self) -> dict[str, float]:
        """How the clock kept its `speed`: `effective_speed` is virtual seconds per wall second while
        not paused (over `wall_s`, from the loop's first turn to its latest); `held_s` the wall seconds
        it stood still for the store, `lag_s` those it lost to a busy process (virtual time lost ÷
        speed)."""
        now = self._last_wall
        paused = self._paused_s + max(0.0, now - (self._paused_since or now))
        held = self._held_s + max(0.0, now - (self._held_since or now))
        wall = now - (self._first_wall or now) - paused
        virtual = self._virtual_now - self._start_virtual
        return {
            "speed": self.speed,
            "wall_s": round(wall, 3),  # the wall seconds the effective speed is over (not paused)
            "effective_speed": round(virtual / wall, 3) if wall > 0 else self.speed,
            "held_s": round(held, 3),
            "lag_s": round(self._lag_s, 3),
        }

    def _is_held(self) -> bool:
        held = self.hold is not None and not self._paused and self.hold()
        if held and self._held_since is None:
            self._anchor_virtual = self._virtual_now
            self._held_since = time.monotonic()
        elif not held and self._held_since is not None:
            now = time.monotonic()
            self._held_s += now - self._held_since
            self._held_since = None
            self._anchor_wall = now  # virtual time goes on from where the hold froze it
        return held

    def _paced_now(self) -> float:
        if self._paused or self._held_since is not None:
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
        self._last_wall = time.monotonic()
        if self._first_wall is None:
            self._first_wall = self._last_wall
        held = self._is_held()
        if ready or self._stopping:  # type: ignore[attr-defined]
            timeout: float | None = 0.0
        elif held:
            timeout = HOLD_POLL_S
        elif self._paused or not timers:
            timeout = None  # only another thread (a command) can give us work
        elif self._hurrying:
            timeout = 0.0
        else:
            timeout = min(MAX_SELECT_S, max(0.0, (timers[0][0] - self._paced_now()) / self.speed))
        self._process_events(self._selector.select(timeout))  # type: ignore[attr-defined]
        now = self._paced_now()
        if self._hurrying and timers and not held and not self._paused and now < timers[0][0]:
            now = timers[0][0]  # to the next timer at once, as the simulator's loop goes
            self._anchor_virtual, self._anchor_wall = now, time.monotonic()
        if timers and now > timers[0][0] + LAG_SLACK_S * self.speed:
            # Behind the wall clock: go to the next timer, not past it, and owe nothing (module doc).
            due = max(timers[0][0], self._virtual_now)
            self._lag_s += (now - due) / self.speed
            self._anchor_virtual, self._anchor_wall = due, time.monotonic()
            now = due
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
