"""A run end to end through the API, on SQLite and on Postgres with in-process lanes: batches fetched
and acked by the client, the policy changed live, weights published, and the database holding every
group's account."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import TOKEN, make_run, make_settings, serving, stored_run, wait_for

from app.client import AsyncCorralClient, CorralClient, RunEnded
from app.core.events import Ledger
from app.service.store import ServiceStore
from app.sim.adapters import SimEngine, SimSource
from app.store.repos import BatchRepo, GroupRepo, PolicyRepo


def test_run_end_to_end_through_the_client(server: str, backend_url: str) -> None:
    with CorralClient(server, token=TOKEN, actor="trainer-1") as corral:
        run = corral.create_run(**make_run(batches=4))
        run_id = run["id"]
        assert run["state"] in ("created", "running")
        seen = []
        for step in range(4):
            batch = corral.next_batch(run_id, timeout=30)
            assert batch is not None
            assert batch.index == step
            assert batch.publish_version == step + 1
            assert len(batch.groups) == 2  # B
            for group in batch.groups:
                assert group["staleness"] >= 0
                assert len(group["trajectories"]) == 2  # G
                for trajectory in group["trajectories"]:
                    assert set(trajectory) >= {"reward", "advantage", "turns", "policy_versions"}
                assert pytest.approx(sum(group["advantages"])) == 0.0
            if step == 1:
                changed = corral.set_policy(run_id, max_staleness=3, surplus_groups=3)
                assert changed["policy"]["max_staleness"] == 3
                assert changed["policy"]["surplus_groups"] == 3
            rollout = corral.publish(run_id, batch.publish_version, sentinel=True)
            assert rollout["version"] == batch.publish_version
            assert {e["engine"] for e in rollout["engines"]} == {"engine-0", "engine-1"}
            assert corral.ack(run_id, batch.batch_id)["already_acked"] is False
            assert corral.ack(run_id, batch.batch_id)["already_acked"] is True  # idempotent
            seen.append(batch.batch_id)
        assert len(set(seen)) == 4
        done = wait_for(lambda: corral.run(run_id)["state"] == "completed", what="the run to complete")
        assert done
        final = corral.rollout(run_id, 4)
        assert final["version"] == 4
        with pytest.raises(RunEnded):
            corral.next_batch(run_id, timeout=1)
        view = corral.run(run_id)
        assert view["live"]["batches"] == 4
        assert view["policy"]["max_staleness"] == 3
        stored = stored_run(backend_url, run_id)
        assert set(stored.policy) == set(view["policy"]) > {"max_staleness", "admission", "completion_order"}
        assert stored.policy["max_staleness"] == 3  # the change, written over the policy it started with
        kinds = {e["kind"] for e in corral.timeline(run_id, limit=10_000)["events"]}
        assert {"run_started", "group_admitted", "batch_delivered", "policy_changed", "run_ended"} <= kinds

    store = ServiceStore(backend_url, migrate=False)
    try:
        # The sinks flush when the run ends; the stored stream alone accounts for every group.
        ledger, _ = wait_for(lambda: _ended_ledger(store, run_id), what="the stored run_ended")
        assert ledger.lost == 0
        assert ledger.gaps == 0
        assert ledger.delivered_count == 8
        with store.session() as s:
            account = GroupRepo(s).account(run_id)
            assert account.open == 0
            assert account.delivered == 8
            assert account.admitted == account.delivered + sum(account.discarded.values())
            changes = [(c.field, c.old, c.new, c.actor) for c in PolicyRepo(s).history(run_id)]
        assert ("max_staleness", 2, 3, "trainer-1") in changes
        assert ("surplus_groups", 2, 3, "trainer-1") in changes
    finally:
        store.close()


def _ended_ledger(store: ServiceStore, run_id: str) -> tuple[Ledger, float] | None:
    ledger, last_t = store.ledger(run_id)
    events = store.timeline(run_id, -1, 100_000)
    return (ledger, last_t) if events and events[-1]["kind"] == "run_ended" else None


def test_a_trainer_waiting_when_the_last_batch_ends_the_run_is_told_it_completed(server: str) -> None:
    # The trainer waiting as the run's last step ended was woken with "has ended (ended)": no state.
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as api:
        run_id = api.post("/api/runs", json=make_run(batches=1)).json()["id"]
        batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30}).json()
        assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
        publish = {"version": batch["publish_version"], "sentinel": True}
        assert api.post(f"/api/runs/{run_id}/weights", json=publish).status_code == 202
        ended = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30})
        assert ended.status_code == 409, ended.text
        assert ended.json()["detail"] == f"run {run_id!r} has ended (completed); no more batches"


DRAIN_S = 2.0  # how long the faults below take to fail the run's drain


def _stopping_fails(source: SimSource) -> None:
    """The attempts' source, told the run stops (as a docker daemon gone away holds it up), fails."""
    time.sleep(DRAIN_S)
    raise RuntimeError("the source could not stop")


async def _close_refused(engine: SimEngine) -> None:
    """An engine client that takes `DRAIN_S` of wall time to fail to close, once the run is over."""
    await asyncio.to_thread(time.sleep, DRAIN_S)
    raise RuntimeError(f"{engine.name}: its client would not close")


@pytest.mark.parametrize(
    ("fault", "state"),
    [
        ((SimSource, "stopping", _stopping_fails), "failed"),
        ((SimEngine, "aclose", _close_refused), "completed"),
    ],
    ids=["in-the-runtime-s-drain", "in-the-teardown"],
)
def test_a_run_whose_drain_fails_after_its_last_batch_tells_everyone_one_end(
    server: str, backend_url: str, monkeypatch: pytest.MonkeyPatch, fault: tuple[Any, str, Any], state: str
) -> None:
    """A one-batch run's trainer loop completes (its batch acked, version 1 published), then its drain
    fails a moment into it. Its trainer, waiting for the next batch as the loop completed, was told
    "has ended (completed)" at once, and so were a publication and a policy change sent during the
    drain, whatever the drain then did. They are told the run's end once the drain is over, in the state
    that its API, its stored row and its dashboard page say: `failed` where the runtime's drain failed
    (its end recorded as an error), `completed` where only the teardown after the runtime's end failed
    (closing its engines' clients): that end was stored first, and nothing was lost. Before, that run's
    API said `failed` while the store kept `completed`."""
    monkeypatch.setattr(*fault)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    clients = [httpx.Client(base_url=server, headers=auth, timeout=60) for _ in range(3)]
    api, publisher, operator = clients
    try:
        run_id = api.post("/api/runs", json=make_run(batches=1)).json()["id"]
        batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30}).json()
        assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
        with ThreadPoolExecutor(1) as pool:
            # the trainer asks for the next batch, and waits, as its loop completes
            waiting = pool.submit(api.get, f"/api/runs/{run_id}/batches/next", params={"timeout": 30})
            time.sleep(0.5)
            publish = {"version": batch["publish_version"], "sentinel": True}
            assert publisher.post(f"/api/runs/{run_id}/weights", json=publish).status_code == 202
            # the trainer loop is over and the run drains: these come during its DRAIN_S
            late = publisher.post(f"/api/runs/{run_id}/weights", json={"version": 2, "sentinel": True})
            changed = operator.patch(f"/api/runs/{run_id}/policy", json={"max_staleness": 3})
            told = waiting.result()
        ended = f"run {run_id!r} has ended ({state})"
        assert (told.status_code, told.json()["detail"]) == (409, f"{ended}; no more batches")
        assert (late.status_code, late.json()["detail"]) == (409, ended)
        assert changed.status_code == 409, changed.text
        assert changed.json()["detail"] in (ended, f"{ended}; its policy is fixed")
        wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] != "running", what="its end")
        assert api.get(f"/api/runs/{run_id}").json()["state"] == state
        wait_for(lambda: stored_run(backend_url, run_id).state != "running", what="its stored end")
        assert stored_run(backend_url, run_id).state == state
        assert f'<span class="badge {state}" id="run-state">{state}</span>' in api.get(f"/runs/{run_id}").text
    finally:
        for client in clients:
            client.close()


def test_async_client_takes_publishes_and_acks(server: str) -> None:
    async def main() -> list[int]:
        async with AsyncCorralClient(server, token=TOKEN) as corral:
            run_id = (await corral.create_run(**make_run(batches=2)))["id"]
            versions = []
            while True:
                try:
                    batch = await corral.next_batch(run_id, timeout=30)
                except RunEnded:
                    return versions
                if batch is None:
                    continue
                if batch.delivery == 1:  # handed back untrained: it comes again at once, as delivery 2
                    assert (await corral.release(run_id, batch))["released"] is True
                    continue
                renewed = await corral.renew(run_id, batch)
                assert (renewed["renewed"], renewed["lease_s"]) == (True, batch.ack_timeout_s)
                await corral.publish(run_id, batch.publish_version, sentinel=True)
                await corral.ack(run_id, batch.batch_id)
                versions.append(batch.publish_version)

    assert asyncio.run(main()) == [1, 2]


def test_renew_answers_for_the_holder_only_and_refuses_what_it_cannot_renew(server: str) -> None:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as api:
        run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
        url = f"/api/runs/{run_id}/batches/{run_id}-b0/renew"
        try:
            metrics = f"/api/runs/{run_id}/metrics"
            wait_for(lambda: api.get(metrics).json()["trainer"]["offered"] >= 1, what="batch 0 to be offered")
            untaken = api.post(url, json={"delivery": 1})
            assert untaken.status_code == 409, untaken.text
            assert "has not been handed out yet" in untaken.json()["detail"]
            held = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30}).json()
            assert (held["batch_id"], held["delivery"]) == (f"{run_id}-b0", 1)
            for bad in ({}, {"delivery": 0}, {"delivery": "1"}, {"delivery": 1.5}, {"delivery": 2**31},
                        {"delivery": 1, "x": 1}, [1]):  # fmt: skip
                refused = api.post(url, json=bad)
                assert refused.status_code == 422, (bad, refused.text)
                assert "delivery" in refused.json()["detail"] or "x" in refused.json()["detail"]
            assert httpx.post(f"{server}{url}", json={"delivery": 1}).status_code == 401  # no token
            assert api.post(url, json={"delivery": 2}).json() == {
                "batch_id": held["batch_id"], "renewed": False, "delivery": 1, "lease_s": 0.0,
                "detail": "it has been handed out 1 time(s), not 2",
            }  # fmt: skip
            assert api.post(url, json={"delivery": 1}).json() == {
                "batch_id": held["batch_id"], "renewed": True, "delivery": 1,
                "lease_s": held["ack_timeout_s"], "detail": None,
            }  # fmt: skip
            assert api.post(f"/api/runs/{run_id}/batches/{held['batch_id']}/ack").status_code == 200
            acked = api.post(url, json={"delivery": 1})
            assert acked.status_code == 409, acked.text
            assert "is acked" in acked.json()["detail"]
            unknown = api.post(f"/api/runs/{run_id}/batches/{run_id}-b999/renew", json={"delivery": 1})
            assert unknown.status_code == 404, unknown.text
            assert "has no batch" in unknown.json()["detail"]
            assert api.post("/api/runs/nope/batches/nope-b0/renew", json={"delivery": 1}).status_code == 404
        finally:
            api.post(f"/api/runs/{run_id}/stop")


def test_unacked_batch_is_offered_again(tmp_path: Path, backend_url: str) -> None:
    with (
        serving(make_settings(tmp_path, backend_url, ack_timeout_s=0.5)) as url,
        CorralClient(url, token=TOKEN) as corral,
    ):
        run_id = corral.create_run(**make_run(batches=2))["id"]
        first = corral.next_batch(run_id, timeout=30)
        assert first is not None
        assert first.delivery == 1
        assert corral.next_batch(run_id, timeout=0.1) is None  # leased to us, nothing else to take
        again = corral.next_batch(run_id, timeout=5)  # the lease ran out without an ack
        assert again is not None
        assert again.batch_id == first.batch_id
        assert again.delivery == 2
        corral.publish(run_id, again.publish_version, sentinel=True)
        assert corral.ack(run_id, again.batch_id)["already_acked"] is False
        assert corral.metrics(run_id)["trainer"]["redelivered"] == 1
        corral.stop(run_id)
        store = ServiceStore(backend_url, migrate=False)
        try:  # the store counts the second hand-out too (it stayed at 1)

            def offers() -> list[int]:
                with store.session() as s:
                    return [b.offer_count for b in BatchRepo(s).list(run_id) if b.batch_index == first.index]

            wait_for(lambda: offers() == [2], what="the store to count the second hand-out")
        finally:
            store.close()


def test_an_ack_of_a_batch_never_handed_out_is_refused(server: str) -> None:
    """Batch ids follow the run's id, so one can be acked unseen: it was taken (200), and the batch counted
    as trained on though no trainer ever had it."""
    with CorralClient(server, token=TOKEN) as corral:
        run_id = corral.create_run(**make_run(batches=2))["id"]
        try:
            wait_for(lambda: corral.metrics(run_id)["trainer"]["offered"] >= 1, what="batch 0 to be offered")
            refused = httpx.post(
                f"{server}/api/runs/{run_id}/batches/{run_id}-b0/ack",
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert refused.status_code == 409, refused.text
            assert "has not been handed out yet" in refused.json()["detail"]
            assert corral.metrics(run_id)["trainer"]["acked"] == 0
            batch = corral.next_batch(run_id, timeout=30)
            assert batch is not None
            assert (batch.batch_id, batch.delivery) == (f"{run_id}-b0", 1)
            assert corral.ack(run_id, batch.batch_id)["already_acked"] is False
        finally:
            corral.stop(run_id)


def test_a_trainer_that_stops_taking_batches_cannot_make_the_run_grow_without_bound(server: str) -> None:
    """Completed groups wait for a batch outside B + S (policy full). With an external trainer they are
    capped by default at B + S more (`ready_surplus`), so live groups stay ≤ 2·(B + S) while nobody
    takes a batch; `ready_surplus: null` asks for no cap of its own, and then at most (K + 1)·B wait
    (the scheduler's `ready_cap`: before it, they piled up without bound)."""
    with CorralClient(server, token=TOKEN) as corral:
        capped = corral.create_run(**make_run(batches=None, speed=200.0))
        uncapped = corral.create_run(**make_run(batches=None, speed=200.0, ready_surplus=None))
        try:
            policy = corral.run(capped["id"])["policy"]
            room = policy["groups_per_batch"] + policy["surplus_groups"]
            assert policy["ready_surplus"] == room
            assert corral.run(uncapped["id"])["policy"]["ready_surplus"] is None

            def live(run_id: str) -> int:
                return int(corral.run(run_id)["live"]["groups_live"])

            wait_for(lambda: live(uncapped["id"]) > 2 * room, 60, "ready groups past the default cap")
            # No group is admitted once (K + 1)·B wait ready; those running then complete and wait too.
            implicit = room + (policy["max_staleness"] + 1) * policy["groups_per_batch"]

            def admitted() -> int:
                return int(corral.run(uncapped["id"])["live"]["groups_admitted"])

            time.sleep(1)  # at 200× speed, a few hundred simulated seconds
            before = admitted()
            time.sleep(1)
            assert admitted() == before  # no longer growing
            assert live(uncapped["id"]) <= implicit
            assert live(capped["id"]) <= 2 * room
        finally:
            corral.stop(capped["id"])
            corral.stop(uncapped["id"])


def test_ready_surplus_is_for_policy_full_only(server: str) -> None:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        answer = api.post("/api/runs", json=make_run(policy="sync", ready_surplus=4))
        assert answer.status_code == 422
        assert "ready_surplus: only policy full" in answer.text


def test_a_run_created_with_attempts_admission_admits_by_attempts_and_says_so(server: str) -> None:
    with CorralClient(server, token=TOKEN) as corral:
        run = corral.create_run(**make_run(batches=2, admission="attempts"))
        try:
            assert corral.next_batch(run["id"], timeout=30) is not None
            got = corral.run(run["id"])
            assert got["policy"]["admission"] == "attempts"
            assert got["policy"]["ready_surplus"] is None  # its own cap on ready groups, (K + 1)·B
        finally:
            corral.stop(run["id"])
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}) as api:
        answer = api.post("/api/runs", json=make_run(admission="attempts", ready_surplus=2))
        assert answer.status_code == 422
        assert "ready_surplus: admission is attempts" in answer.text


def test_a_simulated_run_s_batches_carry_each_turn_s_policy_version(server: str) -> None:
    # Its trajectories had "turns": [] and "policy_versions": [], where the docs show both filled in.
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as api:
        run_id = api.post("/api/runs", json=make_run(batches=1)).json()["id"]
        batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30}).json()
        trajectories = [t for g in batch["groups"] for t in g["trajectories"]]
        assert trajectories
        for t in trajectories:
            assert t["turn_count"] >= 1
            assert len(t["turns"]) == len(t["policy_versions"]) == t["turn_count"], t
            assert all(v <= batch["trainer_version"] for v in t["policy_versions"]), t
            assert all(turn["tokens"] > 0 for turn in t["turns"]), t
        api.post(f"/api/runs/{run_id}/stop")
