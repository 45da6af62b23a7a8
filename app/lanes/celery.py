"""CeleryLanes: lane operations as Celery tasks on per-lane, per-host queues (distributed deployment).

`attach` places a sandbox on a host (the one with the fewest live sandboxes, ties in the given order)
and the handle carries that host: every op of the sandbox goes to `lane.<host>.<op's lane>`, where the
workers of that host and lane (`corral worker --lane L --host H`) consume it. The op id is the task id.

Invariants:
- every op of one sandbox lands on the host its handle names; an op whose handle has no host is refused;
- waiting for a result never blocks the event loop: publishing and each poll of the result backend run
  in a thread, polls back off from `poll_min_s` to `poll_max_s`;
- a cancelled op is revoked (a queued op then never runs) and the cancellation waits, up to
  `cancel_grace_s`, for the op to settle: a sandbox's cleanup, sent after the cancellation, never
  overtakes its own reset still running in another lane;
- a revoked op (cancelled, or timed out) never starts afterwards, whatever worker its message reaches,
  however late (up to `CANCELLED_TTL_S`): it is recorded in the result backend before it is revoked;
- a worker's error is raised here (its type when importable, else celery's), never swallowed;
- with `start_timeout_s`, an op no worker has started in that time (its host is down, or its lane has
  no worker) is revoked and fails with `LaneStartTimeout`, so an attempt never hangs on a lost host;
  with `op_timeout_s`, an op not finished in that time fails with `LaneOpTimeout` (on Redis, an op whose
  whole worker died mid-op comes back only after the visibility timeout: this bounds the wait);
- an op a Redis broker lost in a restart (it came back empty) is sent again once no queue and no worker
  holds it, never while a worker may still run it (app.lanes.lost_ops).

Stats: `queue_depth` is the broker's count of messages waiting in the lane's queues (on Redis the LLEN
of the queue), `busy` the ops of this client a worker has started and not finished, waits are measured
from the publish to the worker's start (wall clocks: same host or NTP-synchronised hosts). `stats` may
be called from any thread, often (run views); it asks the broker at most once per `depth_ttl_s` and
answers from that count in between. A broker that cannot be reached leaves the last counts standing
(logged once) and is asked again only after `DEPTH_RETRY_S`: a run view waits for no broker outage.
`resent` counts the ops sent again after a broker restart lost them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery, states
from celery.exceptions import BackendGetMetaError
from celery.result import AsyncResult
from kombu.exceptions import OperationalError
from redis import Redis

from app.lanes import lost_ops
from app.lanes.base import LaneName, LaneSlot, LaneStats
from app.lanes.ops import LaneOp, LaneOpError, SandboxHandle, decode_result, handle_of
from app.sandboxes.base import Sandbox
from app.validation import hide_password

T = TypeVar("T")
log = logging.getLogger(__name__)

LANE_OP_TASK = "corral.lane_op"  # workers.lane_tasks registers the task under this name
LANE_SWEEP_TASK = "corral.lane_sweep"  # a run's sweep of a lane host (`CeleryLanes.begin_incarnation`)
ORCHESTRATOR_QUEUE = "orchestrator"
ORCHESTRATOR_TASK = "corral.run_orchestrator"
# An operator's stop of a run a celery orchestrator drives: a key in the result backend's Redis, which that
# orchestrator watches (app.service.runner); kept a week, for a run still queued when it was asked.
RUN_STOP_TTL_S = 7 * 24 * 3600


# The orchestrator task's lease of a run (workers.orchestrator.run_lease): its key and how long it lasts
# unrenewed
ORCHESTRATOR_LEASE_S = 30.0


def lease_key(run_id: str) -> str:
    return f"corral:orchestrator:{run_id}"


def run_stop_key(run_id: str) -> str:
    return f"corral:stop:{run_id}"


def run_handoff_key(run_id: str) -> str:
    """Set by an orchestrator worker's main process as it shuts down: the run's orchestrator leaves the
    run to another worker (app.service.runner)."""
    return f"corral:handoff:{run_id}"


def orchestrated_run(message: dict[str, Any]) -> str | None:
    """The run id an orchestrator task's message (as kombu's Redis transport keeps it) carries, or None
    for any other message."""
    if message.get("headers", {}).get("task") != ORCHESTRATOR_TASK:
        return None
    body = message.get("body", "")
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    return str(args[0]) if args else None


def runs_in_broker(celery: Celery, client: Redis) -> set[str]:
    """The runs whose orchestrator task the broker's Redis (`client`) holds: queued, or taken by a
    worker and not acked."""
    messages = lost_ops.queue_messages(celery, client, ORCHESTRATOR_QUEUE)
    return {run for run in map(orchestrated_run, messages) if run is not None}


# A revoked op (cancelled, or timed out): a key in the result backend's Redis, which every lane worker
# reads before it runs an op (workers.lane_tasks). Celery's revoke reaches only the workers up when it is
# sent and lives in their memory, while the op's message may be delivered later, to a worker that never
# heard of it: one still queued for a host that was down, or one a worker killed whole left among Redis's
# unacked messages, given out again after the visibility timeout. Kept a week, above that timeout.
CANCELLED_TTL_S = 7 * 24 * 3600


def cancelled_key(op_id: str) -> str:
    return f"corral:cancelled:{op_id}"


def request_run_stop(result_backend: str, run_id: str, actor: str) -> None:
    """Ask the orchestrator worker driving `run_id` (or the next to take it) to stop it. Raises redis's
    errors when the result backend does not answer."""
    from app.lanes.redis_client import COMMAND_TIMEOUT_S, redis_client

    client = redis_client(result_backend, COMMAND_TIMEOUT_S)
    try:
        client.set(run_stop_key(run_id), actor, ex=RUN_STOP_TTL_S)
    finally:
        client.close()


# Above the longest sandbox op we expect (p99 setup 860 s, agent timeouts up to ~2,300 s): on Redis a
# message not acked within this time is delivered again.
VISIBILITY_TIMEOUT_S = 4 * 3600
RESULT_TTL_S = 24 * 3600
# A broker or result backend that stops answering (Redis restarted) is waited out for about a minute:
# a worker whose op ends meanwhile stores its result once it is back, and a client's poll or send waits
# instead of failing the op. Backoff doubles from 10 ms to at most 2 s between tries, with jitter.
OUTAGE_RETRIES = 60
OUTAGE_RETRY_MAX_S = 2.0
DEPTH_RETRY_S = 30.0  # after a broker that could not be reached for queue depths


class _HolderGone(Exception):
    """A cancelled op's worker does not answer: its op is not waited for."""


@dataclass
class _HolderWatch:
    """What `_resend_if_holder_died` keeps of one op between its checks."""

    next_at: float
    holder: str | None = None
    misses: int = 0
    given_up: set[str] = field(default_factory=set)  # workers it was sent again from


def make_celery(broker_url: str, result_backend: str, include: Sequence[str] = ()) -> Celery:
    """A Celery app as Corral's clients and workers both configure it: JSON only, late acks with a
    prefetch of 1, redelivery when a pool process dies, results kept `RESULT_TTL_S`, and about a minute
    of broker or result-backend outage waited out (`OUTAGE_RETRIES`)."""
    app = Celery("corral", broker=broker_url, backend=result_backend, include=list(include))
    app.conf.update(
        task_acks_late=True,
        task_track_started=True,  # clients see when an op leaves its queue
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_expires=RESULT_TTL_S,
        result_extended=True,
        task_default_queue=ORCHESTRATOR_QUEUE,
        task_routes={ORCHESTRATOR_TASK: {"queue": ORCHESTRATOR_QUEUE}},
        broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        result_backend_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
        broker_connection_retry_on_startup=True,
        # Celery's defaults give up on the first refused connection when a worker stores a result (the
        # op's outcome was lost with a Redis restart) and after 0.6 s when a client sends an op.
        result_backend_always_retry=True,
        result_backend_max_retries=OUTAGE_RETRIES,
        result_backend_max_sleep_between_retries_ms=int(OUTAGE_RETRY_MAX_S * 1000),
        task_publish_retry_policy={
            "max_retries": OUTAGE_RETRIES // 2,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": OUTAGE_RETRY_MAX_S,
        },
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def lane_queue(host: str, lane: LaneName) -> str:
    return f"lane.{host}.{lane.value}"


def broker_urls(broker_url: str | None, result_backend: str | None) -> tuple[str, str]:
    """(broker, result backend) as Celery lanes need them; `LaneOpError` names the variable at fault.
    The backend defaults to the broker when it is Redis; results need Redis (the worker reads an op's
    stored result back to stay idempotent, and the orchestrator lease lives there)."""
    if not broker_url:
        raise LaneOpError("CORRAL_BROKER_URL is not set; set it to redis://… or amqp://… to use Celery")
    if not broker_url.startswith(("redis://", "rediss://", "amqp://", "pyamqp://")):
        raise LaneOpError(f"CORRAL_BROKER_URL must be redis:// or amqp://, got {hide_password(broker_url)!r}")
    backend = result_backend
    if backend is None:
        if not broker_url.startswith(("redis://", "rediss://")):
            raise LaneOpError(
                "CORRAL_RESULT_BACKEND is not set; with an amqp:// broker set it to a redis:// URL"
            )
        backend = broker_url
    if not backend.startswith(("redis://", "rediss://")):
        raise LaneOpError(f"CORRAL_RESULT_BACKEND must be redis://, got {hide_password(backend)!r}")
    return broker_url, backend


def _queue(op: LaneOp[Any]) -> str:
    if op.host is None:
        raise LaneOpError(f"op {op.name.value} on sandbox {op.handle.id!r}: handle.host is not set")
    return lane_queue(op.host, op.lane)


def check_lane_host(host: str) -> str:
    """A lane host name as queue names need it; `LaneOpError` names the bad one."""
    if not HOST_NAME.match(host):
        raise LaneOpError(f"host name {host!r}: use letters, digits, '.', '_' or '-' (at most 63)")
    return host


def parse_lane_hosts(text: str) -> tuple[str, ...]:
    """`CORRAL_LANE_HOSTS` as the deployment spells it: host names, comma-separated."""
    hosts = tuple(check_lane_host(part.strip()) for part in text.split(","))
    if len(set(hosts)) != len(hosts):
        raise LaneOpError(f"lane hosts {text!r}: a host is named twice")
    return hosts


@dataclass(frozen=True)
class OpRecord:
    """Where and when one op ran, as its worker reported it (wall-clock seconds)."""

    op: LaneOp[Any]
    host: str
    pid: int
    affinity: tuple[int, ...]
    sent_at: float
    started_at: float
    ended_at: float
    replayed: bool


class LaneStartTimeout(TimeoutError):
    """No worker started the op within `start_timeout_s`."""


class LaneOpTimeout(TimeoutError):
    """The op did not finish within `op_timeout_s`."""


class CeleryLanes:
    def __init__(
        self,
        celery: Celery,
        hosts: Sequence[str],
        *,
        poll_min_s: float = 0.005,
        poll_max_s: float = 0.2,
        cancel_grace_s: float = 60.0,
        start_timeout_s: float | None = None,
        op_timeout_s: float | None = None,
        depth_ttl_s: float = 1.0,
        on_done: Callable[[OpRecord], None] | None = None,
    ) -> None:
        if not hosts:
            raise LaneOpError("hosts: CeleryLanes needs at least one lane host")
        if len(set(hosts)) != len(hosts):
            raise LaneOpError(f"hosts: duplicates in {list(hosts)}")
        for host in hosts:
            check_lane_host(host)
        self.celery = celery
        self.hosts = tuple(hosts)
        self._poll = (poll_min_s, poll_max_s)
        self._cancel_grace_s = cancel_grace_s
        self._start_timeout_s = start_timeout_s
        self._op_timeout_s = op_timeout_s
        self._depth_ttl_s = depth_ttl_s
        self._depth_at: float | None = None  # when the broker is next asked for queue depths
        self._depth_failed = False
        self._placed: dict[str, str] = {}  # sandbox id -> host, until its cleanup op has run
        self._stats = {lane: LaneStats() for lane in LaneName}
        self._on_done = on_done
        self._epoch = lost_ops.BrokerEpoch(celery)
        self._live = lost_ops.LiveWorkers(celery)

    @classmethod
    def connect(
        cls, broker_url: str, result_backend: str, hosts: Sequence[str], **options: Any
    ) -> CeleryLanes:
        """Lanes on the workers behind `broker_url`, placing sandboxes on `hosts`."""
        return cls(make_celery(broker_url, result_backend), hosts, **options)

    def close(self) -> None:
        self._epoch.close()
        self.celery.close()

    # -- the Lanes port ---------------------------------------------------------------------------

    async def run(self, lane: LaneName, op: Callable[[LaneSlot], Awaitable[T]]) -> T:
        raise LaneOpError(f"{lane.value}: a closure cannot cross to a Celery worker; send a LaneOp (run_op)")

    def attach(self, sandbox: Sandbox) -> SandboxHandle:
        handle = handle_of(sandbox)
        host = self._placed.get(handle.id)
        if host is None:
            load = {h: 0 for h in self.hosts}
            for placed in self._placed.values():
                load[placed] += 1
            host = min(self.hosts, key=lambda h: load[h])
            self._placed[handle.id] = host
        return handle.on(host)

    def begin_incarnation(self, root: Path | None = None, run: str | None = None) -> int:
        """Start an incarnation of a run (its first start, or a resume) whose sandboxes live in `root`
        (local sandboxes) or are docker containers labelled with run id `run`: draw its number, the
        result backend's Redis clock in ms (one clock for every host, so a later incarnation's number is
        larger wherever it runs), and send each lane host a sweep of `root` or of `run`'s containers
        through its cleanup lane. The host's cleanup worker removes the sandboxes there of every older
        incarnation (what a killed one left) and refuses their ops from then on (workers.sandboxes). Not
        waited for: a sweep touches no sandbox of this incarnation, whose ids end with
        `incarnation_suffix(n)`, and a host that is down sweeps when it is back."""
        if (root is None) == (run is None):
            raise LaneOpError(
                "begin_incarnation: name the run's sandbox directory or its run id, one of them"
            )
        try:
            seconds, micros = self.celery.backend.client.time()
        except lost_ops.BROKER_ERRORS as exc:  # never a reason not to run: this host's clock then
            log.warning("the result backend did not answer for the time (%s): this host's clock is used", exc)
            seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
        incarnation = int(seconds) * 1000 + int(micros) // 1000
        sweep: dict[str, object] = {"root": str(root)} if run is None else {"run": run}
        sweep["incarnation"] = incarnation
        for host in self.hosts:
            try:
                self.celery.send_task(LANE_SWEEP_TASK, args=[sweep], queue=lane_queue(host, LaneName.CLEANUP))
            except lost_ops.BROKER_ERRORS as exc:  # its next start sweeps it
                log.warning("%s on %s not swept: the broker did not answer (%s)", root or run, host, exc)
        return incarnation

    def forget(self, handle: SandboxHandle) -> bool:
        """Never: an op sent to a worker may run there however it ends here, so cleanup always runs."""
        return False

    async def run_op(self, op: LaneOp[T], on_start: Callable[[], None] | None = None, group: int = 0) -> T:
        # A lane's queue here is the broker's, first in first out: `group` does not reorder it (lanes
        # ordered `oldest_group` apply only in process). `on_start` fires once a poll sees the worker's
        # STARTED mark (or the result, for an op done between two polls): the op's wait in its lane's
        # queue ends then, to within one poll.
        _queue(op)  # refuses an op whose handle has no host, before anything is counted
        stats = self._stats[op.lane]
        started = False

        def mark_started() -> None:
            nonlocal started
            if not started:
                started = True
                stats.busy += 1
                stats.max_busy = max(stats.max_busy, stats.busy)
                if on_start is not None:
                    on_start()

        sent_at = time.time()
        try:
            result, epoch = await asyncio.to_thread(self._send, op)
            envelope = await self._wait(result, op, mark_started, epoch)
        finally:
            if started:
                stats.busy -= 1
            if op.name is LaneName.CLEANUP:
                self._placed.pop(op.handle.id, None)
        waited = max(0.0, float(envelope["started_at"]) - sent_at)
        stats.completed += 1
        stats.wait_s_total += waited
        stats.wait_s_max = max(stats.wait_s_max, waited)
        if self._on_done is not None:
            self._on_done(
                OpRecord(
                    op=op,
                    host=str(envelope["host"]),
                    pid=int(envelope["pid"]),
                    affinity=tuple(envelope["affinity"]),
                    sent_at=sent_at,
                    started_at=float(envelope["started_at"]),
                    ended_at=float(envelope["ended_at"]),
                    replayed=bool(envelope["replayed"]),
                )
            )
        return decode_result(op, envelope["result"])

    def stats(self) -> dict[str, LaneStats]:
        now = time.monotonic()
        if self._depth_at is None or now >= self._depth_at:
            self._depth_at = now + self._depth_ttl_s
            try:
                depths = self._queue_depths()
            except OperationalError as exc:  # kombu's: the broker cannot be reached (a Redis restart)
                self._depth_at = time.monotonic() + DEPTH_RETRY_S
                if not self._depth_failed:
                    log.warning(
                        "lane queue depths: the broker cannot be reached (%s); the last counts stand", exc
                    )
                self._depth_failed = True
            else:
                self._depth_failed = False
                for lane, depth in depths.items():
                    stats = self._stats[lane]
                    stats.queue_depth = depth
                    stats.max_queue_depth = max(stats.max_queue_depth, depth)
        return {lane.value: s for lane, s in self._stats.items()}

    # -- internals ----------------------------------------------------------------------------------

    def _send(self, op: LaneOp[Any]) -> tuple[AsyncResult, str | None]:
        """Publish the op (its id is the task id); with the Redis broker's run_id it went to, or
        `lost_ops.UNKNOWN` when the broker was restarted around the send (app.lanes.lost_ops)."""
        before = self._epoch.now()
        result = self.celery.send_task(LANE_OP_TASK, args=[op.to_dict()], queue=_queue(op), task_id=op.op_id)
        after = self._epoch.now()
        return result, (after if before == after else lost_ops.UNKNOWN)

    def _revoke(self, op: LaneOp[Any]) -> None:
        """Revoke the op, recorded first where a worker that takes it later looks (`cancelled_key`).
        Neither step raises: a Redis that does not answer leaves the op's fate to its worker, and says so,
        rather than turning a cancellation (a run stopping) into a failure."""
        try:
            self.celery.backend.client.set(cancelled_key(op.op_id), op.name.value, ex=CANCELLED_TTL_S)
        except lost_ops.BROKER_ERRORS as exc:
            log.warning(
                "op %s (%s): could not record its cancellation, the result backend did not answer (%s); "
                "a worker that takes it later may still run it",
                op.op_id,
                op.name.value,
                exc,
            )
        try:
            self.celery.control.revoke(op.op_id)
        except lost_ops.BROKER_ERRORS as exc:
            log.warning(
                "op %s (%s): could not revoke it, the broker did not answer (%s)",
                op.op_id,
                op.name.value,
                exc,
            )

    async def _resend_if_lost(self, op: LaneOp[Any], result: AsyncResult, epoch: str) -> str | None:
        """The op's epoch after a check: sent again (same id) if the broker lost it in a restart."""
        latest = await asyncio.to_thread(self._epoch.latest)
        if latest is None or latest == epoch:
            return epoch
        try:
            client = self._epoch.client
            assert client is not None  # an epoch was read: the broker is one Redis
            holder = await asyncio.to_thread(lost_ops.held, self.celery, client, op.op_id, _queue(op))
        except lost_ops.BROKER_ERRORS as exc:  # the broker is away again: ask at the next check
            log.warning("op %s: could not look for it after a broker restart (%s)", op.op_id, exc)
            return epoch
        if holder is None:
            return epoch  # no worker of its queue answered: ask again at the next check
        if holder or await asyncio.to_thread(lambda: result.state) != states.PENDING:
            return latest  # still queued or held, or it has started or ended meanwhile
        log.warning(
            "op %s (%s) was lost with the broker's restart (it came back empty); sent again",
            op.op_id,
            op.name.value,
        )
        self._stats[op.lane].resent += 1
        _, sent_under = await asyncio.to_thread(self._send, op)
        return sent_under

    async def _resend_if_holder_died(self, op: LaneOp[Any], result: AsyncResult, watch: _HolderWatch) -> None:
        """One check of a started op's worker: sent again (same id) once the worker has missed
        `HOLDER_MISSES` pings in a row that others answered and no worker of its queue holds the op."""
        try:
            holder = await asyncio.to_thread(lost_ops.holder_of, result)
            if holder is None or holder in watch.given_up:
                return  # no mark to go by, or sent again already from this one: its new start is awaited
            if holder != watch.holder:
                watch.holder, watch.misses = holder, 0
            dead = await asyncio.to_thread(self._live.dead, holder)
            if dead is None:
                return  # no worker answered: the broker, not this worker, is in doubt
            watch.misses = watch.misses + 1 if dead else 0
            if watch.misses < lost_ops.HOLDER_MISSES:
                return
            if (
                await asyncio.to_thread(lost_ops.held_by_a_worker, self.celery, op.op_id, _queue(op))
                is not False
            ):
                return  # a live worker holds it, or none of its queue answered: ask again later
            if await asyncio.to_thread(lambda: result.state) != states.STARTED:
                return  # it ended meanwhile
            log.warning(
                "op %s (%s): its worker %s stopped answering (killed?) with it started; sent again",
                op.op_id,
                op.name.value,
                holder,
            )
            if self._epoch.client is not None:
                client = self._epoch.client
                await asyncio.to_thread(lost_ops.drop_unacked, self.celery, client, op.op_id, _queue(op))
            watch.given_up.add(holder)
            self._stats[op.lane].resent += 1
            await asyncio.to_thread(self._send, op)
        except lost_ops.BROKER_ERRORS as exc:  # the broker is away: ask at the next check
            log.warning("op %s: could not check its worker (%s)", op.op_id, exc)

    async def _resend_if_taker_died(self, op: LaneOp[Any], result: AsyncResult, watch: _HolderWatch) -> None:
        """One check of an op not started: sent again (same id) once its message has sat among the
        broker's unacked ones, held by no live worker of its queue, for `HOLDER_MISSES` checks in a row.
        A worker killed whole (`kill -9` of its process group) after it took the op and before it marked
        it STARTED left it there, and the broker delivers it again only after its visibility timeout: the
        attempt waited `start_timeout_s` (900 s) and failed with a live worker on its queue."""
        client = self._epoch.client
        if client is None:
            return  # not a Redis broker: nothing to look in
        queue = _queue(op)
        try:
            if not await asyncio.to_thread(lost_ops.delivered_only, self.celery, client, op.op_id, queue):
                watch.misses = 0  # queued, or not taken yet
                return
            if await asyncio.to_thread(lost_ops.held_by_a_worker, self.celery, op.op_id, queue) is not False:
                watch.misses = 0  # a live worker has it reserved, or none of its queue answered
                return
            watch.misses += 1
            if watch.misses < lost_ops.HOLDER_MISSES:
                return
            if await asyncio.to_thread(lambda: result.state) != states.PENDING:
                return  # it started or ended meanwhile
            log.warning(
                "op %s (%s): the worker that took it stopped before starting it (killed?); sent again",
                op.op_id,
                op.name.value,
            )
            await asyncio.to_thread(lost_ops.drop_unacked, self.celery, client, op.op_id, queue)
            watch.misses = 0
            self._stats[op.lane].resent += 1
            await asyncio.to_thread(self._send, op)
        except lost_ops.BROKER_ERRORS as exc:  # the broker is away: ask at the next check
            log.warning("op %s: could not look for its worker (%s)", op.op_id, exc)

    async def _holder_gone(self, result: AsyncResult) -> bool:
        """Whether a started op's worker does not answer while others do: cancelled, its op would be
        waited for `cancel_grace_s` for nothing."""
        try:
            holder = await asyncio.to_thread(lost_ops.holder_of, result)
            return holder is not None and await asyncio.to_thread(self._live.dead, holder) is True
        except lost_ops.BROKER_ERRORS:
            return False

    def _queue_depths(self) -> dict[LaneName, int]:
        """Messages waiting in each lane's queues over all hosts, as the broker counts them (0 for a queue
        never declared), over one connection."""
        depths = dict.fromkeys(self._stats, 0)
        with self.celery.connection_for_read() as conn:
            conn.ensure_connection(max_retries=0)  # one try: a caller waits for no reconnection loop
            channel = conn.channel()
            try:
                for lane, host in itertools.product(depths, self.hosts):
                    try:
                        ok = channel.queue_declare(queue=lane_queue(host, lane), passive=True)
                    except conn.channel_errors:
                        # AMQP closes the channel on a passive declare of a missing queue: take another
                        with contextlib.suppress(Exception):
                            channel.close()
                        channel = conn.channel()
                        continue
                    depths[lane] += int(ok.message_count)
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
        return depths

    async def _settled(
        self,
        result: AsyncResult,
        deadline: float | None = None,
        on_started: Callable[[], None] | None = None,
        start_deadline: float | None = None,
        on_waiting: Callable[[str], Awaitable[None]] | None = None,
    ) -> bool:
        """Poll until the op is done (True) or `deadline` passes (False); raise `LaneStartTimeout` if it
        is still waiting in its queue at `start_deadline`. `on_waiting(state)` runs while it is pending
        or started."""
        delay, most = self._poll
        loop = asyncio.get_running_loop()
        while True:
            state = await asyncio.to_thread(lambda: result.state)
            if state != states.PENDING and on_started is not None:
                on_started()
            if state in states.READY_STATES:
                return True
            now = loop.time()
            if deadline is not None and now >= deadline:
                return False
            if state == states.PENDING and start_deadline is not None and now >= start_deadline:
                raise LaneStartTimeout(f"no worker started op {result.id} in {self._start_timeout_s} s")
            if on_waiting is not None:
                await on_waiting(state)
            await asyncio.sleep(delay)
            delay = min(delay * 2, most)

    async def _wait(
        self, result: AsyncResult, op: LaneOp[Any], on_started: Callable[[], None], epoch: str | None
    ) -> dict[str, Any]:
        now = asyncio.get_running_loop().time()
        start_deadline = None if self._start_timeout_s is None else now + self._start_timeout_s
        deadline = None if self._op_timeout_s is None else now + self._op_timeout_s

        next_look = now + lost_ops.EPOCH_CHECK_S
        watch = _HolderWatch(next_at=now + lost_ops.HOLDER_CHECK_S)

        async def look_for_it(state: str) -> None:
            nonlocal epoch, next_look
            loop_now = asyncio.get_running_loop().time()
            if state == states.PENDING:  # lost in a broker restart?
                if epoch is not None and loop_now >= next_look:
                    epoch = await self._resend_if_lost(op, result, epoch)
                    next_look = asyncio.get_running_loop().time() + lost_ops.EPOCH_CHECK_S
                if loop_now >= watch.next_at:  # taken by a worker killed before it started the op?
                    await self._resend_if_taker_died(op, result, watch)
                    watch.next_at = asyncio.get_running_loop().time() + lost_ops.HOLDER_CHECK_S
            elif state == states.STARTED and loop_now >= watch.next_at:  # its worker killed?
                await self._resend_if_holder_died(op, result, watch)
                watch.next_at = asyncio.get_running_loop().time() + lost_ops.HOLDER_CHECK_S

        try:
            if not await self._settled(result, deadline, on_started, start_deadline, look_for_it):
                await asyncio.to_thread(self._revoke, op)
                raise LaneOpTimeout(f"op {op.op_id} ({op.name.value}) not done in {self._op_timeout_s} s")
        except LaneStartTimeout:
            await asyncio.to_thread(self._revoke, op)
            raise
        except asyncio.CancelledError:
            await asyncio.to_thread(self._revoke, op)
            deadline = asyncio.get_running_loop().time() + self._cancel_grace_s
            next_check = asyncio.get_running_loop().time()

            async def unless_gone(state: str) -> None:  # a dead worker's op never settles: not waited for
                nonlocal next_check
                if state == states.STARTED and asyncio.get_running_loop().time() >= next_check:
                    next_check = asyncio.get_running_loop().time() + lost_ops.HOLDER_CHECK_S
                    if await self._holder_gone(result):
                        raise _HolderGone

            try:
                # bounded here too: a poll of a result backend that went away blocks in its retries
                settled = await asyncio.wait_for(
                    self._settled(result, deadline, on_waiting=unless_gone), self._cancel_grace_s
                )
            except _HolderGone:
                settled = True
            except (TimeoutError, BackendGetMetaError, *lost_ops.BROKER_ERRORS):
                settled = False
            if not settled:
                log.warning(
                    "op %s (%s) not seen to end in the %.0f s after its cancellation",
                    op.op_id,
                    op.name.value,
                    self._cancel_grace_s,
                )
            raise
        envelope = await asyncio.to_thread(result.get, propagate=True, disable_sync_subtasks=False)
        if not isinstance(envelope, dict) or "result" not in envelope:
            raise LaneOpError(f"op {op.op_id}: the worker answered {envelope!r}, not a lane op result")
        return envelope
