"""Wait attribution on the simulator: one phase made slow on purpose must come out as the largest
share of the trainer's wait, and the attributed total must equal the report's trainer wait."""

import pytest

from app.core.attribution import attribute_waits
from app.core.events import Envelope


def simulated_attribution(**overrides):
    from factories import make_workload_data

    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload

    workload = Workload.model_validate(make_workload_data(**overrides))
    envelopes: list[Envelope] = []
    # Fixed lanes: adaptive lanes (full's default) would grow the reset lane away from the slow phase.
    policy = policy_for(workload, "full", adaptive_lanes=False)
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
    assert attribution.largest() == phase
    assert report["wait_attribution"]["largest"] == phase  # the run report says the same
    assert report["wait_attribution"] == attribution.to_dict()
    assert attribution.total_s == pytest.approx(report["trainer_wait_s"], abs=1e-3)
