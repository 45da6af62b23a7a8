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
  5. `model_turn`   a turn's engine call (`TurnDone.start` → `end`);
  6. `engine_wait`  a turn waiting for an engine slot (`TurnDone.queued_at` → `start`);
  7. `lane_queue`   a sandbox op waiting in its lane's queue (`SandboxOp.queued_at` → `start`);
  8. `reset`, `tool_call`, `validate`, `cleanup`  a sandbox op running in the lane of that name
                    (`reset`, `exec`, `validate`, `cleanup`);
  9. `agent`        inside the attempt, between recorded spans (the agent's own work).

So the phases of a batch sum to its wait exactly, and the run's phases sum to the trainer's total wait.
A batch whose groups were all ready before it was asked for has a wait near zero, all of it `handoff`.

Pure: no I/O, no clock. `attribute_waits` reads envelopes in any order (it sorts by sequence number).
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from app.core.events import (
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    GroupAdmitted,
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
    "model_turn",
    "engine_wait",
    "lane_queue",
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
    "model_turn": "model turns",
    "engine_wait": "waits for an engine slot",
    "lane_queue": "lane queues",
    "reset": "sandbox resets",
    "tool_call": "tool calls",
    "validate": "validation",
    "cleanup": "cleanup",
    "agent": "agent work between calls",
}

LANE_PHASE = {"reset": "reset", "exec": "tool_call", "validate": "validate", "cleanup": "cleanup"}
# "stalled" (every engine updating, no span recorded) ranks just above "agent"; it counts as update_pause.
_RANK: dict[str, float] = {name: i for i, name in enumerate(PHASES)} | {"stalled": len(PHASES) - 1.5}

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
    batches: tuple[BatchWait, ...]
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(b.wait_s for b in self.batches)

    def largest(self) -> str | None:
        return _largest(self.phases)

    def ranked(self) -> list[tuple[str, float]]:
        """Phases with a share of the wait, largest first."""
        shares = [(p, s) for p, s in self.phases.items() if s > 0]
        return sorted(shares, key=lambda ps: (-ps[1], _RANK[ps[0]]))

    def summary(self, top: int = 4) -> str:
        """One sentence: "The trainer waited 84.0 s over 3 batches: 51.2 s on model turns, …"."""
        n = len(self.batches)
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


@dataclass
class _Attempt:
    started: float | None = None
    finished: float | None = None
    restarted: float | None = None
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    turns: list[tuple[str, float, float, float]] = field(default_factory=list)  # engine, queued, start, end


@dataclass
class _Index:
    admitted: dict[int, float] = field(default_factory=dict)
    ready: dict[int, float] = field(default_factory=dict)
    attempts: dict[tuple[int, int], _Attempt] = field(default_factory=lambda: defaultdict(_Attempt))
    updates: dict[str, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    batches: list[tuple[BatchDelivered, float]] = field(default_factory=list)
    engines: set[str] = field(default_factory=set)

    def all_updating(self) -> list[Interval]:
        """Intervals during which every known engine was loading weights."""
        if not self.engines or set(self.updates) != self.engines:
            return []
        edges = sorted((t, d) for ivs in self.updates.values() for b, e in ivs for t, d in ((b, 1), (e, -1)))
        out: list[Interval] = []
        depth, since = 0, 0.0
        for t, d in edges:
            depth += d
            if d == 1 and depth == len(self.engines):
                since = t
            elif d == -1 and depth == len(self.engines) - 1 and t > since:
                out.append((since, t))
        return out


def _index(envelopes: Iterable[Envelope]) -> _Index:
    idx = _Index()
    open_updates: dict[str, float] = {}
    last_t = 0.0
    for env in sorted(envelopes, key=lambda e: e.seq):
        ev, t = env.event, env.t
        last_t = max(last_t, t)
        if isinstance(ev, GroupAdmitted):
            idx.admitted[ev.group_id] = t
        elif isinstance(ev, GroupReady):
            idx.ready[ev.group_id] = t
        elif isinstance(ev, AttemptStarted):
            att = idx.attempts[ev.group_id, ev.attempt]
            att.started = t if att.started is None else att.started
        elif isinstance(ev, AttemptFinished):
            idx.attempts[ev.group_id, ev.attempt].finished = t
        elif isinstance(ev, AttemptRestarted):
            idx.attempts[ev.group_id, ev.attempt].restarted = t
        elif isinstance(ev, TurnDone):
            idx.engines.add(ev.engine)
            att = idx.attempts[ev.group_id, ev.attempt]
            att.turns.append((ev.engine, ev.queued_at, ev.start, ev.end))
            att.spans.append((ev.queued_at, ev.start, "engine_wait"))
            att.spans.append((ev.start, ev.end, "model_turn"))
        elif isinstance(ev, SandboxOp):
            att = idx.attempts[ev.group_id, ev.attempt]
            att.spans.append((ev.queued_at, ev.start, "lane_queue"))
            att.spans.append((ev.start, ev.end, LANE_PHASE.get(ev.lane, "tool_call")))
        elif isinstance(ev, EngineUpdateBegin):
            idx.engines.add(ev.engine)
            open_updates[ev.engine] = t
        elif isinstance(ev, EngineUpdateEnd):
            begin = open_updates.pop(ev.engine, None)
            if begin is not None:
                idx.updates[ev.engine].append((begin, t))
        elif isinstance(ev, BatchDelivered):
            idx.batches.append((ev, t))
        elif isinstance(ev, RunStarted):
            idx.engines.update(getattr(ev, "engines", ()))
    for engine, begin in open_updates.items():  # an update still running when the stream ends
        idx.updates[engine].append((begin, last_t))
    return idx


def _critical(idx: _Index, group_ids: Iterable[int]) -> tuple[int | None, int | None]:
    best: tuple[float, int] | None = None
    for gid in group_ids:
        ends = [a.finished for (g, _), a in idx.attempts.items() if g == gid and a.finished is not None]
        ready = idx.ready.get(gid, max(ends, default=None))
        if ready is not None and (best is None or ready >= best[0]):
            best = (ready, gid)
    if best is None:
        return None, None
    gid = best[1]
    finished = [(a.finished, i) for (g, i), a in idx.attempts.items() if g == gid and a.finished is not None]
    return gid, max(finished)[1] if finished else None


def _labelled(
    idx: _Index, gid: int, attempt: _Attempt, window: Interval, stalled: list[Interval]
) -> list[tuple[float, float, str]]:
    lo, hi = window
    out: list[tuple[float, float, str]] = []
    start = attempt.started if attempt.started is not None else idx.admitted.get(gid, lo)
    out.append((lo, start, "admission"))
    if attempt.finished is not None:
        out.append((attempt.finished, hi, "handoff"))
    if attempt.restarted is not None:
        out.append((lo, attempt.restarted, "restart"))
    for engine, queued, _, end in attempt.turns:
        for b, e in idx.updates.get(engine, ()):
            out.append((max(queued, b), min(end, e), "update_pause"))
    out.extend(attempt.spans)
    out.extend((b, e, "stalled") for b, e in stalled)
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
        phases["update_pause" if phase == "stalled" else phase] += b - a
    return phases


def attribute_waits(envelopes: Iterable[Envelope]) -> WaitAttribution:
    """The critical path of every delivered batch, and the run's wait summed by phase."""
    idx = _index(envelopes)
    stalled = idx.all_updating()
    batches = []
    total = dict.fromkeys(PHASES, 0.0)
    for ev, delivered in idx.batches:
        window = (ev.requested_at, max(delivered, ev.requested_at))
        gid, attempt_no = _critical(idx, ev.group_ids)
        if gid is None or attempt_no is None:
            phases = dict.fromkeys(PHASES, 0.0)
            phases["handoff"] = window[1] - window[0]
        else:
            attempt = idx.attempts[gid, attempt_no]
            phases = _split(_labelled(idx, gid, attempt, window, stalled), window)
        for p, s in phases.items():
            total[p] += s
        batches.append(
            BatchWait(
                batch_index=ev.batch_index,
                requested_at=window[0],
                delivered_at=window[1],
                group_id=gid,
                attempt=attempt_no,
                group_ready_at=None if gid is None else idx.ready.get(gid),
                phases=phases,
            )
        )
    return WaitAttribution(tuple(batches), total)
