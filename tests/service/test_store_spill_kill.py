"""A process killed (kill -9) while its run's store sink held events in its spill, the database locked by
another writer: the next start stores the spill before the run resumes, and the resumed run continues
after it, with no hole in the stored stream. Killed at the moment its spill began, it left on disk every
event it had published."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from factories import take_write_lock
from kill_at import kill_when

from app.runtime.spill import recover, segments
from app.service.manager import RunManager
from app.service.store import ServiceStore

# The child: a RunManager driving one simulated run, built as `corral serve` builds it from its settings,
# its store's outage wait and buffer made small (SHORT_WAITS) so that a locked file sends its events to
# the spill within a second.
CHILD = """
import time
from app.service.compose import manager_for, store_for
from app.service.schemas import RunCreate
from app.settings import Settings

settings = Settings()  # CORRAL_DATABASE_URL, CORRAL_DATA_DIR and the waits, from the environment
manager = manager_for(settings, store_for(settings))
spec = {"name": "killed", "kind": "sim", "speed": 20.0, "trainer": "sentinel", "batches": 10000}
print(manager.create(RunCreate.model_validate(spec)), flush=True)
time.sleep(600)
"""
SHORT_WAITS = {
    "CORRAL_STORE_OUTAGE_S": "1.0",
    "CORRAL_SQLITE_BUSY_TIMEOUT_S": "0.5",
    "CORRAL_STORE_BUFFER": "100",
    "CORRAL_SINK_RETRY_MAX_S": "0.5",
}


# The child: the store sink of a bus on a database the test holds locked, publishing `BatchRequested(n)`
# with n = seq; after each publish it writes n to the ledger file (the test's own account, not Corral's).
FILLING = """
import os, sys
from pathlib import Path
from app.core.events import BatchRequested
from app.runtime.events import EventBus
from app.runtime.spill import SpillFile
from app.service.store import ServiceStore

url, run_id, spill_dir, ledger, capacity = sys.argv[1:]
clock = iter(range(10**9))
bus = EventBus(run_id, clock=lambda: float(next(clock)))
spill = SpillFile(Path(spill_dir), max_bytes=2**30)
bus.add_sink(ServiceStore(url, migrate=False).event_sink(), name="store", capacity=int(capacity), spill=spill)
fd = os.open(ledger, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
for n in range(10**7):
    bus.publish(BatchRequested(n))
    os.write(fd, b"%d\\n" % n)
"""


def rows(db: Path, run_id: str) -> list[int]:
    conn = sqlite3.connect(db)
    try:
        return [s for (s,) in conn.execute("SELECT seq FROM events WHERE run_id = ? ORDER BY seq", (run_id,))]
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("restart", ["at once", "in the background"])
def test_a_spill_left_by_a_killed_process_is_stored_and_its_run_resumes_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart: str
) -> None:
    """`resume_unfinished` stores the spill, then resumes; `start_resuming` (as `corral serve` starts,
    which answers `/healthz` meanwhile) does both on its thread: it returns before the spill is stored."""
    db, data = tmp_path / "corral.db", tmp_path / "data"
    url = f"sqlite:///{db}"
    ServiceStore(url).close()  # the schema, before the child and the lock
    env = {**os.environ, "CORRAL_DATABASE_URL": url, "CORRAL_DATA_DIR": str(data), **SHORT_WAITS}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    other = None
    try:
        assert child.stdout is not None
        run_id = child.stdout.readline().strip()
        assert run_id, "the child printed no run id"
        deadline = time.monotonic() + 60
        while len(rows(db, run_id)) < 50:
            assert time.monotonic() < deadline, "the child stored nothing"
            time.sleep(0.1)
        other = take_write_lock(db)  # held past the child's outage wait, until after the kill
        spill_dir = data / run_id / "event-spill"
        deadline = time.monotonic() + 60
        while sum(p.stat().st_size for p in segments(spill_dir)) < 100_000:
            assert time.monotonic() < deadline, "the child never spilled"
            time.sleep(0.1)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
        other.execute("COMMIT")
        other.close()
        other = None
        before = rows(db, run_id)
        spilled = [e.seq for e in recover(spill_dir).envelopes]
        assert before == list(range(len(before)))
        assert spilled
        assert spilled[0] <= len(before)  # the spill starts where the store stops: nothing in between
        assert spilled[-1] - spilled[0] + 1 == len(spilled)  # and has no hole

        store = ServiceStore(url)
        manager = RunManager(store, data, 30.0)
        try:
            if restart == "at once":
                assert manager.resume_unfinished() == [run_id]
            else:
                held, release = threading.Event(), threading.Event()
                recover_spill = RunManager._recover_spill

                def held_recovery(self: RunManager, run: str, directory: Path) -> int:
                    held.set()
                    release.wait(30)
                    return recover_spill(self, run, directory)

                monkeypatch.setattr(RunManager, "_recover_spill", held_recovery)
                assert manager.start_resuming() == [run_id]  # returned with the spill not yet stored
                assert held.wait(30)
                assert spill_dir.exists()
                assert manager.get(run_id) is None  # nor resumed before it
                release.set()
                deadline = time.monotonic() + 60
                while manager.get(run_id) is None:
                    assert time.monotonic() < deadline, "the run was not resumed"
                    time.sleep(0.05)
            handle = manager.get(run_id)
            assert handle is not None
            after_recovery = rows(db, run_id)[: spilled[-1] + 1]
            assert after_recovery == list(range(spilled[-1] + 1))
            assert not spill_dir.exists()
            deadline = time.monotonic() + 30
            while handle.recorder.bus.published < spilled[-1] + 200:
                assert time.monotonic() < deadline, "the resumed run did not go on"
                time.sleep(0.05)
            manager.shutdown()
            published = handle.recorder.bus.published
        finally:
            manager.shutdown()
            store.close()
        assert rows(db, run_id) == list(range(published))  # every event, once, no hole
        print(f"stored before the kill {len(before)}, spilled {len(spilled)}, in all {published}")
    finally:
        if other is not None:
            other.execute("COMMIT")
            other.close()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


@pytest.mark.slow
def test_a_process_killed_as_its_spill_begins_leaves_every_event_it_published_on_disk(tmp_path: Path) -> None:
    # Before: the copy of the full buffer went to disk on a thread after the first spilled event (0.7 s
    # for 100,000): a kill in between left the spill without the buffer, a hole of `capacity` events.
    db, data, ledger = tmp_path / "corral.db", tmp_path / "data", tmp_path / "ledger"
    url, run_id = f"sqlite:///{db}", "killedrun01"
    store = ServiceStore(url)
    store.create_run(run_id, "killed as it spilled", {}, {})
    store.close()
    spill_dir = data / run_id / "event-spill"
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the database is away: the sink's first batch waits on it
    argv = [sys.executable, "-c", FILLING, url, run_id, str(spill_dir), str(ledger), "20000"]
    try:  # killed once the first spilled event is on disk
        kill_when(argv, lambda: segments(spill_dir), "the child spilled")
    finally:
        other.execute("COMMIT")
        other.close()
    published = [int(line) for line in ledger.read_text().split()]
    assert published == list(range(len(published)))
    assert len(published) > 20_000  # past the buffer
    store = ServiceStore(url)
    try:
        RunManager(store, data, 30.0).recover_spills()
    finally:
        store.close()
    stored = rows(db, run_id)
    print(f"published {len(published)} before the kill, stored {len(stored)} after the restart")
    assert stored[: len(published)] == published  # every event published, once, in order: no hole
    assert stored == list(range(len(stored)))
