"""`corral serve` while the disk under its database or its data directory fills up and is freed again,
a real full file system (a small tmpfs, `small_disk`) under a real server and a run collecting: the run
goes on once there is room, and nothing it stored, or had to store, is lost."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest
from api_support import free_port, make_run, serve_env, serve_process, wait_for
from small_disk import fill, read_only_switch, small_disk

pytestmark = pytest.mark.timeout(300)


def batches(api: httpx.Client, run_id: str) -> int:
    """The run's batches delivered so far; the run must not have failed or stopped on its own."""
    answer = api.get(f"/api/runs/{run_id}").json()
    assert answer["state"] in ("created", "running", "paused"), answer.get("error")
    return int(answer["live"]["batches"])


def collect_through_a_full_disk(
    api: httpx.Client, disk: Path, log: Path, refused: str, paused_when: str | None = None
) -> str:
    """A simulated run with the built-in trainer, collecting; `disk` filled once it has delivered 3
    batches, freed once the log has said `refused` twice (no store write given up meanwhile), then the
    run stopped after 3 more batches. `paused_when`: the run is paused once the log says it, with the
    disk full, and resumed once it is freed. Returns its id."""
    spec = make_run(batches=None, speed=10.0, trainer="sentinel", sentinel_step_s=0.2)
    run_id: str = api.post("/api/runs", json=spec).json()["id"]
    wait_for(lambda: batches(api, run_id) >= 3, 120, what="3 batches before the disk fills")
    filler = fill(disk)
    if paused_when is not None:
        wait_for(lambda: paused_when in log.read_text(), 120, what=f"{paused_when!r} in {log}")
        assert api.post(f"/api/runs/{run_id}/pause").status_code == 200

    def refused_twice() -> bool:
        text = log.read_text()
        assert "store mirror write failed" not in text, text[-3000:]  # an offer or ack mark given up
        return batches(api, run_id) >= 0 and text.count(refused) >= 2

    wait_for(refused_twice, 120, what=f"{refused!r} twice in {log}")
    filler.unlink()
    if paused_when is not None:
        assert api.post(f"/api/runs/{run_id}/resume").status_code == 200
    after = batches(api, run_id)
    wait_for(lambda: batches(api, run_id) >= after + 3, 120, what="3 more batches once the disk has room")
    stop(api, run_id)
    return run_id


def stop(api: httpx.Client, run_id: str) -> None:
    assert api.post(f"/api/runs/{run_id}/stop").status_code == 200
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["state"] == "stopped", 120, what="the stop")


def stored(database: Path, run_id: str) -> tuple[list[int], str, list[tuple[int, bool]]]:
    """The run's stored event seqs, its stored state and each delivered batch's (index, acked)."""
    db = sqlite3.connect(database)
    try:
        seqs = [r[0] for r in db.execute("select seq from events where run_id = ? order by seq", (run_id,))]
        (state,) = db.execute("select state from runs where id = ?", (run_id,)).fetchone()
        rows = db.execute(
            "select batch_index, acked_at is not null from batches where run_id = ? and delivered_at is not "
            "null order by batch_index",
            (run_id,),
        )
        return seqs, state, [(int(i), bool(acked)) for i, acked in rows]
    finally:
        db.close()


def test_a_full_disk_under_the_database_loses_no_event_and_no_ack(tmp_path: Path) -> None:
    """Before, each batch of events the database refused ("database or disk is full") was counted failed
    and dropped, 7,677 of a run's 21,183 events in 20 s of a full disk (holes in its stored stream), and
    every store writer's write (a pause, a stop, an offer or ack mark) was given up after the store's
    outage wait ("store mirror write failed"): a stop not stored is resumed by the next start, an ack not
    stored hands its batch out again."""
    with small_disk(tmp_path / "disk", 16) as disk:
        database = disk / "corral.db"
        env = {
            **serve_env(tmp_path, f"sqlite:///{database}", free_port()),
            "CORRAL_STORE_OUTAGE_S": "1",  # the disk stays full past the store's outage wait
        }
        log = tmp_path / "serve.log"
        with serve_process(env, log) as api:
            # The pause's state write goes to the store writer; its second try comes once its first
            # waited out the store's outage wait
            refused = "store writer: the database is out of disk space (database or disk is full)"
            run_id = collect_through_a_full_disk(api, disk, log, refused, "database or disk is full")
        seqs, state, delivered = stored(database, run_id)
    assert state == "stopped"
    assert seqs == list(range(len(seqs)))  # every event stored, none twice, no hole
    assert len(delivered) >= 6
    # the built-in trainer acks each batch it takes; the stop may come before it acks the last one
    assert [index for index, acked in delivered[:-1] if not acked] == []
    text = log.read_text()
    assert "the database is out of disk space (database or disk is full)" in text
    assert "Traceback" not in text


def test_a_full_disk_under_the_data_directory_holds_the_batch_until_it_is_kept(tmp_path: Path) -> None:
    """Before, the batch's kept file (written before a trainer may take it) raised ENOSPC into the run,
    which failed for good with a traceback in the log: `failed`, "OSError: [Errno 28] No space left on
    device", where the disk was free again seconds later."""
    with small_disk(tmp_path / "disk", 4) as disk:
        env = {
            **serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", free_port()),
            "CORRAL_DATA_DIR": str(disk / "data"),
        }
        log = tmp_path / "serve.log"
        with serve_process(env, log) as api:
            run_id = collect_through_a_full_disk(
                api,
                disk,
                log,
                "kept before a trainer may take it: the disk refuses it (No space left on device)",
            )
        text = log.read_text()
        assert "Traceback" not in text
        assert "kept before a trainer may take it: written after" in text
        assert not [
            p.name for p in (disk / "data" / run_id / "offers").iterdir() if not p.name.endswith(".json")
        ]
        seqs, state, _ = stored(tmp_path / "corral.db", run_id)
    assert state == "stopped"
    assert seqs == list(range(len(seqs)))


@pytest.mark.slow
def test_sentinel_weights_the_full_disk_refuses_wait_for_room_and_a_publish_says_why(tmp_path: Path) -> None:
    """A local run (real embedded engines) with the built-in trainer, its data directory on a disk that
    fills while the trainer steps. Before, the trainer's sentinel weights raised ENOSPC into the run,
    which failed; and a publication through the API (the dashboard's Publish) answered 500, a traceback
    in the log."""
    from factories import make_local_config

    with small_disk(tmp_path / "disk", 8) as disk:
        env = {
            **serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", free_port()),
            "CORRAL_DATA_DIR": str(disk / "data"),
        }
        log = tmp_path / "serve.log"
        with serve_process(env, log) as api:
            spec = {"name": "local", "kind": "local", "config": make_local_config(), "trainer": "sentinel",
                    "sentinel_step_s": 5.0}  # fmt: skip
            run_id = api.post("/api/runs", json=spec).json()["id"]

            def taken() -> bool:  # the first batch kept and handed to the trainer, which steps on it
                batches(api, run_id)
                return bool(api.get(f"/api/runs/{run_id}").json()["live"].get("batches_unacked"))

            wait_for(taken, 280, what=f"the first batch; log {log}")
            filler = fill(disk)
            answer = api.post(f"/api/runs/{run_id}/weights", json={"version": 50, "sentinel": True})
            assert answer.status_code == 503, answer.text
            assert answer.headers["retry-after"] == "5"
            assert answer.json()["detail"].startswith(
                "the sentinel weights of version 50 cannot be written ([Errno 28] No space left on device"
            )
            refused = f"run {run_id}: sentinel weights v1: the disk refuses it"
            wait_for(lambda: batches(api, run_id) >= 0 and refused in log.read_text(), 60, what=refused)
            filler.unlink()
            wait_for(lambda: batches(api, run_id) >= 2, 280, what="the next batch once the disk has room")
            stop(api, run_id)
        text = log.read_text()
        assert f"run {run_id}: sentinel weights v1: written after" in text
        assert "Traceback" not in text


def test_an_acked_batch_whose_kept_file_a_read_only_disk_keeps_is_not_handed_out_again(
    tmp_path: Path,
) -> None:
    """The data directory turned read-only under a run, `corral serve` killed meanwhile and started
    again once it is writable. Before, the acked batch's kept file could not be removed: the store
    writer's flush ended there ("store mirror write failed: OSError(30, 'Read-only file system')",
    the marks after it lost), and the restarted server handed the acked batch out again (its ack
    count 2 in the store)."""
    env = {
        **serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", free_port()),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
    }
    log = tmp_path / "serve.log"
    with read_only_switch(tmp_path / "data") as read_only:
        with serve_process(env, log, killed=True) as api:
            spec = make_run(batches=None, speed=10.0, trainer="sentinel", sentinel_step_s=0.2)
            run_id = api.post("/api/runs", json=spec).json()["id"]
            wait_for(lambda: batches(api, run_id) >= 3, 120, what="3 batches")
            read_only(True)
            said = ("acked; its kept file is not removed", "store mirror write failed")  # after, before
            wait_for(lambda: any(s in log.read_text() for s in said), 120, what=f"an ack's file kept; {log}")
        kept = sorted((tmp_path / "data" / run_id / "offers").glob("*.json"))
        assert kept, "no kept file left by the read-only disk"
        read_only(False)
        with serve_process(env, log) as api:
            after = batches(api, run_id)
            wait_for(lambda: batches(api, run_id) >= after + 3, 120, what="3 more batches after the restart")
            stop(api, run_id)
        db = sqlite3.connect(tmp_path / "corral.db")
        try:
            twice = db.execute(
                "select batch_index from batches where run_id = ? and ack_count > 1", (run_id,)
            )
            assert twice.fetchall() == []  # no acked batch handed out and acked again
        finally:
            db.close()
        assert not [p for p in kept if p.exists() and p.stem in acked_ids(tmp_path / "corral.db", run_id)]
    assert "store mirror write failed" not in log.read_text()


def acked_ids(database: Path, run_id: str) -> set[str]:
    db = sqlite3.connect(database)
    try:
        rows = db.execute(
            "select batch_index from batches where run_id = ? and acked_at is not null", (run_id,)
        )
        return {f"{run_id}-b{index}" for (index,) in rows}
    finally:
        db.close()


@pytest.mark.slow
def test_a_local_run_whose_events_can_be_kept_nowhere_holds_instead_of_dropping_them(tmp_path: Path) -> None:
    """A local run (real embedded engines and sandboxes) with its database and its event spill on one
    disk, which fills (its data directory elsewhere, so its trainer's weights keep coming): the store
    sink's buffer (1,000 events here) fills and the spill's disk refuses.
    Before, every event past the buffer was dropped, counted, for as long as the disk stayed full (holes
    in the stored stream). Now the run is held (no turn starts) before the buffer is full, and goes on
    once the disk has room: every event stored, in order."""
    from factories import make_local_config

    with small_disk(tmp_path / "disk", 16) as disk:
        database = disk / "corral.db"
        env = {
            **serve_env(tmp_path, f"sqlite:///{database}", free_port()),
            "CORRAL_SPILL_DIR": str(disk / "spill"),
            "CORRAL_STORE_OUTAGE_S": "1",
            # The hold leaves the buffer's last 20% to the events of what is under way (its turns and
            # sandbox ops end and say so): with 400, a loaded CI machine overran that by 9 events
            "CORRAL_STORE_BUFFER": "1000",
        }
        log = tmp_path / "serve.log"
        with serve_process(env, log) as api:
            spec = {"name": "local", "kind": "local", "config": make_local_config(), "trainer": "sentinel",
                    "sentinel_step_s": 0.5}  # fmt: skip
            run_id = api.post("/api/runs", json=spec).json()["id"]
            wait_for(lambda: batches(api, run_id) >= 1, 280, what=f"the first batch; log {log}")
            filler = fill(disk)
            held = f"run {run_id}: held, starting no turn"
            wait_for(lambda: batches(api, run_id) >= 0 and held in log.read_text(), 120, what=f"{held!r}")
            live = api.get(f"/api/runs/{run_id}").json()["live"]
            assert live["held_for_store"] is True
            time.sleep(5)  # held with the disk full: nothing new starts, nothing is dropped
            live = api.get(f"/api/runs/{run_id}").json()["live"]
            assert live["held_for_store"] is True
            assert live["events_spill"]["dropped"] == 0
            assert live["events_unwritten"] < 1000
            page = api.get(f"/runs/{run_id}")
            assert page.status_code == 200
            assert 'id="store-note"' in page.text
            assert "No turn starts until they do" in page.text
            filler.unlink()
            goes_on = f"run {run_id}: goes on: its events are being stored again"
            wait_for(lambda: goes_on in log.read_text(), 120, what=f"{goes_on!r}")
            after = batches(api, run_id)
            wait_for(lambda: batches(api, run_id) >= after + 2, 280, what="2 more batches once it goes on")
            assert api.get(f"/api/runs/{run_id}").json()["live"]["events_spill"]["dropped"] == 0
            assert 'id="store-note"' not in api.get(f"/runs/{run_id}").text
            stop(api, run_id)
        seqs, state, _ = stored(database, run_id)
    assert state == "stopped"
    assert seqs == list(range(len(seqs)))  # every event stored, none twice, no hole
    assert "Traceback" not in log.read_text()
