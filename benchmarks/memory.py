"""Memory: the production runtime and scheduler under the simulator for 100,000 groups.

Memory must grow with the groups in flight, not with the run's history: finished groups leave the
scheduler and the runtime, and the report is folded from the event stream as it goes. The run keeps
B + S groups live (default B=50, S=50, G=2) with short, one-turn trajectories and enough slots that
nothing queues, and prints the peak and current RSS of this process when the 10,000th, 50,000th and
100,000th group is admitted. It asserts nothing about the figures; it exits 1 if a group was lost.

What still grows with history, by design and small: the simulator's per-group bound inputs (32 bytes a
group), the ledger's bit per group id, and the report's per-batch figures (a few floats per batch).
A bench's `TrajectorySource` also keeps every trajectory it drew (so that its rungs replay the same
draws); that cache belongs to the workload, not to the runtime, so by default this benchmark draws
through an uncached source, as one simulation (`corral sim`) does (the draws are seeded per group and
attempt, so they are the same); `--cached` measures with the cache.

Run: `.venv/bin/python -m benchmarks.memory [--groups 100000 --batch-groups 50 --surplus 50] [--cached]`.
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import time
from typing import Any

from app.core.events import Envelope, GroupAdmitted
from app.sim.run import policy_for, simulate
from app.sim.workload import Trajectory, TrajectorySource, Workload

MARKS = (10_000, 50_000, 100_000)


def memory_workload(groups: int, batch_groups: int, surplus: int, group_size: int = 2) -> Workload:
    """Enough batches to admit `groups` groups; one short turn per attempt; a slot for everything."""
    live = (batch_groups + surplus) * group_size
    return Workload.model_validate(
        {
            "seed": 11,
            "batches": math.ceil(groups / batch_groups),
            "batch": {"groups": batch_groups, "group_size": group_size},
            "trainer": {"step_s": 0.5},
            "policy": {"surplus_groups": surplus, "max_staleness": 4},
            "engines": {"count": 2, "slots": live, "update_s": 0.2},
            "cpus": {"total": 16 + live, "serving": 16, "engine_demand": 1.0},
            "lanes": {"reset": live, "exec": live, "validate": live, "cleanup": live},
            "trajectory": {
                "reset_s": {"uniform": [0.1, 0.5]},
                "turns": 1,
                "llm_s": {"uniform": [0.5, 2.0]},
                "tool_s": 0.1,
                "validate_s": 0.1,
                "cleanup_s": 0.1,
                "timeout_s": 60.0,
                "task_spread": 0.3,
            },
        }
    )


class UncachedTrajectories(TrajectorySource):
    """Draws a trajectory again each time it is asked for instead of keeping it."""

    def trajectory(self, group: int, attempt: int) -> Trajectory:
        return self._draw(group, attempt)


def rss_mib() -> tuple[float, float]:
    """(peak RSS, current RSS) of this process in MiB."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return peak_kib / 1024, pages * resource.getpagesize() / 2**20


def run_memory(groups: int, batch_groups: int, surplus: int, cached: bool = False) -> dict[str, Any]:
    workload = memory_workload(groups, batch_groups, surplus)
    source = TrajectorySource(workload) if cached else UncachedTrajectories(workload)
    marks = sorted({m for m in MARKS if m <= groups} | {groups})
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    events = 0

    def on_event(env: Envelope) -> None:
        nonlocal events
        events += 1
        ev = env.event
        if isinstance(ev, GroupAdmitted) and ev.group_id + 1 in marks and len(rows) < len(marks):
            peak, current = rss_mib()
            rows.append(
                {
                    "groups_admitted": ev.group_id + 1,
                    "peak_rss_mib": round(peak, 1),
                    "rss_mib": round(current, 1),
                    "events": events,
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )

    baseline_peak, baseline = rss_mib()
    report = simulate(workload, policy_for(workload, "full"), "full", trajectories=source, events=on_event)
    # After the run: the simulator's bounds (lists over every admitted group) and the report.
    end_peak, end = rss_mib()
    return {
        "after_run_rss_mib": round(end, 1),
        "after_run_peak_rss_mib": round(end_peak, 1),
        "before_run_rss_mib": round(baseline, 1),
        "before_run_peak_rss_mib": round(baseline_peak, 1),
        "marks": rows,
        "admitted_groups": report["admitted_groups"],
        "delivered_groups": report["delivered_groups"],
        "lost_groups": report["lost_groups"],
        "max_groups_in_flight": report["max_groups_in_flight"],
        "events": report["event_stream"]["events"],
        "wall_s": report["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=int, default=100_000, help="groups to run through")
    parser.add_argument("--batch-groups", type=int, default=50, help="B")
    parser.add_argument("--surplus", type=int, default=50, help="S")
    parser.add_argument("--cached", action="store_true", help="keep the simulator's trajectory cache")
    args = parser.parse_args(argv)
    for name in ("groups", "batch_groups", "surplus"):
        value = getattr(args, name)
        if not 0 <= value <= 10_000_000 or (name != "surplus" and value < 1):
            print(f"--{name.replace('_', '-')}: {value} is out of range", file=sys.stderr)
            return 2
    result = run_memory(args.groups, args.batch_groups, args.surplus, args.cached)
    print(f"trajectory source: {'cached' if args.cached else 'uncached'}")
    print(
        f"before the run: rss {result['before_run_rss_mib']} MiB (peak {result['before_run_peak_rss_mib']})"
    )
    print(f"{'groups admitted':>16} {'peak RSS MiB':>13} {'RSS MiB':>9} {'events':>10} {'wall s':>8}")
    for row in result["marks"]:
        print(
            f"{row['groups_admitted']:>16,} {row['peak_rss_mib']:>13} {row['rss_mib']:>9} "
            f"{row['events']:>10,} {row['wall_s']:>8}"
        )
    print(f"after the run (bounds, report): rss {result['after_run_rss_mib']} MiB "
          f"(peak {result['after_run_peak_rss_mib']})")  # fmt: skip
    for key in (
        "admitted_groups",
        "delivered_groups",
        "max_groups_in_flight",
        "lost_groups",
        "events",
        "wall_s",
    ):
        print(f"{key:>22}: {result[key]}")
    return 0 if result["lost_groups"] == 0 else 1


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
