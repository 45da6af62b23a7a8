"""The dashboard's read model: one `RunView` per run, built from its event stream (live runs, or a
report that carries its event log) or from a report's group timeline (older reports).

The pages read only this, so a live run and a replay are browsed with the same eyes. Building a view
is pure: envelopes and run metadata in, plain rows out (times in seconds from the start of the run).

Definitions shown on the pages:
- a trajectory's spans: `engine_wait` (queued for an engine slot), `model_turn`, `lane_queue` (queued
  in a sandbox lane), `reset`, `tool_call`, `validate`, `cleanup` (running in that lane), `agent_gate`
  (its reset done, held before its agent phase while the exec lane was full: app.runtime.gate);
- a **straggler** group took more than `STRAGGLER_RATIO` × the median admission-to-completion time of
  the run's completed groups (with at least 3 completed);
- a group **held** batch n when it was that batch's critical group (see app.core.attribution);
- trainer idle fraction at a batch = total trainer wait so far ÷ time since the run started.

A live run's view keeps its figures for the whole run as running totals (batches delivered, the
trainer's wait, the wait by phase, staleness) and bounded per-step series for the charts
(app.web.series), and per-batch rows only for its newest batches (`BATCHES_KEPT` batch rows, weight
publications and engine updates, `PATHS_KEPT` critical paths): its memory does not grow with the run's
length, but for the observed bound's and the straggler rule's inputs, a float a completed group and
one a batch (both need every one).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from array import array
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from app.core.advantages import no_learning_signal
from app.core.attribution import LANE_PHASE, WaitAccumulator, WaitAttribution
from app.core.config import AdmissionMode
from app.core.events import (
    AgentGateWait,
    AttemptFinished,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    LaneResized,
    PolicyChanged,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
    envelope_from_dict,
    rotation_change,
)
from app.core.rollout import too_stale
from app.sim.bound import lower_bound_s
from app.store.sink import RUN_END_STATE
from app.web.series import BatchTrend

STRAGGLER_RATIO = 1.5
REFUSALS_KEPT = 50  # the latest weight refusals a view lists
AUDIT_KEPT = 100  # the latest audit rows a view lists (adaptive lanes' resizes can run to thousands)
NO_GROUPS_NOTE = (
    "This report has no group timeline (corral sim writes one with --plot; corral run always does): "
    "its batches, engines, lanes and wait attribution are shown, its groups are not."
)
LANE_WAITS_KEPT = 10_000  # per lane, for its p99 queue wait
# A live view's per-batch rows: its newest batches (the timeline draws the batches and versions of the
# latest groups, at most 500 of them ended: app.web.live.KEEP_GROUPS), and the newest critical paths
# (the page lists 12). The run's totals and chart series cover every batch.
BATCHES_KEPT = 500
PATHS_KEPT = 100
SNAPSHOT_KEYS = ("state", "version", "in_flight", "target_version")  # an engine's, from a live run's owner
POOL = "*"  # the engine name of events about the whole pool (every engine down, every one given up)
OUTCOMES = ("completed", "stopped", "failed")  # an ended run's states
ASKING = ("running", "paused", "stopping")  # the states in which the trainer's open request is waited on
POLICY_KEYS = {"groups_per_batch": "B", "group_size": "G", "surplus_groups": "S", "max_staleness": "K"}


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float
    phase: str
    detail: str = ""


@dataclass
class Trajectory:
    group_id: int
    attempt: int
    spans: list[Span] = field(default_factory=list)
    versions: list[tuple[float, int]] = field(default_factory=list)  # (t, version) where it changes
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    reward: float | None = None  # its validation's, once it finished


@dataclass
class GroupRow:
    group_id: int
    task: str = ""
    admitted: float | None = None
    ready: float | None = None
    ended: float | None = None
    outcome: str = "in flight"  # delivered, a discard reason, ready, in flight
    detail: str = ""
    batch: int | None = None
    staleness: int | None = None
    straggler: bool = False
    held_batch: int | None = None

    @property
    def discarded(self) -> bool:
        return self.outcome not in ("delivered", "ready", "in flight")


@dataclass(frozen=True, slots=True)
class BatchRow:
    index: int
    requested: float
    delivered: float
    wait_s: float
    groups: tuple[int, ...] = ()
    tokens_per_s: float | None = None
    idle_fraction: float | None = None
    mean_reward: float | None = None  # over its groups' attempts
    trainable: float | None = None  # the share of its groups with a learning signal (rewards not all equal)


@dataclass
class EngineRow:
    name: str
    state: str = "serving"
    version: int = 0
    in_flight: int | None = None
    target_version: int | None = None  # the version being loaded while updating
    too_stale: bool = False  # serving, but more than K behind the newest version: it takes no turns


@dataclass(frozen=True, slots=True)
class RefusalRow:
    """An engine refused to load a version (a 4xx from a healthy engine): it serves on at its own."""

    t: float
    engine: str
    version: int
    reason: str  # as the engine client said it (app.engines.errors): URL, route, status, body
    said: str = ""  # the same for a reader (`EngineRequestError.summary`); empty in streams before it

    @property
    def summary(self) -> str:
        return self.said or self.reason


@dataclass(frozen=True, slots=True)
class LaneRow:
    name: str
    cpus: str = ""
    busy: int | None = None
    slots: int | None = None
    queue_depth: int | None = None
    p99_wait_s: float | None = None
    configured_slots: int | None = None  # differs from `slots` when adaptive lanes resized the lane
    order: str | None = None  # whom the lane serves first, as the live lanes say (`lane_order_text`)


@dataclass(frozen=True, slots=True)
class AuditRow:
    t: float
    actor: str
    field: str
    old: object
    new: object
    did: str = ""  # what the actor did, where it is not a setting changed from old to new


# How app.service.handle says who took an engine out of rotation or put it back (EngineStateChanged.detail)


@dataclass
class RunMeta:
    """What the event stream does not carry: live snapshots and figures from the run's owner."""

    state: str | None = None
    policy: Mapping[str, Any] | None = None
    engines: Sequence[Mapping[str, Any]] = ()  # name, state, updating, version, in_flight
    lanes: Sequence[Mapping[str, Any]] = ()  # name, cpus, busy, slots, queue_depth, p99_wait_s
    lower_bound_s: float | None = None
    now: float | None = None  # the run's clock now (live runs), for open spans and idle fraction
    label: str = ""
    started_at: float | None = None  # Unix time the run started (stored runs; None for replays)
    error: str | None = None  # why the run failed, as its owner recorded it
    clock_note: str | None = None  # whose seconds the page counts, where that is not the wall clock's
    trainer_note: str | None = None  # what the run has long waited on its trainer for (live runs)
    store_note: str | None = None  # a live run held: its events can be kept nowhere
    # Set while the view covers only the start of the stream (a long one being read): the figures are
    # then the run's as of its last event read, so `now` is that event's time (leave it None).
    catch_up_note: str | None = None
    resume_note: str | None = None  # the run is being resumed after a restart, and how far it has got


def _outcome(state: str) -> str | None:
    """How an ended run ended (completed, stopped or failed), from its state; None while it has not."""
    if state in OUTCOMES:
        return state
    if state.startswith("ended (") and state.endswith(")"):  # from the stream alone
        ended = RUN_END_STATE.get(state[len("ended (") : -1])  # the store's word for it
        return ended.value if ended is not None else "stopped"
    return None


def _badge(source: str, state: str) -> str:
    """The state badge's style: live (running), paused, completed, stopped, failed, replay."""
    if source == "replay":
        return "replay"
    if state in ("running", "stopping", "created"):
        return "live"
    if state == "paused":
        return "paused"
    return _outcome(state) or "ended"


class _RunFace:
    """What a runs-page row and a run's view say alike of a run, from its source, state and policy."""

    source: str
    state: str
    policy: Mapping[str, Any]

    @property
    def outcome(self) -> str | None:
        """How an ended run ended (completed, stopped or failed); None while it has not ended."""
        return _outcome(self.state)

    @property
    def badge(self) -> str:
        """The state badge's style: live (running), paused, completed, stopped, failed, replay."""
        return _badge(self.source, self.state)

    @property
    def policy_short(self) -> dict[str, Any]:
        return {short: self.policy.get(key) for key, short in POLICY_KEYS.items()}


@dataclass(frozen=True)
class RunSummary(_RunFace):
    """A runs-page row: what the list shows of a run, from counters (the run's live counters or the
    store's projected rows), never from a replay of its stream. Times are on the run's clock."""

    run_id: str
    source: str  # live or replay
    state: str
    policy: Mapping[str, Any]
    label: str = ""
    started_at: float | None = None  # Unix time the run started (stored runs; None for replays)
    batches: int = 0  # delivered
    trainer_wait_s: float = 0.0  # the delivered batches' collection times, summed
    waiting_s: float = 0.0  # the open request's wait so far (an ended run's: to its end)
    elapsed_s: float = 0.0  # from the run's first event to now (a live run) or to its last event
    resume_note: str | None = None  # being resumed after a restart: how far its replay has got

    @property
    def mean_collection_s(self) -> float | None:
        return self.trainer_wait_s / self.batches if self.batches else None

    @property
    def idle_fraction(self) -> float | None:
        """Trainer wait so far (the open request included) ÷ time since the run started, as the run
        page's `RunView.idle_fraction`."""
        if self.elapsed_s <= 0:
            return None
        return (self.trainer_wait_s + self.waiting_s) / self.elapsed_s


@dataclass
class RunView(_RunFace):
    run_id: str
    source: str  # live or replay
    state: str
    policy: dict[str, Any]
    t0: float
    now: float
    groups: list[GroupRow]
    trajectories: dict[tuple[int, int], Trajectory]
    batches: list[BatchRow]  # every batch's, or a long live run's newest `BATCHES_KEPT`
    engines: list[EngineRow]
    lanes: list[LaneRow]
    publications: list[tuple[float, int]]  # (t, version) weight publications (a long live run's newest)
    updates: list[tuple[str, float, float, int]]  # engine, begin, end, version (a long live run's newest)
    audit: list[AuditRow]  # the latest `AUDIT_KEPT` (all of a report's)
    staleness: dict[int, int]  # staleness -> delivered groups
    attribution: WaitAttribution | None
    lower_bound_s: float | None = None
    lower_bound_observed: bool = False  # the bound over observed group durations (live runs)
    label: str = ""
    last_seq: int = -1
    detailed: bool = True  # False: group-level rows only (a report without its event log)
    pending_request: float | None = None  # when the trainer asked for a batch it has not got yet
    dropped_groups: int = 0  # ended groups no longer kept (a long live run keeps its latest)
    dropped_outcomes: dict[str, int] = field(default_factory=dict)  # how those groups ended
    started_at: float | None = None  # Unix time the run started (stored runs; None for replays)
    pool_note: str | None = None  # the whole pool's state (every engine down, or given up), when it holds
    refusals: list[RefusalRow] = field(default_factory=list)  # the latest, oldest first
    refusals_total: int = 0  # every refusal of the run, those no longer kept included
    audit_total: int = 0  # every audit row of the run, those no longer kept included
    refused: dict[str, int] = field(default_factory=dict)  # engine -> the newest version it refused
    newest_version: int = 0  # the newest version published (or served)
    stall_note: str | None = None  # every engine refused the newest version and is more than K behind
    timeline_note: str | None = None  # why a replay has no group timeline
    unanswered_s: float = 0.0  # an ended run's last request, never answered: the trainer waited to the end
    error: str | None = None  # why a failed run failed (its record: a run failing at start has no events)
    clock_note: str | None = None  # a simulated run's seconds are not the wall clock's
    trainer_note: str | None = None  # the run waits on its trainer to take, ack or publish
    store_note: str | None = None  # held: its events can be kept nowhere
    catch_up_note: str | None = None  # the view covers the stream read so far, and says how far
    resume_note: str | None = None  # the run is being resumed after a restart, and how far it has got
    # A view that keeps only its newest batches (a long live run's): every batch delivered, their
    # collection times summed, and the chart series of every batch. None: `batches` is every batch.
    batch_count: int | None = None
    batch_wait_s: float | None = None
    kept_trend: BatchTrend | None = None
    publications_dropped: int = 0  # weight publications no longer in `publications`

    # -- figures ----------------------------------------------------------------------------------

    @property
    def group_counts(self) -> dict[str, int]:
        """Groups by where they are: in flight, ready, delivered, then each discard reason, those no
        longer kept included."""
        counts = Counter(g.outcome for g in self.groups) + Counter(self.dropped_outcomes)
        first = [k for k in ("in flight", "ready", "delivered") if counts[k]]
        return {
            k: counts[k]
            for k in (*first, *sorted(set(counts) - set(first) - {"in flight", "ready", "delivered"}))
        }

    @property
    def group_counts_text(self) -> str:
        """`12 in flight, 3 ready, 480 delivered, 423 discarded (stale 420, failed 3)`."""
        counts = self.group_counts
        shown = [f"{counts[k]:,} {k}" for k in ("in flight", "ready", "delivered") if k in counts]
        discarded = {k: n for k, n in counts.items() if k not in ("in flight", "ready", "delivered")}
        if discarded:
            reasons = ", ".join(f"{k} {n:,}" for k, n in discarded.items())
            shown.append(f"{sum(discarded.values()):,} discarded ({reasons})")
        if shown:
            return ", ".join(shown)
        if self.source == "replay":  # a report without its groups' rows (`corral sim` without --plot)
            return "not in this report"
        return "none" if self.outcome is not None else "none yet"

    @property
    def trend(self) -> BatchTrend:
        """The per-step chart series of every batch delivered."""
        return self.kept_trend if self.kept_trend is not None else trend_of(self.batches)

    @property
    def batches_delivered(self) -> int:
        return len(self.batches) if self.batch_count is None else self.batch_count

    @property
    def trainer_wait_s(self) -> float:
        """The delivered batches' collection times, summed in delivery order."""
        return sum(b.wait_s for b in self.batches) if self.batch_wait_s is None else self.batch_wait_s

    @property
    def batches_dropped(self) -> int:
        """Batches delivered whose rows are no longer kept (a long live run keeps its newest)."""
        return self.batches_delivered - len(self.batches)

    @property
    def mean_collection_s(self) -> float | None:
        n = self.batches_delivered
        return self.trainer_wait_s / n if n else None

    @property
    def waiting_s(self) -> float | None:
        """How long the trainer has been waiting for the batch it asked for, if it is waiting."""
        return None if self.pending_request is None else max(self.now - self.pending_request, 0.0)

    @property
    def idle_fraction(self) -> float | None:
        """Trainer wait so far (the open request included) ÷ time since the run started."""
        elapsed = self.now - self.t0
        if elapsed <= 0:
            return None
        waited = self.trainer_wait_s + (self.waiting_s or 0.0) + self.unanswered_s
        return waited / elapsed

    def summary(self) -> RunSummary:
        """This view's runs-page row (a replay's; a live run's row comes from its counters)."""
        return RunSummary(
            self.run_id,
            self.source,
            self.state,
            self.policy,
            self.label,
            self.started_at,
            self.batches_delivered,
            self.trainer_wait_s,
            (self.waiting_s or 0.0) + self.unanswered_s,
            self.now - self.t0,
        )

    @property
    def span_count(self) -> int:
        return sum(len(t.spans) for t in self.trajectories.values())

    def ordered_groups(self) -> list[GroupRow]:
        """Completed groups in completion order, then the rest in admission order."""

        def key(g: GroupRow) -> tuple[int, float, int]:
            if g.ready is not None:
                return (0, g.ready, g.group_id)
            return (1, g.admitted if g.admitted is not None else float("inf"), g.group_id)

        return sorted(self.groups, key=key)

    def rows(self) -> list[tuple[GroupRow, list[Trajectory]]]:
        by_group: dict[int, list[Trajectory]] = defaultdict(list)
        for (gid, _), traj in sorted(self.trajectories.items()):
            by_group[gid].append(traj)
        return [(g, by_group.get(g.group_id, [])) for g in self.ordered_groups()]


# -- from events ------------------------------------------------------------------------------------


class RunViewBuilder:
    """Folds a run's envelopes (in sequence order) into what its `RunView` shows, incrementally, so a
    live page costs one pass over the new events, not over the whole stream.

    With `keep_groups` and/or `keep_spans`, only that many ended groups (or as many as hold that many
    spans, counted when each ended) keep their rows and trajectories (oldest ended first out; open
    groups are always kept); figures (batches, staleness, the wait attribution, the
    straggler rule's durations) still cover the whole run. With `keep_batches`, only the newest that
    many batch rows, publications and engine updates are kept, and `PATHS_KEPT` critical paths; the
    batches' count, wait and chart series still cover the whole run. Memory is then bounded by the
    open and the latest ended groups, the newest batches, the last `LANE_WAITS_KEPT` queue waits of
    each lane, and a float a completed group and a batch (the observed bound's and the straggler
    rule's inputs).
    """

    def __init__(
        self,
        run_id: str,
        source: str = "live",
        keep_groups: int | None = None,
        keep_spans: int | None = None,
        keep_batches: int | None = None,
    ) -> None:
        self.run_id = run_id
        self.source = source
        self.keep_groups = keep_groups
        self.keep_spans = keep_spans
        self._ended_spans: deque[int] = deque()  # spans of each kept ended group, at its end
        self._kept_spans = 0
        self.t0: float | None = None
        self.last_t = 0.0
        self.last_seq = -1
        self.started_policy: dict[str, Any] = {}
        self.policy_changes: dict[str, Any] = {}
        # The S in force (the start's, then each live change's) and every S some group was admitted under:
        # at an admission at most B + S groups are live, and between admissions their number only falls
        self._publication_run = (0, 0)  # the first version and count of the audit's last publication row
        self.surplus_now: object = None
        self.surplus_admitting: set[int] = set()
        self.ended: str | None = None
        self.groups: dict[int, GroupRow] = {}
        self.trajs: dict[int, dict[int, Trajectory]] = defaultdict(dict)
        self.ended_order: deque[int] = deque()
        self.dropped_groups = 0
        self.dropped_outcomes: Counter[str] = Counter()  # how the groups no longer kept ended
        self.durations = array("d")  # admission to completion of every completed group
        self.first_admitted: float | None = None  # the run's first admission
        self.batches: deque[BatchRow] = deque(maxlen=keep_batches)
        self.batch_count = 0
        self.batch_wait = 0.0  # summed in delivery order
        self.first_requested: float | None = None
        self.steps = array("d")  # the trainer's step after each batch but the last: to the next request
        self.trend = BatchTrend()
        # rewards of the batches not yet delivered: batch → [reward sum, rewards, groups, with a signal]
        self._batch_rewards: dict[int, list[float]] = {}
        self.engines: dict[str, EngineRow] = {}
        self.pool: tuple[str, str] | None = None  # the whole pool's state and its detail, while not serving
        self.publications: deque[tuple[float, int]] = deque(maxlen=keep_batches)
        self.publication_count = 0
        self.updates: deque[tuple[str, float, float, int]] = deque(maxlen=keep_batches)
        self.open_updates: dict[str, tuple[float, int]] = {}
        self.refusals: deque[RefusalRow] = deque(maxlen=REFUSALS_KEPT)
        self.refusals_total = 0
        self.refused: dict[str, int] = {}  # engine -> the newest version it refused (not offered again)
        # engines an operator took out of rotation and has not put back: an update that ends, or a
        # restart, leaves such an engine draining, not serving
        self.drained: set[str] = set()
        self.audit: deque[AuditRow] = deque(maxlen=AUDIT_KEPT)
        self.audit_total = 0
        self.staleness: dict[int, int] = defaultdict(int)
        self.lane_waits: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=LANE_WAITS_KEPT))
        self.lane_now: dict[str, tuple[int | None, int | None]] = {}  # busy, queue depth at the latest op
        self.lane_slots: dict[str, tuple[int, int]] = {}  # slots, configured: adaptive lanes' latest resize
        self.pending: float | None = None
        self.waits = WaitAccumulator(None if keep_batches is None else min(keep_batches, PATHS_KEPT))
        self._tokens = 0  # since the last batch
        self._turns = 0
        self._waited = 0.0
        self._last_delivered = 0.0

    def _traj(self, gid: int, attempt: int) -> Trajectory:
        group = self.trajs[gid]
        if attempt not in group:
            group[attempt] = Trajectory(gid, attempt)
        return group[attempt]

    def _serving(self, name: str) -> str:
        """The state of an engine back at work: draining while an operator keeps it out of rotation."""
        return "draining" if name in self.drained else "serving"

    def _engine(self, name: str) -> EngineRow:
        if name not in self.engines:
            self.engines[name] = EngineRow(name)
        return self.engines[name]

    def _group(self, gid: int) -> GroupRow:
        if gid not in self.groups:
            self.groups[gid] = GroupRow(gid)
        return self.groups[gid]

    def _ended(self, gid: int) -> None:
        spans = sum(len(t.spans) for t in self.trajs.get(gid, {}).values())
        self.ended_order.append(gid)
        self._ended_spans.append(spans)
        self._kept_spans += spans
        groups_over = self.keep_groups is not None and len(self.ended_order) > self.keep_groups
        spans_over = self.keep_spans is not None and self._kept_spans > self.keep_spans
        while (groups_over or spans_over) and len(self.ended_order) > 1:
            old = self.ended_order.popleft()
            self._kept_spans -= self._ended_spans.popleft()
            if (dropped := self.groups.pop(old, None)) is not None:
                self.dropped_outcomes[dropped.outcome] += 1
            self.trajs.pop(old, None)
            self.dropped_groups += 1
            groups_over = self.keep_groups is not None and len(self.ended_order) > self.keep_groups
            spans_over = self.keep_spans is not None and self._kept_spans > self.keep_spans

    def on_envelope(self, env: Envelope) -> None:
        if self.t0 is None:
            self.t0 = env.t
        t0 = self.t0
        self.last_t = max(self.last_t, env.t)
        self.last_seq = env.seq
        self.waits.on_envelope(env)
        ev, t = env.event, env.t - t0
        if isinstance(ev, RunStarted):
            self.started_policy = dict(ev.policy)
            self.surplus_now = self.started_policy.get("surplus_groups")
            for name in getattr(ev, "engines", ()):
                self._engine(name)
        elif isinstance(ev, RunEnded):
            self.ended = ev.reason
            # The engines stop with the run: an update under way ends here (its rollout is cancelled).
            for name, (since, version) in self.open_updates.items():
                self.updates.append((name, since, t, version))
            self.open_updates.clear()
            for row_e in self.engines.values():
                row_e.state, row_e.target_version = "stopped", None
            if self.pool is not None and self.pool[0] != "given_up":  # why the run ended stays said
                self.pool = None
            # The lanes close with the run: nothing runs or queues in them any more.
            self.lane_now = dict.fromkeys(self.lane_now, (0, 0))
        elif isinstance(ev, GroupAdmitted):
            if isinstance(self.surplus_now, int):
                self.surplus_admitting.add(self.surplus_now)
            self.groups[ev.group_id] = GroupRow(ev.group_id, task=ev.task or str(ev.task_index), admitted=t)
            if self.first_admitted is None:
                self.first_admitted = t
        elif isinstance(ev, GroupReady):
            row = self._group(ev.group_id)
            row.ready, row.outcome = t, "ready"
            if row.admitted is not None:
                self.durations.append(t - row.admitted)
        elif isinstance(ev, GroupDelivered):
            row = self._group(ev.group_id)
            row.ended, row.outcome, row.batch, row.staleness = t, "delivered", ev.batch_index, ev.staleness
            self.staleness[ev.staleness] += 1
            sums = self._batch_rewards.setdefault(ev.batch_index, [0.0, 0, 0, 0])
            sums[0] += math.fsum(ev.rewards)
            sums[1] += len(ev.rewards)
            sums[2] += 1
            sums[3] += not no_learning_signal(ev.rewards)
            self._ended(ev.group_id)
        elif isinstance(ev, GroupDiscarded):
            row = self._group(ev.group_id)
            row.ended, row.outcome, row.detail = t, ev.reason, ev.detail
            self._ended(ev.group_id)
        elif isinstance(ev, AttemptStarted):
            tr = self._traj(ev.group_id, ev.attempt)
            tr.started = t if tr.started is None else tr.started
        elif isinstance(ev, AttemptFinished):
            tr = self._traj(ev.group_id, ev.attempt)
            tr.finished, tr.error, tr.reward = t, ev.error, ev.reward
        elif ev.kind == "attempt_cancelled":  # the try stopped because its group was discarded
            tr = self._traj(getattr(ev, "group_id", -1), getattr(ev, "attempt", -1))
            tr.finished, tr.error = t, f"cancelled ({getattr(ev, 'reason', '')})"
        elif isinstance(ev, TurnDone):
            tr = self._traj(ev.group_id, ev.attempt)
            q, s, e = ev.queued_at - t0, ev.start - t0, ev.end - t0
            if s > q:
                tr.spans.append(Span(q, s, "engine_wait", f"waited for an engine slot ({ev.engine})"))
            detail = f"{ev.engine}, policy v{ev.version}, {ev.tokens} tokens" + (
                f", error: {ev.error}" if ev.error else ""
            )
            tr.spans.append(Span(s, e, "model_turn", detail))
            if not tr.versions or tr.versions[-1][1] != ev.version:
                tr.versions.append((s, ev.version))
            self._engine(ev.engine)
            self._tokens += ev.tokens
            self._turns += 1
        elif isinstance(ev, AgentGateWait):
            tr = self._traj(ev.group_id, ev.attempt)
            q, s = ev.queued_at - t0, ev.start - t0
            tr.spans.append(
                Span(q, s, "agent_gate", "reset done; waited at the agent-phase gate (exec lane full)")
            )
        elif isinstance(ev, SandboxOp):
            tr = self._traj(ev.group_id, ev.attempt)
            q, s, e = ev.queued_at - t0, ev.start - t0, ev.end - t0
            if s > q:
                tr.spans.append(Span(q, s, "lane_queue", f"queued in the {ev.lane} lane"))
            self.lane_waits[ev.lane].append(max(s - q, 0.0))
            self.lane_now[ev.lane] = (getattr(ev, "busy", None), getattr(ev, "queue_depth", None))
            status = "ok" if ev.ok else "failed"
            detail = f"{ev.lane} lane, {status}" + (f": {ev.detail}" if ev.detail else "")
            tr.spans.append(Span(s, e, LANE_PHASE.get(ev.lane, "tool_call"), detail))
        elif isinstance(ev, VersionPublished):
            self.publications.append((t, ev.version))
            self.publication_count += 1
            if ev.command_id:  # a command's (the dashboard's Publish, the API's), not a built-in trainer's
                self._audit_publication(t, ev)
        elif isinstance(ev, EngineUpdateBegin):
            row_e = self._engine(ev.engine)
            row_e.state, row_e.target_version = "updating", ev.version
            self.open_updates[ev.engine] = (t, ev.version)
        elif isinstance(ev, EngineUpdateEnd):
            row_e = self._engine(ev.engine)
            begin = self.open_updates.pop(ev.engine, (t, ev.version))
            self.updates.append((ev.engine, begin[0], t, ev.version))
            row_e.target_version = None
            if ev.ok:
                row_e.version, row_e.state = ev.version, self._serving(ev.engine)
            else:  # a refusal leaves the engine serving its version; another failure, out of rotation
                row_e.state = self._serving(ev.engine) if ev.refused else "unhealthy"
            if ev.refused:
                self.refusals.append(RefusalRow(t, ev.engine, ev.version, ev.error, ev.said))
                self.refusals_total += 1
                self.refused[ev.engine] = max(ev.version, self.refused.get(ev.engine, -1))
        elif isinstance(ev, EngineStateChanged):
            if ev.engine == POOL:
                self.pool = None if ev.state == "serving" else (ev.state, ev.detail or ev.state)
            else:
                if (change := rotation_change(ev.detail)) is not None:
                    (self.drained.add if change[0] == "drained" else self.drained.discard)(ev.engine)
                    self.audit.append(_rotation_audit(t, ev.engine, *change))
                    self.audit_total += 1
                state = self._serving(ev.engine) if ev.state == "serving" else ev.state
                self._engine(ev.engine).state = state
        elif isinstance(ev, BatchRequested):
            self.pending = t
        elif isinstance(ev, BatchDelivered):
            self.pending = None
            requested = ev.requested_at - t0
            interval = t - self._last_delivered
            self._waited += t - requested
            total, rewards, groups, signal = self._batch_rewards.pop(ev.batch_index, (0.0, 0, 0, 0))
            row_b = BatchRow(
                ev.batch_index,
                requested,
                t,
                t - requested,
                ev.group_ids,
                tokens_per_s=self._tokens / interval if interval > 0 and self._turns else None,
                idle_fraction=self._waited / t if t > 0 else None,
                mean_reward=total / rewards if rewards else None,
                trainable=signal / groups if groups else None,
            )
            if self.batches:
                self.steps.append(max(0.0, requested - self.batches[-1].delivered))
            else:
                self.first_requested = requested
            self.batches.append(row_b)
            self.batch_count += 1
            self.batch_wait += row_b.wait_s
            if self.batches.maxlen is not None:  # else a view's series are drawn from its rows
                self.trend.add(
                    row_b.index, requested, t, row_b.tokens_per_s, row_b.mean_reward, row_b.trainable
                )
            # the batch's critical group, if it held the trainer (the accumulator has just folded it)
            held = self.waits.latest
            if held is not None and held.group_id in self.groups and held.wait_s > 0:
                self.groups[held.group_id].held_batch = held.batch_index
            self._tokens, self._last_delivered = 0, t
        elif isinstance(ev, PolicyChanged):
            self.audit.append(AuditRow(t, ev.actor, ev.field, ev.old, ev.new))
            self.audit_total += 1
            self.policy_changes[ev.field] = ev.new
            if ev.field == "surplus_groups":  # published before the admissions the change makes
                self.surplus_now = ev.new
        elif isinstance(ev, LaneResized):
            self.audit.append(AuditRow(t, "adaptive lanes", f"lanes.{ev.lane}.slots", ev.old, ev.new))
            self.audit_total += 1
            self.lane_slots[ev.lane] = (ev.new, ev.configured)

    def _audit_publication(self, t: float, ev: VersionPublished) -> None:
        """A publication by a command as an audit row; one actor's publications in a row are one row
        (`published weights v5–v110 (106 versions)`): a trainer publishing each step through the API
        put every other row, an operator's K included, out of the list's latest 100."""
        last = self.audit[-1] if self.audit else None
        if last is not None and last.field == "weights" and last.actor == ev.actor:
            first, n = self._publication_run
            self._publication_run = (first, n + 1)
            did = f"published weights v{first}–v{ev.version} ({n + 1} versions)"
            self.audit[-1] = AuditRow(t, ev.actor, "weights", last.old, ev.version, did)
            return
        self._publication_run = (ev.version, 1)
        previous = self.publications[-2][1] if len(self.publications) > 1 else None
        did = f"published weights v{ev.version}" + (" (a sentinel)" if ev.path is None else "")
        self.audit.append(AuditRow(t, ev.actor, "weights", previous, ev.version, did))
        self.audit_total += 1

    def _bound_policy(self, policy: Mapping[str, Any]) -> Mapping[str, Any]:
        """`policy` with the largest S any group was admitted under, the most groups the run had live
        (B + S) however S changed: the latest S, taken for the whole run, put the bound above the mean
        of a run whose S was larger before (1.1 s against 0.9 s after S went down to 0), and the largest
        S it ever had made it 0.0 s after an S set for a moment, while paused, admitted nothing."""
        if not self.surplus_admitting:
            return policy
        return {**policy, "surplus_groups": max(self.surplus_admitting)}

    def view(self, meta: RunMeta | None = None) -> RunView:
        """A snapshot: copies of the rows, safe to render while the builder goes on folding."""
        meta = meta or RunMeta()
        partial = meta.catch_up_note is not None
        t0 = self.t0 if self.t0 is not None else 0.0
        now = max(meta.now if meta.now is not None else self.last_t, self.last_t) - t0
        policy = {**self.started_policy, **(meta.policy or {}), **self.policy_changes}
        state = meta.state or (f"ended ({self.ended})" if self.ended is not None else "running")
        groups = {gid: replace(g) for gid, g in self.groups.items()}
        trajs = {
            (gid, a): replace(tr, spans=list(tr.spans), versions=list(tr.versions))
            for gid, by_attempt in self.trajs.items()
            if gid in groups or (self.keep_groups is None and self.keep_spans is None)
            for a, tr in by_attempt.items()
        }
        engines = {name: replace(e) for name, e in self.engines.items()}
        # Once the run has ended, the owner's plan is as the run left it (an engine may still be listed
        # updating): the stream's account of the engines' states wins.
        keys = ("version", "in_flight") if self.ended is not None else SNAPSHOT_KEYS
        for snap in meta.engines:
            name = str(snap["name"])
            row_e = engines.setdefault(name, EngineRow(name))
            for key in keys:
                if snap.get(key) is not None:
                    setattr(row_e, key, snap[key])
            if self.ended is not None:
                continue
            # `updating` (the owner's plan, ahead of the stored stream) settles an update the stream
            # has not closed yet; other states (draining, paused, unhealthy) come from the stream.
            if snap.get("updating") is True:
                row_e.state = "updating"
            elif snap.get("updating") is False and row_e.state == "updating":
                row_e.state, row_e.target_version = self._serving(name), None
        updates = list(self.updates) + [(n, since, now, v) for n, (since, v) in self.open_updates.items()]
        rows = sorted(engines.values(), key=lambda e: e.name)
        ended = self.ended is not None or state in OUTCOMES
        newest = max([v for _, v in self.publications] + [e.version for e in rows], default=0)
        k = policy.get("max_staleness")
        if not ended and isinstance(k, int) and not isinstance(k, bool):
            for row_e in rows:  # the runtime routes no turn to such an engine (app.core.rollout)
                row_e.too_stale = row_e.state == "serving" and too_stale(row_e.version, newest, k)
        attribution = self.waits.result() if self.batches else None
        unanswered = 0.0
        if ended and not partial and self.pending is not None:
            unanswered = max(now - self.pending, 0.0)
        _mark_groups(groups, self.durations)
        bounded = self.batches.maxlen is not None
        return RunView(
            run_id=self.run_id,
            source=self.source,
            state=state,
            policy=policy,
            t0=0.0,
            now=now,
            groups=list(groups.values()),
            trajectories=trajs,
            batches=list(self.batches),
            batch_count=self.batch_count if bounded else None,
            batch_wait_s=self.batch_wait if bounded else None,
            kept_trend=self.trend.copy() if bounded else None,
            publications_dropped=self.publication_count - len(self.publications),
            engines=rows,
            lanes=_lanes(
                meta.lanes,
                {k: list(v) for k, v in self.lane_waits.items()},
                dict(self.lane_now),
                dict(self.lane_slots),
            ),
            publications=list(self.publications),
            updates=updates,
            audit=list(self.audit),
            audit_total=self.audit_total,
            staleness=dict(sorted(self.staleness.items())),
            attribution=attribution,
            lower_bound_s=meta.lower_bound_s
            if meta.lower_bound_s is not None
            else _observed_bound(
                self.durations,
                self.first_admitted,
                self.first_requested,
                self.batch_count,
                self.steps,
                self._bound_policy(policy),
            ),
            lower_bound_observed=meta.lower_bound_s is None and bool(self.batches),
            label=meta.label,
            last_seq=self.last_seq,
            # A view of the stream read so far is the run as it was then: a request open then was waited on.
            pending_request=self.pending if state in ASKING or partial else None,
            unanswered_s=unanswered,
            dropped_groups=self.dropped_groups,
            dropped_outcomes=dict(self.dropped_outcomes),
            started_at=meta.started_at,
            pool_note=self.pool[1] if self.pool is not None else None,
            refusals=list(self.refusals),
            refusals_total=self.refusals_total,
            refused=dict(self.refused),
            newest_version=newest,
            stall_note=_stall_note(rows, self.refused, newest, policy.get("max_staleness"), ended),
            error=meta.error,
            clock_note=meta.clock_note,
            trainer_note=meta.trainer_note,
            store_note=meta.store_note,
            catch_up_note=meta.catch_up_note,
            resume_note=meta.resume_note,
        )


def _rotation_audit(t: float, name: str, did: str, actor: str) -> AuditRow:
    """An operator's drain of an engine (`did` "drained"), or its return to rotation, as an audit row."""
    if did == "drained":
        return AuditRow(t, actor, f"engines.{name}", "in rotation", "drained", f"took {name} out of rotation")
    return AuditRow(t, actor, f"engines.{name}", "drained", "in rotation", f"returned {name} to rotation")


def _stall_note(
    engines: Sequence[EngineRow], refused: Mapping[str, int], newest: int, k: object, ended: bool
) -> str | None:
    """What the runtime warns of (app.runtime.driver): every engine not drained refused the newest
    version (or a newer one) and serves one more than K behind it, so no turn can run. None otherwise."""
    if not isinstance(k, int) or isinstance(k, bool):
        return None
    rotation = [e for e in engines if e.state != "draining"]
    stalled = all(refused.get(e.name, -1) >= newest and newest - e.version > k for e in rotation)
    if not rotation or not stalled:
        return None
    served = ", ".join(sorted({f"v{e.version}" for e in rotation}))
    said = (
        f"every engine refused v{newest} and serves {served}, more than K = {k} versions behind it, so no "
        "turn can run"
    )
    if ended:
        return f"The run was stalled when it ended: {said}."
    return f"Stalled: {said}. Publish a version the engines can load, or raise K."


def _observed_bound(
    durations: Sequence[float],
    first_admitted: float | None,
    first_requested: float | None,
    batches: int,
    steps: Sequence[float],
    policy: Mapping[str, Any],
) -> float | None:
    """The clairvoyant bound of `app.sim.bound` over the run's observed group durations (admission to
    completion): still a lower bound on this run's mean batch collection time, since each delivered
    group took its observed duration, at most B + S were live at once (S the largest the run had: the
    caller's `policy` gives it), and the trainer's steps are
    subtracted as they were, as is any head start of groups admitted before the first batch was asked
    for. A live run knows no uncontended durations, so this is the bound it can state. Under attempts
    admission more than B + S groups can be live, so only the order statistic is stated."""
    b = policy.get("groups_per_batch")
    s = policy.get("surplus_groups")
    if not batches or first_requested is None or not isinstance(b, int) or not isinstance(s, int) or b < 1:
        return None
    # Groups admitted before the first batch was asked for had a head start the bound must not count.
    head_start = 0.0 if first_admitted is None else max(0.0, first_requested - first_admitted)
    # Attempts admission: as many live as there are groups makes the capacity term no tighter than the
    # order statistic
    live = max(1, len(durations)) if policy.get("admission") == AdmissionMode.ATTEMPTS.value else b + s
    return max(0.0, lower_bound_s(durations, batches, b, live, steps) - head_start / batches)


def view_from_events(
    run_id: str, envelopes: Iterable[Envelope], meta: RunMeta | None = None, source: str = "live"
) -> RunView:
    """The view of a whole stream at once (replays, tests); live runs keep a `RunViewBuilder`."""
    builder = RunViewBuilder(run_id, source)
    for env in sorted(envelopes, key=lambda e: e.seq):
        builder.on_envelope(env)
    return builder.view(meta)


def _mark_groups(groups: dict[int, GroupRow], durations: Sequence[float] | None = None) -> None:
    """Straggler flags, against the median of `durations`, or of these groups' own."""
    if durations is None:
        durations = [
            g.ready - g.admitted for g in groups.values() if g.ready is not None and g.admitted is not None
        ]
    if len(durations) >= 3:
        limit = STRAGGLER_RATIO * statistics.median(durations)
        for g in groups.values():
            if g.ready is not None and g.admitted is not None:
                g.straggler = g.ready - g.admitted > limit


def trend_of(batches: Iterable[BatchRow]) -> BatchTrend:
    """The chart series of these batches, in order."""
    trend = BatchTrend()
    for b in batches:
        trend.add(b.index, b.requested, b.delivered, b.tokens_per_s, b.mean_reward, b.trainable)
    return trend


def _number_at(values: Sequence[Any], i: int) -> float | None:
    """The `i`th of a report's per-batch figures, None where it has none (an older report, a null)."""
    value = values[i] if i < len(values) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _with_rates(batches: list[BatchRow]) -> list[BatchRow]:
    """Idle fraction at each batch (a report has no turn times, so no tokens/s)."""
    out: list[BatchRow] = []
    waited = 0.0
    for b in batches:
        waited += b.wait_s
        idle = waited / b.delivered if b.delivered > 0 else None
        out.append(replace(b, idle_fraction=idle))
    return out


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * 0.99
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def _lanes(
    snapshots: Sequence[Mapping[str, Any]],
    waits: Mapping[str, list[float]],
    latest: Mapping[str, tuple[int | None, int | None]] | None = None,
    resized: Mapping[str, tuple[int, int]] | None = None,
) -> list[LaneRow]:
    """Lane rows: the owner's snapshot where it gives a figure, else the stream's: busy and queue depth
    at the latest op (0 once the run has ended), slots at the latest resize."""
    known = [str(s["name"]) for s in snapshots]
    names = known + [n for n in waits if n not in known]
    by_name = {str(s["name"]): s for s in snapshots}
    rows = []
    for name in names:
        snap = by_name.get(name, {})
        p99 = snap.get("p99_wait_s")
        busy, depth = (latest or {}).get(name, (None, None))
        slots, configured = (resized or {}).get(name, (None, None))
        rows.append(
            LaneRow(
                name,
                cpus=_cpus(snap.get("cpus", "")),
                busy=snap.get("busy", busy),
                slots=_first(snap.get("slots"), _first(slots, snap.get("configured_slots"))),
                queue_depth=snap.get("queue_depth", depth),
                p99_wait_s=p99 if p99 is not None else _p99(waits.get(name, [])),
                configured_slots=_first(snap.get("configured_slots"), configured),
                order=snap.get("order"),
            )
        )
    return rows


def _first(value: Any, otherwise: Any) -> Any:
    return value if value is not None else otherwise


def _cpus(cpus: object) -> str:
    if isinstance(cpus, list | tuple):
        return ",".join(str(c) for c in cpus)
    return str(cpus)


# -- from a report ------------------------------------------------------------------------------


class ReportError(ValueError):
    """A report that cannot be browsed; the message names the field."""


def view_from_report(run_id: str, report: Mapping[str, Any], label: str = "") -> RunView:
    """A replay of a `corral sim` / `corral run` report. With an event log (`event_log`: a list of
    envelope dicts) it is as detailed as a live run; otherwise one row per group from
    `groups_timeline`, batches from `batch_marks` and updates from `update_log`. A report that does
    not have a report's shape is a ReportError."""
    try:
        return _view_from_report(run_id, report, label)
    except ReportError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # A hand-edited report: a field missing or of the wrong type, named as Python names it.
        raise ReportError(f"report: not a report's shape ({type(exc).__name__}: {exc})") from exc


def _view_from_report(run_id: str, report: Mapping[str, Any], label: str) -> RunView:
    if not isinstance(report, Mapping):
        raise ReportError("report: expected a JSON object")
    policy = dict(report.get("policy_config") or {})
    lanes = [
        {
            "name": name,
            "cpus": lane.get("cpus", ""),
            "busy": lane.get("max_busy"),
            "slots": lane.get("slots"),
            "queue_depth": lane.get("max_queue_depth"),
        }
        for name, lane in (report.get("lanes") or {}).items()
    ]
    meta = RunMeta(
        state=f"replay ({report.get('policy', '?')})",
        policy=policy,
        lanes=lanes,
        lower_bound_s=_float_or_none(report.get("lower_bound_s"), "lower_bound_s"),
        label=label,
    )
    log = report.get("event_log")
    if log is not None:
        if not isinstance(log, list):
            raise ReportError("event_log: expected a list of events")
        try:
            envs = [envelope_from_dict(d) for d in log]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReportError(f"event_log: {exc}") from exc
        for i, env in enumerate(envs):
            _check_field_types(env.event, f"event_log[{i}]")
        view = view_from_events(run_id, envs, meta, source="replay")
        view.now = max(view.now, float(report.get("run_s") or 0.0))
        return view
    return _view_from_timeline(run_id, report, meta)


_SCALARS: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_field_types(event: object, where: str) -> None:
    """A loaded event's scalar fields have their declared types (`envelope_from_dict` takes any JSON
    value; the views sort, add and format them). Containers are left to the code that reads them."""
    cls = type(event)
    hints = _HINTS[cls] if cls in _HINTS else _HINTS.setdefault(cls, _field_hints(cls))
    for name, kinds in hints.items():
        value = getattr(event, name)
        if value is None and None in kinds:
            continue
        allowed = tuple(t for k in kinds if k is not None for t in _SCALARS[k])
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            raise ReportError(f"{where}.{name}: expected {' or '.join(str(k) for k in kinds)}, got {value!r}")


_HINTS: dict[type, dict[str, tuple[str | None, ...]]] = {}


def _field_hints(cls: type) -> dict[str, tuple[str | None, ...]]:
    """Each scalar field's allowed types by name, None for an optional one (containers left out)."""
    out: dict[str, tuple[str | None, ...]] = {}
    for f in dataclasses.fields(cls):
        names = [part.strip() for part in str(f.type).split("|")]
        if all(n in _SCALARS or n == "None" for n in names):
            out[f.name] = tuple(None if n == "None" else n for n in names)
    return out


def _float_or_none(value: object, name: str) -> float | None:
    if value is None:
        return None
    if not isinstance(value, int | float):
        raise ReportError(f"{name}: expected a number")
    return float(value)


def _int_or_none(value: object, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ReportError(f"{name}: expected a whole number")
    return value


def _view_from_timeline(run_id: str, report: Mapping[str, Any], meta: RunMeta) -> RunView:
    rows = report.get("groups_timeline")
    note = None
    if rows is None and isinstance(report.get("batch_collection_s"), Mapping):
        # `corral sim` without --plot: its batches, engines, lanes and wait attribution, no groups
        rows, note = [], NO_GROUPS_NOTE
    if not isinstance(rows, list):
        raise ReportError("groups_timeline: missing; run corral sim with --plot or corral run")
    groups: list[GroupRow] = []
    trajs: dict[tuple[int, int], Trajectory] = {}
    staleness: dict[int, int] = defaultdict(int)
    run_s = float(report.get("run_s") or 0.0)
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping) or "group" not in r:
            raise ReportError(f"groups_timeline[{i}]: expected an object with a group")
        gid = int(r["group"])
        outcome = str(r.get("outcome", "in flight"))
        g = GroupRow(
            gid,
            task=str(r.get("task", "")),
            admitted=_float_or_none(r.get("admitted_s"), f"groups_timeline[{i}].admitted_s"),
            ready=_float_or_none(r.get("completed_s"), f"groups_timeline[{i}].completed_s"),
            ended=_float_or_none(r.get("ended_s"), f"groups_timeline[{i}].ended_s"),
            outcome=outcome,
            batch=_int_or_none(r.get("batch"), f"groups_timeline[{i}].batch"),
            staleness=_int_or_none(r.get("staleness"), f"groups_timeline[{i}].staleness"),
            detail=str(r.get("detail") or ""),
        )
        groups.append(g)
        if outcome == "delivered" and g.staleness is not None:
            staleness[int(g.staleness)] += 1
        tr = Trajectory(gid, 0)
        if g.admitted is not None:
            end = g.ready if g.ready is not None else (g.ended if g.ended is not None else run_s)
            detail = "all attempts (the report has no event log)"
            tr.spans.append(Span(g.admitted, end, "group_running", detail))
            if g.ready is not None and g.ended is not None and g.ended > g.ready:
                tr.spans.append(Span(g.ready, g.ended, "group_ready", "ready, waiting to be consumed"))
        trajs[gid, 0] = tr
    waits = (report.get("batch_collection_s") or {}).get("per_batch") or []
    rewards = report.get("mean_reward_per_batch") or []
    trainable = report.get("trainable_share_per_batch") or []
    batches = [
        BatchRow(
            int(m["batch"]),
            float(m["requested_s"]),
            float(m["delivered_s"]),
            float(m["delivered_s"]) - float(m["requested_s"]),
            tuple(g.group_id for g in groups if g.batch == m["batch"]),
            mean_reward=_number_at(rewards, i),
            trainable=_number_at(trainable, i),
        )
        for i, m in enumerate(report.get("batch_marks") or [])
    ]
    if not batches:
        t = 0.0
        for i, w in enumerate(waits):
            r, share = _number_at(rewards, i), _number_at(trainable, i)
            batches.append(BatchRow(i, t, t + float(w), float(w), mean_reward=r, trainable=share))
            t += float(w)
    updates: list[tuple[str, float, float, int]] = []
    begins: dict[str, float] = {}
    publications: set[tuple[float, int]] = set()
    for u in report.get("update_log") or []:
        if u.get("phase") == "begin":
            begins[u["engine"]] = float(u["t"])
        else:
            start = begins.pop(u["engine"], float(u["t"]))
            updates.append((str(u["engine"]), start, float(u["t"]), int(u["version"])))
    for _, start, _, version in updates:
        if not any(v == version for _, v in publications):
            publications.add((start, version))
    engines = [
        EngineRow(name, "stopped", int(e.get("final_version", 0)))
        for name, e in (report.get("engines") or {}).items()
    ]
    by_group = {g.group_id: g for g in groups}
    _mark_groups(by_group)
    batches = _with_rates(batches)
    critical: dict[int, int] = {}
    for b in batches:
        done = [by_group[gid] for gid in b.groups if by_group[gid].ready is not None]
        if done and b.wait_s > 0:
            critical[b.index] = max(done, key=lambda g: g.ready or 0.0).group_id
    for index, gid in critical.items():
        by_group[gid].held_batch = index
    attribution = report.get("wait_attribution")
    return RunView(
        run_id=run_id,
        source="replay",
        state=meta.state or "replay",
        policy=dict(meta.policy or {}),
        t0=0.0,
        now=max([run_s, *(b.delivered for b in batches)]),
        groups=groups,
        trajectories=trajs,
        batches=batches,
        engines=engines,
        lanes=_lanes(meta.lanes, {}),
        publications=sorted(publications),
        updates=updates,
        audit=[],
        staleness=dict(sorted(staleness.items())),
        attribution=None if attribution is None else _attribution_from_dict(attribution),
        lower_bound_s=meta.lower_bound_s,
        label=meta.label,
        detailed=False,
        timeline_note=note,
    )


def _attribution_from_dict(data: Mapping[str, Any]) -> WaitAttribution:
    from app.core.attribution import PHASES, BatchWait

    batches = []
    for b in data.get("batches", []):
        phases = {p: float(b.get("phases", {}).get(p, 0.0)) for p in PHASES}
        requested = float(b.get("requested_at", 0.0))
        batches.append(
            BatchWait(
                int(b["batch"]),
                requested,
                requested + float(b["wait_s"]),
                b.get("group"),
                b.get("attempt"),
                b.get("group_ready_at"),
                phases,
            )
        )
    return WaitAttribution(tuple(batches), {p: float(data.get("phases", {}).get(p, 0.0)) for p in PHASES})
