"""Invariants of docs/design.md, checked on the production runtime under the simulator, over random
workloads and random live changes of S and K."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from factories import make_workload_data
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.core.config import AdmissionMode, PolicyConfig, PolicyName
from app.core.events import (
    AttemptCancelled,
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    Ledger,
    envelope_from_dict,
)
from app.lanes.adaptive import AdaptiveLanesSpec
from app.runtime.driver import Runtime
from app.runtime.report import report_from_events, static_of
from app.sim.peers import PEERS, peer_policy
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload


def make_workload(**overrides: Any) -> Workload:
    base = make_workload_data(
        seed=1,
        batches=3,
        policy={"max_staleness": 1},
        engines={"slots": 2, "update_s": 2.0},
        lanes={"reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
        trajectory={
            "reset_s": {"uniform": [0.5, 3]},
            "turns": {"uniform": [1, 4]},
            "llm_s": {"lognormal": {"median": 2, "p90": 6}},
            "tool_s": {"uniform": [0.1, 3]},
            "validate_s": 1.0,
            "cleanup_s": 1.0,
            "timeout_s": 30.0,
        },
    )
    for key, value in overrides.items():
        base[key] = (
            {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        )
    return Workload.model_validate(base)


workloads = st.builds(
    lambda seed, b, g, s, k, engines, slots, step, spread, p_err, batches: make_workload(
        seed=seed,
        batches=batches,
        batch={"groups": b, "group_size": g},
        trainer={"step_s": step},
        policy={"surplus_groups": s, "max_staleness": k},
        engines={"count": engines, "slots": slots, "update_s": 2.0},
        trajectory={"task_spread": spread, "p_infra_error": p_err},
    ),
    seed=st.integers(0, 10_000),
    b=st.integers(1, 4),
    g=st.integers(2, 4),
    s=st.integers(0, 4),
    k=st.integers(0, 3),
    engines=st.integers(1, 3),
    slots=st.integers(1, 4),
    step=st.floats(0.0, 5.0),
    spread=st.floats(0.0, 1.0),
    p_err=st.sampled_from([0.0, 0.0, 0.1]),
    batches=st.integers(1, 4),
)
policies = st.sampled_from(list(PolicyName))
changes = st.lists(
    st.tuples(st.floats(0.0, 200.0), st.sampled_from(["surplus_groups", "max_staleness"]), st.integers(0, 4)),
    max_size=4,
)


class InvariantObserver:
    """Checks the invariants at every runtime event, as they happen."""

    def __init__(self) -> None:
        self.violations: list[str] = []
        self.batches: list[BatchDelivered] = []
        # Running groups' attempts not yet finished, from the stream alone (attempts admission's cap)
        self.open_attempts: dict[int, int] = {}

    def __call__(self, runtime: Runtime, event: Event) -> None:
        sched = runtime.scheduler
        if isinstance(event, GroupAdmitted):
            self.open_attempts[event.group_id] = event.group_size
        elif isinstance(event, AttemptFinished) and event.group_id in self.open_attempts:
            self.open_attempts[event.group_id] -= 1
        elif isinstance(event, GroupReady | GroupDiscarded):
            self.open_attempts.pop(event.group_id, None)
        if isinstance(event, GroupAdmitted) and runtime.policy.admission is AdmissionMode.ATTEMPTS:
            # (B + S)·G caps the attempts in flight
            in_flight, cap = sum(self.open_attempts.values()), sched.capacity * runtime.policy.group_size
            if in_flight > cap:
                self.violations.append(f"admitted past (B+S)·G: {in_flight} attempts in flight > {cap}")
            ready_cap = sched.ready_cap
            if ready_cap is None or sched.groups_ready > ready_cap:
                self.violations.append(f"admitted past the ready cap: {sched.groups_ready} > {ready_cap}")
        elif isinstance(event, GroupAdmitted):
            # B + S caps what is live, or (in-flight admission) what is in flight; then in flight +
            # ready stays within B + S + R when R is set.
            if sched.groups_running > sched.capacity:
                self.violations.append(
                    f"admitted past B+S: {sched.groups_running} in flight > {sched.capacity}"
                )
            cap = sched.live_cap
            if cap is not None and sched.groups_live > cap:
                self.violations.append(f"admitted past the live cap: {sched.groups_live} > {cap}")
        if isinstance(event, BatchDelivered):
            if len(event.staleness) != len(event.group_ids):
                self.violations.append(f"batch {event.batch_index}: a staleness per group expected")
            for staleness in event.staleness:
                if staleness > sched.max_staleness:
                    self.violations.append(f"delivered staleness {staleness} > K={sched.max_staleness}")
            self.batches.append(event)
        if runtime.plan.rolling and len(runtime.plan.updating) > runtime.policy.max_updating_engines:
            self.violations.append("too many engines updating at once")


def check_run(workload: Workload, policy: PolicyConfig, live: list[tuple[float, str, int]]) -> dict[str, Any]:
    observer = InvariantObserver()
    captured: dict[str, Runtime] = {}

    def observe(runtime: Runtime, event: Event) -> None:
        captured["rt"] = runtime
        observer(runtime, event)

    envelopes: list[Envelope] = []
    report = simulate(workload, policy, "prop", changes=live, observer=observe, events=envelopes.append)
    assert observer.violations == []
    assert report["lost_groups"] == 0
    assert report["batches"] == workload.batches
    if policy.rolling_updates:
        assert report["restarted_trajectories"] == 0
    rt = captured["rt"]
    # The run's own accounting is independent of the stream: both agree, and nothing is left over.
    counters = rt.scheduler.counters
    assert rt.scheduler.groups == {}
    # Every admitted group ended exactly once, with a reason when it was not delivered.
    ledger = Ledger()
    for env in envelopes:
        ledger.on_envelope(env)
    assert (ledger.lost, ledger.gaps, ledger.open_groups) == (0, 0, set())
    assert ledger.admitted_count == counters.admitted == report["admitted_groups"]
    discards = [e.event for e in envelopes if isinstance(e.event, GroupDiscarded)]
    assert all(d.reason for d in discards)
    delivered = {
        e.event.group_id: e.event.batch_index for e in envelopes if isinstance(e.event, GroupDelivered)
    }
    assert len(delivered) == counters.delivered == report["delivered_groups"]
    assert len(delivered) == workload.batches * policy.groups_per_batch
    assert report["admitted_groups"] == len(delivered) + sum(report["discarded_groups"].values())
    check_tries_close_once(envelopes)
    if policy.completion_order:
        # No group that had completed earlier was passed over for one that completed later.
        ready = {e.event.group_id: e.t for e in envelopes if isinstance(e.event, GroupReady)}
        for n in set(delivered.values()):
            latest = max(ready[g] for g, b in delivered.items() if b == n)
            for g, b in delivered.items():
                if b > n:
                    assert ready[g] >= latest, (n, g)
    # The report rebuilt from the stored stream (through its JSON form) equals the runtime's.
    stored = [envelope_from_dict(json.loads(json.dumps(e.to_dict()))) for e in envelopes]
    assert report_from_events(reversed(stored), static_of(report)) == report
    # The lower bound is a true lower bound.
    assert report["batch_collection_s"]["mean"] >= report["lower_bound_s"] - 1e-6
    assert report["batch_collection_s"]["mean"] >= report["lower_bound_given_admissions_s"] - 1e-5
    return report


def check_tries_close_once(envelopes: list[Envelope]) -> None:
    """Every try of an attempt that opened is closed exactly once: finished, cancelled or restarted."""
    open_tries: set[tuple[int, int]] = set()
    for env in envelopes:
        ev = env.event
        if isinstance(ev, AttemptStarted):
            assert (ev.group_id, ev.attempt) not in open_tries
            open_tries.add((ev.group_id, ev.attempt))
        elif isinstance(ev, AttemptFinished | AttemptCancelled | AttemptRestarted):
            key = (ev.group_id, ev.attempt)
            assert key in open_tries or (isinstance(ev, AttemptFinished) and ev.error), key
            open_tries.discard(key)
        elif isinstance(ev, GroupAdmitted):
            assert not any(g == ev.group_id for g, _ in open_tries)
    assert open_tries == set()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, rung=policies, live=changes)
def test_invariants_hold_on_random_workloads_and_live_changes(
    workload: Workload, rung: PolicyName, live: list[tuple[float, str, int]]
) -> None:
    check_run(workload, policy_for(workload, rung.value), live)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    zero_var=st.booleans(),
    pause=st.sampled_from(["keep", "wait"]),
    max_up=st.integers(1, 3),
)
def test_invariants_hold_with_other_switches(
    workload: Workload, zero_var: bool, pause: str, max_up: int
) -> None:
    policy = policy_for(workload, "full").with_changes(
        filter_zero_variance=zero_var, pause_mode=pause, max_updating_engines=max_up
    )
    check_run(workload, policy, [])


def test_same_seed_gives_byte_identical_report() -> None:
    workload = make_workload(batches=4)
    policy = policy_for(workload, "full")
    one = simulate(workload, policy, "full")
    two = simulate(workload, policy, "full")
    one.pop("wall_s")
    two.pop("wall_s")
    assert json.dumps(one) == json.dumps(two)
    other = simulate(make_workload(batches=4, seed=2), policy, "full")
    other.pop("wall_s")
    assert json.dumps(other) != json.dumps(one)


def test_sync_restarts_and_full_does_not() -> None:
    workload = make_workload(batches=3, policy={"surplus_groups": 3, "max_staleness": 2})
    sync = simulate(workload, policy_for(workload, "sync"), "sync")
    full = simulate(workload, policy_for(workload, "full"), "full")
    assert sync["restarted_trajectories"] > 0
    assert full["restarted_trajectories"] == 0
    assert sync["max_groups_in_flight"] <= 2
    assert full["max_groups_running"] <= 5  # full admits in flight: B + S caps groups running


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    rung=st.sampled_from([PolicyName.LANES, PolicyName.FULL]),
    sharing=st.sampled_from(["work_conserving", "partitioned"]),
    adaptive=st.sampled_from(
        [
            None,
            {"interval_s": 1.0, "overload": None, "long_op_factor": None},
            {"interval_s": 3.0, "step": 0.25, "max_factor": 4.0, "overload": None, "long_op_factor": None},
            {"interval_s": 1.0},  # slots follow cores, long resets leave the reset lane
            {"interval_s": 2.0, "overload": 1.5, "long_op_factor": 2.0, "background_share": 0.5},
        ]
    ),
    demand=st.sampled_from([0.25, 1.0, 3.0]),
    order=st.sampled_from(["fifo", "oldest_group"]),  # oldest_group: CPU priority by group age too
    live=changes,
)
def test_invariants_hold_under_every_lane_mode(
    workload: Workload,
    rung: PolicyName,
    sharing: str,
    adaptive: dict[str, float | None] | None,
    demand: float,
    order: str,
    live: list[tuple[float, str, int]],
) -> None:
    data = workload.model_dump(by_alias=True)
    data["lanes"] = {**data["lanes"], "sharing": sharing, "adaptive": adaptive, "order": order}
    data["cpus"] = {**data["cpus"], "sandbox_demand": demand}
    moded = Workload.model_validate(data)
    report = check_run(moded, policy_for(moded, rung.value), live)
    assert report["lane_sharing"] == sharing
    assert report["lanes_cpu_priority"] is (order == "oldest_group")
    if adaptive is not None:
        floor = adaptive.get("overload", 1.0) is not None  # slots may go below configured, never below 1
        cap = AdaptiveLanesSpec.model_validate(adaptive).max_factor
        for lane, slots in report["lane_slots"].items():
            assert (1 if floor else slots["configured"]) <= slots["final"] <= slots["max"], lane
            assert slots["max"] <= max(slots["configured"], math.floor(cap * slots["configured"])), lane


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads,
    rung=st.sampled_from([PolicyName.COMPLETION, PolicyName.FULL]),
    ready_surplus=st.none() | st.integers(0, 4),
    live=changes,
)
def test_invariants_hold_when_b_plus_s_caps_only_groups_in_flight(
    workload: Workload, rung: PolicyName, ready_surplus: int | None, live: list[tuple[float, str, int]]
) -> None:
    policy = policy_for(workload, rung.value, admission="in_flight", ready_surplus=ready_surplus)
    report = check_run(workload, policy, live)
    top_s = max([policy.surplus_groups] + [v for _, k, v in live if k == "surplus_groups"])
    assert report["max_groups_running"] <= policy.groups_per_batch + top_s
    if ready_surplus is not None:
        assert report["max_groups_in_flight"] <= policy.groups_per_batch + top_s + ready_surplus


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, rung=st.sampled_from([PolicyName.COMPLETION, PolicyName.FULL]), live=changes)
def test_invariants_hold_when_b_plus_s_caps_attempts_in_flight(
    workload: Workload, rung: PolicyName, live: list[tuple[float, str, int]]
) -> None:
    # check_run's observer counts the attempts in flight from the stream at every admission, and checks
    # that the mean is not below the lower bound, which for this mode counts attempt-seconds.
    policy = policy_for(workload, rung.value, admission="attempts")
    report = check_run(workload, policy, live)
    assert report["policy_config"]["admission"] == "attempts"


def test_attempts_admission_runs_more_groups_on_the_same_attempt_room() -> None:
    # One slow attempt per task keeps each group open while its siblings are done: their room admits
    # further groups, so more groups run at once than B + S, and never more attempts than (B + S)·G.
    workload = make_workload(
        batches=4,
        batch={"groups": 2, "group_size": 4},
        policy={"surplus_groups": 2, "max_staleness": 3},
        trajectory={"attempt_spread": 1.0},
    )
    groups = simulate(workload, policy_for(workload, "full", admission="in_flight"), "full")
    attempts = simulate(workload, policy_for(workload, "full", admission="attempts"), "full")
    assert groups["max_groups_running"] <= 4 < attempts["max_groups_running"]
    assert attempts["batches"] == groups["batches"] == 4
    assert attempts["lower_bound_s"] <= attempts["batch_collection_s"]["mean"]


def test_in_flight_admission_with_no_ready_room_is_the_live_mode() -> None:
    workload = make_workload(batches=4, policy={"surplus_groups": 2, "max_staleness": 2})
    live = simulate(workload, policy_for(workload, "full", admission="live"), "full")
    in_flight = simulate(
        workload, policy_for(workload, "full", admission="in_flight", ready_surplus=0), "full"
    )
    for report in (live, in_flight):
        report.pop("wall_s")
        report.pop("policy_config")
    assert in_flight == live


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, peer=st.sampled_from(sorted(PEERS)), live=changes)
def test_invariants_hold_for_every_peer_rung(
    workload: Workload, peer: str, live: list[tuple[float, str, int]]
) -> None:
    policy = peer_policy(workload, peer)
    report = check_run(workload, policy, live)
    assert report["max_engines_updating"] <= workload.engines.count


@pytest.mark.parametrize("order", ["fifo", "oldest_group"])
def test_invariants_hold_while_long_resets_leave_the_reset_lane(order: str) -> None:
    # Few sandbox cores, many groups and a long reset tail: long resets leave the reset lane's slots.
    workload = make_workload(
        batches=4,
        batch={"groups": 2, "group_size": 4},
        policy={"surplus_groups": 4, "max_staleness": 2},
        cpus={"total": 8, "serving": 4, "sandbox_demand": 1.0},
        lanes={
            "reset": 4,
            "exec": 4,
            "validate": 2,
            "cleanup": 2,
            "adaptive": {"interval_s": 1.0, "long_op_factor": 2.0},
            "order": order,
        },
        trajectory={"reset_s": {"lognormal": {"median": 1, "p90": 20, "max": 300}}},
    )
    report = check_run(workload, policy_for(workload, "full"), [])
    assert report["lanes_cpu_priority"] is (order == "oldest_group")
    assert report["lane_long_resets"] > 0
    assert report["lost_groups"] == 0


def test_a_run_whose_every_group_has_equal_rewards_ends_instead_of_discarding_forever() -> None:
    """With filter_zero_variance and tasks nobody solves, every group is discarded and a run admitted
    groups for ever (a simulated peer on `cpu-scarce`, all of whose attempts ran out of time). It now
    ends once 1,000 groups in a row were discarded so, and says why; nothing is lost on the way."""
    from app.runtime.driver import RunCannotProceed

    workload = make_workload(batches=2, trajectory={"p_success": 0.0})
    envelopes: list[Envelope] = []
    policy = policy_for(workload, "full", filter_zero_variance=True)
    with pytest.raises(ExceptionGroup) as info:
        simulate(workload, policy, "full", events=envelopes.append)
    assert info.group_contains(RunCannotProceed, match="1001 groups in a row had all their rewards equal")
    flat = [e for e in envelopes if isinstance(e.event, GroupDiscarded) and e.event.reason == "zero_variance"]
    assert len(flat) >= 1001
    ledger = Ledger()
    for env in envelopes:
        ledger.on_envelope(env)
    assert (ledger.lost, ledger.gaps) == (0, 0)
