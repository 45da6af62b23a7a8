"""Does the simulator predict the real runs? The real pairs' own attempts, replayed at their own config.

    python -m benchmarks.sim_vs_real [--runs docs/runs/stop45] [--seeds 6] [--json OUT]

`benchmarks.real_pairs` ran `full` and `sync` back to back on this machine (RUNS/pairI-POLICY.json).
This reads every finished or cut-short attempt of those reports into one trace (`corral trace import --format
corral-run`, the reports' attempts added together, RUNS/sim-vs-real-trace.jsonl), builds a workload that
replays it at the runs' own settings, read from the `full` reports (B, G, S, K, batches, engines and
their weight-load time, the trainer step between a delivery and the next request, lane slots, serving
and lane CPUs), with its groups picking tasks as often as the runs did (`trace.tasks: as_recorded`),
and simulates `sync` and `full` on it over `--seeds` draws. It prints each rung's simulated mean batch
collection time per seed, the median ratio sync / full, and the real pairs' figures beside them.

The recorded times already hold the real runs' CPU contention, so the workload must not add it again:
each engine's serving demand is the serving cores shared among the engines (all of them busy fill the
serving cores exactly), and each sandbox operation's demand is what the real lanes measured
(`lane_op_demand_cores`). A second block replays the same trace with the simulator's default CPU
demands (2 cores a busy engine, up to 1 core a sandbox operation), which count that contention twice.
The simulator needs at least 4 sandbox cores; this machine's lanes have 2, which at the measured
demand (about 0.05 cores an operation) changes nothing.

A third block replays each rung on its own runs' attempts only (RUNS/sim-vs-real-trace-POLICY.jsonl).
A `full` run ends with its slowest groups still running, so its attempts cut short are in its traces as
`censored` lines, which a replay stands in for with finished attempts of their task that took at least
as long: without them `full`'s own trace lacked its slowest work (3.5 s predicted against 28.6 s real).

What a trace cannot carry: each policy's own contention. The runs' mean model-turn latency is printed
per policy: under `sync`, sandboxes share the CPUs with the engines, and the CPU-bound set-ups and tool
calls starved the turns; under `full`, lanes kept them off the serving core, and the CPU-bound tool
calls ran slower instead. The pooled trace holds both kinds of attempt for every rung. It asserts
nothing and exits 0; the figures are the output.
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from app.sim.run import policy_for, simulate
from app.sim.traces import import_corral_run, write_trace
from app.sim.workload import Workload, WorkloadError
from app.validation import int_between

POLICIES = ("sync", "full")


def reports(runs: Path) -> list[Path]:
    found = sorted(runs.glob("pair*-*.json"))
    if not found:
        raise SystemExit(f"error: no pairI-POLICY.json reports in {runs}; run benchmarks.real_pairs first")
    return found


def trace_of(found: list[Path], out: Path) -> int:
    """Every finished attempt of `found`, as one trace at `out`; how many attempts it holds."""
    records = []
    for path in found:
        try:
            records.extend(import_corral_run(path).records)
        except WorkloadError as exc:
            raise SystemExit(f"error: {exc}") from None
    return write_trace(records, out)


def _median(values: list[float], what: str) -> float:
    if not values:
        raise SystemExit(f"error: the full reports record no {what}")
    return statistics.median(values)


def settings(full_reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The workload fields the real `full` runs ran with, as their reports record them."""
    first = full_reports[0]
    policy = first["policy_config"]
    steps, loads = [], []
    for report in full_reports:
        marks = report["batch_marks"]
        steps += [b["requested_s"] - a["delivered_s"] for a, b in itertools.pairwise(marks)]
        begun: dict[tuple[str, int], float] = {}
        for entry in report["update_log"]:
            key = (entry["engine"], entry["version"])
            if entry["phase"] == "begin":
                begun[key] = entry["t"]
            elif entry["phase"] == "end" and key in begun:
                loads.append(entry["t"] - begun.pop(key))
    engines = len(first["engines"])
    serving = len(first["cpus"]["serving"])
    in_flight = (policy["groups_per_batch"] + policy["surplus_groups"]) * policy["group_size"]
    return {
        "trace": {"tasks": "as_recorded"},
        "batches": int(first["batches"]),
        "batch": {"groups": policy["groups_per_batch"], "group_size": policy["group_size"]},
        "policy": {
            "surplus_groups": policy["surplus_groups"],
            "max_staleness": policy["max_staleness"],
            "max_updating_engines": policy["max_updating_engines"],
        },
        "trainer": {"step_s": round(_median(steps, "trainer steps"), 3)},
        # every attempt may have a turn in flight: the real runs waited next to nothing for a slot
        "engines": {
            "count": engines,
            "slots": in_flight,
            "update_s": round(_median(loads, "weight loads"), 3),
        },
        "cpus": {
            "total": serving + 4,
            "serving": serving,
            "engine_demand": serving / engines,
            "sandbox_demand": _median([r["lane_op_demand_cores"] for r in full_reports], "lane demand"),
        },
        "lanes": {
            **{lane: slots["configured"] for lane, slots in first["lane_slots"].items()},
            "borrow_serving_cpus": bool(first["cpus"]["lanes_borrow_serving"]),
        },
    }


def _turn_latency(loaded: dict[Path, dict[str, Any]], policy: str) -> float:
    """The median over `policy`'s runs of their mean model-turn latency."""
    means = [r["turn_latency_s"]["mean"] for p, r in loaded.items() if p.stem.endswith(f"-{policy}")]
    return round(float(statistics.median(means)), 3)


def simulate_rungs(fields: dict[str, Any], traces: dict[str, Path], seeds: int) -> dict[str, Any]:
    """Each rung on its trace (policy → trace), over `seeds` draws."""
    means: dict[str, list[float]] = {policy: [] for policy in POLICIES}
    for seed in range(seeds):
        for policy in POLICIES:
            trace_spec = {**fields["trace"], "path": str(traces[policy])}
            workload = Workload.model_validate({**fields, "seed": seed, "trace": trace_spec})
            report = simulate(workload, policy_for(workload, policy), policy)
            means[policy].append(round(report["batch_collection_s"]["mean"], 3))
        print(f"  seed {seed}: sync {means['sync'][-1]:.1f} s, full {means['full'][-1]:.1f} s", flush=True)
    ratios = [s / f for s, f in zip(means["sync"], means["full"], strict=True)]
    return {
        "mean_s": means,
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 3),
    }


def main() -> None:
    from benchmarks import ScriptParser, check_outputs, save_json  # as a script (-m), importable

    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=Path, default=Path("docs/runs/stop45"), help="benchmarks.real_pairs' OUT"
    )
    parser.add_argument("--seeds", type=int_between(1, 100), default=6, help="draws of each rung")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    trace = args.runs / "sim-vs-real-trace.jsonl"
    own = {policy: args.runs / f"sim-vs-real-trace-{policy}.jsonl" for policy in POLICIES}
    check_outputs(json=args.json, trace=trace, **{f"trace_{p}": path for p, path in own.items()})
    found = reports(args.runs)
    loaded = {p: json.loads(p.read_text()) for p in found}
    full = [report for p, report in loaded.items() if p.stem.endswith("-full")]
    if not full:
        raise SystemExit(f"error: no pairI-full.json report in {args.runs}")
    attempts = trace_of(found, trace)
    for policy, path in own.items():
        trace_of([p for p in found if p.stem.endswith(f"-{policy}")], path)
    print(f"{attempts} attempts from {len(found)} reports → {trace}")
    fields = settings(full)
    print("workload:", json.dumps(fields))
    real = json.loads((args.runs / "pairs.json").read_text())
    real_ratios = [
        p["sync"]["mean_s"] / p["full"]["mean_s"] for p in real["pairs"] if "sync" in p and "full" in p
    ]
    out: dict[str, Any] = {"runs": str(args.runs), "attempts": attempts, "workload": fields}
    print("the runs' own CPU demands (the recorded times hold their contention):")
    pooled = dict.fromkeys(POLICIES, trace)
    out["measured_demands"] = simulate_rungs(fields, pooled, args.seeds)
    defaults = {**fields, "cpus": {k: v for k, v in fields["cpus"].items() if k in ("total", "serving")}}
    print("the simulator's default CPU demands (that contention counted twice):")
    out["default_demands"] = simulate_rungs(defaults, pooled, args.seeds)
    print("each rung on its own runs' attempts, the runs' own CPU demands:")
    out["own_attempts"] = simulate_rungs(fields, own, args.seeds)
    latency = {policy: _turn_latency(loaded, policy) for policy in POLICIES}
    out["real"] = {
        "turn_latency_s_mean": latency,
        "full_mean_s": [p["full"]["mean_s"] for p in real["pairs"]],
        "sync_mean_s": [p["sync"]["mean_s"] for p in real["pairs"]],
        "ratios": [round(r, 3) for r in real_ratios],
        "median_ratio": round(statistics.median(real_ratios), 3),
    }
    print()
    print(f"{'':34} {'sync / full, median':>20}   {'full mean s, median':>20}   {'sync mean s, median':>20}")
    rows = [
        ("simulated, measured CPU demands", out["measured_demands"]),
        ("simulated, default CPU demands", out["default_demands"]),
        ("simulated, each on its own attempts", out["own_attempts"]),
        ("real pairs", {"median_ratio": out["real"]["median_ratio"],
                        "mean_s": {"full": out["real"]["full_mean_s"], "sync": out["real"]["sync_mean_s"]}}),
    ]  # fmt: skip
    for label, block in rows:
        full_s, sync_s = (statistics.median(block["mean_s"][policy]) for policy in ("full", "sync"))
        print(f"{label:34} {block['median_ratio']:>20.2f}   {full_s:>20.1f}   {sync_s:>20.1f}")
    print(f"real mean model-turn latency (median of the runs): sync {latency['sync']:.2f} s, "
          f"full {latency['full']:.2f} s")  # fmt: skip
    if args.json is not None:
        save_json(args.json, out)
        print(f"→ {args.json}")


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
