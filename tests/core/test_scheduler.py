"""The scheduler as a pure state machine: admission, batching order, staleness, accounting."""

from __future__ import annotations

import pytest

from app.core.advantages import grpo_advantages
from app.core.config import PolicyConfig
from app.core.scheduler import CancelGroup, DeliverBatch, DiscardReason, GroupState, Scheduler, StartGroup


def make_policy(**overrides: object) -> PolicyConfig:
    base: dict[str, object] = {
        "groups_per_batch": 2,
        "group_size": 2,
        "surplus_groups": 1,
        "max_staleness": 1,
    }
    return PolicyConfig.model_validate({**base, **overrides})


def starts(decisions: list) -> list[int]:
    return [d.group_id for d in decisions if isinstance(d, StartGroup)]


def finish_group(s: Scheduler, gid: int, now: float, version: int = 0, rewards=(1.0, 0.0)) -> list:
    out: list = []
    for i, r in enumerate(rewards):
        out += s.on_turn(gid, i, version, now)
        out += s.on_attempt_done(gid, i, r, None, now)
    return out


def test_admits_up_to_b_plus_s() -> None:
    s = Scheduler(make_policy(groups_per_batch=2, surplus_groups=3))
    assert starts(s.on_start(0.0)) == [0, 1, 2, 3, 4]
    assert s.groups_live == 5


def test_completion_order_batches_take_the_first_to_finish() -> None:
    s = Scheduler(make_policy())
    s.on_start(0.0)
    s.on_batch_requested(0.0)
    finish_group(s, 2, 1.0)
    out = finish_group(s, 0, 2.0)
    batches = [d for d in out if isinstance(d, DeliverBatch)]
    assert [g.group_id for g in batches[0].groups] == [2, 0]
    # The two delivered groups freed their slots: two new groups start.
    assert starts(out) == [3, 4]


def test_start_order_waits_for_the_oldest_groups() -> None:
    s = Scheduler(make_policy(completion_order=False))
    s.on_start(0.0)
    s.on_batch_requested(0.0)
    assert not [d for d in finish_group(s, 2, 1.0) if isinstance(d, DeliverBatch)]
    assert not [d for d in finish_group(s, 1, 2.0) if isinstance(d, DeliverBatch)]
    out = finish_group(s, 0, 3.0)
    batch = next(d for d in out if isinstance(d, DeliverBatch))
    assert [g.group_id for g in batch.groups] == [0, 1]


def test_group_that_cannot_meet_k_is_cancelled_early() -> None:
    s = Scheduler(make_policy(max_staleness=1))
    s.on_start(0.0)
    s.on_turn(0, 0, 0, 1.0)
    assert s.on_version_published(1, 2.0) == []  # nothing stale yet at K=1, and no slot free
    assert s.group_of(0).state is GroupState.RUNNING
    out = s.on_version_published(2, 3.0)
    assert CancelGroup(0, DiscardReason.STALE) in out
    assert s.group_of(0).reason is DiscardReason.STALE
    assert 3 in starts(out)


def test_ready_group_going_stale_is_discarded_not_delivered() -> None:
    s = Scheduler(make_policy(max_staleness=0))
    s.on_start(0.0)
    finish_group(s, 0, 1.0, version=0)
    s.on_version_published(1, 2.0)
    assert s.group_of(0).state is GroupState.DISCARDED
    assert s.group_of(0).reason is DiscardReason.STALE


def test_infra_error_fails_the_group_and_cancels_siblings() -> None:
    s = Scheduler(make_policy())
    s.on_start(0.0)
    out = s.on_attempt_done(1, 0, 0.0, "sandbox died", 1.0)
    assert CancelGroup(1, DiscardReason.FAILED) in out
    assert s.counters.discarded[DiscardReason.FAILED] == 1
    assert s.on_attempt_done(1, 1, 1.0, None, 2.0) == []  # a late sibling is ignored, not double-counted


def test_zero_variance_filter() -> None:
    s = Scheduler(make_policy(filter_zero_variance=True))
    s.on_start(0.0)
    finish_group(s, 0, 1.0, rewards=(1.0, 1.0))
    assert s.group_of(0).reason is DiscardReason.ZERO_VARIANCE


def test_lowering_s_never_evicts_and_raising_admits() -> None:
    s = Scheduler(make_policy(surplus_groups=2))
    s.on_start(0.0)
    assert s.set_surplus(0, 1.0) == []
    assert s.groups_live == 4
    finish_group(s, 0, 2.0)
    s.on_batch_requested(2.0)
    out = finish_group(s, 1, 3.0)
    assert starts(out) == []  # live is 2 = B + 0 after the batch took two
    assert starts(s.set_surplus(3, 4.0)) == [4, 5, 6]


def test_lowering_k_discards_what_no_longer_meets_it() -> None:
    s = Scheduler(make_policy(max_staleness=3))
    s.on_start(0.0)
    s.on_turn(0, 0, 0, 1.0)
    s.on_version_published(2, 2.0)
    out = s.set_max_staleness(1, 3.0)
    assert CancelGroup(0, DiscardReason.STALE) in out


def test_stop_discards_everything_live_as_cancelled() -> None:
    s = Scheduler(make_policy())
    s.on_start(0.0)
    finish_group(s, 0, 1.0)
    s.on_stop(2.0)
    assert all(g.state in (GroupState.DELIVERED, GroupState.DISCARDED) for g in s.groups.values())
    assert s.counters.discarded[DiscardReason.CANCELLED] == 3
    assert s.on_start(3.0) == []


def test_bad_live_values_are_refused() -> None:
    s = Scheduler(make_policy())
    with pytest.raises(ValueError, match="surplus_groups"):
        s.set_surplus(-1, 0.0)
    with pytest.raises(ValueError, match="max_staleness"):
        s.set_max_staleness(-1, 0.0)
    with pytest.raises(ValueError, match="went back"):
        s.on_version_published(-1, 0.0)


@pytest.mark.parametrize(
    ("field", "value"), [("group_size", 1), ("surplus_groups", -1), ("max_staleness", -1)]
)
def test_policy_bounds(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=field):
        make_policy(**{field: value})


def test_grpo_advantages_normalise_within_group() -> None:
    adv = grpo_advantages([1.0, 0.0, 1.0, 0.0])
    assert adv == pytest.approx((1.0, -1.0, 1.0, -1.0), abs=1e-5)
    assert grpo_advantages([1.0, 1.0]) == (0.0, 0.0)


def test_lanes_must_stay_off_the_serving_cpus() -> None:
    from app.core.config import LanesConfig

    lane = {"slots": 2, "cpus": (1,)}
    config = LanesConfig.model_validate(
        {"reset": lane, "exec": lane, "validate": lane, "cleanup": lane, "serving_cpus": (0,)}
    )
    assert config.by_name()["validate"].slots == 2
    with pytest.raises(ValueError, match="lane exec shares CPUs \\[0\\] with serving"):
        LanesConfig.model_validate(
            {"reset": lane, "exec": {"slots": 1, "cpus": (0, 1)}, "validate": lane, "cleanup": lane,
             "serving_cpus": (0,)}
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs a CPU set"):
        LanesConfig.model_validate(
            {"reset": lane, "exec": {"slots": 1}, "validate": lane, "cleanup": lane, "serving_cpus": (0,)}
        )
