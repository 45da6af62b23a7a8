"""Random workloads × the ladder and the peers: does `full` win on configurations nobody tuned it for?

The workload family (benchmarks/family.py) is five hand-made workloads. Users bring their own traces,
CPU budgets, lane slots and staleness bounds, so this draws `--count` workloads at random from wide
ranges (below) and runs on each, on the same seeded draws: the ladder (sync, completion, lanes, full),
`full` with its serving set sized to its engines' CPU demand (the same cores in all; what `corral
advise` tries), `full` with lanes that also run on the serving cores serving leaves idle
(`lanes.borrow_serving_cpus`), `full` with attempts admission ((B + S)·G attempts in flight rather
than B + S groups), and the equal-resource peer rungs of docs/peers.md (areal, which
`skyrl` equals in the simulator, prime-rl, pipelinerl, slime). It prints one line per workload,
every place where the ladder is out of order or another rung beats `full` (`!!!`), and a summary: in
how many workloads `full` is best, and the median and worst ratio of `full` to the best other rung
(the ladder and the peers), for `full` as configured and for each variant. Exit code 0 either way:
the findings are results, not failures.

What a workload draws (`random_workload`; seeded by `--seed` and the workload's index):
- B in {8, 16, 32}, G in {4, 8}, S = B × {0.5, 1, 2, 3}, K in {1, 2, 4, 6}, 8 batches;
- 2, 4 or 8 engines with slots for 0.3–1.2 × the live trajectories (B + S)·G, an engine demand of 1
  or 2 cores, and serving cores of 0.5–2 × the engines' demand (so about a third of the workloads give
  serving fewer cores than its engines use: an under-provisioned serving set);
- sandbox cores of 0.05–2 per live trajectory (log-uniform: from very scarce to ample), per-operation
  demand per lane drawn from {0.25, 0.5, 1};
- lane slots of 5–50% (reset), 10–50% (exec), 2–20% (validate, cleanup) of the live trajectories;
- per trajectory: reset median 2–30 s (log-uniform) with p90 2–15 × the median and a cap of 300, 1,800
  or 5,400 s; 4, 10, 18 or 30 turns median (p90 twice that); engine time 2–12 s (p90 twice that,
  capped at 600 s) and tool time 0.5–10 s (p90 2–5 ×, capped at 1,800 s) per turn; validation median
  2–20 s, p90 20–80 s, capped at 300 s; cleanup median 2–15 s, p90 16–40 s, capped at 300 s; an agent
  cap of 1.5–4 × the median agent phase; task log-sd 0.1–0.7, attempt log-sd 0.05–0.3;
- trainer step 2–30 s, weight load 1–20 s.

Run: `.venv/bin/python -m benchmarks.random_workloads --count 24 --processes 2 --json OUT.json
[--plot OUT.png] [--seed 0] [--batches 8] [--no-peers]`.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.core.config import PolicyName
from app.sim.family import LADDER_RUNGS, findings, simulated_row
from app.sim.workload import TrajectorySource, Workload
from benchmarks import seconds_cell

# `skyrl` is the same policy as `areal` in the simulator (app/sim/peers.py); the uncapped rows use
# more sandboxes than the workload's S allows, so they are left out of an equal-resource comparison.
PEER_RUNGS = ["areal", "prime-rl", "pipelinerl", "slime"]
# `full` with the serving/sandbox boundary moved to the engines' CPU demand (the same cores in all):
# what an operator who sizes the serving set to its engines runs, and what `corral advise` tries.
SIZED = "full (serving = engine demand)"


# `full` with lanes that also run on the serving cores serving leaves idle (`lanes.borrow_serving_cpus`).
BORROWING = "full (borrowing serving CPUs)"
# `full` with attempts admission: (B + S)·G caps the attempts in flight rather than B + S the groups.
ATTEMPTS = "full (attempt admission)"


def borrowing(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "lanes": {**spec["lanes"], "borrow_serving_cpus": True}}


def sized_serving(spec: dict[str, Any]) -> dict[str, Any]:
    """`spec` with `cpus.serving` set to the engines' CPU demand, leaving the 4 lanes a core each."""
    cpus = spec["cpus"]
    demand = math.ceil(spec["engines"]["count"] * cpus["engine_demand"])
    return {**spec, "cpus": {**cpus, "serving": max(1, min(demand, cpus["total"] - 4))}}


def _lognormal(median: float, p90: float, cap: float | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"median": round(median, 3), "p90": round(p90, 3)}
    if cap is not None:
        spec["max"] = cap
    return {"lognormal": spec}


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def random_workload(index: int, seed: int = 0, batches: int = 8) -> dict[str, Any]:
    """Workload `index` of the random family `seed`, as a workload document (see the module's doc)."""
    rng = random.Random(f"corral-random-workload/{seed}/{index}")
    groups = rng.choice([8, 16, 32])
    size = rng.choice([4, 8])
    surplus = max(1, round(groups * rng.choice([0.5, 1, 2, 3])))
    live = (groups + surplus) * size
    engines = rng.choice([2, 4, 8])
    engine_demand = rng.choice([1.0, 2.0])
    serving = max(1, round(engines * engine_demand * rng.uniform(0.5, 2.0)))
    sandbox = max(4, round(live * _log_uniform(rng, 0.05, 2.0)))
    turns = rng.choice([4, 10, 18, 30])
    llm_s, tool_s = rng.uniform(2, 12), rng.uniform(0.5, 10)
    reset_s = _log_uniform(rng, 2, 30)
    return {
        "seed": index,
        "batches": batches,
        "batch": {"groups": groups, "group_size": size},
        "trainer": {"step_s": round(rng.uniform(2, 30), 1)},
        "policy": {"surplus_groups": surplus, "max_staleness": rng.choice([1, 2, 4, 6])},
        "engines": {
            "count": engines,
            "slots": max(1, math.ceil(live * rng.uniform(0.3, 1.2) / engines)),
            "update_s": round(rng.uniform(1, 20), 1),
        },
        "cpus": {
            "total": sandbox + serving,
            "serving": serving,
            "engine_demand": engine_demand,
            "sandbox_demand": {
                "reset": rng.choice([0.25, 0.5, 1.0]),
                "exec": rng.choice([0.5, 1.0]),
                "validate": rng.choice([0.25, 0.5, 1.0]),
                "cleanup": rng.choice([0.25, 0.5]),
            },
        },
        "lanes": {
            "reset": max(1, round(live * rng.uniform(0.05, 0.5))),
            "exec": max(1, round(live * rng.uniform(0.1, 0.5))),
            "validate": max(1, round(live * rng.uniform(0.02, 0.2))),
            "cleanup": max(1, round(live * rng.uniform(0.02, 0.2))),
        },
        "trajectory": {
            "reset_s": _lognormal(reset_s, reset_s * rng.uniform(2, 15), rng.choice([300, 1800, 5400])),
            "turns": _lognormal(turns, 2 * turns),
            "llm_s": _lognormal(llm_s, 2 * llm_s, 600),
            "tool_s": _lognormal(tool_s, tool_s * rng.uniform(2, 5), 1800),
            "validate_s": _lognormal(rng.uniform(2, 20), rng.uniform(20, 80), 300),
            "cleanup_s": _lognormal(rng.uniform(2, 15), rng.uniform(16, 40), 300),
            "timeout_s": round(turns * (llm_s + tool_s) * rng.uniform(1.5, 4), 1),
            "task_spread": round(rng.uniform(0.1, 0.7), 2),
            "attempt_spread": round(rng.uniform(0.05, 0.3), 2),
        },
    }


def features(spec: dict[str, Any]) -> dict[str, Any]:
    """What sets a workload apart, for reading the findings: serving cores against the engines' demand,
    sandbox cores per live trajectory, K, and the smallest lane's slots per live trajectory."""
    live = (spec["batch"]["groups"] + spec["policy"]["surplus_groups"]) * spec["batch"]["group_size"]
    cpus = spec["cpus"]
    return {
        "live_trajectories": live,
        "serving_over_engine_demand": round(
            cpus["serving"] / (spec["engines"]["count"] * cpus["engine_demand"]), 2
        ),
        "sandbox_cores_per_trajectory": round((cpus["total"] - cpus["serving"]) / live, 3),
        "max_staleness": spec["policy"]["max_staleness"],
        "smallest_lane_per_trajectory": round(min(spec["lanes"].values()) / live, 3),
    }


def _simulate(seed: int, index: int, batches: int, rung: str) -> dict[str, Any]:
    from app.sim.peers import peer_policy
    from app.sim.run import policy_for

    spec = random_workload(index, seed, batches)
    draws = TrajectorySource(Workload.model_validate(spec))  # the serving split draws nothing
    variant = {SIZED: sized_serving, BORROWING: borrowing}.get(rung)
    workload = Workload.model_validate(variant(spec) if variant else spec)
    if rung in PEER_RUNGS:
        policy = peer_policy(workload, rung)
    elif rung == ATTEMPTS:
        policy = policy_for(workload, PolicyName.FULL.value, admission="attempts")
    else:
        policy = policy_for(workload, PolicyName.FULL.value if variant else rung)
    return simulated_row(workload, policy, rung, draws)


Progress = Callable[[str, int, int], None]


def run(
    count: int,
    seed: int = 0,
    peers: bool = True,
    processes: int = 1,
    on_run: Progress | None = None,
    batches: int = 8,
) -> dict[str, Any]:
    """Every rung on `count` random workloads; per workload its spec, features, rungs and findings, and
    a summary over all of them."""
    rungs = [rung.value for rung in LADDER_RUNGS] + [SIZED, BORROWING, ATTEMPTS]
    rungs += PEER_RUNGS if peers else []
    plan = [(index, rung) for index in range(count) for rung in rungs]
    results: dict[tuple[int, str], dict[str, Any]] = {}
    if processes > 1:
        from app.children import map_in_workers

        def finished(task: tuple[int, str], done: int, total: int) -> None:
            if on_run is not None:
                on_run(f"r{task[0]} {task[1]}", done, total)

        tasks = [((index, rung), (seed, index, batches, rung)) for index, rung in plan]
        results = map_in_workers(_simulate, tasks, processes, finished)
    else:
        for done, (index, rung) in enumerate(plan):
            results[(index, rung)] = _simulate(seed, index, batches, rung)
            if on_run is not None:
                on_run(f"r{index} {rung}", done + 1, len(plan))
    workloads: dict[str, Any] = {}
    for index in range(count):
        spec = random_workload(index, seed, batches)
        by_rung = {rung: results[(index, rung)] for rung in rungs}
        workloads[f"r{index}"] = {
            "spec": spec,
            "features": features(spec),
            "rungs": by_rung,
            "findings": findings(by_rung),
        }
    return {
        "seed": seed,
        "batches": batches,
        "rungs": rungs,
        "workloads": workloads,
        "summary": summary(workloads),
    }


def summary(workloads: dict[str, Any]) -> dict[str, Any]:
    """How `full` fares: workloads where it is best, where the ladder holds, and its ratio to the best
    other rung (above 1: another rung is faster) and to `sync`. The other rungs are the ladder and the
    peers; each variant of `full` (sized serving, borrowing serving CPUs, attempts admission) is compared
    with them on its own, under its name."""
    to_best: dict[str, float] = {}
    variants: dict[str, dict[str, float]] = {}
    to_sync: dict[str, float] = {}
    ladder_holds = 0
    no_batch: dict[str, list[str]] = {}
    for name, data in workloads.items():
        mean = {rung: row["mean_s"] for rung, row in data["rungs"].items()}
        if missing := [rung for rung, m in mean.items() if m is None]:
            # No mean to compare: the workload is named with its rungs that delivered nothing, and
            # left out of the ratios (a null mean in a division was a traceback).
            no_batch[name] = missing
            continue
        others = [m for rung, m in mean.items() if not rung.startswith(PolicyName.FULL.value)]
        to_best[name] = mean["full"] / min(others)
        for variant in (SIZED, BORROWING, ATTEMPTS):
            if variant in mean:
                variants.setdefault(variant, {})[name] = mean[variant] / min(others)
        to_sync[name] = mean["full"] / mean["sync"]
        ladder_holds += mean["full"] <= mean["completion"] <= mean["sync"]
    worst = max(to_best, key=lambda name: to_best[name]) if to_best else None
    out: dict[str, Any] = {
        "workloads": len(workloads),
        "full_best": sum(ratio <= 1.0 for ratio in to_best.values()),
        "ladder_holds": ladder_holds,
        "full_over_best_other_median": round(statistics.median(to_best.values()), 4) if to_best else None,
        "full_over_best_other_worst": None
        if worst is None
        else {"workload": worst, "ratio": round(to_best[worst], 4)},
        "full_over_sync_median": round(statistics.median(to_sync.values()), 4) if to_sync else None,
        "full_over_best_other": {name: round(ratio, 4) for name, ratio in to_best.items()},
        "no_batch": no_batch,
        "variants": {},
    }
    for variant, ratios in variants.items():
        worst_v = max(ratios, key=lambda name: ratios[name])
        out["variants"][variant] = {
            "full_best": sum(ratio <= 1.0 for ratio in ratios.values()),
            "over_best_other_median": round(statistics.median(ratios.values()), 4),
            "over_best_other_worst": {"workload": worst_v, "ratio": round(ratios[worst_v], 4)},
            "over_best_other": {name: round(ratio, 4) for name, ratio in ratios.items()},
        }
    return out


def lines(result: dict[str, Any]) -> list[str]:
    out = []
    for name, data in result["workloads"].items():
        cells = " ".join(f"{rung}={seconds_cell(row['mean_s'])}" for rung, row in data["rungs"].items())
        f = data["features"]
        out.append(
            f"{name:>4} {cells}  [serving/demand {f['serving_over_engine_demand']}, "
            f"sandbox cores/traj {f['sandbox_cores_per_trajectory']}, K {f['max_staleness']}]"
        )
    for name, data in result["workloads"].items():
        out += [f"!!! {name}: {line}" for line in data["findings"]]
    s = result["summary"]
    for name, rungs in s.get("no_batch", {}).items():
        out.append(f"!!! {name}: no batch delivered by {', '.join(rungs)}; left out of the ratios")
    worst = s["full_over_best_other_worst"]
    if worst is None:
        out.append(f"no workload of {s['workloads']} has a mean for every rung: no ratio to give")
        return out
    out.append(
        f"full is best in {s['full_best']} of {s['workloads']} workloads; the ladder (full ≤ completion ≤ "
        f"sync) holds in {s['ladder_holds']}; full / best other rung: median "
        f"{s['full_over_best_other_median']:.3f}, worst {worst['ratio']:.3f} ({worst['workload']}); "
        f"full / sync: median {s['full_over_sync_median']:.3f}"
    )
    for variant, z in s["variants"].items():
        out.append(
            f"{variant}: best in {z['full_best']} of {s['workloads']}; / best other rung: median "
            f"{z['over_best_other_median']:.3f}, worst {z['over_best_other_worst']['ratio']:.3f} "
            f"({z['over_best_other_worst']['workload']})"
        )
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Per workload, sorted: `full`'s mean over the best other rung's (below 1: `full` wins), and the
    same for each variant of `full`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["summary"]
    ratios = sorted(s["full_over_best_other"].items(), key=lambda kv: kv[1])
    names = [n for n, _ in ratios]
    variants = list(s["variants"].items())
    width = 0.8 / (1 + len(variants))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(ratios) + 2), 4.5))
    colours = ["tab:green" if r <= 1.0 else "tab:red" for _, r in ratios]
    ax.bar([i - 0.4 + width / 2 for i in range(len(names))], [r for _, r in ratios], width=width,
           color=colours, label="full as configured (red: another rung is faster)")  # fmt: skip
    palette = ["tab:blue", "tab:purple", "tab:orange", "tab:brown", "tab:olive"]  # one per variant
    for k, ((variant, z), colour) in enumerate(zip(variants, palette, strict=False)):
        offset = -0.4 + width * (k + 1.5)
        ax.bar([i + offset for i in range(len(names))], [z["over_best_other"][n] for n in names],
               width=width, color=colour, alpha=0.6, label=variant)  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(range(len(names))), names, rotation=90)
    ax.set_ylabel("÷ best other rung (mean batch collection time)")
    ax.set_title(f"{len(ratios)} random workloads: below 1, full is faster than every other rung")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=24, help="random workloads to draw (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="which random family (default 0)")
    parser.add_argument("--batches", type=int, default=8, help="trainer steps per workload (default 8)")
    parser.add_argument("--no-peers", action="store_true", help="leave out the peer rungs")
    parser.add_argument("--processes", type=int, default=1, help="simulations run in this many processes")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of full against the best other rung here")
    args = parser.parse_args(argv)
    limits = [args.count <= 1000, args.batches <= 1000, args.seed <= 2**31, args.processes <= 64]
    if min(args.count, args.batches, args.processes) < 1 or args.seed < 0 or not all(limits):
        print("error: --count and --batches must be 1–1000, --seed 0–2^31, --processes 1–64", file=sys.stderr)
        return 2
    from benchmarks import check_outputs, interruptible, write_results

    check_outputs(json=args.json_out, plot=args.plot)
    started = time.perf_counter()

    def on_run(label: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)

    result = interruptible(
        lambda: run(args.count, args.seed, not args.no_peers, args.processes, on_run, args.batches)
    )
    if result is None:
        return 130
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print("\n".join(lines(result)))
    write_results(result, args.json_out, args.plot, plot)
    print(f"{args.count} workloads in {result['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
