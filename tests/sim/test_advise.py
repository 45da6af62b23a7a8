"""`advise`: coordinate descent over S, K, updating engines and lane slots, on real simulations."""

import itertools
from pathlib import Path

from app.sim.advise import Settings, advise, current_settings, evaluate, knob_grid
from app.sim.workload import load_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_grid_always_holds_the_current_value() -> None:
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    start = current_settings(workload)
    grid = knob_grid(workload, start)
    assert start.surplus_groups in grid["surplus_groups"]
    assert start.max_staleness in grid["max_staleness"]
    assert dict(start.lane_slots)["reset"] in grid["reset"]
    # The hand-written config's own updating engines (None: the policy's default) come first.
    assert grid["max_updating_engines"][0] is start.max_updating_engines is None
    assert all(v >= 1 for v in grid["max_updating_engines"][1:] if v is not None)


def test_advice_is_never_worse_than_the_current_settings() -> None:
    workload = load_workload(EXAMPLES / "small-trace.yaml")
    progress: list[tuple[int, int]] = []
    advice = advise(
        workload, passes=1, workers=2, knobs=["surplus_groups"], on_run=lambda d, p: progress.append((d, p))
    )
    assert advice.recommended.batch_collection_s <= advice.current.batch_collection_s
    assert progress[-1] == (len(advice.evaluated), len(advice.evaluated))
    # A round's candidates are counted as it starts, before any of them finishes: the bar never sits
    # full while simulations run.
    for (done, planned), (next_done, next_planned) in itertools.pairwise(progress):
        if done == planned:
            assert next_done == done
            assert next_planned > planned
    # The recommendation is one of the simulated candidates, and re-simulating it gives the same figure.
    again = evaluate(workload, advice.recommended.settings)
    assert again.batch_collection_s == advice.recommended.batch_collection_s
    assert isinstance(advice.recommended.settings, Settings)
    if advice.beats_current:
        assert "cut mean batch collection time" in advice.verdict()
    else:
        assert "matches the current config" in advice.verdict()


def test_the_current_candidate_is_the_hand_written_config_as_it_runs() -> None:
    from app.sim.run import policy_for, simulate

    workload = load_workload(EXAMPLES / "small-trace.yaml")
    outcome = evaluate(workload, current_settings(workload))
    policy = policy_for(workload, "full")
    assert policy.adaptive_lanes  # the sweep runs full as it is, adaptive lanes included
    report = simulate(workload, policy, "full")
    assert outcome.batch_collection_s == report["batch_collection_s"]["mean"]
