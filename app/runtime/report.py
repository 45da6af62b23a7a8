"""The run report, built from the run's event stream alone: the same JSON shape for `corral sim` and
`corral run` (a contract other tools read).

Fields: policy, batches, batch_collection_s {mean, p50, p90, per_batch}, batch_interval_s {mean},
trainer_idle_fraction, lower_bound_s, max_staleness, max_groups_in_flight,
discarded_groups {stale, failed, cancelled, zero_variance}, restarted_trajectories, lost_groups,
tokens_per_s, events, wall_s — plus the extras listed in `ReportAccumulator.report`.

A figure over no value is null, never 0.0: `batch_collection_s` mean, p50 and p90 and `mean_reward`
when no batch was delivered (`batches` 0: a run stopped or failed before its first),
`batch_interval_s.mean` below two batches, and `trainer_idle_fraction` for a run that never collected
(stopped while its engines started). Every reader of these says so in words instead.

`max_groups_in_flight` counts live groups (in flight + ready: what B + S caps in the default admission
mode); `max_groups_running` counts groups in flight only (what B + S caps in the in-flight mode).
`event_sinks` (when the run's bus had sinks) says per sink how many envelopes were written, dropped
(full buffer, and full or unwritable spill), failed (the sink raised, not to be tried again), left
unflushed at close or kept on disk for the next start, and how many went through its spill;
`event_observer_errors` (only when some were raised) how many exceptions each observer of the run
raised (app.runtime.events).

Invariants:
- the runtime's report and `report_from_events(envelopes, static)` over the same run's stored
  envelopes are equal: both fold the same stream with `ReportAccumulator` (what is not in the stream,
  such as the wall time or the simulator's lower bounds, comes in `ReportStatic`);
- `lost_groups` comes from the `Ledger` over the stream, independent of the scheduler's counters;
- wasted trajectory time counts each second of an attempt once: a try thrown away by a restart counts
  under `restarted` only; a discarded group's tries count under its reason from their (re)start to
  their finish or cancellation;
- memory is O(groups in flight), except the per-group timeline, kept only when asked for.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from app.core.advantages import no_learning_signal
from app.core.attribution import WaitAccumulator
from app.core.events import (
    AttemptCancelled,
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    Ledger,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
)
from app.core.scheduler import DiscardReason

if TYPE_CHECKING:
    from app.runtime.events import EventBus

# Distinct discard details kept per reason; the rest are counted under "(other)".
MAX_DETAILS_PER_REASON = 20


NO_BATCH = "no batch"


def shown_s(value: float | None, spec: str = ".1f", none: str = NO_BATCH) -> str:
    """A report's mean or quantile of batch collection time as text (`12.3`), or `none` in words where
    it is null: a run that delivered no batch has no mean, and 0.0 would read as instant batches."""
    return none if value is None else format(value, spec)


def drawn_s(value: float | None) -> float:
    """A report's seconds as a plot draws them: null (no batch delivered, so no mean) is NaN, which
    matplotlib leaves out (no bar, a gap in a line) where 0.0 would draw instant batches."""
    return math.nan if value is None else value


def _r(x: float) -> float:
    return round(x, 6)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile; 0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True)
class ReportStatic:
    """What a report needs that is not in the event stream."""

    policy: str  # the rung or run name shown in the report
    wall_s: float = 0.0  # wall-clock seconds the run took to compute
    lower_bound_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # merged into the report as given


@dataclass
class _Engine:
    turns: int = 0
    tokens: int = 0
    updates: int = 0
    busy_s: float = 0.0
    final_version: int = 0


@dataclass
class _Lane:
    completed: int = 0
    max_busy: int = 0
    max_queue_depth: int = 0
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0


@dataclass
class _Batch:
    requested_at: float
    delivered_at: float
    ready_at: float
    mean_reward: float
    groups: int = 0  # delivered in it
    signal: int = 0  # of them with a learning signal (rewards not all equal)


class ReportAccumulator:
    """Folds envelopes, in sequence order, into the figures of the run report.

    Subscribe `on_envelope` to the run's bus, or feed it stored envelopes; then call `report`.
    """

    def __init__(self, timeline: bool = False) -> None:
        self.ledger = Ledger()
        self.waits = WaitAccumulator()  # why the trainer waited: report["wait_attribution"]
        self.timeline = timeline
        self.stream_events = 0
        self.started_at: float | None = None
        self.collection_ended_at: float | None = None
        self.end: RunEnded | None = None
        self.policy_config: dict[str, Any] = {}
        self.engines: dict[str, _Engine] = {}
        self.lanes: dict[str, _Lane] = {}
        self.batches: list[_Batch] = []
        self.trainer_wait_s = 0.0
        self.max_staleness = 0
        # Delivered groups whose G rewards are all equal: GRPO's advantages are all zero there, so the
        # group carries no learning signal (a group of attempts that all ran out of time, say).
        self.delivered_zero_variance = 0
        self.restarts = 0
        self.turns = 0
        self.tokens = 0
        self.refused_turns = 0
        self.trainer_version = 0
        self.max_updating = 0
        self.wasted: dict[str, float] = dict.fromkeys([*(r.value for r in DiscardReason), "restarted"], 0.0)
        self.details: dict[str, dict[str, int]] = {}
        self._open_request: float | None = None
        self._updating: set[str] = set()
        self._tries: dict[tuple[int, int], float] = {}  # open tries: start time
        self._group_s: dict[int, float] = {}  # live groups: seconds of their closed current tries
        self._batch_rewards: dict[int, list[float]] = {}
        self._batch_groups: dict[int, list[int]] = {}  # batch → [groups delivered, with a learning signal]
        self._rows: dict[int, dict[str, Any]] = {}  # per group, only with `timeline`
        self._batch_marks: list[tuple[int, float, float]] = []
        self._updates: list[tuple[float, str, int, str]] = []

    def by_type(self) -> dict[type[Event], Callable[[Envelope], None]]:
        """Handlers for the frequent kinds, for `EventBus.subscribe(acc.on_envelope, acc.by_type())`:
        each does what `on_envelope` does for its kind, with fewer checks."""
        return {TurnDone: self.on_turn, SandboxOp: self.on_sandbox_op}

    def on_turn(self, env: Envelope) -> None:
        """`on_envelope` for a `TurnDone`."""
        self.stream_events += 1
        ledger = self.ledger  # `ledger.on_quiet(env)` without its call
        seq = env.seq
        if seq != ledger.next_seq:
            ledger.gaps += abs(seq - ledger.next_seq)
        ledger.next_seq = seq + 1
        self.waits.on_op(env)
        ev: TurnDone = env.event  # type: ignore[assignment]
        engine = self.engines.get(ev.engine)
        if engine is None:
            engine = self.engines[ev.engine] = _Engine()
        engine.busy_s += ev.end - ev.start
        if ev.error is None:
            engine.turns += 1
            engine.tokens += ev.tokens
            self.turns += 1
            self.tokens += ev.tokens
            if ev.version > self.trainer_version:
                self.refused_turns += 1

    def on_sandbox_op(self, env: Envelope) -> None:
        """`on_envelope` for a `SandboxOp`."""
        self.stream_events += 1
        ledger = self.ledger  # `ledger.on_quiet(env)` without its call
        seq = env.seq
        if seq != ledger.next_seq:
            ledger.gaps += abs(seq - ledger.next_seq)
        ledger.next_seq = seq + 1
        self.waits.on_op(env)
        ev: SandboxOp = env.event  # type: ignore[assignment]
        lane = self.lanes.get(ev.lane)
        if lane is None:
            lane = self.lanes[ev.lane] = _Lane()
        if ev.queue_depth > lane.max_queue_depth:
            lane.max_queue_depth = ev.queue_depth
        if ev.busy > 0:
            lane.completed += 1
            if ev.busy > lane.max_busy:
                lane.max_busy = ev.busy
            waited = ev.start - ev.queued_at
            lane.wait_s_total += waited
            if waited > lane.wait_s_max:
                lane.wait_s_max = waited

    def on_envelope(self, env: Envelope) -> None:
        ev = env.event
        if isinstance(ev, TurnDone):
            self.on_turn(env)
            return
        if isinstance(ev, SandboxOp):
            self.on_sandbox_op(env)
            return
        self.stream_events += 1
        self.ledger.on_envelope(env)
        self.waits.on_envelope(env)
        t = env.t
        if isinstance(ev, AttemptStarted):
            self._tries[ev.group_id, ev.attempt] = t
        elif isinstance(ev, AttemptFinished):
            start = self._tries.pop((ev.group_id, ev.attempt), None)
            if start is not None:
                self._group_s[ev.group_id] = self._group_s.get(ev.group_id, 0.0) + t - start
        elif isinstance(ev, AttemptRestarted):
            self.restarts += 1
            start = self._tries.pop((ev.group_id, ev.attempt), None)
            if start is not None:
                self.wasted["restarted"] += t - start
        elif isinstance(ev, AttemptCancelled):
            start = self._tries.pop((ev.group_id, ev.attempt), None)
            if start is not None:
                self.wasted[ev.reason] = self.wasted.get(ev.reason, 0.0) + t - start
        else:
            self._on_group_or_run(ev, t)

    def _on_group_or_run(self, ev: object, t: float) -> None:
        if isinstance(ev, GroupAdmitted):
            if self.timeline:
                self._rows[ev.group_id] = {
                    "group": ev.group_id,
                    "task": ev.task_index,
                    "admitted_s": t,
                    "completed_s": None,
                    "ended_s": None,
                    "outcome": "running",
                    "batch": None,
                    "staleness": None,
                    "detail": "",
                }
        elif isinstance(ev, GroupReady):
            if self.timeline and ev.group_id in self._rows:
                self._rows[ev.group_id]["completed_s"] = t
        elif isinstance(ev, GroupDelivered):
            self._group_s.pop(ev.group_id, None)
            self.max_staleness = max(self.max_staleness, ev.staleness)
            self._batch_rewards.setdefault(ev.batch_index, []).extend(ev.rewards)
            counts = self._batch_groups.setdefault(ev.batch_index, [0, 0])
            counts[0] += 1
            if no_learning_signal(ev.rewards):
                self.delivered_zero_variance += 1
            else:
                counts[1] += 1
            self._end_row(ev.group_id, t, "delivered", ev.batch_index, ev.staleness, "")
        elif isinstance(ev, GroupDiscarded):
            self.wasted[ev.reason] = self.wasted.get(ev.reason, 0.0) + self._group_s.pop(ev.group_id, 0.0)
            details = self.details.setdefault(ev.reason, {})
            key = ev.detail if ev.detail in details or len(details) < MAX_DETAILS_PER_REASON else "(other)"
            details[key] = details.get(key, 0) + 1
            self._end_row(ev.group_id, t, ev.reason, None, None, ev.detail)
        elif isinstance(ev, BatchRequested):
            self._open_request = t
        elif isinstance(ev, BatchDelivered):
            self._open_request = None
            self.trainer_wait_s += t - ev.requested_at
            rewards = self._batch_rewards.pop(ev.batch_index, [])
            mean = sum(rewards) / len(rewards) if rewards else 0.0
            groups, signal = self._batch_groups.pop(ev.batch_index, (0, 0))
            self.batches.append(_Batch(ev.requested_at, t, ev.ready_at, mean, groups, signal))
            self._batch_marks.append((ev.batch_index, ev.requested_at, t))
        elif isinstance(ev, VersionPublished):
            self.trainer_version = max(self.trainer_version, ev.version)
        elif isinstance(ev, EngineUpdateBegin):
            self._updating.add(ev.engine)
            self.max_updating = max(self.max_updating, len(self._updating))
            self._updates.append((t, ev.engine, ev.version, "begin"))
        elif isinstance(ev, EngineUpdateEnd):
            self._updating.discard(ev.engine)
            engine = self.engines.setdefault(ev.engine, _Engine())
            if ev.ok:
                engine.updates += 1
                engine.final_version = ev.version
            self._updates.append((t, ev.engine, ev.version, "end" if ev.ok else "failed"))
        elif isinstance(ev, RunStarted):
            self.started_at = t
            self.policy_config = dict(ev.policy)
            for name in ev.engines:
                self.engines.setdefault(name, _Engine())
            for name in ev.lanes:
                self.lanes.setdefault(name, _Lane())
        elif isinstance(ev, RunEnded):
            self.end = ev
            self.collection_ended_at = ev.collection_ended_at if ev.collection_ended_at is not None else t
            if self._open_request is not None:  # the trainer waited until the run stopped
                self.trainer_wait_s += self.collection_ended_at - self._open_request
                self._open_request = None

    def _end_row(
        self, gid: int, t: float, outcome: str, batch: int | None, staleness: int | None, detail: str
    ) -> None:
        row = self._rows.get(gid) if self.timeline else None
        if row is None:
            return
        row.update(ended_s=t, outcome=outcome, batch=batch, staleness=staleness, detail=detail)
        if outcome == "zero_variance":  # discarded the moment its last attempt finished
            row["completed_s"] = t

    # -- the report ------------------------------------------------------------------------------

    def report(self, static: ReportStatic) -> dict[str, Any]:
        t0 = self.started_at or 0.0
        end = self.collection_ended_at if self.collection_ended_at is not None else t0
        duration = max(end - t0, 1e-9)
        waits = [b.delivered_at - b.requested_at for b in self.batches]
        intervals = [b.ready_at - a.ready_at for a, b in itertools.pairwise(self.batches)]
        ledger = self.ledger
        reasons = [r.value for r in DiscardReason] + sorted(
            set(ledger.discarded) - {r.value for r in DiscardReason}
        )
        discarded = {reason: ledger.discarded.get(reason, 0) for reason in reasons}
        report: dict[str, Any] = {
            "policy": static.policy,
            "batches": len(self.batches),
            # Of no batch there is no mean or quantile: null, not 0.0 (a run stopped before its first
            # batch read as one that collected batches instantly).
            "batch_collection_s": {
                "mean": _r(statistics.fmean(waits)) if waits else None,
                "p50": _r(quantile(waits, 0.5)) if waits else None,
                "p90": _r(quantile(waits, 0.9)) if waits else None,
                "per_batch": [_r(w) for w in waits],
            },
            "batch_interval_s": {"mean": _r(statistics.fmean(intervals)) if intervals else None},
            # of no time collecting there is no share: null, not 0% (a run stopped during its engines'
            # start-up read 0% idle, one stopped while collecting its first batch 100%)
            "trainer_idle_fraction": _r(self.trainer_wait_s / duration) if end > t0 else None,
            "lower_bound_s": None if static.lower_bound_s is None else _r(static.lower_bound_s),
            "max_staleness": self.max_staleness,
            "max_groups_in_flight": ledger.max_open,
            "discarded_groups": discarded,
            "restarted_trajectories": self.restarts,
            "lost_groups": ledger.lost,
            "tokens_per_s": _r(self.tokens / duration),
            "events": self.end.scheduler_events if self.end is not None else 0,
            "wall_s": round(static.wall_s, 3),
            # extras
            "admitted_groups": ledger.admitted_count,
            "delivered_groups": ledger.delivered_count,
            "delivered_zero_variance_groups": self.delivered_zero_variance,
            "run_s": _r(duration),
            "trainer_wait_s": _r(self.trainer_wait_s),
            "turns": self.turns,
            "tokens": self.tokens,
            "refused_turns": self.refused_turns,
            "mean_reward": (
                _r(statistics.fmean(b.mean_reward for b in self.batches)) if self.batches else None
            ),
            # each batch's mean reward, and the share of its groups with a learning signal (rewards not
            # all equal: GRPO's advantages are all zero in the others); null for a batch without groups
            "mean_reward_per_batch": [_r(b.mean_reward) if b.groups else None for b in self.batches],
            "trainable_share_per_batch": [
                _r(b.signal / b.groups) if b.groups else None for b in self.batches
            ],
            "wasted_trajectory_s": {k: _r(v) for k, v in self.wasted.items()},
            "discard_details": {reason: dict(d) for reason, d in sorted(self.details.items())},
            "max_groups_running": ledger.max_running,
            "max_engines_updating": self.max_updating,
            "engines": {
                name: {
                    "turns": e.turns,
                    "tokens": e.tokens,
                    "updates": e.updates,
                    "busy_s": _r(e.busy_s),
                    "final_version": e.final_version,
                }
                for name, e in self.engines.items()
            },
            "lanes": {
                name: {
                    "completed": lane.completed,
                    "max_busy": lane.max_busy,
                    "max_queue_depth": lane.max_queue_depth,
                    "wait_s_mean": _r(lane.wait_s_total / lane.completed) if lane.completed else 0.0,
                    "wait_s_max": _r(lane.wait_s_max),
                }
                for name, lane in self.lanes.items()
            },
            "event_stream": {
                "events": self.stream_events,
                "gaps": ledger.gaps,
                "run_ended": None if self.end is None else self.end.reason,
            },
            "policy_config": self.policy_config,
            "wait_attribution": self.waits.result().to_dict(),
        }
        if self.timeline:
            report["groups_timeline"] = self.group_timeline()
            report["batch_marks"] = [
                {"batch": n, "requested_s": round(req - t0, 3), "delivered_s": round(dlv - t0, 3)}
                for n, req, dlv in self._batch_marks
            ]
            report["update_log"] = [
                {"t": round(t - t0, 3), "engine": e, "version": v, "phase": p} for t, e, v, p in self._updates
            ]
        report.update(static.extra)
        return report

    def group_timeline(self) -> list[dict[str, Any]]:
        """One row per admitted group (with `timeline`), times in seconds from the start of the run."""
        t0 = self.started_at or 0.0

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 3)

        return [
            {**row, "admitted_s": rel(row["admitted_s"]), "completed_s": rel(row["completed_s"]),
             "ended_s": rel(row["ended_s"])}
            for row in self._rows.values()
        ]  # fmt: skip


def build_report(acc: ReportAccumulator, static: ReportStatic, bus: EventBus | None = None) -> dict[str, Any]:
    """The report of a run whose envelopes `acc` has folded (the runtime's own `report_acc`); with the
    run's `bus`, its sinks' counts too (close the bus first, so that they are final)."""
    if bus is not None and bus.stats():
        static = replace(static, extra={**static.extra, "event_sinks": bus.stats()})
    if bus is not None and bus.observer_errors:
        static = replace(static, extra={**static.extra, "event_observer_errors": dict(bus.observer_errors)})
    return acc.report(static)


def static_of(report: Mapping[str, Any]) -> ReportStatic:
    """The parts of a finished report that its event stream does not carry (wall time, bounds and any
    extras the caller merged in): store them beside the events to rebuild the report later."""
    from_stream = ReportAccumulator(timeline=True).report(ReportStatic(""))
    extra = {k: v for k, v in report.items() if k not in from_stream}
    return ReportStatic(str(report["policy"]), float(report["wall_s"]), report["lower_bound_s"], extra)


def report_from_events(
    envelopes: Iterable[Envelope], static: ReportStatic, timeline: bool = False
) -> dict[str, Any]:
    """Rebuild a run's report from its stored envelopes (any order; they are sorted by sequence)."""
    acc = ReportAccumulator(timeline=timeline)
    for env in sorted(envelopes, key=lambda e: e.seq):
        acc.on_envelope(env)
    return acc.report(static)
