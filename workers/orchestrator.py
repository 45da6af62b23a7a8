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
  picked up again, never dropped: a killed pool process's run at once; a run whose whole worker died
  (`kill -9` of its process group, its host lost) by the next orchestrator worker's check
  (`Reclaimer`, every `RECLAIM_S`), once its lease has lapsed. On Redis the broker itself would hand
  that message out again only after its visibility timeout (4 h): the run sat `running`, undriven.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis
from celery import Celery, Task, shared_task

from app.lanes.celery import ORCHESTRATOR_LEASE_S, lease_key, orchestrated_run, run_handoff_key
from app.lanes.redis_client import LEASE_TIMEOUT_S, RECLAIM_TIMEOUT_S, redis_client
from app.settings import load_settings
from workers.celery_app import ORCHESTRATOR_QUEUE, ORCHESTRATOR_TASK

log = logging.getLogger(__name__)

LEASE_S = ORCHESTRATOR_LEASE_S
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
    lock = client.lock(lease_key(run_id), timeout=lease_s, thread_local=False)
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
    client = redis_client(self.app.conf.result_backend, LEASE_TIMEOUT_S)
    try:
        with run_lease(client, run_id):
            result = drive_run(run_id, load_settings())
            if isinstance(result, dict) and result.get("handed_off"):
                # Sent again while this task holds the lease: the worker that takes it waits for the
                # lease, which is released as this returns, then resumes the run from what is stored.
                self.app.send_task(ORCHESTRATOR_TASK, args=[run_id], queue=ORCHESTRATOR_QUEUE,
                                   ignore_result=True)  # fmt: skip
                log.warning("run %s: sent to the orchestrator queue again for another worker", run_id)
            return result
    except LeaseHeld as exc:
        log.info("%s; this delivery ends without running it", exc)
        return {"run_id": run_id, "skipped": str(exc)}
    finally:
        client.close()


RECLAIM_S = LEASE_S  # how often each orchestrator worker looks for runs whose worker died
# Moves one unacked message back to the front of its queue, if no one else has meanwhile (its ack, or
# another worker's reclaim): in one step, so a process that dies halfway loses no run.
_REQUEUE = """
if redis.call('hdel', KEYS[1], ARGV[1]) == 1 then
  redis.call('zrem', KEYS[2], ARGV[1])
  redis.call('rpush', KEYS[3], ARGV[2])
  return 1
end
return 0
"""


def reclaim_orphaned(
    broker: redis.Redis, leases: redis.Redis, unacked: tuple[str, str], now: float, lease_s: float = LEASE_S
) -> list[str]:
    """Put back in the orchestrator queue every run's message that a worker took and nobody drives: no
    live lease for its run, taken more than a lease period ago (time enough for its worker to take the
    lease, which lapses a lease period after its holder died). Returns those runs. A run put back while
    its holder in fact lives (its lease lapsed while Redis was away) is safe: the new delivery finds the
    lease renewed and ends without running."""
    unacked_key, index_key = unacked
    reclaimed = []
    for tag, raw in broker.hgetall(unacked_key).items():
        if ORCHESTRATOR_TASK.encode() not in raw:
            continue  # a lane op's message: its client watches it (app.lanes.lost_ops)
        message, exchange, routing_key = json.loads(raw)
        run_id = orchestrated_run(message)
        taken_at = broker.zscore(index_key, tag)
        if run_id is None or routing_key != ORCHESTRATOR_QUEUE or exchange != "" or taken_at is None:
            continue
        if now - taken_at < lease_s or leases.exists(lease_key(run_id)):
            continue
        message["headers"]["redelivered"] = True
        message["properties"].setdefault("delivery_info", {})["redelivered"] = True
        if broker.eval(_REQUEUE, 3, unacked_key, index_key, ORCHESTRATOR_QUEUE, tag, json.dumps(message)):
            log.warning(
                "run %s: the orchestrator worker that took it is gone (its lease lapsed); sent to the "
                "orchestrator queue again", run_id,
            )  # fmt: skip
            reclaimed.append(run_id)
    return reclaimed


class Reclaimer:
    """A thread of an orchestrator worker's main process: `reclaim_orphaned` at once, then every
    `RECLAIM_S`, until `stop`. Only on a Redis broker (RabbitMQ redelivers when a consumer's connection
    drops)."""

    def __init__(self, app: Celery, period_s: float = RECLAIM_S) -> None:
        from kombu.transport.redis import Channel

        # The keys from the settings, not through a kombu connection: one left in the app's pool by this
        # thread could block a pool process forked later in kombu's after-fork hook.
        options = app.conf.broker_transport_options or {}
        self._unacked = (
            str(options.get("unacked_key", Channel.unacked_key)),
            str(options.get("unacked_index_key", Channel.unacked_index_key)),
        )
        self.period_s = period_s
        self._stop = threading.Event()
        self._broker = redis_client(app.conf.broker_url, RECLAIM_TIMEOUT_S)
        self._leases = redis_client(app.conf.result_backend, RECLAIM_TIMEOUT_S)
        self._thread = threading.Thread(target=self._loop, name="orchestrator-reclaim", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                reclaim_orphaned(self._broker, self._leases, self._unacked, time.time())
            except redis.RedisError as exc:  # fault tolerance: the broker is away; try again next period
                log.warning("looking for runs whose orchestrator worker died failed, retrying: %r", exc)
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (the worker got ready)
            self._thread.join()
        self._broker.close()
        self._leases.close()


def runs_in_progress() -> list[str]:
    """The runs this worker's pool drives now (in the worker's main process: its accepted requests)."""
    from celery.worker import state

    return sorted(
        str(request.args[0])
        for request in list(state.active_requests)
        if request.task_name == ORCHESTRATOR_TASK and request.args
    )


def hand_off_runs(backend: str, how: str) -> None:
    """A Ctrl-C, SIGTERM or SIGHUP (warm shutdown) asks every run in progress to leave itself to another
    orchestrator worker (`run_handoff_key`: app.service.runner stores its events, leaves it running and
    sends it to the queue again), so the worker exits within seconds, not when an unbounded run ends;
    then says what the shutdown still waits for. An entry point of its own (`--entry`) may not hand off:
    its runs are waited for."""
    runs = runs_in_progress() if how == "Warm" else []
    if not runs:
        return
    client = redis_client(backend, LEASE_TIMEOUT_S)
    try:
        for run_id in runs:
            client.set(run_handoff_key(run_id), "1", ex=HANDOFF_KEY_S)
        log.warning("handing the runs this worker drives to another orchestrator worker: %s (their events "
                    "stored, each resumed where it stands)", ", ".join(runs))  # fmt: skip
    except redis.RedisError as exc:  # they are waited for, as before
        log.warning("could not ask the runs this worker drives to hand off (%r): waiting for them", exc)
    finally:
        client.close()
    say_what_a_warm_shutdown_waits_for(runs)


HANDOFF_KEY_S = 3600  # a hand-off nobody took (the run ended meanwhile) lapses


def say_what_a_warm_shutdown_waits_for(runs: list[str]) -> None:
    """The warm shutdown waits for the runs in progress to hand off or end, which a run without `batches`
    of an entry point that does not hand off never does by itself: say which, and the ways out, instead
    of Celery's bare "Warm shutdown". A second SIGTERM is another warm shutdown: SIGQUIT is the way out
    whatever stop came first."""
    if runs:
        log.warning(
            "waiting for the runs this worker drives to end: %s (runs of the default entry point hand off "
            "within seconds). Stop them (POST /api/runs/<id>/stop), or press Ctrl-C again (or send SIGQUIT) "
            "to leave them to another orchestrator worker, which resumes them once their lease lapses "
            "(about 30 s; the events they have not stored yet are lost)",
            ", ".join(runs),
        )
