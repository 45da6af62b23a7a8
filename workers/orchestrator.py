"""The orchestrator task: one run's orchestrator, executed by a worker of the `orchestrator` queue.

The task is thin: it holds the run's lease and calls the run manager's entry point, by default
`app.service.runner:run_orchestrator(run_id, settings)`, which loads the run from the database, drives
it to its end and persists it (resuming a run that was live before, as after a restart). A worker may
name another entry point (`corral worker --orchestrator --entry module:function`).

Invariants:
- at most one orchestrator drives a run at a time: the task holds a lease in Redis
  (`corral:orchestrator:<run id>`), renewed while it runs. A second delivery of the run (a redelivery
  while the first is alive, e.g. after the visibility timeout) waits one lease period and, finding the
  lease still renewed, ends without running; a delivery after its holder died takes over once the
  lease lapses.
- late acks and redelivery on a lost worker (workers.celery_app) mean a crashed orchestrator's run is
  picked up again, never dropped.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import redis
from celery import Task, shared_task

from app.settings import load_settings
from workers.celery_app import ORCHESTRATOR_TASK

log = logging.getLogger(__name__)

LEASE_S = 30.0
DEFAULT_ENTRY = "app.service.runner:run_orchestrator"

_entry = DEFAULT_ENTRY


def configure(entry: str) -> None:
    """Set the run manager's entry point, `module:function`, before the worker starts."""
    global _entry
    module, sep, function = entry.partition(":")
    if not sep or not module or not function.isidentifier():
        raise ValueError(f"entry point {entry!r}: expected module:function")
    try:  # found now, not when the first run arrives and fails on the worker
        found = getattr(importlib.import_module(module), function)
    except ImportError as exc:
        raise ValueError(f"entry point {entry!r}: cannot import {module}: {exc}") from None
    except AttributeError:
        raise ValueError(f"entry point {entry!r}: {module} has no {function}") from None
    if not callable(found):
        raise ValueError(f"entry point {entry!r}: {function} is not callable")
    _entry = entry


def _entry_point() -> Callable[[str, Any], Any]:
    module, _, function = _entry.partition(":")
    found: Callable[[str, Any], Any] = getattr(importlib.import_module(module), function)
    return found


class LeaseHeld(RuntimeError):
    """Another live orchestrator holds the run."""


@contextlib.contextmanager
def run_lease(client: redis.Redis, run_id: str, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold `corral:orchestrator:<run_id>` while the block runs, renewing it every third of `lease_s`;
    raise `LeaseHeld` if another holder keeps it renewed for a whole lease period."""
    lock = client.lock(f"corral:orchestrator:{run_id}", timeout=lease_s, thread_local=False)
    if not lock.acquire(blocking=True, blocking_timeout=lease_s + 1.0):
        raise LeaseHeld(f"run {run_id}: another orchestrator holds it")
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            try:
                lock.reacquire()
            except redis.exceptions.LockNotOwnedError:
                # The key is gone (Redis restarted empty, or it expired while Redis was away) or another
                # holder has it: a key nobody holds is taken back, so the run keeps its one orchestrator.
                try:
                    retaken = lock.acquire(blocking=False)
                except redis.exceptions.RedisError:
                    retaken = False
                if retaken:
                    log.warning("run %s: lease had lapsed (Redis restarted?); taken again", run_id)
                    continue
                log.error("run %s: lease lost (renewed too late); another orchestrator may take it", run_id)
                return
            except redis.exceptions.RedisError as exc:  # fault tolerance: try again next period
                log.warning("run %s: lease renewal failed, retrying: %r", run_id, exc)

    renewer = threading.Thread(target=renew, name=f"lease-{run_id}", daemon=True)
    renewer.start()
    try:
        yield
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(redis.exceptions.LockError):
            lock.release()


@shared_task(name=ORCHESTRATOR_TASK, bind=True)  # type: ignore[untyped-decorator]
def run_orchestrator(self: Task, run_id: str) -> Any:
    drive_run = _entry_point()
    client = redis.Redis.from_url(self.app.conf.result_backend)
    try:
        with run_lease(client, run_id):
            return drive_run(run_id, load_settings())
    except LeaseHeld as exc:
        log.info("%s; this delivery ends without running it", exc)
        return {"run_id": run_id, "skipped": str(exc)}
    finally:
        client.close()
