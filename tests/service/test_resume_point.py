"""Where a resumed run continues, from what the store holds of its stream (`ServiceStore.resume_point`)."""

from __future__ import annotations

from pathlib import Path

from app.core.events import BatchDelivered, BatchRequested, Envelope, Event, GroupAdmitted, GroupDelivered
from app.service.store import ServiceStore


def test_a_batch_requested_but_never_delivered_before_a_crash_keeps_its_index(tmp_path: Path) -> None:
    """Killed while collecting batch 1 (its request stored, its delivery not): the resumed run numbered
    its next batch 2, and b1 never existed."""
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        store.create_run("r", "crashed", {"kind": "sim"}, {})
        timed: list[tuple[float, Event]] = [
            (0.0, BatchRequested(0)),
            (0.5, GroupAdmitted(0, 0, 2)),
            (0.6, GroupAdmitted(1, 1, 2)),
            (1.0, GroupDelivered(0, 0, 0)),
            (1.0, BatchDelivered(0, (0,), 0, 0.0, 1.0)),
            (1.1, BatchRequested(1)),  # then kill -9: group 1 still in flight
        ]
        store.event_sink().write_batch([Envelope("r", seq, t, ev) for seq, (t, ev) in enumerate(timed)])
        point = store.resume_point("r")
    finally:
        store.close()
    assert point.batch_offset == 1  # b1 next, not b2
    assert point.delivered_batches == frozenset({0})
    assert point.open_groups == frozenset({1})
    assert point.group_offset == 2
