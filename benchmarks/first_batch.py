"""The first batch against what its admissions allow: `full` on a built-in workload, its first batch's
collection time beside the uncontended duration of the B-th fastest group among those admitted at t = 0
(no schedule of those groups delivers B of them sooner) and among every group the run admitted (what the
clairvoyant `lower_bound_s` may pick from). It prints the figures; it asserts nothing.

Run: `.venv/bin/python -m benchmarks.first_batch [--workload default]`
"""

from __future__ import annotations

import argparse
from typing import Any


def first_batch(name: str) -> dict[str, Any]:
    from app.core.events import Envelope, GroupAdmitted
    from app.sim.family import builtin_workload
    from app.sim.run import policy_for, simulate
    from app.sim.workload import TrajectorySource

    workload = builtin_workload(name)
    draws = TrajectorySource(workload)
    admitted: list[tuple[float, int]] = []  # (time, task) of each admission

    def on_event(env: Envelope) -> None:
        if isinstance(env.event, GroupAdmitted):
            admitted.append((env.t, env.event.task_index))

    policy = policy_for(workload, "full")
    report = simulate(workload, policy, "full", trajectories=draws, events=on_event)
    b = policy.groups_per_batch
    at_start = sorted(draws.group_duration(task) for t, task in admitted if t == 0.0)
    every = sorted(draws.group_duration(task) for _, task in admitted)
    return {
        "workload": name,
        "groups_per_batch": b,
        "first_batch_s": report["batch_collection_s"]["per_batch"][0],
        "admitted_at_start": len(at_start),
        "bth_fastest_at_start_s": at_start[b - 1] if len(at_start) >= b else None,
        "admitted": len(every),
        "bth_fastest_of_all_s": every[b - 1] if len(every) >= b else None,
    }


def main(argv: list[str] | None = None) -> int:
    from app.sim.family import FAMILY

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workload", choices=sorted(FAMILY), default="default")
    args = parser.parse_args(argv)
    from benchmarks import interruptible

    row = interruptible(lambda: first_batch(args.workload))
    if row is None:
        return 130
    for key, value in row.items():
        print(f"{key:>24}: {round(value, 1) if isinstance(value, float) else value}")
    return 0


if __name__ == "__main__":
    from benchmarks import run_script

    run_script(main)
