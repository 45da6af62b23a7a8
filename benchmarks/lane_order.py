"""Lane order in the simulator: `full` with `lanes.order: fifo`, with `oldest_group`'s queue order alone,
and with its CPU priority by group age too, on the same seeded draws, over several seeds.

Each seed replaces the workload's own (all else is the built-in workload's), and the three runs of a
seed share its trajectory draws. It prints each seed's mean batch collection times and, per variant,
the median, least and most of its ratio to fifo and how many seeds it was faster on; it asserts
nothing.

Run: `.venv/bin/python -m benchmarks.lane_order [--workload cpu-scarce] [--seeds 1-6] [--json FILE]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "fifo": {"order": "fifo"},
    "queue": {"order": "oldest_group", "cpu_priority": False},
    "cpu_priority": {"order": "oldest_group", "cpu_priority": True},
}


def seed_range(text: str) -> list[int]:
    """`3` or `1-6`: the seeds, for argparse (which turns a ValueError into its one-line error)."""
    first, _, last = text.partition("-")
    low, high = int(first), int(last or first)
    if not 0 <= low <= high or high - low >= 1000:
        raise ValueError(text)
    return list(range(low, high + 1))


def run_seed(name: str, seed: int) -> dict[str, Any]:
    """The three variants on `name` with `seed`, on one set of draws: each one's mean and p90."""
    from app.sim.family import builtin_workload
    from app.sim.run import policy_for, simulate
    from app.sim.workload import TrajectorySource, Workload

    base = builtin_workload(name).model_dump(mode="json", by_alias=True, exclude_none=True)
    base["seed"] = seed
    draws = TrajectorySource(Workload.model_validate(base))
    row: dict[str, Any] = {"workload": name, "seed": seed}
    for variant, lanes in VARIANTS.items():
        workload = Workload.model_validate({**base, "lanes": {**base["lanes"], **lanes}})
        report = simulate(workload, policy_for(workload, "full"), "full", trajectories=draws)
        row[variant] = {
            "mean_s": report["batch_collection_s"]["mean"],
            "p90_s": report["batch_collection_s"]["p90"],
            "attempts_cut_short": report["attempts_cut_short"],
            "lanes_cpu_priority": report["lanes_cpu_priority"],
        }
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for variant in VARIANTS:
        if variant == "fifo":
            continue
        ratios = [row[variant]["mean_s"] / row["fifo"]["mean_s"] for row in rows]
        out[variant] = {
            "median_ratio_to_fifo": round(statistics.median(ratios), 4),
            "min_ratio": round(min(ratios), 4),
            "max_ratio": round(max(ratios), 4),
            "faster_on": sum(r < 1.0 for r in ratios),
            "seeds": len(ratios),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    from app.sim.family import FAMILY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workload", choices=sorted(FAMILY), default="cpu-scarce")
    parser.add_argument("--seeds", type=seed_range, default=seed_range("1-6"), help="e.g. 1-6 or 3")
    parser.add_argument("--json", dest="json_out", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    from benchmarks import check_outputs, save_json

    check_outputs(json=args.json_out)
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        for done, seed in enumerate(args.seeds, 1):
            row = run_seed(args.workload, seed)
            rows.append(row)
            cells = "  ".join(f"{v} {row[v]['mean_s']:.1f} s" for v in VARIANTS)
            print(f"[{done}/{len(args.seeds)}] seed {seed}: {cells}", flush=True)
    except KeyboardInterrupt:  # the seeds done are kept: a Ctrl-C was a traceback that lost them
        interrupted = True
        print(f"interrupted after {len(rows)} of {len(args.seeds)} seeds", file=sys.stderr)
        if not rows:
            print("nothing written", file=sys.stderr)
            return 130
    result = {"workload": args.workload, "runs": rows, "summary": summary(rows), "interrupted": interrupted}
    for variant, figures in result["summary"].items():
        print(
            f"{variant} / fifo: median {figures['median_ratio_to_fifo']:.3f}x "
            f"({figures['min_ratio']:.3f}x to {figures['max_ratio']:.3f}x), "
            f"faster on {figures['faster_on']} of {figures['seeds']} seeds"
        )
    if args.json_out is not None:
        save_json(args.json_out, result)
    return 130 if interrupted else 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
