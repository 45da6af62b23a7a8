"""Ops a Redis broker lost in a restart: found and sent again, never run twice at once.

A Redis that keeps nothing on disk comes back empty from a restart: the ops still waiting in its queues
are gone (and so are the messages a worker had taken but not acked), while a client polling one of them
would see it pending for ever. Redis's `run_id` (INFO server) is new at every start, so:
- `BrokerEpoch` reads it, at most once per `EPOCH_CHECK_S` for all of a client's ops, and before and
  after each send; an op whose send did not see one run_id throughout is marked unknown;
- an op still pending under another run_id than its own (or an unknown one) is looked for, in this
  order: in its queue (every priority list), in the broker's unacked messages, then with the workers
  that consume its queue (`inspect().query_task`: the ops they have reserved or are running); its result
  is read once more last;
- it is sent again (same id) only when a worker of its queue answered and none of these holds it. With
  no worker of its queue answering (not yet reconnected, or its host down), nothing is decided and it is
  looked for again at the next check: a worker still running it could not say so.

Only the order of the checks guards against a race: a message moves from the queue to a worker, never
back while the worker lives, so an op found in neither place after both were read in that order is not
held. If it was sent twice anyway (a worker that took it and died unseen), the worker's own check of a
stored result (workers.lane_tasks) keeps the second delivery from running it again once the first is
done. On a broker that keeps its queues (RabbitMQ: durable), nothing is checked.

Ops a dead worker held. A worker killed whole (`kill -9` of its process group, its host lost) leaves
the op it had started in the broker's unacked messages, redelivered only after the visibility timeout
(4 h): its attempt waited that long, and a stop waited on it until the server gave up, the run left
`stopping`. So the workers are pinged at most every `HOLDER_CHECK_S`, once for all of a client's ops
(`LiveWorkers`), and each op marked STARTED is checked against its worker (the mark's `hostname`):
after `HOLDER_MISSES` checks in a row without its answer while other workers answer, it is sent again
(same id) when a worker of its queue answered and none of them holds it (`held_by_a_worker`); its
stale message is dropped from the unacked ones (`drop_unacked`). A cancelled op whose worker does not
answer is not waited for; its message, left among the unacked ones, is refused by the worker it reaches
later (app.lanes.celery.cancelled_key).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit

from celery import Celery
from kombu.exceptions import KombuError
from redis import Redis
from redis.exceptions import RedisError

from app.lanes.redis_client import COMMAND_TIMEOUT_S, redis_client

log = logging.getLogger(__name__)
T = TypeVar("T")

EPOCH_CHECK_S = 2.0
HOLDER_CHECK_S = 10.0
HOLDER_MISSES = 3  # checks in a row without the holder's answer (about 30 s) before it is taken for dead
INSPECT_TIMEOUT_S = 1.0
# What a broker that is away (or restarting) raises: kombu's errors (its connections), redis-py's, the
# OS's (sockets).
BROKER_ERRORS = (KombuError, RedisError, OSError)
UNKNOWN = ""  # an op's epoch when its send did not see one run_id throughout


class Throttled(Generic[T]):
    """`read()` done at most once per `period()` seconds for every caller: within it, callers get the
    value last read (a caller that starts a read returns its own answer; one that comes meanwhile, the
    one before, or waits for the first read to end when there is none before: "nothing read yet" is not
    an answer). One read then serves every op waiting, whatever their number."""

    def __init__(self, read: Callable[[], T | None], period: Callable[[], float]) -> None:
        self._read = read
        self._period = period
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._value: T | None = None
        self._first_read = threading.Event()

    def latest(self) -> T | None:
        with self._lock:
            fresh = self._read_at is not None and time.monotonic() - self._read_at < self._period()
            if not fresh:
                self._read_at = time.monotonic()
        if fresh:
            self._first_read.wait()  # at once, unless the first read is still under way
            return self._value
        try:
            value = self._read()
            with self._lock:
                self._value = value
        finally:
            self._first_read.set()
        return value


class BrokerEpoch:
    """The Redis broker's run_id: new at every start of the server, so a change means it was restarted.

    It is read with a redis-py client of its own (thread-safe, pooled: 0.3 ms a read here), not through
    kombu's channel, whose client serves kombu's own asynchronous reads: a command sent on it after a
    restart read another command's answer."""

    def __init__(self, celery: Celery, check_s: float = EPOCH_CHECK_S) -> None:
        self.check_s = check_s
        self._latest = Throttled(self.now, lambda: self.check_s)
        url = celery.conf.broker_url
        scheme = urlsplit(url).scheme if isinstance(url, str) else ""
        self.client: Redis | None = None
        if scheme in ("redis", "rediss"):  # not sentinel:// (no one server), not amqp:// (durable queues)
            self.client = redis_client(url, COMMAND_TIMEOUT_S)

    def now(self) -> str | None:
        """The run_id read now, or None where the broker cannot be reached (or is not one Redis)."""
        if self.client is None:
            return None
        try:
            return str(self.client.info("server")["run_id"])
        except BROKER_ERRORS:  # the broker is away (restarting): no answer is no change yet
            return None

    def latest(self) -> str | None:
        """The run_id as read at most `check_s` ago: one read serves every op waiting."""
        return self._latest.latest()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


@dataclass(frozen=True)
class _RedisNames:
    """The keys kombu's Redis transport keeps a queue's messages and the unacked ones under."""

    lists: frozenset[str]  # the queue's list per priority step
    unacked: str  # hash: delivery tag -> message
    unacked_index: str  # sorted set of the same tags


def _redis_names(celery: Celery, queue: str) -> _RedisNames:
    with celery.connection_for_write() as conn:
        conn.ensure_connection(max_retries=0)
        channel: Any = conn.default_channel
        steps = getattr(channel, "priority_steps", [0])
        lists = {channel._q_for_pri(queue, p) for p in steps} if hasattr(channel, "_q_for_pri") else {queue}
        return _RedisNames(
            frozenset(lists),
            getattr(channel, "unacked_key", "unacked"),
            getattr(channel, "unacked_index_key", "unacked_index"),
        )


def _in_broker(celery: Celery, client: Redis, op_id: str, queue: str) -> str | None:
    """Where the broker's Redis (`client`) holds the op's message: "queued" in `queue`, "unacked"
    (delivered to a consumer that has not acked it), or None."""
    names = _redis_names(celery, queue)
    needle = op_id.encode()
    if any(needle in raw for name in sorted(names.lists) for raw in client.lrange(name, 0, -1)):
        return "queued"
    if any(needle in raw for raw in client.hvals(names.unacked)):
        return "unacked"
    return None


def queue_messages(celery: Celery, client: Redis, queue: str) -> list[dict[str, Any]]:
    """The messages of `queue` that the broker's Redis (`client`) holds: queued (read first: a message
    moves from there to the unacked ones), then delivered to a consumer that has not acked them."""
    names = _redis_names(celery, queue)
    found = [json.loads(raw) for name in sorted(names.lists) for raw in client.lrange(name, 0, -1)]
    for raw in client.hvals(names.unacked):
        message, _, routing_key = json.loads(raw)
        if routing_key == queue:
            found.append(message)
    return found


def held(celery: Celery, client: Redis, op_id: str, queue: str) -> bool | None:
    """Whether the broker or a worker of `queue` holds the op (True), neither does (False), or no worker
    of `queue` answered (None: undecided). `client`: the broker's Redis."""
    if _in_broker(celery, client, op_id, queue) is not None:
        return True
    return held_by_a_worker(celery, op_id, queue)


def delivered_only(celery: Celery, client: Redis, op_id: str, queue: str) -> bool:
    """Whether the op's message left its queue for a consumer (it is among the broker's unacked ones)
    and is not queued again: with no live worker holding it, its consumer died before it marked the op
    STARTED, and the broker gives it back only after its visibility timeout. `client`: the broker's."""
    return _in_broker(celery, client, op_id, queue) == "unacked"


def holder_of(result: Any) -> str | None:
    """The worker that marked the op STARTED (Celery's STARTED meta: its node name), or None."""
    info = result.info
    hostname = info.get("hostname") if isinstance(info, dict) else None
    return hostname if isinstance(hostname, str) else None


class LiveWorkers:
    """The workers that answer, with the queues each consumes, asked at most once per `check_s` (default
    `HOLDER_CHECK_S`) for all callers: a client's ops, or `/healthz` (an ask waits `INSPECT_TIMEOUT_S`
    for the answers: one per op, or per request, would fill the threads it runs in). One broadcast
    (`active_queues`) is both the ping and the list of queues."""

    def __init__(self, celery: Celery, check_s: float | None = None) -> None:
        self.celery = celery
        period = (lambda: HOLDER_CHECK_S) if check_s is None else (lambda: check_s)  # looked up at each read
        self._latest = Throttled(self._ping, period)

    def _ping(self) -> dict[str, frozenset[str]] | None:
        """Each worker that answers now, with the names of the queues it consumes; None where none does."""
        answers = self.celery.control.inspect(timeout=INSPECT_TIMEOUT_S).active_queues() or {}
        live = {w: frozenset(str(q.get("name")) for q in queues or ()) for w, queues in answers.items()}
        return live or None

    def dead(self, worker: str) -> bool | None:
        """Whether `worker` did not answer a ping that other workers answered (True), answered (False),
        or no worker answered at all (None: the broker or the network, not the worker, is in doubt)."""
        live = self._latest.latest()
        return None if live is None else worker not in live

    def consumers(self, queues: Sequence[str]) -> dict[str, int]:
        """How many live workers consume each of `queues` (0 for each where no worker answered)."""
        live = self._latest.latest() or {}
        return {queue: sum(queue in consumed for consumed in live.values()) for queue in queues}


def held_by_a_worker(celery: Celery, op_id: str, queue: str) -> bool | None:
    """Whether a live worker of `queue` has the op reserved or running (True), none of them has (False),
    or none answered (None)."""
    consumers = celery.control.inspect(timeout=INSPECT_TIMEOUT_S).active_queues() or {}
    workers = [w for w, queues in consumers.items() if any(q.get("name") == queue for q in queues)]
    if not workers:
        return None
    found = celery.control.inspect(destination=workers, timeout=INSPECT_TIMEOUT_S).query_task(op_id) or {}
    if any(op_id in tasks for tasks in found.values()):
        return True
    if not set(workers) <= set(found):
        return None  # a worker that saw the queue did not answer now: it may hold the op
    return False


def drop_unacked(celery: Celery, client: Redis, op_id: str, queue: str) -> int:
    """Remove the op's messages from the broker's unacked ones (a dead worker's, about to be sent again):
    left there, the broker would deliver it again after its visibility timeout. Returns how many."""
    names = _redis_names(celery, queue)
    needle = op_id.encode()
    tags = [tag for tag, raw in client.hgetall(names.unacked).items() if needle in raw]
    for tag in tags:
        client.hdel(names.unacked, tag)
        client.zrem(names.unacked_index, tag)
    return len(tags)
