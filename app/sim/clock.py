"""A virtual clock for asyncio: the loop's time jumps to the next deadline whenever every task is blocked.

The production runtime runs on this loop unchanged. Nothing sleeps for real, so a simulated hour takes
as long as its events take to process, and a seed reproduces a timeline exactly (the loop's ready queue
and timer heap are deterministic for a given sequence of calls: timers due at the same instant run in
the order they were scheduled).

Invariant: virtual time never goes backwards, and it only moves when nothing is ready to run.

Speed. The loop keeps its own timer heap of `(when, seq, handle)` tuples, compared in C, instead of
asyncio's heap of `TimerHandle`s compared by a Python `__lt__` (with 10,000 attempt timeouts pending
that comparison was the single largest cost of a simulation), and its `_run_once` skips the selector
unless something other than the loop's own wake-up pipe is registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import itertools
from collections.abc import Callable, Coroutine
from contextvars import Context, copy_context
from typing import Any, TypeVar

from app import early_signals

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task is blocked and no timer is pending: the simulated system can make no progress."""


class _SimHandle(asyncio.Handle):
    """A ready-queue handle built by `VirtualTimeLoop.call_soon` directly, without asyncio's debug-mode
    check (the virtual loop never runs in debug mode, so a handle has no creation traceback and never
    caches its repr); otherwise the same object."""

    __slots__ = ()
    _repr = None
    _source_traceback = None


_new_handle = object.__new__


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    # One timer heap for both kinds, for a subclass whose own `_run_once` reads only `_timers`
    # (app.service.paced); this class's `_run_once` merges the two.
    _one_heap = False

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._virtual_now = start
        self._clock_resolution = 1e-9
        # (when, seq, handle) for asyncio's timers, (when, seq, callback) for `call_fast` ones, in two
        # heaps that `_run_once` merges in (when, seq) order: asyncio's holds every attempt's timeout
        # (10,000 and more in a scale run, cancelled ones until they reach its head), the simulator's
        # a few CPU streams' timers, which so cost a few comparisons a push and a pop instead of ~15.
        self._timers: list[tuple[float, int, Any]] = []
        self._fast_timers: list[tuple[float, int, Any]] = self._timers if self._one_heap else []
        self._timer_seq = itertools.count()
        # Set by a Ctrl-C handler (`run_virtual`); the loop raises KeyboardInterrupt between callbacks,
        # never inside one (where it could leave, say, a coroutine made and its task not).
        self.interrupted = False
        # Ready-queue handles dispatched (task wake-ups and other callbacks), counted once per
        # iteration: what the loop itself costs per event (benchmarks/scale.py's loop floor).
        self.dispatched = 0

    def time(self) -> float:
        return self._virtual_now

    def call_at(  # type: ignore[override]
        self, when: float, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> asyncio.TimerHandle:
        self._check_closed()  # type: ignore[attr-defined]
        handle = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._timer_seq), handle))
        handle._scheduled = True  # type: ignore[attr-defined]
        return handle

    def call_soon(  # type: ignore[override]
        self, callback: Callable[..., object], *args: Any, context: Context | None = None
    ) -> asyncio.Handle:
        # Every task wake-up comes through here; asyncio's version adds closed and debug checks.
        handle: Any = _new_handle(_SimHandle)  # `Handle.__init__` without its frame
        handle._context = context if context is not None else copy_context()
        handle._loop = self
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle  # type: ignore[no-any-return]

    def create_task(  # type: ignore[override]
        self, coro: Coroutine[Any, Any, T], *, name: str | None = None, context: Context | None = None
    ) -> asyncio.Task[T]:
        # asyncio's version without a task factory, with fewer calls (the loop never runs in debug mode)
        if self._task_factory is not None or self._closed:  # type: ignore[attr-defined]
            return super().create_task(coro, name=name, context=context)
        return asyncio.Task(coro, loop=self, name=name, context=context)

    def timers_scheduled(self) -> int:
        """Timers scheduled so far, asyncio's and `call_fast` ones (each took one sequence number; this
        takes one more, which changes no order)."""
        return next(self._timer_seq)

    def call_fast(self, when: float, callback: Callable[[int], object]) -> int:
        """Run `callback(token)` at virtual time `when`, with no handle and no context: for the
        simulator's own timers, which cancel by ignoring a stale token. Returns the token."""
        seq = next(self._timer_seq)
        heapq.heappush(self._fast_timers, (when, seq, callback))
        return seq

    def close(self) -> None:
        super().close()
        # asyncio's close clears its own timer list; ours holds every timer left, cancelled ones too
        # (each attempt's timeout, with its task's context): freed here by reference counting, they
        # no longer wait for the cyclic collector (app.sim.run frees each simulation with one).
        self._timers.clear()
        self._fast_timers.clear()

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        pass  # cancelled timers leave the heap lazily, when they reach its head

    def _run_once(self) -> None:
        # asyncio's run_forever calls this once per iteration; here it iterates itself until the loop
        # is stopping, which saves a call and the bookkeeping of each iteration.
        ready: Any = self._ready  # type: ignore[attr-defined]
        timers = self._timers
        # The registered file descriptors, fetched once: the selector's own dict where it has one (its
        # `get_map()` view answers `len` through two Python calls, once per iteration here).
        selector: Any = self._selector  # type: ignore[attr-defined]
        fd_map = getattr(selector, "_fd_to_key", None)
        if not isinstance(fd_map, dict):
            fd_map = selector.get_map()  # a live view
        fast = self._fast_timers
        if fast is timers:
            raise RuntimeError("a loop with one timer heap runs its own `_run_once`")
        heappop = heapq.heappop
        while True:
            if self.interrupted:
                self.interrupted = False
                raise KeyboardInterrupt
            if len(fd_map) > 1:  # real file descriptors besides the wake-up pipe: poll them
                self._process_events(self._selector.select(0))  # type: ignore[attr-defined]
            if not ready:
                if self._stopping:  # type: ignore[attr-defined]
                    return
                while timers and timers[0][2]._cancelled:
                    heappop(timers)
                # Land exactly on the next deadline so that float error never leaves a timer unfired.
                if fast:
                    when = fast[0][0] if not timers or fast[0][0] < timers[0][0] else timers[0][0]
                elif timers:
                    when = timers[0][0]
                else:
                    raise SimulationDeadlock("every task is blocked and no timer is pending")
                if when > self._virtual_now:
                    self._virtual_now = when
            end = self._virtual_now + self._clock_resolution
            # The due timers of both heaps, in (when, seq) order: as one heap would give them.
            while True:
                if fast and fast[0][0] <= end:
                    if not (timers and timers[0][0] <= end and timers[0] < fast[0]):
                        _, seq, callback = heappop(fast)
                        callback(seq)  # a `call_fast` timer: the simulator's own, which raises nothing
                        continue
                elif not (timers and timers[0][0] <= end):
                    break
                handle = heappop(timers)[2]
                if not handle._cancelled:
                    handle._scheduled = False
                    ready.append(handle)
            n = len(ready)
            self.dispatched += n
            for _ in range(n):
                handle = ready.popleft()
                if handle._cancelled:
                    continue
                try:  # Handle._run without its frame; errors go to the handler as asyncio's do
                    handle._context.run(handle._callback, *handle._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self.call_exception_handler(
                        {"message": f"Exception in callback {handle!r}", "exception": exc, "handle": handle}
                    )
            if self._stopping:  # type: ignore[attr-defined]
                return


# The cyclic GC's first-generation threshold during a virtual-time run. A simulation allocates a few
# objects per event (futures, events, envelopes), nearly all acyclic and short-lived, while keeping
# thousands of tasks alive; at the default (700) the collector ran so often, and its full collections
# walked so many live tasks, that it took ~25% of a 10,000-trajectory run (benchmarks/scale.py); at
# 20,000 still ~15% (gen-0 survivors, still-running operations, were walked again in older generations).
# At 100,000 its collections still took 0.16 s of a `short` run (5 of them) and 0.8 s of a `realistic`
# one (11; each walked ~100,000 young live objects, and the second generation's walked all of them)
# while finding almost nothing: the whole `realistic` run leaves ~27,000 objects in cycles, most of them
# the simulation's own structure, freed when it ends (app.sim.run). At 1,000,000 each run has one,
# 0.04 s and 0.27 s; cyclic garbage is still collected, in steps of at most a million objects.
SIM_GC_THRESHOLD0 = 1_000_000


def run_virtual(
    main: Coroutine[Any, Any, T], start: float = 0.0, loop_stats: dict[str, int] | None = None
) -> T:
    """Run `main` to completion on a fresh virtual-time loop (with the GC threshold above; the
    process's thresholds are restored after). `loop_stats`, if given, gets the loop's own work:
    `dispatched` ready-queue handles and `timers` scheduled."""
    loop = VirtualTimeLoop(start)
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], SIM_GC_THRESHOLD0), *thresholds[1:])

    def interrupt() -> None:
        loop.interrupted = True

    with early_signals.interruptible_once(interrupt):
        try:
            result = loop.run_until_complete(main)
        except BaseException:
            _unwind(loop)  # a Ctrl-C mid-run: let every task run its cleanup, so none is left pending
            raise
        finally:
            gc.set_threshold(*thresholds)
            if loop_stats is not None:
                loop_stats.update(dispatched=loop.dispatched, timers=loop.timers_scheduled())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        if loop.interrupted:  # pressed after the loop's last check: the run is done, the press still counts
            raise KeyboardInterrupt
        return result


def _unwind(loop: VirtualTimeLoop) -> None:
    """Cancel the tasks a run left (after a KeyboardInterrupt out of the loop, or an error) and run
    them to their end on virtual time. Left pending, each was destroyed at exit with a warning, and
    each attempt's cleanup then failed outside the loop: thousands of stderr lines for one Ctrl-C."""
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        with contextlib.suppress(Exception):  # best effort: the interrupt is what the caller reports
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
