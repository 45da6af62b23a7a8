"""Wait attribution on the simulator: one phase made slow on purpose must come out as the largest
share of the trainer's wait, and the attributed total must equal the report's trainer wait."""

import pytest

from app.core.attribution import attribute_waits
from app.core.events import Envelope


def simulated_attribution(gate=None, **overrides):
    from factories import make_workload_data

    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    workload = Workload.model_validate(make_workload_data(**overrides))
    envelopes: list[Envelope] = []
    # Fixed lanes: adaptive lanes (full's default) would grow the reset lane away from the slow phase;
    # no agent-phase gate unless asked for: it would hold attempts back from a slow exec lane.
    policy = policy_for(workload, "full", adaptive_lanes=False, agent_gate=gate)
    report = simulate(workload, policy, "full", events=envelopes.append)
    return attribute_waits(envelopes), report


@pytest.mark.parametrize(
    ("overrides", "phase"),
    [
        ({}, "model_turn"),
        ({"trajectory": {"reset_s": 30}}, "reset"),
        (
            {
                "trajectory": {"tool_s": {"uniform": [0.5, 40]}},
                "lanes": {"reset": 4, "exec": 64, "validate": 2, "cleanup": 2},
            },
            "tool_call",
        ),
        (
            {"lanes": {"reset": 4, "exec": 1, "validate": 2, "cleanup": 2}, "trajectory": {"tool_s": 3}},
            "lane_queue",
        ),
        ({"engines": {"count": 1, "update_s": 60}, "batches": 3}, "update_pause"),
    ],
    ids=["baseline", "slow-reset", "straggling-tool-call", "exec-lane-queue", "long-update-pause"],
)
def test_the_slow_phase_is_named_the_largest_share_in_a_simulated_run(overrides, phase):
    attribution, report = simulated_attribution(**overrides)
    check_attribution(attribution, report, phase)


def test_with_the_agent_gate_a_full_exec_lane_holds_attempts_at_the_gate():
    """full's default gate: an exec lane of one slot keeps attempts out of their agent phase, and the
    trainer's wait is put on the gate (its own events), not on the agent's work."""
    slow_exec = {"lanes": {"reset": 4, "exec": 1, "validate": 2, "cleanup": 2}, "trajectory": {"tool_s": 3}}
    attribution, report = simulated_attribution(gate=1.0, **slow_exec)
    check_attribution(attribution, report, "agent_gate")
    assert report["agent_gate"]["waited"] > 0
    assert report["agent_gate"]["max_inside"] < (2 + 2) * 2  # fewer than the (B + S)·G attempts running


def check_attribution(attribution, report, phase):
    assert attribution.largest() == phase
    assert report["wait_attribution"]["largest"] == phase  # the run report says the same
    assert report["wait_attribution"] == attribution.to_dict()
    assert attribution.total_s == pytest.approx(report["trainer_wait_s"], abs=1e-3)


def test_the_accumulator_keeps_no_group_past_its_end_in_a_simulated_run():
    """An ended group's late ops (its sandboxes' cleanup, the tail of an attempt the group no longer
    waited for) came after its delivery or discard and filled the accumulator's map again: 71 groups
    kept after 40 batches, about one more a batch for the run's whole life (the dashboard's view of a
    long run grew about 1 KB a version). Only the groups still open may be kept, at every event."""
    from factories import make_workload_data

    from app.core.attribution import WaitAccumulator
    from app.core.events import BatchDelivered, GroupAdmitted, GroupDiscarded
    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    workload = Workload.model_validate(make_workload_data(batches=40))
    envelopes: list[Envelope] = []
    simulate(workload, policy_for(workload, "full", adaptive_lanes=False), "full", events=envelopes.append)
    acc = WaitAccumulator()
    open_groups: set[int] = set()
    late = 0
    for env in envelopes:
        ev = env.event
        if isinstance(ev, GroupAdmitted):
            open_groups.add(ev.group_id)
        elif isinstance(ev, GroupDiscarded):
            open_groups.discard(ev.group_id)
        elif isinstance(ev, BatchDelivered):
            open_groups.difference_update(ev.group_ids)
        elif getattr(ev, "group_id", None) is not None and ev.group_id not in open_groups:
            late += 1
        acc.on_envelope(env)
        assert acc.open_groups == len(open_groups), f"event {env.seq} ({ev.kind})"
    assert late > 40  # the stream has them (113 ops of ended groups): the check above met them
    assert acc.open_groups == 0
    assert acc.result() == attribute_waits(envelopes)


def test_a_long_run_s_accumulator_keeps_its_newest_paths_and_the_windows_a_batch_can_still_reach():
    """The dashboard's view of a long run kept every batch's critical path (783 bytes each, its phase
    dict most of it) and every engine's every weight-update window. Kept to its newest 10 paths, the
    accumulator's totals are still the whole run's, and it holds only the update windows that end after
    the latest batch was asked for: 400 batches published about 800 windows."""
    from factories import make_workload_data

    from app.core.attribution import WaitAccumulator
    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    workload = Workload.model_validate(make_workload_data(batches=400))
    envelopes: list[Envelope] = []
    simulate(workload, policy_for(workload, "full", adaptive_lanes=False), "full", events=envelopes.append)
    whole = attribute_waits(envelopes)
    acc = WaitAccumulator(keep_batches=10)
    most_windows = 0
    for env in envelopes:
        acc.on_envelope(env)
        most_windows = max(most_windows, acc.kept_windows)
    kept = acc.result()
    assert len(whole.batches) == kept.count == 400
    assert kept.batches == whole.batches[-10:]
    assert kept.phases == whole.phases
    assert kept.total_s == whole.total_s == sum(b.wait_s for b in whole.batches)
    assert kept.summary() == whole.summary()
    assert sum(e.event.kind == "engine_update_end" for e in envelopes) > 700
    assert most_windows <= 3 * workload.engines.count  # the latest versions of each engine (5, of 797)
