"""A simulated run (the production scheduler and runtime under the virtual clock) through the store:
its report rebuilt from the stored events equals the runtime's, and the projected tables hold every
group's account as the report counts it."""

from __future__ import annotations

from typing import Any

from factories import make_workload_data
from run_events import batches_of
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session

from app.core.events import EngineUpdateEnd, Envelope, TurnDone
from app.runtime.report import report_from_events, static_of
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload
from app.store.models import Trajectory
from app.store.repos import EventRepo, GroupRepo, RolloutRepo, RunRepo
from app.store.sink import SqlEventSink


def make_simulated_run(run_id: str, **workload: Any) -> tuple[list[Envelope], dict[str, Any]]:
    data = make_workload_data(batches=3, trajectory={"p_infra_error": 0.2}, **workload)
    wl = Workload.model_validate(data)
    envelopes: list[Envelope] = []
    report = simulate(wl, policy_for(wl, "lanes"), "lanes", timeline=True, events=envelopes.append)
    return [Envelope(run_id, e.seq, e.t, e.event) for e in envelopes], report


def test_report_rebuilt_from_the_store_equals_the_runtimes(conn: Connection, session: Session) -> None:
    envelopes, report = make_simulated_run("sim", policy={"max_staleness": 0})
    sink = SqlEventSink(conn)
    for chunk in batches_of(envelopes, 64):
        sink.write_batch(chunk)

    stored = EventRepo(session).load_envelopes("sim")
    assert stored == envelopes
    assert report_from_events(stored, static_of(report), timeline=True) == report

    account = GroupRepo(session).account("sim")
    assert account.open == 0
    assert GroupRepo(session).orphans("sim") == []
    assert account.admitted == report["admitted_groups"]
    assert account.delivered == report["delivered_groups"] == 3 * 2
    discarded = {reason: n for reason, n in report["discarded_groups"].items() if n}
    assert account.discarded == discarded
    # the projections agree with the stream they came from
    turns = [e.event for e in envelopes if isinstance(e.event, TurnDone)]
    trajectories = session.scalars(select(Trajectory).where(Trajectory.run_id == "sim")).all()
    assert sum(t.tokens for t in trajectories) == sum(t.tokens for t in turns)
    assert sum(t.restarts for t in trajectories) == report["restarted_trajectories"]
    rollouts = RolloutRepo(session).list("sim")
    updates = [e.event for e in envelopes if isinstance(e.event, EngineUpdateEnd)]
    assert sum(len(RolloutRepo(session).steps(r.id)) for r in rollouts) == len(updates)
    run = RunRepo(session).require("sim")
    assert run.state == "completed"
