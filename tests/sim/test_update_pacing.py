"""Free-slot update pacing (`PolicyConfig.update_pacing`) on the production runtime under the simulator:
docs/design.md's invariants hold, the configured maximum is never passed, and an engine begins updating
beside others only when the engines left serving had a free slot for every turn of those updating."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_properties import changes, check_run, make_workload, workloads

from app.core.config import PolicyName, UpdatePacing
from app.core.events import EngineUpdateBegin, EngineUpdateEnd, Envelope, Event
from app.runtime.driver import Runtime
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload


def independent_free_slots(runtime: Runtime, engine: str, updating: tuple[str, ...]) -> bool:
    """The rule, computed again from the pool's state: free slots on the engines left serving."""
    pool, plan, k = runtime.pool, runtime.plan, runtime.scheduler.max_staleness
    # engines that take turns: not updating, not down, and not more than K versions behind
    left = [
        e
        for e in pool.active
        if e != engine and e not in updating and e not in plan.down and plan.target - plan.versions[e] <= k
    ]
    free = sum(pool.slots - pool.active[e] for e in left) - pool.waiting
    return free >= pool.active[engine] + sum(pool.active[e] for e in updating)


class PacingWitness:
    """Wraps the runtime's pacing predicate: checks each answer against the rule and records, per
    virtual time, which engines it let join an update already running."""

    def __init__(self) -> None:
        self.approved: list[tuple[float, str]] = []
        self.wrong: list[str] = []
        self.wrapped = False

    def __call__(self, runtime: Runtime, event: Event) -> None:
        if self.wrapped:
            return
        self.wrapped = True
        inner = runtime.plan.may_join
        assert inner is not None

        def may_join(engine: str, updating: tuple[str, ...]) -> bool:
            answer = inner(engine, updating)
            if answer != independent_free_slots(runtime, engine, updating):
                self.wrong.append(f"{engine} beside {updating}: {answer}")
            if answer:
                self.approved.append((runtime.now(), engine))
            return answer

        runtime.plan.may_join = may_join


def joins(envelopes: list[Envelope], k: int | None = None) -> list[tuple[float, str]]:
    """(time, engine) of every update that began while another engine was updating; with `k`, leaving
    out engines more than k versions behind (they join without pacing: they can serve nothing)."""
    updating: set[str] = set()
    versions: dict[str, int] = {}
    out = []
    for env in envelopes:
        ev = env.event
        if isinstance(ev, EngineUpdateBegin):
            too_stale = k is not None and ev.version - versions.get(ev.engine, 0) > k
            if updating and not too_stale:
                out.append((env.t, ev.engine))
            updating.add(ev.engine)
        elif isinstance(ev, EngineUpdateEnd):
            updating.discard(ev.engine)
            if ev.ok:
                versions[ev.engine] = ev.version
    return out


def run_paced(workload: Workload, cap: int) -> tuple[dict[str, Any], PacingWitness, list[Envelope]]:
    policy = policy_for(workload, "full", update_pacing="free_slots", max_updating_engines=cap)
    witness = PacingWitness()
    envelopes: list[Envelope] = []
    report = simulate(workload, policy, "paced", observer=witness, events=envelopes.append)
    return report, witness, envelopes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, cap=st.integers(1, 4), live=changes)
def test_invariants_hold_with_free_slot_pacing(
    workload: Workload, cap: int, live: list[tuple[float, str, int]]
) -> None:
    policy = policy_for(workload, "full", update_pacing="free_slots", max_updating_engines=cap)
    report = check_run(workload, policy, live)  # K, B + S, completion order, no restart, ≤ cap, no loss
    assert report["max_engines_updating"] <= min(cap, workload.engines.count)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads, cap=st.integers(2, 4))
def test_an_engine_joins_an_update_only_when_the_others_have_free_slots(workload: Workload, cap: int) -> None:
    report, witness, envelopes = run_paced(workload, cap)
    assert witness.wrong == []
    # Every update that began beside another was let in by the rule at that moment (the first of a
    # step never asks it).
    for joined in joins(envelopes, workload.policy.max_staleness):
        assert joined in witness.approved, joined
    assert report["restarted_trajectories"] == 0
    assert report["lost_groups"] == 0


def test_free_slots_let_engines_update_together_and_full_engines_keep_one_at_a_time() -> None:
    roomy = make_workload(batches=4, engines={"count": 3, "slots": 64, "update_s": 2.0})
    report, witness, envelopes = run_paced(roomy, 3)
    assert witness.wrong == []
    # A light turn load, 64 slots an engine: two update together while the third serves every turn
    # (all three only when no turn is in flight at all: nobody would be left to take new turns).
    assert report["max_engines_updating"] >= 2
    assert joins(envelopes)
    # One slot an engine for 8+ trajectories: the others never have room, so one engine at a time.
    tight = make_workload(
        batches=4, batch={"groups": 2, "group_size": 4}, engines={"count": 3, "slots": 1, "update_s": 2.0}
    )
    report, witness, envelopes = run_paced(tight, 3)
    assert report["max_engines_updating"] == 1
    assert joins(envelopes) == []


def test_full_paces_by_free_slots_and_the_other_rungs_do_not() -> None:
    workload = make_workload()
    full = policy_for(workload, "full")
    assert full.update_pacing is UpdatePacing.FREE_SLOTS
    assert full.max_updating_engines > workload.engines.count  # the rule, not the cap, decides
    for rung in (PolicyName.SYNC, PolicyName.COMPLETION, PolicyName.LANES):
        assert policy_for(workload, rung.value).update_pacing is UpdatePacing.FIXED


def test_a_maximum_given_is_kept_as_given() -> None:
    # `corral run` and `corral serve` pass their config's maximum: the rollout keeps that pace, fixed.
    workload = make_workload()
    given = policy_for(workload, "full", max_updating_engines=2)
    assert (given.update_pacing, given.max_updating_engines) == (UpdatePacing.FIXED, 2)
    fixed = policy_for(workload, "full", update_pacing="fixed")
    assert fixed.max_updating_engines == 1
    paced = policy_for(workload, "full", update_pacing="free_slots")
    assert paced.max_updating_engines == 64
