"""The scheduler: a pure state machine that decides which groups run and which batches are delivered.

It takes `on_<event>(...)` calls from the runtime and returns decisions for the runtime to carry out.
It owns no tasks, clocks or sockets: time arrives as the `now` argument.

Invariants (checked by tests over random workloads and random live changes of S and K):
- groups in flight + ready ≤ B + S at all times (S as currently set; lowering S admits nothing until
  the count falls below the new cap, it never evicts);
- every delivered group has staleness ≤ K, where staleness = trainer version at consume − the oldest
  policy version of any turn in the group;
- with completion order, batches take ready groups in the order they completed;
- every admitted group ends exactly once: delivered, or discarded with a reason (stale, failed,
  cancelled, zero_variance). Nothing is lost silently.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from app.core.advantages import grpo_advantages
from app.core.config import PolicyConfig


class GroupState(StrEnum):
    RUNNING = "running"
    READY = "ready"
    DELIVERED = "delivered"
    DISCARDED = "discarded"

    @property
    def is_live(self) -> bool:
        """Running or ready: counted against B + S."""
        return self in (GroupState.RUNNING, GroupState.READY)


class DiscardReason(StrEnum):
    STALE = "stale"
    FAILED = "failed"
    CANCELLED = "cancelled"
    ZERO_VARIANCE = "zero_variance"


@dataclass
class AttemptRecord:
    group_id: int
    index: int
    done: bool = False
    reward: float = 0.0
    error: str | None = None
    turns: int = 0
    min_version: int | None = None
    restarts: int = 0


@dataclass
class GroupRecord:
    id: int
    task_index: int
    admitted_at: float
    attempts: list[AttemptRecord]
    state: GroupState = GroupState.RUNNING
    completed_at: float | None = None
    ended_at: float | None = None
    reason: DiscardReason | None = None
    detail: str = ""
    batch_index: int | None = None
    staleness: int | None = None

    @property
    def min_version(self) -> int | None:
        versions = [a.min_version for a in self.attempts if a.min_version is not None]
        return min(versions) if versions else None

    @property
    def rewards(self) -> list[float]:
        return [a.reward for a in self.attempts]


@dataclass(frozen=True)
class StartGroup:
    group_id: int
    task_index: int
    group_size: int


@dataclass(frozen=True)
class CancelGroup:
    """Stop the group's running attempts; the group is already accounted as discarded."""

    group_id: int
    reason: DiscardReason


@dataclass(frozen=True)
class DeliveredGroup:
    group_id: int
    task_index: int
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    staleness: int


@dataclass(frozen=True)
class DeliverBatch:
    index: int
    groups: tuple[DeliveredGroup, ...]
    trainer_version: int


Decision = StartGroup | CancelGroup | DeliverBatch


@dataclass
class SchedulerCounters:
    events: int = 0
    admitted: int = 0
    delivered: int = 0
    discarded: dict[DiscardReason, int] = field(default_factory=lambda: {r: 0 for r in DiscardReason})
    max_groups_in_flight: int = 0
    max_staleness_delivered: int = 0
    restarts: int = 0


class Scheduler:
    """Admission, completion-order batching and staleness enforcement for one run."""

    def __init__(self, policy: PolicyConfig, trainer_version: int = 0) -> None:
        self.policy = policy
        self.surplus = policy.surplus_groups
        self.max_staleness = policy.max_staleness
        self.trainer_version = trainer_version
        self.groups: dict[int, GroupRecord] = {}
        self.counters = SchedulerCounters()
        self._next_group = 0
        self._live: dict[int, GroupRecord] = {}  # running or ready, in admission order
        self._ready: deque[int] = deque()  # completion order
        self._batch_wanted = False
        self._batches = 0
        self._stopped = False

    # -- queries -------------------------------------------------------------------------------

    @property
    def groups_live(self) -> int:
        """Groups in flight + ready, the quantity bounded by B + S."""
        return len(self._live)

    @property
    def capacity(self) -> int:
        return self.policy.groups_per_batch + self.surplus

    @property
    def batches_delivered(self) -> int:
        return self._batches

    def group_of(self, group_id: int) -> GroupRecord:
        return self.groups[group_id]

    def is_running(self, group_id: int) -> bool:
        return self.groups[group_id].state is GroupState.RUNNING

    # -- events --------------------------------------------------------------------------------

    def on_start(self, now: float) -> list[Decision]:
        self.counters.events += 1
        return self._admit(now)

    def on_turn(self, group_id: int, attempt: int, version: int, now: float) -> list[Decision]:
        """A model turn of a running attempt finished, generated by policy `version`."""
        self.counters.events += 1
        group = self.groups[group_id]
        if group.state is not GroupState.RUNNING:
            return []
        record = group.attempts[attempt]
        record.turns += 1
        if record.min_version is None or version < record.min_version:
            record.min_version = version
        if self.trainer_version - version > self.max_staleness:
            return self._discard_running(group, DiscardReason.STALE, now, "cannot meet K") + self._admit(now)
        return []

    def on_attempt_restarted(self, group_id: int, attempt: int, now: float) -> list[Decision]:
        """The attempt starts over: its turns are thrown away, so they no longer count for staleness."""
        self.counters.events += 1
        group = self.groups[group_id]
        if group.state is not GroupState.RUNNING:
            return []
        record = group.attempts[attempt]
        record.turns = 0
        record.min_version = None
        record.restarts += 1
        self.counters.restarts += 1
        return []

    def on_attempt_done(
        self, group_id: int, attempt: int, reward: float, error: str | None, now: float
    ) -> list[Decision]:
        self.counters.events += 1
        group = self.groups[group_id]
        if group.state is not GroupState.RUNNING:
            return []
        record = group.attempts[attempt]
        if record.done:
            raise ValueError(f"attempt {group_id}/{attempt} reported done twice")
        record.done, record.reward, record.error = True, reward, error
        if error is not None:
            return self._discard_running(group, DiscardReason.FAILED, now, error) + self._admit(now)
        if not all(a.done for a in group.attempts):
            return []
        group.completed_at = now
        if self.policy.filter_zero_variance and len(set(group.rewards)) == 1:
            self._end(group, GroupState.DISCARDED, now, DiscardReason.ZERO_VARIANCE, "all rewards equal")
            return self._admit(now)
        group.state = GroupState.READY
        self._ready.append(group_id)
        return self._try_deliver(now) + self._admit(now)

    def on_batch_requested(self, now: float) -> list[Decision]:
        self.counters.events += 1
        self._batch_wanted = True
        return self._try_deliver(now) + self._admit(now)

    def on_version_published(self, version: int, now: float) -> list[Decision]:
        """The trainer moved to `version`; work that can no longer meet K is cancelled now."""
        self.counters.events += 1
        if version < self.trainer_version:
            raise ValueError(f"trainer version went back from {self.trainer_version} to {version}")
        self.trainer_version = version
        return self._enforce_staleness(now) + self._admit(now)

    def set_surplus(self, surplus: int, now: float) -> list[Decision]:
        self.counters.events += 1
        if surplus < 0:
            raise ValueError(f"surplus_groups must be ≥ 0, got {surplus}")
        self.surplus = surplus
        return self._admit(now)

    def set_max_staleness(self, max_staleness: int, now: float) -> list[Decision]:
        self.counters.events += 1
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be ≥ 0, got {max_staleness}")
        self.max_staleness = max_staleness
        return self._enforce_staleness(now) + self._try_deliver(now) + self._admit(now)

    def on_stop(self, now: float) -> list[Decision]:
        """The run ends: every group still live is discarded as cancelled."""
        self.counters.events += 1
        self._stopped = True
        decisions: list[Decision] = []
        for group in list(self._live.values()):
            if group.state is GroupState.RUNNING:
                decisions += self._discard_running(group, DiscardReason.CANCELLED, now, "run ended")
            else:
                self._end(group, GroupState.DISCARDED, now, DiscardReason.CANCELLED, "run ended")
        return decisions

    # -- internals -----------------------------------------------------------------------------

    def _staleness(self, group: GroupRecord) -> int:
        oldest = group.min_version
        return 0 if oldest is None else self.trainer_version - oldest

    def _enforce_staleness(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        for group in list(self._live.values()):
            if self._staleness(group) <= self.max_staleness:
                continue
            if group.state is GroupState.RUNNING:
                decisions += self._discard_running(group, DiscardReason.STALE, now, "cannot meet K")
            else:
                self._end(group, GroupState.DISCARDED, now, DiscardReason.STALE, "went stale while ready")
        return decisions

    def _admit(self, now: float) -> list[Decision]:
        decisions: list[Decision] = []
        if self._stopped:
            return decisions
        while len(self._live) < self.capacity:
            gid = self._next_group
            self._next_group += 1
            size = self.policy.group_size
            group = GroupRecord(gid, gid, now, [AttemptRecord(gid, i) for i in range(size)])
            self.groups[gid] = group
            self._live[gid] = group
            self.counters.admitted += 1
            decisions.append(StartGroup(gid, gid, size))
        self.counters.max_groups_in_flight = max(self.counters.max_groups_in_flight, len(self._live))
        return decisions

    def _try_deliver(self, now: float) -> list[Decision]:
        if not self._batch_wanted:
            return []
        b = self.policy.groups_per_batch
        if self.policy.completion_order:
            chosen: list[GroupRecord] = []
            for gid in self._ready:
                chosen.append(self.groups[gid])
                if len(chosen) == b:
                    break
        else:
            chosen = list(self._live.values())[:b]
            if any(g.state is not GroupState.READY for g in chosen):
                return []
        if len(chosen) < b:
            return []
        delivered: list[DeliveredGroup] = []
        for group in chosen:
            staleness = self._staleness(group)
            # _enforce_staleness runs on every change of version or K, so a ready group here is fresh.
            assert staleness <= self.max_staleness, (group.id, staleness)
            group.staleness = staleness
            group.batch_index = self._batches
            self._end(group, GroupState.DELIVERED, now, None, "")
            rewards = tuple(group.rewards)
            delivered.append(
                DeliveredGroup(group.id, group.task_index, rewards, grpo_advantages(rewards), staleness)
            )
            self.counters.max_staleness_delivered = max(self.counters.max_staleness_delivered, staleness)
        self._batch_wanted = False
        batch = DeliverBatch(self._batches, tuple(delivered), self.trainer_version)
        self._batches += 1
        return [batch]

    def _discard_running(
        self, group: GroupRecord, reason: DiscardReason, now: float, detail: str
    ) -> list[Decision]:
        self._end(group, GroupState.DISCARDED, now, reason, detail)
        return [CancelGroup(group.id, reason)]

    def _end(
        self, group: GroupRecord, state: GroupState, now: float, reason: DiscardReason | None, detail: str
    ) -> None:
        if group.state in (GroupState.DELIVERED, GroupState.DISCARDED):
            raise ValueError(f"group {group.id} ended twice")
        if group.state is GroupState.READY:
            self._ready.remove(group.id)
        group.state = state
        group.ended_at = now
        group.reason = reason
        group.detail = detail
        del self._live[group.id]
        if state is GroupState.DELIVERED:
            self.counters.delivered += 1
        elif reason is not None:
            self.counters.discarded[reason] += 1
