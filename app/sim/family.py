"""The bench's workload family: built-in named workloads, each a stress the techniques must survive.

- `default`: the calibrated terminal-bench-style workload (`Workload()`). Its agent cap (420 s), task
  spread (0.3), reset and validate tails and engine slots were chosen so that `sync` lands at the
  write-up's 591.8 s; see docs/simulator.md.
- `design`: docs/design.md's terminal-bench-core figures taken as they are, with no calibration: setup
  median 7 s / p90 76 s (uncapped), agent cap 660 s, 18 turns median / 36 p90, tests 5 / 55 s capped at
  120 s, cleanup 13 / 17 s capped at 38 s, task log-sd 0.6, attempt log-sd 0.15 (within-group max/mean
  ≈ 1.24). docs/design.md gives no split of a turn into engine and tool time: engine time per turn is
  median 10 s / p90 20 s and tool time the default 2.5 / 10 s, so 18 turns make about the 270 s median
  agent phase. Resources are the default's; 8 batches.
- `cpu-scarce`: the held-out case: 32 sandbox cores for 384 live trajectories, resets that need half
  a core with a tail beyond an hour (median 20 s, p90 300 s, cap 5,400 s), and a static proportional
  split that gives the reset lane 4 cores for its 64 slots.
- `ample-cpu`: the default with 2,048 cores and 1,024 slots a lane: CPUs never limit anything; 8
  batches.
- `trace`: replays examples/tb-trace.jsonl (240 attempts of 40 tasks; synthetic, drawn to docs/design.md's
  quantiles with a few setups beyond an hour, see benchmarks/make_trace.py), 8 batches.

`builtin_workload(name)` builds one; `load_workload` accepts these names in place of a file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.core.config import PolicyConfig, PolicyName
from app.sim.workload import TrajectorySource, Workload

TRACE_PATH = Path(__file__).resolve().parents[2] / "examples" / "tb-trace.jsonl"


def _ln(median: float, p90: float, cap: float | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"median": median, "p90": p90}
    if cap is not None:
        spec["max"] = cap
    return {"lognormal": spec}


FAMILY: dict[str, dict[str, Any]] = {
    "default": {},
    "design": {
        "batches": 8,
        "trajectory": {
            "reset_s": _ln(7, 76),
            "turns": _ln(18, 36),
            "llm_s": _ln(10, 20),
            "tool_s": _ln(2.5, 10),
            "validate_s": _ln(5, 55, 120),
            "cleanup_s": _ln(13, 17, 38),
            "timeout_s": 660.0,
            "task_spread": 0.6,
            "attempt_spread": 0.15,
        },
    },
    "cpu-scarce": {
        "batches": 8,
        "batch": {"groups": 16, "group_size": 8},
        "policy": {"surplus_groups": 32, "max_staleness": 4},
        "engines": {"count": 4, "slots": 96},
        "cpus": {
            "total": 40,
            "serving": 8,
            "sandbox_demand": {"reset": 0.5, "exec": 1.0, "validate": 0.5, "cleanup": 0.5},
        },
        "lanes": {"reset": 64, "exec": 192, "validate": 16, "cleanup": 32},
        "trajectory": {"reset_s": _ln(20, 300, 5400)},
    },
    "ample-cpu": {
        "batches": 8,
        "cpus": {"total": 2048, "serving": 64},
        "lanes": {"reset": 1024, "exec": 1024, "validate": 1024, "cleanup": 1024},
    },
    "trace": {
        "batches": 8,
        "trajectory": {"timeout_s": 660.0},
        "trace": {"path": str(TRACE_PATH), "llm_fraction": 0.6},
    },
}


def builtin_workload(name: str, **overrides: Any) -> Workload:
    """The named workload of the family, with top-level sections merged from `overrides`."""
    if name not in FAMILY:
        raise KeyError(f"no built-in workload {name!r}; choose one of {', '.join(FAMILY)}")
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in FAMILY[name].items()}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return Workload.model_validate(data)


OnRun = Callable[[str, int, int], None]

LADDER_RUNGS = [PolicyName.SYNC, PolicyName.COMPLETION, PolicyName.LANES, PolicyName.FULL]


def _staleness_surplus(workload: Workload) -> dict[str, Any]:
    # The largest S that, in steady state, keeps admitted groups within K versions of the trainer
    # (AReaL's and SkyRL's admission bound): full on the same footing as those peer rungs.
    groups = workload.batch.groups
    return {"policy": {"surplus_groups": workload.policy.max_staleness * groups}}


def _same(workload: Workload) -> dict[str, Any]:
    return {}


# Variants of `full`: workload overrides, and policy overrides. `full` adapts its lanes; the fixed and
# partitioned variants keep the configured slots and shares, for comparison.
VARIANTS: dict[str, tuple[Callable[[Workload], dict[str, Any]], dict[str, Any]]] = {
    "full (fixed lanes)": (_same, {"adaptive_lanes": False}),
    "full (partitioned lanes)": (lambda w: {"lanes": {"sharing": "partitioned"}}, {"adaptive_lanes": False}),
    "full (S = K·B)": (_staleness_surplus, {}),
    # (B + S)·G caps the attempts in flight rather than B + S the groups: the same sandboxes and engine
    # slots, more groups in flight (a group's finished attempts make room for the next group)
    "full (attempt admission)": (_same, {"admission": "attempts"}),
    # The real runtime's `lanes.borrow_serving_cpus`: lanes also run on the serving cores serving leaves
    # idle (off by default, as in the runtime: the hard boundary is the design).
    "full (borrowing serving CPUs)": (lambda w: {"lanes": {"borrow_serving_cpus": True}}, {}),
    "full (S = K·B, borrowing serving CPUs)": (
        lambda w: {**_staleness_surplus(w), "lanes": {"borrow_serving_cpus": True}},
        {},
    ),
}


def run_family(
    names: Sequence[str] | None = None,
    peers: bool = True,
    on_run: OnRun | None = None,
    processes: int = 1,
    known: Mapping[str, Mapping[str, Any]] | None = None,
    trainable: bool = False,
    seed: int | None = None,
) -> dict[str, Any]:
    """Every rung (the ladder, the variants of `full`, and the peers) on every named workload, each
    workload's rungs on the same seeded draws. Returns per-workload summaries and the checks.

    A rung whose workload and policy equal an earlier rung's is not simulated again (`skyrl` and
    `areal` are the same policy). With `processes` > 1 the simulations run in that many processes;
    every simulation is seeded, so the results do not depend on it. `known` holds rungs already
    simulated (workload name → rung name → summary, as returned before); they are not run again.
    With `trainable`, every rung discards a group whose rewards are all equal (`filter_zero_variance`:
    it has no learning signal), so the times are to batches of trainable groups. A rung whose groups
    all lack a signal (the uncapped peers on `cpu-scarce`, whose attempts all run out of time) stops
    once the driver's limit of such groups in a row is reached, and is a row that delivered no batch
    and says why. `seed` replaces each workload's own seed (0): other
    draws of the same workloads, to see whether a result holds beyond one draw."""
    from app.sim.peers import PEERS

    chosen = list(names or FAMILY)
    plan: list[tuple[str, str]] = []
    for name in chosen:
        plan += [(name, rung.value) for rung in LADDER_RUNGS]
        plan += [(name, variant) for variant in VARIANTS]
        if peers:
            plan += [(name, f"peer:{peer}") for peer in PEERS]
    keys = {task: _key(*task, trainable, seed) for task in plan}
    summaries: dict[str, dict[str, Any]] = {}
    for (name, rung), key in keys.items():
        found = (known or {}).get(name, {}).get(rung.removeprefix("peer:"))
        if found is not None:
            summaries[key] = dict(found)
    unique: dict[str, tuple[str, str]] = {}
    for task in plan:
        if keys[task] not in summaries:
            unique.setdefault(keys[task], task)
    todo = [(key, (*task, trainable, seed)) for key, task in unique.items()]
    if processes > 1:
        from app.children import map_in_workers

        def finished(key: str, done: int, total: int) -> None:
            if on_run is not None:
                on_run(" ".join(unique[key]), done, total)

        summaries.update(map_in_workers(_simulate_rung, todo, processes, finished))
    else:
        for done, (key, args) in enumerate(todo):
            if on_run is not None:
                on_run(" ".join(unique[key]), done, len(todo))
            summaries[key] = _simulate_rung(*args)
    if on_run is not None:
        on_run("done", len(todo), len(todo))
    results: dict[str, Any] = {name: {"rungs": {}} for name in chosen}
    for task in plan:
        name, rung = task
        results[name]["rungs"][rung.removeprefix("peer:")] = summaries[keys[task]]
    for name in chosen:
        results[name]["findings"] = findings(results[name]["rungs"])
    specs = {n: FAMILY[n] if seed is None else {**FAMILY[n], "seed": seed} for n in chosen}
    return {"workloads": results, "specs": specs}


def _seeded(name: str, seed: int | None, **overrides: Any) -> Workload:
    """`builtin_workload(name, **overrides)`, with `seed` in place of its own when one is given."""
    return builtin_workload(name, **overrides, **({} if seed is None else {"seed": seed}))


def _workload_and_policy(
    name: str, rung: str, trainable: bool = False, seed: int | None = None
) -> tuple[Workload, PolicyConfig]:
    workload, policy = _rung_as_configured(name, rung, seed)
    return workload, policy.with_changes(filter_zero_variance=True) if trainable else policy


def _rung_as_configured(name: str, rung: str, seed: int | None = None) -> tuple[Workload, PolicyConfig]:
    from app.sim.peers import peer_policy
    from app.sim.run import policy_for

    if rung in VARIANTS:
        overrides, policy = VARIANTS[rung]
        workload = _seeded(name, seed, **overrides(_seeded(name, seed)))
        return workload, policy_for(workload, "full", **policy)
    workload = _seeded(name, seed)
    if rung.startswith("peer:"):
        return workload, peer_policy(workload, rung.removeprefix("peer:"))
    return workload, policy_for(workload, rung)


def _key(name: str, rung: str, trainable: bool = False, seed: int | None = None) -> str:
    workload, policy = _workload_and_policy(name, rung, trainable, seed)
    return workload.model_dump_json() + policy.model_dump_json()


_DRAWS: dict[str, TrajectorySource] = {}  # by the drawn workload's JSON


def _simulate_rung(name: str, rung: str, trainable: bool = False, seed: int | None = None) -> dict[str, Any]:
    workload, policy = _workload_and_policy(name, rung, trainable, seed)
    # One workload's rungs share their draws (lane settings do not change what is drawn), kept by the
    # workload drawn from, so another seed, or another workload under the same name, draws its own.
    drawn = _seeded(name, seed)
    source = _DRAWS.get(key := drawn.model_dump_json())
    if source is None:
        source = _DRAWS[key] = TrajectorySource(drawn)
    return simulated_row(workload, policy, rung, source)


def simulated_row(
    workload: Workload, policy: PolicyConfig, rung: str, trajectories: TrajectorySource | None = None
) -> dict[str, Any]:
    """One rung simulated and summarised (`summarise`). A run that stopped because it could not fill a
    batch (`RunCannotProceed`: every group failed, or, for trainable batches, none had a learning
    signal) is a row that delivered no batch and says why (`stopped`), not an error that ends a whole
    benchmark with a traceback."""
    from app.sim.run import simulate_unless_stopped

    report = simulate_unless_stopped(workload, policy, rung, trajectories)
    if not isinstance(report, dict):
        row: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)
        row.update(policy_config=policy.model_dump(mode="json"), stopped=str(report))
        return row
    return summarise(report)


SUMMARY_KEYS = (
    "mean_s",
    "p90_s",
    "lower_bound_s",
    "lower_bound_given_admissions_s",
    "stale_groups",
    "restarted_trajectories",
    "wasted_trajectory_s",
    "lost_groups",
    "mean_reward",
    "attempts_cut_short",
    "attempts_cut_short_share",
    "trainable_share",
    "reset_lane",
    "lane_sharing",
    "lane_slots",
    "agent_gate",
    "policy_config",
    "wall_s",
)


def summarise(report: dict[str, Any]) -> dict[str, Any]:
    lanes = report.get("lanes", {})
    return {
        "mean_s": report["batch_collection_s"]["mean"],
        "p90_s": report["batch_collection_s"]["p90"],
        "lower_bound_s": report["lower_bound_s"],
        "lower_bound_given_admissions_s": report.get("lower_bound_given_admissions_s"),
        "stale_groups": report["discarded_groups"]["stale"],
        "restarted_trajectories": report["restarted_trajectories"],
        "wasted_trajectory_s": round(sum(report["wasted_trajectory_s"].values()), 1),
        "lost_groups": report["lost_groups"],
        "mean_reward": report["mean_reward"],
        "attempts_cut_short": report.get("attempts_cut_short"),
        "attempts_cut_short_share": cut_short_share(report),
        "trainable_share": trainable_share(report),
        "reset_lane": {
            "max_queue": lanes.get("reset", {}).get("max_queue_depth"),
            "mean_wait_s": lanes.get("reset", {}).get("wait_s_mean"),
            "long_resets_left": report.get("lane_long_resets"),
        },
        "lane_sharing": report.get("lane_sharing"),
        "lane_slots": report.get("lane_slots"),
        "agent_gate": report.get("agent_gate"),
        "policy_config": report.get("policy_config"),
        "wall_s": report["wall_s"],
    }


def cut_short_share(report: Mapping[str, Any]) -> float | None:
    """The share of a simulated run's attempts that ran out of their agent time before the turns an
    idle machine finishes in it (the simulator fails them); None for a report without the counts."""
    played = report.get("attempts_played")
    if not played:
        return None
    return round(int(report["attempts_cut_short"]) / int(played), 4)


def trainable_share(report: Mapping[str, Any]) -> float | None:
    """The share of the delivered groups with a learning signal: rewards not all equal (GRPO's
    advantages are all zero otherwise); None when none was delivered or the report has no count."""
    delivered, flat = report.get("delivered_groups"), report.get("delivered_zero_variance_groups")
    if not delivered or flat is None:
        return None
    return round(1 - int(flat) / int(delivered), 4)


# A rung whose attempts were cut short this often delivers batches of failures: said beside its time.
CUT_SHORT_FINDING = 0.25


# A share of attempts cut short (absolute) that one run may exceed another's by and still count as cutting
# no more: the bench's findings and `corral advise` (which does not advise settings past it) both use it.
CUT_SHORT_SLACK = 0.05


def cuts_more(share: float | None, than: float | None) -> bool:
    """Whether a run that cut short `share` of its attempts cut short more than one at `than`, past
    `CUT_SHORT_SLACK` (False when either is unknown)."""
    return share is not None and than is not None and share > than + CUT_SHORT_SLACK


def _cut_more(rungs: Mapping[str, Mapping[str, Any]], name: str) -> str:
    """A clause for a rung that beats `full`'s time while it cut short more of its attempts than `full`
    did (`cuts_more`): part of its speed is failures delivered sooner. Empty otherwise."""
    share, full = rungs[name].get("attempts_cut_short_share"), rungs["full"].get("attempts_cut_short_share")
    if not cuts_more(share, full):
        return ""
    return f", cutting short {share:.0%} of its attempts against full's {full:.0%}"


def findings(rungs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Where a ladder rung is worse than the rung below it (sync → completion → lanes → full; and
    `full` ≤ `completion` ≤ `sync` must hold), and where any other rung beats `full`, one line each; a
    rung that delivered no batch (its mean null) is named as such and compared with none."""
    out = [
        f"{name} delivered no batch" + (f": {row['stopped']}" if row.get("stopped") else "")
        for name, row in rungs.items()
        if row["mean_s"] is None
    ]
    mean = {name: row["mean_s"] for name, row in rungs.items() if row["mean_s"] is not None}
    pairs = [("completion", "sync"), ("lanes", "completion"), ("full", "lanes"), ("full", "completion")]
    for better, worse in pairs:
        if better in mean and worse in mean and mean[better] > mean[worse]:
            must = " (full ≤ completion ≤ sync must hold)" if "lanes" not in (better, worse) else ""
            out.append(
                f"LADDER OUT OF ORDER: {better} {mean[better]:.1f} s is worse than "
                f"{worse} {mean[worse]:.1f} s{must}"
            )
    if "full" in mean:
        for name, value in mean.items():
            if name not in ("full", "lanes", "completion", "sync") and value < mean["full"]:
                out.append(f"{name} {value:.1f} s beats full {mean['full']:.1f} s{_cut_more(rungs, name)}")
    for name, row in rungs.items():
        share = row.get("attempts_cut_short_share")
        if share is not None and share >= CUT_SHORT_FINDING:
            out.append(
                f"{name}: {share:.0%} of its attempts ran out of time before the turns an idle machine "
                f"finishes in it and failed (mean reward {row['mean_reward']:.3f}): fast batches of failures"
            )
    return out
