"""Why did the trainer wait? The critical path of every batch, computed from the event stream alone.

Definitions (seconds on the run's clock):

- The **wait** of batch n is its batch collection time: the window W = [requested_at, delivered_at]
  from `BatchDelivered` (`requested_at`, and the envelope time as the delivery).
- The **critical group** of batch n is the group of the batch whose `GroupReady` came last (ties: the
  later event). Without a `GroupReady`, the latest `AttemptFinished` of the group stands in.
- The **critical attempt** is the attempt of the critical group whose last `AttemptFinished` came last:
  the sibling that held the group.
- Every instant of W is given to exactly one **phase**, by what the critical attempt was doing then.
  When several apply, the first in this list wins:

  1. `admission`    the critical attempt had not started yet (its group waited for admission: B + S full);
  2. `handoff`      the critical attempt had finished: the group waited to be handed to the trainer;
  3. `restart`      the instant lies before the attempt's last `AttemptRestarted`: that work was thrown
                    away by a stop-the-world update;
  4. `update_pause` inside a turn (queued or running) while the engine that ran it was loading weights
                    (`EngineUpdateBegin` → `EngineUpdateEnd` of that engine); and, ranked just
                    above `agent`, any instant of the attempt not covered by a recorded span while
                    *every* engine was loading weights: no turn could be served then (a turn
                    cancelled while it waited, e.g. by the attempt's timeout, leaves no `TurnDone`);
  5. `engine_outage` inside a turn while every engine was down (`EngineStateChanged` of engine `*`:
                    `all_down` until its next state), and a turn's engine call that failed (a
                    `TurnDone` with an error: its engine died under it, or failed it) up to the turn's
                    retry asking for a slot again; and, ranked just above `agent` (below the update
                    rule), any instant of the attempt not covered by a recorded span while every engine
                    was down;
  6. `model_turn`   a turn's engine call (`TurnDone.start` → `end`);
  7. `engine_wait`  a turn waiting for an engine slot (`TurnDone.queued_at` → `start`);
  8. `lane_queue`   a sandbox op waiting in its lane's queue (`SandboxOp.queued_at` → `start`);
     `agent_gate`   an attempt, its reset done, waiting to start its agent phase while the exec lane
                    is full (`AgentGateWait.queued_at` → `start`; app.runtime.gate);
  9. `reset`, `tool_call`, `validate`, `cleanup`  a sandbox op running in the lane of that name
                    (`reset`, `exec`, `validate`, `cleanup`);
  10. `agent`       inside the attempt, between recorded spans (the agent's own work).

So the phases of a batch sum to its wait exactly, and the run's phases sum to the trainer's total wait.
A batch whose groups were all ready before it was asked for has a wait near zero, all of it `handoff`.

Pure: no I/O, no clock. `attribute_waits` reads envelopes in any order (it sorts by sequence number);
`WaitAccumulator` folds them one at a time in sequence order, keeping only the open groups' spans
and, with `keep_batches`, only the newest batches' critical paths (the run's totals stay whole).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from app.core.events import (
    AgentGateWait,
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    GroupAdmitted,
    GroupDiscarded,
    GroupReady,
    RunStarted,
    SandboxOp,
    TurnDone,
)

PHASES: tuple[str, ...] = (
    "admission",
    "handoff",
    "restart",
    "update_pause",
    "engine_outage",
    "model_turn",
    "engine_wait",
    "lane_queue",
    "agent_gate",
    "reset",
    "tool_call",
    "validate",
    "cleanup",
    "agent",
)

PHASE_LABELS: dict[str, str] = {
    "admission": "waiting for admission",
    "handoff": "hand-off to the trainer",
    "restart": "work thrown away by restarts",
    "update_pause": "weight-update pauses",
    "engine_outage": "engine outages",
    "model_turn": "model turns",
    "engine_wait": "waits for an engine slot",
    "lane_queue": "lane queues",
    "agent_gate": "the agent-phase gate",
    "reset": "sandbox resets",
    "tool_call": "tool calls",
    "validate": "validation",
    "cleanup": "cleanup",
    "agent": "agent work between calls",
}

LANE_PHASE = {"reset": "reset", "exec": "tool_call", "validate": "validate", "cleanup": "cleanup"}
# "stalled" (every engine updating, no span recorded) ranks just above "agent" and counts as update_pause;
# "unserved" (every engine down, no span recorded) ranks just below it and counts as engine_outage.
_RANK: dict[str, float] = {name: i for i, name in enumerate(PHASES)} | {
    "stalled": len(PHASES) - 1.5,
    "unserved": len(PHASES) - 1.25,
}
_COUNTS_AS = {"stalled": "update_pause", "unserved": "engine_outage"}

Interval = tuple[float, float]


@dataclass(frozen=True, slots=True)
class BatchWait:
    """The critical path of one batch: who held it, and where the wait went (phase → seconds)."""

    batch_index: int
    requested_at: float
    delivered_at: float
    group_id: int | None
    attempt: int | None
    group_ready_at: float | None
    phases: dict[str, float]

    @property
    def wait_s(self) -> float:
        return self.delivered_at - self.requested_at

    def largest(self) -> str | None:
        return _largest(self.phases)


@dataclass(frozen=True, slots=True)
class WaitAttribution:
    """The run's wait by phase and the critical path of its batches: every batch's, or, where
    `batch_count` says there were more (a long live run's view), the newest ones'. `waited_s`, when
    given, is the whole run's wait (its batches' waits summed in delivery order)."""

    batches: tuple[BatchWait, ...]
    phases: dict[str, float] = field(default_factory=dict)
    batch_count: int | None = None  # every batch attributed, those not kept included
    waited_s: float | None = None

    @property
    def count(self) -> int:
        return len(self.batches) if self.batch_count is None else self.batch_count

    @property
    def total_s(self) -> float:
        return sum(b.wait_s for b in self.batches) if self.waited_s is None else self.waited_s

    def largest(self) -> str | None:
        return _largest(self.phases)

    def ranked(self) -> list[tuple[str, float]]:
        """Phases with a share of the wait, largest first."""
        shares = [(p, s) for p, s in self.phases.items() if s > 0]
        return sorted(shares, key=lambda ps: (-ps[1], _RANK[ps[0]]))

    def summary(self, top: int = 4) -> str:
        """One sentence: "The trainer waited 84.0 s over 3 batches: 51.2 s on model turns, …"."""
        n = self.count
        head = f"The trainer waited {self.total_s:.1f} s over {n} batch{'es' if n != 1 else ''}"
        parts = [f"{s:.1f} s on {PHASE_LABELS[p]}" for p, s in self.ranked()[:top]]
        return head + (": " + ", ".join(parts) + "." if parts else ".")

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON form for run reports."""
        return {
            "total_s": round(self.total_s, 6),
            "largest": self.largest(),
            "summary": self.summary(),
            "phases": {p: round(s, 6) for p, s in self.phases.items()},
            "batches": [
                {
                    "batch": b.batch_index,
                    "requested_at": round(b.requested_at, 6),
                    "wait_s": round(b.wait_s, 6),
                    "group": b.group_id,
                    "attempt": b.attempt,
                    "group_ready_at": None if b.group_ready_at is None else round(b.group_ready_at, 6),
                    "largest": b.largest(),
                    "phases": {p: round(s, 6) for p, s in b.phases.items() if s > 0},
                }
                for b in self.batches
            ],
        }


def _largest(phases: dict[str, float]) -> str | None:
    best = max(phases.items(), key=lambda ps: (ps[1], -_RANK[ps[0]]), default=None)
    return best[0] if best is not None and best[1] > 0 else None


@dataclass(slots=True)
class _Attempt:
    started: float | None = None
    finished: float | None = None
    restarted: float | None = None
    # Its turns and sandbox ops as published; their spans are worked out only for a batch's critical
    # attempt (`spans`, `turns`), so folding an event costs one append.
    ops: list[TurnDone | SandboxOp | AgentGateWait] = field(default_factory=list)

    @property
    def spans(self) -> list[tuple[float, float, str]]:
        out: list[tuple[float, float, str]] = []
        for ev in self.ops:
            if isinstance(ev, TurnDone):
                out.append((ev.queued_at, ev.start, "engine_wait"))
                out.append((ev.start, ev.end, "model_turn"))
            elif isinstance(ev, AgentGateWait):
                out.append((ev.queued_at, ev.start, "agent_gate"))
            else:
                out.append((ev.queued_at, ev.start, "lane_queue"))
                out.append((ev.start, ev.end, LANE_PHASE.get(ev.lane, "tool_call")))
        return out

    @property
    def failed_calls(self) -> list[Interval]:
        """Each failed engine call, from its start until the turn asked for a slot again (its next op,
        a retry) or, when the attempt went on no further, the call's end."""
        out: list[Interval] = []
        for ev, after in itertools.zip_longest(self.ops, self.ops[1:]):
            if isinstance(ev, TurnDone) and ev.error is not None:
                retry = after.queued_at if isinstance(after, TurnDone) else ev.end
                out.append((ev.start, max(ev.end, retry)))
        return out

    @property
    def turns(self) -> list[tuple[str, float, float, float]]:
        """engine, queued, start, end of each turn"""
        return [(ev.engine, ev.queued_at, ev.start, ev.end) for ev in self.ops if isinstance(ev, TurnDone)]


class WaitAccumulator:
    """Folds the stream in sequence order; at each `BatchDelivered` it works out that batch's critical
    path, then forgets the batch's groups (and a discarded group's attempts at its discard).

    Memory: the spans of groups not yet ended, the weight-update and outage windows that end after the
    latest batch was asked for (batches are asked for in order, so no later batch's window reaches an
    earlier one), and one `BatchWait` per batch, or with `keep_batches` the newest that many (the
    run's phases, batch count and wait are running totals). So the runtime can keep one beside its
    report, and the result equals `attribute_waits` over the same envelopes (its last `keep_batches`
    batches).

    A group is open from its `GroupAdmitted` until it is delivered or discarded, and only an open group's
    attempts and ops are kept. Ops come after that too (an attempt's sandbox cleanup, the tail of an
    attempt its group no longer waited for), and no batch's path can include them: kept, they filled
    the map again, about one group a batch for the rest of the run (some 1 KB a version).
    """

    def __init__(self, keep_batches: int | None = None) -> None:
        self._admitted: dict[int, float] = {}
        self._ready: dict[int, float] = {}
        self._attempts: dict[int, dict[int, _Attempt]] = {}
        self._updates: dict[str, list[Interval]] = defaultdict(list)
        self._open_updates: dict[str, float] = {}
        self._engines: set[str] = set()
        self._outages: list[Interval] = []  # every engine down
        self._outage_since: float | None = None
        self._batches: deque[BatchWait] = deque(maxlen=keep_batches)
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._count = 0
        self._waited = 0.0  # summed in delivery order, as `sum` over every batch would

    @property
    def open_groups(self) -> int:
        """Groups whose spans are still kept (for tests of the memory bound)."""
        return len(set(self._attempts) | set(self._admitted) | set(self._ready))

    def _attempt(self, gid: int, attempt: int) -> _Attempt:
        """The attempt's record; one that is not kept (its group is not open) when it has ended."""
        group = self._attempts.get(gid)
        if group is None:
            if gid not in self._admitted:
                return _Attempt()
            group = self._attempts[gid] = {}
        att = group.get(attempt)
        if att is None:
            att = group[attempt] = _Attempt()
        return att

    def on_op(self, env: Envelope) -> None:
        """`on_envelope` for the frequent kinds, a `TurnDone` or a `SandboxOp`: one append."""
        ev = env.event
        self._attempt(ev.group_id, ev.attempt).ops.append(ev)  # type: ignore[attr-defined, arg-type]
        if isinstance(ev, TurnDone):
            self._engines.add(ev.engine)

    def on_envelope(self, env: Envelope) -> None:
        ev, t = env.event, env.t
        if isinstance(ev, TurnDone | SandboxOp | AgentGateWait):  # the frequent kinds first
            self.on_op(env)
        elif isinstance(ev, GroupAdmitted):
            self._admitted[ev.group_id] = t
        elif isinstance(ev, GroupReady):
            self._ready[ev.group_id] = t
        elif isinstance(ev, AttemptStarted):
            att = self._attempt(ev.group_id, ev.attempt)
            att.started = t if att.started is None else att.started
        elif isinstance(ev, AttemptFinished):
            self._attempt(ev.group_id, ev.attempt).finished = t
        elif isinstance(ev, AttemptRestarted):
            self._attempt(ev.group_id, ev.attempt).restarted = t
        elif isinstance(ev, EngineUpdateBegin):
            self._engines.add(ev.engine)
            self._open_updates[ev.engine] = t
        elif isinstance(ev, EngineUpdateEnd):
            begin = self._open_updates.pop(ev.engine, None)
            if begin is not None:
                self._updates[ev.engine].append((begin, t))
        elif isinstance(ev, EngineStateChanged):
            if ev.engine == "*" and ev.state == "all_down":
                self._outage_since = t if self._outage_since is None else self._outage_since
            elif ev.engine == "*" and self._outage_since is not None:
                self._outages.append((self._outage_since, t))
                self._outage_since = None
        elif isinstance(ev, GroupDiscarded):
            self._forget(ev.group_id)
        elif isinstance(ev, BatchDelivered):
            self._on_batch(ev, t)
            for gid in ev.group_ids:
                self._forget(gid)
        elif isinstance(ev, RunStarted):
            self._engines.update(getattr(ev, "engines", ()))

    def _forget(self, gid: int) -> None:
        self._attempts.pop(gid, None)
        self._admitted.pop(gid, None)
        self._ready.pop(gid, None)

    def _windows(self, lo: float, hi: float) -> dict[str, list[Interval]]:
        """Each engine's update windows overlapping [lo, hi]; one still open ends at `hi`."""
        out: dict[str, list[Interval]] = {}
        for engine in self._engines:
            ivs = [(b, e) for b, e in reversed(self._updates.get(engine, [])) if e > lo]
            if engine in self._open_updates:
                ivs.append((self._open_updates[engine], hi))
            out[engine] = [(b, e) for b, e in ivs if b < hi]
        return out

    def _all_down(self, lo: float, hi: float) -> list[Interval]:
        """The windows with every engine down that overlap [lo, hi]; one still open ends at `hi`."""
        ivs = [(b, e) for b, e in reversed(self._outages) if e > lo]
        if self._outage_since is not None:
            ivs.append((self._outage_since, hi))
        return [(b, e) for b, e in ivs if b < hi]

    def _critical(self, group_ids: Iterable[int]) -> tuple[int | None, int | None]:
        best: tuple[float, int] | None = None
        for gid in group_ids:
            ends = [a.finished for a in self._attempts.get(gid, {}).values() if a.finished is not None]
            ready = self._ready.get(gid, max(ends, default=None))
            if ready is not None and (best is None or ready >= best[0]):
                best = (ready, gid)
        if best is None:
            return None, None
        gid = best[1]
        finished = [(a.finished, i) for i, a in self._attempts.get(gid, {}).items() if a.finished is not None]
        return gid, max(finished)[1] if finished else None

    def _on_batch(self, ev: BatchDelivered, delivered: float) -> None:
        window = (ev.requested_at, max(delivered, ev.requested_at))
        gid, attempt_no = self._critical(ev.group_ids)
        if gid is None or attempt_no is None:
            phases = dict.fromkeys(PHASES, 0.0)
            phases["handoff"] = window[1] - window[0]
        else:
            updates = self._windows(*window)
            stalled = _all_updating(updates, len(self._engines))
            attempt = self._attempts[gid][attempt_no]
            outages = self._all_down(*window)
            labelled = _labelled(self._admitted.get(gid), attempt, window, updates, stalled, outages)
            phases = _split(labelled, window)
        for p, sec in phases.items():
            self._phases[p] += sec
        self._prune(window[0])
        self._count += 1
        self._waited += window[1] - window[0]
        self._batches.append(
            BatchWait(
                batch_index=ev.batch_index,
                requested_at=window[0],
                delivered_at=window[1],
                group_id=gid,
                attempt=attempt_no,
                group_ready_at=None if gid is None else self._ready.get(gid),
                phases=phases,
            )
        )

    def _prune(self, asked: float) -> None:
        """Forget the update and outage windows that ended before `asked`, this batch's request: the
        next batches are asked for no earlier, so none of their windows can reach them."""
        for ivs in self._updates.values():
            ended = next((i for i, (_, e) in enumerate(ivs) if e > asked), len(ivs))
            del ivs[:ended]
        ended = next((i for i, (_, e) in enumerate(self._outages) if e > asked), len(self._outages))
        del self._outages[:ended]

    @property
    def latest(self) -> BatchWait | None:
        """The critical path of the batch folded last."""
        return self._batches[-1] if self._batches else None

    @property
    def kept_windows(self) -> int:
        """Update and outage windows kept (for tests of the memory bound)."""
        return sum(len(ivs) for ivs in self._updates.values()) + len(self._outages)

    def result(self) -> WaitAttribution:
        return WaitAttribution(tuple(self._batches), dict(self._phases), self._count, self._waited)


def _all_updating(updates: dict[str, list[Interval]], engines: int) -> list[Interval]:
    """Intervals during which every one of `engines` engines was loading weights."""
    if not engines or len(updates) != engines or not all(updates.values()):
        return []
    edges = sorted((t, d) for ivs in updates.values() for b, e in ivs for t, d in ((b, 1), (e, -1)))
    out: list[Interval] = []
    depth, since = 0, 0.0
    for t, d in edges:
        depth += d
        if d == 1 and depth == engines:
            since = t
        elif d == -1 and depth == engines - 1 and t > since:
            out.append((since, t))
    return out


def _labelled(
    admitted: float | None,
    attempt: _Attempt,
    window: Interval,
    updates: dict[str, list[Interval]],
    stalled: list[Interval],
    outages: list[Interval],
) -> list[tuple[float, float, str]]:
    lo, hi = window
    out: list[tuple[float, float, str]] = []
    start = attempt.started if attempt.started is not None else (admitted if admitted is not None else lo)
    out.append((lo, start, "admission"))
    if attempt.finished is not None:
        out.append((attempt.finished, hi, "handoff"))
    if attempt.restarted is not None:
        out.append((lo, attempt.restarted, "restart"))
    for engine, queued, _, end in attempt.turns:
        for b, e in updates.get(engine, ()):
            out.append((max(queued, b), min(end, e), "update_pause"))
        for b, e in outages:
            out.append((max(queued, b), min(end, e), "engine_outage"))
    out.extend((b, e, "engine_outage") for b, e in attempt.failed_calls)
    out.extend(attempt.spans)
    out.extend((b, e, "stalled") for b, e in stalled)
    out.extend((b, e, "unserved") for b, e in outages)
    return [(max(a, lo), min(b, hi), p) for a, b, p in out if min(b, hi) > max(a, lo)]


def _split(labelled: list[tuple[float, float, str]], window: Interval) -> dict[str, float]:
    """Give each instant of `window` to the highest-ranked phase covering it (else `agent`)."""
    lo, hi = window
    phases = dict.fromkeys(PHASES, 0.0)
    if hi <= lo:
        return phases
    cuts = sorted({lo, hi, *(a for a, _, _ in labelled), *(b for _, b, _ in labelled)})
    by_start = sorted(labelled)
    starts = [a for a, _, _ in by_start]
    for a, b in itertools.pairwise(cuts):
        mid = (a + b) / 2
        # Spans are few per attempt (tens to hundreds); a prefix scan is enough.
        covering = [p for s, e, p in by_start[: bisect.bisect_right(starts, mid)] if e > mid]
        phase = min(covering, key=_RANK.__getitem__) if covering else "agent"
        phases[_COUNTS_AS.get(phase, phase)] += b - a
    return phases


def attribute_waits(envelopes: Iterable[Envelope]) -> WaitAttribution:
    """The critical path of every delivered batch, and the run's wait summed by phase."""
    acc = WaitAccumulator()
    for env in sorted(envelopes, key=lambda e: e.seq):
        acc.on_envelope(env)
    return acc.result()
