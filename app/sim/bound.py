"""A clairvoyant lower bound on the mean batch collection time of one run's admitted groups under its B + S.

Let D_n be the time batch n is delivered, s the trainer step and d_g a group's uncontended duration
(its slowest attempt on an idle machine). By D_n, n·B groups have completed, so:
- order statistic: D_n ≥ the (n·B)-th smallest d_g among admitted groups;
- capacity: at most B + S groups are live at once and each delivered group was live for at least d_g,
  so D_n ≥ (sum of the n·B smallest d_g) / (B + S).
Collection times add up to at least D_n minus the n − 1 trainer steps between deliveries, so the mean
over N batches is at least max over n of (max(order, capacity) − (n − 1)·s) / N; with steps that vary
(a real run's), the n − 1 steps as they were.

What it bounds: the mean over the N batches (not each batch) of any schedule that draws its batches
from these admitted groups, keeps at most `max_live` = B + S of them live, and runs no group faster
than uncontended. It depends on the policy through B + S and through which groups it admitted, so it
is a bound for that policy's run, not for every policy. Contention, queueing, restarts and pauses
only add time within those assumptions.

Attempts admission caps the attempts in flight at (B + S)·G instead, so more than B + S groups can be
live and the capacity term above does not hold. With w_g a group's attempt-seconds (the sum of its G
attempts' uncontended durations), each delivered group's attempts took at least w_g of attempt room
by D_n, so D_n ≥ (sum of the n·B smallest w_g) / ((B + S)·G); the order statistic holds as before.
Given `attempt_work` and `max_attempts`, the bound takes that capacity term.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def lower_bound_s(
    admitted_durations: Sequence[float],
    batches: int,
    groups_per_batch: int,
    max_live: int,
    step_s: float | Sequence[float],
    attempt_work: Sequence[float] | None = None,
    max_attempts: int | None = None,
) -> float:
    """`step_s`: the trainer's step, one figure (the simulator's), or each step as it was (a real run's:
    the k-th is the time from delivering batch k to asking for batch k + 1). A real run's steps vary,
    and its shortest step taken for all of them subtracted too little: the "bound" came out above the
    run's own mean (the dashboard showed 3.3 s against 3.2 s). With `attempt_work` (each admitted
    group's attempt-seconds) and `max_attempts` ((B + S)·G), the capacity term is attempts admission's
    and `max_live` is not used."""
    if batches <= 0:
        return 0.0
    durations = sorted(admitted_durations)
    if attempt_work is None:
        work, room = durations, float(max_live)
    else:
        if max_attempts is None or len(attempt_work) != len(durations):
            raise ValueError("attempt_work needs max_attempts and one figure per admitted group")
        work, room = sorted(attempt_work), float(max_attempts)
    steps_before = list(itertools.accumulate(_steps(step_s, batches), initial=0.0))  # [n - 1]: n batches
    best = 0.0
    prefix = 0.0
    for i, (d, w) in enumerate(zip(durations, work, strict=True)):
        prefix += w
        n, rem = divmod(i + 1, groups_per_batch)
        if rem or n > batches:
            continue
        bound = max(d, prefix / room) - steps_before[n - 1]
        best = max(best, bound / batches)
    return best


def _steps(step_s: float | Sequence[float], batches: int) -> list[float]:
    """The trainer steps between `batches` batches (one fewer than batches)."""
    if isinstance(step_s, int | float):
        return [float(step_s)] * max(0, batches - 1)
    steps = [float(s) for s in step_s][: max(0, batches - 1)]
    if len(steps) < batches - 1:
        raise ValueError(f"{batches} batches need {batches - 1} trainer steps, got {len(steps)}")
    return steps


def admission_bound_s(
    requests: Sequence[float],
    groups: Sequence[tuple[float, float, float | None, int | None]],
    groups_per_batch: int,
) -> float:
    """Mean over batches of a per-batch bound that takes the run's own admission times as given.

    `groups` holds (admitted_at, uncontended duration, ended_at, batch index or None). Batch n, asked
    for at r_n, needs B groups that it did not leave to earlier batches and that were still live at
    r_n; none of them can be ready before max(r_n, admitted_at + duration). So its collection time is
    at least the B-th smallest of those, minus r_n. This bounds the execution (contention, queueing,
    pauses) of the run's own scheduling decisions, not the decisions themselves.
    """
    if not requests:
        return 0.0
    total = 0.0
    for n, r in enumerate(requests):
        ready_at = sorted(
            max(r, admitted + duration)
            for admitted, duration, ended, batch in groups
            if (batch is None or batch >= n) and (ended is None or ended >= r)
        )
        if len(ready_at) >= groups_per_batch:
            total += ready_at[groups_per_batch - 1] - r
    return total / len(requests)
