"""The ablation ladder and the S and K sweeps, all on the same seeded trajectory draws."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from app.sim.family import findings
from app.sim.peers import PEERS, peer_policy
from app.sim.run import LADDER, policy_for, simulate
from app.sim.workload import TrajectorySource, Workload

OnRun = Callable[[str, int, int], None]


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "batch_collection_s": report["batch_collection_s"]["mean"],
        "p90_s": report["batch_collection_s"]["p90"],
        "lower_bound_s": report["lower_bound_s"],
        "trainer_idle_fraction": report["trainer_idle_fraction"],
        "max_staleness_delivered": report["max_staleness"],
        "discarded_groups": report["discarded_groups"],
        "max_groups_in_flight": report["max_groups_in_flight"],
        "wasted_trajectory_s": report["wasted_trajectory_s"],
    }


def run_bench(
    workload: Workload,
    surplus_values: Sequence[int],
    staleness_values: Sequence[int],
    on_run: OnRun | None = None,
    peers: bool = False,
) -> dict[str, Any]:
    """The ladder, the S and K sweeps and the ablations; with `peers`, the peer rungs of
    app.sim.peers too (reported beside the ladder under `policies`). `findings` lists, one line each,
    where the ladder is out of order and where any rung beats `full`."""
    draws = TrajectorySource(workload)
    plan: list[tuple[str, str, dict[str, Any]]] = [(p.value, p.value, {}) for p in LADDER]
    plan += [(f"S={s}", "full", {"surplus_groups": s}) for s in surplus_values]
    # K matters only where groups live long enough to go stale, so compare it at the default S and at
    # the largest S of the sweep.
    k_surplus = sorted({workload.policy.surplus_groups, max(surplus_values, default=0)})
    plan += [
        (f"K={k},S={s}", "full", {"max_staleness": k, "surplus_groups": s})
        for s in k_surplus
        for k in staleness_values
    ]
    plan += [
        ("full without lanes", "full", {"pinned_lanes": False}),
        ("full without rolling", "full", {"rolling_updates": False}),
        ("full without completion order", "full", {"completion_order": False}),
    ]
    if peers:
        plan += [(peer, f"peer:{peer}", {}) for peer in PEERS]
    policies: dict[str, Any] = {}
    surplus: list[dict[str, Any]] = []
    staleness: list[dict[str, Any]] = []
    ablations: dict[str, Any] = {}
    for i, (label, rung, overrides) in enumerate(plan):
        if on_run is not None:
            on_run(label, i, len(plan))
        switches = {
            k: overrides.pop(k)
            for k in ("pinned_lanes", "rolling_updates", "completion_order")
            if k in overrides
        }
        if rung.startswith("peer:"):
            policy = peer_policy(workload, label)
        else:
            policy = policy_for(workload, rung, **overrides)
        if switches:
            policy = policy.with_changes(**switches)
        report = simulate(workload, policy, label, trajectories=draws)
        if label in {p.value for p in LADDER} or rung.startswith("peer:"):
            policies[label] = report
        elif label.startswith("S="):
            surplus.append({"surplus_groups": policy.surplus_groups, **_summary(report)})
        elif label.startswith("K="):
            staleness.append(
                {
                    "max_staleness": policy.max_staleness,
                    "surplus_groups": policy.surplus_groups,
                    **_summary(report),
                }
            )
        else:
            ablations[label] = _summary(report)
    if on_run is not None:
        on_run("done", len(plan), len(plan))
    means = {name: {"mean_s": rep["batch_collection_s"]["mean"]} for name, rep in policies.items()}
    return {
        "workload": workload.model_dump(mode="json", by_alias=True),
        "policies": policies,
        "findings": findings(means),
        "sweeps": {"surplus": surplus, "max_staleness": staleness, "ablations": ablations},
    }
