"""The workload family × every rung, peers included: one table, one JSON, one plot.

For each built-in workload of `app.sim.family` (default, design, cpu-scarce, ample-cpu, trace) it runs
the ablation ladder (sync, completion, lanes, full, whose lanes adapt), `full` with fixed and with
partitioned lanes, and the peer rungs of `app.sim.peers` (areal, prime-rl, pipelinerl, slime, skyrl,
and areal and skyrl without their concurrency cap), all of one workload on the same seeded draws. It
prints a table of mean batch collection times and, loudly, every place where the ladder is out of
order (`full` ≤ `completion` ≤ `sync` must hold) or another rung beats `full`. Exit code 0 either
way: the findings are results, not failures.

Run: `.venv/bin/python -m benchmarks.family --json docs/family.json --plot docs/family.png
[--workloads default,design] [--no-peers] [--processes 2] [--trainable] [--seed N]`. With `--trainable`
every rung discards a group whose rewards are all equal (no learning signal under GRPO), so the table
gives the times to *trainable* batches (`docs/family-trainable.json`). `--seed N` runs other draws of
the same workloads (their own seed is 0), to see whether a result holds beyond one draw.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from app.sim.family import FAMILY, run_family
from app.validation import MAX_SEED, int_between
from benchmarks import seconds_cell


def table(result: dict[str, Any]) -> str:
    workloads = result["workloads"]
    rungs: list[str] = []
    for data in workloads.values():
        rungs += [r for r in data["rungs"] if r not in rungs]
    rows = ["| rung | " + " | ".join(workloads) + " |", "| --- |" + " --- |" * len(workloads)]
    for rung in rungs:
        cells = []
        for data in workloads.values():
            row = data["rungs"].get(rung)
            cells.append("" if row is None else seconds_cell(row["mean_s"]))
        rows.append(f"| {rung} | " + " | ".join(cells) + " |")
    bounds = [seconds_cell(data["rungs"]["full"]["lower_bound_s"]) for data in workloads.values()]
    rows.append("| lower bound (full) | " + " | ".join(bounds) + " |")
    return "\n".join(rows)


def _reusable(path: Path, seed: int | None) -> tuple[dict[str, Any], str | None]:
    """The rungs of a family JSON written before, by workload, or why they cannot be reused: the file
    cannot be read, or it holds other draws than `seed` asks for."""
    try:
        data = json.loads(path.read_text())
        rungs = {name: entry["rungs"] for name, entry in data["workloads"].items()}
        specs = data.get("specs", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return {}, f"{path}: not a family JSON ({exc})"
    want = 0 if seed is None else seed  # the family's workloads draw with seed 0 of their own
    other = sorted(name for name in rungs if specs.get(name, {}).get("seed", 0) != want)
    if other:
        return {}, f"{path}: {', '.join(other)} were drawn with another seed than {want}"
    return rungs, None


def _plot(result: dict[str, Any], path: Path) -> None:
    from app.sim.plot import plot_family

    plot_family(result, path)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import ScriptParser, check_outputs  # as a script (-m), the package is importable

    parser = ScriptParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workloads", default=",".join(FAMILY), help="comma-separated built-in names")
    parser.add_argument("--no-peers", action="store_true", help="leave out the peer rungs")
    parser.add_argument("--json", dest="json_out", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of every workload's rungs here")
    parser.add_argument(
        "--processes", type=int_between(1, 64), default=1, help="simulations run in this many processes"
    )
    parser.add_argument(
        "--trainable",
        action="store_true",
        help="discard groups whose rewards are all equal (no learning signal): times to trainable batches",
    )
    parser.add_argument(
        "--reuse", type=Path, help="a JSON written before: its rungs are taken as they are, only new ones run"
    )
    parser.add_argument(
        "--seed",
        type=int_between(0, MAX_SEED),
        metavar="N",
        help="draw the workloads with this seed instead of their own (0)",
    )
    args = parser.parse_args(argv)
    check_outputs(json=args.json_out, plot=args.plot)
    names = [n for n in args.workloads.split(",") if n]
    unknown = [n for n in names if n not in FAMILY]
    if unknown:
        print(f"error: --workloads: unknown {unknown}; choose from {', '.join(FAMILY)}", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def on_run(label: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {label}", file=sys.stderr, flush=True)

    known = None
    if args.reuse is not None:
        known, problem = _reusable(args.reuse, args.seed)
        if problem:
            print(f"error: --reuse: {problem}", file=sys.stderr)
            return 2
    from benchmarks import interruptible, write_results

    result = interruptible(
        lambda: run_family(
            names,
            peers=not args.no_peers,
            on_run=on_run,
            processes=args.processes,
            known=known,
            trainable=args.trainable,
            seed=args.seed,
        )
    )
    if result is None:
        return 130
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(table(result))
    for name, data in result["workloads"].items():
        for line in data["findings"]:
            print(f"!!! {name}: {line}")
    write_results(result, args.json_out, args.plot, _plot)
    print(f"{len(names)} workloads in {result['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
