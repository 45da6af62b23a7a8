"""ManagerRuns against the service's real run manager (SQLite store, a paced simulated run)."""

import asyncio
import html
import re
import time

import httpx
import pytest
from fastapi import FastAPI

from app.engines.embedded.weights import save_sentinel
from app.service.manager import RunManager
from app.service.schemas import RunCreate, small_workload
from app.service.store import ServiceStore
from app.web.backend import ActionRefused
from app.web.live import ManagerRuns, clock_note, trainer_note, wall_duration
from app.web.readmodel import RunMeta
from app.web.security import AccessConfig
from app.web.views import Dashboard, mount_dashboard


@pytest.fixture
def runs(tmp_path):
    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}"), tmp_path / "data", 30.0)
    yield ManagerRuns(lambda: manager)
    manager.shutdown()


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


async def test_a_launched_run_is_viewed_and_acted_on(runs):
    run_id = await runs.launch({"policy": "full", "surplus_groups": "3", "name": "live-test"}, "tester")
    assert run_id in runs.run_ids()
    await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).batches) >= 2)
    view = runs.view(run_id)
    assert view.state == "running"
    assert view.label == "live-test"
    assert view.started_at is not None
    assert 0 <= time.time() - view.started_at < 60  # the stored start, for the runs page
    assert view.policy_short["S"] == 3
    assert view.span_count > 0
    assert {e.name for e in view.engines} == {"engine-0", "engine-1"}
    assert all(lane.slots for lane in view.lanes)  # from the run's lanes
    assert {lane.order for lane in view.lanes} == {"first come, first served"}  # the default lanes.order
    assert view.attribution is not None
    assert view.attribution.total_s == pytest.approx(sum(b.wait_s for b in view.batches), abs=1e-6)

    await runs.set_policy(run_id, {"max_staleness": 7}, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).audit)
    view = runs.view(run_id)
    assert view.policy["max_staleness"] == 7
    assert (view.audit[-1].field, view.audit[-1].new, view.audit[-1].actor) == ("max_staleness", 7, "tester")

    target = max(e.version for e in view.engines) + 1
    await runs.publish(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: all(e.version >= target for e in runs.view(run_id).engines))

    await runs.stop(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state in ("stopped", "completed"))
    with pytest.raises(ActionRefused):
        await runs.publish(run_id, "tester")


async def test_a_run_launched_with_attempts_admission_admits_by_attempts(runs):
    # The form had no admission field, and the API none either: only `corral sim` and a local run's
    # config could ask for attempts admission.
    run_id = await runs.launch({"policy": "full", "admission": "attempts", "name": "attempts"}, "tester")
    await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).batches) >= 1)
    view = runs.view(run_id)
    assert view.policy["admission"] == "attempts"
    assert view.policy["ready_surplus"] is None  # attempts admission keeps its own cap on ready groups
    handle = runs.manager.get(run_id)
    assert handle.runtime.scheduler.policy.admission.value == "attempts"
    await runs.stop(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state in ("stopped", "completed"))


async def test_a_run_is_paused_and_resumed_from_the_dashboard(runs):
    # The dashboard could stop a run but neither pause nor resume one (only the API could).
    run_id = await runs.launch({"policy": "full", "name": "pause-test"}, "tester")
    await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).batches) >= 1)
    handle = runs.manager.get(run_id)
    await runs.pause(run_id, "tester")
    assert handle.state.value == "paused"
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "paused")
    now = handle.loop.time()
    await asyncio.sleep(0.5)
    assert handle.loop.time() == now  # a simulated run's clock stands still while paused
    with pytest.raises(ActionRefused, match="is paused; this needs it running"):
        await runs.pause(run_id, "tester")
    await runs.resume(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "running")
    await asyncio.to_thread(wait_for, lambda: handle.loop.time() > now)
    with pytest.raises(ActionRefused, match="is running; this needs it paused"):
        await runs.resume(run_id, "tester")
    await runs.stop(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state in ("stopped", "completed"))
    with pytest.raises(ActionRefused):
        await runs.resume(run_id, "tester")


@pytest.mark.parametrize(
    ("form", "field"),
    [
        ({"groups_per_batch": "0"}, "groups_per_batch"),
        ({"max_staleness": "x"}, "max_staleness"),
        ({"policy": "fastest"}, "policy"),
        ({"batches": "-1"}, "batches"),
        # int() takes other scripts' digits: these launched runs with K = 3, B = 3 and 12 batches
        ({"max_staleness": "\u0663"}, "max_staleness: expected a whole number"),  # Arabic-Indic 3
        ({"groups_per_batch": "\uff13"}, "groups_per_batch: expected a whole number"),  # fullwidth 3
        ({"batches": "\u0967\u0968"}, "batches: expected a whole number"),  # Devanagari 12
        ({"surplus_groups": "1_0"}, "surplus_groups: expected a whole number"),
        # the sync rung sets S = 0: this launched a run showing S = 0 with nothing said
        ({"policy": "sync", "surplus_groups": "1"}, "surplus_groups: policy sync runs without surplus"),
        # a check across fields: pydantic's "Value error," reached the page ("run: Value error, ...")
        ({"groups_per_batch": "4096", "group_size": "1024"}, "groups_per_batch, group_size: \\(B \\+ S\\)"),
        ({"admission": "tokens"}, "admission"),
        ({"agent_gate": "abc"}, "agent_gate: expected a number, got 'abc'"),
        ({"agent_gate": "nan"}, "agent_gate: expected a number"),  # float() takes these
        ({"agent_gate": "inf"}, "agent_gate: expected a number"),
        ({"agent_gate": "1_0"}, "agent_gate: expected a number"),
        ({"agent_gate": "1e400"}, "agent_gate: expected a number"),  # float() makes it inf
        ({"agent_gate": "-1"}, "agent_gate: Input should be greater than or equal to 0"),
        ({"agent_gate": "1e9"}, "agent_gate: Input should be less than or equal to 1000"),
    ],
)
async def test_a_bad_launch_form_names_the_field(runs, form, field):
    with pytest.raises(ValueError, match=f"^{field}") as refused:
        await runs.launch(form, "tester")
    assert "Value error" not in str(refused.value)
    assert runs.run_ids() == []


@pytest.mark.slow
@pytest.mark.parametrize("sentinel", [True, False])
async def test_the_dashboard_publishes_weights_disk_engines_load_or_is_refused(runs, sentinel):
    # The dashboard published without a path: an engine that loads weights from disk refused the
    # update with a ValueError that failed the whole run. Now it is a sentinel version with its files,
    # as the API's `sentinel: true`, which sentinel engines load; engines of real weights would refuse
    # it, every version, so the dashboard refuses to publish it (a 422 note) and nothing changes.
    manager = runs.manager
    run_id = disk_local_run(manager, max_staleness=2, sentinel=sentinel)
    handle = manager.get(run_id)
    await asyncio.to_thread(wait_for, lambda: handle.state.value == "running", 120)

    def rollout():
        return handle.submit(handle.rollout, 1).result(10)

    if sentinel:
        await runs.publish(run_id, "tester")
        await asyncio.to_thread(wait_for, lambda: rollout()["state"] != "running", 60)
        assert rollout()["path"] is not None
        assert rollout()["state"] == "completed"
    else:
        with pytest.raises(ValueError, match=r"engines\.sentinel: false"):
            await runs.publish(run_id, "tester")
        assert handle.runtime.version == 0
        assert runs.view(run_id).publications == []
    assert handle.state.value == "running"
    await runs.stop(run_id, "tester")
    await asyncio.to_thread(wait_for, lambda: handle.state.value == "stopped", 60)


async def test_an_ended_run_s_lanes_after_a_restart_show_what_was_stored_and_nothing_queued(tmp_path):
    # After a restart an ended run's Lanes table said '—' for its CPU set and slots, and the queue depth
    # its last operation saw (1 or more) as if work still queued.
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    manager = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    runs = ManagerRuns(lambda: manager)
    try:
        run_id = await runs.launch({"policy": "full", "name": "lanes-test"}, "tester")
        await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).batches) >= 2)
        await runs.stop(run_id, "tester")
        await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "stopped")
        ended_here = {lane.name: lane for lane in runs.view(run_id).lanes}
    finally:
        manager.shutdown()

    restarted = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    try:
        view = ManagerRuns(lambda: restarted).view(run_id)
    finally:
        restarted.shutdown()
    assert view is not None
    assert view.state == "stopped"
    lanes = {lane.name: lane for lane in view.lanes}
    assert set(lanes) == set(ended_here) == {"reset", "exec", "validate", "cleanup"}
    for name, lane in lanes.items():
        assert (lane.busy, lane.queue_depth) == (0, 0)
        assert lane.slots == ended_here[name].slots  # the run config's, as stored
        assert lane.cpus == ended_here[name].cpus  # as recorded while it ran
        assert lane.order is None  # known only from lanes executing here
        assert (ended_here[name].busy, ended_here[name].queue_depth) == (0, 0)


def disk_local_run(manager, max_staleness, sentinel=False):
    """A local run of one embedded engine, which loads weights from disk: of real weights by default
    (engines.sentinel: false), so it refuses every checkpoint of the sentinel tensor alone."""
    import os

    from app.service.schemas import RunCreate

    cpus = sorted(os.sched_getaffinity(0))
    serving, lanes = (cpus[:1], cpus[1:2]) if len(cpus) > 1 else (cpus, cpus)
    config = {
        "batch": {"groups": 1, "group_size": 2},
        "policy": {"surplus_groups": 1, "max_staleness": max_staleness, "max_updating_engines": 1},
        "engines": {"count": 1, "cpus": serving, "slots": 4, "layers": 1, "hidden": 16, "max_tokens": 8,
                    "sentinel": sentinel},
        "lanes": {"cpus": lanes, "reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
        "tasks": {"suite": "builtin", "include": ["fix-off-by-one"]},
    }  # fmt: skip
    return manager.create(RunCreate.model_validate({"name": "refuses", "kind": "local", "config": config}))


async def run_page_blocks(runs, run_id):
    """The run page and its engines and summary blocks, as the dashboard serves them over `runs`."""
    import httpx
    from fastapi import FastAPI

    from app.web.security import AccessConfig
    from app.web.views import Dashboard, mount_dashboard

    app = FastAPI()
    mount_dashboard(app, Dashboard(AccessConfig(None, None), live=runs))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        page = (await client.get(f"/runs/{run_id}")).text
        blocks = {b: (await client.get(f"/runs/{run_id}/block/{b}")).text for b in ("engines", "summary")}
    return page, blocks


@pytest.mark.slow
async def test_a_run_stalled_by_refused_weights_says_so_live_and_after_a_restart(tmp_path):
    # Engines that refuse every publication (sentinel weights to engines of real weights) stall the run
    # once they are more than K behind; the runtime only logged it and the run page showed nothing.
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    manager = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    runs = ManagerRuns(lambda: manager)
    try:
        run_id = disk_local_run(manager, max_staleness=0)
        handle = manager.get(run_id)
        await asyncio.to_thread(wait_for, lambda: handle.state.value == "running", 120)
        # An external trainer publishes a checkpoint of the sentinel tensor alone (the API's weights
        # route with a path), which these engines refuse.
        weights = tmp_path / "v1"
        save_sentinel(weights, 1.0)
        await handle.call(handle.publish, 1, str(weights), "trainer")
        await asyncio.to_thread(wait_for, lambda: runs.view(run_id).refusals, 60)
        view = runs.view(run_id)
        (refusal,) = view.refusals
        assert (refusal.engine, refusal.version) == ("engine-0", 1)
        assert "lacks" in refusal.reason
        assert view.stall_note is not None
        assert view.stall_note.startswith("Stalled: every engine refused v1")
        page, blocks = await run_page_blocks(runs, run_id)
        for html in (page, blocks["engines"]):
            assert 'id="refusals"' in html
            assert "lacks" in html
            assert 'id="stall-note"' in html
            assert "Weights v1: 0 of 1 engines loaded, 1 refused." in html
        assert 'id="stall-summary"' in blocks["summary"]
        await runs.stop(run_id, "tester")
        await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "stopped", 60)
    finally:
        manager.shutdown()

    restarted = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    try:
        runs = ManagerRuns(lambda: restarted)
        view = runs.view(run_id)
        page, blocks = await run_page_blocks(runs, run_id)
    finally:
        restarted.shutdown()
    assert view is not None
    assert view.state == "stopped"
    assert [(r.engine, r.version, r.reason) for r in view.refusals] == [
        (refusal.engine, refusal.version, refusal.reason)
    ]
    assert view.stall_note is not None
    assert view.stall_note.startswith("The run was stalled when it ended: every engine refused v1")
    assert 'id="refusals"' in blocks["engines"]
    assert "lacks" in blocks["engines"]
    assert "The run was stalled when it ended" in page


async def test_a_sync_run_refuses_a_surplus_from_the_policy_form(runs):
    # The sync rung has no surplus (S = 0); the policy form set S = 3 on it live and the run went on
    # admitting groups beyond B, no longer the rung it was launched as.
    run_id = await runs.launch({"policy": "sync", "name": "sync-s"}, "tester")
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "running")
    with pytest.raises(
        ValueError, match=r"surplus_groups: policy sync runs without surplus \(S = 0\), got 3"
    ):
        await runs.set_policy(run_id, {"surplus_groups": 3}, "tester")
    await runs.set_policy(run_id, {"max_staleness": 4, "surplus_groups": 0}, "tester")  # K still changes
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).policy["max_staleness"] == 4)
    assert runs.view(run_id).policy["surplus_groups"] == 0
    await runs.stop(run_id, "tester")


async def test_the_launch_form_shows_the_values_its_empty_fields_take(runs):
    # Every field said 'default', with nothing saying what that was: a run launched empty showed B, G,
    # S and K the operator first saw on its page.
    import html
    import re

    import httpx
    from fastapi import FastAPI

    from app.web.security import AccessConfig
    from app.web.views import Dashboard, mount_dashboard

    app = FastAPI()
    mount_dashboard(app, Dashboard(AccessConfig(None, None), live=runs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        page = (await client.get("/")).text
    shown = {
        name: html.unescape(text)
        for name, text in re.findall(r'name="(\w+)" type="number" min="\d+" placeholder="([^"]*)"', page)
    }
    run_id = await runs.launch({}, "tester")
    policy = runs.view(run_id).policy_short
    assert shown == {
        "groups_per_batch": f"default {policy['B']}",
        "group_size": f"default {policy['G']}",
        "surplus_groups": f"default {policy['S']} (sync: 0)",
        "max_staleness": f"default {policy['K']}",
        "agent_gate": f"default {runs.view(run_id).policy['agent_gate']:g} (full)",
        "batches": "until stopped",
    }
    # The admission select offers every mode by its value, the policy's own first and chosen.
    options = re.findall(
        r'<option value="(\w*)" (selected)?', page.split('name="admission"')[1].split("</select>")[0]
    )
    assert options == [("", "selected"), ("in_flight", ""), ("attempts", ""), ("live", "")]
    await runs.stop(run_id, "tester")


async def test_concurrent_policy_changes_from_the_dashboard_are_stored_as_made_before_the_answer(tmp_path):
    # The dashboard wrote each change's knobs to the store itself, beside the event sink's ordered write
    # of the same changes: with changes at once, the stored policy could be older than the live run's
    # (for up to a sink flush), and a kill -9 then resumed the run with stale knobs. Now each change
    # answers once it is in the store, written in the order the changes were made.
    from app.store.models import Run

    db = f"sqlite:///{tmp_path / 'corral.db'}"
    manager = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    runs = ManagerRuns(lambda: manager)
    reader = ServiceStore(db, migrate=False)
    knobs = ("max_staleness", "surplus_groups")

    def stored(run_id):
        with reader.session() as s:
            policy = s.get(Run, run_id).policy
        return {k: policy[k] for k in knobs}

    try:
        run_id = await runs.launch({"policy": "full", "name": "policy-race"}, "tester")
        await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "running")
        handle = manager.get(run_id)
        for round_ in range(12):
            values = range(20 * round_ + 1, 20 * round_ + 17)
            await asyncio.gather(
                *(
                    runs.set_policy(run_id, {"max_staleness": v, "surplus_groups": v % 7}, "tester")
                    for v in values
                )
            )
            live = {k: handle.knobs[k] for k in knobs}
            assert await asyncio.to_thread(stored, run_id) == live, f"round {round_}"
        await runs.stop(run_id, "tester")
    finally:
        reader.engine.dispose()
        manager.shutdown()


async def test_a_failed_run_s_page_says_why_it_failed(runs):
    # The page of a failed run showed its badge and empty panels; why it failed was only in the API,
    # and there it read "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)".
    workload = small_workload()
    workload["trajectory"]["p_infra_error"] = 0.999  # groups fail in a row: the run cannot fill a batch
    spec = RunCreate.model_validate(
        {"name": "doomed", "workload": workload, "speed": 1000, "trainer": "sentinel"}
    )
    run_id = runs.manager.create(spec)
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).state == "failed", 120)
    error = runs.manager.view(run_id)["error"]
    # no batch ever came: the trainer was idle the whole run (the page said 0%, counting only answers);
    # and the run's end in its own stream says why, as its record does
    await asyncio.to_thread(wait_for, lambda: runs.view(run_id).idle_fraction == pytest.approx(1.0, abs=0.02))
    ended = runs.manager.store.timeline(run_id, -1, 100_000)[-1]
    assert (ended["kind"], ended["reason"], ended["detail"]) == ("run_ended", "error", error)
    # the error itself, not the task group's wrapper ("ExceptionGroup: unhandled errors in a TaskGroup")
    assert error.startswith("RunCannotProceed: 101 groups in a row failed and none completed"), error

    app = FastAPI()
    mount_dashboard(app, Dashboard(AccessConfig("op-token", None), live=runs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        page = await client.get(f"/runs/{run_id}")
    assert page.status_code == 200
    assert '<span class="badge failed" id="run-state">failed</span>' in page.text
    shown = re.search(r'<p class="flash error" id="run-error" role="alert">(.*?)</p>', page.text, re.S)
    assert shown is not None, page.text[:2000]
    assert html.unescape(shown.group(1)) == f'<b>Why it failed:</b> <span class="run-error">{error}</span>'


async def test_a_run_held_by_a_trainer_that_takes_no_batch_says_so(runs):
    # An external trainer that never asks: the page showed the run running, one batch delivered and its
    # clock stopped, with nothing saying that the run was held by its trainer.
    spec = RunCreate.model_validate(
        {"name": "held", "kind": "sim", "speed": 5.0, "workload": small_workload()}
    )
    run_id = runs.manager.create(spec)
    await asyncio.to_thread(wait_for, lambda: runs.manager.get(run_id).gateway.pending())
    handle = runs.manager.get(run_id)
    assert trainer_note(handle.gateway) is None  # just offered: a trainer gets 10 s before the page says so
    note = trainer_note(handle.gateway, after_s=0.0)
    assert str(note).startswith("Batch 0 has been ready for 0 s and the trainer has not taken it")
    page = runs.view(run_id)
    assert "5× as fast as the wall clock" in str(page.clock_note)
    offer = await handle.gateway.next_batch(0)
    assert offer is not None
    assert "The trainer took batch 0 0 s ago and has not acked it" in str(trainer_note(handle.gateway, 0.0))
    await runs.stop(run_id, "tester")


def test_waits_read_as_a_person_reads_them():
    assert [wall_duration(s) for s in (0.4, 59.9, 60, 582, 3599, 3600, 7500)] == [
        "0 s", "59 s", "1 min", "9 min", "59 min", "1 h 0 min", "2 h 5 min"
    ]  # fmt: skip


async def test_an_operator_takes_an_engine_out_of_rotation_and_back_from_the_run_page(runs):
    # Only the API could drain an engine; the dashboard showed "draining" with no way back.
    run_id = await runs.launch({"policy": "full", "name": "rotation"}, "tester")
    await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).batches) >= 1)
    app = FastAPI()
    mount_dashboard(app, Dashboard(AccessConfig("op-token", None), live=runs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        page = (await client.get(f"/runs/{run_id}")).text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', page).group(1)
        assert (
            await client.post("/login", data={"csrf_token": csrf, "token": "op-token"})
        ).status_code == 303
        page = (await client.get(f"/runs/{run_id}")).text
        assert f'action="/runs/{run_id}/engines/engine-0/drain"' in page
        form = {"csrf_token": csrf}
        out = await client.post(
            f"/runs/{run_id}/engines/engine-0/drain", data=form, headers={"HX-Request": "true"}
        )
        assert out.status_code == 200, out.text
        assert "engine-0 is out of rotation" in out.text
        handle = runs.manager.get(run_id)
        assert "engine-0" in handle.runtime.plan.drained
        put_back = f'action="/runs/{run_id}/engines/engine-0/serve"'  # its button now puts it back
        for _ in range(100):  # once the page has folded the drain in (its view is rebuilt every 0.4 s)
            if put_back in (await client.get(f"/runs/{run_id}/block/engines")).text:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError((await client.get(f"/runs/{run_id}/block/engines")).text)
        last = await client.post(
            f"/runs/{run_id}/engines/engine-1/drain", data=form, headers={"HX-Request": "true"}
        )
        assert last.status_code == 409  # the last engine serving: draining it would stop the run
        assert "last one serving" in last.text
        unknown = await client.post(
            f"/runs/{run_id}/engines/engine-9/drain", data=form, headers={"HX-Request": "true"}
        )
        assert unknown.status_code == 422
        back = await client.post(
            f"/runs/{run_id}/engines/engine-0/serve", data=form, headers={"HX-Request": "true"}
        )
        assert back.status_code == 200, back.text
        assert "engine-0" not in handle.runtime.plan.drained
    await asyncio.to_thread(wait_for, lambda: len(runs.view(run_id).audit) >= 2)
    assert [row.did for row in runs.view(run_id).audit[-2:]] == [
        "took engine-0 out of rotation", "returned engine-0 to rotation"
    ]  # fmt: skip
    await runs.stop(run_id, "tester")


def stored_run(manager, run_id, groups=12):
    """A run that executed elsewhere (ended, or before a restart): its events written straight into the
    manager's store by the store's sink, its last request for a batch never answered. The events."""
    from app.core.events import BatchRequested, Envelope, RunEnded
    from app.store.sink import SqlEventSink
    from app.web.synthetic import synthetic_run

    events = synthetic_run(run_id, groups=groups, group_size=2, batch_groups=2)
    last = events[-1]
    index = max(e.event.batch_index for e in events if e.event.kind == "batch_delivered") + 1
    events += [
        Envelope(run_id, last.seq + 1, last.t + 1.0, BatchRequested(index)),
        Envelope(run_id, last.seq + 2, last.t + 4.0, RunEnded("stopped")),
    ]
    manager.store.create_run(run_id, "stored", {"kind": "sim"}, {})
    SqlEventSink(manager.store.engine).write_batch(events)
    return events


class EventReads:
    """The statements that read the store's `events` table while it is open, with their parameters."""

    def __init__(self, engine):
        self.engine = engine
        self.reads = []

    def _on_execute(self, conn, cursor, statement, parameters, context, executemany):
        if re.search(r"\bevents\b", statement, re.I) and statement.lstrip().upper().startswith("SELECT"):
            self.reads.append((statement, parameters))

    def __enter__(self):
        from sqlalchemy import event

        event.listen(self.engine, "before_cursor_execute", self._on_execute)
        return self

    def __exit__(self, *exc):
        from sqlalchemy import event

        event.remove(self.engine, "before_cursor_execute", self._on_execute)

    def assert_no_stream_read(self):
        """Every read of `events` is a lookup of one row by the table's key (the run's first or last
        event): a search of the primary key, limited to one row, never a scan or a range of rows."""
        with self.engine.connect() as conn:
            for statement, params in self.reads:
                assert re.search(r"LIMIT \?", statement), statement
                assert list(params)[-2:] == [1, 0], (statement, params)  # LIMIT 1 OFFSET 0
                plan = [row[-1] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", params)]
                assert all("SCAN" not in step for step in plan), plan


async def test_the_runs_list_reads_counters_not_the_event_stream(runs):
    # The runs page folded every run's whole stream into a view to render one row per run: 100+ s and a
    # 500 on four runs of ~350k events. Its rows come from counters now: a run executing here from its
    # recorder's, any other from the store's run and batch rows.
    from app.web.readmodel import view_from_events

    events = stored_run(runs.manager, "stored-1")
    run_id = await runs.launch({"policy": "full", "name": "live-one", "batches": "3"}, "tester")
    handle = runs.manager.get(run_id)
    await asyncio.to_thread(wait_for, lambda: handle.state.value == "completed", 60)

    with EventReads(runs.manager.store.engine) as reads:
        rows = {row.run_id: row for row in runs.summaries()}
        app = FastAPI()
        mount_dashboard(app, Dashboard(AccessConfig(None, None), live=runs))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            page = await client.get("/")
    assert page.status_code == 200
    assert len(reads.reads) == 2  # the stored run's first and last event, read once (then cached)
    reads.assert_no_stream_read()
    assert runs._cache == {}  # no run's stream was folded

    stored = view_from_events("stored-1", events, RunMeta(state="stopped"))
    assert stored.unanswered_s > 0
    live = runs.view(run_id)
    for row, view in ((rows["stored-1"], stored), (rows[run_id], live)):
        assert (row.state, row.badge, row.batches) == (view.state, view.badge, len(view.batches))
        assert row.policy_short == view.policy_short
        assert row.mean_collection_s == pytest.approx(view.mean_collection_s)
        assert row.idle_fraction == pytest.approx(view.idle_fraction)
        cells = re.search(rf'<tr data-run="{row.run_id}">(.*?)</tr>', page.text, re.S).group(1)
        assert f'<td class="num">{len(view.batches)}</td>' in cells
        assert f"{view.mean_collection_s:.1f} s" in cells
        assert f"{view.idle_fraction:.0%}" in cells


async def test_a_long_stored_run_s_first_page_load_is_bounded_and_the_page_catches_up(tmp_path):
    # A run page's first load folded every event of the run it had not read before answering: 53 s on a
    # stored run of 363,753 events (benchmarks/long_run.py). A request now reads for about `catch_up_s`
    # (here: one batch of `fetch_limit` events), the page says how far the view got and shows the run
    # as of its last event read, and later requests (the page's live stream) read on to the end.
    from app.web.live import catch_up_note
    from app.web.readmodel import view_from_events

    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}"), tmp_path / "data", 30.0)
    try:
        events = stored_run(manager, "stored-1", groups=60)
        runs = ManagerRuns(lambda: manager, catch_up_s=0.0, fetch_limit=500)
        first = runs.view("stored-1")
        assert first.last_seq == 499
        assert first.catch_up_note == catch_up_note(499, events[-1].seq)
        assert f"500 of {len(events):,} events read" in first.catch_up_note
        then = view_from_events("stored-1", events[:500], RunMeta(state="running"))
        full = view_from_events("stored-1", events, RunMeta(state="stopped"))
        assert len(first.batches) == len(then.batches) < len(full.batches)
        assert first.now == pytest.approx(then.now)
        assert first.now < full.now
        assert first.idle_fraction == pytest.approx(then.idle_fraction)
        assert first.waiting_s == pytest.approx(then.waiting_s)

        versions = [runs.version("stored-1")]  # the live stream's key: each call reads on, and it changes
        while runs.view("stored-1").catch_up_note is not None:
            versions.append(runs.version("stored-1"))
        assert len(set(versions)) == len(versions) >= 2
        last = runs.view("stored-1")
        assert last.last_seq == events[-1].seq
        assert (len(last.batches), last.now) == (len(full.batches), pytest.approx(full.now))
        assert last.mean_collection_s == pytest.approx(full.mean_collection_s)
        assert last.idle_fraction == pytest.approx(full.idle_fraction)
        assert last.unanswered_s == pytest.approx(full.unanswered_s)
        assert last.unanswered_s > 0

        fresh = ManagerRuns(lambda: manager, catch_up_s=0.0, fetch_limit=500)
        page, blocks = await run_page_blocks(fresh, "stored-1")
        assert "Catching up with this run&#39;s stream: 500 of" in page
        assert "Catching up with this run&#39;s stream: 1,500 of" in blocks["summary"]  # read on since
    finally:
        manager.shutdown()


def test_a_simulated_run_that_fell_short_of_its_speed_says_by_how_much() -> None:
    # A run held for its store (or slowed by a busy server) said it went 100× as fast as the wall clock
    # while it reached 19×.
    config = {"kind": "sim", "speed": 100.0}
    on_pace = {"speed": 100.0, "wall_s": 200.0, "effective_speed": 96.0, "held_s": 0.0, "lag_s": 2.0}
    short = {"speed": 100.0, "wall_s": 200.0, "effective_speed": 18.765, "held_s": 125.0, "lag_s": 14.4}
    just_started = {**short, "wall_s": 2.0}  # engines coming up: too soon to say
    assert "100× as fast as the wall clock" in str(clock_note(config, just_started))
    assert "100× as fast as the wall clock" in str(clock_note(config, on_pace))
    note = str(clock_note(config, short))
    assert "asks for 100× the wall clock's speed and has reached 18.8×" in note
    assert "stood still 125 s while its events waited to be stored" in note
    assert "lost 14.4 s to a busy server" in note


def test_views_of_runs_not_executing_here_are_let_go_past_a_bound(runs) -> None:
    # Each view holds up to 20,000 spans (several MB on a long run), and the dashboard kept one for every
    # run ever opened, ended or deleted, for the server's life.
    from app.web.live import KEEP_IDLE_VIEWS

    for i in range(KEEP_IDLE_VIEWS + 10):
        runs._entry(f"ended-{i}")
    runs._entry("ended-0")  # read again: among the most recent now
    runs._entry("ended-new")
    kept = list(runs._cache)
    assert len(kept) == KEEP_IDLE_VIEWS
    assert kept[-2:] == ["ended-0", "ended-new"]
    assert "ended-1" not in kept  # the least recently read went first


def test_the_live_key_of_a_run_a_celery_worker_drives_follows_its_stored_state(tmp_path) -> None:
    # Its worker pauses a simulated run with no event; the page's live stream re-renders on this key, so
    # it went on offering Pause to a paused run.
    from app.store.models import RunState

    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}"), tmp_path / "data", 30.0)
    try:
        spec = RunCreate(name="elsewhere", kind="sim", trainer="sentinel", orchestrator="celery")
        manager.store.create_run("elsewhere", spec.name, spec.stored(), {})
        manager.store.set_state("elsewhere", RunState.RUNNING)
        runs = ManagerRuns(lambda: manager)
        running = runs.version("elsewhere")
        manager.store.set_state("elsewhere", RunState.PAUSED)
        wait_for(lambda: runs.version("elsewhere") != running)
        assert runs.view("elsewhere").state == "paused"
    finally:
        manager.shutdown()


def test_a_run_another_process_drives_is_followed_within_a_second_and_an_ended_one_seldom(
    tmp_path, monkeypatch
) -> None:
    # A celery worker's run page was re-read from the store every 5 s, like an ended run's: it lagged its
    # worker by up to 5 s while a run this server drives follows it within 0.4 s.
    import types

    from app.core.events import BatchRequested, Envelope, GroupAdmitted
    from app.store.models import RunState
    from app.web import live

    clock = [1000.0]
    monkeypatch.setattr(live, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}"), tmp_path / "data", 30.0)
    try:
        spec = RunCreate(name="elsewhere", kind="sim", trainer="sentinel", orchestrator="celery")
        sink = manager.store.event_sink()
        for run_id, states in (
            ("elsewhere", [RunState.RUNNING]),
            ("ended", [RunState.RUNNING, RunState.COMPLETED]),
        ):
            manager.store.create_run(run_id, spec.name, spec.stored(), {})
            for state in states:
                manager.store.set_state(run_id, state)
            sink.write_batch([Envelope(run_id, 0, 0.0, BatchRequested(0))])
        runs = ManagerRuns(lambda: manager)
        before = {run_id: runs.version(run_id) for run_id in ("elsewhere", "ended")}
        assert [len(runs.view(run_id).groups) for run_id in before] == [0, 0]
        for run_id in before:
            sink.write_batch([Envelope(run_id, 1, 1.0, GroupAdmitted(0, 0, 2))])

        clock[0] += 1.1  # within about a second
        assert runs.version("elsewhere") != before["elsewhere"]
        assert runs.version("ended") == before["ended"]  # an ended run is not re-read this soon
        assert [len(runs.view(run_id).groups) for run_id in before] == [1, 0]

        clock[0] += live.IDLE_REFETCH_S
        assert runs.version("ended") != before["ended"]
        assert len(runs.view("ended").groups) == 1
    finally:
        manager.shutdown()


async def test_the_agent_gate_is_set_from_the_launch_form_and_changed_from_the_policy_form(tmp_path):
    """Through the dashboard's own routes: a bad value is the launch form's error, a good one the run's
    gate; the policy form opens it (0) on a run that has one and is refused on one that has none."""
    manager = RunManager(ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}"), tmp_path / "data", 30.0)
    runs = ManagerRuns(lambda: manager)
    app = FastAPI()
    mount_dashboard(app, Dashboard(AccessConfig("op-token", None), live=runs))
    htmx = {"HX-Request": "true"}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            csrf = re.search(r'name="csrf_token" value="([^"]+)"', (await client.get("/")).text).group(1)
            await client.post("/login", data={"csrf_token": csrf, "token": "op-token"})
            form = {"csrf_token": csrf, "policy": "full", "name": "gated"}

            bad = await client.post("/runs", data={**form, "agent_gate": "abc"}, headers=htmx)
            assert bad.status_code == 422
            assert "agent_gate: expected a number, got 'abc'" in html.unescape(bad.text)
            assert 'name="agent_gate" type="number" min="0" placeholder="default 1 (full)"' in bad.text
            too_big = await client.post("/runs", data={**form, "agent_gate": "2000"}, headers=htmx)
            assert too_big.status_code == 422
            assert "agent_gate: Input should be less than or equal to 1000" in too_big.text
            assert 'value="2000"' in too_big.text  # the form keeps what was typed
            assert runs.run_ids() == []

            launched = await client.post("/runs", data={**form, "agent_gate": "0.5"}, headers=htmx)
            assert launched.status_code == 204, launched.text
            run_id = launched.headers["HX-Redirect"].rsplit("/", 1)[1]
            handle = manager.get(run_id)
            await asyncio.to_thread(wait_for, lambda: handle.state.value == "running")
            assert handle.runtime.gate.factor == 0.5
            page = (await client.get(f"/runs/{run_id}")).text
            assert (
                'id="p-gate" name="agent_gate" type="number" min="0" max="1000" step="any" value="0.5"'
                in page
            )
            assert '<b>agent gate</b> = <span id="current-gate">0.5</span>' in page

            opened = await client.post(
                f"/runs/{run_id}/policy", data={"csrf_token": csrf, "agent_gate": "0"}, headers=htmx
            )
            assert opened.status_code == 200, opened.text
            assert "Applied agent gate = 0." in opened.text
            assert handle.runtime.gate.factor == 0
            await asyncio.to_thread(wait_for, lambda: runs.view(run_id).audit)
            block = (await client.get(f"/runs/{run_id}/block/policy")).text
            assert '<span id="current-gate">0 (open)</span>' in block
            assert "set agent_gate from 0.5 to 0.0" in block
            nan = await client.post(
                f"/runs/{run_id}/policy", data={"csrf_token": csrf, "agent_gate": "nan"}, headers=htmx
            )
            assert nan.status_code == 422
            assert "agent_gate (agent gate): expected a number, got 'nan'" in html.unescape(nan.text)
            await runs.stop(run_id, "tester")

            sync = await client.post("/runs", data={**form, "policy": "sync"}, headers=htmx)
            sync_id = sync.headers["HX-Redirect"].rsplit("/", 1)[1]
            await asyncio.to_thread(wait_for, lambda: manager.get(sync_id).state.value == "running")
            page = (await client.get(f"/runs/{sync_id}")).text
            assert 'id="p-gate"' not in page  # nothing to change
            assert '<span id="current-gate">off</span>' in page
            refused = await client.post(
                f"/runs/{sync_id}/policy", data={"csrf_token": csrf, "agent_gate": "1"}, headers=htmx
            )
            assert refused.status_code == 422
            assert f"agent_gate: run {sync_id} has no agent-phase gate" in html.unescape(refused.text)
            await runs.stop(sync_id, "tester")
    finally:
        manager.shutdown()


def test_the_runs_list_lets_go_of_the_figures_of_runs_deleted_since(runs) -> None:
    # The runs page caches each stored run's trainer figures; a deleted run's stayed for the server's
    # life, so a server that ran and deleted runs for weeks held one entry for every run it ever listed.
    from app.store.models import RunState

    store = runs.manager.store
    spec = RunCreate(name="old", kind="sim", trainer="sentinel")
    for i in range(30):
        store.create_run(f"old-{i}", spec.name, spec.stored(), {})
        store.set_state(f"old-{i}", RunState.RUNNING)
        store.set_state(f"old-{i}", RunState.COMPLETED)
    assert len(runs.summaries()) == 30
    for i in range(25):
        runs.manager.delete(f"old-{i}")
    kept = {f"old-{i}" for i in range(25, 30)}
    assert {row.run_id for row in runs.summaries()} == kept
    assert set(runs._figures) == kept
