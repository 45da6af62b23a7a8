"""Workload specs: distributions draw in range and reproducibly per seed; traces load, are drawn per task
from their recorded attempts, and a trace workload simulates end to end without losing a group."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from factories import make_workload_data

from app.sim.run import policy_for, simulate
from app.sim.workload import (
    Dist,
    TrajectorySource,
    Workload,
    WorkloadError,
    load_trace,
    load_workload,
    parse_workload,
)


def draws(spec: Any, seed: int, n: int = 500) -> list[float]:
    dist = Dist.model_validate(spec)
    rng = random.Random(seed)
    return [dist.draw(rng) for _ in range(n)]


def make_small(**overrides: Any) -> dict[str, Any]:
    return make_workload_data(**overrides)


# -- distributions -----------------------------------------------------------------------------------


def test_number_is_a_constant() -> None:
    assert set(draws(3.5, seed=1, n=20)) == {3.5}
    assert Dist.model_validate(0).mean() == 0


def test_lognormal_matches_median_and_p90() -> None:
    values = sorted(draws({"lognormal": {"median": 10, "p90": 40}}, seed=2, n=20_000))
    median, p90 = values[len(values) // 2], values[int(len(values) * 0.9)]
    assert median == pytest.approx(10, rel=0.05)
    assert p90 == pytest.approx(40, rel=0.08)
    assert min(values) > 0


def test_lognormal_max_caps_every_draw() -> None:
    values = draws({"lognormal": {"median": 10, "p90": 40, "max": 25}}, seed=3, n=2_000)
    assert max(values) == 25  # the tail above the cap lands exactly on it (a harness timeout)
    assert min(values) > 0


def test_uniform_stays_in_range() -> None:
    values = draws({"uniform": [2, 5]}, seed=4)
    assert all(2 <= v <= 5 for v in values)
    assert max(values) - min(values) > 2.5


def test_empirical_draws_only_its_samples() -> None:
    values = draws({"empirical": [1, 4, 9]}, seed=5)
    assert set(values) == {1, 4, 9}


@pytest.mark.parametrize(
    "spec",
    [7, {"lognormal": {"median": 3, "p90": 8, "max": 20}}, {"uniform": [0, 1]}, {"empirical": [1, 2, 3]}],
)
def test_draws_repeat_for_a_seed_and_differ_across_seeds(spec: Any) -> None:
    assert draws(spec, seed=11) == draws(spec, seed=11)
    if not isinstance(spec, int):
        assert draws(spec, seed=11) != draws(spec, seed=12)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"lognormal": {"median": 3}}, "p90"),
        ({"lognormal": {"median": 5, "p90": 2}}, "p90"),
        ({"uniform": [3, 1]}, "uniform"),
        ({"empirical": []}, "empirical"),
        ({"normal": 3}, "normal"),
        (True, "boolean"),
    ],
)
def test_bad_distribution_is_refused_naming_the_field(spec: Any, field: str) -> None:
    with pytest.raises(WorkloadError, match=field):
        parse_workload({"trajectory": {"llm_s": spec}}, "w.yaml")


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (-1, "greater than or equal to 0, not -1"),
        (1e9, "less than or equal to 1000000, not 1000000000.0"),
        (float("inf"), "a finite number, not Infinity"),
        (float("nan"), "a finite number, not NaN"),
    ],
)
@pytest.mark.parametrize("key", ["turns", "llm_s"])
def test_a_bad_number_for_a_distribution_is_refused_naming_the_key_as_typed(
    key: str, value: float, why: str
) -> None:
    # `trajectory: {turns: 1e9}` was refused as `trajectory.turns.constant`, a key nobody typed.
    with pytest.raises(WorkloadError) as raised:
        parse_workload({"trajectory": {key: value}}, "w.yaml")
    assert str(raised.value) == f"w.yaml: trajectory.{key}: Input should be {why}"


@pytest.mark.parametrize("median", [1e-300, 1e-320])
@pytest.mark.parametrize("key", ["turns", "llm_s", "reset_s"])
def test_a_lognormal_too_wide_to_draw_is_refused_in_one_line(key: str, median: float) -> None:
    # A tiny median made the 6-sigma check pass (its exponent was capped at 700 before the median
    # scaled it back down), and the first wide draw raised OverflowError: a traceback out of `corral sim`.
    # With p90 / median beyond a float (1e-320), sigma was infinite and every draw inf or 0, silently.
    with pytest.raises(WorkloadError, match=rf"trajectory\.{key}: draws would reach [0-9.]+e\+[0-9]+ "):
        parse_workload({"trajectory": {key: {"lognormal": {"median": median, "p90": 1e6}}}}, "w.yaml")


@pytest.mark.parametrize("value", [0, -1, 10**9, 2.0, "2", True, float("nan")])
def test_bad_updating_engines_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(WorkloadError, match=r"policy\.max_updating_engines"):
        parse_workload({"policy": {"max_updating_engines": value}}, "w.yaml")


def test_trajectories_are_keyed_by_group_and_attempt_not_by_order() -> None:
    workload = Workload.model_validate(make_small())
    forward, backward = TrajectorySource(workload), TrajectorySource(workload)
    keys = [(g, a) for g in range(6) for a in range(2)]
    first = [forward.trajectory(g, a) for g, a in keys]
    second = [backward.trajectory(g, a) for g, a in reversed(keys)]
    assert first == list(reversed(second))
    other = TrajectorySource(Workload.model_validate(make_small(seed=4)))
    assert [other.trajectory(g, a) for g, a in keys] != first


def test_drawn_trajectories_respect_their_distributions() -> None:
    source = TrajectorySource(Workload.model_validate(make_small()))
    for g in range(20):
        resets = set()
        for a in range(2):
            t = source.trajectory(g, a)
            resets.add(t.reset_s)
            assert 0.5 <= t.reset_s <= 2
            assert t.validate_s == 1
            assert t.cleanup_s == 1
            assert len(t.turns) >= 1
            assert t.reward in (0.0, 1.0)
            assert t.agent_s <= t.timeout_s
        assert len(resets) == 1  # set-up cost belongs to the task, shared by the group's attempts


# -- traces --------------------------------------------------------------------------------------------


def write_trace(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TURN_3 = {"llm_s": 2.0, "tool_s": 1.0}
TURN_2_5 = {"llm_s": 2.0, "tool_s": 0.5}


def attempt(task: str, agent_s: float, reward: float = 1.0, **extra: Any) -> dict[str, Any]:
    return {
        "task": task,
        "reset_s": 1.0,
        "agent_s": agent_s,
        "validate_s": 2.0,
        "cleanup_s": 3.0,
        "reward": reward,
        **extra,
    }


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    records = [attempt("a", 10 + i, reward=i % 2) for i in range(4)]
    records += [attempt("b", 100 + i) for i in range(3)]
    # agent_s also holds time between turns; the turns are what the simulator replays.
    records.append(attempt("c", 9, turns=[{"llm_s": 2.0, "tool_s": 1.0}, {"llm_s": 4.0, "tool_s": 0.5}]))
    return write_trace(tmp_path / "trace.jsonl", records)


def test_trace_loads_attempts_grouped_by_task(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    assert sorted(trace) == ["a", "b", "c"]
    assert [r.agent_s for r in trace["a"]] == [10, 11, 12, 13]
    assert [r.reward for r in trace["a"]] == [0, 1, 0, 1]
    assert all(r.turns is None for r in trace["a"] + trace["b"])
    (c,) = trace["c"]
    assert c.turns is not None
    assert [(t.llm_s, t.tool_s) for t in c.turns] == [(2.0, 1.0), (4.0, 0.5)]
    assert c.agent_s == pytest.approx(7.5)  # recorded turns are the truth, not the agent_s field


def trace_workload(trace_file: Path, **overrides: Any) -> Workload:
    data = make_small(trace={"path": str(trace_file), "llm_fraction": 0.75}, **overrides)
    data["trajectory"] = {"turns": {"uniform": [3, 6]}, "timeout_s": 1000}
    return parse_workload(data)


def test_groups_draw_from_one_tasks_recorded_attempts(trace_file: Path) -> None:
    trace = load_trace(trace_file)
    workload = trace_workload(trace_file, batch={"groups": 2, "group_size": 4})
    source = TrajectorySource(workload)
    tasks_seen = set()
    for g in range(30):
        members = [source.trajectory(g, a) for a in range(4)]
        # every attempt of a group is a recorded attempt of the same task
        matching = [
            task
            for task, recs in trace.items()
            if all(any(m.agent_s == pytest.approx(r.agent_s) for r in recs) for m in members)
        ]
        assert len(matching) == 1, (g, [m.agent_s for m in members])
        tasks_seen.add(matching[0])
        for m in members:
            assert (m.reset_s, m.validate_s, m.cleanup_s) == (1.0, 2.0, 3.0)
    assert tasks_seen == {"a", "b", "c"}
    again = TrajectorySource(workload)
    assert [again.trajectory(g, 1) for g in range(30)] == [source.trajectory(g, 1) for g in range(30)]


def test_agent_time_is_split_into_turns_when_the_trace_has_none(trace_file: Path) -> None:
    source = TrajectorySource(trace_workload(trace_file))
    split = recorded = 0
    for g in range(40):
        t = source.trajectory(g, 0)
        total = sum(turn.llm_s + turn.tool_s for turn in t.turns)
        if t.agent_s != pytest.approx(7.5):  # tasks a and b carry no turns
            split += 1
            assert 3 <= len(t.turns) <= 6  # the workload's turn distribution
            llm = sum(turn.llm_s for turn in t.turns)
            assert llm == pytest.approx(0.75 * total)  # trace.llm_fraction
            assert all(turn.llm_s > 0 and turn.tool_s > 0 for turn in t.turns)
        else:
            recorded += 1
            assert [(x.llm_s, x.tool_s) for x in t.turns] == [(2.0, 1.0), (4.0, 0.5)]
        assert total in (pytest.approx(7.5), *(pytest.approx(v) for v in (10, 11, 12, 13, 100, 101, 102)))
    assert split
    assert recorded


def test_relative_trace_path_is_read_next_to_the_workload_file(tmp_path: Path, trace_file: Path) -> None:
    spec = tmp_path / "w.yaml"
    spec.write_text(json.dumps(make_small(trace=trace_file.name)))
    workload = load_workload(spec)
    assert workload.trace is not None
    assert workload.trace.path == tmp_path / "trace.jsonl"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty"),
        ("\n  \n", "empty"),
        (json.dumps(attempt("a", 1)) + "\n{not json\n", "line 2: not JSON"),
        ('{"task": "a", "reset_s": 1, "validate_s": 1, "cleanup_s": 1, "reward": 1}\n', "line 1: agent_s"),
        (json.dumps(attempt("a", -1)) + "\n", "line 1: agent_s"),
        (json.dumps(attempt("a", 1, turns=[{"llm_s": 1}])) + "\n", "line 1: turns.0.tool_s"),
        (json.dumps(attempt("a", 1)) + "\n[1, 2]\n", "line 2: each line must be a JSON object"),
        (json.dumps(attempt("a", 1, reward=7)) + "\n", r"line 1: reward: .* 1, not 7"),  # rewards: [0, 1]
        (json.dumps(attempt("a", 1, reward=-0.5)) + "\n", r"line 1: reward: .* 0, not -0.5"),
        # Taken, and replayed as 5.5 s of agent time: the turns, not agent_s, are what the simulator runs.
        (
            json.dumps(attempt("a", 1)) + "\n" + json.dumps(attempt("a", 5, turns=[TURN_3, TURN_2_5])) + "\n",
            r"line 2: its turns add up to 5\.5 s, more than its agent_s of 5 s",
        ),
    ],
)
def test_bad_trace_is_refused_naming_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        load_trace(path)
    with pytest.raises(WorkloadError, match=message):
        parse_workload({"trace": str(path)})  # refused at load time, not mid-run


def test_turns_may_add_up_to_less_than_agent_s_or_more_by_their_rounding(tmp_path: Path) -> None:
    # Time between turns is agent time no turn holds; a line written to milliseconds rounds each figure.
    turns = [{"llm_s": 0.001, "tool_s": 0.001}] * 3
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps(attempt("a", 9, turns=[TURN_3])) + "\n" + json.dumps(attempt("a", 0.002, turns=turns))
    )
    assert [r.agent_s for r in load_trace(path)["a"]] == [3, pytest.approx(0.006)]


def test_a_trace_takes_rewards_from_0_to_1(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(attempt("a", 1, reward=r)) + "\n" for r in (0, 0.25, 1)))
    assert [r.reward for r in load_trace(path)["a"]] == [0, 0.25, 1]


def test_trace_workload_simulates_end_to_end(trace_file: Path) -> None:
    workload = trace_workload(trace_file)
    report = simulate(workload, policy_for(workload, "full"), "full")
    assert report["batches"] == 2
    assert report["lost_groups"] == 0
    assert report["max_groups_running"] <= 2 + 2  # B + S caps groups in flight (in-flight admission)
    assert report["max_staleness"] <= 2
    assert len(report["batch_collection_s"]["per_batch"]) == 2


def test_borrowing_serving_cpus_needs_work_conserving_lanes() -> None:
    ok = Workload.model_validate({"lanes": {"borrow_serving_cpus": True}})
    assert ok.lanes.borrow_serving_cpus
    with pytest.raises(ValueError, match="borrow_serving_cpus needs work_conserving lanes"):
        Workload.model_validate({"lanes": {"borrow_serving_cpus": True, "sharing": "partitioned"}})


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path: Path) -> None:
    # YAML 1.1 read `1e3` as a string, and the workload refused it as "not a valid number".
    path = tmp_path / "w.yaml"
    data = make_workload_data(trainer={"step_s": "STEP"}, trajectory={"timeout_s": "TIMEOUT"})
    text = json.dumps(data).replace('"STEP"', "1e3").replace('"TIMEOUT"', "6.0E+1")  # JSON is YAML too
    path.write_text(text)
    spec = load_workload(path)
    assert spec.trainer.step_s == 1000.0
    assert spec.trajectory.timeout_s == 60.0
    path.write_text(text.replace("1e3", "1e400"))  # past a float's range: infinity, refused as any
    with pytest.raises(WorkloadError, match=r"trainer\.step_s"):
        load_workload(path)


def test_lane_weights_too_small_to_share_the_cores_are_refused() -> None:
    # Weights 1e-320 against 1e6 passed (> 0), and the reset lane's share of the cores came out 0: the
    # simulation then raised "every lane needs a positive guaranteed share", a traceback out of `corral sim`.
    weights = {"reset": 1e-320, "exec": 1e6, "validate": 1e6, "cleanup": 1e6}
    with pytest.raises(WorkloadError, match=r"lanes\.weights\.reset: Input should be greater than or equal"):
        parse_workload(make_small(lanes={"weights": weights}), "w.yaml")
    spec = parse_workload(make_small(lanes={"weights": {**weights, "reset": 1e-6}}), "w.yaml")
    assert simulate(spec, policy_for(spec, "full"), "full")["batches"] == 2


@pytest.mark.parametrize("value", [True, "2"])
def test_lane_weights_are_numbers_as_typed(value: Any) -> None:
    # Every other number in a workload is strict; `weights: {reset: true}` ran as weight 1, `"2"` as 2.
    weights = {"reset": value, "exec": 1, "validate": 1, "cleanup": 1}
    with pytest.raises(WorkloadError, match=r"lanes\.weights\.reset: Input should be a valid number"):
        parse_workload(make_small(lanes={"weights": weights}), "w.yaml")


@pytest.mark.parametrize("value", [True, "2"])
@pytest.mark.parametrize(
    "key", ["interval_s", "step", "max_factor", "min_share", "overload", "long_op_factor"]
)
def test_adaptive_lane_settings_are_numbers_as_typed(key: str, value: Any) -> None:
    # `lanes.adaptive: {step: "2"}` ran as step 2 and `{max_factor: true}` as 1, without a word.
    with pytest.raises(WorkloadError, match=rf"lanes\.adaptive\.{key}: Input should be a valid number"):
        parse_workload(make_small(lanes={"adaptive": {key: value}}), "w.yaml")


def test_too_many_turns_from_the_attempt_spread_names_the_attempt_spread() -> None:
    # `attempt_spread: 10` with the default turns was refused as "turns: ... give a smaller p90 or a
    # lognormal max", naming neither the key typed nor the fix, in a 29-digit number.
    with pytest.raises(WorkloadError) as raised:
        parse_workload({"trajectory": {"attempt_spread": 10}}, "w.yaml")
    message = str(raised.value)
    assert "attempt_spread 10" in message
    assert "about 5.28e+28 turns per attempt" in message


class _FixedGauss:
    """An rng whose normal draws are given: the far tail, without waiting a billion draws for it."""

    def __init__(self, *sigmas: float) -> None:
        self.sigmas = list(sigmas)

    def gauss(self, mu: float, sigma: float) -> float:
        return mu + self.sigmas.pop(0) * sigma


def test_a_lognormal_draw_far_in_its_tail_is_held_to_the_limit_never_an_overflow() -> None:
    # A tiny median with a wide spread passes the 6-sigma check, and e^z alone overflowed at about 5.6 σ:
    # `corral sim` died in an OverflowError traceback, about once in 10^8 draws.
    from app.sim.workload import Dist
    from app.validation import MAX_SECONDS

    dist = Dist.model_validate(
        {"lognormal": {"median": 1e-320, "p90": 1e-320 * math.exp(1.2815515655 * 120)}}
    )
    assert dist.upper() <= MAX_SECONDS
    far, farther, near = (
        dist.draw(_FixedGauss(5.95)),
        dist.draw(_FixedGauss(9.0)),
        dist.draw(_FixedGauss(1.0)),
    )
    assert 0 < far <= MAX_SECONDS
    assert farther == pytest.approx(MAX_SECONDS)
    assert near == pytest.approx(1e-320 * math.exp(120), rel=1e-9)
    capped = Dist.model_validate({"lognormal": {"median": 10.0, "p90": 20.0, "max": 30.0}})
    assert capped.draw(_FixedGauss(50.0)) == 30.0
