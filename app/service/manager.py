"""The run manager: creates runs from a config, starts them in-process, and resumes after a restart.

Each run executes in its own thread and loop (`RunHandle`); its events go through an event bus to the
store's `SqlEventSink` and to the metrics sink. State changes of a run (running, paused, stopping,
ended) are written to its row as they happen.

Snapshot and restore: at start-up `resume_unfinished` finds the runs the previous server was driving
(not created, not ended). Each resumes as a new incarnation: the groups its predecessor left open are
discarded with the reason `orphaned` (events, so the stored stream stays the account), and it goes on
from the stored sequence number, group and batch numbers and policy version, its live counts and
rollouts from the stored stream's. Batches handed out and not acked are kept as files under the run's
data directory until acked, so a resumed run offers them again (at least once, across restarts too);
a batch its gateway does not hold (acked before the restart) is acked in the store (`ack_stored`). A
run that was stopping is ended instead of resumed. A run that had ended before the restart still hands
out the batches it kept (`ended_gateway`), then answers that it has ended.

Invariants:
- every run this manager starts is stopped (and its sinks flushed) by `shutdown`;
- every group admitted before a crash ends in the stored stream: delivered, or discarded with a reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from app.core.events import BatchDelivered, GroupDelivered, RunEnded
from app.cpulist import format_cpu_list
from app.metrics import CorralMetrics
from app.service.gateway import Offer, OfferFiles, TrainerGateway
from app.service.handle import IllegalRunStateError, RunHandle, RunNotLiveError
from app.service.ports import LanesFactory, run_policy
from app.service.recorder import CLOSE_WAIT_S, RunRecorder, StoredMark
from app.service.schemas import OrchestratorKind, RunCreate
from app.service.store import IllegalTransitionError, ResumePoint, RunRecord, ServiceStore
from app.store.db import through_outage
from app.store.models import TERMINAL_RUN_STATES, RunState, utcnow
from app.store.repos import stamped

log = logging.getLogger(__name__)

ENDED_STATES = frozenset(s.value for s in TERMINAL_RUN_STATES)
# How long a stopping control plane waits for each run to end: longer than a cancelled lane op is waited
# for on a worker that answers (CeleryLanes' cancel_grace_s, 60 s). At 30 s, a run whose op outlived it
# was left `stopping` in the store.
RUN_STOP_WAIT_S = 75.0
# How long an ack waits for the store to have it before it answers
WRITTEN_WAIT_S = 5.0

__all__ = ["IllegalRunStateError", "RunManager", "RunNotLiveError"]


class RunManager:
    def __init__(
        self,
        store: ServiceStore,
        data_dir: Path,
        ack_timeout_s: float,
        metrics: CorralMetrics | None = None,
        lanes: LanesFactory | None = None,
    ) -> None:
        self.store = store
        self.lanes = lanes  # local runs' lanes (app.service.ports.lanes_for); None: in-process
        self.data_dir = data_dir
        self.ack_timeout_s = ack_timeout_s
        self.metrics = metrics
        self.handles: dict[str, RunHandle] = {}
        self._records: dict[str, RunRecord] = {}  # rows of executing runs, so a GET needs no query
        self._lanes_stored: set[str] = set()  # runs whose lanes' CPU sets this server stored
        # Runs that ended before this server started, with batches never acked: see `ended_gateway`.
        self._ended: dict[str, TrainerGateway] = {}
        self._ended_lock = threading.Lock()
        # Mirrors of offers and acks go to the store off the run's loop and off the request.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-store")

    # -- creating and resuming ----------------------------------------------------------------------

    def create(self, spec: RunCreate, dispatch: Callable[[str], None] | None = None) -> str:
        """Store the run and start it here, or hand it to `dispatch` (a Celery orchestrator task) when
        its orchestrator is celery. Returns its id."""
        if spec.orchestrator is OrchestratorKind.CELERY and dispatch is None:
            raise ValueError("celery needs CORRAL_BROKER_URL (a broker for the orchestrator queue)")
        run_id = uuid.uuid4().hex[:12]
        policy = run_policy(spec)
        self.store.create_run(run_id, spec.name, spec.stored(), policy.model_dump(mode="json"))
        if dispatch is not None and spec.orchestrator is OrchestratorKind.CELERY:
            dispatch(run_id)
        else:
            self._start(run_id, spec, None)
        return run_id

    def adopt(self, run_id: str) -> RunHandle:
        """Drive a stored run in this process (an orchestrator worker): from its start, or resumed."""
        record = self.store.get_run(run_id)
        if record is None:
            raise LookupError(f"no run {run_id!r}")
        spec = RunCreate.model_validate(record.config)
        point = None if record.state == RunState.CREATED.value else self.store.resume_point(run_id)
        return self._start(run_id, spec, point)

    def resume_unfinished(self) -> list[str]:
        resumed = []
        for record in self.store.unfinished_runs():
            try:
                spec = RunCreate.model_validate(record.config)
            except ValidationError as exc:
                self._end_unresumable(record, f"stored config no longer valid: {exc.errors()[0]['msg']}")
                continue
            if spec.orchestrator is OrchestratorKind.CELERY:
                continue  # its orchestrator task is redelivered to a worker, which resumes it
            point = self.store.resume_point(record.id)
            if record.state == RunState.STOPPING.value:
                self._end_unresumable(record, "was stopping when the control plane stopped", point)
                continue
            self._start(record.id, spec, point)
            resumed.append(record.id)
        return resumed

    def _attach_sinks(self, recorder: RunRecorder) -> None:
        recorder.stored = StoredMark(self.store.event_sink())
        recorder.bus.add_sink(recorder.stored, name="store")
        if self.metrics is not None:
            recorder.bus.add_sink(self.metrics.sink(recorder.run_id), name="metrics", flush_interval_s=0.1)

    def _start(self, run_id: str, spec: RunCreate, point: ResumePoint | None) -> RunHandle:
        offers = OfferFiles(self.data_dir / run_id / "offers")
        kept = offers.load() if point is not None else []
        if point is not None and kept:
            # A kept batch the store never got: the resumed run numbers its groups and batches after
            # it, or its next batch would take the kept one's id (and the trainer's ack of it).
            point = dataclasses.replace(
                point,
                group_offset=max(
                    [point.group_offset]
                    + [
                        int(g["group_id"]) + 1
                        for o in kept
                        for g in o.payload.get("groups", [])
                        if "group_id" in g
                    ]
                ),
                batch_offset=max([point.batch_offset] + [o.index + 1 for o in kept]),
            )
        handle = RunHandle(
            run_id, spec, self.data_dir / run_id, self.ack_timeout_s, self._on_state, point, self.lanes
        )
        self._attach_sinks(handle.recorder)
        if point is not None:
            open_groups = set(point.open_groups)
            for offer in kept:
                if offer.index not in point.delivered_batches:
                    open_groups -= _record_kept_delivery(handle.recorder, offer, open_groups, point.last_t)
            if open_groups:
                handle.recorder.orphan_open_groups(open_groups, "in flight when the control plane stopped")
            for offer in kept:  # handed out before the restart and never acked: again
                handle.gateway.restore(offer)
            # the trainer's counters go on from the store's, as the run's own counters do
            stored = self.store.figures(run_id)
            stats = handle.gateway.stats
            stats.offered, stats.redelivered, stats.acked = (
                stored["offered"],
                stored["redelivered"],
                stored["acked"],
            )
        handle.gateway.on_offer = lambda offer: self._mirror(self._offered, run_id, offer, offers)
        handle.gateway.on_take = lambda offer: self._mirror(offers.save, offer)
        handle.gateway.on_ack = lambda offer: self._mirror(self._acked, run_id, offer, offers)
        # a batch handed out again counts in the store's offer_count, as the answer's `delivery` does
        handle.gateway.on_redeliver = lambda offer: self._mirror(self._redelivered, run_id, offer)
        record = self.store.get_run(run_id)
        assert record is not None
        self._records[run_id] = record
        self.handles[run_id] = handle
        handle.start()
        return handle

    def _offered(self, run_id: str, offer: Offer, offers: OfferFiles) -> None:
        offers.save(offer)
        self.store.mark_offered(run_id, offer.index)

    def _redelivered(self, run_id: str, offer: Offer) -> None:
        self.store.mark_offered(run_id, offer.index)

    def _acked(self, run_id: str, offer: Offer, offers: OfferFiles) -> None:
        self.store.mark_acked(run_id, offer.index)
        offers.remove(offer)  # after the store knows: a failed write leaves the batch to offer again

    def ack_stored(self, run_id: str, batch_id: str) -> bool | None:
        """Ack a batch the run's gateway does not hold (handed out before a restart, or the run ended
        before one) in the store: whether it was acked already; None for no such delivered batch."""
        already = self.store.ack_batch(run_id, batch_id)
        if already is False:  # a valid batch id: its kept offer, if any, is done with
            (self.data_dir / run_id / "offers" / f"{batch_id}.json").unlink(missing_ok=True)
        return already

    def ended_gateway(self, record: RunRecord) -> TrainerGateway | None:
        """For a stored run that ended before this server started (it is not executing here), a closed
        gateway holding the batches it offered and never saw acked, from its offer files: a trainer takes
        and acks them as it would have before the restart, then hears that the run has ended. None for a
        run that has not ended or kept no such batch. Called off the event loop (it may read files)."""
        if record.state not in ENDED_STATES:
            return None
        run_id = record.id
        with self._ended_lock:
            gateway = self._ended.get(run_id)
            if gateway is not None:
                return gateway
            offers = OfferFiles(self.data_dir / run_id / "offers")
            kept = offers.load()
            if not kept:
                return None
            gateway = TrainerGateway(run_id, self.ack_timeout_s, lambda: 0)
            for offer in kept:
                gateway.restore(offer)
            gateway.on_take = lambda offer: self._mirror(offers.save, offer)
            gateway.on_ack = lambda offer: self._mirror(self._acked, run_id, offer, offers)
            gateway.on_redeliver = lambda offer: self._mirror(self._redelivered, run_id, offer)
            gateway.close(record.state)
            self._ended[run_id] = gateway
            return gateway

    def _end_unresumable(self, record: RunRecord, detail: str, point: ResumePoint | None = None) -> None:
        point = point or self.store.resume_point(record.id)
        recorder = RunRecorder(record.id, lambda: point.last_t, point.next_seq)
        self._attach_sinks(recorder)
        recorder.orphan_open_groups(set(point.open_groups), detail)
        recorder.publish(RunEnded("stopped", detail))
        recorder.close()
        log.warning("run %s not resumed: %s", record.id, detail)

    def wait_written(self, timeout_s: float = WRITTEN_WAIT_S) -> bool:
        """Wait until what was handed to the store writer so far is written (its writes run one at a
        time, in order): whether it was, within `timeout_s` (a database that is away is waited out)."""
        try:
            done = self._writer.submit(lambda: None)
        except RuntimeError:  # shut down: every write was done before
            return True
        try:
            done.result(timeout_s)
        except TimeoutError:
            log.warning("store writes not done after %.0f s", timeout_s)
            return False
        return True

    def _mirror(self, fn: Any, *args: Any) -> None:
        # A database that is away (Postgres restarting) is waited out: each write is its own transaction,
        # so one tried again stores nothing twice, and the writes after it wait their turn.
        write = functools.partial(through_outage, functools.partial(fn, *args), "store writer")
        try:
            future = self._writer.submit(write)
        except RuntimeError:  # the writer has shut down (a run outlived `shutdown`): write here
            write()
            return
        future.add_done_callback(_log_failure)

    def _on_state(self, handle: RunHandle, state: RunState, error: str | None) -> None:
        # Called on the run's loop: the row is written by the store writer, in order, off the loop. The
        # cached row a GET reads takes the same times now, so a run shown ended shows when it ended.
        at = utcnow().timestamp()  # microseconds, as the database keeps it
        record = self._records.get(handle.run_id)
        if record is not None:
            started, ended = stamped(state, record.started_at, record.ended_at, at)
            self._records[handle.run_id] = dataclasses.replace(record, started_at=started, ended_at=ended)
        self._mirror(self._write_state, handle.run_id, state, error, at)
        if (
            state is RunState.RUNNING
            and handle.run_id not in self._lanes_stored
            and handle.runtime is not None
        ):
            # A lane's CPU set is worked out as the run starts and is in no event: stored now, so a
            # run nobody watched still shows it after a restart.
            lanes = described_lanes(handle.runtime.lanes)
            if lanes:
                self._lanes_stored.add(handle.run_id)
                self._mirror(self.store.set_lanes, handle.run_id, lanes)
        if state in TERMINAL_RUN_STATES and self.metrics is not None:
            self.metrics.forget_run(handle.run_id, handle.live())

    def _write_state(self, run_id: str, state: RunState, error: str | None, at: float) -> None:
        try:
            stored = self.store.set_state(run_id, state, error, at)
        except IllegalTransitionError as exc:
            log.info("run %s: state %s not written: %s", run_id, state.value, exc)
            return
        record = self._records.get(run_id)
        if record is not None:  # the stored times win (the sink may have written the end first)
            self._records[run_id] = dataclasses.replace(
                record, started_at=stored.started_at, ended_at=stored.ended_at
            )

    # -- reading -------------------------------------------------------------------------------------

    def get(self, run_id: str) -> RunHandle | None:
        return self.handles.get(run_id)

    def live_view(self, run_id: str) -> dict[str, Any] | None:
        """The view of a run executing here, from memory alone; None for any other run."""
        handle = self.handles.get(run_id)
        record = self._records.get(run_id)
        return None if handle is None or record is None else self._with_live(_record_dict(record), handle)

    @staticmethod
    def _with_live(out: dict[str, Any], handle: RunHandle) -> dict[str, Any]:
        out["state"] = handle.state.value
        out["live"] = handle.live()
        out["policy"] = {**out["policy"], **handle.knobs}  # the shape stored, the knobs as they are now
        if handle.error:
            out["error"] = handle.error
        return out

    def view(self, run_id: str) -> dict[str, Any] | None:
        """A run as GET /api/runs/{id} shows it: its stored row, and its live state when it runs here."""
        handle = self.handles.get(run_id)
        record = self._records.get(run_id) or self.store.get_run(run_id)
        if record is None:
            return None
        out = _record_dict(record)
        if handle is not None:
            self._with_live(out, handle)
        else:
            out["live"] = None
            out["groups"] = self.store.group_account(run_id)
        return out

    def list(self) -> list[dict[str, Any]]:
        out = []
        for record in self.store.list_runs():
            row = _record_dict(record)
            handle = self.handles.get(record.id)
            if handle is not None:
                row["state"] = handle.state.value
                live = handle.recorder.view
                row["batches"] = live.batches
            out.append(row)
        return out

    def sample_metrics(self) -> None:
        if self.metrics is None:
            return
        for run_id, handle in list(self.handles.items()):
            if handle.state not in TERMINAL_RUN_STATES:
                self.metrics.sample_run(run_id, handle.live())

    # -- shutting down -------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = RUN_STOP_WAIT_S) -> None:
        """Stop every run still executing and wait up to `timeout_s` for each to end; a run that has
        ended and is storing its last events (the database away) is waited for up to `CLOSE_WAIT_S`
        more, so no event and no end state is lost with the process."""
        for handle in list(self.handles.values()):
            with contextlib.suppress(RunNotLiveError, IllegalRunStateError, TimeoutError):
                handle.submit(handle.stop).result(timeout=5)  # refused: already ending, or not started
        deadline = time.monotonic() + timeout_s
        for handle in list(self.handles.values()):
            if handle.join(max(0.1, deadline - time.monotonic())):
                continue
            if not handle.flushing.is_set():
                log.warning("run %s did not end within %.0f s of shutdown", handle.run_id, timeout_s)
                continue
            # Its thread is a daemon: returning now would lose the events it still holds, and its end.
            log.warning(
                "run %s has ended; waiting up to %.0f s more for its last events to be stored",
                handle.run_id,
                CLOSE_WAIT_S,
            )
            if not handle.join(CLOSE_WAIT_S + 5.0):
                log.warning("run %s: its last events and end state may be lost, unstored", handle.run_id)
        self._writer.shutdown(wait=True)


def _record_dict(record: RunRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "name": record.name,
        "state": record.state,
        "config": record.config,
        "policy": record.policy,
        "created_at": record.created_at,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "error": record.error,
    }


def _log_failure(future: Any) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("store mirror write failed: %r", exc)


def _record_kept_delivery(recorder: RunRecorder, offer: Offer, open_groups: set[int], t: float) -> set[int]:
    """A batch handed out and kept (its offer file) whose delivery never reached the store: the
    process died with the events buffered. The kept offer proves the delivery, and it is offered
    again, so its groups still open in the stored stream are recorded delivered in it (not orphaned),
    and the batch delivered, at the run's last stored time `t`. The groups it covers."""
    payload = offer.payload
    groups = [g for g in payload.get("groups", []) if isinstance(g, dict) and "group_id" in g]
    ids = [int(g["group_id"]) for g in groups]
    for group in groups:
        if int(group["group_id"]) in open_groups:
            rewards = tuple(float(r) for r in group.get("rewards", ()))
            behind = int(group.get("staleness", 0))
            recorder.publish(GroupDelivered(int(group["group_id"]), offer.index, behind, rewards))
    staleness = tuple(int(g.get("staleness", 0)) for g in groups)
    version = int(payload.get("trainer_version", 0))
    recorder.publish(BatchDelivered(offer.index, tuple(ids), version, t, t, staleness))
    log.warning(
        "run %s: batch %s was handed out before the restart but its delivery never reached the store; "
        "recorded delivered from its kept offer (groups %s)",
        recorder.run_id,
        offer.batch_id,
        ids,
    )
    return set(ids)


def described_lanes(lanes: Any) -> dict[str, tuple[str, int]]:
    """Each lane's CPU set ("unpinned" for none) and configured slots, when the run's lanes describe
    themselves (in-process lanes do; others: nothing), as the store's `lanes` table keeps them."""
    describe = getattr(lanes, "describe", None)
    if describe is None:
        return {}
    out = {}
    for name, lane in describe().items():
        configured = lane.get("configured")
        slots = int(configured if configured is not None else lane["slots"])
        out[name] = (format_cpu_list(lane["cpus"]) if lane["cpus"] else "unpinned", slots)
    return out
