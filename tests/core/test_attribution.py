import math

import pytest

from app.core.attribution import PHASES, WaitAccumulator, attribute_waits
from app.core.events import (
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    SandboxOp,
    TurnDone,
)


def make_stream(*timed: tuple[float, Event], run_id: str = "run-1") -> list[Envelope]:
    """Envelopes in the order given, numbered from 0."""
    return [Envelope(run_id, seq, t, ev) for seq, (t, ev) in enumerate(timed)]


def make_attempt(gid, attempt, start, *spans, finish, engine="engine-0", version=0):
    """Timed events for one attempt: spans are ("turn"|lane, queued_at, start, end)."""
    out: list[tuple[float, Event]] = [(start, AttemptStarted(gid, attempt))]
    for kind, queued, s, e in spans:
        if kind == "turn":
            out.append((e, TurnDone(gid, attempt, engine, version, queued, s, e, 10)))
        else:
            out.append((e, SandboxOp(gid, attempt, kind, queued, s, e)))
    out.append((finish, AttemptFinished(gid, attempt, 1.0)))
    return out


def make_batch(index, gids, requested, delivered, version=0):
    return [
        (requested, BatchRequested(index)),
        (delivered, BatchDelivered(index, tuple(gids), version, requested, delivered)),
        *[(delivered, GroupDelivered(g, index, 0)) for g in gids],
    ]


def by_time(*parts):
    return sorted((x for part in parts for x in part), key=lambda te: te[0])


def test_phases_of_the_critical_attempt_sum_to_the_wait():
    # Group 0 attempt 1 is the straggler: reset 0-2 (queued 0-1), turn 2-5 (slot wait 2-3), tool 5-9,
    # validate 9-10; its sibling finished at 4.
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            make_attempt(0, 0, 0.0, ("reset", 0.0, 0.0, 1.0), ("turn", 1.0, 1.0, 4.0), finish=4.0),
            make_attempt(
                0, 1, 0.0,
                ("reset", 0.0, 1.0, 2.0), ("turn", 2.0, 3.0, 5.0), ("exec", 5.0, 5.0, 9.0),
                ("validate", 9.0, 9.0, 10.0),
                finish=10.0,
            ),
            [(10.0, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=10.5),
        )
    )  # fmt: skip
    result = attribute_waits(stream)
    (batch,) = result.batches
    assert (batch.group_id, batch.attempt, batch.group_ready_at) == (0, 1, 10.0)
    assert batch.wait_s == pytest.approx(10.5)
    assert batch.phases["lane_queue"] == pytest.approx(1.0)
    assert batch.phases["reset"] == pytest.approx(1.0)
    assert batch.phases["engine_wait"] == pytest.approx(1.0)
    assert batch.phases["model_turn"] == pytest.approx(2.0)
    assert batch.phases["tool_call"] == pytest.approx(4.0)
    assert batch.phases["validate"] == pytest.approx(1.0)
    assert batch.phases["handoff"] == pytest.approx(0.5)
    assert math.fsum(batch.phases.values()) == pytest.approx(batch.wait_s)
    assert result.largest() == "tool_call"
    assert set(result.phases) == set(PHASES)


def test_only_the_window_from_request_to_delivery_counts():
    # The straggler's first 6 s of model turn happened before the trainer asked for the batch.
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(3, 0, 2))],
            make_attempt(3, 0, 0.0, ("turn", 0.0, 0.0, 8.0), ("exec", 8.0, 9.0, 10.0), finish=10.0),
            make_attempt(3, 1, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0),
            [(10.0, GroupReady(3))],
            make_batch(4, [3], requested=6.0, delivered=10.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.batch_index == 4
    assert batch.wait_s == pytest.approx(4.0)
    assert batch.phases["model_turn"] == pytest.approx(2.0)
    assert batch.phases["lane_queue"] == pytest.approx(1.0)
    assert batch.phases["tool_call"] == pytest.approx(1.0)


def test_the_last_group_to_complete_is_the_critical_one():
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2)), (0.0, GroupAdmitted(1, 1, 2))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 0.0, 3.0), finish=3.0),
            make_attempt(0, 1, 0.0, ("turn", 0.0, 0.0, 2.0), finish=2.0),
            [(3.0, GroupReady(0))],
            make_attempt(1, 0, 0.0, ("reset", 0.0, 0.0, 7.0), finish=7.0),
            make_attempt(1, 1, 0.0, ("turn", 0.0, 0.0, 5.0), finish=5.0),
            [(7.0, GroupReady(1))],
            make_batch(0, [0, 1], requested=0.0, delivered=7.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert (batch.group_id, batch.attempt) == (1, 0)
    assert batch.largest() == "reset"
    assert batch.phases["reset"] == pytest.approx(7.0)


def test_a_turn_paused_by_its_engine_update_counts_as_update_pause():
    # engine-0 loads weights from 2 to 6; the straggler's turn ran 1-7 on it (paused, kept).
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 1.0, 7.0), finish=7.5),
            make_attempt(0, 1, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0, engine="engine-1"),
            [(2.0, EngineUpdateBegin("engine-0", 1)), (6.0, EngineUpdateEnd("engine-0", 1))],
            [(2.0, EngineUpdateBegin("engine-1", 1)), (2.5, EngineUpdateEnd("engine-1", 1))],
            [(7.5, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=7.5),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.phases["update_pause"] == pytest.approx(4.0)
    assert batch.phases["model_turn"] == pytest.approx(2.0)
    assert batch.phases["engine_wait"] == pytest.approx(1.0)
    assert batch.phases["agent"] == pytest.approx(0.5)
    assert batch.largest() == "update_pause"


def test_admission_wait_and_restarted_work_are_named():
    # The critical group is admitted 3 s into the wait; its attempt restarts at 5 (stop-the-world).
    stream = make_stream(
        *by_time(
            [(3.0, GroupAdmitted(2, 0, 2))],
            make_attempt(2, 0, 3.0, ("turn", 3.0, 3.0, 5.0), ("turn", 5.0, 5.0, 6.0), finish=6.0),
            [(5.0, AttemptRestarted(2, 0))],
            make_attempt(2, 1, 3.0, ("turn", 3.0, 3.0, 4.0), finish=4.0),
            [(6.0, GroupReady(2))],
            make_batch(1, [2], requested=0.0, delivered=6.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.phases["admission"] == pytest.approx(3.0)
    assert batch.phases["restart"] == pytest.approx(2.0)
    assert batch.phases["model_turn"] == pytest.approx(1.0)


def test_run_totals_sum_over_batches_and_read_as_a_sentence():
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2)), (0.0, GroupAdmitted(1, 1, 2))],
            make_attempt(0, 0, 0.0, ("exec", 0.0, 2.0, 3.0), finish=3.0),
            make_attempt(0, 1, 0.0, finish=0.5),
            [(3.0, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=3.0),
            make_attempt(1, 0, 0.0, ("exec", 3.0, 5.0, 6.0), finish=6.0),
            make_attempt(1, 1, 0.0, finish=0.5),
            [(6.0, GroupReady(1))],
            make_batch(1, [1], requested=4.0, delivered=6.0),
        )
    )
    result = attribute_waits(stream)
    assert result.total_s == pytest.approx(5.0)
    assert result.phases["lane_queue"] == pytest.approx(3.0)
    assert result.phases["tool_call"] == pytest.approx(2.0)
    assert result.ranked()[0] == ("lane_queue", pytest.approx(3.0))
    assert result.summary() == (
        "The trainer waited 5.0 s over 2 batches: 3.0 s on lane queues, 2.0 s on tool calls."
    )
    data = result.to_dict()
    assert data["largest"] == "lane_queue"
    assert [b["group"] for b in data["batches"]] == [0, 1]


def test_the_accumulator_keeps_only_open_groups_and_matches_the_batch_function():
    first = by_time(
        [(0.0, GroupAdmitted(0, 0, 2)), (0.0, GroupAdmitted(1, 1, 2)), (0.0, GroupAdmitted(2, 2, 2))],
        make_attempt(0, 0, 0.0, ("exec", 0.0, 2.0, 3.0), finish=3.0),
        make_attempt(0, 1, 0.0, finish=0.5),
        make_attempt(2, 0, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0),
        [(3.0, GroupReady(0))],
        make_batch(0, [0], requested=0.0, delivered=3.0),
    )
    rest = by_time(
        make_attempt(1, 0, 3.0, ("exec", 3.0, 5.0, 6.0), finish=6.0),
        make_attempt(1, 1, 3.0, finish=3.5),
        [(6.0, GroupReady(1))],
        make_batch(1, [1], requested=4.0, delivered=6.0),
        [(6.5, GroupDiscarded(2, "cancelled"))],
    )
    stream = make_stream(*first, *rest)
    acc = WaitAccumulator()
    for env in stream[: len(first)]:
        acc.on_envelope(env)
    assert acc.open_groups == 2  # group 0 went with its batch; 1 and 2 are still open
    for env in stream[len(first) :]:
        acc.on_envelope(env)
    assert acc.open_groups == 0  # group 1 went with its batch, group 2 with its discard
    assert acc.result() == attribute_waits(stream)
    assert acc.result().phases["lane_queue"] == pytest.approx(3.0)
    assert acc.result().phases["tool_call"] == pytest.approx(2.0)


def test_a_batch_ready_before_it_was_asked_for_has_no_critical_work():
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0),
            make_attempt(0, 1, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0),
            [(1.0, GroupReady(0))],
            make_batch(0, [0], requested=5.0, delivered=5.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.wait_s == 0.0
    assert attribute_waits(stream).largest() is None
    assert attribute_waits([]).summary() == "The trainer waited 0.0 s over 0 batches."


def test_time_with_every_engine_updating_and_no_recorded_span_is_an_update_pause():
    # The straggler's second turn was cancelled while it waited (no TurnDone): both engines updating.
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 0.0, 1.0), ("validate", 9.0, 9.0, 10.0), finish=10.0),
            make_attempt(0, 1, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0, engine="engine-1"),
            [(2.0, EngineUpdateBegin("engine-0", 1)), (8.0, EngineUpdateEnd("engine-0", 1))],
            [(1.0, EngineUpdateBegin("engine-1", 1)), (7.0, EngineUpdateEnd("engine-1", 1))],
            [(10.0, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=10.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.phases["update_pause"] == pytest.approx(5.0)  # 2..7: both engines loading
    assert batch.phases["agent"] == pytest.approx(3.0)  # 1..2 and 7..9


def test_a_turn_held_up_by_every_engine_being_down_counts_as_an_engine_outage():
    # Every engine went down for a while: the straggler's turn failed on its dying engine (1..3), the
    # runtime probed it (3..3.5), and the retry waited for a restart (3.5..8). That read as model turns
    # and engine-slot waits: an operator could not tell the slow batch was an outage.
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            [(0.0, AttemptStarted(0, 1)), (1.0, TurnDone(0, 1, "engine-0", 0, 0.0, 0.0, 1.0, 10))],
            [(3.0, TurnDone(0, 1, "engine-0", -1, 1.0, 1.0, 3.0, 0, "EngineUnreachable: gone"))],
            [(3.0, EngineStateChanged("engine-0", "unhealthy")), (3.0, EngineStateChanged("*", "all_down"))],
            [(8.0, EngineStateChanged("engine-1", "serving")), (8.0, EngineStateChanged("*", "serving"))],
            [(10.0, TurnDone(0, 1, "engine-1", 0, 3.5, 8.0, 10.0, 10))],
            [(11.0, SandboxOp(0, 1, "validate", 10.0, 10.0, 11.0)), (11.0, AttemptFinished(0, 1, 1.0))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 0.0, 2.0), finish=2.0, engine="engine-1"),
            [(11.0, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=11.0),
        )
    )
    result = attribute_waits(stream)
    (batch,) = result.batches
    assert batch.phases["engine_outage"] == pytest.approx(7.0)  # 1..8
    assert batch.phases["model_turn"] == pytest.approx(3.0)  # 0..1 and 8..10
    assert batch.phases["engine_wait"] == 0.0
    assert batch.phases["validate"] == pytest.approx(1.0)
    assert math.fsum(batch.phases.values()) == pytest.approx(batch.wait_s)
    assert batch.largest() == "engine_outage"
    assert "7.0 s on engine outages" in result.summary()


def test_time_with_every_engine_down_and_no_recorded_span_is_an_engine_outage():
    # The straggler's turn was cancelled while every engine was down (no TurnDone): not agent work.
    stream = make_stream(
        *by_time(
            [(0.0, GroupAdmitted(0, 0, 2))],
            make_attempt(0, 0, 0.0, ("turn", 0.0, 0.0, 1.0), ("validate", 9.0, 9.0, 10.0), finish=10.0),
            make_attempt(0, 1, 0.0, ("turn", 0.0, 0.0, 1.0), finish=1.0, engine="engine-1"),
            [(2.0, EngineStateChanged("*", "all_down")), (6.0, EngineStateChanged("*", "serving"))],
            [(10.0, GroupReady(0))],
            make_batch(0, [0], requested=0.0, delivered=10.0),
        )
    )
    (batch,) = attribute_waits(stream).batches
    assert batch.phases["engine_outage"] == pytest.approx(4.0)  # 2..6
    assert batch.phases["agent"] == pytest.approx(4.0)  # 1..2 and 6..9
