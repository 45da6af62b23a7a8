"""The simulator injects the same engine faults as `corral run` meets, from the workload's `faults:`
list, and the production runtime rides them out the same way: batches keep coming, nothing is lost."""

from __future__ import annotations

import itertools
import logging
import math
from typing import Any

import pytest
from factories import make_workload_data

from app.core.events import EngineStateChanged, EngineUpdateEnd, Envelope, TurnDone
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload, WorkloadError, load_workload


def run_with_faults(faults: list[dict[str, Any]], batches: int = 6) -> tuple[dict[str, Any], list[Envelope]]:
    workload = Workload.model_validate(make_workload_data(batches=batches, faults=faults))
    seen: list[Envelope] = []
    report = simulate(workload, policy_for(workload, "full"), "full", events=seen.append)
    return report, seen


def engine_states(envelopes: list[Envelope], engine: str) -> list[tuple[float, str, str]]:
    return [
        (env.t, env.event.state, env.event.detail)
        for env in envelopes
        if isinstance(env.event, EngineStateChanged) and env.event.engine == engine
    ]


def test_an_engine_down_for_a_while_comes_back_and_the_run_goes_on() -> None:
    report, envelopes = run_with_faults([{"kind": "engine_down", "engine": 0, "at_s": 10.0, "for_s": 20.0}])
    assert report["batches"] == 6
    assert report["lost_groups"] == 0
    assert report["discarded_groups"]["failed"] == 0
    states = engine_states(envelopes, "engine-0")
    assert states[0][1] == "unhealthy"
    assert states[0][0] >= 10.0
    back = [t for t, state, _ in states if state == "serving"]
    assert back
    assert back[0] >= 30.0  # not before it answers again
    assert engine_states(envelopes, "engine-1") == []


def test_every_engine_down_waits_then_recovers() -> None:
    down = [{"kind": "engine_down", "engine": e, "at_s": 10.0, "for_s": 15.0} for e in (0, 1)]
    report, envelopes = run_with_faults(down)
    assert report["batches"] == 6
    assert report["lost_groups"] == 0
    assert [state for _, state, _ in engine_states(envelopes, "*")] == ["all_down", "serving"]


def test_an_update_that_hangs_times_out_and_the_rolling_update_goes_on() -> None:
    # Long enough for the hang to reach update_timeout_s (120 s) mid-run: at the run's end an update
    # under way is abandoned after a few seconds (UPDATE_STOP_GRACE_S), not waited out.
    report, envelopes = run_with_faults([{"kind": "update_hang", "engine": 0, "version": 1}], batches=20)
    assert report["batches"] == 20
    assert report["lost_groups"] == 0
    failed = [env.event for env in envelopes if isinstance(env.event, EngineUpdateEnd) and not env.event.ok]
    assert [(e.engine, e.version) for e in failed] == [("engine-0", 1)]
    assert failed[0].error.startswith("timed out after")


def test_a_fault_on_an_engine_that_does_not_exist_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "w.yaml"
    path.write_text("engines: {count: 2}\nfaults: [{kind: engine_down, engine: 5, at_s: 1, for_s: 1}]\n")
    with pytest.raises(WorkloadError, match="faults"):
        load_workload(path)


def test_a_simulation_keeps_its_own_warnings_quiet_and_leaves_the_driver_logger_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine down warns in a real run; in a simulation it is drawn and counted, so not logged. A
    real run's runtime logging beside the simulation (here: on every event) still is."""
    workload = Workload.model_validate(
        make_workload_data(
            batches=2, faults=[{"kind": "engine_down", "engine": 0, "at_s": 5.0, "for_s": 5.0}]
        )
    )
    driver = logging.getLogger("app.runtime.driver")
    with caplog.at_level(logging.INFO, logger="app.runtime.driver"):
        report = simulate(
            workload,
            policy_for(workload, "full"),
            "full",
            observer=lambda _, ev: (
                isinstance(ev, EngineStateChanged) and driver.warning("beside: %s", ev.state)
            ),
        )
    assert report["batches"] == 2
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("app.runtime.driver")]
    assert "beside: unhealthy" in messages  # the driver logger was not raised to ERROR meanwhile
    assert not [m for m in messages if not m.startswith("beside: ")]  # the simulation's own: none


def test_the_wait_while_every_engine_is_down_is_attributed_to_the_outage() -> None:
    # Every engine down from 10 s to 25 s, mid-turn: the batch it held read as "model turns", so an
    # operator could not tell the slow batch was an outage. It is the phase engine_outage: the straggler's
    # call that failed as its engine went down, then its retry's wait for an engine to come back.
    down = [{"kind": "engine_down", "engine": e, "at_s": 10.0, "for_s": 15.0} for e in (0, 1)]
    report, envelopes = run_with_faults(down)
    assert [(t, state) for t, state, _ in engine_states(envelopes, "*")] == [
        (10.0, "all_down"),
        (25.0, "serving"),
    ]
    waits = report["wait_attribution"]
    held = next(
        b for b in waits["batches"] if b["requested_at"] <= 10.0 and b["requested_at"] + b["wait_s"] >= 25.0
    )
    turns = [
        env.event
        for env in envelopes
        if isinstance(env.event, TurnDone)
        and (env.event.group_id, env.event.attempt) == (held["group"], held["attempt"])
    ]
    failed = [(turn.start, after.queued_at) for turn, after in itertools.pairwise(turns) if turn.error]
    assert failed  # the straggler's turn was on an engine as it went down
    assert all(start < 10.0 <= retry for start, retry in failed)
    assert held["phases"]["engine_outage"] == pytest.approx(15.0 + sum(r - s for s, r in failed), abs=1e-5)
    assert held["largest"] == "engine_outage"
    assert math.fsum(held["phases"].values()) == pytest.approx(held["wait_s"], abs=1e-5)
    assert "on engine outages" in waits["summary"]


def test_attempts_the_run_cut_short_fail_and_are_counted() -> None:
    """Every engine down for the whole run: no attempt makes a turn, each runs out of its agent time and
    is validated; it failed (reward 0), it does not keep the reward drawn for the work it never did (it
    did: the batches looked as healthy as without the fault). The same draws without the fault keep
    theirs, and no attempt is cut short."""
    down = [{"kind": "engine_down", "engine": e, "at_s": 0.0, "for_s": 1e6} for e in (0, 1)]
    cut, _ = run_with_faults(down, batches=2)
    healthy, _ = run_with_faults([], batches=2)
    assert cut["turns"] == 0
    assert cut["mean_reward"] == 0.0
    assert cut["attempts_played"] > 0
    assert cut["attempts_cut_short"] == cut["attempts_played"]
    assert healthy["mean_reward"] > 0
    assert healthy["attempts_played"] > 0
    assert healthy["attempts_cut_short"] == 0
    # a group of attempts that all failed has no learning signal: the report counts it
    assert cut["delivered_zero_variance_groups"] == cut["delivered_groups"] > 0
    assert healthy["delivered_zero_variance_groups"] < healthy["delivered_groups"]


def test_an_attempt_is_cut_short_only_below_the_turns_an_idle_machine_finishes_in_time() -> None:
    from app.sim.workload import Trajectory, Turn

    def drawn(*turns: tuple[float, float], timeout_s: float = 10.0) -> Trajectory:
        return Trajectory(1.0, tuple(Turn(*t) for t in turns), 1.0, 1.0, timeout_s, 1.0)

    assert drawn((2, 1), (3, 1)).turns_in_time == 2  # 7 s of 10: all of them
    assert drawn((2, 1), (3, 1), (2, 2)).turns_in_time == 2  # the third ends at 11 s: past the cap
    assert drawn((2, 1), (3, 1), (2, 1)).turns_in_time == 3  # the third ends at 10 s: in time
    assert drawn((20, 1)).turns_in_time == 0  # its own length runs past the cap: keeps its drawn reward
