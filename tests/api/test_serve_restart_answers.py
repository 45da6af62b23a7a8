"""What a restarted `corral serve` answers about what happened before it: a run resumed after a kill -9
counts on from the stored totals and still takes a repeated ack of a batch acked before the kill; a
run that ended before the restart (Ctrl-C) answers as an ended run, so the trainer loop ends cleanly."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_support import (
    POSTGRES_URL,
    TOKEN,
    free_port,
    make_run,
    make_settings,
    serve_env,
    serving,
    stored_run,
    wait_for,
)
from db_relay import relayed_database
from factories import make_local_config
from test_serve_restart import _healthy, corral_serve
from test_trainer_loop_example import run_example

from app.client import CorralClient, RunEnded
from app.core.events import (
    EngineUpdateBegin,
    Envelope,
    Event,
    GroupAdmitted,
    RunStarted,
    VersionPublished,
)
from app.service.store import ServiceStore
from app.store.models import Run, RunState
from app.store.repos import BatchRepo, GroupRepo


def _serve_env(tmp_path: Path) -> tuple[dict[str, str], str, str, Path, httpx.Client]:
    """A `corral serve` kept in `tmp_path` on a free port: its environment, URL, database, log file, and
    an API client holding the operator token."""
    port = free_port()
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": database,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }
    url = f"http://127.0.0.1:{port}"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    return env, url, database, tmp_path / "serve.log", api


def _train(api: httpx.Client, run_id: str, steps: int) -> list[str]:
    """Take, publish and ack `steps` batches; their ids."""
    acked = []
    for _ in range(steps):
        batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
        published = api.post(
            f"/api/runs/{run_id}/weights", json={"version": batch["publish_version"], "sentinel": True}
        )
        assert published.status_code == 202, published.text
        assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
        acked.append(batch["batch_id"])
    return acked


def _consistent(api: httpx.Client, run_id: str) -> dict[str, Any] | None:
    """The run's live counts once they agree: admitted = delivered + discarded + live."""
    live: dict[str, Any] = api.get(f"/api/runs/{run_id}").json()["live"]
    ended = live["groups_delivered"] + sum(live["groups_discarded"].values())
    return live if live["groups_admitted"] - ended == live["groups_live"] else None


def test_a_resumed_run_counts_on_from_the_store_and_takes_a_repeated_ack(tmp_path: Path) -> None:
    env, url, database, log, api = _serve_env(tmp_path)
    store = ServiceStore(database, migrate=False)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None, speed=8.0)).json()["id"]
            acked = _train(api, run_id, 2)
            wait_for(lambda: _consistent(api, run_id), what="consistent counts before the kill")

            def acks_stored() -> bool:
                with store.session() as s:
                    return sum(b.acked_at is not None for b in BatchRepo(s).list(run_id)) == 2

            wait_for(acks_stored, what="both acks in the store")
            wait_for(lambda: store.resume_point(run_id).open_groups, what="stored groups in flight")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        ledger, _ = store.ledger(run_id)  # the stored account the resumed run goes on from
        with store.session() as s:
            delivered = {b.batch_index for b in BatchRepo(s).list(run_id) if b.delivered_at is not None}
        batches = len(delivered)
        assert batches >= 2
        # A batch handed out whose delivery the store had not got yet is kept as a file: its groups are
        # recorded delivered at the restart, not orphaned.
        offers = [json.loads(f.read_text()) for f in (tmp_path / "data" / run_id / "offers").glob("*.json")]
        kept = {g["group_id"] for o in offers if o["index"] not in delivered for g in o["groups"]}

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            again = api.post(f"/api/runs/{run_id}/batches/{acked[0]}/ack")
            assert again.status_code == 200, again.text
            assert again.json() == {"batch_id": acked[0], "acked": True, "already_acked": True}
            unknown = api.post(f"/api/runs/{run_id}/batches/{run_id}-b999/ack")
            assert unknown.status_code == 404, unknown.text

            live = wait_for(lambda: _consistent(api, run_id), what="consistent counts after the resume")
            assert live["batches"] >= batches
            assert live["groups_admitted"] >= ledger.admitted_count
            assert live["groups_delivered"] >= ledger.delivered_count
            assert ledger.open_groups
            assert live["groups_discarded"].get("orphaned", 0) >= len(ledger.open_groups - kept)
            assert live["last_seq"] + 1 >= live["events"] > 0  # events counted from the stream's start
            trainer = api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]
            assert trainer["acked"] >= 2  # the trainer's counters go on from the store's too
            assert trainer["offered"] >= batches
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        store.close()
        api.close()


def test_a_resumed_run_counts_the_batches_delivered_before_the_kill_towards_its_batches(
    tmp_path: Path,
) -> None:
    """`batches` counts the run's trainer steps over all its lives: a run of 4 batches killed after 2
    went on for 4 more after the restart (6 in all), since the resumed run counted from zero again."""
    env, url, database, log, api = _serve_env(tmp_path)
    store = ServiceStore(database, migrate=False)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=4, speed=8.0)).json()["id"]
            before = _train(api, run_id, 2)
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            after = []
            while (
                taken := api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60})
            ).status_code == 200:
                batch = taken.json()
                publish = {"version": batch["publish_version"], "sentinel": True}
                assert api.post(f"/api/runs/{run_id}/weights", json=publish).status_code in (202, 409)
                assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
                after.append(batch["batch_id"])
                assert len(before + after) <= 4, after  # it went on for 4 more
            assert taken.status_code == 409, taken.text
            assert taken.json()["detail"] == f"run {run_id!r} has ended (completed); no more batches"
            assert before + after == [f"{run_id}-b{index}" for index in range(4)]
        with store.session() as s:
            assert [b.batch_index for b in BatchRepo(s).list(run_id) if b.delivered_at is not None] == [
                0,
                1,
                2,
                3,
            ]
    finally:
        store.close()
        api.close()


@pytest.mark.slow
def test_a_resumed_local_run_still_starting_asks_its_trainer_to_wait(tmp_path: Path) -> None:
    """A local run resumed after a kill -9 starts its engines again (seconds): meanwhile the publication
    of the batch its trainer holds answered 409 "is created; this needs it running or paused", which the
    README's trainer loop takes for the run's end (it died with CorralError). Now: 503, then 202."""
    env, url, _, log, api = _serve_env(tmp_path)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            spec = {"name": "local", "kind": "local", "config": make_local_config()}
            run_id = api.post("/api/runs", json=spec).json()["id"]
            batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 240}).json()
            kept = tmp_path / "data" / run_id / "offers" / f"{batch['batch_id']}.json"
            wait_for(kept.exists, what="the offer kept on disk")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            publish = {"version": batch["publish_version"], "sentinel": True}
            waits = 0
            while (published := api.post(f"/api/runs/{run_id}/weights", json=publish)).status_code == 503:
                assert published.headers["Retry-After"] == "5"
                assert "is being resumed after a restart" in published.json()["detail"]
                waits += 1
                time.sleep(0.2)
            assert published.status_code == 202, published.text
            assert waits > 0  # asked while its engines started
            assert api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack").status_code == 200
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        api.close()


def test_an_ack_the_store_has_not_got_is_a_503_so_a_kill_does_not_hand_its_batch_out_again(
    tmp_path: Path,
) -> None:
    """SQLite locked by another connection past the ack's wait (5 s): the ack answered 200 all the same,
    and a kill -9 before the lock went handed the acked batch out again after the restart (delivery 2),
    which the README's trainer loop trains on twice. Now a 503 until the store has it."""
    env, url, database, log, api = _serve_env(tmp_path)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            publish = {"version": batch["publish_version"], "sentinel": True}
            assert api.post(f"/api/runs/{run_id}/weights", json=publish).status_code == 202
            ack = f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack"
            holder = sqlite3.connect(database.removeprefix("sqlite:///"), isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                unstored = api.post(ack)
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            assert unstored.status_code == 503, unstored.text
            assert unstored.headers["retry-after"] == "5"
            assert "has not stored the ack yet" in unstored.json()["detail"]
            again = api.post(ack)  # as the trainer loop does after a 503
            assert again.status_code == 200, again.text
            assert again.json()["already_acked"] is True
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            following = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30})
            assert following.status_code == 200, following.text
            assert following.json()["batch_id"] != batch["batch_id"]
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        api.close()


def test_a_batch_handed_out_while_the_database_is_locked_is_offered_again_after_a_kill(
    tmp_path: Path,
) -> None:
    """A batch's kept file was written by the store writer, behind the marks it waits to store: with
    SQLite locked, a batch offered after the writer blocked was handed out with no file, and a kill -9
    then lost it (not offered again, its ack a 404 "has no batch"). Here the trainer acks without waiting
    for the store (it takes the 503s as done); each batch comes back after the restart."""
    env, url, database, log, api = _serve_env(tmp_path)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            holder = sqlite3.connect(database.removeprefix("sqlite:///"), isolation_level=None)
            taken = []
            try:
                for step in range(3):
                    batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
                    taken.append(batch["batch_id"])
                    if step == 2:
                        break
                    publish = {"version": batch["publish_version"], "sentinel": True}
                    published = api.post(f"/api/runs/{run_id}/weights", json=publish)
                    assert published.status_code == (202 if step == 0 else 503), published.text  # 503: locked
                    if step == 0:
                        holder.execute("BEGIN IMMEDIATE")
                    acked = api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack")
                    assert acked.status_code == 503, acked.text  # not stored: offered again after the kill
                first.send_signal(signal.SIGKILL)
                assert first.wait(10) == -signal.SIGKILL
            finally:
                holder.execute("ROLLBACK")
                holder.close()
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            again = [api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 10}) for _ in taken]
            assert [a.status_code for a in again] == [200, 200, 200], [a.text for a in again]
            assert [a.json()["batch_id"] for a in again] == taken
            assert [a.json()["delivery"] for a in again] == [2, 2, 2]  # each handed out before
            for batch_id in taken:
                assert api.post(f"/api/runs/{run_id}/batches/{batch_id}/ack").status_code == 200
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        api.close()


def test_hand_outs_the_store_missed_before_a_kill_are_counted_from_the_kept_file(tmp_path: Path) -> None:
    """A batch handed out three times while SQLite was locked, then a kill -9: the store had one offer,
    so after the restart `redelivered` said 1 where the trainer had been handed it 4 times (the kept
    file counted them all). The trainer's own ledger here is the `delivery` of each answer."""
    env, url, database, log, api = _serve_env(tmp_path)
    env["CORRAL_ACK_TIMEOUT_S"] = "0.5"
    deliveries = []
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            deliveries.append(batch["delivery"])

            def offer_count() -> list[int]:
                store = ServiceStore(database, migrate=False)
                try:
                    with store.read_session() as s:
                        return [b.offer_count for b in BatchRepo(s).list(run_id) if b.batch_index == 0]
                finally:
                    store.close()

            wait_for(lambda: offer_count() == [1], what="the first offer to be stored")
            holder = sqlite3.connect(database.removeprefix("sqlite:///"), isolation_level=None)
            try:
                holder.execute("BEGIN IMMEDIATE")
                for _ in range(2):  # the lease runs out each time: the same batch again
                    again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 10}).json()
                    assert again["batch_id"] == batch["batch_id"]
                    deliveries.append(again["delivery"])
                first.send_signal(signal.SIGKILL)
                assert first.wait(10) == -signal.SIGKILL
            finally:
                holder.execute("ROLLBACK")
                holder.close()
        assert offer_count() == [1]  # what the kill left in the store
        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 30}).json()
            assert again["batch_id"] == batch["batch_id"]
            deliveries.append(again["delivery"])
            assert deliveries == [1, 2, 3, 4]
            trainer = api.get(f"/api/runs/{run_id}/metrics").json()["trainer"]
            assert (trainer["offered"], trainer["redelivered"]) == (1, 3)
            wait_for(lambda: offer_count() == [4], what="the store to count every hand-out")
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        api.close()


def test_a_run_that_ended_before_a_restart_answers_as_ended(tmp_path: Path) -> None:
    env, url, database, log, api = _serve_env(tmp_path)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None)).json()["id"]
            (acked,) = _train(api, run_id, 1)
            # the next batch is handed out and never acked: the run waits on it when Ctrl-C comes
            unacked = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            kept = tmp_path / "data" / run_id / "offers" / f"{unacked['batch_id']}.json"
            wait_for(kept.exists, what="the unacked offer kept on disk")
            first.send_signal(signal.SIGINT)  # Ctrl-C: the server stops its runs
            assert first.wait(60) in (0, -signal.SIGINT, 130), log.read_text()[-2000:]
        assert stored_run(database, run_id).state == "stopped"

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            # the batch handed out and never acked is not lost with the run: it comes again, once
            again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 1})
            assert again.status_code == 200, again.text
            assert again.json()["batch_id"] == unacked["batch_id"]
            assert again.json()["groups"] == unacked["groups"]
            leased = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 0.5})
            assert leased.status_code == 204, leased.text  # leased to the first taker until its timeout
            took = api.post(f"/api/runs/{run_id}/batches/{unacked['batch_id']}/ack")
            assert took.status_code == 200, took.text
            assert took.json()["already_acked"] is False
            wait_for(lambda: not kept.exists(), what="the acked offer's file removed")
            repeated = api.post(f"/api/runs/{run_id}/batches/{unacked['batch_id']}/ack")
            assert repeated.json()["already_acked"] is True
            ended = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 1})
            assert ended.status_code == 409, ended.text
            assert ended.json()["detail"] == f"run {run_id!r} has ended (stopped); no more batches"
            with CorralClient(url, token=TOKEN) as corral, pytest.raises(RunEnded):
                corral.next_batch(run_id, timeout=1)

            again = api.post(f"/api/runs/{run_id}/batches/{acked}/ack")
            assert again.status_code == 200, again.text
            assert again.json()["already_acked"] is True
            for bad in (f"{run_id}-b999", f"{run_id}-b²", f"{run_id}-b-1", "b0", "..%2F..%2Fx"):
                assert api.post(f"/api/runs/{run_id}/batches/{bad}/ack").status_code == 404, bad

            metrics = api.get(f"/api/runs/{run_id}/metrics")
            assert metrics.status_code == 200, metrics.text
            figures = metrics.json()
            assert figures["state"] == "stopped"
            assert figures["batches"] >= 1
            assert figures["trainer"]["acked"] == 2
            assert figures["groups_live"] == 0
            assert figures["groups_admitted"] == figures["groups_delivered"] + sum(
                figures["groups_discarded"].values()
            )

            paused = api.post(f"/api/runs/{run_id}/pause")
            assert paused.status_code == 409
            assert "has ended (stopped)" in paused.json()["detail"]

            done = run_example(url, run_id)
            assert done.returncode == 0, done.stderr
            assert "Traceback" not in done.stderr
            assert done.stdout == ""  # no batch: the loop ended at once
    finally:
        api.close()


def test_a_run_stopped_by_ctrl_c_while_postgres_was_away_stays_stopped_after_the_restart(
    tmp_path: Path,
) -> None:
    """Ctrl-C with the database away: the run stopped ("stopped, N batches"), its end kept in its spill,
    not in its row. The next start stored the spill (its `run_ended`, which ends the row) but resumed the
    run all the same, from the list of unfinished runs it read before: the run an operator stopped
    delivered batches again, its stream going on past its end. Now it answers as the stopped run it is."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    try:
        with relayed_database(POSTGRES_URL, tmp_path) as db:
            env = {**serve_env(tmp_path, db.relayed_url, port), "CORRAL_STORE_OUTAGE_S": "2"}
            with corral_serve(env, log) as first:
                wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
                spec = make_run(batches=None, trainer="sentinel", sentinel_step_s=0.05, speed=8.0)
                run_id = api.post("/api/runs", json=spec).json()["id"]
                wait_for(
                    lambda: api.get(f"/api/runs/{run_id}").json()["live"]["batches"] >= 2, what="2 batches"
                )
                db.relay.cut()
                first.send_signal(signal.SIGINT)
                assert first.wait(120) == 0, log.read_text()[-2000:]
            assert f"run {run_id} (test-run): stopped" in log.read_text()
            db.relay.restore()
            with corral_serve(env, log):
                wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
                view = api.get(f"/api/runs/{run_id}").json()
                assert (view["state"], view["live"]) == ("stopped", None), log.read_text()[-2000:]
            store = ServiceStore(db.url, migrate=False)
            try:
                kinds = [row["kind"] for row in store.timeline(run_id, -1, 100_000)]
            finally:
                store.close()
            assert kinds.count("run_started") == kinds.count("run_ended") == 1
            assert kinds[-1] == "run_ended"
    finally:
        api.close()


def test_a_rollout_left_running_by_a_run_that_had_ended_is_cancelled_at_start_up(tmp_path: Path) -> None:
    """The store of a run that ended with a rollout under way (written before rollouts were closed at
    the run's end, or with its last events dropped) said `running` for ever; a starting server closes
    such rollouts as cancelled, at the run's last event."""
    database = f"sqlite:///{tmp_path / 'corral.db'}"
    store = ServiceStore(database)
    try:
        store.create_run("ended-1", "ended", make_run(), {})
        timed: list[tuple[float, Event]] = [
            (0.0, RunStarted(engines=("e0", "e1"))),
            (1.0, VersionPublished(1, None, "trainer-1")),
            (1.0, EngineUpdateBegin("e0", 1)),
            (2.5, GroupAdmitted(0, 0, 2)),
        ]
        store.event_sink().write_batch([Envelope("ended-1", seq, t, ev) for seq, (t, ev) in enumerate(timed)])
        store.set_state("ended-1", RunState.RUNNING)
        store.set_state("ended-1", RunState.STOPPED)
    finally:
        store.close()
    with serving(make_settings(tmp_path, database)) as url:
        answer = httpx.get(f"{url}/api/runs/ended-1/rollouts/1", timeout=30)
    assert answer.status_code == 200, answer.text
    rollout = answer.json()
    assert (rollout["state"], rollout["ended_at"]) == ("cancelled", 2.5)
    assert [(e["engine"], e["state"], e["error"]) for e in rollout["engines"]] == [
        ("e0", "cancelled", "run ended"),
        ("e1", "cancelled", "run ended"),
    ]


def test_a_resumed_run_keeps_the_policy_changed_live_and_its_ready_cap(tmp_path: Path) -> None:
    """K, S and the rollout pace changed live (PATCH) were stored, but a run resumed after a kill -9
    went back to the values it was created with, and an external trainer's run lost its cap on ready
    groups (ready_surplus B + S became none), writing both over the stored policy."""
    env, url, database, log, api = _serve_env(tmp_path)
    changes = {"max_staleness": 5, "surplus_groups": 3, "max_updating_engines": 2, "pause_mode": "abort"}
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None, speed=8.0)).json()["id"]
            before = api.get(f"/api/runs/{run_id}").json()["policy"]
            assert before["ready_surplus"] == before["groups_per_batch"] + before["surplus_groups"]
            changed = api.patch(f"/api/runs/{run_id}/policy", json=changes)
            assert changed.status_code == 200, changed.text
            expected = {**before, **changes}
            knobs = [*changes, "ready_surplus"]

            def starts() -> list[dict[str, Any]]:
                store = ServiceStore(database, migrate=False)
                try:
                    events = store.timeline(run_id, -1, 100_000)
                finally:
                    store.close()
                return [e for e in events if e["kind"] == "run_started"]

            def stored_changes() -> bool:
                policy = stored_run(database, run_id).policy
                return all(policy[k] == expected[k] for k in knobs)

            wait_for(stored_changes, what="the changes in the store")
            wait_for(starts, what="the run's start in the store")
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            view = api.get(f"/api/runs/{run_id}").json()
            assert view["state"] == "running"
            assert {k: view["policy"][k] for k in knobs} == {k: expected[k] for k in knobs}

            resumed = wait_for(lambda: starts()[1:], what="the resumed run's start in the store")
            assert {k: resumed[0]["policy"][k] for k in knobs} == {k: expected[k] for k in knobs}
            assert stored_changes()
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
        assert stored_changes()
    finally:
        api.close()


def test_a_batch_kept_for_the_trainer_but_whose_delivery_the_store_never_got_is_recorded_delivered(
    tmp_path: Path,
) -> None:
    """A batch handed out, kept as a file, and then the server killed before its delivery reached the
    store (its events buffered, here behind a locked database): the restarted server offered it again,
    yet recorded its groups `orphaned` and the batch never delivered, so the trainer trained on groups
    the account says were discarded and its ack was not stored. Now the kept offer is the proof of the
    delivery: its groups are recorded delivered in that batch, and the ack is stored."""
    import sqlite3

    env, url, database, log, api = _serve_env(tmp_path)
    store = ServiceStore(database, migrate=False)
    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            # at speed 1 the first batch takes a few seconds: the store is locked before it comes
            run_id = api.post("/api/runs", json=make_run(batches=None, speed=1.0)).json()["id"]
            wait_for(lambda: store.timeline(run_id, -1, 10), what="the run's first events in the store")
            lock = sqlite3.connect(tmp_path / "corral.db", timeout=30, isolation_level=None)
            lock.execute("BEGIN EXCLUSIVE")  # the store takes no more writes: events stay buffered
            try:
                batch = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
                kept = tmp_path / "data" / run_id / "offers" / f"{batch['batch_id']}.json"
                wait_for(kept.exists, what="the kept offer")
                first.send_signal(signal.SIGKILL)
                assert first.wait(10) == -signal.SIGKILL
            finally:
                lock.execute("ROLLBACK")
                lock.close()
        groups = sorted(g["group_id"] for g in batch["groups"])
        with store.session() as s:
            stored = BatchRepo(s).get(run_id, batch["index"])
            assert stored is None or stored.delivered_at is None  # the delivery died with the server
        assert set(groups) <= store.resume_point(run_id).open_groups

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            again = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            assert again["batch_id"] == batch["batch_id"]
            acked = api.post(f"/api/runs/{run_id}/batches/{batch['batch_id']}/ack")
            assert acked.status_code == 200, acked.text
            publish = {"version": again["publish_version"], "sentinel": True}  # the step's end, as a trainer
            assert api.post(f"/api/runs/{run_id}/weights", json=publish).status_code == 202
            # the resumed run numbers its batches and groups after the kept one (not from the store's)
            fresh = api.get(f"/api/runs/{run_id}/batches/next", params={"timeout": 60}).json()
            assert fresh["index"] > batch["index"]
            assert fresh["batch_id"] != batch["batch_id"]
            assert min(g["group_id"] for g in fresh["groups"]) > max(groups)
            assert api.post(f"/api/runs/{run_id}/batches/{fresh['batch_id']}/ack").status_code == 200
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 60, "stopped")
        ledger, _ = store.ledger(run_id)
        assert ledger.lost == 0
        with store.session() as s:
            ends = {g.group_id: (g.state, g.reason, g.batch_index) for g in GroupRepo(s).list(run_id)}
            assert [ends[g] for g in groups] == [("delivered", None, batch["index"])] * len(groups)
            stored = BatchRepo(s).get(run_id, batch["index"])
            assert stored is not None
            assert stored.delivered_at is not None
            assert sorted(stored.group_ids) == groups
            assert stored.acked_at is not None
    finally:
        store.close()
        api.close()


def test_concurrent_policy_changes_are_stored_as_they_were_made_before_the_answer(tmp_path: Path) -> None:
    """The API wrote each PATCH's knobs to the store itself, beside the event sink's ordered write of
    the same changes: with PATCHes at once, the stored policy could be an older one than the live run's
    (for up to a sink flush), and a kill -9 then resumed the run with stale knobs. Now a PATCH answers
    once its changes are in the store, written in the order they were made."""
    from concurrent.futures import ThreadPoolExecutor

    env, url, database, log, api = _serve_env(tmp_path)
    headers = dict(api.headers)
    store = ServiceStore(database, migrate=False)
    knobs = ("max_staleness", "surplus_groups")

    def patch(value: int) -> None:
        change = {"max_staleness": value, "surplus_groups": value % 7}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            answer = client.patch(f"/api/runs/{run_id}/policy", json=change)
        assert answer.status_code == 200, answer.text

    def stored() -> dict[str, Any]:
        with store.session() as s:
            policy = s.get(Run, run_id).policy  # type: ignore[union-attr]
            s.expire_all()
        return {k: policy[k] for k in knobs}

    try:
        with corral_serve(env, log) as first:
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            run_id = api.post("/api/runs", json=make_run(batches=None, speed=8.0)).json()["id"]
            wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "running", what="running")
            with ThreadPoolExecutor(8) as pool:
                for round_ in range(12):
                    list(pool.map(patch, range(20 * round_ + 1, 20 * round_ + 17)))
                    live = {k: api.get(f"/api/runs/{run_id}").json()["policy"][k] for k in knobs}
                    assert stored() == live, f"round {round_}"
            first.send_signal(signal.SIGKILL)  # at once: nothing more flushed
            assert first.wait(10) == -signal.SIGKILL

        with corral_serve(env, log):
            wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
            view = api.get(f"/api/runs/{run_id}").json()
            assert {k: view["policy"][k] for k in knobs} == live
            assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    finally:
        store.close()
        api.close()
