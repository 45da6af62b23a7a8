"""The trainer gateway: at-least-once offers with leases, idempotent acks, the step's wait, closing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.service.gateway import (
    KEEP_ACKED,
    AlreadyAckedError,
    NotTakenError,
    Offer,
    OfferFiles,
    RunClosedError,
    TrainerGateway,
    UnknownBatchError,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_gateway(**overrides: Any) -> tuple[TrainerGateway, Clock, dict[str, int]]:
    clock = Clock()
    published = {"version": 0}
    fields: dict[str, Any] = {"run_id": "r", "ack_timeout_s": 10.0, "clock": clock}
    fields.update(overrides)
    return TrainerGateway(published_version=lambda: published["version"], **fields), clock, published


def make_payload(index: int = 0, **overrides: Any) -> dict[str, Any]:
    payload: dict[str, Any] = {"batch_id": f"r-b{index}", "index": index, "publish_version": index + 1,
                               "trainer_version": index, "groups": []}  # fmt: skip
    payload.update(overrides)
    return payload


async def test_an_unacked_batch_is_offered_again_after_its_lease() -> None:
    gateway, clock, _ = make_gateway()
    gateway.offer(make_payload(0))
    first = await gateway.next_batch(0)
    assert first is not None
    assert first.deliveries == 1
    assert await gateway.next_batch(0) is None  # leased: nobody else gets it
    clock.now += 10.5
    again = await gateway.next_batch(0)
    assert again is first
    assert again.deliveries == 2
    assert gateway.stats.redelivered == 1


async def test_acks_are_idempotent_and_unknown_batches_refused() -> None:
    gateway, _, _ = make_gateway()
    acked: list[Offer] = []
    gateway.on_ack = acked.append
    gateway.offer(make_payload(0))
    assert await gateway.next_batch(0) is not None
    assert gateway.ack("r-b0")[1] is False
    assert gateway.ack("r-b0")[1] is True
    assert len(acked) == 1  # the store hears of the first ack only
    assert await gateway.next_batch(0) is None
    with pytest.raises(UnknownBatchError):
        gateway.ack("r-b9")


async def test_a_batch_never_handed_out_cannot_be_acked() -> None:
    """Its id guessed (they follow the run's id), such an ack was taken: the batch counted as trained on
    and was never handed out to anyone."""
    gateway, _, _ = make_gateway()
    gateway.offer(make_payload(0))
    with pytest.raises(NotTakenError):
        gateway.ack("r-b0")
    taken = await gateway.next_batch(0)
    assert taken is not None
    assert taken.batch_id == "r-b0"
    assert gateway.ack("r-b0")[1] is False


async def test_a_released_batch_is_handed_out_again_at_once_and_only_its_holder_can_release_it() -> None:
    gateway, clock, _ = make_gateway()
    gateway.offer(make_payload(0))
    gateway.offer(make_payload(1))
    held = await gateway.next_batch(0)
    assert held is not None
    assert held.index == 0
    # a trainer waiting meanwhile gets batch 1 (batch 0 is leased), then waits
    assert (await gateway.next_batch(0)).index == 1  # type: ignore[union-attr]
    waiting = asyncio.create_task(gateway.next_batch(30))
    await asyncio.sleep(0)
    assert gateway.release("r-b0", 1) == (held, None)
    again = await asyncio.wait_for(waiting, 5)  # woken by the release, long before the lease ends
    assert again is held
    assert again.deliveries == 2
    assert gateway.stats.redelivered == 1
    # the first trainer's release again, now that another holds it: nothing changes
    assert gateway.release("r-b0", 1) == (held, "it was handed out again since (delivery 2)")
    assert await gateway.next_batch(0) is None
    clock.now += 10.5  # the second lease ran out too: nothing left to release
    assert gateway.release("r-b0", 2) == (held, "its lease had already ended")
    assert gateway.ack("r-b1")[1] is False
    refuses_what_no_trainer_holds(gateway, gateway.release, acked="r-b1", fresh=2)


def refuses_what_no_trainer_holds(
    gateway: TrainerGateway, act: Callable[[str, int], object], acked: str, fresh: int
) -> None:
    """`act` (release, renew) refuses batch `acked` (acked), batch `fresh` (offered now, never handed out)
    and a batch never offered."""
    with pytest.raises(AlreadyAckedError):
        act(acked, 1)
    gateway.offer(make_payload(fresh))
    with pytest.raises(NotTakenError):
        act(f"r-b{fresh}", 1)
    with pytest.raises(UnknownBatchError):
        act("r-b9", 1)


async def test_a_renewed_lease_is_not_handed_out_again_and_only_its_holder_can_renew_it() -> None:
    """A step longer than the lease: its batch was handed out to a second trainer while the first still
    trained on it. Renewed, the lease ends `ack_timeout_s` after the renewal instead."""
    gateway, clock, _ = make_gateway()
    gateway.offer(make_payload(0))
    held = await gateway.next_batch(0)
    assert held is not None
    clock.now += 8
    assert gateway.renew("r-b0", 1) == (held, 10.0, None)
    clock.now += 8  # 16 s since it was taken: past the first lease's end, within the renewed one
    assert await gateway.next_batch(0) is None
    assert gateway.holding() == ("ack", held, 16)
    assert gateway.renew("r-b0", 2) == (held, 0.0, "it has been handed out 1 time(s), not 2")
    clock.now += 2.5  # the renewed lease ran out: it cannot be renewed back, and is free to take
    assert gateway.renew("r-b0", 1) == (held, 0.0, "its lease had already ended")
    again = await gateway.next_batch(0)
    assert again is held
    assert again.deliveries == 2
    # the first trainer renews again, now that another holds it: the second's lease is untouched
    assert gateway.renew("r-b0", 1) == (held, 0.0, "it was handed out again since (delivery 2)")
    assert held.leased_until == clock.now + 10
    assert gateway.renew("r-b0", 2)[2] is None
    assert gateway.ack("r-b0")[1] is False
    refuses_what_no_trainer_holds(gateway, gateway.renew, acked="r-b0", fresh=1)


async def test_batches_are_handed_out_oldest_first() -> None:
    gateway, _, _ = make_gateway()
    gateway.offer(make_payload(0))
    gateway.offer(make_payload(1))
    assert gateway.offer(make_payload(0)).index == 0  # offering again changes nothing
    taken = [await gateway.next_batch(0), await gateway.next_batch(0)]
    assert [o.index for o in taken if o is not None] == [0, 1]


async def test_a_waiting_trainer_is_woken_by_an_offer() -> None:
    gateway, _, _ = make_gateway()
    waiting = asyncio.create_task(gateway.next_batch(30))
    await asyncio.sleep(0)
    gateway.offer(make_payload(0))
    offer = await asyncio.wait_for(waiting, 5)
    assert offer is not None
    assert offer.batch_id == "r-b0"


async def test_the_step_ends_once_acked_and_published() -> None:
    from app.core.scheduler import DeliverBatch
    from app.runtime.ports import TrainingBatch

    gateway, _, published = make_gateway()
    step = asyncio.create_task(gateway.step(TrainingBatch(DeliverBatch(0, (), 0), {}), 1))
    offer = await gateway.next_batch(5)
    assert offer is not None
    gateway.ack(offer.batch_id)
    await asyncio.sleep(0.01)
    assert not step.done()  # acked, but version 1 is not published yet
    published["version"] = 1
    gateway.notify()
    assert await asyncio.wait_for(step, 5) is None


async def test_a_closed_gateway_still_hands_out_what_is_left_then_refuses() -> None:
    gateway, _, _ = make_gateway()
    gateway.offer(make_payload(0))
    gateway.close("stopped")
    offer = await gateway.next_batch(0)
    assert offer is not None
    gateway.ack(offer.batch_id)
    with pytest.raises(RunClosedError):
        await gateway.next_batch(5)


def test_kept_offers_load_in_batch_order_and_a_damaged_file_is_skipped_and_kept(tmp_path: Path) -> None:
    files = OfferFiles(tmp_path / "offers")
    for index in (2, 0, 1):
        files.save(Offer(f"r-b{index}", index, {"batch_id": f"r-b{index}", "index": index}, 0.0))
    damaged = {"r-b7.json": "{not json", "r-b8.json": '{"index": 8}', "r-b9.json": "[1, 2]"}
    for name, text in damaged.items():
        (tmp_path / "offers" / name).write_text(text)
    (tmp_path / "offers" / "r-b6.json").write_bytes(b"\xff\xfe")
    loaded = files.load()
    assert [o.batch_id for o in loaded] == ["r-b0", "r-b1", "r-b2"]
    assert all((tmp_path / "offers" / name).exists() for name in damaged)  # nothing deleted


async def test_what_the_run_waits_on_its_trainer_for_and_since_when() -> None:
    gateway, clock, published = make_gateway()
    assert gateway.holding() is None  # nothing offered: the run waits on its groups, not its trainer
    offer = gateway.offer(make_payload(0))
    clock.now += 12
    assert gateway.holding() == ("take", offer, 12)
    taken = await gateway.next_batch(0)
    assert taken is offer
    clock.now += 5
    assert gateway.holding() == ("ack", offer, 5)  # since it was taken, not since it was offered
    clock.now += 20  # the lease (10 s) ran out 15 s ago: nobody holds it, it waits to be taken again
    assert gateway.holding() == ("take", offer, 15)
    assert await gateway.next_batch(0) is offer  # handed out again: still waited on since the first take
    assert gateway.holding() == ("ack", offer, 25)
    clock.now += 2
    assert gateway.release(offer.batch_id, 2)[1] is None  # handed back: it waits to be taken, since now
    clock.now += 4
    assert gateway.holding() == ("take", offer, 4)
    assert await gateway.next_batch(0) is offer
    assert gateway.holding() == ("ack", offer, 31)
    gateway.ack(offer.batch_id)
    clock.now += 3
    assert gateway.holding() == ("publish", offer, 3)  # the step also waits for version 1
    published["version"] = 1
    assert gateway.holding() is None
    second = gateway.offer(make_payload(1))
    assert gateway.holding() == ("take", second, 0)


async def test_acked_batches_are_forgotten_so_a_long_run_holds_a_bounded_number() -> None:
    """Every offer used to be kept, payload and all, for the run's life: a sentinel run at speed 100
    held 4.9 MB of them after 61,000 events (benchmarks.serve_memory), and growing."""
    gateway, clock, published = make_gateway()
    steps = KEEP_ACKED * 10
    for index in range(steps):
        gateway.offer(make_payload(index, groups=[{"group_id": index, "trajectories": ["x" * 100]}]))
        taken = await gateway.next_batch(0)
        assert taken is not None
        clock.now += 1.0
        gateway.ack(taken.batch_id)
        published["version"] = index + 1
    gateway.offer(make_payload(steps))
    assert len(gateway._offers) <= KEEP_ACKED + 1
    assert gateway.get(f"r-b{steps - 1}") is not None  # the newest acked are kept: a repeated ack is seen
    with pytest.raises(UnknownBatchError):  # an old one: the API answers it from the store
        gateway.ack("r-b0")
    assert gateway.stats.acked == steps
    assert gateway.stats.collections == steps
    assert gateway.stats.collection_s_mean == 0.0


async def test_an_acked_batch_is_kept_until_its_version_is_published() -> None:
    gateway, _, published = make_gateway()
    for index in range(KEEP_ACKED * 2):
        gateway.offer(make_payload(index))
        assert await gateway.next_batch(0) is not None
        gateway.ack(f"r-b{index}")
    gateway.offer(make_payload(KEEP_ACKED * 2))
    assert gateway.get("r-b0") is not None  # version 1 never published: the run still waits on it
    holding = gateway.holding()
    assert holding is not None
    assert holding[0] == "publish"
    published["version"] = KEEP_ACKED * 2
    gateway.offer(make_payload(KEEP_ACKED * 2 + 1))
    assert gateway.get("r-b0") is None


async def test_a_trainer_is_told_the_runs_end_once_its_drain_is_over_not_at_its_loops_end() -> None:
    """Once the trainer loop is over (`trainer_loop_over`) the run drains, and the drain may fail it: a
    waiting trainer hears the state the run ends in (`close`), not "completed" at the loop's end. The
    run's built-in trainer (`to_loop_end`) is done at the loop's end; `until_closed` waits within its
    bound."""
    gateway, _, _ = make_gateway()
    waiting = asyncio.ensure_future(gateway.next_batch(30.0))
    await asyncio.sleep(0.05)
    gateway.trainer_loop_over()
    assert gateway.ending
    with pytest.raises(RunClosedError, match="trainer loop is over"):
        await gateway.next_batch(30.0, to_loop_end=True)
    assert await gateway.until_closed(0.05) is None  # still draining
    await asyncio.sleep(0.05)
    assert not waiting.done()  # told nothing while the run drains
    gateway.close("failed")
    with pytest.raises(RunClosedError, match="failed"):
        await waiting
    assert await gateway.until_closed(0.0) == "failed"
