"""The trainer gateway: a run's side of the trainer API, and `ExternalTrainer`, the Trainer port that
waits on it.

The runtime's trainer step offers the delivered batch here; a trainer (in another process, through the
API, or the built-in sentinel client in this one) takes it with `next_batch`, acknowledges it with `ack`
and publishes the next policy version. The step ends once its batch is acked and a version at least as
new as the one it trains towards is published.

Invariants:
- delivery is at least once: a batch handed out and not acked within `ack_timeout_s` is handed out
  again (same batch id); a batch is never handed to two trainers within one lease, which its holder
  may renew (`renew`) or end (`release`), and nobody else;
- acking is idempotent: a second ack of the same batch reports `already_acked`;
- a trainer is told a run's end (`RunClosedError`, the API's 409 "has ended (<state>)") in the state the
  run ends in: a run whose trainer loop completed tells it once its drain is over (`trainer_loop_over`,
  then `close`), as that drain may fail it;
- memory does not grow with the run's length: an acked batch whose version is published is forgotten
  once `KEEP_ACKED` newer batches have been acked (a repeated ack of it is answered from the store,
  which has had the ack since: the store writer writes in order); the wait per step is kept as a sum
  and a count, not a list;
- the gateway is thread-safe: the run's loop and the API's loop both call it; waiters on either loop are
  woken with `call_soon_threadsafe`. Leases are real seconds (`time.monotonic`); `next_batch` is
  called on the API's loop, whose clock is real, whatever clock the run itself runs on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.outputs import until_written, write_text_atomically
from app.runtime.ports import TrainingBatch

log = logging.getLogger(__name__)

# Acked batches kept in memory after their version is published, newest first; older ones are forgotten.
KEEP_ACKED = 16


class UnknownBatchError(KeyError):
    """No batch with that id was ever offered in this run."""


class AlreadyAckedError(RuntimeError):
    """An acked batch was released or its lease renewed: it was trained on, so it is not handed out
    again and holds no lease."""


class NotTakenError(RuntimeError):
    """A batch offered but never handed out was acked: no trainer has seen it, so the ack is refused
    (taking it as given would mark a batch trained on that nobody trained on)."""


@dataclass
class Offer:
    batch_id: str
    index: int
    payload: dict[str, Any]
    offered_at: float
    leased_until: float | None = None
    deliveries: int = 0
    acked: bool = False
    acked_by: str | None = None
    taken_at: float | None = None  # first handed out (this gateway's clock)
    acked_at: float | None = None


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]


@dataclass
class GatewayStats:
    offered: int = 0
    redelivered: int = 0
    acked: int = 0
    trainer_idle_s: float = 0.0  # time trainers spent in next_batch with nothing to take
    collection_s_total: float = 0.0  # the waits for batches handed out the first time: their sum
    collections: int = 0  # and their count

    @property
    def collection_s_mean(self) -> float | None:
        return self.collection_s_total / self.collections if self.collections else None


class TrainerGateway:
    def __init__(
        self,
        run_id: str,
        ack_timeout_s: float,
        published_version: Callable[[], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id = run_id
        self.ack_timeout_s = ack_timeout_s
        self._published_version = published_version
        self._clock = clock
        self._lock = threading.Lock()
        self._offers: dict[str, Offer] = {}
        self._waiters: list[_Waiter] = []
        self._restored: list[Offer] = []  # handed out before a restart and not acked then
        self._closed: str | None = None
        self._loop_over = False  # the run's trainer loop is over: it drains its work (`trainer_loop_over`)
        self.stats = GatewayStats()
        self.on_offer: Callable[[Offer], None] | None = None
        self.on_redeliver: Callable[[Offer], None] | None = None  # a batch handed out again
        self.on_take: Callable[[Offer], None] | None = None  # a batch handed out, first time or again
        self.on_ack: Callable[[Offer], None] | None = None
        self.batch_offset = 0  # a resumed run numbers its batches and groups after the earlier ones
        self.group_offset = 0

    # -- the runtime's side ------------------------------------------------------------------------

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        """The Trainer port: offer `batch`, then wait for its ack and for `version` to be published. An
        offer whose kept file the disk refuses (`on_offer` raises `OSError`: full, read-only) waits for
        the disk, the run collecting on meanwhile; a run stopped before the disk takes it ends without
        handing the batch out (it was never on disk, so no restart could offer it either)."""
        payload = batch_payload(self.run_id, batch, version, self.batch_offset, self.group_offset)

        async def offered() -> Offer:
            return self.offer(payload)

        what = f"run {self.run_id}: batch {payload['batch_id']}, kept before a trainer may take it"
        offer = await until_written(offered, what, lambda: self._closed is not None, self.wait_changed)
        if offer is None:
            return None
        while not (offer.acked and self._published_version() >= version) and self._closed is None:
            await self.wait_changed(None)
        return None  # the trainer published through the run's `publish`; nothing left to publish

    def offer(self, payload: dict[str, Any]) -> Offer:
        offer = Offer(payload["batch_id"], int(payload["index"]), payload, self._clock())
        with self._lock:
            if offer.batch_id in self._offers:
                return self._offers[offer.batch_id]
        if self.on_offer is not None:  # before a trainer can take it: it keeps the batch on disk
            self.on_offer(offer)
        with self._lock:
            self._offers[offer.batch_id] = offer
            self.stats.offered += 1
            self._forget_acked()
        self.notify()
        return offer

    def restore(self, offer: Offer) -> None:
        """Re-offer a batch that a previous incarnation of the run handed out and never saw acked."""
        with self._lock:
            if offer.batch_id not in self._offers:
                self._offers[offer.batch_id] = offer
                self._restored.append(offer)
        self.notify()

    def _forget_acked(self) -> None:
        """Under the lock: drop the acked batches older than the newest `KEEP_ACKED` acked ones whose
        version is published (the run's `step` for them is over; `holding` no longer looks at them)."""
        acked = [offer for offer in self._offers.values() if offer.acked]
        if len(acked) <= KEEP_ACKED:
            return
        published = self._published_version()
        for offer in acked[:-KEEP_ACKED]:
            if published >= int(offer.payload.get("publish_version", 0)):
                del self._offers[offer.batch_id]

    async def restored_steps(self) -> None:
        """A resumed run's trainer steps on its restored batches: wait until each is acked and the
        version it trains towards is published, as the step that offered it did before the restart.
        Without it the resumed run asked for its next batch at once and offered it beside the restored
        one, towards the same version (a trainer publishing that version twice was refused)."""
        with self._lock:
            restored = list(self._restored)
        target = max((int(o.payload["publish_version"]) for o in restored), default=0)
        while self._closed is None and not (
            all(o.acked for o in restored) and self._published_version() >= target
        ):
            await self.wait_changed(None)

    # -- the trainer's side ------------------------------------------------------------------------

    async def next_batch(self, timeout_s: float, *, to_loop_end: bool = False) -> Offer | None:
        """The oldest batch not acked and not leased to someone else, waiting up to `timeout_s`.
        `RunClosedError` once the run has ended with nothing left to hand out; `to_loop_end` (the run's
        built-in trainer): once its trainer loop is over, the run's end not waited for."""
        asked = self._clock()
        deadline = asked + timeout_s
        while True:
            now = self._clock()
            with self._lock:
                taken, next_expiry = self._take(now)
                if taken is None and self._closed is not None and next_expiry is None:
                    if self._closed == DELETED:
                        raise RunDeletedError(DELETED)
                    raise RunClosedError(self._closed)  # nothing left to hand out, ever
                if taken is None and to_loop_end and self._loop_over and next_expiry is None:
                    raise RunClosedError("its trainer loop is over")
            if taken is not None:
                if self.on_take is not None:
                    self.on_take(taken)
                self.stats.trainer_idle_s += now - asked
                if taken.deliveries == 1:
                    self.stats.collection_s_total += now - asked
                    self.stats.collections += 1
                elif self.on_redeliver is not None:
                    self.on_redeliver(taken)
                return taken
            if now >= deadline:
                self.stats.trainer_idle_s += now - asked
                return None
            wake = deadline if next_expiry is None else min(deadline, next_expiry)
            await self.wait_changed(max(0.0, wake - now))

    def _take(self, now: float) -> tuple[Offer | None, float | None]:
        next_expiry: float | None = None
        for offer in self._offers.values():
            if offer.acked:
                continue
            if offer.leased_until is not None and offer.leased_until > now:
                next_expiry = (
                    offer.leased_until if next_expiry is None else min(next_expiry, offer.leased_until)
                )
                continue
            if offer.deliveries:
                self.stats.redelivered += 1
            else:
                offer.taken_at = now
            offer.deliveries += 1
            offer.leased_until = now + self.ack_timeout_s
            return offer, None
        return None, next_expiry

    def ack(self, batch_id: str, actor: str = "trainer") -> tuple[Offer, bool]:
        """Acknowledge a batch; returns it and whether it had been acked already."""
        with self._lock:
            offer = self._offers.get(batch_id)
            if offer is None:
                raise UnknownBatchError(batch_id)
            if not offer.acked and not offer.deliveries:
                raise NotTakenError(batch_id)
            already = offer.acked
            if not already:
                offer.acked = True
                offer.acked_by = actor
                offer.acked_at = self._clock()
                self.stats.acked += 1
        if not already:
            if self.on_ack is not None:
                self.on_ack(offer)
            self.notify()
        return offer, already

    def release(self, batch_id: str, delivery: int) -> tuple[Offer, str | None]:
        """Hand a batch back before its lease ends (a trainer stopping without training on it): the
        next `next_batch` takes it at once instead of after `ack_timeout_s`. Only the lease of that
        `delivery` is ended, so a trainer whose lease ran out, and whose batch another trainer holds
        now, cannot take it from that one. Returns the batch and, when nothing was released, why."""
        with self._lock:
            now = self._clock()
            offer, unheld = self._lease(batch_id, delivery, now)
            if unheld is not None:
                return offer, unheld
            offer.leased_until = now  # ended now: free to take, and `holding` says since when
        log.info("run %s: batch %s released (delivery %d): handed out again at once", self.run_id,
                 batch_id, delivery)  # fmt: skip
        self.notify()
        return offer, None

    def renew(self, batch_id: str, delivery: int) -> tuple[Offer, float, str | None]:
        """Extend the lease of `delivery` to `ack_timeout_s` from now (a trainer whose step takes longer
        than the lease): the batch is not handed out again while its trainer still trains on it, and a
        trainer killed meanwhile holds it for at most one lease past its last renewal. As with `release`,
        only the delivery that holds the lease can renew it; one whose lease ran out cannot take it
        back. Returns the batch, the seconds the lease of `delivery` has left (0 when not renewed) and,
        when it was not renewed, why."""
        with self._lock:
            now = self._clock()
            offer, unheld = self._lease(batch_id, delivery, now)
            if unheld is not None:
                return offer, 0.0, unheld
            offer.leased_until = now + self.ack_timeout_s
        return offer, self.ack_timeout_s, None

    def _lease(self, batch_id: str, delivery: int, now: float) -> tuple[Offer, str | None]:
        """Under the lock: the batch, and why `delivery` does not hold its lease (None when it does)."""
        offer = self._offers.get(batch_id)
        if offer is None:
            raise UnknownBatchError(batch_id)
        if offer.acked:
            raise AlreadyAckedError(batch_id)
        if not offer.deliveries:
            raise NotTakenError(batch_id)
        if delivery < offer.deliveries:
            return offer, f"it was handed out again since (delivery {offer.deliveries})"
        if delivery > offer.deliveries:
            return offer, f"it has been handed out {offer.deliveries} time(s), not {delivery}"
        if offer.leased_until is None or offer.leased_until <= now:
            return offer, "its lease had already ended"
        return offer, None

    def get(self, batch_id: str) -> Offer | None:
        with self._lock:
            return self._offers.get(batch_id)

    def pending(self) -> list[Offer]:
        with self._lock:
            return [o for o in self._offers.values() if not o.acked]

    def holding(self) -> tuple[str, Offer, float] | None:
        """What the run waits on its trainer for, if anything, oldest batch first: the trainer to take
        it (`take`), to ack it (`ack`), or to publish the version it trains towards (`publish`), with
        how long it has waited for that (seconds of this gateway's clock). A run's next trainer step
        begins only once its batch is acked and that version published (`step`). A batch handed back
        (`release`), or whose lease ran out, waits to be taken again, since then."""
        now = self._clock()
        published = self._published_version()
        with self._lock:
            offers = list(self._offers.values())
        for offer in offers:
            if not offer.acked:
                if offer.taken_at is None:
                    return "take", offer, now - offer.offered_at
                if offer.leased_until is not None and offer.leased_until <= now:
                    # handed back, or its lease ran out: no trainer holds it, and it waits to be taken
                    return "take", offer, now - offer.leased_until
                return "ack", offer, now - offer.taken_at
            if published < int(offer.payload.get("publish_version", 0)):
                return "publish", offer, now - (offer.acked_at or offer.offered_at)
        return None

    @property
    def closed(self) -> str | None:
        """Why the run's trainer gets no more batches (the state the run ends in), or None."""
        return self._closed

    @property
    def ending(self) -> bool:
        """Whether the run has ended for its trainer: its trainer loop is over (`trainer_loop_over`), or
        it is stopping or has ended (`close`). It takes no batch, version or policy change from then on."""
        return self._loop_over or self._closed is not None

    def trainer_loop_over(self) -> None:
        """The run's trainer loop completed (its last batch acked, its version published): no batch is
        offered from now on while the run drains its turns and weight updates. Its trainer is told how
        the run ended only once the drain is over (`close`), since a drain that fails ends it `failed`:
        told at the loop's end, a trainer heard "completed" from a run that then ended "failed"."""
        with self._lock:
            self._loop_over = True
        self.notify()

    def close(self, reason: str) -> None:
        """The run ended: waiting trainers are told so."""
        with self._lock:
            self._closed = reason
        self.notify()

    async def until_closed(self, timeout_s: float) -> str | None:
        """`closed`, waiting up to `timeout_s` (seconds of this loop's clock) for the run's end."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._closed is None and (left := deadline - loop.time()) > 0:
            await self.wait_changed(left, lambda: self._closed is not None)
        return self._closed

    def deleted(self) -> None:
        """The run was deleted: its batches are gone, and a trainer waiting for one is told so at once
        (`RunDeletedError`). A long-poll open across the delete waited out its timeout for a batch that
        could no longer be acked, then answered 204."""
        with self._lock:
            self._offers.clear()
            self._closed = DELETED
        self.notify()

    # -- waking waiters on any loop --------------------------------------------------------------

    def notify(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.loop.is_closed():
                waiter.loop.call_soon_threadsafe(_set_done, waiter.future)

    async def wait_changed(self, timeout_s: float | None, done: Callable[[], bool] | None = None) -> None:
        """Wait until `notify` is called (or `timeout_s` seconds of this loop's clock pass); not at all
        when `done()` holds, asked under the lock that a change and its `notify` take."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if done is not None and done():
                return
            self._waiters.append(_Waiter(loop, future))
        if timeout_s is None:
            await future
            return
        handle = loop.call_later(timeout_s, _set_done, future)
        try:
            await future
        finally:
            handle.cancel()


KEPT_DELIVERIES = "delivery"  # beside the payload in a kept offer's file: the times it was handed out


class OfferFiles:
    """Offered, unacked batches kept as JSON files (one per batch, written atomically), so that a
    run resumed after a crash offers them again. Called from the store writer thread, in order."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, batch_id: str) -> Path:
        return self.directory / f"{batch_id}.json"

    def save(self, offer: Offer) -> None:
        """The offer's payload, and how many times it was handed out (`delivery`): a restarted server
        hands it out again as the next delivery, not the first."""
        # A disk that refuses it (full) leaves no partial file behind, taking space the run then needs
        write_text_atomically(
            self._path(offer.batch_id), json.dumps({**offer.payload, KEPT_DELIVERIES: offer.deliveries})
        )

    def remove(self, offer: Offer) -> None:
        self.remove_batch(offer.batch_id)

    def remove_batch(self, batch_id: str) -> None:
        """Forget an acked batch's file. One the disk keeps (read-only) is logged, not raised: the store
        holds the ack, and the next start leaves it out (`load`'s `acked`) and removes it then."""
        try:
            self._path(batch_id).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("batch %s acked; its kept file is not removed (%s): the next start removes it",
                        batch_id, exc)  # fmt: skip

    def load(self, acked: set[int] | frozenset[int] = frozenset()) -> list[Offer]:
        """The kept offers, oldest first, less those whose index is in `acked` (the store holds their
        ack: a file a read-only disk or a kill kept after the ack was stored), whose files go."""
        if not self.directory.is_dir():
            return []
        offers = []
        for path in self.directory.glob("*.json"):
            try:
                payload = json.loads(path.read_text())
                deliveries = int(payload.pop(KEPT_DELIVERIES, 0))  # a file from before it was kept: 0
                offer = Offer(str(payload["batch_id"]), int(payload["index"]), payload, time.monotonic())
                offer.deliveries = deliveries
            except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
                # written atomically, so only a hand-edited or damaged disk gets here: keep the file
                log.warning("kept offer %s not offered again: unreadable (%r)", path, exc)
                continue
            if offer.index in acked:
                self.remove_batch(offer.batch_id)
                continue
            offers.append(offer)
        return sorted(offers, key=lambda o: o.index)


class RunClosedError(RuntimeError):
    """The run ended; no more batches will be offered."""


class RunDeletedError(RunClosedError):
    """The run was deleted while a trainer waited: it has no batches any more."""


DELETED = "deleted"  # the gateway's close reason once its run is deleted


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def batch_payload(
    run_id: str, training: TrainingBatch, publish_version: int, batch_offset: int = 0, group_offset: int = 0
) -> dict[str, Any]:
    """A delivered batch as the trainer API sends it: every group with its trajectories, each with its
    turns, reward, GRPO advantage and the policy versions of its turns, and the group's staleness."""
    batch = training.batch
    groups = []
    for group in batch.groups:
        outcomes = training.attempts.get(group.group_id, ())
        trajectories = []
        for i, outcome in enumerate(outcomes):
            turns = [dict(entry) for entry in outcome.transcript]
            versions = [int(str(t["weight_version"])) for t in turns if t.get("weight_version") is not None]
            trajectories.append(
                {
                    "attempt": i,
                    "reward": outcome.reward,
                    "advantage": group.advantages[i] if i < len(group.advantages) else 0.0,
                    "turns": turns,
                    "turn_count": outcome.turns,
                    "policy_versions": versions,
                    "timed_out": outcome.timed_out,
                }
            )
        groups.append(
            {
                "group_id": group.group_id + group_offset,
                "task_index": group.task_index,
                "staleness": group.staleness,
                "rewards": list(group.rewards),
                "advantages": list(group.advantages),
                "trajectories": trajectories,
            }
        )
    index = batch.index + batch_offset
    return {
        "batch_id": f"{run_id}-b{index}",
        "index": index,
        "trainer_version": batch.trainer_version,
        "publish_version": publish_version,
        "groups": groups,
    }
