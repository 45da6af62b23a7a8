"""The start timeout of celery runs: a run sent to the `orchestrator` queue while no orchestrator worker
is up stayed `created` for ever, its page and `GET /api/runs/{id}` saying nothing of why.

`corral serve` (with a broker) checks every `period_s`: a celery run still `created` (no worker has taken
it) `CORRAL_START_TIMEOUT_S` after its creation, while no orchestrator worker answers the broker's ping,
is ended with a reason an operator can read: `failed`, "no orchestrator worker took it within …", or
`stopped` when an operator asked for its stop meanwhile (the stop key). A run waiting while workers are
up (each busy driving other runs) is left waiting: a worker takes it once one is free.

Invariants:
- a run a worker has taken is never ended here: the check holds the run's lease (the orchestrator
  task's own, `app.lanes.celery.lease_key`) while it reads the run's state and ends it, so a worker
  that takes the run meanwhile waits for the lease and then finds it ended (and ends without running
  it, as for a redelivery after a run's end), and one that took it first keeps the lease;
- a broker in doubt (it does not answer the ping) ends nothing: a worker may be up behind it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import redis
from sqlalchemy.exc import DBAPIError

from app.lanes.celery import ORCHESTRATOR_LEASE_S, lease_key, run_stop_key
from app.service.channel import driven_elsewhere
from app.service.store import ServiceStore
from app.store.models import RunState
from app.store.repos import IllegalTransitionError

log = logging.getLogger(__name__)

CHECK_S = 5.0  # how often the queued runs are looked at (twice a timeout, for a shorter one)


def start_timeout_reason(timeout_s: float) -> str:
    return (
        f"no orchestrator worker took it within {timeout_s:g} s of its creation, and none is live: start "
        "`corral worker --orchestrator` on its database (GET /healthz shows `orchestrator.workers`), then "
        "create the run again"
    )


class StartTimeout:
    """Ends the celery runs no orchestrator worker took in time (the module's docstring): `check` once,
    or `start` a thread that checks every `period_s` until `stop`."""

    def __init__(
        self,
        store: ServiceStore,
        leases: redis.Redis,
        orchestrators: Callable[[], int],
        timeout_s: float,
        period_s: float | None = None,
    ) -> None:
        self.store = store
        self.leases = leases
        self.orchestrators = orchestrators  # the live orchestrator workers now (raises if the broker is away)
        self.timeout_s = timeout_s
        self.period_s = min(CHECK_S, timeout_s / 2) if period_s is None else period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="start-timeout", daemon=True)

    def check(self, now: float) -> list[str]:
        """End every celery run queued since `timeout_s` before `now` (a Unix time) while no orchestrator
        worker is live; the runs ended."""
        created = self.store.created_runs()
        due = [r for r in created if driven_elsewhere(r) and now - r.created_at >= self.timeout_s]
        if not due or self.orchestrators() > 0:
            return []
        return [record.id for record in due if self._end(record.id)]

    def _end(self, run_id: str) -> bool:
        lock = self.leases.lock(lease_key(run_id), timeout=ORCHESTRATOR_LEASE_S, thread_local=False)
        if not lock.acquire(blocking=False):
            return False  # a worker has just taken it
        try:
            record = self.store.get_run(run_id)
            if record is None or record.state != RunState.CREATED.value:
                return False
            if self.leases.exists(run_stop_key(run_id)):
                state, reason = RunState.STOPPED, "stopped before an orchestrator worker took it"
            else:
                state, reason = RunState.FAILED, start_timeout_reason(self.timeout_s)
            try:
                self.store.set_state(run_id, state, reason)
            except IllegalTransitionError as exc:  # ended meanwhile
                log.info("run %s: not ended for its start timeout: %s", run_id, exc)
                return False
            log.warning("run %s: %s: %s", run_id, state.value, reason)
            return True
        finally:
            with contextlib.suppress(redis.exceptions.LockError):
                lock.release()

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        from app.lanes.lost_ops import BROKER_ERRORS

        while not self._stop.wait(self.period_s):
            try:
                self.check(time.time())
            except (DBAPIError, *BROKER_ERRORS) as exc:  # fault tolerance: the next period asks again
                log.warning("queued celery runs not checked for their start timeout: %r", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        self.leases.close()
