import json
import math

import pytest

from app.core.events import (
    EVENT_TYPES,
    AttemptCancelled,
    BatchDelivered,
    Envelope,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    LaneResized,
    Ledger,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    envelope_from_dict,
)


def make_envelope(event, seq=0, t=1.5, run_id="run-1"):
    return Envelope(run_id, seq, t, event)


def test_every_kind_is_unique_and_registered():
    assert len(EVENT_TYPES) == len({cls.kind for cls in EVENT_TYPES.values()})
    assert EVENT_TYPES["turn"] is TurnDone


@pytest.mark.parametrize(
    "event",
    [
        GroupAdmitted(3, 3, 8, "count-primes"),
        GroupDiscarded(3, "stale", "cannot meet K"),
        TurnDone(1, 2, "engine-0", 4, 0.5, 1.0, 2.0, 32),
        BatchDelivered(0, (4, 5, 6), 2, 10.0, 11.0),
        LaneResized("reset", 2, 3, 2, "4 queued, 0.80 idle cores, ~0.25 cores an operation"),
    ],
)
def test_envelope_round_trips_through_a_dict(event):
    env = make_envelope(event, seq=7)
    assert envelope_from_dict(env.to_dict()) == env


def test_non_finite_fields_are_refused():
    env = make_envelope(TurnDone(1, 0, "e", 0, 0.0, math.nan, 1.0, 1))
    with pytest.raises(ValueError, match="start is not finite"):
        env.to_dict()


def test_unknown_kind_or_field_is_refused():
    with pytest.raises(ValueError, match="unknown event kind"):
        envelope_from_dict({"kind": "nope", "run_id": "r", "seq": 0, "t": 0.0})
    body = make_envelope(GroupAdmitted(1, 1, 2)).to_dict()
    body["surprise"] = 1
    with pytest.raises(ValueError, match="surprise"):
        envelope_from_dict(body)


def test_ledger_counts_a_group_without_terminal_event_as_lost():
    ledger = Ledger()
    events = [GroupAdmitted(0, 0, 2), GroupAdmitted(1, 1, 2), GroupDelivered(0, 0, 0)]
    for seq, event in enumerate(events):
        ledger.on_envelope(make_envelope(event, seq=seq))
    assert ledger.open_groups == {1}
    assert ledger.lost == 1
    ledger.on_envelope(make_envelope(GroupDiscarded(1, "cancelled"), seq=3))
    assert ledger.lost == 0
    assert ledger.gaps == 0


def test_ledger_sees_double_endings_unknown_groups_and_gaps():
    ledger = Ledger()
    ledger.on_envelope(make_envelope(GroupAdmitted(0, 0, 2), seq=0))
    ledger.on_envelope(make_envelope(GroupDelivered(0, 0, 0), seq=1))
    ledger.on_envelope(make_envelope(GroupDiscarded(0, "stale"), seq=2))
    ledger.on_envelope(make_envelope(GroupDiscarded(9, "stale"), seq=5))
    assert ledger.ended_twice == {0}
    assert ledger.lost == 2
    assert ledger.gaps == 2


@pytest.mark.parametrize(
    "event",
    [
        AttemptCancelled(2, 1, "stale"),
        GroupDelivered(4, 1, 0, (1.0, 0.0)),
        RunStarted({"groups_per_batch": 2, "pause_mode": "keep"}, ("engine-0",), ("reset", "exec")),
        RunEnded("stopped", "", 12.5, 301),
        SandboxOp(1, 0, "exec", 1.0, 1.5, 2.0, queue_depth=3, busy=2),
    ],
)
def test_new_fields_round_trip_through_strict_json(event):
    env = make_envelope(event, seq=3)
    assert envelope_from_dict(json.loads(json.dumps(env.to_dict(), allow_nan=False))) == env


def test_ledger_memory_is_the_open_groups_plus_a_bit_per_group():
    ledger = Ledger(next_seq=10)  # a resumed run continues its sequence
    for seq, gid in enumerate(range(10_000), start=10):
        ledger.on_envelope(make_envelope(GroupAdmitted(gid, gid, 2), seq=2 * seq - 10))
        ledger.on_envelope(make_envelope(GroupDelivered(gid, gid, 0), seq=2 * seq - 9))
    assert ledger.gaps == 0
    assert ledger.open_groups == set()
    assert (ledger.admitted_count, ledger.delivered_count, ledger.max_open) == (10_000, 10_000, 1)
    assert len(ledger._admitted._bits) == 10_000 // 8
    assert ledger.admitted == ledger.ended == set(range(10_000))
