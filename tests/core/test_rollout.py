from __future__ import annotations

import pytest

from app.core.rollout import BeginUpdate, RestartInFlight, UpdatePlan
from app.core.router import choose_engine


def test_rolling_updates_one_engine_at_a_time_to_the_newest_version() -> None:
    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=1)
    assert plan.on_publish(1) == [BeginUpdate("a", 1)]
    assert not plan.routable("a")
    assert plan.routable("b")
    assert plan.on_publish(2) == []  # a is still updating; nobody else may start
    assert plan.on_updated("a") == [BeginUpdate("a", 2)]  # a is behind the newest version: it goes again
    assert plan.on_updated("a") == [BeginUpdate("b", 2)]
    assert plan.on_updated("b") == [BeginUpdate("c", 2)]
    assert plan.on_updated("c") == []
    assert plan.versions == {"a": 2, "b": 2, "c": 2}
    assert plan.max_seen_updating == 1


def test_rolling_respects_a_larger_maximum() -> None:
    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=2)
    assert plan.on_publish(1) == [BeginUpdate("a", 1), BeginUpdate("b", 1)]
    assert plan.on_updated("b") == [BeginUpdate("c", 1)]
    assert plan.max_seen_updating == 2


def test_stop_the_world_updates_all_and_restarts() -> None:
    plan = UpdatePlan(["a", "b"], rolling=False)
    assert plan.on_publish(1) == [RestartInFlight(), BeginUpdate("a", 1), BeginUpdate("b", 1)]
    assert plan.on_publish(2) == []
    assert plan.on_updated("a") == []
    assert plan.on_updated("b") == [RestartInFlight(), BeginUpdate("a", 2), BeginUpdate("b", 2)]


def test_plan_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one engine"):
        UpdatePlan([], rolling=True)
    with pytest.raises(ValueError, match="max_updating"):
        UpdatePlan(["a"], rolling=True, max_updating=0)


def test_router_picks_least_loaded_routable_engine_with_a_free_slot() -> None:
    assert choose_engine({"a": 2, "b": 1, "c": 1}, 3, lambda e: e != "b") == "c"
    assert choose_engine({"a": 3, "b": 3}, 3, lambda e: True) is None
    assert choose_engine({"a": 0}, 3, lambda e: False) is None


def test_an_engine_that_goes_down_mid_update_hands_the_rolling_update_on() -> None:
    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=1)
    assert plan.on_publish(1) == [BeginUpdate("a", 1)]
    assert plan.on_engine_down("a") == [BeginUpdate("b", 1)]  # a's update is abandoned, b goes
    assert not plan.routable("a")
    assert plan.on_updated("b") == [BeginUpdate("c", 1)]
    assert plan.on_publish(2) == []
    assert plan.on_updated("c") == [BeginUpdate("b", 2)]  # a, down, is skipped
    assert plan.on_updated("b") == [BeginUpdate("c", 2)]
    assert plan.on_updated("c") == []
    # a comes back at the newest version: routable at once, nothing to update.
    assert plan.on_engine_up("a", 2) == []
    assert plan.routable("a")
    assert plan.versions == {"a": 2, "b": 2, "c": 2}


def test_an_engine_back_at_an_older_version_is_updated_in_turn() -> None:
    plan = UpdatePlan(["a", "b"], rolling=True)
    plan.on_engine_down("a")
    assert plan.on_publish(1) == [BeginUpdate("b", 1)]
    assert plan.on_engine_up("a", 0) == []  # b holds the one updating slot
    assert plan.on_updated("b") == [BeginUpdate("a", 1)]


def test_all_down_and_stop_the_world_skip_down_engines() -> None:
    plan = UpdatePlan(["a", "b"], rolling=False)
    plan.on_engine_down("a")
    assert plan.on_publish(1) == [RestartInFlight(), BeginUpdate("b", 1)]
    plan.on_engine_down("b")
    assert plan.all_down
    assert plan.on_publish(2) == [RestartInFlight()]  # nobody to update, in-flight work still restarts
    assert plan.on_engine_up("b", 2) == []
    assert plan.on_engine_up("a", 1) == [RestartInFlight(), BeginUpdate("a", 2), BeginUpdate("b", 2)]
    with pytest.raises(ValueError, match="not down"):
        plan.on_engine_up("a", 2)


def test_may_join_paces_engines_beyond_the_first() -> None:
    asked: list[tuple[str, tuple[str, ...]]] = []
    allow = {"b": True, "c": False}

    def may_join(engine: str, updating: tuple[str, ...]) -> bool:
        asked.append((engine, updating))
        return allow[engine]

    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=3, may_join=may_join)
    # The first engine never waits on the predicate; b may join a, c may not join a and b.
    assert plan.on_publish(1) == [BeginUpdate("a", 1), BeginUpdate("b", 1)]
    assert asked == [("b", ("a",)), ("c", ("a", "b"))]
    allow["c"] = True
    assert plan.on_updated("a") == [BeginUpdate("c", 1)]  # asked again at the next step
    assert plan.on_updated("b") == []
    assert plan.on_updated("c") == []
    assert plan.versions == {"a": 1, "b": 1, "c": 1}
    assert plan.max_seen_updating == 2


def test_may_join_never_raises_the_configured_maximum() -> None:
    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=2, may_join=lambda e, u: True)
    assert plan.on_publish(1) == [BeginUpdate("a", 1), BeginUpdate("b", 1)]
    assert plan.max_seen_updating == 2


def test_a_refused_engine_alone_still_updates() -> None:
    # A predicate that always refuses leaves the plan one engine at a time: the update goes on.
    plan = UpdatePlan(["a", "b"], rolling=True, max_updating=2, may_join=lambda e, u: False)
    assert plan.on_publish(1) == [BeginUpdate("a", 1)]
    assert plan.on_updated("a") == [BeginUpdate("b", 1)]
    assert plan.on_updated("b") == []
    assert plan.versions == {"a": 1, "b": 1}


def test_router_prefers_fresh_engines_and_falls_back_to_any() -> None:
    fresh = {"c"}.__contains__
    # c is busier than a, but fresh: it wins while it has a free slot
    assert choose_engine({"a": 0, "b": 1, "c": 2}, 3, lambda e: True, fresh) == "c"
    # c is full: the least loaded of the rest, as without a preference
    assert choose_engine({"a": 1, "b": 0, "c": 3}, 3, lambda e: True, fresh) == "b"
    # a fresh engine that is not routable (updating, down) is never chosen
    assert choose_engine({"a": 1, "c": 0}, 3, lambda e: e != "c", fresh) == "a"


def test_fresh_for_keeps_a_group_from_getting_older_during_a_rolling_update() -> None:
    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=1)
    assert not plan.lagging
    assert plan.fresh_for(None) is None
    plan.on_publish(1)
    plan.on_updated("a")  # a serves version 1; b is updating; c still serves 0
    assert plan.lagging
    fresh = plan.fresh_for(None)  # a group with no turn yet should start on the newest version
    assert fresh is not None
    assert [e for e in "abc" if fresh(e)] == ["a"]
    assert plan.fresh_for(0) is None  # a group already holding a version-0 turn loses nothing on c
    plan.on_updated("b")
    plan.on_updated("c")
    assert not plan.lagging


def test_an_engine_more_than_k_versions_behind_serves_nothing_and_updates_first() -> None:
    joins: list[str] = []

    def may_join(engine: str, updating: tuple[str, ...]) -> bool:
        joins.append(engine)
        return False  # pacing would keep every engine beyond the first waiting

    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=3, may_join=may_join, max_staleness=0)
    # K = 0: the moment version 1 is out, turns of version 0 are discarded as they end, so no engine
    # at 0 takes turns; they all update at once, without asking the pacing.
    assert plan.on_publish(1) == [BeginUpdate("a", 1), BeginUpdate("b", 1), BeginUpdate("c", 1)]
    assert joins == []
    plan.on_updated("a")
    assert plan.routable("a")

    plan = UpdatePlan(["a", "b", "c"], rolling=True, max_updating=1, max_staleness=1)
    assert plan.on_publish(1) == [BeginUpdate("a", 1)]
    assert plan.routable("b")
    assert plan.routable("c")
    assert plan.on_publish(2) == []
    assert not plan.routable("b")
    assert not plan.routable("c")
    assert plan.on_updated("a") == [BeginUpdate("b", 2)]  # the stale engines go before a again
    assert not plan.routable("c")
    # K raised live: c fits again, and the rolling update goes on at its pace
    assert plan.set_max_staleness(2) == []
    assert plan.routable("c")


def test_a_held_plan_routes_nothing_begins_no_update_and_catches_up_when_released() -> None:
    plan = UpdatePlan(["a", "b"], rolling=True, max_updating=1)
    assert plan.set_held(True) == []
    assert not plan.routable("a")
    assert not plan.routable("b")
    assert plan.on_publish(1) == []
    assert plan.on_publish(2) == []
    assert plan.set_held(False) == [BeginUpdate("a", 2)]  # straight to the newest version
    assert plan.routable("b")

    world = UpdatePlan(["a", "b"], rolling=False)
    world.set_held(True)
    assert world.on_publish(1) == []
    assert world.set_held(False) == [RestartInFlight(), BeginUpdate("a", 1), BeginUpdate("b", 1)]


def test_a_drained_engine_stays_out_through_updates_and_restarts_until_it_is_put_back() -> None:
    plan = UpdatePlan(["a", "b"], rolling=True, max_updating=1)
    assert plan.set_drained("a", True) == []
    assert not plan.routable("a")
    assert plan.on_publish(1) == [BeginUpdate("b", 1)]  # a is skipped
    assert plan.on_updated("b") == []
    assert plan.on_engine_down("a") == []
    assert plan.on_engine_up("a", 0) == []  # restarted, still drained: no turn, no update
    assert not plan.routable("a")
    assert plan.set_drained("a", False) == [BeginUpdate("a", 1)]  # back, and brought to the newest
    assert plan.on_updated("a") == []
    assert plan.routable("a")
    with pytest.raises(ValueError, match="unknown engine"):
        plan.set_drained("z", True)


def test_an_engine_that_refuses_a_version_serves_on_at_its_own_and_takes_the_next() -> None:
    plan = UpdatePlan(["a", "b"], rolling=True, max_updating=1, max_staleness=1)
    assert plan.on_publish(1) == [BeginUpdate("a", 1)]
    assert plan.on_refused("a", 1) == [BeginUpdate("b", 1)]  # the update goes on to the others
    assert plan.routable("a")  # serving its own version, within K
    assert plan.on_updated("b") == []  # a is not offered version 1 again
    assert plan.versions == {"a": 0, "b": 1}
    assert plan.on_publish(2) == [BeginUpdate("a", 2)]  # a newer version is offered as usual
    assert plan.on_updated("a") == [BeginUpdate("b", 2)]
    # More than K behind on a version it refused: it serves nothing until a newer one comes.
    assert plan.on_refused("b", 2) == []
    assert plan.on_publish(3) == [BeginUpdate("b", 3)]
    assert plan.on_refused("b", 3) == [BeginUpdate("a", 3)]
    assert plan.on_updated("a") == []
    assert not plan.routable("b")
    assert plan.on_publish(4)[0] == BeginUpdate("b", 4)


def test_stop_the_world_does_not_offer_a_refused_version_again() -> None:
    plan = UpdatePlan(["a", "b"], rolling=False)
    assert plan.on_publish(1) == [RestartInFlight(), BeginUpdate("a", 1), BeginUpdate("b", 1)]
    assert plan.on_refused("a", 1) == []
    assert plan.on_updated("b") == []
    assert plan.versions == {"a": 0, "b": 1}
    plan.on_engine_down("b")
    assert plan.on_engine_up("b", 1) == []  # nobody is behind but a, which refused version 1
    assert plan.on_publish(2) == [RestartInFlight(), BeginUpdate("a", 2), BeginUpdate("b", 2)]
