"""Every group's timeline, for reports, plots and (later) the dashboard: admitted, completed, ended."""

from __future__ import annotations

from typing import Any

from app.core.scheduler import GroupState, Scheduler
from app.runtime.driver import RunState


def group_timeline(scheduler: Scheduler, state: RunState) -> list[dict[str, Any]]:
    """One row per admitted group, times in seconds from the start of the run."""
    t0 = state.started_at

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    rows = []
    for group in scheduler.groups.values():
        if group.state is GroupState.DELIVERED:
            outcome = "delivered"
        elif group.reason is not None:
            outcome = group.reason.value
        else:
            outcome = group.state.value
        rows.append(
            {
                "group": group.id,
                "task": group.task_index,
                "admitted_s": rel(group.admitted_at),
                "completed_s": rel(group.completed_at),
                "ended_s": rel(group.ended_at),
                "outcome": outcome,
                "batch": group.batch_index,
                "staleness": group.staleness,
            }
        )
    return rows


def batch_marks(state: RunState) -> list[dict[str, float]]:
    return [
        {"batch": b.index, "requested_s": round(b.requested_at - state.started_at, 3),
         "delivered_s": round(b.delivered_at - state.started_at, 3)}
        for b in state.batches
    ]  # fmt: skip
