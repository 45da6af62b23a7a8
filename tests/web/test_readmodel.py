import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.events import EngineUpdateBegin, Envelope, LaneResized, PolicyChanged
from app.web.readmodel import ReportError, RunMeta, view_from_events, view_from_report
from app.web.synthetic import synthetic_run
from app.web.views import make_env


def make_view(**overrides):
    events = synthetic_run(**overrides)
    return view_from_events("run-1", events), events


def test_view_from_events_has_every_trajectory_batch_and_engine():
    view, events = make_view(groups=12, group_size=3, batch_groups=3)
    assert len(view.trajectories) == 12 * 3
    assert len(view.batches) == 4
    assert [e.name for e in view.engines] == ["engine-0", "engine-1"]
    assert all(e.version == 4 for e in view.engines)  # every engine loaded the last publication
    assert view.policy_short == {"B": 3, "G": 3, "S": 3, "K": 3}  # K changed live from 2 to 3
    assert view.audit[0].field == "max_staleness"
    assert sum(view.staleness.values()) == 12
    assert view.attribution is not None
    assert len(view.attribution.batches) == 4
    assert view.last_seq == events[-1].seq


def test_groups_are_ordered_by_completion_and_critical_ones_are_marked():
    view, _ = make_view()
    ordered = view.ordered_groups()
    ready = [g.ready for g in ordered if g.ready is not None]
    assert ready == sorted(ready)
    held = {b.group_id for b in view.attribution.batches if b.wait_s > 0}
    assert {g.group_id for g in view.groups if g.held_batch is not None} == held


def test_spans_have_known_phases_and_versions_change_inside_trajectories():
    view, _ = make_view()
    phases = {s.phase for t in view.trajectories.values() for s in t.spans}
    assert {"reset", "model_turn", "tool_call", "validate", "cleanup"} <= phases
    assert any(len(t.versions) > 1 for t in view.trajectories.values())


def test_live_snapshots_override_engine_state_and_fill_lanes():
    _, events = make_view(groups=4, group_size=2, batch_groups=2)
    tail = events[-1]
    events = [*events, Envelope("run-1", tail.seq + 1, tail.t + 1, EngineUpdateBegin("engine-0", 9))]
    meta = RunMeta(
        engines=[{"name": "engine-1", "in_flight": 3}],
        lanes=[
            {"name": "exec", "cpus": [2, 3], "busy": 1, "slots": 4, "queue_depth": 0, "configured_slots": 2},
            {"name": "reset", "cpus": [2, 3], "busy": 0, "slots": 2, "queue_depth": 0, "configured_slots": 2},
        ],
        now=tail.t + 5,
    )
    view = view_from_events("run-1", events, meta)
    engines = {e.name: e for e in view.engines}
    assert (engines["engine-0"].state, engines["engine-0"].target_version) == ("updating", 9)
    assert engines["engine-1"].in_flight == 3
    lanes = {lane.name: lane for lane in view.lanes}
    assert lanes["exec"].cpus == "2,3"
    assert lanes["exec"].slots == 4
    assert lanes["exec"].p99_wait_s is not None  # from the stream's queue waits
    # Adaptive lanes grew exec from its configured 2 slots to 4: the panel says so; reset kept its 2.
    assert lanes["exec"].configured_slots == 2
    template = make_env().get_template("run.html")
    panel = "".join(template.blocks["lanes"](template.new_context({"view": view})))
    assert re.search(r"1 / 4\s*<span[^>]*>\(configured 2\)</span>", panel)
    assert panel.count("(configured") == 1
    assert view.now == pytest.approx(tail.t + 5 - events[0].t)


def test_a_report_with_its_event_log_replays_in_full():
    events = synthetic_run(groups=8, group_size=2, batch_groups=2)
    report = {"policy": "full", "event_log": [e.to_dict() for e in events], "lower_bound_s": 3.5}
    view = view_from_report("replay-1", report)
    assert view.source == "replay"
    assert view.detailed
    assert view.lower_bound_s == 3.5
    assert len(view.trajectories) == 16


def test_a_report_without_event_log_shows_one_row_per_group():
    report = {
        "policy": "full",
        "run_s": 30.0,
        "policy_config": {"groups_per_batch": 2, "group_size": 4, "surplus_groups": 1, "max_staleness": 2},
        "groups_timeline": [
            {"group": 0, "task": 0, "admitted_s": 0.0, "completed_s": 9.0, "ended_s": 10.0,
             "outcome": "delivered", "batch": 0, "staleness": 0},
            {"group": 1, "task": 1, "admitted_s": 0.0, "completed_s": 4.0, "ended_s": 10.0,
             "outcome": "delivered", "batch": 0, "staleness": 1},
            {"group": 2, "task": 2, "admitted_s": 1.0, "completed_s": None, "ended_s": 12.0,
             "outcome": "stale", "batch": None, "staleness": None},
        ],
        "batch_marks": [{"batch": 0, "requested_s": 0.0, "delivered_s": 10.0}],
        "update_log": [{"t": 11.0, "engine": "engine-0", "version": 1, "phase": "begin"},
                       {"t": 12.0, "engine": "engine-0", "version": 1, "phase": "end"}],
        "engines": {"engine-0": {"final_version": 1}},
    }  # fmt: skip
    view = view_from_report("replay-2", report)
    assert not view.detailed
    assert [g.group_id for g in view.ordered_groups()] == [1, 0, 2]
    assert next(g for g in view.groups if g.group_id == 0).held_batch == 0
    assert next(g for g in view.groups if g.group_id == 2).discarded
    assert view.publications == [(11.0, 1)]
    assert view.policy_short == {"B": 2, "G": 4, "S": 1, "K": 2}


@pytest.mark.parametrize(
    ("report", "field"),
    [
        ([], "report"),
        ({"policy": "full"}, "groups_timeline"),
        ({"event_log": "nope"}, "event_log"),
        ({"event_log": [{"kind": "bogus", "run_id": "r", "seq": 0, "t": 0}]}, "event_log"),
        ({"groups_timeline": [], "lower_bound_s": "x"}, "lower_bound_s"),
        ({"groups_timeline": [{"task": 1}]}, "groups_timeline"),
    ],
)
def test_bad_reports_are_refused_naming_the_field(report, field):
    with pytest.raises(ReportError, match=field):
        view_from_report("r", report)


def test_policy_changes_in_the_stream_update_the_policy():
    events = [Envelope("r", 0, 0.0, PolicyChanged("surplus_groups", 4, 9, "alice"))]
    view = view_from_events("r", events, RunMeta(policy={"surplus_groups": 4}))
    assert view.policy["surplus_groups"] == 9
    assert view.audit[0].actor == "alice"


def test_a_simulated_report_replays_group_by_group():
    from factories import make_workload_data

    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload
    from app.web.timeline import render_timeline

    workload = Workload.model_validate(make_workload_data())
    report = simulate(workload, policy_for(workload, "full"), "full", timeline=True)
    view = view_from_report("replay-1", report)
    assert len(view.groups) == report["admitted_groups"]
    assert len(view.batches) == report["batches"]
    assert [b.wait_s for b in view.batches] == pytest.approx(
        report["batch_collection_s"]["per_batch"], abs=1e-3
    )
    assert sum(view.staleness.values()) == report["delivered_groups"]
    assert view.mean_collection_s == pytest.approx(report["batch_collection_s"]["mean"], abs=1e-3)
    done = [g.ready for g in view.ordered_groups() if g.ready is not None]
    assert done == sorted(done)
    assert 'class="sp"' in render_timeline(view)
    assert view.attribution is not None  # from the report's wait_attribution
    assert view.attribution.largest() == report["wait_attribution"]["largest"]
    assert view.attribution.total_s == pytest.approx(report["wait_attribution"]["total_s"])
    # each batch's mean reward and learning-signal share, from the report's per-batch lists
    assert [b.mean_reward for b in view.batches] == pytest.approx(report["mean_reward_per_batch"])
    assert [b.trainable for b in view.batches] == pytest.approx(report["trainable_share_per_batch"])
    assert report["mean_reward"] == pytest.approx(
        sum(report["mean_reward_per_batch"]) / report["batches"], abs=1e-5
    )


def test_the_owners_plan_settles_updates_and_the_stream_keeps_other_states():
    from app.core.events import EngineStateChanged

    events = [
        Envelope("r", 0, 0.0, EngineUpdateBegin("engine-0", 1)),  # its end is not stored yet
        Envelope("r", 1, 0.5, EngineStateChanged("engine-1", "unhealthy", "failed /health")),
    ]
    meta = RunMeta(
        engines=[
            {"name": "engine-0", "updating": False, "version": 1},
            {"name": "engine-1", "updating": False},
            {"name": "engine-2", "updating": True, "target_version": 2},
        ]
    )
    engines = {e.name: e for e in view_from_events("r", events, meta).engines}
    assert (engines["engine-0"].state, engines["engine-0"].version) == ("serving", 1)
    assert engines["engine-1"].state == "unhealthy"
    assert (engines["engine-2"].state, engines["engine-2"].target_version) == ("updating", 2)


def test_a_bounded_builder_keeps_the_latest_ended_groups_and_the_whole_runs_figures():
    from app.web.readmodel import RunViewBuilder
    from app.web.timeline import render_timeline

    events = synthetic_run(groups=26, group_size=2, batch_groups=4)  # 2 groups left over: cancelled
    full = view_from_events("r", events)
    builder = RunViewBuilder("r", "live", keep_groups=5)
    for env in events:
        builder.on_envelope(env)
    view = builder.view()
    ended = [g for g in full.groups if g.ended is not None]
    assert len([g for g in view.groups if g.ended is not None]) == 5
    assert view.dropped_groups == len(ended) - 5
    assert {gid for gid, _ in view.trajectories} == {g.group_id for g in view.groups}
    assert view.batches == full.batches
    assert view.staleness == full.staleness
    assert view.attribution == full.attribution
    # the groups' counts are the whole run's, those no longer kept included; the page had none, so a
    # run discarding a quarter of its groups as stale showed only red bands in the timeline
    assert view.group_counts == full.group_counts
    assert sum(full.group_counts.values()) == len(full.groups)
    assert full.group_counts == {k: sum(1 for g in full.groups if g.outcome == k) for k in full.group_counts}
    assert next(iter(full.group_counts)) == "delivered"
    assert "cancelled" in full.group_counts  # synthetic_run's leftover groups, or this shows little
    delivered, cancelled = full.group_counts["delivered"], full.group_counts["cancelled"]
    assert f"{delivered} delivered, {cancelled} discarded (cancelled {cancelled})" in full.group_counts_text
    empty = dataclasses.replace(full, groups=[], dropped_outcomes={})
    assert dataclasses.replace(empty, source="replay").group_counts_text == "not in this report"
    assert dataclasses.replace(empty, state="running").group_counts_text == "none yet"
    assert dataclasses.replace(empty, state="completed").group_counts_text == "none"
    assert [g.straggler for g in view.groups] == [
        g.straggler for g in full.groups if g.group_id in {r.group_id for r in view.groups}
    ]
    assert f"of {len(full.groups)} groups" in render_timeline(view)


def test_folding_in_steps_gives_the_same_view_as_all_at_once():
    from app.web.readmodel import RunViewBuilder

    events = synthetic_run(groups=8, group_size=2, batch_groups=2)
    builder = RunViewBuilder("r")
    half = len(events) // 2
    for env in events[:half]:
        builder.on_envelope(env)
    early = builder.view()
    for env in events[half:]:
        builder.on_envelope(env)
    assert builder.view() == view_from_events("r", events)
    assert early == view_from_events("r", events[:half])  # the snapshot did not change under us


def test_a_span_budget_also_bounds_the_ended_groups_kept():
    from app.web.readmodel import RunViewBuilder

    events = synthetic_run(groups=24, group_size=2, batch_groups=4)
    builder = RunViewBuilder("r", "live", keep_spans=100)
    for env in events:
        builder.on_envelope(env)
    view = builder.view()
    ended = [g.group_id for g in view.groups if g.ended is not None]
    kept_spans = sum(len(t.spans) for (gid, _), t in view.trajectories.items() if gid in ended)
    assert 1 <= len(ended) < 24
    assert kept_spans <= 100 + max(len(t.spans) for t in view.trajectories.values()) * 2  # the last may cross
    assert view.dropped_groups + len(view.groups) == 24


def test_a_live_run_states_the_bound_over_its_observed_group_durations():
    view, _ = make_view(groups=12, group_size=3, batch_groups=3)
    assert view.lower_bound_observed
    assert view.lower_bound_s is not None
    # A lower bound on this run's own mean: every batch waited for groups whose observed durations
    # the bound takes as given, so the run cannot have beaten it.
    assert 0 < view.lower_bound_s <= view.mean_collection_s
    owned = view_from_events("run-1", synthetic_run(groups=12, group_size=3, batch_groups=3),
                             RunMeta(lower_bound_s=1.5))  # fmt: skip
    assert owned.lower_bound_s == 1.5
    assert not owned.lower_bound_observed


def test_a_lane_resize_joins_the_audit_list_without_changing_the_policy():
    _, events = make_view(groups=4, group_size=2, batch_groups=2)
    tail = events[-1]
    resized = Envelope("run-1", tail.seq + 1, tail.t + 1, LaneResized("exec", 2, 4, 2, "3 queued"))
    view = view_from_events("run-1", [*events, resized], RunMeta())
    row = view.audit[-1]
    assert (row.actor, row.field, row.old, row.new) == ("adaptive lanes", "lanes.exec.slots", 2, 4)
    assert "lanes.exec.slots" not in view.policy


def test_an_operator_s_publication_joins_the_audit_list_and_the_trainer_s_own_do_not():
    """docs/api.md says the audit trail holds publications; the dashboard's Publish left none there."""
    from app.core.events import VersionPublished
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    _, events = make_view(groups=4, group_size=2, batch_groups=2)
    tail = events[-1]
    own = VersionPublished(7, "/w/7")
    operator = VersionPublished(8, None, actor="alice", command_id="c-1")
    view = view_from_events(
        "run-1",
        [
            *events,
            Envelope("run-1", tail.seq + 1, tail.t + 1, own),
            Envelope("run-1", tail.seq + 2, tail.t + 2, operator),
        ],
        RunMeta(),
    )
    rows = [a for a in view.audit if a.field == "weights"]
    assert [(a.actor, a.old, a.new, a.did) for a in rows] == [
        ("alice", 7, 8, "published weights v8 (a sentinel)")
    ]
    audit = Dashboard(AccessConfig(None, None)).render("run.html", run_context(view), "policy")
    assert "<b>alice</b> published weights v8 (a sentinel)</li>" in audit
    assert "v7" not in "".join(a.did for a in view.audit)  # a built-in trainer's own, with no command


def test_one_actor_s_publications_in_a_row_are_one_audit_row():
    """An external trainer publishing each step through the API (each with a command id) filled the
    list's latest 100 rows, and an operator's change of K went out of it."""
    from app.core.events import VersionPublished

    _, events = make_view(groups=4, group_size=2, batch_groups=2)
    seq, t = events[-1].seq, events[-1].t
    tail = []
    for i, ev in enumerate(
        [
            *(VersionPublished(v, f"/w/{v}", actor="bot", command_id=f"c{v}") for v in range(5, 110)),
            PolicyChanged("max_staleness", 2, 3, "alice"),
            *(VersionPublished(v, f"/w/{v}", actor="bot", command_id=f"c{v}") for v in range(110, 113)),
        ]
    ):
        tail.append(Envelope("run-1", seq + 1 + i, t + i, ev))
    before = view_from_events("run-1", events, RunMeta()).audit_total
    view = view_from_events("run-1", [*events, *tail], RunMeta())
    rows = [(a.actor, a.field, a.did) for a in view.audit][-3:]
    assert rows == [
        ("bot", "weights", "published weights v5–v109 (105 versions)"),
        ("alice", "max_staleness", ""),
        ("bot", "weights", "published weights v110–v112 (3 versions)"),
    ]
    assert view.audit_total == before + 3


def test_an_update_under_way_when_the_run_ends_is_not_shown_updating_for_ever():
    """The engines table said `updating → v2` after the run had ended, from the stream and from the
    owner's plan (which the run leaves as it was); the engines stop with the run, the update's bar ends."""
    from app.core.events import RunEnded, RunStarted

    events = [
        Envelope("r", 0, 0.0, RunStarted(engines=("engine-0", "engine-1"))),
        Envelope("r", 1, 1.0, EngineUpdateBegin("engine-1", 2)),
        Envelope("r", 2, 3.0, RunEnded("stopped")),
    ]
    stale_plan = RunMeta(
        engines=[
            {"name": "engine-0", "version": 1, "in_flight": 0, "state": None, "updating": False},
            {"name": "engine-1", "version": 1, "in_flight": 0, "state": None, "updating": True,
             "target_version": 2},
        ]
    )  # fmt: skip
    for meta in (None, stale_plan):
        view = view_from_events("r", events, meta)
        assert [(e.name, e.state, e.target_version) for e in view.engines] == [
            ("engine-0", "stopped", None),
            ("engine-1", "stopped", None),
        ]
        assert view.updates == [("engine-1", 1.0, 3.0, 2)]


def test_an_engine_that_refused_weights_is_shown_serving_its_version_not_unhealthy():
    """A failed update always showed the engine `unhealthy`: true when it left rotation (a timeout, a
    5xx), not when it refused the weights and serves on at its version."""
    from app.core.events import EngineUpdateEnd, RunStarted

    events = [
        Envelope("r", 0, 0.0, RunStarted(engines=("engine-0", "engine-1"))),
        Envelope("r", 1, 1.0, EngineUpdateBegin("engine-0", 1)),
        Envelope("r", 2, 2.0, EngineUpdateEnd("engine-0", 1)),
        Envelope("r", 3, 3.0, EngineUpdateBegin("engine-0", 2)),
        Envelope("r", 4, 4.0, EngineUpdateEnd("engine-0", 2, ok=False, error="HTTP 400", refused=True)),
        Envelope("r", 5, 4.0, EngineUpdateBegin("engine-1", 2)),
        Envelope("r", 6, 5.0, EngineUpdateEnd("engine-1", 2, ok=False, error="timed out")),
    ]
    view = view_from_events("r", events, None)
    assert [(e.name, e.state, e.version, e.target_version) for e in view.engines] == [
        ("engine-0", "serving", 1, None),
        ("engine-1", "unhealthy", 0, None),
    ]


def test_the_whole_pool_s_state_is_a_note_not_an_engine_named_star():
    """The runtime records 'every engine down' (and its end, and 'every engine given up') under the
    engine name `*`; the engines table showed it as a row, an engine named `*` in state all_down."""
    from app.core.events import EngineStateChanged, RunEnded, RunStarted

    events = [
        Envelope("r", 0, 0.0, RunStarted(engines=("engine-0", "engine-1"))),
        Envelope("r", 1, 1.0, EngineStateChanged("engine-0", "unhealthy")),
        Envelope("r", 2, 1.0, EngineStateChanged("engine-1", "unhealthy")),
        Envelope("r", 3, 1.0, EngineStateChanged("*", "all_down", "every engine is down; turns wait")),
    ]
    down = view_from_events("r", events)
    assert [e.name for e in down.engines] == ["engine-0", "engine-1"]
    assert down.pool_note == "every engine is down; turns wait"
    html = make_env().get_template("run.html")
    block = "".join(html.blocks["engines"](html.new_context({"view": down})))
    assert "every engine is down" in block
    assert 'data-engine="*"' not in block

    back = [*events, Envelope("r", 4, 2.0, EngineStateChanged("*", "serving", "an engine is back"))]
    assert view_from_events("r", back).pool_note is None
    # Still down when the run ended: the note is about a live pool, and the engines are stopped.
    assert view_from_events("r", [*events, Envelope("r", 4, 3.0, RunEnded("stopped"))]).pool_note is None
    given_up = [
        *events,
        Envelope("r", 4, 2.0, EngineStateChanged("*", "given_up", "every engine was given up")),
        Envelope("r", 5, 3.0, RunEnded("error")),
    ]
    view = view_from_events("r", given_up)
    assert [e.name for e in view.engines] == ["engine-0", "engine-1"]
    assert view.pool_note == "every engine was given up"


def test_an_ended_run_s_lanes_have_nothing_queued_and_keep_their_latest_slots():
    """Without the owner's snapshot (after a restart) an ended run's lanes showed the busy slots and
    queue depth its last operation saw, as if work still queued, and no slots."""
    from app.core.events import RunEnded, RunStarted, SandboxOp

    events = [
        Envelope("r", 0, 0.0, RunStarted(lanes=("reset", "exec"))),
        Envelope("r", 1, 1.0, SandboxOp(0, 0, "exec", 0.5, 0.8, 1.0, busy=2, queue_depth=3)),
        Envelope("r", 2, 1.5, LaneResized("exec", 2, 3, 2)),
    ]
    stored = RunMeta(
        lanes=[{"name": "reset", "configured_slots": 4}, {"name": "exec", "configured_slots": 2}]
    )
    running = {lane.name: lane for lane in view_from_events("r", events, stored).lanes}
    assert (running["exec"].busy, running["exec"].queue_depth) == (2, 3)
    ended = {
        lane.name: lane
        for lane in view_from_events("r", [*events, Envelope("r", 3, 2.0, RunEnded("stopped"))], stored).lanes
    }
    assert (ended["exec"].busy, ended["exec"].queue_depth) == (0, 0)
    assert (ended["exec"].slots, ended["exec"].configured_slots) == (3, 2)  # resized, the stream says
    assert (ended["reset"].slots, ended["reset"].configured_slots) == (4, 4)  # as configured


def refusing_run(k, *later):
    """Two engines that each refuse version 1 while serving version 0, under K = `k`; then `later`."""
    from app.core.events import EngineUpdateEnd, RunStarted, VersionPublished

    events = [
        RunStarted(engines=("e0", "e1"), policy={"max_staleness": k}),
        VersionPublished(1),
        EngineUpdateBegin("e0", 1),
        EngineUpdateEnd("e0", 1, ok=False, error="HTTP 400: checkpoint lacks layer.0", refused=True),
        EngineUpdateBegin("e1", 1),
        EngineUpdateEnd("e1", 1, ok=False, error="HTTP 422: bad shape", refused=True),
        *later,
    ]
    return [Envelope("r", i, float(i), ev) for i, ev in enumerate(events)]


def test_refused_weights_are_listed_and_a_run_they_stall_says_so():
    # The runtime only logged each refusal and the stall; the view carried neither.
    view = view_from_events("r", refusing_run(0))
    assert [(r.engine, r.version, r.reason) for r in view.refusals] == [
        ("e0", 1, "HTTP 400: checkpoint lacks layer.0"),
        ("e1", 1, "HTTP 422: bad shape"),
    ]
    assert view.refused == {"e0": 1, "e1": 1}
    assert view.newest_version == 1
    assert view.stall_note == (
        "Stalled: every engine refused v1 and serves v0, more than K = 0 versions behind it, so no turn "
        "can run. Publish a version the engines can load, or raise K."
    )
    ended = view_from_events("r", refusing_run(0), RunMeta(state="stopped"))
    assert ended.stall_note is not None
    assert ended.stall_note.startswith("The run was stalled when it ended")


@pytest.mark.parametrize(
    "later",
    [
        [],  # K = 1: v0 is within K of v1, the engines still serve
        [PolicyChanged("max_staleness", 0, 1, "operator")],  # K raised past the gap
    ],
)
def test_refusals_within_k_or_after_k_is_raised_do_not_stall(later):
    k = 1 if not later else 0
    view = view_from_events("r", refusing_run(k, *later))
    assert len(view.refusals) == 2
    assert view.stall_note is None


def test_a_newer_version_loaded_or_a_drained_engine_s_refusal_ends_the_stall():
    from app.core.events import EngineStateChanged, EngineUpdateEnd, VersionPublished

    loaded = [VersionPublished(2), EngineUpdateBegin("e0", 2), EngineUpdateEnd("e0", 2)]
    assert view_from_events("r", refusing_run(0, *loaded)).stall_note is None
    # a newer version published but not offered yet: the engines may load it, so no stall is claimed
    assert view_from_events("r", refusing_run(0, VersionPublished(2))).stall_note is None
    # a drained engine is out of rotation: the one left still refuses, so the run is still stalled
    drained = view_from_events("r", refusing_run(0, EngineStateChanged("e1", "draining")))
    assert drained.stall_note is not None


def test_the_engines_block_lists_refusals_and_the_stall():
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    view = view_from_events("r", refusing_run(0), RunMeta(state="running"))
    html = Dashboard(AccessConfig(None, None)).render("run.html", run_context(view), "engines")
    assert 'id="stall-note"' in html
    assert "Stalled: every engine refused v1" in html
    assert "Weights v1: 0 of 2 engines loaded, 2 refused." in html
    row = r'<tr><td>(\w+)</td><td class="num">v(\d+)</td><td class="num">([\d.]+ s)</td>'
    assert re.findall(row, html) == [("e1", "1", "5.0 s"), ("e0", "1", "3.0 s")]  # newest first
    assert "checkpoint lacks layer.0" in html
    assert html.count('class="refused"') == 2


def test_a_refusal_s_reason_reads_as_the_engine_s_own_message():
    # The read model parsed the message string back (a regex, then ast.literal_eval of the body's repr):
    # the error now says it itself, and the event carries it.
    from app.core.events import EngineUpdateEnd, Envelope, envelope_from_dict
    from app.engines.errors import EngineRequestError

    body = '{"error":"refused weights (still serving version 0): checkpoint \'/w/v1\' lacks 7 tensors"}'
    error = EngineRequestError("http://127.0.0.1:4000", "/update_weights", 400, body)
    said = (
        "HTTP 400 from /update_weights: refused weights (still serving version 0): checkpoint '/w/v1' "
        "lacks 7 tensors"
    )
    assert error.summary == said
    for other in (
        EngineRequestError("http://e", "/update_weights", 422, "not json"),
        EngineRequestError("http://e", "/update_weights", 400, '{"error": 7}'),
        EngineRequestError("http://e", "/update_weights", 400, '["error"]'),
    ):
        assert other.summary == str(other)
    event = EngineUpdateEnd("e0", 1, ok=False, error=str(error), refused=True, said=error.summary)
    stored = envelope_from_dict(Envelope("r", 3, 3.0, event).to_dict())  # a stream written and read back
    view = view_from_events("r", [*refusing_run(0)[:3], stored], RunMeta(state="running"))
    assert [(r.engine, r.summary, r.reason) for r in view.refusals] == [("e0", said, str(error))]
    old = {k: v for k, v in stored.to_dict().items() if k != "said"}  # stored before events carried it
    view = view_from_events("r", [*refusing_run(0)[:3], envelope_from_dict(old)], RunMeta(state="running"))
    assert [r.summary for r in view.refusals] == [str(error)]


def test_a_simulated_report_without_its_group_timeline_replays_its_batches_engines_and_lanes():
    # A plain `corral sim` report (no --plot) was refused ('groups_timeline: missing') although the
    # runs page offers to browse corral sim reports.
    from factories import make_workload_data

    from app.sim.run import policy_for, simulate
    from app.sim.workload import Workload
    from app.web.readmodel import NO_GROUPS_NOTE
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    workload = Workload.model_validate(make_workload_data())
    report = simulate(workload, policy_for(workload, "full"), "full")
    assert "groups_timeline" not in report
    view = view_from_report("plain", report)
    assert view.timeline_note == NO_GROUPS_NOTE
    assert view.groups == []
    assert [b.wait_s for b in view.batches] == pytest.approx(report["batch_collection_s"]["per_batch"])
    assert {e.name for e in view.engines} == set(report["engines"])
    assert {lane.name for lane in view.lanes} == set(report["lanes"])
    assert view.attribution is not None
    page = Dashboard(AccessConfig(None, None)).render(
        "run.html", {**run_context(view), "csrf": "", "csrf_field": ""}
    )
    assert 'id="timeline-note"' in page
    # it said 'Weights v0: 2 of 2 engines loaded': the newest version came from publications alone
    newest = max(e["final_version"] for e in report["engines"].values())
    loaded = sum(1 for e in report["engines"].values() if e["final_version"] == newest)
    assert f"Weights v{newest}: {loaded} of {len(report['engines'])} engines loaded." in page
    # a replay's empty charts said 'no data yet', as if more would come
    trainer = Dashboard(AccessConfig(None, None)).render("run.html", run_context(view), "trainer")
    assert "no data yet" not in trainer
    # tokens/s, staleness and group time: no groups, no turns
    assert trainer.count(">not in this report</text>") == 3
    # the report's per-batch rewards are drawn, a bar a batch, each saying its learning signal
    assert [b.mean_reward for b in view.batches] == pytest.approx(report["mean_reward_per_batch"])
    reward = trainer[trainer.index('aria-label="mean reward per step"') :].split("</svg>")[0]
    assert reward.count("<rect") == report["batches"]
    assert "of its groups with a learning signal" in reward


def test_an_engine_more_than_k_behind_is_marked_as_taking_no_turns():
    # Such an engine showed '● serving' with 0 turns in flight and nothing saying the runtime routes it
    # none (every turn it served would make its group too stale at once).
    from app.core.events import EngineUpdateEnd, RunStarted, VersionPublished
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    events = [
        RunStarted(engines=("e0", "e1"), policy={"max_staleness": 1}),
        VersionPublished(1),
        EngineUpdateBegin("e0", 1),
        EngineUpdateEnd("e0", 1),
        VersionPublished(2),
        EngineUpdateBegin("e0", 2),
        EngineUpdateEnd("e0", 2),
    ]
    envs = [Envelope("r", i, float(i), ev) for i, ev in enumerate(events)]
    view = view_from_events("r", envs, RunMeta(state="running"))
    assert [(e.name, e.version, e.too_stale) for e in view.engines] == [("e0", 2, False), ("e1", 0, True)]
    html = Dashboard(AccessConfig(None, None)).render("run.html", run_context(view), "engines")
    assert html.count("too stale: no turns") == 1
    # within K again (K raised), or once the run has ended, nothing is marked
    raised = [*envs, Envelope("r", 7, 7.0, PolicyChanged("max_staleness", 1, 2, "operator"))]
    assert not any(e.too_stale for e in view_from_events("r", raised, RunMeta(state="running")).engines)
    assert not any(e.too_stale for e in view_from_events("r", envs, RunMeta(state="stopped")).engines)


def test_an_engine_drained_and_returned_is_audited_and_left_out_of_the_progress():
    # A drain and a return were missing from the audit list ("No change yet."), and the progress line
    # read "Weights v2: 0 of 2 engines loaded." with one of the two drained.
    from app.core.events import EngineStateChanged, EngineUpdateEnd, RunStarted, VersionPublished
    from app.web.security import AccessConfig
    from app.web.views import Dashboard, run_context

    events = [
        RunStarted(engines=("engine-0", "engine-1"), policy={"max_staleness": 2}),
        EngineStateChanged("engine-0", "draining", "drained by operator"),
        VersionPublished(1),
        EngineUpdateBegin("engine-1", 1),
        EngineUpdateEnd("engine-1", 1),
        EngineStateChanged("engine-0", "serving", "returned by ops-bot"),
        EngineStateChanged("engine-1", "unhealthy", "health check failed"),  # not an operator's change
    ]
    envs = [Envelope("r", i, float(i), ev) for i, ev in enumerate(events)]
    render = Dashboard(AccessConfig(None, None)).render

    drained = view_from_events("r", envs[:5], RunMeta(state="running"))
    html = render("run.html", run_context(drained), "engines")
    assert "Weights v1: 1 of 1 engines in rotation loaded; engine-0 drained." in html
    audit = render("run.html", run_context(drained), "policy")
    assert "<b>operator</b> took engine-0 out of rotation</li>" in audit

    returned = view_from_events("r", envs, RunMeta(state="running"))
    assert [(a.t, a.actor, a.field, a.old, a.new) for a in returned.audit] == [
        (1.0, "operator", "engines.engine-0", "in rotation", "drained"),
        (5.0, "ops-bot", "engines.engine-0", "drained", "in rotation"),
    ]
    html = render("run.html", run_context(returned), "engines")
    assert "Weights v1: 1 of 2 engines loaded." in html
    audit = render("run.html", run_context(returned), "policy")
    assert audit.index("returned engine-0 to rotation") < audit.index("took engine-0 out of rotation")


def test_a_drained_engine_whose_update_ends_or_that_restarts_stays_draining():
    # The drain lets an update under way finish, and its end set the row back to "serving" (with a
    # "too stale" mark), so the page offered to take out an engine already out of rotation.
    from app.core.events import EngineStateChanged, EngineUpdateEnd, RunStarted, rotation_detail

    events = [
        RunStarted(engines=("engine-0", "engine-1"), policy={"max_staleness": 2}),
        EngineUpdateBegin("engine-0", 1),
        EngineStateChanged("engine-0", "draining", rotation_detail("drained", "operator")),
        EngineUpdateEnd("engine-0", 1),
    ]
    envs = [Envelope("r", i, float(i), ev) for i, ev in enumerate(events)]

    def state(envelopes: list[Envelope], meta: RunMeta) -> str:
        return {e.name: e.state for e in view_from_events("r", envelopes, meta).engines}["engine-0"]

    assert state(envs, RunMeta(state="running")) == "draining"
    snapshot = RunMeta(state="running", engines=[{"name": "engine-0", "version": 1, "updating": False}])
    assert state(envs[:3], snapshot) == "draining"  # the owner's plan ended the update first
    later = [
        EngineStateChanged("engine-0", "unhealthy", "exited"),
        EngineStateChanged("engine-0", "serving", "back at version 1"),
        EngineStateChanged("engine-0", "serving", rotation_detail("returned", "op")),
    ]
    restarted = envs + [Envelope("r", 4 + i, 4.0 + i, ev) for i, ev in enumerate(later)]
    assert state(restarted[:6], RunMeta(state="running")) == "draining"  # out of rotation until put back
    returned = restarted
    assert state(returned, RunMeta(state="running")) == "serving"


def completion_order_run(
    durations: list[float], steps: list[float], head_start: float, b: int, s: int
) -> list[Envelope]:
    """A run's events as a completion-order collector makes them: B + S groups live, each batch the
    first B ready; the trainer takes `steps[k]` after batch k, and asks for its first batch
    `head_start` after the first admissions."""
    import heapq

    from app.core.events import BatchDelivered, BatchRequested, GroupAdmitted, GroupReady, RunStarted

    timed: list[tuple[float, int, object]] = []

    def at(t: float, event: object) -> None:
        timed.append((t, len(timed), event))

    at(0.0, RunStarted({"groups_per_batch": b, "surplus_groups": s, "group_size": 1, "max_staleness": 2}))
    todo = iter(enumerate(durations))
    live: list[tuple[float, int]] = []

    def admit(t: float) -> None:
        for gid, d in todo:
            at(t, GroupAdmitted(gid, gid, 1))
            heapq.heappush(live, (t + d, gid))
            return

    for _ in range(b + s):
        admit(0.0)
    ready: list[tuple[float, int]] = []
    requested = head_start
    for k, step in enumerate([*steps, 0.0]):
        at(requested, BatchRequested(k))
        while len(ready) < b and live:
            done, gid = heapq.heappop(live)
            at(done, GroupReady(gid))
            ready.append((done, gid))
            admit(done)
        if len(ready) < b:
            break
        batch, ready = ready[:b], ready[b:]
        delivered = max(requested, batch[-1][0])
        at(delivered, BatchDelivered(k, tuple(g for _, g in batch), 0, requested, batch[-1][0]))
        requested = delivered + step
    return [Envelope("run-1", seq, t, ev) for seq, (t, _, ev) in enumerate(sorted(timed))]


@settings(max_examples=300, deadline=None)
@given(
    durations=st.lists(st.floats(0.1, 50.0), min_size=4, max_size=60),
    steps=st.lists(st.floats(0.0, 30.0), min_size=0, max_size=20),
    head_start=st.floats(0.0, 40.0),
    b=st.integers(1, 4),
    s=st.integers(0, 3),
)
def test_the_observed_bound_never_exceeds_the_runs_own_mean(durations, steps, head_start, b, s):
    """What the page calls a lower bound is one: on any completion-order run, whatever its trainer's
    steps and however long before its first request groups were admitted. The shortest step seen,
    taken for every step, and groups admitted before the first request, put a real run's bound above
    its own mean (the demo's page showed 3.3 s against 3.2 s)."""
    view = view_from_events("run-1", completion_order_run(durations, steps, head_start, b, s), RunMeta())
    if not view.batches:
        return
    assert view.lower_bound_observed
    assert view.lower_bound_s is not None
    assert view.lower_bound_s <= view.mean_collection_s + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    durations=st.lists(st.floats(0.1, 50.0), min_size=4, max_size=60),
    b=st.integers(1, 4),
    s=st.integers(1, 6),
    lowered_to=st.integers(0, 5),
)
def test_the_observed_bound_holds_after_a_live_change_lowers_s(durations, b, s, lowered_to):
    """The bound took the S of the latest live change for the whole run: after an operator set S from 2
    to 0, the page read 'mean 0.9 s, lower bound (observed) 1.1 s'. It takes the largest S the run had."""
    events = completion_order_run(durations, [0.0] * (len(durations) // b), 0.0, b, s)
    last = events[-1]
    change = PolicyChanged("surplus_groups", s, min(lowered_to, s - 1))
    view = view_from_events("run-1", [*events, Envelope("run-1", last.seq + 1, last.t, change)], RunMeta())
    if not view.batches:
        return
    assert view.policy["surplus_groups"] == min(lowered_to, s - 1)  # the page shows S as it is now
    assert view.lower_bound_s is not None
    assert view.lower_bound_s <= view.mean_collection_s + 1e-9


def test_an_s_that_admitted_no_group_leaves_the_observed_bound_as_it_was() -> None:
    """The bound took the largest S the run ever had: an S of 900 set for a moment while the run was
    paused, then put back, took it from 0.6 s to 0.0 s for the rest of the run. Only an S some group was
    admitted under counts."""
    durations = [float(d) for d in (5, 9, 3, 7, 4, 8, 6, 2, 9, 5, 3, 7)]
    events = completion_order_run(durations, [0.5] * 6, 0.0, 2, 1)
    last = events[-1]
    spike = [
        Envelope("run-1", last.seq + 1, last.t, PolicyChanged("surplus_groups", 1, 900)),
        Envelope("run-1", last.seq + 2, last.t, PolicyChanged("surplus_groups", 900, 1)),
    ]
    plain = view_from_events("run-1", events, RunMeta())
    spiked = view_from_events("run-1", [*events, *spike], RunMeta())
    assert plain.lower_bound_s is not None
    assert plain.lower_bound_s > 0
    assert spiked.lower_bound_s == plain.lower_bound_s


def test_the_observed_bound_of_an_attempts_admission_run_is_its_order_statistic() -> None:
    """Attempts admission can have more than B + S groups live, so the capacity term in groups is no bound
    for it: eight 10 s groups, B = 2, S = 0, two batches delivered at 10 s and 20 s."""
    from app.web.readmodel import _observed_bound

    # the first batch asked for at 0 s, two batches, the trainer's step between them 0 s
    policy = {"groups_per_batch": 2, "surplus_groups": 0}
    # B + S groups live: 4 groups of 10 s through 2 places take 20 s, so the mean is at least 10 s
    assert _observed_bound([10.0] * 8, 0.0, 0.0, 2, [0.0], {**policy, "admission": "in_flight"}) == 10.0
    # attempts admission: only that no group is ready before 10 s, so the mean is at least 5 s
    assert _observed_bound([10.0] * 8, 0.0, 0.0, 2, [0.0], {**policy, "admission": "attempts"}) == 5.0


def test_each_batch_s_mean_reward_and_learning_signal_come_from_its_groups():
    view, events = make_view(groups=12, group_size=3, batch_groups=3)
    delivered = [e.event for e in events if e.event.kind == "group_delivered"]
    for batch in view.batches:
        rewards = [r for ev in delivered if ev.batch_index == batch.index for r in ev.rewards]
        assert len(rewards) == 3 * 3
        assert batch.mean_reward == pytest.approx(sum(rewards) / len(rewards))
        assert batch.trainable == 1.0  # uniform draws: no group's three rewards are all equal


def test_a_batch_whose_groups_all_solved_or_all_failed_has_no_learning_signal():
    from app.core.events import BatchDelivered, BatchRequested, GroupAdmitted, GroupDelivered, RunStarted

    policy = {"groups_per_batch": 2, "group_size": 2, "surplus_groups": 0, "max_staleness": 1}
    stream = [
        RunStarted(policy),
        GroupAdmitted(0, 0, 2, "a"),
        GroupAdmitted(1, 1, 2, "b"),
        BatchRequested(0),
        GroupDelivered(0, 0, 0, (1.0, 1.0)),
        GroupDelivered(1, 0, 0, (0.0, 1.0)),
        BatchDelivered(0, (0, 1), 0, 0.0, 1.0),
    ]
    envelopes = [Envelope("run-1", i, float(i), ev) for i, ev in enumerate(stream)]
    (batch,) = view_from_events("run-1", envelopes).batches
    assert batch.mean_reward == pytest.approx(0.75)
    assert batch.trainable == pytest.approx(0.5)


def test_a_long_run_s_live_view_keeps_its_newest_batches_and_the_whole_run_s_figures():
    """A live view kept every batch's row, critical path, publication and engine updates (about 1.9 KB
    a batch: a long fast run's server grew 3.7 KiB of RSS a version while its page was watched). Fed a
    3,000-batch stream, a view keeping its newest batches holds a bounded number of each however far
    the stream goes, and every block of the run page renders the same as from a view of every batch."""
    from app.web.live import KEEP_GROUPS, KEEP_SPANS
    from app.web.readmodel import BATCHES_KEPT, PATHS_KEPT, RunViewBuilder
    from app.web.security import AccessConfig
    from app.web.series import MOST_BUCKETS
    from app.web.views import LIVE_BLOCKS, Dashboard, run_context

    events = synthetic_run(groups=6000, group_size=2, batch_groups=2, turns=2)
    bounded = RunViewBuilder("long", "live", KEEP_GROUPS, KEEP_SPANS, BATCHES_KEPT)
    whole = RunViewBuilder("long", "live", KEEP_GROUPS, KEEP_SPANS)  # every batch's rows
    kept = []
    for env in events:
        bounded.on_envelope(env)
        whole.on_envelope(env)
        if env.event.kind == "batch_delivered" and env.event.batch_index % 250 == 249:
            kept.append(
                (
                    len(bounded.batches),
                    len(bounded.publications),
                    len(bounded.updates),
                    len(bounded.waits.result().batches),
                    bounded.waits.kept_windows,
                    max(len(s.buckets) for s in vars(bounded.trend).values() if hasattr(s, "buckets")),
                )
            )
    assert len(kept) == 12  # 3,000 batches
    assert max(k[0] for k in kept) == max(k[1] for k in kept) == max(k[2] for k in kept) == BATCHES_KEPT
    assert max(k[3] for k in kept) == PATHS_KEPT
    assert max(k[4] for k in kept) <= 4  # windows that may still reach a batch: an engine's latest or two
    assert max(k[5] for k in kept) <= MOST_BUCKETS

    meta = RunMeta(state="running")
    view, full = bounded.view(meta), whole.view(meta)
    assert len(full.batches) == full.batches_delivered == view.batches_delivered == 3000
    assert view.batches == full.batches[-BATCHES_KEPT:]
    assert view.batches_dropped == 3000 - BATCHES_KEPT
    assert view.trainer_wait_s == full.trainer_wait_s
    assert view.mean_collection_s == full.mean_collection_s
    assert view.idle_fraction == full.idle_fraction
    assert view.summary() == full.summary()
    assert view.lower_bound_s == full.lower_bound_s
    assert view.staleness == full.staleness
    assert view.groups == full.groups  # the held batches and straggler flags of the kept groups
    assert any(g.held_batch is not None for g in view.groups)
    assert view.attribution is not None
    assert full.attribution is not None
    assert view.attribution.batches == full.attribution.batches[-PATHS_KEPT:]
    assert view.attribution.phases == full.attribution.phases
    assert view.attribution.total_s == full.attribution.total_s
    assert view.attribution.summary() == full.attribution.summary()
    assert "over 3000 batches" in view.attribution.summary()
    dash = Dashboard(AccessConfig(None, None))
    blocks = {b: dash.render("run.html", run_context(view), b) for b in LIVE_BLOCKS}
    assert blocks == {b: dash.render("run.html", run_context(full), b) for b in LIVE_BLOCKS}
    assert 'id="batches-delivered">3000<' in blocks["summary"]
    assert "a bar is the mean of 32 steps" in blocks["trainer"]
    from app.web.timeline import render_timeline

    assert render_timeline(view) == render_timeline(full)  # the latest groups' batches are all kept
