"""The engine pool: engines with a fixed number of turn slots each, and their health.

Invariants:
- a turn is routed only to an engine that is neither updating nor down (`UpdatePlan.routable`), and at
  most `slots` turns run on an engine at once;
- turns wait for a routable slot in FIFO order; while every engine is down they wait on a future (no
  polling) until one comes back;
- when an engine goes down, every call in flight on it is interrupted at once (`interrupt`), so its
  turns can be retried on another engine instead of waiting for a dead peer's timeout;
- each time an engine goes down its epoch increases, so a failure seen by a call made to an older
  incarnation never takes a restarted engine down again.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from app.core.rollout import UpdatePlan
from app.core.router import choose_engine
from app.engines.base import Engine
from app.engines.errors import EngineServerError, EngineTimeout, EngineUnavailable, TurnAborted


@dataclass(frozen=True)
class EngineFaultConfig:
    """How the runtime treats failing engines (bounds in app/runtime/config.py's `EnginesConfig`)."""

    update_timeout_s: float = 120.0  # one engine's whole update step: pause, drain, load, resume
    health_timeout_s: float = 5.0  # a health probe that takes longer counts as unhealthy
    health_interval_s: float | None = None  # probe serving engines this often; None: only on failures
    # Unanswered probes in a row (each `health_timeout_s`) before the health watch or an update takes a
    # serving engine for frozen; an unhealthy or unreachable answer counts at once.
    health_misses: int = 3
    restart_backoff_s: float = 1.0  # wait after a failed restart; doubles up to the maximum
    restart_backoff_max_s: float = 30.0
    turn_retries: int = 3  # failures of one turn on engines that stay up, before its attempt fails
    max_restarts: int = 0  # restart tries in a crash loop before the engine is given up; 0: never


class EngineSupervisor(Protocol):
    """Owns engine processes: `corral run`'s `EngineProcesses`; absent for remote engines and the sim."""

    async def restart(self, name: str) -> Engine:
        """Stop whatever is left of engine `name`, start it again and return a client for it once it
        answers its health check; raise when it cannot be started."""
        ...

    def exit_status(self, name: str) -> str | None:
        """How engine `name`'s process ended (`exited with -9 (SIGKILL)`), None while it runs."""
        ...


def is_engine_fault(exc: BaseException) -> bool:
    """A failure that may be the engine's, not the turn's: worth a health probe and a retry elsewhere.

    An unreachable engine, a timeout, a 5xx and an abort (by an engine the run did not pause) qualify;
    a 4xx or a malformed answer would fail the same way on any engine, so the turn fails instead."""
    return isinstance(exc, EngineUnavailable | EngineTimeout | EngineServerError | TurnAborted)


def is_unreachable(exc: BaseException) -> bool:
    """The engine could not be reached at all: it is down without asking its health route."""
    return isinstance(exc, EngineUnavailable)


class _CallScope:
    """`EnginePool.call`'s scope: what an `asyncio.Timeout` without a deadline does, registered while it
    runs so that `interrupt` can end it, as a plain `with` block. `asyncio.Timeout` is entered and left
    through two coroutines, four a turn; this carries out the same steps in the same order (the
    interruption a `call_soon` that cancels the task, its `CancelledError` turned into `TimeoutError` on
    the way out unless someone else cancelled the task too)."""

    __slots__ = ("_calls", "_cancelling", "_expiring", "_handle", "_task")

    def __init__(self, calls: dict[_CallScope, None]) -> None:
        self._calls = calls
        self._handle: asyncio.Handle | None = None
        self._expiring = False

    def __enter__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an engine call runs inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._calls[self] = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._calls.pop(self, None)
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if not self._expiring:
            return
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # interrupted, and nobody else cancelled the task meanwhile

    def interrupt(self) -> None:
        """End the call at the loop's next turn (`asyncio.Timeout.reschedule` to now)."""
        if self._expiring:
            raise RuntimeError("Cannot change state of expiring Timeout")  # as asyncio.Timeout
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_soon(self._expire)

    def _expire(self) -> None:
        self._task.cancel()
        self._expiring = True
        self._handle = None


class EnginePool:
    """Engines with a fixed number of slots each; turns wait in FIFO order for a routable slot."""

    def __init__(self, engines: Sequence[Engine], slots: int, plan: UpdatePlan) -> None:
        self.by_name = {e.name: e for e in engines}
        self.slots = slots
        self.plan = plan
        self.active = dict.fromkeys(self.by_name, 0)
        self.epoch = dict.fromkeys(self.by_name, 0)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._drain: dict[str, list[asyncio.Future[None]]] = {name: [] for name in self.by_name}
        # Each engine's calls in flight, in the order they began (a dict: `interrupt` ends them in it).
        self._calls: dict[str, dict[_CallScope, None]] = {name: {} for name in self.by_name}

    @property
    def waiting(self) -> int:
        """Turns waiting for a slot."""
        return len(self._waiters)

    def try_acquire(self, fresh: Callable[[str], bool] | None = None) -> Engine | None:
        """A routable slot now if one is free and no turn waits before us, else None (then `acquire`).
        `fresh`: engines to prefer (app.core.router.choose_engine)."""
        if self._waiters:
            return None
        name = choose_engine(self.active, self.slots, self.plan.routable, fresh)
        if name is None:
            return None
        self.active[name] += 1
        return self.by_name[name]

    async def acquire(self, fresh: Callable[[str], bool] | None = None) -> Engine:
        loop = asyncio.get_running_loop()
        while True:
            name = choose_engine(self.active, self.slots, self.plan.routable, fresh)
            if name is not None and not self._waiters:
                self.active[name] += 1
                return self.by_name[name]
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self.wake()  # pass the wake-up we were given on to the next waiter
                elif waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
            # Woken: our turn at the head. Take a slot directly if one is routable.
            name = choose_engine(self.active, self.slots, self.plan.routable, fresh)
            if name is not None:
                self.active[name] += 1
                self.wake()
                return self.by_name[name]

    def release(self, engine: Engine) -> None:
        self.active[engine.name] -= 1
        if self.active[engine.name] == 0:
            for fut in self._drain[engine.name]:
                if not fut.done():
                    fut.set_result(None)
            self._drain[engine.name].clear()
        self.wake()

    def wake(self) -> None:
        if not self._waiters or choose_engine(self.active, self.slots, self.plan.routable) is None:
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def drained(self, name: str) -> None:
        if self.active[name] == 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain[name].append(fut)
        await fut

    def call(self, name: str) -> _CallScope:
        """Scope one call to engine `name`; `interrupt(name)` ends it with `TimeoutError`."""
        return _CallScope(self._calls[name])

    def interrupt(self, name: str) -> int:
        """End every call in flight on `name` now; returns how many there were."""
        scopes = list(self._calls[name])
        for scope in scopes:
            scope.interrupt()
        return len(scopes)

    def mark_down(self, name: str) -> None:
        """A new incarnation begins: failures of calls made before this are about the old one."""
        self.epoch[name] += 1
        self.interrupt(name)

    def replace(self, engine: Engine) -> Engine:
        """Swap in a client for a restarted engine; returns the old client (the caller closes it)."""
        old = self.by_name[engine.name]
        self.by_name[engine.name] = engine
        return old
