"""The run manager: creates runs from a config, starts them in-process, and resumes after a restart.

Each run executes in its own thread and loop (`RunHandle`); its events go through an event bus to the
store's `SqlEventSink` and to the metrics sink. State changes of a run (running, paused, stopping,
ended) are written to its row as they happen.

Snapshot and restore: at start-up `resume_unfinished` finds the runs the previous server was driving
(not created, not ended). Each resumes as a new incarnation: the groups its predecessor left open are
discarded with the reason `orphaned` (events, so the stored stream stays the account), and it goes on
from the stored sequence number, group and batch numbers and policy version, its live counts and
rollouts from the stored stream's. A run that was paused comes back paused: no turn starts until an
operator resumes it. Batches handed out and not acked are kept as files under the run's
data directory until acked, so a resumed run offers them again (at least once, across restarts too);
a batch its gateway does not hold (acked before the restart) is acked in the store (`ack_stored`). A
run that was stopping is ended instead of resumed. A run that had ended before the restart still hands
out the batches it kept (`ended_gateway`), then answers that it has ended. So does, in a server that
runs on, a run that ended here before the latest `KEEP_ENDED_HANDLES`: its handle is let go.

Shutting down (`shutdown`, a Ctrl-C of `corral serve`) is bounded: each run gets `RUN_STOP_WAIT_S` to
stop and `close_wait_s` more to store its last events (`CORRAL_STORE_OUTAGE_S` + 10 s), and the store
writer `WRITER_WAIT_S` for what it still holds (`SHUTDOWN_BOUND_S` in all); `abandon` (a second Ctrl-C)
ends every wait at once. A stop made by the shutdown is not written to the store as `stopping`: a run the
shutdown did not finish stopping is left `running` there, and the next start resumes it from what was
stored, as after a kill -9.

Invariants:
- every run this manager starts is stopped (and its sinks flushed) by `shutdown`, within its bound;
- every group admitted before a crash ends in the stored stream: delivered, or discarded with a reason.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from app.core.events import BatchDelivered, Envelope, GroupDelivered, RunEnded
from app.cpulist import format_cpu_list
from app.metrics import CorralMetrics
from app.runtime import spill
from app.runtime.events import RETRY_FIRST_S, RETRY_MAX_S
from app.runtime.spill import SpillFile
from app.sandboxes import leftovers
from app.service import retention
from app.service.gateway import Offer, OfferFiles, TrainerGateway
from app.service.handle import IllegalRunStateError, RunHandle, RunNotLiveError
from app.service.ports import LanesFactory, run_policy
from app.service.recorder import CLOSE_WAIT_S, RunRecorder, StoredMark, close_wait_s
from app.service.schemas import OrchestratorKind, RunCreate
from app.service.store import IllegalTransitionError, ResumePoint, RunLiveError, RunRecord, ServiceStore
from app.settings import MAX_RUNS, SPILL_MAX_BYTES, STORE_BUFFER
from app.store.db import is_outage, through_outage
from app.store.models import TERMINAL_RUN_STATES, RunState, utcnow
from app.store.repos import stamped
from app.validation import hide_password


class DispatchError(RuntimeError):
    """A run could not be sent to the `orchestrator` queue (the broker did not answer)."""


class ServerStoppingError(RuntimeError):
    """A run not started: this server has begun to stop (Ctrl-C, SIGTERM)."""


NOT_STARTED = "not started: corral serve was stopping when its create was carried out"


class RunLimitError(RuntimeError):
    """A run not created: this server executes `limit` runs already (`CORRAL_MAX_RUNS`)."""

    def __init__(self, limit: int, executing: int) -> None:
        super().__init__(
            f"this server executes {executing} runs, its limit (CORRAL_MAX_RUNS={limit}): a run counts "
            "until it has ended (created, running, paused or stopping). Stop one (POST "
            "/api/runs/{id}/stop) and wait for its end, restart corral serve with a higher "
            'CORRAL_MAX_RUNS, or create it with "orchestrator": "celery" to run it in an orchestrator '
            "worker"
        )
        self.limit = limit
        self.executing = executing


log = logging.getLogger(__name__)
T = TypeVar("T")

ENDED_STATES = frozenset(s.value for s in TERMINAL_RUN_STATES)
# How long a stopping control plane waits for each run to end: longer than a cancelled lane op is waited
# for on a worker that answers (CeleryLanes' cancel_grace_s, 60 s). At 30 s, a run whose op outlived it
# was left `stopping` in the store.
RUN_STOP_WAIT_S = 75.0
# How long a stopping control plane lets the store writer finish what it holds once the runs have
# stopped. Each write is then one look (a batch row the event sink never stored is not waited for): a
# writer that waited 10 s for each such row, thousands of them behind a slow sink, held a Ctrl-C of
# `corral serve` for 52 minutes.
WRITER_WAIT_S = 15.0
# How long `shutdown` gives the runs, all asked at once, to take their stop before their stop wait begins
STOP_ASK_S = 5.0
# How long past its stop wait a run that has ended may take to store its last events, beyond its store's
# `close_wait_s` (all runs share one such bound)
FLUSH_SLACK_S = 5.0
# The most `shutdown` takes: the runs taking their stop, their stop, their last events, the store
# writer's last writes (at the default store outage wait: a run's last events get `close_wait_s` of its
# store's)
SHUTDOWN_BOUND_S = STOP_ASK_S + RUN_STOP_WAIT_S + CLOSE_WAIT_S + FLUSH_SLACK_S + WRITER_WAIT_S
# How long `shutdown` still waits once abandoned (a second Ctrl-C): a run a moment from its end ends
ABANDON_GRACE_S = 1.0
# How long a frozen run's sinks, left to the next start with events unstored, get to let go of them:
# the store's puts what it holds in its spill on disk (local disk writes, milliseconds)
SPILL_AT_LEAVE_S = 0.5
# How long an ack waits for the store to have it before it answers
WRITTEN_WAIT_S = 5.0
# How long an offer's or an ack's mirror waits for the event sink to store its batch
BATCH_STORED_WAIT_S = 60.0
# The runs ended here whose handles (gateway, recorder, runtime: about 0.6 MB each) are kept, the latest
# ended: an older one is let go and answers from the store, as a run that ended before a restart does.
# Kept for all, a server's memory grew with every run it had ever executed.
KEEP_ENDED_HANDLES = 8
STORE_BATCH = 500  # envelopes per transaction
STORE_SINK = "store"  # the name of each run's store sink on its bus
# A spill left by a dead process is stored in batches of this many envelopes
SPILL_RECOVER_BATCH = 2_000


@dataclasses.dataclass
class _BatchWrite:
    # offered, taken (its kept file only), redelivered, acked, restored (a kept offer at a restart: its
    # hand-outs, which a kill -9 may have kept from the store)
    kind: str
    run_id: str
    offer: Offer
    offers: OfferFiles
    since: float  # monotonic: when it was queued


@dataclasses.dataclass
class _BatchMark:
    """A batch write waiting for its batch's row: what it writes, without the batch."""

    kind: str
    run_id: str
    index: int
    batch_id: str
    offers: OfferFiles
    since: float
    count: int  # a restored offer's hand-outs (at least 1: its offer)


__all__ = ["IllegalRunStateError", "RunLimitError", "RunLiveError", "RunManager", "RunNotLiveError"]


class RunManager:
    def __init__(
        self,
        store: ServiceStore,
        data_dir: Path,
        ack_timeout_s: float,
        metrics: CorralMetrics | None = None,
        lanes: LanesFactory | None = None,
        spill_dir: Path | None = None,
        spill_max_bytes: int = SPILL_MAX_BYTES,
        store_buffer: int = STORE_BUFFER,
        sink_retry_max_s: float = RETRY_MAX_S,
        max_runs: int = MAX_RUNS,
    ) -> None:
        """`store_buffer`: the events a run's store sink holds in memory before it spills;
        `sink_retry_max_s`: the longest pause before it tries a batch the database refused again;
        `max_runs`: the most runs `create` has executing here at once."""
        if spill_max_bytes < 1:
            raise ValueError(f"spill_max_bytes must be at least 1, not {spill_max_bytes}")
        if store_buffer < 1 or not sink_retry_max_s > 0:
            raise ValueError(f"need store_buffer ≥ 1 and sink_retry_max_s > 0, not {store_buffer}, "
                             f"{sink_retry_max_s}")  # fmt: skip
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, not {max_runs}")
        self.max_runs = max_runs
        self._creating: set[str] = set()  # runs `create` has let in and not yet started
        self._count_lock = threading.Lock()
        self.store = store
        self.spill_dir = spill_dir  # None: each run's own directory under data_dir
        self.spill_max_bytes = spill_max_bytes
        self.store_buffer = store_buffer
        self.sink_retry_max_s = sink_retry_max_s
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
        self._writer = StoreWriter()
        self._batch_writes: list[_BatchWrite] = []  # offers, takes and acks not yet flushed, in order
        self._waiting_marks: list[_BatchMark] = []  # flushed, waiting for the sink to store their batch
        self._flushing: list[str] = []  # the batch ids of the writes the flush under way took
        self._batch_lock = threading.Lock()
        self._flush_scheduled = False
        self._closing = False  # shutting down: the runs' stops are the server's own (`shutdown`)
        self._abandoned = threading.Event()  # shutting down at once: no more waiting (`abandon`)
        self._abandoned_by = float("inf")  # the monotonic time every wait ends once abandoned
        self._start_lock = threading.Lock()
        self._created = threading.Condition(self._count_lock)  # a create under way has stored its run
        self._left_lock = threading.Lock()  # `stop_left`
        # Runs that had ended when a second Ctrl-C came, their end stored or kept on disk for the next
        # start, which finds them ended and does not resume them (`_keep_what_left_runs_hold`)
        self.ends_kept: set[str] = set()
        self.resuming: set[str] = set()  # runs of the previous server still to resume (`start_resuming`)
        self._ended_here: deque[str] = deque()  # runs ended here whose handles are kept, oldest first
        # How far each run being resumed has replayed its stored stream (`replay_progress`)
        self._replays: dict[str, ReplayProgress] = {}
        self._resumer: threading.Thread | None = None

    # -- creating and resuming ----------------------------------------------------------------------

    def create(self, spec: RunCreate, dispatch: Callable[[str], None] | None = None) -> str:
        """Store the run and start it here, or hand it to `dispatch` (a Celery orchestrator task) when
        its orchestrator is celery. Returns its id. A run to execute here is refused (`RunLimitError`,
        nothing stored) while `max_runs` execute here already (`executing`); a celery run executes in
        a worker, and its queue waits for one."""
        if spec.orchestrator is OrchestratorKind.CELERY and dispatch is None:
            raise ValueError("celery needs CORRAL_BROKER_URL (a broker for the orchestrator queue)")
        run_id = uuid.uuid4().hex[:12]
        policy = run_policy(spec)
        if dispatch is not None and spec.orchestrator is OrchestratorKind.CELERY:
            self.store.create_run(run_id, spec.name, spec.stored(), policy.model_dump(mode="json"))
            try:
                dispatch(run_id)
            except DispatchError as exc:  # never sent, so never driven: it ends here, saying why
                self._write_state(
                    run_id, RunState.FAILED, f"not sent to the orchestrator queue: {exc}", time.time()
                )
                raise DispatchError(f"run {run_id!r} was not started (stored as failed): {exc}") from None
            return run_id
        with self._count_lock:  # counted and let in at once: two creates cannot both take the last place
            if self._closing:
                raise ServerStoppingError("corral serve is stopping; create the run again once it is back")
            executing = len(self.executing())
            if executing >= self.max_runs:
                raise RunLimitError(self.max_runs, executing)
            self._creating.add(run_id)
        try:
            self.store.create_run(run_id, spec.name, spec.stored(), policy.model_dump(mode="json"))
            # A create the shutdown overtook as it stored the run (the database slow past the requests'
            # grace) started it after the shutdown had stopped every run: left running in the store at
            # the exit, and resumed by the next start, where its request had got a 500.
            with self._start_lock:
                stopping = self._closing
                if not stopping:
                    self._start(run_id, spec, None)
            if stopping:
                self._write_state(run_id, RunState.STOPPED, NOT_STARTED, time.time())
                raise ServerStoppingError(f"run {run_id!r} was not started (stored as stopped): corral serve "
                                          "is stopping; create it again once the server is back")  # fmt: skip
        finally:
            with self._count_lock:
                self._creating.discard(run_id)
                self._created.notify_all()
        return run_id

    def executing(self) -> set[str]:
        """The runs that count towards `max_runs`: those executing here that have not ended (created,
        running, paused or stopping), those being created, and the previous server's still to resume."""
        live = {run_id for run_id, h in list(self.handles.items()) if h.state not in TERMINAL_RUN_STATES}
        return live | self._creating | self.resuming

    def adopt(self, run_id: str) -> RunHandle:
        """Drive a stored run in this process (an orchestrator worker): from its start, or resumed."""
        record = self.store.get_run(run_id)
        if record is None:
            raise LookupError(f"no run {run_id!r}")
        spec = RunCreate.model_validate(record.config)
        self._recover_spill(run_id, self._spill_path(run_id))
        point = None if record.state == RunState.CREATED.value else self.store.resume_point(run_id)
        return self._start(run_id, spec, point, paused=record.state == RunState.PAUSED.value)

    def resume_unfinished(self) -> list[str]:
        """Resume (or end) every run the previous server left unfinished, now: the runs resumed."""
        self.recover_spills()
        return [run_id for record in self.store.unfinished_runs() if (run_id := self._resume(record))]

    def start_resuming(self) -> list[str]:
        """`resume_unfinished` on a thread of its own, so the server answers meanwhile: replaying a run's
        stored stream (`resume_point`) took 28 s for four runs of a few hundred thousand events, all of
        it before `/healthz` answered. The runs still to resume are in `resuming` until each executes
        here (or is ended); the shutdown stops the resuming (`shutdown`). Returns them. What the previous
        server left in its runs' spills is stored first, on that thread too (`recover_spills`: up to
        4 GiB of events a run, which is no reason for `/healthz` not to answer)."""
        records = self.store.unfinished_runs()
        # A celery run is not resumed here (`_resume`): its orchestrator worker drives it, taking commands
        # meanwhile. Listed, it showed "being resumed", its controls hidden, while other runs replayed.
        here = [r.id for r in records if r.config.get("orchestrator") != OrchestratorKind.CELERY.value]
        self.resuming = set(here)
        self._resumer = threading.Thread(
            target=self._resume_all, args=(records,), name="corral-resume", daemon=True
        )
        self._resumer.start()
        return here

    def _resume_all(self, records: list[RunRecord]) -> None:
        resumed = []
        try:
            self.recover_spills()  # a run with its spill still there is not resumed (`_resume`)
        except Exception:
            log.exception("the spills of the previous server's runs could not be stored; the next start "
                          "tries again")  # fmt: skip
        for record in records:
            try:
                if self._closing:
                    break
                # One run that cannot be resumed (a database error) must not keep the others from it
                try:
                    run_id = self._resume(record)
                except Exception:
                    log.exception("run %s not resumed; the next start tries again", record.id)
                    continue
                if run_id is not None:
                    resumed.append(run_id)
            finally:
                self.resuming.discard(record.id)
                self._replays.pop(record.id, None)
        self.resuming.clear()
        self._replays.clear()
        if resumed:
            log.warning("resumed runs %s", ", ".join(resumed))

    # -- spills: what a run's store sink could not write in time, on local disk -------------------------

    def _spill_path(self, run_id: str) -> Path:
        if self.spill_dir is not None:
            return self.spill_dir / run_id
        return self.data_dir / run_id / "event-spill"

    def recover_spills(self) -> dict[str, int]:
        """Store what the previous process's runs left in their spills (it was killed, or gave up at
        shutdown, while the database was away): before anything reads those runs' streams, so that a
        resumed run continues after them. A run another process drives (a celery orchestrator) is left
        to it (`adopt`). Returns the events stored per run; a spill the store refuses is kept for the
        next start (its error is logged)."""
        pattern = "*" if self.spill_dir is not None else "*/event-spill"
        root = self.spill_dir if self.spill_dir is not None else self.data_dir
        stored = {}
        for directory in sorted(root.glob(pattern)) if root.is_dir() else []:
            run_id = directory.relative_to(root).parts[0]
            if run_id in self.handles or not spill.files(directory):
                continue
            record = self.store.get_run(run_id)
            celery = record is not None and record.config.get("orchestrator") == OrchestratorKind.CELERY.value
            if celery and record is not None and record.state not in ENDED_STATES:
                continue
            try:
                stored[run_id] = self._recover_spill(run_id, directory)
            except Exception:
                log.exception("run %s: its spill %s could not be stored; the next start tries again",
                              run_id, directory)  # fmt: skip
        return stored

    def _recover_spill(self, run_id: str, directory: Path) -> int:
        """Store the envelopes a dead process left in `directory`, in seq order (the store skips those it
        has), then remove it: how many were new."""
        if not directory.is_dir():
            return 0
        found = spill.recover(directory)
        sink = self.store.event_sink()
        for start in range(0, len(found.envelopes), SPILL_RECOVER_BATCH):
            sink.write_batch(found.envelopes[start : start + SPILL_RECOVER_BATCH])  # waits out an outage
        gaps = self.store.event_gaps(run_id)
        log.warning(
            "run %s: stored %d events its spill kept (%d already stored, %d unreadable lines, %s bytes)%s",
            run_id,
            sink.written,
            sink.duplicates,
            found.bad_lines,
            f"{found.bytes:,}",
            f"; the stored stream has {gaps} holes" if gaps else "; the stored stream has no hole",
        )
        spill.remove(directory)
        return sink.written

    def _resume(self, record: RunRecord) -> str | None:
        """Resume one unfinished run (its id), or end it when it cannot be (None)."""
        try:
            spec = RunCreate.model_validate(record.config)
        except ValidationError as exc:
            self._end_unresumable(record, f"stored config no longer valid: {exc.errors()[0]['msg']}")
            return None
        if spec.orchestrator is OrchestratorKind.CELERY:
            return None  # its orchestrator task is redelivered to a worker, which resumes it
        if spill.files(self._spill_path(record.id)):  # numbered after them, its events would hide them
            log.error("run %s not resumed: its spill could not be stored; the next start tries again",
                      record.id)  # fmt: skip
            return None
        stored = self.store.get_run(record.id)
        if stored is None or stored.state in ENDED_STATES:  # its spill, stored since, held its end
            log.warning("run %s not resumed: it had ended (%s), as its spill says", record.id,
                        stored.state if stored else "deleted")  # fmt: skip
            return None
        progress = self._replays[record.id] = ReplayProgress(self.store.last_seq(record.id))
        point = self.store.resume_point(record.id, progress.on_envelope)
        if record.state == RunState.STOPPING.value:
            self._end_unresumable(record, "was stopping when the control plane stopped", point)
            return None
        with self._start_lock:  # none starts once the shutdown has begun: it would never be stopped
            if self._closing:
                return None
            self._start(record.id, spec, point, paused=record.state == RunState.PAUSED.value)
        return record.id

    def _attach_sinks(self, recorder: RunRecorder) -> None:
        recorder.stored = StoredMark(self.store.event_sink())
        recorder.close_wait_s = close_wait_s(self.store.outage_s)
        overflow = SpillFile(self._spill_path(recorder.run_id), self.spill_max_bytes)
        recorder.bus.add_sink(
            recorder.stored,
            name=STORE_SINK,
            batch_size=min(STORE_BATCH, self.store_buffer),
            capacity=self.store_buffer,
            spill=overflow,
            retry_first_s=min(RETRY_FIRST_S, self.sink_retry_max_s),
            retry_max_s=self.sink_retry_max_s,
        )
        if self.metrics is not None:
            recorder.bus.add_sink(self.metrics.sink(recorder.run_id), name="metrics", flush_interval_s=0.1)

    def _start(
        self, run_id: str, spec: RunCreate, point: ResumePoint | None, paused: bool = False
    ) -> RunHandle:
        """Start a run here: from its beginning, or resumed from `point`; `paused`: it was paused
        when the process driving it died, and comes back paused (an operator's pause outlives it)."""
        offers = OfferFiles(self.data_dir / run_id / "offers")
        # a kept file of a batch the store holds acked is not offered again (handed out twice, before)
        kept = offers.load(self.store.acked_batches(run_id)) if point is not None else []
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
            run_id,
            spec,
            self.data_dir / run_id,
            self.ack_timeout_s,
            self._on_state,
            point,
            self.lanes,
            paused=paused and point is not None,
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
                self._batch_write("restored", run_id, offer, offers)
            # The trainer's counters go on from the store's, as the run's own counters do, with the kept
            # offers' hand-outs where the store missed some (a kill -9 before it had them).
            stored = self.store.figures(run_id, {offer.index: offer.deliveries for offer in kept})
            stats = handle.gateway.stats
            stats.offered, stats.redelivered, stats.acked = (
                stored["offered"],
                stored["redelivered"],
                stored["acked"],
            )
        handle.gateway.on_offer = lambda offer: self._batch_write("offered", run_id, offer, offers)
        handle.gateway.on_take = lambda offer: self._batch_write("taken", run_id, offer, offers)
        handle.gateway.on_ack = lambda offer: self._batch_write("acked", run_id, offer, offers)
        # a batch handed out again counts in the store's offer_count, as the answer's `delivery` does
        handle.gateway.on_redeliver = lambda offer: self._batch_write("redelivered", run_id, offer, offers)
        record = self.store.get_run(run_id)
        assert record is not None
        self._records[run_id] = record
        self.handles[run_id] = handle
        self.resuming.discard(run_id)  # executing: the API, the dashboard and /healthz say so alike
        handle.start()
        return handle

    def _batch_write(self, kind: str, run_id: str, offer: Offer, offers: OfferFiles) -> None:
        """Mirror an offer, a take, a redelivery or an ack of a batch: its kept file now, its row in the
        store with every other one waiting (`_flush_batch_writes`), in the order they came. The file is
        written here, before a trainer can take the batch (an offer) or is answered (a take): written by
        the store writer, it waited behind the marks of a store locked or away, and a kill -9 lost a batch
        handed out meanwhile, or handed one out again as its first delivery."""
        if kind == "offered":  # raises while the disk refuses it: the offer waits (`TrainerGateway.step`)
            offers.save(offer)
        elif kind == "taken" and not offer.acked:  # an acked one's file is on its way out
            try:
                offers.save(offer)
            except OSError as exc:  # its file from the offer keeps it, with an older delivery count
                log.warning("run %s: batch %s handed out; its kept file is not updated: %s", run_id,
                            offer.batch_id, exc)  # fmt: skip
        with self._batch_lock:
            self._batch_writes.append(_BatchWrite(kind, run_id, offer, offers, time.monotonic()))
            if self._flush_scheduled:
                return  # the flush waiting in the writer's queue takes this one too
            self._flush_scheduled = True
        try:
            future = self._writer.submit(self._flush_batch_writes, self._give_up_batch_writes)
        except RuntimeError:  # the writer has shut down (a run outlived `shutdown`): write here
            self._flush_batch_writes()
            return
        future.add_done_callback(_log_failure)

    def _give_up_batch_writes(self) -> None:
        """A flush the shutdown gave up (`StoreWriter.close`): the kept offers are still left right, an
        acked batch's file removed (an unacked one's was written with its offer: offered again at the next
        start)."""
        with self._batch_lock:
            writes, self._batch_writes = self._batch_writes, []
            marks, self._waiting_marks = self._waiting_marks, []
            self._flush_scheduled = False
        for write in writes:
            if write.kind == "acked":
                write.offers.remove(write.offer)
        for mark in marks:
            if mark.kind == "acked":
                mark.offers.remove_batch(mark.batch_id)
        if writes or marks:
            log.warning("store writer: %d offer and ack marks given up at shutdown", len(writes) + len(marks))

    def _flush_batch_writes(self) -> None:
        """On the store writer: every batch write queued so far, in one transaction (one wait for
        SQLite's writer lock, which the event sink holds most of the time under a busy run: at one
        transaction a write, the writer fell behind a sentinel run at speed 100, 2,563 writes queued
        after 60,000 events, each holding its batch). Kept files are written before (`_batch_write`); an
        ack's file goes once the store has the ack (a failed write leaves the batch to offer again). A write
        whose batch the sink has not stored yet waits, as a few ids, not the batch, and is tried again
        by the next flush (one is queued while any wait), for `BATCH_STORED_WAIT_S`; past that it is
        given up with a warning."""
        with self._batch_lock:
            writes, self._batch_writes = self._batch_writes, []
            self._flush_scheduled = False  # a write from now on schedules the next flush
            self._flushing = [w.offer.batch_id for w in writes]
        try:
            self._flush_marks(writes)
        finally:
            with self._batch_lock:
                self._flushing = []

    def _flush_marks(self, writes: list[_BatchWrite]) -> None:
        """`_flush_batch_writes`' work on the writes it took."""
        now = time.monotonic()
        marks = self._waiting_marks + [
            _BatchMark(
                w.kind,
                w.run_id,
                w.offer.index,
                w.offer.batch_id,
                w.offers,
                w.since,
                max(1, w.offer.deliveries),
            )
            for w in writes
            if w.kind != "taken"
        ]
        rows = [
            (m.kind if m.kind in ("acked", "restored") else "offered", m.run_id, m.index, m.count)
            for m in marks
        ]
        store_marks = functools.partial(self.store.mark_batches, rows)
        done = self._until_stored(store_marks)
        waiting = []
        for mark, written in zip(marks, done, strict=True):
            # Once shutting down, one look: a batch row the sink never stored is not waited for.
            if not written and not self._closing and now - mark.since < BATCH_STORED_WAIT_S:
                waiting.append(mark)
                continue
            if not written:
                log.warning(
                    "batch %s never reached the store; its %s is not mirrored", mark.batch_id, mark.kind
                )
            if mark.kind == "acked":
                mark.offers.remove_batch(mark.batch_id)
        with self._batch_lock:
            self._waiting_marks = waiting
            self._flushing = []
            again = bool(waiting) and not self._flush_scheduled
            self._flush_scheduled = self._flush_scheduled or again
        if again:  # behind the writes queued meanwhile; the pause keeps it from spinning on the sink
            time.sleep(0.1)
            try:
                self._writer.submit(self._flush_batch_writes, self._give_up_batch_writes).add_done_callback(
                    _log_failure
                )
            except RuntimeError:  # shut down, every run's sink closed: their batches never came
                log.warning("%d offers and acks never mirrored: their batches never reached the store",
                            len(waiting))  # fmt: skip

    def ack_stored(self, run_id: str, batch_id: str) -> bool | None:
        """Ack a batch the run's gateway does not hold (handed out before a restart, or the run ended
        before one) in the store: whether it was acked already; None for no such delivered batch."""
        already = self.store.ack_batch(run_id, batch_id)
        if already is False:  # a valid batch id: its kept offer, if any, is done with
            OfferFiles(self.data_dir / run_id / "offers").remove_batch(batch_id)
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
            kept = offers.load(self.store.acked_batches(run_id))
            if not kept:
                return None
            gateway = TrainerGateway(run_id, self.ack_timeout_s, lambda: 0)
            for offer in kept:
                gateway.restore(offer)
            gateway.on_take = lambda offer: self._batch_write("taken", run_id, offer, offers)
            gateway.on_ack = lambda offer: self._batch_write("acked", run_id, offer, offers)
            gateway.on_redeliver = lambda offer: self._batch_write("redelivered", run_id, offer, offers)
            gateway.close(record.state)
            self._ended[run_id] = gateway
            return gateway

    def stop_left(self, run_id: str, actor: str) -> tuple[RunRecord, bool] | None:
        """Stop a stored run a crash left unfinished (created, running, paused or stopping) that executes
        nowhere: this server did not resume it (`CORRAL_RESUME_RUNS=false`, or its resume failed) and it
        is no celery run (the caller sends those to their worker). It is ended `stopped` in the store as a
        run found stopping by a restart is: the groups its stream shows open discarded `orphaned`, then
        its end. Without this, such a run could be neither stopped (not executing here) nor deleted (not
        ended). Returns its row now and whether this call stopped it (False: it was stopping already,
        or had ended); None for a run executing here, being created or resumed, or not stored."""
        with self._left_lock:  # two stops at once end it once
            if run_id in self.handles or run_id in self._creating or run_id in self.resuming:
                return None
            record = self.store.get_run(run_id)
            if record is None:
                return None
            if record.state in ENDED_STATES:
                return record, False
            # What the dead process left in its spill first: the end is numbered after it
            self._recover_spill(run_id, self._spill_path(run_id))
            stopping = record.state == RunState.STOPPING.value
            detail = (
                "was stopping when the control plane stopped"
                if stopping
                else f"stopped by {actor}: not resumed after the control plane stopped"
            )
            self._end_unresumable(record, detail)
            ended = self.store.get_run(run_id)
            return (ended or record), not stopping

    def _end_unresumable(self, record: RunRecord, detail: str, point: ResumePoint | None = None) -> None:
        point = point or self.store.resume_point(record.id)
        recorder = RunRecorder(record.id, lambda: point.last_t, point.next_seq)
        self._attach_sinks(recorder)
        recorder.orphan_open_groups(set(point.open_groups), detail)
        recorder.publish(RunEnded("stopped", detail))
        recorder.close()
        log.warning("run %s not resumed: %s", record.id, detail)

    def wait_written(self, timeout_s: float = WRITTEN_WAIT_S, batch_id: str | None = None) -> bool:
        """Wait until what was handed to the store writer so far is written (its writes run one at a
        time, in order): whether it was, within `timeout_s` (a database that is away is waited out).
        `batch_id`: of the marks waiting for their batch's row, only that batch's count (another run's
        sink, behind, must not hold up this one's ack).

        A write is waited for until its flush has carried it out, wherever it is meanwhile: queued, in
        the flush under way, or waiting for its row. Before, only the last were: while other batches'
        marks waited for their rows, the flush that would take an ack was queued again 0.1 s later, the
        wait's marker ran before it, and an ack was answered before its batch's kept file was removed."""
        deadline = time.monotonic() + timeout_s

        def waiting() -> bool:
            with self._batch_lock:
                if batch_id is None:  # what was handed over before: the marker ran after its flushes
                    return bool(self._waiting_marks)
                queued = [w.offer.batch_id for w in self._batch_writes] + self._flushing
                return batch_id in queued or any(mark.batch_id == batch_id for mark in self._waiting_marks)

        try:
            done = self._writer.submit(lambda: None)
        except RuntimeError:  # shut down: every write was done (or given up) before
            return True
        try:
            done.result(timeout_s)
            while waiting() and time.monotonic() < deadline:  # their batches not stored yet
                time.sleep(0.02)
        except (TimeoutError, CancelledError):
            pass
        if done.done() and not done.cancelled() and not waiting():
            return True
        log.warning("store writes not done after %.0f s", timeout_s)
        return False

    def _until_stored(self, write: Callable[[], T]) -> T:
        """`write()` on the store writer, through the store's outage wait, then through another, for as
        long as the database stays away (its disk full until someone frees space, say) and the server
        is not shutting down. After one wait, offers, acks and state changes were given up with a
        warning: an ack the trainer had been told was stored was not, and a run stopped meanwhile was
        resumed at the next start. The writes behind it wait their turn, in order."""
        while True:
            try:
                return through_outage(write, "store writer", self.store.outage_s)
            except Exception as exc:
                if not is_outage(exc) or self._closing:
                    raise

    def _mirror(
        self, fn: Any, *args: Any, dropped: Callable[[], None] | None = None, first: bool = False
    ) -> None:
        # A database that is away (Postgres restarting) is waited out: each write is its own transaction,
        # so one tried again stores nothing twice, and the writes after it wait their turn. `dropped`:
        # what to do instead when the shutdown gives the write up; `first`: see `StoreWriter`.
        write = functools.partial(self._until_stored, functools.partial(fn, *args))
        try:
            future = self._writer.submit(write, dropped, first)
        except RuntimeError:  # the writer has shut down (a run outlived `shutdown`): write here
            if not self._abandoned.is_set():
                write()
            elif dropped is not None:  # stopping at once: the store is left as it is
                dropped()
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
        # The shutdown's stop is not stored: a run whose stop the shutdown cannot finish stays `running`
        # in the store and is resumed at the next start (a stored `stopping` run is ended there instead).
        if not (state is RunState.STOPPING and self._closing):
            self._mirror(self._write_state, handle.run_id, state, error, at, first=True)
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
                self._mirror(self.store.set_lanes, handle.run_id, lanes, first=True)
        if state in TERMINAL_RUN_STATES and self.metrics is not None:
            self.metrics.forget_run(handle.run_id, handle.live())
        if state in TERMINAL_RUN_STATES:
            self._let_go_ended(handle.run_id)

    def _let_go_ended(self, run_id: str) -> None:
        """Note that `run_id` has ended, and let go of the handles of the runs ended here before the
        latest `KEEP_ENDED_HANDLES`: each then answers from the store (its view, its batches never acked
        through `ended_gateway`), as after a restart. One still storing its last events is kept until
        the next run ends."""
        with self._ended_lock:
            self._ended_here.append(run_id)
            while len(self._ended_here) > KEEP_ENDED_HANDLES:
                oldest = self._ended_here[0]
                handle = self.handles.get(oldest)
                if handle is not None and not handle.done.is_set():
                    break
                self._ended_here.popleft()
                self.handles.pop(oldest, None)
                self._records.pop(oldest, None)
                self._lanes_stored.discard(oldest)

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

    def replay_progress(self, run_id: str) -> dict[str, int | None] | None:
        """For a run being resumed (`resuming`): the events of its stored stream replayed so far and
        the events there are (None before the replay has begun); None for any other run."""
        if run_id not in self.resuming:
            return None
        progress = self._replays.get(run_id)
        if progress is None:
            return {"events_replayed": 0, "events": None}
        return {"events_replayed": progress.replayed, "events": progress.events}

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
            if (replay := self.replay_progress(run_id)) is not None:  # executing again in a moment
                out["resuming"] = True
                out["replay"] = replay
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
            elif (replay := self.replay_progress(record.id)) is not None:
                row["resuming"] = True
                row["replay"] = replay
            out.append(row)
        return out

    def sample_metrics(self) -> None:
        """At each scrape: the gauges of executing runs, and the series of runs ended long enough ago
        (`app.metrics.RUN_SERIES_GRACE_S`) removed."""
        if self.metrics is None:
            return
        self.metrics.expire()
        for run_id, handle in list(self.handles.items()):
            if handle.state not in TERMINAL_RUN_STATES:
                self.metrics.sample_run(run_id, handle.live())

    # -- retention -----------------------------------------------------------------------------------

    def delete(self, run_id: str) -> bool:
        """Delete an ended run: its rows in the store (`ServiceStore.delete_run`), its data directory
        (kept batches, sentinel weights) and what this server holds of it (its handle, metrics series).
        False for no such run; `RunLiveError`, and nothing deleted, for a run that has not ended, here
        or in the store (one executing in an orchestrator worker says so there); `retention.MarkError`,
        and nothing deleted, when its directories cannot be marked for deletion (a read-only or full
        disk): files that outlived their rows would be no later prune's to find."""
        handle = self.handles.get(run_id)
        if handle is not None and not handle.done.is_set():
            raise RunLiveError(f"run {run_id!r} is {handle.state.value}; stop it and wait until it has ended")
        self.wait_written()  # its offers' and acks' mirrors land before its rows go, not after
        # Only a run this database has is marked: another database's run of the same id (a data directory
        # shared) is not this deletion's. What a failed or cut-short removal below leaves, prune finishes.
        dirs = retention.run_dirs(run_id, self.data_dir, self.spill_dir) if self.store.get_run(run_id) else []
        made = retention.mark(dirs, self.store.instance_id() or "", hide_password(self.store.url))
        try:
            deleted = self.store.delete_run(run_id)
        except RunLiveError:
            retention.unmark(made)  # its row is there: it is not gone
            raise
        if handle is not None:
            handle.gateway.deleted()  # a long-poll open on it answers 404 now, not 204 at its timeout
        self.handles.pop(run_id, None)
        self._records.pop(run_id, None)
        self._lanes_stored.discard(run_id)
        with self._ended_lock:
            ended = self._ended.pop(run_id, None)
        if ended is not None:  # an ended run's kept batches, a long-poll open on them: 404 now too
            ended.deleted()
        # Not deleted: never here (nothing was marked), or gone meanwhile (a prune), whose removal the
        # tombstones may still serve, so they stay.
        problems = retention.remove(dirs) if deleted else []
        if problems:
            log.warning("run %s: deleted, but not all of its files (corral prune removes them): %s",
                        run_id, "; ".join(problems[:3]))  # fmt: skip
        if self.metrics is not None:
            self.metrics.drop_run(run_id)
        return deleted

    # -- shutting down -------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = RUN_STOP_WAIT_S) -> None:
        """Stop every run still executing and wait up to `timeout_s` for them to end; a run that has ended and
        is storing its last events (the database away) is waited for up to `close_wait_s` (its store's outage
        wait + 10 s) more, so no event and no end state is lost with the process; then the store writer gets
        `WRITER_WAIT_S` for its last writes. `abandon` (from another thread) ends every wait at once: a run
        not stopped by then is left as the store has it, and resumed at the next start."""
        with self._start_lock:  # a run being resumed starts before this, or not at all
            self._closing = True
        stops = []
        for handle in list(self.handles.values()):
            with contextlib.suppress(RunNotLiveError, IllegalRunStateError):
                stops.append(handle.submit(handle.stop))  # refused: already ending, or not started
        # Asked of every run at once: a run's loop slow to answer (under load) holds no other's stop
        asked_by = time.monotonic() + STOP_ASK_S
        for stop in stops:
            with contextlib.suppress(RunNotLiveError, IllegalRunStateError, TimeoutError):
                self._wait_or_abandoned(stop, asked_by)
        deadline = time.monotonic() + timeout_s
        # One bound for all: they store their last in parallel
        flushed_by = deadline + close_wait_s(self.store.outage_s) + FLUSH_SLACK_S
        for handle in list(self.handles.values()):
            if self._wait_or_abandoned(handle.done, deadline):
                continue
            if self._abandoned.is_set():
                continue  # each run gets what is left of the grace
            if not handle.flushing.is_set():
                log.warning("run %s did not end within %.0f s of shutdown", handle.run_id, timeout_s)
                continue
            # Its thread is a daemon: returning now would lose the events it still holds, and its end.
            log.warning(
                "run %s has ended; waiting up to %.0f s more for its last events to be stored",
                handle.run_id,
                max(0.0, flushed_by - time.monotonic()),
            )
            if not self._wait_or_abandoned(handle.done, flushed_by):
                log.warning("run %s: its last events and end state may be lost, unstored", handle.run_id)
        if self._abandoned.is_set():
            self._keep_what_left_runs_hold()
        self._wait_for_creates(flushed_by)
        self._writer.close(time.monotonic() + WRITER_WAIT_S, lambda: self._abandoned_by)
        interrupted = [
            h.run_id for h in self.handles.values() if not h.done.is_set() and h.run_id not in self.ends_kept
        ]
        if interrupted:
            log.warning(
                "runs %s not stopped: left as the store has them, resumed at the next start",
                ", ".join(interrupted),
            )

    def leave_for_next_start(self, timeout_s: float = RUN_STOP_WAIT_S) -> tuple[str, ...]:
        """Shut down leaving every run executing to the next start (`CORRAL_RUNS_ON_SHUTDOWN=resume`): each
        run's loop is frozen where it stands (it takes no further step, so it publishes nothing more), the
        store gets every event it published (up to `timeout_s` in all, its database waited out meanwhile)
        and the store writer its last writes; the store keeps each run as it was (running, paused), and the
        next start resumes it as after a crash, its groups in flight discarded `orphaned`. What a kill -9
        would leave, with nothing lost: the process must end after this (the frozen runs' threads hold
        their engines, which end with it), and it keeps its sandbox registration, so the next start
        removes the sandboxes the runs had. `abandon` ends the waits at once. Returns the runs left."""
        with self._start_lock:
            self._closing = True
        # A run whose loop has ended meanwhile is left out: its end is stored as any run's
        frozen = [(h, reached) for h, reached in self._freeze_runs() if reached is not h.flushing]
        deadline = time.monotonic() + timeout_s
        left: builtins.list[str] = []
        for handle, reached in frozen:
            if not self._wait_or_abandoned(reached, min(deadline, time.monotonic() + STOP_ASK_S)):
                log.warning("run %s: its loop did not stop within %.0f s; left as the store has it",
                            handle.run_id, STOP_ASK_S)  # fmt: skip
                left.append(handle.run_id)
                continue
            last = handle.recorder.bus.published - 1
            stored = self._wait_or_abandoned(_Stored(handle.recorder, last), deadline)
            kept = "stored" if stored else self._keep_unstored(handle)[1]
            log.warning(
                "run %s: left to the next start, which resumes it (its %d events %s)", handle.run_id,
                last + 1, kept,
            )  # fmt: skip
            left.append(handle.run_id)
        self._wait_for_creates(deadline)
        self._writer.close(time.monotonic() + WRITER_WAIT_S, lambda: self._abandoned_by)
        registration = leftovers.current()
        if left and registration is not None:
            registration.keep()
        return tuple(left)

    def _wait_for_creates(self, until: float) -> None:
        """Wait, until `until` or an abandon, for the creates under way as the shutdown began: each stores
        its run stopped, never started (`create`), rather than leave it `created` for the next start to
        run, with the process gone under it."""
        with self._count_lock:
            while self._creating and not self._abandoned.is_set():
                left = until - time.monotonic()
                if left <= 0:
                    log.warning("runs %s: their creates had not stored them at the shutdown's end",
                                ", ".join(sorted(self._creating)))  # fmt: skip
                    return
                self._created.wait(min(left, 0.1))

    def _keep_what_left_runs_hold(self) -> None:
        """Abandoned (a second Ctrl-C): each run not ended yet is left as the store has it, for the next
        start to resume. What it published that the store does not have yet goes to its spill first, as
        `leave_for_next_start` does: its loop is frozen (or it has ended and is storing its last events),
        then its sinks let go. A run whose loop does not take the freeze within `SPILL_AT_LEAVE_S` is
        still publishing and is left as a kill -9 would leave it."""
        frozen = self._freeze_runs()
        by = time.monotonic() + SPILL_AT_LEAVE_S
        for handle, reached in frozen:
            last = handle.recorder.bus.published - 1
            if not reached.wait(max(0.0, by - time.monotonic())):
                continue
            kept = True
            if not handle.recorder.wait_stored(last, 0):
                kept, said = self._keep_unstored(handle)
                log.warning(
                    "run %s: left as the store has it (its %d events %s)", handle.run_id, last + 1, said
                )
            if kept and reached is handle.flushing:
                self.ends_kept.add(handle.run_id)  # its end stored, or on disk for the next start

    def _freeze_runs(self) -> builtins.list[tuple[RunHandle, threading.Event]]:
        """Freeze the loop of each run not done (`_freeze`), all at once: each with the event set once its
        loop has taken the freeze, or, for a run whose loop has ended (it is storing its last events, or
        about to), its `flushing`."""
        frozen: builtins.list[tuple[RunHandle, threading.Event]] = []
        for handle in list(self.handles.values()):
            if handle.done.is_set():
                continue
            reached = threading.Event()
            try:
                handle.submit(_freeze, reached)
            except RunNotLiveError:
                reached = handle.flushing
            frozen.append((handle, reached))
        return frozen

    def _keep_unstored(self, handle: RunHandle) -> tuple[bool, str]:
        """A frozen run whose events the store does not all have: its sinks let go of what they hold,
        the store's into its spill on disk (`_SinkWorker.close`), which the next start stores before it
        resumes the run. Before, a second Ctrl-C (or a database away past the wait) lost every event
        not yet written, all of a young run's. A run whose loop has ended is closing its recorder on its
        own thread meanwhile: the two closes give each sink up once (`_SinkWorker.close`). Whether every
        event is kept, and what became of them, for the log line."""
        sinks = handle.recorder.close(SPILL_AT_LEAVE_S)
        store = sinks.get(STORE_SINK, {})
        kept, lost = int(store.get("kept_on_disk", 0)), int(store.get("unflushed", 0))
        if lost:
            return False, f"published: {lost} of them neither stored nor kept, the spill's disk refused them"
        if kept:
            return True, f"published: {kept} of them not yet stored, kept on disk for the next start to store"
        return True, "stored"

    def abandon(self) -> None:
        """Stop waiting (a second Ctrl-C): `shutdown` returns within `ABANDON_GRACE_S`, leaving each run
        not yet stopped and each store write not yet done as they are; what the store holds is kept,
        and the runs are resumed from it at the next start. Safe from any thread."""
        self._closing = True
        if not self._abandoned.is_set():
            self._abandoned_by = time.monotonic() + ABANDON_GRACE_S
            self._abandoned.set()

    def _wait_or_abandoned(self, what: _Waitable | Future[Any], until: float) -> bool:
        """Wait for `what` (anything with `wait(timeout)`, as an event; or a future's result) until the
        monotonic time `until`, or until `abandon`: whether it came."""
        while True:
            left = min(until, self._abandoned_by) - time.monotonic()
            if isinstance(what, Future):
                if left <= 0:
                    return what.done()
                with contextlib.suppress(TimeoutError):
                    what.result(min(left, 0.1))
                    return True
            else:
                came = what.wait(max(0.0, min(left, 0.1)))  # at the bound: one look, not a wait
                if came or left <= 0:
                    return came


class _Waitable(Protocol):
    """What `RunManager._wait_or_abandoned` waits for in steps: a `threading.Event`, a `_Stored`."""

    def wait(self, timeout: float | None = None) -> bool: ...


def _freeze(reached: threading.Event) -> None:
    """Run on a run's loop: take no further step, for good (`RunManager._freeze_runs`)."""
    reached.set()
    threading.Event().wait()


class _Stored:
    """Whether the store holds a run's event `seq` (`RunRecorder.wait_stored`), waited for as an event
    (`_Waitable`)."""

    def __init__(self, recorder: RunRecorder, seq: int) -> None:
        self.recorder = recorder
        self.seq = seq

    def wait(self, timeout: float | None = None) -> bool:
        return self.seq < 0 or self.recorder.wait_stored(self.seq, 0 if timeout is None else timeout)


class ReplayProgress:
    """How far a run being resumed has replayed its stored stream: fed each event as it is replayed
    (on the resuming thread), read by the API and the dashboard."""

    def __init__(self, last_seq: int | None) -> None:
        self.events = 0 if last_seq is None else last_seq + 1  # sequence numbers start at 0
        self.replayed = 0

    def on_envelope(self, env: Envelope) -> None:
        self.replayed += 1


class StoreWriter:
    """The manager's store writes (offer and ack marks, run states), one at a time, on a daemon thread of
    their own: a process that stops waiting for them (`close` past its bound) exits without them rather
    than hanging on one. Writes run in the order submitted, except that `first` ones (a run's state, its
    lanes: few, and independent of the marks) go before every other still queued: behind a store that
    lags, thousands of marks queue up, and a run's end state waited behind them, or was given up with
    them at shutdown."""

    def __init__(self) -> None:
        self._first: deque[tuple[Callable[[], Any], Callable[[], None] | None, Future[Any]]] = deque()
        self._queue: deque[tuple[Callable[[], Any], Callable[[], None] | None, Future[Any]]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="corral-store", daemon=True)
        self._thread.start()

    def submit(
        self, write: Callable[[], Any], dropped: Callable[[], None] | None = None, first: bool = False
    ) -> Future[Any]:
        """Queue `write`; `dropped` runs instead if `close` gives it up. RuntimeError once closed."""
        future: Future[Any] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the store writer is closed")
            (self._first if first else self._queue).append((write, dropped, future))
            self._cond.notify_all()
        return future

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._first and not self._queue and not self._closed:
                    self._cond.wait()
                if not self._first and not self._queue:
                    return
                write, _, future = (self._first or self._queue).popleft()
                self._busy = True
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(write())
                except BaseException as exc:  # handed to the future's callback, which logs it
                    future.set_exception(exc)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def close(self, until: float, abandoned_by: Callable[[], float] | float = float("inf")) -> int:
        """Take no more writes, let the queued ones run until the monotonic time `until` (or
        `abandoned_by`, which may move nearer meanwhile), then give up the rest: each runs its
        `dropped` instead (a kept offer's file), and its future is cancelled. The writes given up
        (logged)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._first or self._queue or self._busy:
                by = abandoned_by() if callable(abandoned_by) else abandoned_by
                left = min(until, by) - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            given_up = [*self._first, *self._queue]
            self._first.clear()
            self._queue.clear()
        for _, dropped, future in given_up:
            future.cancel()
            if dropped is not None:
                try:
                    dropped()
                except OSError as exc:
                    log.warning("store writer: a given-up write's fallback failed: %r", exc)
        if given_up:
            log.warning(
                "store writer: %d offer, ack or state writes not done by the shutdown's bound, given up "
                "(a batch offered again at the next start, a run resumed)",
                len(given_up),
            )
        return len(given_up)


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
    if future.cancelled():
        return  # given up at shutdown, and counted there
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
