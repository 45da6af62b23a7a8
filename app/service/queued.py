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

Runs whose message a Redis restart took (`LostRuns`, in the same thread): a Redis that keeps nothing on
disk comes back empty, without the orchestrator tasks still queued (a run waiting while the workers are
busy, or none is up) or taken and not acked (a run being driven): a queued run stayed `created` for
ever, and a driven run whose worker then died was never reclaimed (its message, which the reclaim looks
for, was gone). At the watch's start, and whenever the broker's `run_id` changes (a restart), each celery
run not ended is a suspect; a suspect found neither in the broker (queued or unacked) nor leased by an
orchestrator `LOST_CHECKS` checks in a row is sent to the `orchestrator` queue again, once. A second
delivery of a run that is in fact driven (a message in flight between the queue and a worker, a lease
not yet taken again after the restart) is harmless: it finds the lease renewed and ends without running.
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
from app.service.manager import DispatchError
from app.service.store import ServiceStore
from app.store.models import RunState
from app.store.repos import IllegalTransitionError

log = logging.getLogger(__name__)

CHECK_S = 5.0  # how often the queued runs are looked at (twice a timeout, for a shorter one)
# Checks in a row a suspect must be missing for (10-15 s): longer than a message takes from its queue to
# a worker's unacked ones, and a lease renewal period (an orchestrator retakes its lease after a restart)
LOST_CHECKS = 3


def start_timeout_reason(timeout_s: float) -> str:
    return (
        f"no orchestrator worker took it within {timeout_s:g} s of its creation, and none is live: start "
        "`corral worker --orchestrator` on its database (GET /healthz shows `orchestrator.workers`), then "
        "create the run again"
    )


class LostRuns:
    """Celery runs whose orchestrator task a Redis restart took, sent again (the module's docstring).
    `epoch`: the broker's run_id now (None: it cannot be reached); `held`: the runs whose task the broker
    holds; `leased`: whether an orchestrator holds a run's lease; `resend`: send a run's task again."""

    def __init__(
        self,
        epoch: Callable[[], str | None],
        held: Callable[[], set[str]],
        leased: Callable[[str], bool],
        resend: Callable[[str], None],
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.epoch, self.held, self.leased, self.resend, self.close = epoch, held, leased, resend, close
        self._epoch: str | None = None
        self._suspects: dict[str, int] = {}  # run id -> checks in a row it was missing

    def check(self, runs: list[str]) -> list[str]:
        """Given the celery runs not ended now (read before the broker), the runs sent again."""
        epoch = self.epoch()
        if epoch is None:
            return []  # the broker is away: nothing is decided
        if epoch != self._epoch:  # the first check, or the broker restarted since the last one
            self._suspects = dict.fromkeys(runs, 0) | self._suspects
            self._epoch = epoch
        if not self._suspects:
            return []
        held = self.held()
        sent = []
        for run_id in list(self._suspects):
            if run_id not in runs or run_id in held or self.leased(run_id):
                del self._suspects[run_id]  # ended, or where it should be
                continue
            self._suspects[run_id] += 1
            if self._suspects[run_id] >= LOST_CHECKS:
                self.resend(run_id)
                del self._suspects[run_id]
                log.warning("run %s: its orchestrator task is gone from the broker (Redis restarted without "
                            "its data?) and no orchestrator drives it; sent to the orchestrator queue again",
                            run_id)  # fmt: skip
                sent.append(run_id)
        return sent


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
        lost: LostRuns | None = None,
    ) -> None:
        self.store = store
        self.lost = lost
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
            if self.lost is None:
                continue
            try:
                runs = [*self.store.created_runs(), *self.store.unfinished_runs()]
                self.lost.check([r.id for r in runs if driven_elsewhere(r)])
            except (DBAPIError, DispatchError, *BROKER_ERRORS) as exc:  # fault tolerance: asked again next
                log.warning("celery runs not looked for in the broker: %r", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        self.leases.close()
        if self.lost is not None:
            self.lost.close()
