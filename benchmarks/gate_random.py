"""The agent-phase gate on random workloads: `full` with no gate, with its gate (the default), and with
the gate but its adaptive lanes' reweighting and long-reset leaving off, in plain batch time and in
time to trainable batches (`filter_zero_variance` on), on the random workloads of
`benchmarks.random_workloads` (seeds 0 and 1, 24 each, 8 batches), each configuration on the same
draws. Prints one summary line per configuration against no gate, and writes one JSON line a run.

    python -m benchmarks.gate_random --processes 2 --out docs/gate-random.jsonl

The figures of docs/simulator.md ("The agent-phase gate") came from this, at a82626d.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.random_workloads import random_workload

# name -> (the gate's factor, adaptive lane settings over full's own)
CONFIGS: dict[str, tuple[float | None, dict[str, Any]]] = {
    "old": (None, {}),
    "gate": (1.0, {}),
    "gate_plain": (1.0, {"reweight": False, "long_op_factor": None}),
}


def one(task: tuple[int, int, str, bool]) -> dict[str, Any]:
    from app.sim.family import simulated_row
    from app.sim.run import policy_for
    from app.sim.workload import TrajectorySource, Workload

    seed, index, config, trainable = task
    spec = random_workload(index, seed, 8)
    draws = TrajectorySource(Workload.model_validate(spec))
    gate, adaptive = CONFIGS[config]
    if adaptive:
        spec = {**spec, "lanes": {**spec["lanes"], "adaptive": adaptive}}
    workload = Workload.model_validate(spec)
    policy = policy_for(workload, "full").with_changes(agent_gate=gate, filter_zero_variance=trainable)
    row = simulated_row(workload, policy, "full", draws)
    return {
        "seed": seed,
        "idx": index,
        "cfg": config,
        "tr": trainable,
        "mean": row["mean_s"],
        "cut": row["attempts_cut_short_share"],
    }


def summary(rows: list[dict[str, Any]], base: str = "old") -> list[str]:
    by = {(r["seed"], r["idx"], r["cfg"], r["tr"]): r for r in rows}
    out = []
    for trainable in (False, True):
        for config in CONFIGS:
            if config == base:
                continue
            pairs = [
                (r, by[(s, i, base, t)])
                for (s, i, c, t), r in by.items()
                if c == config and t == trainable and (s, i, base, t) in by
            ]
            ratios = [r["mean"] / b["mean"] for r, b in pairs]
            if not ratios:
                continue
            geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
            cut_before = statistics.mean(b["cut"] or 0 for _, b in pairs)
            cut_after = statistics.mean(r["cut"] or 0 for r, _ in pairs)
            measure = "trainable" if trainable else "plain"
            out.append(
                f"{measure} {config} / {base}: {len(ratios)} workloads, geometric mean {geomean:.3f}, "
                f"median {statistics.median(ratios):.3f}, slower by >1% on {sum(x > 1.01 for x in ratios)}, "
                f"faster by >1% on {sum(x < 0.99 for x in ratios)}, "
                f"range {min(ratios):.3f}–{max(ratios):.3f}; "
                f"mean share cut short {cut_before:.3f} → {cut_after:.3f}"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", type=int, default=1, help="simulations run in this many processes")
    parser.add_argument("--out", type=Path, required=True, help="write one JSON line a run here")
    parser.add_argument("--summary", action="store_true", help="summarise --out as it is; run nothing")
    args = parser.parse_args(argv)
    if args.summary:
        rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        print("\n".join(summary(rows)))
        return 0
    if not 1 <= args.processes <= 64:
        print("error: --processes must be 1–64", file=sys.stderr)
        return 2
    from benchmarks import check_outputs

    check_outputs(out=args.out)
    from multiprocessing import Pool

    tasks = [(s, i, c, t) for s in (0, 1) for i in range(24) for c in CONFIGS for t in (False, True)]
    rows = []
    with Pool(args.processes) as pool, args.out.open("w") as out:
        for done, row in enumerate(pool.imap_unordered(one, tasks), 1):
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
            print(f"[{done}/{len(tasks)}]", file=sys.stderr, flush=True)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
