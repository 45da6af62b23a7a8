"""Every group's timeline, for reports, plots and the dashboard: admitted, completed, ended, outcome.

The rows come from the event stream (`ReportAccumulator(timeline=True)`), so a run's live report and
its stored events give the same timeline. Keeping rows costs memory per group, so a run keeps them only
when a timeline is asked for; `group_timeline` rebuilds them from stored envelopes at any time.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

from app.core.events import EVENT_TYPES, Envelope, Event, GroupAdmitted, GroupDelivered, GroupDiscarded
from app.runtime.report import ReportAccumulator


def group_timeline(envelopes: Iterable[Envelope]) -> list[dict[str, Any]]:
    """One row per admitted group, times in seconds from the start of the run."""
    acc = ReportAccumulator(timeline=True)
    for env in sorted(envelopes, key=lambda e: e.seq):
        acc.on_envelope(env)
    return acc.group_timeline()


class GroupSpans:
    """Each admitted group's (task index, admitted at, ended at, batch index), kept compactly (32 bytes
    a group, in arrays indexed by group id) for analyses after the run such as the simulator's bounds.
    Group ids count up from 0 in a run."""

    def __init__(self) -> None:
        self._task = array("q")
        self._admitted = array("d")
        self._ended = array("d")
        self._batch = array("q")

    # For `EventBus.subscribe(spans.on_envelope, GroupSpans.BY_TYPE)`: only a group's admission and its
    # end matter here, so the bus does not call it for the other kinds.
    BY_TYPE: ClassVar[dict[type[Event], None]] = {
        cls: None
        for cls in EVENT_TYPES.values()
        if cls not in (GroupAdmitted, GroupDelivered, GroupDiscarded)
    }

    def on_envelope(self, env: Envelope) -> None:
        ev = env.event
        if isinstance(ev, GroupAdmitted):
            gid = ev.group_id
            while len(self._task) <= gid:
                self._task.append(-1)
                self._admitted.append(math.nan)
                self._ended.append(math.nan)
                self._batch.append(-1)
            self._task[gid] = ev.task_index
            self._admitted[gid] = env.t
        elif isinstance(ev, GroupDelivered | GroupDiscarded) and ev.group_id < len(self._task):
            self._ended[ev.group_id] = env.t
            if isinstance(ev, GroupDelivered):
                self._batch[ev.group_id] = ev.batch_index

    def __iter__(self) -> Iterator[tuple[int, float, float | None, int | None]]:
        """(task index, admitted at, ended at or None, batch index or None) of each admitted group."""
        for gid, task in enumerate(self._task):
            if task < 0:
                continue
            ended, batch = self._ended[gid], self._batch[gid]
            yield (
                task,
                self._admitted[gid],
                None if math.isnan(ended) else ended,
                None if batch < 0 else batch,
            )
