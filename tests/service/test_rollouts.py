"""The rollout log kept from a run's stream, and the one answer rendered from it or from the store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from factories import make_run_ended_mid_rollout, reloaded_after_a_resume

from app.core.events import (
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    RunEnded,
    RunStarted,
    VersionPublished,
)
from app.service.rollouts import ENGINE_KEYS, ROLLOUT_KEYS, RolloutLog, rollout_answer
from app.service.store import ServiceStore
from app.store.models import RunState


def make_log(*timed: tuple[float, Event]) -> RolloutLog:
    log = RolloutLog()
    for seq, (t, event) in enumerate(timed):
        log.on_envelope(Envelope("r", seq, t, event))
    return log


def answer(log: RolloutLog, version: int, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "newest": log.newest,
        "engines": ["e0", "e1"],
        "served": {"e0": 0, "e1": 0},
        "steps": log.steps_from(version),
        "updating": {},
        "t0": log.first_t,
        "knobs": {"max_updating_engines": 1, "pause_mode": "keep"},
        "run_ended": log.ended,
    }
    fields.update(overrides)
    return rollout_answer(log.rollouts[version], **fields)


def test_only_published_versions_are_known_and_a_newer_one_supersedes_a_running_one() -> None:
    log = make_log(
        (1.0, RunStarted(engines=("e0", "e1"))),
        (2.0, VersionPublished(1, None, "ops")),
        (2.5, EngineUpdateBegin("e0", 1)),
        (3.0, VersionPublished(5, "/w/5", "ops")),
        (3.5, EngineUpdateEnd("e0", 1)),
        (4.0, EngineUpdateBegin("e0", 5)),
        (4.25, EngineUpdateBegin("e1", 5)),
        (5.0, EngineUpdateEnd("e0", 5)),
        (5.5, EngineUpdateEnd("e1", 5)),
    )
    assert sorted(log.rollouts) == [1, 5]  # 2, 3, 4 never published
    first = answer(log, 1, served={"e0": 5, "e1": 5})
    assert tuple(first) == ROLLOUT_KEYS
    assert (first["state"], first["superseded"], first["ended_at"]) == ("superseded", True, 3.0)
    e0, e1 = first["engines"]
    assert tuple(e0) == ENGINE_KEYS
    assert (e0["state"], e0["began_s"], e0["ended_s"]) == ("done", 1.5, 2.5)  # its update to 1
    assert (e1["state"], e1["began_s"], e1["ended_s"]) == ("done", 3.25, 4.5)  # it went straight to 5
    fifth = answer(log, 5, served={"e0": 5, "e1": 5})
    assert (fifth["state"], fifth["superseded"], fifth["ended_at"]) == ("completed", False, 5.5)
    assert (fifth["path"], fifth["actor"]) == ("/w/5", "ops")


def test_a_failed_step_fails_the_rollout_once_every_engine_in_rotation_has_ended() -> None:
    log = make_log(
        (0.0, RunStarted(engines=("e0", "e1"))),
        (1.0, VersionPublished(1)),
        (1.0, EngineUpdateBegin("e0", 1)),
        (2.0, EngineUpdateEnd("e0", 1, ok=False, error="timed out")),
        (2.0, EngineStateChanged("e0", "unhealthy")),
    )
    pending = answer(log, 1, updating={"e1": 1})
    assert pending["state"] == "running"  # e1 is still in rotation and has not ended its step
    states = [(e["state"], e["error"]) for e in pending["engines"]]
    assert states == [("failed", "timed out"), ("updating", None)]
    log.on_envelope(Envelope("r", 5, 3.0, EngineUpdateBegin("e1", 1)))
    log.on_envelope(Envelope("r", 6, 4.0, EngineUpdateEnd("e1", 1)))
    done = answer(log, 1, served={"e0": 0, "e1": 1})
    assert (done["state"], done["ended_at"]) == ("failed", 4.0)
    assert [e["state"] for e in done["engines"]] == ["failed", "done"]


def test_a_version_published_again_after_a_resume_keeps_its_row() -> None:
    log = make_log(
        (0.0, VersionPublished(3, "/w/3", "trainer-1")),
        (9.0, VersionPublished(3, "/w/3", "resume")),  # a resumed run rolls its engines to it again
    )
    assert (log.rollouts[3].actor, log.rollouts[3].started_at) == ("trainer-1", 0.0)


def test_a_rollout_still_running_when_the_run_ends_is_cancelled_saying_so() -> None:
    """It said `running` forever, e0 `updating` and e1 `pending`: nothing would ever end them."""
    log = make_log(*make_run_ended_mid_rollout())
    # The runtime's plan may still list e0 as updating once the run has ended: the log's account wins.
    second = answer(log, 2, served={"e0": 1, "e1": 0}, updating={"e0": 2})
    assert (second["state"], second["ended_at"]) == ("cancelled", 4.0)
    assert [(e["state"], e["error"]) for e in second["engines"]] == [
        ("cancelled", "run ended"),  # updating when the run ended
        ("cancelled", "run ended"),  # it never began
    ]
    first = answer(log, 1, served={"e0": 1, "e1": 0})
    assert (first["state"], first["ended_at"]) == ("superseded", 3.0)
    assert [(e["state"], e["error"]) for e in first["engines"]] == [
        ("done", None),
        ("cancelled", "run ended"),
    ]
    # A rollout that had ended keeps its account.
    done = make_log(
        (0.0, RunStarted(engines=("e0",))),
        (1.0, VersionPublished(1)),
        (1.0, EngineUpdateBegin("e0", 1)),
        (2.0, EngineUpdateEnd("e0", 1)),
        (3.0, RunEnded("completed")),
    )
    completed = answer(done, 1, engines=["e0"], served={"e0": 1})
    assert (completed["state"], completed["ended_at"]) == ("completed", 2.0)
    assert [(e["state"], e["error"]) for e in completed["engines"]] == [("done", None)]


def superseded_then_ended() -> list[tuple[float, Event]]:
    """Version 1 is superseded while e0 loads it and e1 has not begun; the run ends while e0 loads 2."""
    return [
        (0.0, RunStarted(engines=("e0", "e1"))),
        (1.0, VersionPublished(1)),
        (1.0, EngineUpdateBegin("e0", 1)),
        (1.5, VersionPublished(2)),
        (2.0, EngineUpdateEnd("e0", 1)),
        (2.0, EngineUpdateBegin("e0", 2)),
        (3.0, RunEnded("stopped")),
    ]


def test_an_engine_that_never_began_a_superseded_rollout_is_cancelled_when_the_run_ends() -> None:
    """e1 stayed `pending` for ever in version 1's rollout: superseded, it was not closed at the run's
    end as a cancelled rollout's engines are."""
    timed = superseded_then_ended()
    running = answer(make_log(*timed[:-1]), 1, served={"e0": 1, "e1": 0}, updating={"e0": 2})
    assert [e["state"] for e in running["engines"]] == ["done", "pending"]  # the run goes on: it may yet
    log = make_log(*timed)
    # The runtime's plan may still list e0 as updating once the run has ended: the log's account wins.
    first = answer(log, 1, served={"e0": 1, "e1": 0}, updating={"e0": 2})
    assert (first["state"], first["ended_at"]) == ("superseded", 1.5)
    assert [(e["state"], e["error"]) for e in first["engines"]] == [
        ("done", None),
        ("cancelled", "run ended"),
    ]
    second = answer(log, 2, served={"e0": 1, "e1": 0}, updating={"e0": 2})
    assert [(e["state"], e["error"]) for e in second["engines"]] == [("cancelled", "run ended")] * 2


def test_the_store_answers_a_superseded_rollout_of_an_ended_run_with_no_engine_pending(
    tmp_path: Path,
) -> None:
    """As the live log, from the store, and from the store opened again (a restarted server)."""
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    for opening in range(2):
        store = ServiceStore(database)
        try:
            if opening == 0:
                store.create_run("r", "ended", {"kind": "sim"}, {})
                timed = superseded_then_ended()
                sink = store.event_sink()
                sink.write_batch([Envelope("r", seq, t, ev) for seq, (t, ev) in enumerate(timed)])
                record = store.get_run("r")
                assert record is not None
                assert record.state == RunState.STOPPED  # set by the stream's run_ended
            first = store.rollout("r", 1)
        finally:
            store.close()
        assert first is not None
        assert first["state"] == "superseded"
        assert [(e["engine"], e["state"], e["error"]) for e in first["engines"]] == [
            ("e0", "done", None),
            ("e1", "cancelled", "run ended"),
        ]


def test_a_resumed_runs_reload_keeps_the_rollouts_own_times() -> None:
    """The reload's begin and end replaced the engines' times of the rollout (9.8-10.1 s for a rollout
    that ended at 4.7 s, seen after a kill -9 and a restart). The store's side is in
    tests/store/test_store_sink.py."""
    log = make_log(*reloaded_after_a_resume())
    by_engine = {s.engine: (s.state, s.started_at, s.ended_at) for s in log.steps_from(1)}
    assert by_engine == {"e0": ("done", 1.0, 2.0), "e1": ("done", 3.0, 4.0)}
    assert (log.rollouts[1].state, log.rollouts[1].ended_at) == ("completed", 4.0)
