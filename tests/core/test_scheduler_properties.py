"""The scheduler alone under random event sequences, in every admission mode: docs/design.md's invariants.

Each example builds a policy (B, G, S, K, admission mode, ready room, batch order) and feeds the pure
scheduler a random stream of turns, attempt ends (some failing), batch requests, version publications
and live changes of S and K, then stops it. After every call it checks:
- admission stops at the cap: a call that admits leaves groups running ≤ B + S, and groups live
  (running + ready) ≤ the live cap (B + S in the live mode; B + S + R in the in-flight mode with R set);
  in the attempts mode it leaves attempts in flight ≤ (B + S)·G, counted from what the test fed and the
  outbox said (each admitted group's size, less the attempts reported done, for groups not ended);
- every delivered group has staleness ≤ K;
- with completion order, no group still waiting completed before a group the batch took;
- every admitted group ends exactly once, delivered or discarded with a reason, and the counters agree.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core.config import AdmissionMode, PolicyConfig
from app.core.events import GroupAdmitted, GroupDelivered, GroupDiscarded
from app.core.scheduler import DeliverBatch, GroupState, Scheduler, StartGroup

# Weighted so that groups complete often enough for batches to have a choice of ready groups.
ACTIONS = ["done"] * 8 + ["turn", "turn", "fail", "request", "request", "publish", "surplus", "staleness"]


@st.composite
def policies(draw: st.DrawFn) -> PolicyConfig:
    admission = draw(st.sampled_from(list(AdmissionMode)))
    ready = draw(st.none() | st.integers(0, 3)) if admission is AdmissionMode.IN_FLIGHT else None
    return PolicyConfig(
        groups_per_batch=draw(st.integers(1, 3)),
        group_size=draw(st.integers(2, 3)),
        surplus_groups=draw(st.integers(0, 3)),
        max_staleness=draw(st.integers(0, 2)),
        completion_order=draw(st.booleans()),
        admission=admission,
        ready_surplus=ready,
    )


class Ledger:
    """What the outbox said, group by group."""

    def __init__(self) -> None:
        self.admitted: set[int] = set()
        self.ends: dict[int, list[str]] = {}
        self.sizes: dict[int, int] = {}
        self.done: dict[int, set[int]] = {}  # attempts this test reported done, by group

    def attempts_in_flight(self) -> int:
        return sum(size - len(self.done.get(g, ())) for g, size in self.sizes.items() if g not in self.ends)

    def take(self, s: Scheduler) -> None:
        for event in s.drain_events():
            if isinstance(event, GroupAdmitted):
                self.admitted.add(event.group_id)
                self.sizes[event.group_id] = event.group_size
            elif isinstance(event, GroupDelivered):
                self.ends.setdefault(event.group_id, []).append("delivered")
            elif isinstance(event, GroupDiscarded):
                assert event.reason, f"group {event.group_id} discarded without a reason"
                self.ends.setdefault(event.group_id, []).append(event.reason)


def check_call(
    s: Scheduler, decisions: list, ready_before: dict[int, float], oldest: dict[int, int], ledger: Ledger
) -> None:
    if any(isinstance(d, StartGroup) for d in decisions):
        if s.policy.admission is AdmissionMode.ATTEMPTS:
            in_flight = ledger.attempts_in_flight()
            assert in_flight == s.attempts_running, (in_flight, s.attempts_running)
            assert in_flight <= s.capacity * s.policy.group_size, (in_flight, s.capacity)
        else:
            assert s.groups_running <= s.capacity, (s.groups_running, s.capacity)
        cap = s.live_cap
        assert cap is None or s.groups_live <= cap, (s.groups_live, cap)
        # without R, a group is admitted only while fewer than (K + 1)·B are ready
        ready_cap = s.ready_cap
        assert ready_cap is None or s.groups_ready < ready_cap, (s.groups_ready, ready_cap)
    for batch in (d for d in decisions if isinstance(d, DeliverBatch)):
        assert len(batch.groups) == s.policy.groups_per_batch
        for group in batch.groups:
            # Staleness from the turns this test fed, not from the scheduler's own account.
            staleness = batch.trainer_version - oldest.get(group.group_id, batch.trainer_version)
            assert group.staleness == staleness <= s.max_staleness, (group, staleness, s.max_staleness)
        if s.policy.completion_order:
            taken = max(ready_before.get(g.group_id, g.completed_at) for g in batch.groups)
            waiting = [
                s.groups[gid].completed_at for gid in s.groups if s.groups[gid].state is GroupState.READY
            ]
            assert all(t is not None and t >= taken for t in waiting), (taken, waiting)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), data=st.data())
def test_invariants_hold_under_random_events_in_every_admission_mode(
    policy: PolicyConfig, data: st.DataObject
) -> None:
    s = Scheduler(policy)
    ledger = Ledger()
    oldest: dict[int, int] = {}  # group → oldest policy version of a turn it was fed while running
    decisions = s.on_start(0.0)
    ledger.take(s)
    check_call(s, decisions, {}, oldest, ledger)
    steps = data.draw(st.integers(0, 150))
    for step in range(steps):
        now = float(step + 1)
        action = data.draw(st.sampled_from(ACTIONS))
        running = [g for g in s.groups.values() if g.state is GroupState.RUNNING]
        ready_before = {gid: g.completed_at or 0.0 for gid, g in s.groups.items() if g.completed_at}
        decisions = []
        if action in ("turn", "done", "fail") and running:
            group = data.draw(st.sampled_from(running))
            open_attempts = [a.index for a in group.attempts if not a.done]
            attempt = data.draw(st.sampled_from(open_attempts))
            low = max(0, s.trainer_version - s.max_staleness - 1)
            version = data.draw(st.integers(low, s.trainer_version))
            oldest[group.id] = min(version, oldest.get(group.id, version))
            decisions = s.on_turn(group.id, attempt, version, now)
            if action != "turn" and s.is_running(group.id):
                error = "sandbox died" if action == "fail" else None
                reward = data.draw(st.sampled_from([0.0, 1.0]))
                ledger.done.setdefault(group.id, set()).add(attempt)
                decisions += s.on_attempt_done(group.id, attempt, reward, error, now)
        elif action == "request":
            decisions = s.on_batch_requested(now)
        elif action == "publish":
            decisions = s.on_version_published(s.trainer_version + 1, now)
        elif action == "surplus":
            decisions = s.set_surplus(data.draw(st.integers(0, 4)), now)
        elif action == "staleness":
            decisions = s.set_max_staleness(data.draw(st.integers(0, 3)), now)
        ledger.take(s)
        check_call(s, decisions, ready_before, oldest, ledger)
    s.on_stop(float(steps + 1))
    ledger.take(s)
    assert s.groups_live == 0
    assert set(ledger.ends) == ledger.admitted
    assert all(len(ends) == 1 for ends in ledger.ends.values()), ledger.ends
    counters = s.counters
    assert counters.admitted == len(ledger.admitted)
    assert counters.admitted == counters.delivered + sum(counters.discarded.values())
