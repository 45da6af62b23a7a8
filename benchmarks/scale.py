"""Scale: the production runtime and scheduler under the simulator with 10,000 trajectories in flight.

The workload keeps (B + S)·G trajectories live (default B=250 groups, G=8, S=1000: 10,000), with enough
engine slots, lane slots and cores that none of them queues for a slot or a core, so the run measures
the runtime, the scheduler and the simulator, not CPU contention. Two trajectory shapes:
- `short`: 2–4 turns an attempt (the shape this benchmark always used, so figures stay comparable);
- `realistic`: docs/design.md's turn count, median 18 and p90 36 turns an attempt, where the per-attempt
  costs (admission, reset, validation, cleanup, the attempt's task and timeout) are spread over as many
  turns as a real agent makes.
It also times `corral bench` on the default workload (the ladder and both sweeps, 16 simulations), as
the bench runs it. It prints the figures; it asserts nothing about speed. `--profile N` prints the N
functions with the most own time under cProfile (which slows the run about 3×).

Invariant checked (exit code 1 if broken): no admitted group is lost (`lost_groups == 0`), and the
scheduler reached B + S groups live at once, so the run really had (B + S)·G trajectories in flight.

Run: `.venv/bin/python -m benchmarks.scale [--groups 250 --group-size 8 --surplus 1000 --batches 3]
[--shape short|realistic|both] [--no-bench] [--profile 25] [--repeat 3]`. Besides events per wall
second it prints events per CPU second of this process, which load from other processes on a shared
machine disturbs much less; `--repeat N` prints the medians of N runs.
"""

from __future__ import annotations

import cProfile
import math
import pstats
import statistics
import sys
import time
from typing import Any

from pydantic import ValidationError

from app.sim.run import policy_for, simulate
from app.sim.workload import Workload
from app.validation import (
    MAX_BATCHES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_BATCH,
    MAX_SURPLUS,
    int_between,
    problems,
)

SHAPES = {
    "short": {"uniform": [2, 4]},
    "realistic": {"lognormal": {"median": 18, "p90": 36}},
}


def scale_workload(
    groups: int = 250, group_size: int = 8, surplus: int = 1000, batches: int = 3, shape: str = "short"
) -> Workload:
    """Short turns, with a slot for every live trajectory on the engines and in every lane, and a core
    for every running sandbox operation."""
    in_flight = (groups + surplus) * group_size
    engines = max(1, math.ceil(in_flight / 1000))
    return Workload.model_validate(
        {
            "seed": 7,
            "batches": batches,
            "batch": {"groups": groups, "group_size": group_size},
            "trainer": {"step_s": 2.0},
            "policy": {"surplus_groups": surplus, "max_staleness": 4},
            "engines": {
                "count": engines,
                "slots": math.ceil(in_flight / engines),
                "update_s": 0.5,
            },
            # Cores scale with the live sandboxes, so the run measures the scheduler, not CPU contention:
            # lanes split the sandbox cores by slots × demand (1 + 0.25 + 0.5 + 0.25 cores per slot
            # set), so 2 cores per trajectory give every lane a core for each operation it runs.
            "cpus": {"total": 64 + 2 * in_flight, "serving": 64, "engine_demand": 1.0},
            "lanes": {"reset": in_flight, "exec": in_flight, "validate": in_flight, "cleanup": in_flight},
            "trajectory": {
                "reset_s": {"uniform": [0.5, 2.0]},
                "turns": SHAPES[shape],
                "llm_s": {"lognormal": {"median": 1.0, "p90": 2.5}},
                "tool_s": {"uniform": [0.1, 1.0]},
                "validate_s": {"uniform": [0.5, 1.5]},
                "cleanup_s": 0.5,
                "timeout_s": 120.0,
                "task_spread": 0.3,
                "attempt_spread": 0.15,
            },
        }
    )


def run_scale(
    groups: int, group_size: int, surplus: int, batches: int, shape: str = "short"
) -> dict[str, Any]:
    workload = scale_workload(groups, group_size, surplus, batches, shape)
    cpu = time.process_time()
    loop: dict[str, int] = {}
    report = simulate(workload, policy_for(workload, "full"), "full", loop_stats=loop)
    cpu = time.process_time() - cpu
    wall = report["wall_s"]
    events = max(1, report["events"])
    return {
        "shape": shape,
        "groups_per_batch": groups,
        "group_size": group_size,
        "surplus_groups": surplus,
        "batches": report["batches"],
        "lost_groups": report["lost_groups"],
        # `full` admits in flight: B + S caps the groups running; ready ones wait outside it.
        "max_groups_in_flight": report["max_groups_running"],
        "trajectories_in_flight": report["max_groups_running"] * group_size,
        "admitted_groups": report["admitted_groups"],
        "turns": report["turns"],
        "events": report["events"],
        "wall_s": wall,
        "events_per_wall_s": round(report["events"] / wall, 1) if wall > 0 else None,
        "turns_per_wall_s": round(report["turns"] / wall, 1) if wall > 0 else None,
        # CPU seconds of this process: the wall figure without time lost to other processes on the core
        "cpu_s": round(cpu, 3),
        "events_per_cpu_s": round(report["events"] / cpu, 1) if cpu > 0 else None,
        "virtual_run_s": report["run_s"],
        "batch_collection_mean_s": report["batch_collection_s"]["mean"],
        # The virtual loop's own work per scheduler event: handles it dispatched (task wake-ups and
        # callbacks) and timers it was given.
        "loop_dispatched_per_event": round(loop["dispatched"] / events, 2),
        "loop_timers_per_event": round(loop["timers"] / events, 2),
    }


def bare_loop_cycle_s(tasks: int = 10_000, steps: int = 20, repeat: int = 3) -> float:
    """Seconds one bare wake-up cycle takes on the virtual loop (median of `repeat`): a timer fires, sets
    a future, and the task awaiting it resumes, with nothing else in the loop but `tasks` such tasks.
    It is the least the loop can spend on one dispatched handle of a simulation."""
    import asyncio
    import random

    from app.sim.clock import run_virtual

    async def sleeper(rng: random.Random) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(steps):
            done = loop.create_future()
            loop.call_fast(loop.time() + rng.random(), lambda _token, done=done: done.set_result(None))  # type: ignore[attr-defined]
            await done

    async def main() -> None:
        rng = random.Random(0)
        async with asyncio.TaskGroup() as group:
            for _ in range(tasks):
                group.create_task(sleeper(rng))

    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        run_virtual(main())
        runs.append((time.perf_counter() - start) / (tasks * steps))
    return statistics.median(runs)


def loop_floor(result: dict[str, Any], cycle_s: float) -> dict[str, Any]:
    """What the loop alone would allow: each dispatched handle or timer of the run at the cost of one bare
    cycle (which has one of each), and nothing else costing anything."""
    per_event = max(result["loop_dispatched_per_event"], result["loop_timers_per_event"]) * cycle_s
    floor_s = per_event * result["events"]
    return {
        "bare_loop_cycle_us": round(cycle_s * 1e6, 2),
        "loop_floor_events_per_s": round(1 / per_event, 1),
        "loop_floor_share_of_wall": round(floor_s / result["wall_s"], 3) if result["wall_s"] else None,
    }


def time_default_bench() -> dict[str, Any]:
    """How long `corral bench` takes on the built-in default workload, with its default sweeps."""
    from app.sim.bench import run_bench
    from app.sim.workload import default_workload

    wall, cpu = time.perf_counter(), time.process_time()
    result = run_bench(default_workload(), [0, 16, 32, 64, 96], [4, 8])
    runs = len(result["policies"]) + sum(len(v) for v in result["sweeps"].values())
    return {
        "simulations": runs,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks import ScriptParser, check_outputs, save_json  # as a script (-m), it is importable

    parser = ScriptParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=int_between(1, MAX_GROUPS_PER_BATCH), default=250, help="B")
    parser.add_argument("--group-size", type=int_between(2, MAX_GROUP_SIZE), default=8, help="G")
    parser.add_argument("--surplus", type=int_between(0, MAX_SURPLUS), default=1000, help="S")
    parser.add_argument("--batches", type=int_between(1, MAX_BATCHES), default=3)
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--no-bench", action="store_true", help="skip timing `corral bench`")
    parser.add_argument(
        "--profile",
        type=int_between(0, 10_000),
        default=0,
        metavar="N",
        help="print the top N under cProfile",
    )
    parser.add_argument("--json", dest="json_out", help="also write the figures to this file")
    parser.add_argument(
        "--repeat",
        type=int_between(1, 100),
        default=1,
        metavar="N",
        help="run each shape N times; print the medians",
    )
    args = parser.parse_args(argv)
    typed = f"--groups {args.groups} --group-size {args.group_size} --surplus {args.surplus}"
    try:  # (B + S)·G sizes the engines, slots and cores (2 for each live trajectory), which have bounds
        scale_workload(args.groups, args.group_size, args.surplus, args.batches)
    except ValidationError as exc:
        parser.error(f"{typed}: the scale workload is out of bounds: {problems(exc)}")
    check_outputs(json=args.json_out)
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    results = []
    ok = True
    for shape in shapes:
        if args.profile:
            profiler = cProfile.Profile()
            result = profiler.runcall(
                run_scale, args.groups, args.group_size, args.surplus, args.batches, shape
            )
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        else:
            runs = [
                run_scale(args.groups, args.group_size, args.surplus, args.batches, shape)
                for _ in range(args.repeat)
            ]
            result = dict(runs[0])  # a copy: each run's own figures are listed after the medians
            if len(runs) > 1:  # a shared machine is noisy: the medians, and every run's figure
                for key in ("wall_s", "events_per_wall_s", "cpu_s", "events_per_cpu_s"):
                    result[key] = statistics.median(r[key] for r in runs)
                    result[f"{key}_runs"] = [r[key] for r in runs]
        result.update(loop_floor(result, bare_loop_cycle_s()))
        for key, value in result.items():
            print(f"{key:>26}: {value}")
        print()
        results.append(result)
        if result["lost_groups"] != 0 or result["max_groups_in_flight"] != args.groups + args.surplus:
            print(f"FAILED ({shape}): groups were lost or B + S was never reached", file=sys.stderr)
            ok = False
    out: dict[str, Any] = {"scale": results}
    if not args.no_bench:
        out["corral_bench_default"] = time_default_bench()
        print(f"corral bench on the default workload: {out['corral_bench_default']}")
    if args.json_out:
        save_json(args.json_out, out)
    return 0 if ok else 1


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
