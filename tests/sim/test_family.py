"""The bench's workload family and peer rungs: every built-in workload validates and loads by name,
peer rungs are the documented policies, and the family's checks say where the ladder is out of order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.core.config import AdmissionMode, PauseModeName
from app.sim.family import FAMILY, builtin_workload, findings, run_family
from app.sim.peers import PEERS, peer_policy
from app.sim.workload import load_workload


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_every_builtin_workload_validates_and_loads_by_name(name: str) -> None:
    assert load_workload(Path(name)) == builtin_workload(name)


def test_unknown_builtin_is_refused_with_the_choices() -> None:
    with pytest.raises(KeyError, match="cpu-scarce"):
        builtin_workload("nope")


def test_design_workload_takes_designs_figures_as_they_are() -> None:
    spec = builtin_workload("design").trajectory
    assert spec.timeout_s == 660.0
    assert spec.reset_s.lognormal is not None
    assert (spec.reset_s.lognormal.median, spec.reset_s.lognormal.p90) == (7, 76)
    assert spec.task_spread == 0.6


def test_cpu_scarce_workload_starves_a_partitioned_reset_lane() -> None:
    w = builtin_workload("cpu-scarce")
    live_trajectories = (w.batch.groups + w.policy.surplus_groups) * w.batch.group_size
    assert w.cpus.total - w.cpus.serving < live_trajectories / 10
    assert w.trajectory.reset_s.lognormal is not None
    assert w.trajectory.reset_s.lognormal.max is not None
    assert w.trajectory.reset_s.lognormal.max > 3600


def test_peer_rungs_are_the_documented_policies() -> None:
    w = builtin_workload("default")
    b, s, k, engines = w.batch.groups, w.policy.surplus_groups, w.policy.max_staleness, w.engines.count
    assert s < k * b  # the staleness bound alone would run more groups than the workload's S
    areal, prime, pipeline, slime, skyrl = (
        peer_policy(w, p) for p in ("areal", "prime-rl", "pipelinerl", "slime", "skyrl")
    )
    assert all(not peer_policy(w, p).pinned_lanes for p in PEERS)
    # Concurrency cap: groups running ≤ B + S; staleness: running + ready ≤ (K + 1)·B.
    assert (areal.admission, areal.surplus_groups, areal.ready_surplus) == (
        AdmissionMode.IN_FLIGHT,
        s,
        k * b - s,
    )
    assert (areal.max_updating_engines, areal.pause_mode) == (engines, PauseModeName.KEEP)
    assert skyrl == areal
    assert (prime.completion_order, prime.surplus_groups, prime.max_staleness) == (False, 2 * b, 2)
    assert (pipeline.rolling_updates, pipeline.max_updating_engines) == (True, engines)
    assert (slime.rolling_updates, slime.surplus_groups) == (False, b)
    for name in ("areal (no concurrency cap)", "skyrl (no concurrency cap)"):
        uncapped = peer_policy(w, name)
        assert (uncapped.admission, uncapped.surplus_groups) == (AdmissionMode.LIVE, k * b)
        assert uncapped == areal.with_changes(
            admission=AdmissionMode.LIVE, surplus_groups=k * b, ready_surplus=None
        )


@pytest.mark.parametrize(("surplus", "staleness"), [(64, 4), (8, 1), (32, 0), (0, 3)])
def test_capped_peer_admission_is_the_smaller_of_staleness_and_concurrency(
    surplus: int, staleness: int
) -> None:
    w = builtin_workload("default", policy={"surplus_groups": surplus, "max_staleness": staleness})
    b = w.batch.groups
    policy = peer_policy(w, "areal")
    running_cap = b + policy.surplus_groups
    live_cap = running_cap + (policy.ready_surplus or 0)
    assert running_cap == min(b + surplus, (staleness + 1) * b)
    assert live_cap == (staleness + 1) * b


def test_capped_peer_runs_no_more_groups_than_the_workloads_cap() -> None:
    from app.core.scheduler import Scheduler, StartGroup

    def admit(scheduler: Scheduler, decisions: list[Any]) -> list[int]:
        return [d.group_id for d in decisions if isinstance(d, StartGroup)]

    def complete(scheduler: Scheduler, group_id: int) -> list[int]:
        started: list[int] = []
        for attempt in range(scheduler.policy.group_size):
            scheduler.on_turn(group_id, attempt, 0, 0.0)
            started += admit(scheduler, scheduler.on_attempt_done(group_id, attempt, 1.0, None, 0.0))
        return started

    # B = 2, S = 1, K = 2: at most 3 groups run (the concurrency cap), at most 6 live (staleness).
    w = builtin_workload(
        "default", batch={"groups": 2, "group_size": 2}, policy={"surplus_groups": 1, "max_staleness": 2}
    )
    capped = Scheduler(peer_policy(w, "areal"))
    running = admit(capped, capped.on_start(0.0))
    assert len(running) == 3
    ready = 0
    while running:
        group = running.pop(0)
        running += complete(capped, group)
        ready += 1
        assert capped.groups_running <= 3
        assert capped.groups_live <= 6
    # Nobody asked for a batch: admission stops once running + ready reach (K + 1)·B.
    assert (ready, capped.groups_ready, capped.groups_running) == (6, 6, 0)
    uncapped = Scheduler(peer_policy(w, "areal (no concurrency cap)"))
    assert len(admit(uncapped, uncapped.on_start(0.0))) == 6


def make_rungs(**means: float) -> dict[str, dict[str, Any]]:
    return {name.replace("_", "-"): {"mean_s": value} for name, value in means.items()}


@pytest.mark.parametrize(
    ("means", "expected"),
    [
        ({"sync": 3, "completion": 2, "full": 1}, []),
        (
            {"sync": 3, "completion": 2, "full": 2.5},
            ["LADDER OUT OF ORDER: full 2.5 s is worse than completion"],
        ),
        ({"sync": 1, "completion": 2, "full": 0.5}, ["LADDER OUT OF ORDER: completion"]),
        (
            {"sync": 3, "completion": 2, "lanes": 2.2, "full": 2.1},
            ["LADDER OUT OF ORDER: lanes 2.2 s is worse than completion", "LADDER OUT OF ORDER: full 2.1"],
        ),
        ({"sync": 3, "completion": 2, "full": 1, "areal": 0.9}, ["areal 0.9 s beats full"]),
    ],
)
def test_findings_name_every_out_of_order_rung(means: dict[str, float], expected: list[str]) -> None:
    lines = findings(make_rungs(**means))
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start)


def test_a_rung_that_beats_full_by_cutting_attempts_short_is_said_to() -> None:
    rungs = make_rungs(sync=3, completion=2, full=1, areal=0.5, slime=0.6)
    rungs["full"]["attempts_cut_short_share"] = 0.35
    rungs["areal"]["attempts_cut_short_share"] = 0.99
    rungs["slime"]["attempts_cut_short_share"] = 0.39  # within 5 points of full's: not said
    for row in rungs.values():
        row["mean_reward"] = 0.2
    beats = [line for line in findings(rungs) if "beats full" in line]
    assert beats == [
        "areal 0.5 s beats full 1.0 s, cutting short 99% of its attempts against full's 35%",
        "slime 0.6 s beats full 1.0 s",
    ]


def _tiny(reset_s: object) -> dict[str, Any]:
    """A workload small enough to run every rung of the family in a test."""
    return {
        "batches": 2,
        "batch": {"groups": 2, "group_size": 2},
        "policy": {"surplus_groups": 2, "max_staleness": 1},
        "engines": {"count": 2, "slots": 4, "update_s": 1.0},
        "cpus": {"total": 12, "serving": 4},
        "lanes": {"reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
        "trajectory": {"turns": {"uniform": [1, 3]}, "timeout_s": 60.0, "reset_s": reset_s},
    }


def test_run_family_on_a_small_cut_reports_every_rung(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.sim.family as family

    monkeypatch.setitem(family.FAMILY, "tiny", _tiny(reset_s=2.0))
    result = run_family(["tiny"])
    rungs = result["workloads"]["tiny"]["rungs"]
    assert set(rungs) == {"sync", "completion", "lanes", "full", *family.VARIANTS, *PEERS}
    assert all(row["lost_groups"] == 0 for row in rungs.values())
    assert rungs["full (partitioned lanes)"]["lane_sharing"] == "partitioned"
    assert rungs["full"]["lane_sharing"] == "work_conserving"
    assert rungs["full"]["lane_slots"] is not None  # full adapts its lanes
    assert rungs["full (fixed lanes)"]["lane_slots"] is None
    assert isinstance(result["workloads"]["tiny"]["findings"], list)
    # Rungs already known are taken as they are; the rest would run (here: none are missing).
    known = {"tiny": {rung: {**row, "mean_s": -1.0} for rung, row in rungs.items()}}
    again = run_family(["tiny"], known=known)
    assert all(row["mean_s"] == -1.0 for row in again["workloads"]["tiny"]["rungs"].values())
    # Trainable batches: a group whose rewards are all equal is discarded, so none is delivered (such
    # groups are common here, as the last line checks).
    trainable = run_family(["tiny"], peers=False, trainable=True)["workloads"]["tiny"]["rungs"]
    for rung, row in trainable.items():
        assert row["policy_config"]["filter_zero_variance"] is True, rung
        assert row["trainable_share"] == 1.0, rung
    assert any(row["trainable_share"] < 1.0 for row in rungs.values())
    assert all(row["policy_config"]["filter_zero_variance"] is False for row in rungs.values())


def test_bench_with_peers_reports_every_peer_beside_the_ladder_and_its_findings() -> None:
    from app.sim.bench import run_bench
    from app.sim.workload import Workload

    workload = Workload.model_validate(
        {
            "batches": 2,
            "batch": {"groups": 2, "group_size": 2},
            "policy": {"surplus_groups": 2, "max_staleness": 1},
            "engines": {"count": 2, "slots": 4, "update_s": 1.0},
            "cpus": {"total": 12, "serving": 4},
            "lanes": {"reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
            "trajectory": {"turns": {"uniform": [1, 3]}, "timeout_s": 60.0, "reset_s": 2.0},
        }
    )
    result = run_bench(workload, [0], [1], peers=True)
    assert set(result["policies"]) == {"sync", "completion", "lanes", "full", *PEERS}
    means = {name: {"mean_s": rep["batch_collection_s"]["mean"]} for name, rep in result["policies"].items()}
    assert result["findings"] == findings(means)
    assert "areal" not in run_bench(workload, [0], [1])["policies"]


def test_a_rung_that_delivered_no_batch_is_named_and_compared_with_none() -> None:
    """Its mean is null (it was 0.0, which beat every rung and put the ladder out of order)."""
    rungs = {**make_rungs(sync=3, completion=2, full=1), "areal": {"mean_s": None}}
    assert findings(rungs) == ["areal delivered no batch"]


def test_run_family_with_a_seed_runs_other_draws_and_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.sim.family as family

    monkeypatch.setitem(family.FAMILY, "tiny", _tiny(reset_s={"uniform": [1, 4]}))
    own = run_family(["tiny"], peers=False)
    again = run_family(["tiny"], peers=False, seed=0)
    other = run_family(["tiny"], peers=False, seed=5)
    assert "seed" not in own["specs"]["tiny"]
    assert other["specs"]["tiny"]["seed"] == 5

    def means(result: dict[str, Any]) -> dict[str, float]:
        return {rung: row["mean_s"] for rung, row in result["workloads"]["tiny"]["rungs"].items()}

    assert means(again) == means(own)  # the family's own seed is 0
    assert means(other) != means(own)
    # Drawn afresh (no draws kept), the same seed gives the same figures.
    family._DRAWS.clear()
    assert means(run_family(["tiny"], peers=False, seed=5)) == means(other)


def test_a_rung_that_cannot_fill_a_batch_is_a_row_that_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nearly every attempt dies of an infra error, so no group completes and the runtime gives up
    (RunCannotProceed): each rung is a row with no batch and the reason, the findings say so, and the
    benchmark goes on (it ended with a traceback before)."""
    import app.sim.family as family

    doomed = _tiny(reset_s=1.0)
    doomed["trajectory"] = {**doomed["trajectory"], "p_infra_error": 0.999}
    monkeypatch.setitem(family.FAMILY, "doomed", doomed)
    result = run_family(["doomed"], peers=False)
    rungs = result["workloads"]["doomed"]["rungs"]
    assert set(rungs) == {"sync", "completion", "lanes", "full", *family.VARIANTS}
    for row in rungs.values():
        assert row["mean_s"] is None
        assert "groups in a row" in row["stopped"]
        assert set(row) == {*family.SUMMARY_KEYS, "stopped"}
    assert rungs["full"]["policy_config"]["agent_gate"] == 1.0
    lines = result["workloads"]["doomed"]["findings"]
    assert any(line.startswith("full delivered no batch: ") for line in lines)


def test_a_row_has_the_same_fields_whether_or_not_its_run_stopped() -> None:
    from app.sim.family import SUMMARY_KEYS, simulated_row
    from app.sim.run import policy_for
    from app.sim.workload import Workload

    workload = Workload.model_validate(_tiny(reset_s=1.0))
    assert set(simulated_row(workload, policy_for(workload, "full"), "full")) == set(SUMMARY_KEYS)


def test_a_trainable_family_run_where_every_attempt_fails_ends_with_rows_that_say_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every attempt fails (the uncapped peers' attempts on `cpu-scarce` all run out of time), so no
    group has a learning signal: each rung, the uncapped peers included, stops at the driver's limit of
    such groups in a row and is a row that delivered no batch and says why, not a run that never ends."""
    import app.sim.family as family

    spec = _tiny(reset_s=2.0)
    spec["trajectory"] = {**spec["trajectory"], "p_success": 0.0}
    monkeypatch.setitem(family.FAMILY, "tiny", spec)
    result = run_family(["tiny"], trainable=True)["workloads"]["tiny"]
    rungs = result["rungs"]
    assert {"areal (no concurrency cap)", "skyrl (no concurrency cap)"} <= set(rungs)
    for rung, row in rungs.items():
        assert row["mean_s"] is None, rung
        assert "no learning signal" in row["stopped"], rung
    assert sum("delivered no batch" in line for line in result["findings"]) == len(rungs)
