"""The manager's shutdown is bounded however far behind the store is. A Ctrl-C of `corral serve` took 52
minutes: its store writer held thousands of offer marks for batches whose rows the lagging event sink
had not written, each waiting 10 s for its row, and the shutdown waited for all of them. The marks now
go in one flush, and once shutting down a flush takes one look for each batch's row."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from app.service.gateway import Offer, OfferFiles
from app.service.manager import RunManager
from app.service.store import ServiceStore


def make_offer(index: int) -> Offer:
    payload = {"batch_id": f"r1-b{index}", "index": index}
    return Offer(batch_id=f"r1-b{index}", index=index, payload=payload, offered_at=0.0)


def test_shutdown_does_not_wait_for_batch_rows_the_store_never_got(tmp_path: Path) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        store.create_run("r1", "r1", {}, {})
        manager = RunManager(store, tmp_path / "data", 30.0)
        offers = OfferFiles(tmp_path / "data" / "r1" / "offers")
        blocker = threading.Event()
        manager._mirror(blocker.wait, 5.0)  # the writer is busy while the marks queue up behind it
        for index in range(6):  # batches delivered by the run, their rows not (yet) in the store
            manager._batch_write("offered", "r1", make_offer(index), offers)
        shutdown = threading.Thread(target=manager.shutdown, daemon=True)
        began = time.monotonic()
        shutdown.start()
        time.sleep(0.3)  # the shutdown has begun: the marks are its last writes
        blocker.set()
        shutdown.join(40)
        took = time.monotonic() - began
        assert not shutdown.is_alive(), "the shutdown waited 10 s for each missing batch row (60 s)"
        assert took < 5, f"{took:.1f} s"
        # The marks are given up, not the kept offers: each batch is offered again at the next start
        assert sorted(o.index for o in offers.load()) == list(range(6))
    finally:
        store.close()


def test_abandon_ends_the_shutdown_within_its_grace(tmp_path: Path) -> None:
    store = ServiceStore(f"sqlite:///{tmp_path / 'corral.db'}")
    try:
        manager = RunManager(store, tmp_path / "data", 30.0)
        stuck = threading.Event()
        manager._mirror(stuck.wait, 60.0)  # a write that would hold the writer for a minute
        offers = OfferFiles(tmp_path / "data" / "r1" / "offers")
        manager._batch_write("offered", "r1", make_offer(0), offers)
        shutdown = threading.Thread(target=manager.shutdown, daemon=True)
        shutdown.start()
        time.sleep(0.5)
        assert shutdown.is_alive()  # the writer's bound (15 s) is not over
        began = time.monotonic()
        manager.abandon()
        shutdown.join(10)
        assert not shutdown.is_alive()
        assert time.monotonic() - began < 3
        assert [o.index for o in offers.load()] == [0]  # the given-up offer's file is still written
        stuck.set()
    finally:
        store.close()
