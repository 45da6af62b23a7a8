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
  `sink.write_batch(envelopes)` as soon as `batch_size` envelopes are buffered or `flush_interval_s`
  after the oldest one arrived, whichever comes first. A sink that has fallen behind gets up to
  `BEHIND_BATCHES` × `batch_size` at once: a SQL sink's cost per event falls with the batch (SQLite:
  21,020 events per CPU-second at 500, 29,385 at 5,000, `benchmarks.ingest`), so it catches up.

The sink protocol::

    class EventSink(Protocol):
        def write_batch(self, envelopes: Sequence[Envelope]) -> None: ...

`write_batch` runs in the sink's worker thread, never on the event loop, with envelopes in sequence
order; batches of one sink never overlap. It may block (a database commit) or raise. A sink that
lives on an event loop (an SSE stream) hands the batch over with `loop.call_soon_threadsafe`.

A sink may be given a spill (`app.runtime.spill.SpillFile`, a bounded append-only file on local disk):
once its buffer is full, every later envelope goes to the spill (`spilled`), and the worker, once it
has written the buffer, writes from the spill, in order, until it is drained (`recovered`); then the
buffer takes new envelopes again. Past half full, the buffer and the batch being written are copied to
disk beside the spill as the buffer fills (on the spill's backup thread), and the spill's first envelope
is written only once the whole copy is on disk: a process killed once the spill holds anything leaves
every unwritten envelope there. Below a quarter full (the sink caught up), the copies are removed.
A sink may say which of its errors pass (`retryable(exc) -> bool`, e.g. the store's database outage):
a batch failed on for such a reason is tried again, after a pause that doubles up to `retry_max_s`,
while what comes after it waits in the buffer and the spill.

Invariants:
- observability never stops the run: `publish` never waits on a sink and never raises because of
  one. It waits only on the local disk: a spilled envelope is written to the OS at once, and the
  publish that begins a spill waits until the backup thread, which has been copying the buffer since
  it was half full, has all of it on disk (7-18 ms measured, `benchmarks.spill_cost`), at most
  BACKUP_WAIT_S. A full buffer without a spill (or whose spill is full, or whose disk refuses) drops
  the new envelope and counts it (`dropped`); a `write_batch` that raises is counted (`errors`) and
  logged, and its envelopes in `failed` unless it is tried again;
- a sink with a spill gets every envelope once, in sequence order, however long it is away, while
  the spill's disk allows (`SinkStats.spill_bytes`, at most the spill's `max_bytes`);
- nothing is lost silently: every envelope published to a sink ends counted once, as `written`,
  `dropped`, `failed` or, after a `close` that gave up on a sink too slow to drain, `unflushed` (memory)
  or `kept_on_disk` (its spill, for the next process to store: once given up, the sink neither writes
  nor counts the batch it was writing, which is there); `stats()` reports them per sink and the run
  report carries them (`event_sinks`);
- `close()` flushes every sink and joins its thread (waiting at most `timeout_s` per sink); closes
  from two threads at once give a sink up once, so its spill gets each envelope it held once.
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
from app.runtime.spill import BACKUP_WAIT_S, SpillFile

log = logging.getLogger(__name__)

Subscriber = Callable[[Envelope], None]


class EventSink(Protocol):
    def write_batch(self, envelopes: Sequence[Envelope]) -> None: ...


BEHIND_BATCHES = 10  # a sink behind writes up to this many batch sizes at once
# A batch a sink failed on for a passing reason is tried again after these pauses (doubling): the
# defaults of `add_sink`'s `retry_first_s` and `retry_max_s`
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


def _worth_logging(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence of a repeated condition: seen, not a flood."""
    return count > 0 and count & (count - 1) == 0


@dataclass
class SinkStats:
    written: int = 0  # envelopes handed to a write_batch that returned (unless kept_on_disk meanwhile)
    dropped: int = 0  # refused: the buffer was full and the spill (if any) could not take them
    failed: int = 0  # in a write_batch that raised and was not tried again (unless kept_on_disk)
    unflushed: int = 0  # still buffered when close() gave up waiting for the sink
    errors: int = 0  # write_batch calls that raised
    batches: int = 0  # write_batch calls that returned
    max_buffered: int = 0
    last_error: str = ""
    spilled: int = 0  # written to the spill on disk (the buffer was full)
    recovered: int = 0  # read back from the spill and written by the sink
    # left in the spill when close() gave up, for the next start to store (with a copy of the batch
    # the sink was still writing, which the store skips if that write landed)
    kept_on_disk: int = 0
    spill_bytes: int = 0  # what the spill holds on disk now
    max_spill_bytes: int = 0  # the most it held

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _SinkWorker:
    def __init__(
        self,
        name: str,
        sink: EventSink,
        batch_size: int,
        flush_interval_s: float,
        capacity: int,
        spill: SpillFile | None = None,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        if batch_size < 1 or capacity < batch_size or not flush_interval_s > 0:
            raise ValueError(
                f"sink {name}: need batch_size ≥ 1, capacity ≥ batch_size and flush_interval_s > 0"
            )
        if not 0 < retry_first_s <= retry_max_s:
            raise ValueError(f"sink {name}: need 0 < retry_first_s ≤ retry_max_s")
        self.retry_first_s = retry_first_s
        self.retry_max_s = retry_max_s
        self.name = name
        self.sink = sink
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.capacity = capacity
        self.stats = SinkStats()
        self._buffer: deque[Envelope] = deque()
        self._spill = spill
        # A sink may say which of its errors pass (a database outage): such a batch is tried again.
        self._retryable: Callable[[BaseException], bool] = getattr(sink, "retryable", _never)
        self._inflight: list[Envelope] = []  # the batch write_batch has, until it returned or failed
        self._done_seq = -1  # the last seq written or failed on: a copy of it read back is skipped
        self._episodes = 0  # times the buffer filled and went to the spill
        # Past half full, the buffer is copied to disk as it fills (`SpillFile.back_up`), so that the
        # spill, when it begins, depends on no copy still to write; below a quarter, the copies go.
        self._backing_up = False
        self._unbacked: list[Envelope] = []  # buffered since, not yet handed to the backup thread
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False  # close() gave up: write nothing more, keep the spill for the next start
        self._batch_kept = False  # close() gave up and put the batch being written in the spill
        self._thread = threading.Thread(target=self._loop, name=f"event-sink-{name}", daemon=True)
        self._thread.start()

    def offer(self, env: Envelope) -> None:
        with self._cond:
            spill = self._spill
            if spill is not None and (spill.unread or len(self._buffer) >= self.capacity):
                dropped = self._spill_locked(spill, env)
            elif len(self._buffer) >= self.capacity:
                self.stats.dropped += 1
                dropped = self.stats.dropped
            else:
                dropped = 0
                self._buffer.append(env)
                n = len(self._buffer)
                self.stats.max_buffered = max(self.stats.max_buffered, n)
                if n == 1 or n >= self.batch_size:
                    self._cond.notify()
                if spill is not None:
                    self._back_up_locked(spill, env, n)
        if _worth_logging(dropped):  # the first drop, then at 2, 4, 8...: seen, not a flood
            log.warning(
                "event sink %s is full (%d buffered%s): %d events dropped so far; the run goes on",
                self.name,
                self.capacity,
                "" if spill is None else f", its spill {spill.disk_bytes:,} bytes of {spill.max_bytes:,}",
                dropped,
            )

    def _back_up_locked(self, spill: SpillFile, env: Envelope, buffered: int) -> None:
        """Copy the buffer to disk as it fills past half: the batch being written and the buffer at
        once, then what comes, `batch_size` at a time, on the spill's backup thread (encoding 100,000
        envelopes held the run's loop 0.7 s)."""
        if self._backing_up:
            self._unbacked.append(env)
            if len(self._unbacked) >= self.batch_size:
                spill.back_up(self._unbacked)
                self._unbacked = []
        elif buffered >= self.capacity // 2:
            self._begin_backup_locked(spill)

    def _begin_backup_locked(self, spill: SpillFile) -> None:
        """Copy the batch being written and the buffer to disk; what comes after goes in `_unbacked`."""
        self._backing_up = True
        spill.back_up([*self._inflight, *self._buffer])

    def _spill_locked(self, spill: SpillFile, env: Envelope) -> int:
        """Put `env` in the spill, after what it holds. The buffer stays the worker's (older than the
        spill, it is written first). The first time (the buffer just filled), the publisher waits for
        the rest of the buffer's copy to reach the disk first (`_back_up_locked` wrote the rest while
        it filled): a process killed once the spill holds anything leaves every envelope not yet
        written on disk. A disk that does not take the copy within BACKUP_WAIT_S is logged, and the
        spill goes on. The dropped count when the disk refused `env`, else 0."""
        first = not spill.unread
        if first:
            if not self._backing_up:
                self._begin_backup_locked(spill)
            spill.back_up(self._unbacked)
            self._unbacked = []
            if not spill.backed_up():
                log.error("event sink %s: the copy of its buffer is not on disk after %.0f s; spilling on",
                          self.name, BACKUP_WAIT_S)  # fmt: skip
        try:
            spill.append([env])
        except (OSError, ValueError) as exc:
            self.stats.dropped += 1
            self.stats.last_error = f"spill: {type(exc).__name__}: {exc}"
            return self.stats.dropped
        self.stats.spilled += 1
        self._note_spill(spill)
        if first:
            self._episodes += 1
            if _worth_logging(self._episodes):
                log.warning(
                    "event sink %s is full (%d buffered): spilling to %s until it catches up (%d times so "
                    "far); the run goes on",
                    self.name,
                    self.capacity,
                    spill.directory,
                    self._episodes,
                )
            self._cond.notify()
        return 0

    def _note_spill(self, spill: SpillFile) -> None:
        self.stats.spill_bytes = spill.disk_bytes
        self.stats.max_spill_bytes = max(self.stats.max_spill_bytes, spill.disk_bytes)

    def stats_now(self) -> dict[str, Any]:
        """The counts, with what the spill holds on disk now (its backup thread removes copies)."""
        with self._cond:
            if self._spill is not None:
                self._note_spill(self._spill)
            return self.stats.as_dict()

    def filled(self, share: float) -> bool:
        """Whether its buffer holds `share` of its capacity or more; only for a sink with a spill (one
        without is allowed to drop: the metrics')."""
        return self._spill is not None and len(self._buffer) >= share * self.capacity

    def at_risk(self, share: float) -> bool:
        """Whether envelopes offered now may be dropped: `filled(share)`, and its spill cannot take the
        rest (`SpillFile.taking`: the disk refuses, or the spill is near its bound)."""
        spill = self._spill
        return spill is not None and self.filled(share) and not spill.taking()

    @property
    def spill(self) -> SpillFile | None:
        return self._spill

    def buffered(self) -> int:
        """Envelopes held unwritten: in memory and in the spill."""
        return len(self._buffer) + (self._spill.unread if self._spill is not None else 0)

    def _take(self) -> tuple[list[Envelope], bool] | None:
        """The next batch, and whether it came from the spill: the buffer's (wait for batch_size
        envelopes, or flush_interval_s after the first one), else the spill's (which holds what came
        after the buffer's), in order."""
        with self._cond:
            while True:
                spill = self._spill
                while not self._buffer and not (spill and spill.unread) and not self._closing:
                    self._cond.wait()
                if self._abandoned:
                    return None
                if self._buffer:
                    deadline = time.monotonic() + self.flush_interval_s
                    while 0 < len(self._buffer) < self.batch_size and not self._closing:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self._cond.wait(left)
                    if not self._buffer:
                        continue  # emptied meanwhile, by a close() that gave up
                    n = min(len(self._buffer), self.batch_size * BEHIND_BATCHES)
                    self._inflight = [self._buffer.popleft() for _ in range(n)]
                    return self._inflight, False
                if not (spill and spill.unread):
                    if spill is not None:
                        spill.clear()
                        spill.close()  # once the backup thread has removed the copies
                    return None  # closing and drained
                on_disk = spill.bytes
                try:
                    read = spill.read(self.batch_size * BEHIND_BATCHES)
                    batch = [e for e in read if e.seq > self._done_seq]
                except (OSError, ValueError) as exc:  # the disk lost them: counted, not hidden
                    self.stats.dropped += spill.unread
                    self.stats.last_error = f"spill: {type(exc).__name__}: {exc}"
                    log.error("event sink %s: its spill %s cannot be read (%r): %d events lost",
                              self.name, spill.directory, exc, spill.unread)  # fmt: skip
                    spill.clear()
                    batch = []
                self._note_spill(spill)
                if not spill.unread and _worth_logging(self._episodes):
                    log.warning("event sink %s: its spill is drained (%d events read back so far)",
                                self.name, self.stats.recovered + len(batch))  # fmt: skip
                if batch:
                    self._inflight = batch
                    if spill.bytes < on_disk:  # a file it came from is removed: a copy (`_loop`) keeps it
                        spill.back_up(batch)
                    return batch, True

    def _loop(self) -> None:
        while (taken := self._take()) is not None:
            batch, from_spill = taken
            if from_spill and self._spill is not None:
                # A batch read back whose segment was removed as it was read would be only in memory
                # while the sink writes it (a database away again: minutes): on disk first, as a copy.
                self._spill.backed_up()
            self._write(batch, from_spill)

    def _write(self, batch: list[Envelope], from_spill: bool) -> None:
        """Write `batch`; one the sink failed on for a passing reason (`retryable`) is tried again,
        after a pause that doubles up to `retry_max_s`, until it is written or close() gives up."""
        delay = self.retry_first_s
        while True:
            try:
                self.sink.write_batch(batch)
            except Exception as exc:  # a broken sink is counted and logged; the run goes on
                if not self._try_again(batch, from_spill, exc, delay):
                    return
                delay = min(2 * delay, self.retry_max_s)
            else:
                self._write_ended(batch, from_spill, None)
                return

    def _try_again(self, batch: list[Envelope], from_spill: bool, exc: Exception, delay: float) -> bool:
        """Count a write that raised `exc`; whether to write `batch` again: the error passes and the sink
        was not given up within the pause of `delay` seconds."""
        again = self._retryable(exc)
        with self._cond:
            again = again and not self._abandoned
            if not self._batch_kept:
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
        if not again:
            self._write_ended(batch, from_spill, exc)
            return False
        log.warning("event sink %s failed on %d events (seq %d-%d): %r; trying again in %.1f s",
                    self.name, len(batch), batch[0].seq, batch[-1].seq, exc, delay)  # fmt: skip
        with self._cond:
            given_up = self._cond.wait_for(lambda: self._abandoned, delay)
        if given_up:
            self._write_ended(batch, from_spill, exc, "given up at close before its next try")
        return not given_up

    def _write_ended(
        self, batch: list[Envelope], from_spill: bool, exc: Exception | None, why: str = ""
    ) -> None:
        """The one place a write's end is counted: written (`exc` None) or failed on (logged with `why`,
        else `exc`). Once close() has given the sink up and put the batch in the spill (counted
        `kept_on_disk`), its write's end is not counted, only logged. Before, a pause's end wrote it again
        after the give-up, and counted it `failed` (or `written`, the database back) on top of
        `kept_on_disk`."""
        with self._cond:
            kept = self._batch_kept
            if not kept:
                self._end_locked(batch, from_spill, written=exc is None)
        if kept:
            ended = (
                "landed; the next start skips their copy in its spill" if exc is None else f"failed ({exc!r})"
            )
            log.info(
                "event sink %s: its write of %d events, given up at close, %s", self.name, len(batch), ended
            )
        elif exc is not None:
            log.warning("event sink %s failed on %d events: %s", self.name, len(batch), why or repr(exc))

    def _end_locked(self, batch: list[Envelope], from_spill: bool, written: bool) -> None:
        """Count `batch` written or failed on. In the same hold of the lock as the count, it stops being
        the batch being written, which a close() that gives the sink up puts in the spill: each of its
        envelopes is counted once, here or there."""
        if written:
            self.stats.written += len(batch)
            self.stats.batches += 1
            if from_spill:
                self.stats.recovered += len(batch)
        else:
            self.stats.failed += len(batch)
        self._inflight = []
        self._done_seq = max(self._done_seq, batch[-1].seq)
        spill = self._spill
        if spill is None or not (self._backing_up or from_spill):
            return
        if len(self._buffer) <= self.capacity // 4 and not spill.unread:
            self._backing_up = False  # caught up: what is buffered is only in memory again
            self._unbacked = []
            spill.drop_backups()
        else:
            spill.forget_backups(self._done_seq)

    def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the worker to write what it holds, then give it up: what it still
        holds goes to the spill (`kept_on_disk`), or is counted `unflushed`. Two closes at once (a run's
        thread as its run ends, and a second Ctrl-C letting its sinks go: `RunManager._keep_unstored`)
        give it up once: each waits its own time, and the second whose wait ends finds it given up by
        the first, whose counts stand. Before, each appended the batch being written to the spill, which
        then held it twice, and counted it twice in `kept_on_disk`."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            if not self._thread.is_alive() or self._abandoned:
                return
            # a sink stuck in write_batch: what it never got is counted, and kept on disk if it can be
            self._abandoned = True
            self._cond.notify_all()
            spill = self._spill
            if spill is not None and (self._buffer or self._inflight):
                # The batch being written too: the write may never return (a copy the store already
                # has is skipped when the next start stores the spill).
                try:
                    spill.append([*self._inflight, *self._buffer])
                    self._batch_kept = bool(self._inflight)  # its write's end is counted no more
                    self.stats.spilled += len(self._buffer)
                    self._buffer.clear()
                except (OSError, ValueError) as exc:
                    log.error("event sink %s: could not spill its buffer at close: %r", self.name, exc)
            self.stats.unflushed += len(self._buffer)
            self._buffer.clear()
            if spill is not None:
                self.stats.kept_on_disk = spill.unread
                self._note_spill(spill)
                # Waits ≤10 s in the lock, yet no offer() waits: a bus closes once its loop ended or froze
                spill.close()
            log.warning(
                "event sink %s did not drain within %.1f s: %d events unflushed, %d kept in %s for the "
                "next start",
                self.name,
                timeout_s,
                self.stats.unflushed,
                self.stats.kept_on_disk,
                "its spill" if spill is None else spill.directory,
            )


def _never(exc: BaseException) -> bool:
    return False


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
        spill: SpillFile | None = None,
        retry_first_s: float = RETRY_FIRST_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        """Buffer up to `capacity` envelopes for `sink`, written in batches by its own thread; past
        that, in `spill` on disk (None: dropped). A batch the sink failed on for a passing reason is
        tried again after `retry_first_s`, then after pauses that double up to `retry_max_s`."""
        name = name or type(sink).__name__
        if any(w.name == name for w in self._sinks):
            raise ValueError(f"an event sink named {name!r} is already attached")
        worker = _SinkWorker(
            name, sink, batch_size, flush_interval_s, capacity, spill, retry_first_s, retry_max_s
        )
        self._sinks.append(worker)

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

    def backlog(self) -> int:
        """The most envelopes any sink holds unwritten now (its buffer and its spill)."""
        return max((w.buffered() for w in self._sinks), default=0)

    def filled(self, share: float) -> bool:
        """Whether a sink with a spill holds `share` of its buffer or more (`_SinkWorker.filled`): cheap,
        and what `at_risk` needs first."""
        return any(w.filled(share) for w in self._sinks)

    def at_risk(self, share: float) -> bool:
        """Whether a sink with a spill may soon drop envelopes (`_SinkWorker.at_risk`): a run that can
        should start nothing new until it is not (`RunHandle`'s hold for the store). Blocking: it may
        probe a disk."""
        return any(w.at_risk(share) for w in self._sinks)

    def spill_directories(self) -> list[str]:
        return [str(w.spill.directory) for w in self._sinks if w.spill is not None]

    def stats(self) -> dict[str, dict[str, Any]]:
        return {w.name: w.stats_now() for w in self._sinks}

    def close(self, timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
        """Flush and stop every sink; return their final stats. Call it once the run has ended; two
        threads may call it at once (`_SinkWorker.close`)."""
        for worker in self._sinks:
            worker.close(timeout_s)
        return self.stats()

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
