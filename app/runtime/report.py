"""The run report: the same JSON shape for `corral sim` and `corral run` (a contract other tools read).

Fields: policy, batches, batch_collection_s {mean, p50, p90, per_batch}, batch_interval_s {mean},
trainer_idle_fraction, lower_bound_s, max_staleness, max_groups_in_flight,
discarded_groups {stale, failed, cancelled, zero_variance}, restarted_trajectories, lost_groups,
tokens_per_s, events, wall_s — plus the extras listed in `build_report`.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from typing import Any

from app.core.scheduler import DiscardReason, GroupState, Scheduler
from app.lanes.base import Lanes
from app.runtime.driver import RunState


def _r(x: float) -> float:
    return round(x, 6)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile; 0 for no values."""
    if not values:
        return 0.0
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def build_report(
    policy_name: str,
    scheduler: Scheduler,
    state: RunState,
    lanes: Lanes,
    lower_bound: float | None,
    wall_s: float,
) -> dict[str, Any]:
    waits = [b.delivered_at - b.requested_at for b in state.batches]
    ready = [b.ready_at for b in state.batches]
    intervals = [b - a for a, b in itertools.pairwise(ready)]
    duration = max(state.ended_at - state.started_at, 1e-9)
    turns = sum(rec.turns for rec in state.engines.values())
    tokens = sum(rec.tokens for rec in state.engines.values())
    counters = scheduler.counters
    discarded = {reason.value: counters.discarded[reason] for reason in DiscardReason}
    ended = sum(
        1 for g in scheduler.groups.values() if g.state in (GroupState.DELIVERED, GroupState.DISCARDED)
    )
    lost = counters.admitted - counters.delivered - sum(discarded.values())
    lost = max(lost, counters.admitted - ended)
    wasted = dict.fromkeys([*discarded, "restarted"], 0.0)
    for group in scheduler.groups.values():
        if group.state is GroupState.DISCARDED and group.reason is not None:
            wasted[group.reason.value] += sum(
                state.attempt_time.get((group.id, a.index), 0.0) for a in group.attempts
            )
    wasted["restarted"] = state.restarted_time
    return {
        "policy": policy_name,
        "batches": len(state.batches),
        "batch_collection_s": {
            "mean": _r(statistics.fmean(waits)) if waits else 0.0,
            "p50": _r(quantile(waits, 0.5)),
            "p90": _r(quantile(waits, 0.9)),
            "per_batch": [_r(w) for w in waits],
        },
        "batch_interval_s": {"mean": _r(statistics.fmean(intervals)) if intervals else 0.0},
        "trainer_idle_fraction": _r(state.trainer_wait_s / duration),
        "lower_bound_s": None if lower_bound is None else _r(lower_bound),
        "max_staleness": counters.max_staleness_delivered,
        "max_groups_in_flight": counters.max_groups_in_flight,
        "discarded_groups": discarded,
        "restarted_trajectories": counters.restarts,
        "lost_groups": lost,
        "tokens_per_s": _r(tokens / duration),
        "events": counters.events,
        "wall_s": round(wall_s, 3),
        # extras
        "admitted_groups": counters.admitted,
        "delivered_groups": counters.delivered,
        "run_s": _r(duration),
        "trainer_wait_s": _r(state.trainer_wait_s),
        "turns": turns,
        "tokens": tokens,
        "mean_reward": _r(statistics.fmean(b.mean_reward for b in state.batches)) if state.batches else 0.0,
        "wasted_trajectory_s": {k: _r(v) for k, v in wasted.items()},
        "max_engines_updating": state.max_engines_updating,
        "engines": {
            name: {
                "turns": rec.turns,
                "tokens": rec.tokens,
                "updates": rec.updates,
                "busy_s": _r(rec.busy_s),
                "final_version": rec.versions[-1][1] if rec.versions else 0,
            }
            for name, rec in state.engines.items()
        },
        "lanes": {
            name: {
                "completed": s.completed,
                "max_busy": s.max_busy,
                "max_queue_depth": s.max_queue_depth,
                "wait_s_mean": _r(s.wait_s_mean),
                "wait_s_max": _r(s.wait_s_max),
            }
            for name, s in lanes.stats().items()
        },
    }
