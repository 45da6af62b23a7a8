"""The run manager's entry point for a Celery orchestrator worker (`workers.orchestrator` calls it).

`run_orchestrator(run_id, settings)` drives one stored run in this process until it ends: from its
start, or resumed (a redelivered task after a worker died: the groups its predecessor left open are
discarded as `orphaned`, see app.service.manager). The worker's task holds the run's lease meanwhile,
so no two processes drive one run. An operator's stop (`POST /api/runs/{id}/stop` to any `corral serve`)
reaches it as a key in the result backend's Redis (`app.lanes.celery.run_stop_key`), looked for every
`STOP_CHECK_S`: the run is stopped as one executing in the API server would be. The operator's other
commands (pause, resume, weights, policy, engines, metrics) come through the run's command channel
(app.service.channel), taken as they come and answered as the API server answers for a run of its own.

Invariants:
- a stop is honoured whatever a command does. The commands are taken and carried out one at a time on
  a thread of their own (`CommandLine`), never on the watcher that looks for the stop: a command whose
  handler hangs holds up the commands after it (they stay on the run's list, and their senders get a
  504 saying no worker took them), never the run's stop or its end, nor its reads (metrics), which have
  a list and a line of their own;
- a run's command lines end with it: one still carrying out a command `LINE_DRAIN_S` after the run's
  end has that command cancelled (answered as an ended run's, 409), so a pool process that drives run
  after run keeps the same threads. Before, each such line was left running forever, holding the run's
  handle, its loop and a Redis connection: a thread more for every run that ended with a command hung.
  Only a handler stuck in a blocking call, which no cancellation reaches, is left behind (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from app.lanes.celery import broker_urls, run_handoff_key, run_stop_key
from app.lanes.redis_client import COMMAND_TIMEOUT_S, redis_client
from app.metrics import CorralMetrics
from app.service.channel import RunInbox, commands_key, expired, reads_key
from app.service.commands import apply
from app.service.compose import manager_for, store_for
from app.service.handle import RunHandle, RunNotLiveError
from app.settings import Settings
from app.store.models import TERMINAL_RUN_STATES, RunState

log = logging.getLogger(__name__)

STOP_CHECK_S = 1.0
# After the run's end, how long the watcher waits for its command line to answer the commands left;
# then the command it still carries out is cancelled, and the line given LINE_CANCEL_S more to end
LINE_DRAIN_S = 5.0
LINE_CANCEL_S = 5.0
NOT_CARRIED_OUT = "past its deadline when the worker took it: its sender had stopped waiting (a 504)"


def run_orchestrator(run_id: str, settings: Settings) -> dict[str, Any]:
    store = store_for(settings)
    try:
        record = store.get_run(run_id)
        if record is None:
            raise LookupError(f"no run {run_id!r} in {settings.database_url}")
        if RunState(record.state) in TERMINAL_RUN_STATES:
            return {"run_id": run_id, "state": record.state, "batches": None}  # a redelivery after its end
        manager = manager_for(settings, store, CorralMetrics())
        handle = manager.adopt(run_id)
        handed_off = _join_serving_commands(handle, settings)
        if handed_off:  # the worker shuts down: another one resumes the run from what is stored
            manager.leave_for_next_start()
        else:
            manager.shutdown()
        return {"run_id": run_id, "state": handle.state.value, "batches": handle.recorder.view.batches,
                "handed_off": handed_off}  # fmt: skip
    finally:
        store.close()


def _join_serving_commands(handle: RunHandle, settings: Settings) -> bool:
    """Wait for the run's end, stopping it once an operator asks (`run_stop_key`), while its command line
    (`CommandLine`) carries out the commands of its channel; or until this worker shuts down and asks
    for the run to be handed off (`run_handoff_key`): whether it did. With no broker, as when this is
    called outside a worker, nobody can ask."""
    if settings.broker_url is None:
        handle.join()
        return False
    _, backend = broker_urls(settings.broker_url, settings.result_backend)
    lines = [CommandLine(handle, backend, key) for key in (commands_key, reads_key)]
    for line in lines:
        line.start()
    client = redis_client(backend, COMMAND_TIMEOUT_S)
    asked = handed_off = False
    try:
        while not handle.join(STOP_CHECK_S):
            if asked:
                continue  # stopping: it ends, and is handed off no more
            try:
                asked, handed_off = _stop_or_hand_off(client, handle)
            except redis.RedisError as exc:  # fault tolerance: the run goes on; asked again next check
                log.warning("run %s: could not look for an operator's stop: %r", handle.run_id, exc)
                continue
            if handed_off:
                log.warning("run %s: this worker shuts down; the run is left to another orchestrator "
                            "worker, which resumes it", handle.run_id)  # fmt: skip
                break
    finally:
        client.close()
        for line in lines:
            line.stop()  # the run ended, or this worker hands it off (a second Ctrl-C): take no more
        for line in lines:
            line.join(LINE_DRAIN_S)
            if line.is_alive() and line.cancel():
                line.join(LINE_CANCEL_S)
            if line.is_alive():  # a handler in a blocking call: no cancellation reaches it
                log.warning("run %s: its command line is still carrying out %s after it was cancelled; left "
                            "behind, as this worker is done with it", handle.run_id, line.busy)  # fmt: skip
    return handed_off


class CommandLine(threading.Thread):
    """The commands of one of a run's lists (app.service.channel: its commands', `key(run_id)`, or its
    reads'), taken and carried out one at a time until the run ends, each as `corral serve` would carry
    it out on a run of its own (`app.service.commands.apply`); then those sent as it ended, answered as
    an ended run's. A thread of its own: the watcher that honours the run's stop never waits on one."""

    def __init__(self, handle: RunHandle, backend: str, key: Callable[[str], str]) -> None:
        super().__init__(name=f"{key.__name__.removesuffix('_key')}-{handle.run_id}", daemon=True)
        self.handle = handle
        self.backend = backend
        self.key = key(handle.run_id)
        self.busy: str | None = None  # the command being carried out, as the log names it
        # The commands' loop, one for the line's life, and the command it carries out now: `cancel`
        self._runner = asyncio.Runner()
        self._task: asyncio.Task[tuple[int, dict[str, Any]]] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def stop(self) -> None:
        """Take no more commands once the one under way (and the wait for the next, at most
        `STOP_CHECK_S`) is done. A run handed off, not ended, leaves the rest on its list for the
        worker that resumes it. Safe from any thread."""
        self._stopped.set()

    def cancel(self) -> bool:
        """Cancel the command being carried out (the run has ended: its answer is an ended run's);
        whether there was one. Safe from any thread."""
        with self._lock:
            task = self._task
            if task is None:
                return False
            log.warning("run %s: cancelling %s, still carried out at the run's end", self.handle.run_id,
                        self.busy)  # fmt: skip
            task.get_loop().call_soon_threadsafe(task.cancel)
            return True

    def run(self) -> None:
        handle = self.handle
        # its answers include the inbox's blocking pop of up to STOP_CHECK_S
        client = redis_client(self.backend, STOP_CHECK_S + COMMAND_TIMEOUT_S)
        inbox = RunInbox(client, handle.run_id, self.key)
        try:
            while not handle.join(0) and not self._stopped.is_set():
                try:
                    command = inbox.take(STOP_CHECK_S)
                    if command is not None:
                        self._carry_out(inbox, command)
                except redis.RedisError as exc:  # fault tolerance: the run goes on; taken next time
                    log.warning("run %s: could not take an operator's commands: %r", handle.run_id, exc)
                    handle.join(STOP_CHECK_S)
            if not handle.join(0):
                return  # handed off: the next worker takes what is left
            try:  # those sent as it ended are answered as an ended run's: "has ended (<state>)"
                for command in inbox.left():
                    self._carry_out(inbox, command)
            except redis.RedisError as exc:  # their senders' waits end in a 504
                log.warning("run %s: could not answer the commands left at its end: %r", handle.run_id, exc)
        finally:
            client.close()
            self._runner.close()

    def _carry_out(self, inbox: RunInbox, command: dict[str, Any]) -> None:
        handle = self.handle
        op, actor = str(command.get("op")), str(command.get("actor") or "operator")
        if expired(command, time.time()):
            log.warning(
                "run %s: %s from %s not carried out: its sender stopped waiting", handle.run_id, op, actor
            )
            inbox.not_carried_out(command, NOT_CARRIED_OUT)
            return
        given = command.get("args")
        args = given if isinstance(given, dict) else {}
        self.busy = f"{op} from {actor}"
        try:
            status, body = self._runner.run(self._apply(op, args, actor, str(command["id"])))
        except asyncio.CancelledError:  # `cancel`: the run has ended
            status, body = 409, {"detail": f"run {handle.run_id} has ended ({handle.state.value}) while its "
                                           f"{op} was carried out; cancelled"}  # fmt: skip
        except Exception as exc:  # fault tolerance: this thread takes the run's commands; it must go on
            log.exception("run %s: %s from %s failed", handle.run_id, op, actor)
            status, body = 500, {"detail": f"run {handle.run_id}'s orchestrator worker failed to carry out "
                                           f"the {op}: {type(exc).__name__}: {exc}"}  # fmt: skip
        finally:
            self.busy = None
        log.info("run %s: %s from %s answered %d", handle.run_id, op, actor, status)
        inbox.answer(command, status, body)

    async def _apply(
        self, op: str, args: dict[str, Any], actor: str, command_id: str
    ) -> tuple[int, dict[str, Any]]:
        """`apply` as a task `cancel` can reach."""
        task = asyncio.ensure_future(apply(self.handle, op, args, actor, command_id))
        with self._lock:
            self._task = task
        try:
            return await task
        finally:
            with self._lock:
                self._task = None


def _stop_or_hand_off(client: redis.Redis, handle: RunHandle) -> tuple[bool, bool]:
    """Stop the run if an operator asked (`run_stop_key`), else take this worker's ask to hand it off
    (`run_handoff_key`): whether each was asked. One round trip to Redis for both (a pipeline, not a
    transaction: each key is read on its own), every `STOP_CHECK_S` of the run's life; a stop wins over a
    hand-off asked at the same time, which it takes too (the run ends: nothing is left to hand off)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.get(run_stop_key(handle.run_id))
        pipe.delete(run_handoff_key(handle.run_id))
        actor, handoffs = pipe.execute()
    if actor is None:
        return False, bool(handoffs)
    who = actor.decode(errors="replace") if isinstance(actor, bytes) else str(actor)
    log.warning("run %s: stopped by %s", handle.run_id, who)
    with contextlib.suppress(RunNotLiveError):  # it ended meanwhile
        handle.submit(handle.stop)
    return True, False
