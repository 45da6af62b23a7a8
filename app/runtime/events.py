"""The event bus: the runtime publishes every state change of a run here, as a typed event.

`EventBus.publish(event)` wraps the event in an `Envelope` (run id, gap-free sequence number, time on
the run's clock: the running loop's time by default) and hands it to two kinds of consumers:

- **Subscribers** (`subscribe(fn)`): synchronous, in-process, called inline in publication order, e.g.
  the group `Ledger` and the report accumulator. They are part of the run's own accounting, so they
  must be cheap, and an exception in one propagates to the publisher (it is a bug, not a fault). A
  subscriber may name cheaper handlers for some exact event types, or none for kinds it ignores
  (`subscribe(fn, by_type)`); the bus picks each type's handlers once.
- **Observers** (`observe(fn, name)`): subscribers that only watch the run (the dashboard's live view,
  the API's rollout answers, progress lines). A bug in one must not cost the run: its exception is
  caught, counted in `observer_errors` (the run report's `event_observer_errors`) and logged, the
  first with its traceback.
- **Sinks** (`add_sink(sink)`): buffered and batched, for the SQL store, the live stream to the
  browser and the metrics. Each sink has its own bounded buffer and its own worker thread that calls
  `sink.write_batch(envelopes)` with up to `batch_size` envelopes, as soon as that many are buffered or
  `flush_interval_s` after the oldest one arrived, whichever comes first.

The sink protocol::

    class EventSink(Protocol):
        def write_batch(self, envelopes: Sequence[Envelope]) -> None: ...

`write_batch` runs in the sink's worker thread, never on the event loop, with envelopes in sequence
order; batches of one sink never overlap. It may block (a database commit) or raise. A sink that
lives on an event loop (an SSE stream) hands the batch over with `loop.call_soon_threadsafe`.

Invariants:
- observability never stops the run: `publish` never blocks and never raises because of a sink. A
  full buffer drops the new envelope and counts it (`dropped`); a `write_batch` that raises is counted
  (`errors`, and its envelopes in `failed`) and logged; the next batch is tried as usual;
- nothing is lost silently: every envelope published to a sink ends counted exactly once, as
  `written`, `dropped`, `failed` or (after `close`, for a sink too slow to drain) `unflushed`;
  `stats()` reports them per sink and the run report carries them (`event_sinks`);
- `close()` flushes every sink and joins its thread (waiting at most `timeout_s` per sink).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from app.core.events import Envelope, Event

log = logging.getLogger(__name__)

Subscriber = Callable[[Envelope], None]


class EventSink(Protocol):
    def write_batch(self, envelopes: Sequence[Envelope]) -> None: ...


@dataclass
class SinkStats:
    written: int = 0  # envelopes handed to a write_batch that returned
    dropped: int = 0  # refused because the buffer was full
    failed: int = 0  # in a write_batch that raised
    unflushed: int = 0  # still buffered when close() gave up waiting for the sink
    errors: int = 0  # write_batch calls that raised
    batches: int = 0  # write_batch calls that returned
    max_buffered: int = 0
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SinkWorker:
    def __init__(
        self, name: str, sink: EventSink, batch_size: int, flush_interval_s: float, capacity: int
    ) -> None:
        if batch_size < 1 or capacity < batch_size or not flush_interval_s > 0:
            raise ValueError(
                f"sink {name}: need batch_size ≥ 1, capacity ≥ batch_size and flush_interval_s > 0"
            )
        self.name = name
        self.sink = sink
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.capacity = capacity
        self.stats = SinkStats()
        self._buffer: deque[Envelope] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name=f"event-sink-{name}", daemon=True)
        self._thread.start()

    def offer(self, env: Envelope) -> None:
        with self._cond:
            if len(self._buffer) >= self.capacity:
                self.stats.dropped += 1
                dropped = self.stats.dropped
            else:
                dropped = 0
                self._buffer.append(env)
                n = len(self._buffer)
                self.stats.max_buffered = max(self.stats.max_buffered, n)
                if n == 1 or n >= self.batch_size:
                    self._cond.notify()
        if dropped and dropped & (dropped - 1) == 0:  # the first drop, then at 2, 4, 8...: seen, not a flood
            log.warning(
                "event sink %s is full (%d buffered): %d events dropped so far; the run goes on",
                self.name,
                self.capacity,
                dropped,
            )

    def _take(self) -> list[Envelope] | None:
        """The next batch: wait for batch_size envelopes, or flush_interval_s after the first one."""
        with self._cond:
            while not self._buffer and not self._closing:
                self._cond.wait()
            if not self._buffer:
                return None  # closing and drained
            deadline = time.monotonic() + self.flush_interval_s
            while len(self._buffer) < self.batch_size and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            n = min(len(self._buffer), self.batch_size)
            return [self._buffer.popleft() for _ in range(n)]

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self.sink.write_batch(batch)
            except Exception as exc:  # a broken sink is counted and logged; the run goes on
                with self._cond:
                    self.stats.errors += 1
                    self.stats.failed += len(batch)
                    self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("event sink %s failed on %d events: %r", self.name, len(batch), exc)
            else:
                with self._cond:
                    self.stats.written += len(batch)
                    self.stats.batches += 1

    def close(self, timeout_s: float) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            if self._thread.is_alive():  # a sink stuck in write_batch: what it never got is counted
                self.stats.unflushed += len(self._buffer)
                self._buffer.clear()
                log.warning("event sink %s did not drain within %.1f s", self.name, timeout_s)


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class EventBus:
    """One run's event stream: gap-free envelopes to synchronous subscribers and buffered sinks."""

    def __init__(self, run_id: str, clock: Callable[[], float] = _loop_time, first_seq: int = 0) -> None:
        self.run_id = run_id
        self._clock = clock
        self._loop_clock = clock is _loop_time
        self._seq = first_seq  # a run resumed from its store continues its sequence
        self._subscribers: list[tuple[Subscriber, dict[type[Event], Subscriber | None]]] = []
        self._dispatch: dict[type[Event], tuple[Subscriber, ...]] = {}  # per event type, built on first use
        self._sinks: list[_SinkWorker] = []
        self.observer_errors: dict[str, int] = {}  # exceptions raised by each observer, by name

    @property
    def published(self) -> int:
        return self._seq

    def bind_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """A bus on the default clock (the running loop's) reads `loop`'s clock directly until it is
        unbound with None: the runtime binds the loop it runs on, which saves a loop lookup per event.
        A bus given its own clock keeps it."""
        if self._loop_clock:
            self._clock = _loop_time if loop is None else loop.time

    def subscribe(
        self, fn: Subscriber, by_type: Mapping[type[Event], Subscriber | None] | None = None
    ) -> None:
        """Call `fn` with every envelope, in publication order; `by_type` names, for some exact event
        types, a handler to call instead (None: none), e.g. a cheaper one for the frequent kinds."""
        self._subscribers.append((fn, dict(by_type or {})))
        self._dispatch.clear()

    def observe(
        self, fn: Subscriber, name: str, by_type: Mapping[type[Event], Subscriber | None] | None = None
    ) -> None:
        """`subscribe` for what only watches the run: an exception in `fn` (or a `by_type` handler) is
        counted under `name` and logged, and the event goes on to the others."""

        def guarded(handler: Subscriber) -> Subscriber:
            def call(env: Envelope) -> None:
                try:
                    handler(env)
                except Exception:
                    failed = self.observer_errors[name] = self.observer_errors.get(name, 0) + 1
                    if failed == 1:
                        log.exception(
                            "run %s: event observer %s failed on %s (seq %d); the run goes on, and its "
                            "further failures are counted",
                            self.run_id,
                            name,
                            type(env.event).__name__,
                            env.seq,
                        )

            return call

        handlers = {cls: None if h is None else guarded(h) for cls, h in (by_type or {}).items()}
        self.subscribe(guarded(fn), handlers)

    def _handlers(self, cls: type[Event]) -> tuple[Subscriber, ...]:
        handlers = []
        for fn, by_type in self._subscribers:
            handler = by_type.get(cls, fn)
            if handler is not None:
                handlers.append(handler)
        self._dispatch[cls] = found = tuple(handlers)
        return found

    def add_sink(
        self,
        sink: EventSink,
        name: str | None = None,
        batch_size: int = 500,
        flush_interval_s: float = 0.25,
        capacity: int = 100_000,
    ) -> None:
        """Buffer up to `capacity` envelopes for `sink`, written in batches by its own thread."""
        name = name or type(sink).__name__
        if any(w.name == name for w in self._sinks):
            raise ValueError(f"an event sink named {name!r} is already attached")
        self._sinks.append(_SinkWorker(name, sink, batch_size, flush_interval_s, capacity))

    def publish(self, event: Event) -> Envelope:
        env = Envelope(self.run_id, self._seq, self._clock(), event)
        self._seq += 1
        handlers = self._dispatch.get(type(event))
        if handlers is None:
            handlers = self._handlers(type(event))
        for fn in handlers:
            fn(env)
        for worker in self._sinks:
            worker.offer(env)
        return env

    def stats(self) -> dict[str, dict[str, Any]]:
        return {w.name: w.stats.as_dict() for w in self._sinks}

    def close(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
        """Flush and stop every sink; return their final stats. Call it once the run has ended."""
        for worker in self._sinks:
            worker.close(timeout_s)
        return self.stats()

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
