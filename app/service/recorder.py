"""A run's event stream as the service records it: the runtime publishes every state change on this
bus (app.runtime.events); the store's sink, the metrics sink and a live view subscribe.

A resumed run (a later incarnation after a restart) continues its predecessor's stream: sequence
numbers go on from the store's next one, its clock starts where the stored stream ended, and its live
view and rollout log start from the stored stream (replayed), so its counters go on from the stored
totals.

Invariants:
- sequence numbers continue across incarnations, so the stored stream of a run has no gap and no
  duplicate;
- publishing never blocks and never raises because of a sink (the sinks are buffered); the live view
  is updated inline, so a GET sees every event published before it;
- every group a crashed incarnation left open ends in the stream, discarded with reason `orphaned`;
- the live view counts the whole stream, stored and new: admitted = delivered + discarded + open;
- an ended run's recent events are let go once its store sink has written every event (`close`): its
  timeline is then read from the store, and a server that ran many runs holds none of their streams.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.events import (
    BatchDelivered,
    BatchRequested,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    SandboxOp,
    TurnDone,
    VersionPublished,
)
from app.runtime.events import EventBus, EventSink
from app.service.rollouts import RolloutLog
from app.store.db import OUTAGE_S

# How long closing a run's recorder waits for its sinks: the store's wait for a database that is away
# (`CORRAL_STORE_OUTAGE_S`, `ServiceStore.outage_s`), and this much more.
CLOSE_MARGIN_S = 10.0
CLOSE_WAIT_S = OUTAGE_S + CLOSE_MARGIN_S  # at the default outage wait


def close_wait_s(outage_s: float) -> float:
    """How long closing a recorder waits for a store that waits `outage_s` for its database: it
    was `CLOSE_WAIT_S` whatever the setting, so a longer `CORRAL_STORE_OUTAGE_S` lost a run's last
    events at close and a shorter one still held a stop 70 s."""
    return outage_s + CLOSE_MARGIN_S


# A simulated run stands still while its sinks hold this many unwritten events, until they are down to
# `BACKLOG_LOW` (`RunRecorder.backlogged`); far below a sink's capacity (100,000), where it would drop.
BACKLOG_HIGH = 20_000
BACKLOG_LOW = 5_000


@dataclass
class LiveView:
    """What GET /api/runs/{id} shows without touching the database; updated inline per event."""

    admitted: int = 0
    delivered: int = 0
    discarded: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    last_batch_index: int | None = None
    trainer_version: int = 0
    engine_versions: dict[str, int] = field(default_factory=dict)
    events: int = 0
    last_seq: int = -1
    staleness: Counter[int] = field(default_factory=Counter)
    # The trainer's figures on the run's clock, for the dashboard's runs list (no replay of the stream)
    first_t: float | None = None  # the run's first event
    last_t: float = 0.0  # its latest
    trainer_wait_s: float = 0.0  # the delivered batches' collection times, summed
    requested_at: float | None = None  # the open request for a batch, if the trainer is waiting

    def on_envelope(self, env: Envelope) -> None:
        ev = env.event
        self.events += 1
        self.last_seq = env.seq
        if self.first_t is None:
            self.first_t = env.t
        self.last_t = max(self.last_t, env.t)
        if isinstance(ev, GroupAdmitted):
            self.admitted += 1
        elif isinstance(ev, GroupDelivered):
            self.delivered += 1
            self.staleness[ev.staleness] += 1
        elif isinstance(ev, GroupDiscarded):
            self.discarded[ev.reason] += 1
        elif isinstance(ev, BatchRequested):
            self.requested_at = env.t
        elif isinstance(ev, BatchDelivered):
            self.batches += 1
            self.last_batch_index = ev.batch_index
            self.trainer_wait_s += env.t - ev.requested_at
            self.requested_at = None
        elif isinstance(ev, VersionPublished):
            self.trainer_version = max(self.trainer_version, ev.version)
        elif isinstance(ev, EngineUpdateEnd) and ev.ok:
            self.engine_versions[ev.engine] = ev.version

    def as_dict(self) -> dict[str, Any]:
        return {
            "groups_admitted": self.admitted,
            "groups_delivered": self.delivered,
            "groups_discarded": dict(self.discarded),
            "batches": self.batches,
            "last_batch_index": self.last_batch_index,
            "staleness_delivered": {str(k): v for k, v in sorted(self.staleness.items())},
            "events": self.events,
            "last_seq": self.last_seq,
        }


class _ContinuingBus(EventBus):
    """The project's event bus, numbering from `first_seq` (a resumed run continues its stream)."""

    def __init__(self, run_id: str, first_seq: int, clock: Callable[[], float]) -> None:
        super().__init__(run_id, clock=clock)
        self._seq = first_seq


class RecentEvents:
    """The newest events of a run as timeline rows, so reading a live run's timeline needs no query.

    Holds at least `keep` events; rows are built once, when published (on the run's loop), and read
    from API threads under a lock."""

    def __init__(self, first_seq: int, keep: int = 20_000) -> None:
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._first = first_seq  # seq of _rows[0]
        self._keep = keep
        self._released = False

    def on_envelope(self, env: Envelope) -> None:
        row = env.to_dict()
        del row["run_id"]
        with self._lock:
            if self._released:
                return
            if not self._rows:
                self._first = env.seq
            self._rows.append(row)
            if len(self._rows) > 2 * self._keep:
                drop = len(self._rows) - self._keep
                self._rows = self._rows[drop:]
                self._first += drop

    def release(self) -> None:
        """Hold nothing more: every later `since` answers None (ask the store)."""
        with self._lock:
            self._rows = []
            self._released = True

    def since(self, since: int, limit: int) -> list[dict[str, Any]] | None:
        """Rows with seq > `since`, or None when older ones are no longer held (ask the store)."""
        with self._lock:
            if self._released:
                return None
            start = since + 1 - self._first
            if start < 0:
                return None
            return self._rows[start : start + limit]


class StoredMark:
    """A run's store sink, noting the highest sequence number its writes have got to (written, or
    failed on for good: done with either way; a batch failed on during an outage is written later), so
    that an answer can wait until what it changed is stored."""

    def __init__(self, sink: EventSink) -> None:
        self.sink = sink
        self._seq = -1
        self._cond = threading.Condition()

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        try:
            self.sink.write_batch(envelopes)
        except Exception as exc:
            if not self.retryable(exc):  # done with: the bus gives it up
                self._mark(envelopes)
            raise
        self._mark(envelopes)

    def retryable(self, exc: BaseException) -> bool:
        """The store's word: a batch failed on during a database outage is written later."""
        retryable = getattr(self.sink, "retryable", None)
        return retryable is not None and bool(retryable(exc))

    def _mark(self, envelopes: Sequence[Envelope]) -> None:
        if envelopes:
            with self._cond:
                self._seq = max(self._seq, envelopes[-1].seq)
                self._cond.notify_all()

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Whether the store's writes got to `seq` within `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq >= seq, timeout_s)


class RunRecorder:
    """One run's bus with its live view and rollout log; the manager attaches the store and metrics
    sinks. A resumed run passes the view and log its stored stream left (`ResumePoint`)."""

    def __init__(
        self,
        run_id: str,
        clock: Callable[[], float],
        first_seq: int = 0,
        view: LiveView | None = None,
        rollouts: RolloutLog | None = None,
    ) -> None:
        self.run_id = run_id
        self.bus: EventBus = _ContinuingBus(run_id, first_seq, clock)
        self.view = view if view is not None else LiveView()
        self.rollouts = rollouts if rollouts is not None else RolloutLog()
        self.recent = RecentEvents(first_seq)
        self.stored: StoredMark | None = None  # the store's sink, once the manager attaches it
        self.close_wait_s = CLOSE_WAIT_S  # the manager sets it from its store's outage wait
        self._backlogged = False
        # They only watch the run (the dashboard, the API's answers): a bug in one must not cost it.
        self.bus.observe(self.view.on_envelope, "live view")
        # The frequent kinds touch no rollout (and never open a stream: its first event is not one).
        self.bus.observe(self.rollouts.on_envelope, "rollouts", {TurnDone: None, SandboxOp: None})
        self.bus.observe(self.recent.on_envelope, "recent events")

    def publish(self, event: Event) -> Envelope:
        return self.bus.publish(event)

    def backlogged(self) -> bool:
        """Whether a run that can wait (a simulated one: `PacedLoop.hold`) should, for its sinks: from
        `BACKLOG_HIGH` events unwritten until they are down to `BACKLOG_LOW`."""
        backlog = self.bus.backlog()
        if backlog >= BACKLOG_HIGH:
            self._backlogged = True
        elif backlog <= BACKLOG_LOW:
            self._backlogged = False
        return self._backlogged

    def wait_stored(self, seq: int, timeout_s: float) -> bool:
        """Block until the event numbered `seq` is in the store (the sink writes in order); False when
        `timeout_s` passed first (a sink far behind, or one that dropped it)."""
        return self.stored is None or self.stored.wait(seq, timeout_s)

    def orphan_open_groups(self, open_groups: set[int], detail: str) -> int:
        """Close the groups a crashed incarnation left open: discarded with reason `orphaned`."""
        for gid in sorted(open_groups):
            self.publish(GroupDiscarded(gid, "orphaned", detail))
        return len(open_groups)

    def close(self, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Flush and stop the sinks, waiting up to `timeout_s` (default `close_wait_s`). The store's may
        be waiting out a database outage (its `outage_s`): the run's last events are waited for rather
        than counted unflushed. Once the store has every event, the recent events are let go (the
        store answers for the ended run)."""
        stats = self.bus.close(self.close_wait_s if timeout_s is None else timeout_s)
        store = stats.get("store")
        lost = ("dropped", "failed", "unflushed", "kept_on_disk")
        if store is not None and not any(store[k] for k in lost):
            self.recent.release()
        return stats
