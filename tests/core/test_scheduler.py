"""The scheduler as a pure state machine: admission, batching order, staleness, accounting."""

from __future__ import annotations

import pytest

from app.core.advantages import grpo_advantages
from app.core.config import AdmissionMode, PolicyConfig
from app.core.events import GroupAdmitted, GroupDelivered, GroupDiscarded, GroupReady
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


def endings(s: Scheduler) -> dict[int, tuple[str, str]]:
    """Drain the scheduler's outbox: each ended group's outcome ("delivered" or the reason) and detail."""
    out: dict[int, tuple[str, str]] = {}
    for event in s.drain_events():
        if isinstance(event, GroupDelivered):
            out[event.group_id] = ("delivered", "")
        elif isinstance(event, GroupDiscarded):
            out[event.group_id] = (event.reason, event.detail)
    return out


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
    assert endings(s)[0] == ("stale", "cannot meet K")
    assert 0 not in s.groups  # an ended group leaves the scheduler
    assert 3 in starts(out)


def test_ready_group_going_stale_is_discarded_not_delivered() -> None:
    s = Scheduler(make_policy(max_staleness=0))
    s.on_start(0.0)
    finish_group(s, 0, 1.0, version=0)
    s.on_version_published(1, 2.0)
    assert endings(s)[0] == ("stale", "went stale while ready")


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
    assert endings(s)[0] == ("zero_variance", "all rewards equal")


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
    assert s.groups == {}
    assert set(endings(s).values()) == {("cancelled", "run ended")}
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


def test_group_events_tell_each_groups_story_in_order() -> None:
    s = Scheduler(make_policy(groups_per_batch=1, surplus_groups=0))
    s.on_start(0.0)
    s.on_batch_requested(0.0)
    finish_group(s, 0, 1.0, rewards=(1.0, 0.0))
    assert s.drain_events() == [
        GroupAdmitted(0, 0, 2),
        GroupReady(0),
        GroupDelivered(0, 0, 0, (1.0, 0.0)),
        GroupAdmitted(1, 1, 2),
    ]
    assert s.drain_events() == []


def test_a_turn_newer_than_the_trainer_is_refused_and_fails_its_group() -> None:
    s = Scheduler(make_policy())
    s.on_start(0.0)
    out = s.on_turn(1, 0, 1, 1.0)  # the trainer is at version 0
    assert CancelGroup(1, DiscardReason.FAILED) in out
    assert s.counters.refused_turns == 1
    reason, detail = endings(s)[1]
    assert reason == "failed"
    assert "newer than the trainer's 0" in detail
    assert starts(out) == [3]  # its slot went to a new group


def test_a_stale_group_is_never_delivered_even_if_enforcement_was_skipped() -> None:
    s = Scheduler(make_policy(groups_per_batch=1, surplus_groups=1, max_staleness=0))
    s.on_start(0.0)
    finish_group(s, 0, 1.0, version=0)
    s.trainer_version = 1  # as if a publication had bypassed on_version_published
    out = s.on_batch_requested(2.0)
    assert not [d for d in out if isinstance(d, DeliverBatch)]
    assert s.counters.stale_at_delivery == 1
    assert endings(s)[0] == ("stale", "stale when chosen for a batch")


def test_finished_groups_leave_the_scheduler() -> None:
    s = Scheduler(make_policy(groups_per_batch=2, surplus_groups=1))
    s.on_start(0.0)
    for n in range(50):
        s.on_batch_requested(float(n))
        for gid in list(s.groups)[:2]:
            finish_group(s, gid, float(n))
        s.drain_events()
    assert s.batches_delivered == 50
    assert len(s.groups) == s.capacity  # never more than B + S records, however long the run


def test_late_reports_for_ended_groups_are_ignored_and_unknown_groups_refused() -> None:
    s = Scheduler(make_policy())
    s.on_start(0.0)
    s.on_attempt_done(0, 0, 0.0, "boom", 1.0)
    assert s.on_turn(0, 1, 0, 2.0) == []
    assert s.on_attempt_restarted(0, 1, 2.0) == []
    with pytest.raises(KeyError, match="never admitted"):
        s.on_turn(99, 0, 0, 2.0)


def test_the_staleness_check_survives_python_dash_o() -> None:
    """`python -O` strips asserts: the check at delivery is not one."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        from app.core.config import PolicyConfig
        from app.core.scheduler import DeliverBatch, Scheduler
        assert False, "never seen: asserts are stripped"
        s = Scheduler(PolicyConfig(groups_per_batch=1, group_size=2, surplus_groups=1, max_staleness=0))
        s.on_start(0.0)
        for i in range(2):
            s.on_turn(0, i, 0, 1.0)
            s.on_attempt_done(0, i, float(i), None, 1.0)
        s.trainer_version = 1  # as if a publication had bypassed on_version_published
        out = s.on_batch_requested(2.0)
        print(sys.flags.optimize, sum(isinstance(d, DeliverBatch) for d in out), s.counters.stale_at_delivery)
        """
    )
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "0", "1"]  # optimised; no batch delivered; one stale group caught


@pytest.mark.parametrize(
    ("rung", "overrides", "expected"),
    [
        ("full", {}, AdmissionMode.IN_FLIGHT),
        ("full", {"admission": "live"}, AdmissionMode.LIVE),
        ("lanes", {}, AdmissionMode.LIVE),
        ("sync", {}, AdmissionMode.LIVE),
    ],
)
def test_full_admits_in_flight_unless_told_otherwise(
    rung: str, overrides: dict[str, object], expected: AdmissionMode
) -> None:
    assert PolicyConfig.ladder(rung, **overrides).admission is expected


def test_in_flight_admission_refills_while_ready_groups_wait_for_their_batch() -> None:
    s = Scheduler(make_policy(groups_per_batch=2, surplus_groups=0, admission="in_flight"))
    assert starts(s.on_start(0.0)) == [0, 1]
    # A ready group holds no sandbox and no engine slot: its place in flight goes to the next group.
    assert starts(finish_group(s, 0, 1.0)) == [2]
    assert (s.groups_running, s.groups_ready) == (2, 1)
    s.on_batch_requested(1.5)
    delivered = [d for d in finish_group(s, 2, 2.0) if isinstance(d, DeliverBatch)]
    assert [g.group_id for g in delivered[0].groups] == [0, 2]
