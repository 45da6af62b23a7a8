"""End to end, with real processes: `corral serve` (uvicorn, a subprocess) and, in the distributed
deployment, one `corral worker` per sandbox lane on the real Redis, state in a fresh Postgres database;
in the embedded default, SQLite and in-process lanes. The same flow runs on both:

a small local run (an embedded engine, a built-in task) is created through the API with `app.client`;
an external trainer loop fetches its batches, acks them, changes K and S live and publishes each new
version, following each rollout engine by engine; then it stops the run. Afterwards the database holds
every group's account (delivered, or discarded with a reason; none open, none lost, no sequence gap),
the acked batches, the policy history with who changed it, and the rollouts; in the distributed
deployment every lane's ops ran in that lane's worker (the result each worker stored names its host,
lane and pool process).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from e2e_support import (
    POSTGRES_URL,
    REDIS_URL,
    TOKEN,
    answers,
    data_dir,
    free_port,
    healthy,
    make_local_config,
    op_results_on,
    parent_of,
    processes,
    serve_env,
    start_lane_workers,
    start_serve,
    unique_host,
    wait_for,
)

from app.client import Batch, CorralClient
from app.lanes.base import LaneName
from app.service.store import ServiceStore
from app.store.db import scratch_database
from app.store.repos import BatchRepo, GroupRepo, PolicyRepo, RolloutRepo

STEPS = 3

DEPLOYMENTS = {
    "postgres-celery": ("postgres", True),
    "sqlite-inprocess": ("sqlite", False),
}


def needs_services(celery: bool, backend: str) -> None:
    if backend == "postgres" and not answers("127.0.0.1", 5432):
        pytest.skip("no Postgres answering on 127.0.0.1:5432")
    if celery and not answers("127.0.0.1", 6379):
        pytest.skip("no Redis answering on 127.0.0.1:6379")


def next_batch(corral: CorralClient, run_id: str) -> Batch:
    batch: Batch = wait_for(lambda: corral.next_batch(run_id, timeout=10), 240, "the next batch")
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("deployment", list(DEPLOYMENTS))
def test_a_run_goes_end_to_end_through_the_api(deployment: str, tmp_path: Path) -> None:
    backend, celery = DEPLOYMENTS[deployment]
    needs_services(celery, backend)
    host = unique_host()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with (
        scratch_database(backend, POSTGRES_URL, tmp_path) as db,
        data_dir() as data,
        processes(tmp_path) as procs,
    ):
        workers = start_lane_workers(procs, host, REDIS_URL) if celery else {}
        timings["workers ready"] = time.monotonic() - t0
        env = serve_env(db, port, data, REDIS_URL if celery else None, host)
        start_serve(procs, env)
        health = wait_for(lambda: healthy(url), 120, f"corral serve to answer; log:\n{procs.tail('serve')}")
        assert health["broker"]["mode"] == ("celery" if celery else "in-process")
        said = f"lanes: celery on {REDIS_URL}, hosts {host}" if celery else "lanes: in-process"
        assert said in procs.tail("serve", 100_000)
        timings["serve healthy"] = time.monotonic() - t0

        with CorralClient(url, token=TOKEN, actor="e2e-trainer", timeout_s=30) as corral:
            spec = {"name": f"e2e-{deployment}", "kind": "local", "config": make_local_config()}
            run_id = corral.create_run(**spec)["id"]
            acked = []
            for step in range(STEPS):
                batch = next_batch(corral, run_id)
                if step == 0:
                    timings["first batch"] = time.monotonic() - t0
                    changed = corral.set_policy(run_id, max_staleness=1, surplus_groups=2)
                    assert (changed["policy"]["max_staleness"], changed["policy"]["surplus_groups"]) == (1, 2)
                    assert changed["actor"] == "e2e-trainer"
                assert batch.index == step
                assert batch.delivery == 1  # acked in time: never offered again
                for group in batch.groups:
                    assert len(group["trajectories"]) == 2
                    assert group["staleness"] <= 2
                rollout = corral.publish(run_id, batch.publish_version, sentinel=True)
                assert [e["engine"] for e in rollout["engines"]] == ["engine-0"]
                done = wait_for(
                    lambda v=batch.publish_version: corral.rollout(run_id, v)["state"] == "completed",
                    120,
                    f"rollout of version {batch.publish_version}",
                )
                assert done
                assert corral.rollout(run_id, batch.publish_version)["engines"][0]["version"] >= (
                    batch.publish_version
                )
                assert corral.ack(run_id, batch.batch_id)["batch_id"] == batch.batch_id
                acked.append(batch.index)
            view = corral.run(run_id)
            assert view["policy"]["max_staleness"] == 1
            assert view["live"]["trainer_version"] == STEPS
            lanes_seen = {lane for lane, s in view["live"]["lanes"].items() if s["completed"] > 0}
            assert lanes_seen >= {"reset", "exec", "validate"}
            corral.stop(run_id)
            wait_for(lambda: corral.run(run_id)["state"] == "stopped", 120, "the run to stop")
            timings["stopped"] = time.monotonic() - t0

        if celery:  # while the workers live: each op ran in a pool process of its lane's worker
            results = op_results_on(REDIS_URL, host)
            by_lane = Counter(r["lane"] for r in results)
            assert set(by_lane) == {lane.value for lane in LaneName}, by_lane
            for result in results:
                assert result["host"] == host
                assert parent_of(int(result["pid"])) == workers[LaneName(result["lane"])].pid
        code = procs.stop("serve", signal.SIGTERM)  # a clean stop flushes every sink
        assert code in (0, -signal.SIGTERM), procs.tail("serve")

        store = ServiceStore(db, migrate=False)
        try:
            ledger, _ = store.ledger(run_id)
            assert ledger.gaps == 0
            assert not ledger.open_groups  # every admitted group ended ...
            assert not ledger.ended_twice  # ... exactly once ...
            assert not ledger.never_admitted
            assert ledger.lost == 0
            assert ledger.delivered_count >= STEPS  # ... delivered, or discarded with a reason
            assert all(reason for reason in ledger.discarded)
            with store.session() as s:
                account = GroupRepo(s).account(run_id)
                groups = GroupRepo(s).list(run_id)
                batches = BatchRepo(s).list(run_id)
                history = [(c.field, c.old, c.new, c.actor) for c in PolicyRepo(s).history(run_id)]
                rollouts = sorted(r.version for r in RolloutRepo(s).list(run_id))
            # The store's projection (the groups table) agrees with the stream, group by group.
            assert account.open == 0
            assert account.admitted == ledger.admitted_count
            assert account.delivered == ledger.delivered_count
            assert account.discarded == ledger.discarded
            assert all(g.state == "delivered" or (g.state == "discarded" and g.reason) for g in groups)
            assert [b.batch_index for b in batches if b.acked_at is not None] == acked
            assert ("max_staleness", 2, 1, "e2e-trainer") in history
            assert ("surplus_groups", 1, 2, "e2e-trainer") in history
            assert rollouts == list(range(1, STEPS + 1))
            ops = [e for e in store.timeline(run_id, -1, 1_000_000) if e["kind"] == "sandbox_op"]
            ok_by_lane = Counter(e["lane"] for e in ops if e["ok"])
            assert set(ok_by_lane) >= {"reset", "exec", "validate", "cleanup"}
            if celery:  # an op's result is stored even when the run cancelled it at the stop
                for lane, n in ok_by_lane.items():
                    assert by_lane[lane] >= n
        finally:
            store.close()
    timings["torn down"] = time.monotonic() - t0
    print(f"{deployment}: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
