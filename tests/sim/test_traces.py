"""Trace import: a synthetic terminal-bench run directory and a `corral run` event stream."""

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from app.sim.traces import (
    AGENT_CUT,
    MAX_EXAMPLES,
    NO_RESULTS,
    TEST_CUT,
    attempts_from_events,
    import_corral_run,
    import_terminal_bench,
    terminal_bench_record,
    write_trace,
)
from app.sim.workload import TrajectorySource, Workload, WorkloadError, load_trace, trace_line_problem


def make_trial(task: str, trial: str, resolved: bool | None, **overrides: str | None) -> dict:
    stamps = {
        "trial_started_at": "2025-06-01T10:00:00+00:00",
        "agent_started_at": "2025-06-01T10:00:07+00:00",
        "agent_ended_at": "2025-06-01T10:04:37+00:00",
        "test_started_at": "2025-06-01T10:04:40+00:00",
        "test_ended_at": "2025-06-01T10:04:45.500000+00:00",
        "trial_ended_at": "2025-06-01T10:04:58.500000+00:00",
    }
    stamps.update(overrides)
    return {"task_id": task, "trial_name": trial, "is_resolved": resolved, **stamps}


def write_run(root: Path, trials: list[dict]) -> Path:
    run = root / "runs" / "2025-06-01__10-00-00"
    for trial in trials:
        trial_dir = run / trial["task_id"] / trial["trial_name"]
        trial_dir.mkdir(parents=True)
        (trial_dir / "results.json").write_text(json.dumps(trial))
    # The run-level summary repeats the same trials; they must not count twice.
    (run / "results.json").write_text(json.dumps({"results": trials}))
    return run


def test_terminal_bench_phases_map_to_trace_fields(tmp_path: Path) -> None:
    run = write_run(
        tmp_path,
        [
            make_trial("hello-world", "hello-world.1-of-2", True),
            make_trial("hello-world", "hello-world.2-of-2", False),
            make_trial("broken", "broken.1-of-1", None, agent_started_at=None),
        ],
    )
    result = import_terminal_bench(run)
    assert len(result.records) == 2
    assert result.skipped == {"no agent start/end": 1}
    assert result.examples == {"no agent start/end": [str(run / "broken" / "broken.1-of-1")]}
    first = result.records[0]
    assert first == {
        "task": "hello-world",
        "reset_s": 7.0,
        "agent_s": 270.0,
        "validate_s": 5.5,
        "cleanup_s": 13.0,
        "reward": 1.0,
    }
    assert sorted(r["reward"] for r in result.records) == [0.0, 1.0]


def test_a_terminal_bench_import_reports_each_file_read_of_all(tmp_path: Path) -> None:
    """30,000 trials took 10 s here with nothing on stderr; `corral trace import` now shows how far it
    is from these reports (a bar, or `trace import: 4808/30000 results.json files, 5 s` in a log)."""
    run = write_run(tmp_path, [make_trial("t", f"t.{i}-of-3", True) for i in range(3)])
    reported: list[tuple[int, int]] = []
    import_terminal_bench(run, on_file=lambda read, total: reported.append((read, total)))
    assert reported == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)]  # 3 trials and the run's summary


def test_a_file_that_begins_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    """A results.json or report saved by an editor that writes a UTF-8 byte-order mark was skipped as
    "not JSON"."""
    run = write_run(tmp_path, [make_trial("t", "t.1", True)])
    trial = run / "t" / "t.1" / "results.json"
    trial.write_bytes(b"\xef\xbb\xbf" + trial.read_bytes())
    (run / "results.json").unlink()
    result = import_terminal_bench(run)
    assert len(result.records) == 1
    assert not result.skipped
    report = tmp_path / "report.json"
    report.write_bytes(b"\xef\xbb\xbf" + json.dumps({"event_log": make_events()}).encode())
    assert import_corral_run(report).records == [COUNT_PRIMES]


def test_unnamed_trials_each_count_once(tmp_path: Path) -> None:
    """Trials without a trial_name were known by their directory: in a run's summary that is the run's,
    so every unnamed trial of a task but the first was dropped, and counted nowhere. A trial file and
    the summary's copy of it still count once."""
    trials = [make_trial("t", "", True, agent_ended_at=f"2025-06-01T10:0{i}:00+00:00") for i in (1, 2, 3)]
    for trial in trials:
        del trial["trial_name"]
    summary_only = tmp_path / "summary"
    summary_only.mkdir()
    (summary_only / "results.json").write_text(json.dumps({"results": trials}))
    result = import_terminal_bench(summary_only)
    assert sorted(r["agent_s"] for r in result.records) == [53.0, 113.0, 173.0]
    assert not result.skipped
    both = tmp_path / "both"
    for i, trial in enumerate(trials):
        (both / "t" / f"trial-{i}").mkdir(parents=True)
        (both / "t" / f"trial-{i}" / "results.json").write_text(json.dumps(trial))
    (both / "results.json").write_text(json.dumps({"results": trials}))
    assert len(import_terminal_bench(both).records) == 3


def test_imported_trace_loads_in_the_simulator(tmp_path: Path) -> None:
    run = write_run(tmp_path, [make_trial("t", f"t.{i}", i % 2 == 0) for i in range(4)])
    out = tmp_path / "trace.jsonl"
    assert write_trace(import_terminal_bench(run).records, out) == 4
    by_task = load_trace(out)
    assert len(by_task["t"]) == 4


def test_a_directory_without_trials_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no usable terminal-bench trial"):
        import_terminal_bench(tmp_path)
    with pytest.raises(WorkloadError, match="missing: no such directory"):
        import_terminal_bench(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(WorkloadError, match="file: not a directory"):
        import_terminal_bench(tmp_path / "file")


def make_op(lane: str, start: float, end: float, attempt: int = 0) -> dict:
    return {"kind": "sandbox_op", "group_id": 0, "attempt": attempt, "lane": lane,
            "queued_at": start, "start": start, "end": end}  # fmt: skip


def make_turn(start: float, end: float, attempt: int = 0) -> dict:
    return {"kind": "turn", "group_id": 0, "attempt": attempt, "engine": "e0", "version": 0,
            "queued_at": start, "start": start, "end": end, "tokens": 8}  # fmt: skip


def make_events() -> list:
    """One group: attempt 0 finishes (its cleanup after it reports), attempt 1 fails."""
    return [
        {"kind": "group_admitted", "group_id": 0, "task_index": 0, "group_size": 2, "task": "count-primes"},
        make_op("reset", 0.5, 2.5),
        make_turn(2.5, 3.5),
        make_op("exec", 3.5, 5.5),
        make_op("validate", 6, 7),
        {"kind": "attempt_finished", "group_id": 0, "attempt": 0, "reward": 1.0, "error": None},
        make_op("cleanup", 7, 7.25),
        {"kind": "attempt_finished", "group_id": 0, "attempt": 1, "reward": 0.0, "error": "SandboxError"},
    ]  # fmt: skip


COUNT_PRIMES = {
    "task": "count-primes",
    "reset_s": 2.0,
    "agent_s": 3.0,
    "validate_s": 1.0,
    "cleanup_s": 0.25,
    "reward": 1.0,
    "turns": [{"llm_s": 1.0, "tool_s": 2.0}],
}


FINISHED_0 = {"kind": "attempt_finished", "group_id": 0, "attempt": 0, "reward": 1.0, "error": None}


def test_corral_run_events_give_one_line_per_finished_attempt() -> None:
    records, skipped = attempts_from_events(make_events())
    assert skipped == {"failed": 1}
    assert records == [COUNT_PRIMES]


def test_each_turn_gets_the_tool_calls_it_asked_for_and_a_failed_turn_is_no_model_time() -> None:
    # From a real report: a turn cut short by an engine outage (error, 16.4 s) became 16.4 s of model
    # time, and 5 exec calls of 3.74, 2.05, 1.18, 5.84 and 2.05 s became equal shares over the turns.
    failed = {**make_turn(3, 19.4), "error": "TimeoutError: ", "version": -1, "tokens": 0}
    events = [
        {"kind": "group_admitted", "group_id": 0, "task_index": 0, "group_size": 1, "task": "t"},
        make_turn(1, 2),
        make_op("exec", 2, 5),  # the first turn's call
        failed,
        make_turn(19.5, 20),  # the retry of the failed turn: its calls follow
        make_op("exec", 20, 21),
        make_op("exec", 21, 21.5),
        make_turn(22, 22.25),  # a last turn that called nothing
        {"kind": "attempt_finished", "group_id": 0, "attempt": 0, "reward": 1.0, "error": None},
    ]
    records, skipped = attempts_from_events(events)
    assert skipped == {}
    assert records[0]["turns"] == [
        {"llm_s": 1.0, "tool_s": 3.0}, {"llm_s": 0.5, "tool_s": 1.5}, {"llm_s": 0.25, "tool_s": 0.0}
    ]  # fmt: skip
    assert records[0]["agent_s"] == 1.75 + 4.5


def test_an_attempt_cancelled_with_its_group_is_a_censored_line() -> None:
    # Skipped before: a run's slowest groups are those still running at its end, so its trace lacked its
    # slowest work (`full` replayed on its own attempts gave 3.5 s against 28.6 s real).
    events = [
        {**make_events()[0], "group_size": 3},
        *make_events()[1:5],
        make_op("reset", 0.5, 40.5, attempt=1),
        make_turn(40.5, 41.5, attempt=1),
        {"kind": "attempt_cancelled", "group_id": 0, "attempt": 1, "reason": "stale"},
        {"kind": "attempt_cancelled", "group_id": 0, "attempt": 2, "reason": "stale"},
        make_op("exec", 41.5, 44.0, attempt=1),  # cut short by the cancel: published after it
        *make_events()[5:7],  # attempt 0 finishes, then its cleanup
        make_op("cleanup", 44.0, 44.5, attempt=1),
    ]
    records, skipped = attempts_from_events(events)
    assert skipped == {"cancelled before it started": 1}
    assert records[0] == COUNT_PRIMES
    assert records[1] == {
        "task": "count-primes",
        "reset_s": 40.0,
        "agent_s": 3.5,
        "validate_s": 0.0,
        "cleanup_s": 0.5,
        "reward": 0.0,
        "turns": [{"llm_s": 1.0, "tool_s": 2.5}],
        "censored": True,
    }


def _draws(tmp_path: Path, lines: list[dict], n: int = 300) -> Counter[float]:
    trace = tmp_path / "censored.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = TrajectorySource(Workload.model_validate({"trace": {"path": str(trace)}}))
    return Counter(round(source.trajectory(g, 0).duration_s, 6) for g in range(n))


def _attempt(seconds: float, censored: bool = False, task: str = "a") -> dict:
    return {"task": task, "reset_s": seconds, "agent_s": 0.0, "validate_s": 0.0, "cleanup_s": 0.0,
            "reward": 1.0, "censored": censored}  # fmt: skip


def test_a_censored_attempt_is_replayed_as_a_finished_one_at_least_as_long(tmp_path: Path) -> None:
    drawn = _draws(tmp_path, [_attempt(10), _attempt(100), _attempt(40, censored=True)])
    assert set(drawn) == {10.0, 100.0}  # 40 s never: it stands for an attempt of at least 40 s
    assert drawn[100.0] > drawn[10.0]  # a third of the draws pick the 100 s one, another third by the cut


def test_a_censored_attempt_longer_than_every_finished_one_is_its_own_lower_bound(tmp_path: Path) -> None:
    drawn = _draws(tmp_path, [_attempt(10), _attempt(500, censored=True)])
    assert set(drawn) == {10.0, 500.0}


def test_a_trace_line_takes_only_a_boolean_censored(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(json.dumps({**_attempt(10), "censored": "yes"}) + "\n")
    with pytest.raises(WorkloadError, match="line 1: censored"):
        load_trace(trace)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({**FINISHED_0, "attempt": 0}, "a second finish of one attempt"),
        ({**FINISHED_0, "attempt": 99}, "an attempt index outside its group"),
        ({**FINISHED_0, "attempt": -5}, "an attempt index outside its group"),
        ({**FINISHED_0, "group_id": 7}, "no sandbox op and no turn recorded"),
    ],
)
def test_a_finish_no_real_attempt_reports_is_skipped_with_its_reason(extra: dict, why: str) -> None:
    """Each of these became a line of zero seconds and reward 1 (the audit's duplicated, out-of-range and
    span-less finishes), and a simulation of the trace then collected batches in 0.0 s."""
    records, skipped = attempts_from_events([*make_events(), extra])
    assert records == [COUNT_PRIMES]
    assert skipped == {"failed": 1, why: 1}


def without(event: dict, key: str) -> dict:
    return {k: v for k, v in event.items() if k != key}


FINISHED = make_events()[5]

MALFORMED_EVENTS = {
    "sandbox_op without group_id": (
        without(make_op("exec", 1, 2), "group_id"),
        ["sandbox_op", "no group_id"],
    ),
    "sandbox_op without lane": (without(make_op("exec", 1, 2), "lane"), ["sandbox_op", "no lane"]),
    "turn without attempt": (without(make_turn(1, 2), "attempt"), ["turn", "no attempt"]),
    "group_id a string": ({**make_op("exec", 1, 2), "group_id": "x"}, ['group_id is "x"', "not an integer"]),
    "group_id a boolean": (
        {**make_op("exec", 1, 2), "group_id": True},
        ["group_id is true", "not an integer"],
    ),
    "lane a number": ({**make_op("exec", 1, 2), "lane": 3}, ["lane is 3", "not a name"]),
    "reward a word": ({**FINISHED, "reward": "abc"}, ['reward is "abc"', "not a finite number"]),
    "reward the string NaN": ({**FINISHED, "reward": "NaN"}, ['reward is "NaN"', "not a finite number"]),
    "reward NaN": ({**FINISHED, "reward": math.nan}, ["reward is NaN", "not a finite number"]),
    "no reward": (without(FINISHED, "reward"), ["attempt_finished", "no reward"]),
    "end the string inf": ({**make_op("exec", 1, 2), "end": "inf"}, ['end is "inf"', "not a finite number"]),
    "start -Infinity": (
        {**make_turn(1, 2), "start": -math.inf},
        ["start is -Infinity", "not a finite number"],
    ),
    "null": (None, ["is null", "not an event object"]),
    "a string": ("oops", ['is "oops"', "not an event object"]),
}


@pytest.mark.parametrize(("event", "needles"), MALFORMED_EVENTS.values(), ids=MALFORMED_EVENTS.keys())
def test_a_malformed_event_is_refused_naming_its_index(event: object, needles: list[str]) -> None:
    events = make_events()
    events.insert(3, event)
    with pytest.raises(WorkloadError) as refused:
        attempts_from_events(events)
    message = str(refused.value)
    assert message.startswith("event_log[3]")
    for needle in needles:
        assert needle in message


def test_a_corral_run_report_with_a_malformed_event_is_refused_naming_the_report(tmp_path: Path) -> None:
    events = make_events()
    events[5] = {**FINISHED, "reward": math.nan}
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"event_log": events}))  # a JSON NaN literal, as Python writes it
    with pytest.raises(WorkloadError, match=r"report\.json: event_log\[5\]: attempt_finished reward is NaN"):
        import_corral_run(report)


BACKWARDS = {
    "a reset op": (1, make_op("reset", 2.5, 0.5), "a sandbox op ends before it starts"),
    "a turn": (2, make_turn(3.5, 2.5), "a turn ends before it starts"),
    "a cleanup after the attempt reports": (
        6,
        make_op("cleanup", 7.25, 7),
        "a sandbox op ends before it starts",
    ),
}


@pytest.mark.parametrize(("index", "event", "why"), BACKWARDS.values(), ids=BACKWARDS.keys())
def test_an_attempt_with_a_span_that_runs_backwards_is_skipped_with_its_reason(
    index: int, event: dict, why: str
) -> None:
    """Attempt 0 of group 0 has the backwards span; the same attempt in group 1 is imported."""
    good = [{**e, "group_id": 1} for e in make_events()[:7]]
    events = make_events()
    events[index] = event
    records, skipped = attempts_from_events([*events, *good])
    assert skipped == {why: 1, "failed": 1}
    assert records == [COUNT_PRIMES]


@pytest.mark.parametrize("reward", [7.0, -1.0])
def test_an_attempt_with_a_reward_outside_0_to_1_is_skipped_with_its_reason(reward: float) -> None:
    # It was imported, and the simulator then loaded and replayed a reward of 7.
    events = make_events()
    events[5] = {**events[5], "reward": reward}
    records, skipped = attempts_from_events(events)
    assert records == []
    assert skipped == {"reward outside [0, 1]": 1, "failed": 1}


def test_a_line_whose_turns_add_up_to_more_than_agent_s_is_not_imported() -> None:
    assert trace_line_problem({**COUNT_PRIMES, "agent_s": 2.5}) == "turns add up to more than agent_s"
    assert trace_line_problem(COUNT_PRIMES) is None


def test_turns_rounded_to_milliseconds_still_load() -> None:
    # Each turn's tool time is rounded apart from agent_s: three calls of 0.6 ms are written as 1 ms in
    # each turn, and agent_s takes their 1.8 ms as 2 ms.
    events = make_events()
    events[2:4] = [
        e for i in range(3) for e in (make_turn(3 + i, 3.5 + i), make_op("exec", 3.5 + i, 3.5006 + i))
    ]
    records, skipped = attempts_from_events(events)
    assert skipped == {"failed": 1}
    assert records[0]["agent_s"] == 1.502
    assert [t["tool_s"] for t in records[0]["turns"]] == [0.001] * 3


def test_durations_too_large_to_add_up_are_skipped() -> None:
    events = make_events()
    events[3:4] = [make_op("exec", -1e308, 1e308)]
    records, skipped = attempts_from_events(events)
    assert records == []
    assert skipped == {"agent_s over 1,000,000 s": 1, "failed": 1}


def test_every_trial_file_not_imported_is_counted_with_its_reason(tmp_path: Path) -> None:
    run = write_run(tmp_path, [make_trial("good", "good.1-of-1", True)])
    for name, content in {
        "truncated": b'{"task_id": "truncated", "trial_name": ',
        "binary": bytes(range(256)),
        "list": b"[1, 2, 3]",
        "number": b"42",
    }.items():
        (run / name / f"{name}.1-of-1").mkdir(parents=True)
        (run / name / f"{name}.1-of-1" / "results.json").write_bytes(content)
    (run / "summary").mkdir()
    (run / "summary" / "results.json").write_text(
        json.dumps({"results": [make_trial("good", "good.1-of-1", True), "x"]})
    )
    result = import_terminal_bench(run)
    assert len(result.records) == 1
    assert result.skipped == {"not JSON": 2, "not an object": 3}


BAD_TRIALS = {
    "reset runs backwards": ({"trial_started_at": "2025-06-01T10:00:09+00:00"}, "timestamps run backwards"),
    "validate runs backwards": ({"test_ended_at": "2025-06-01T10:04:39+00:00"}, "timestamps run backwards"),
    "cleanup runs backwards": ({"trial_ended_at": "2025-06-01T10:04:44+00:00"}, "timestamps run backwards"),
    "cleanup without a test runs backwards": (
        {"test_started_at": None, "test_ended_at": None, "trial_ended_at": "2025-06-01T10:04:30+00:00"},
        "timestamps run backwards",
    ),
    "agent ends before it starts": (
        {"agent_ended_at": "2025-06-01T10:00:06+00:00"},
        "agent ends before it starts",
    ),
    "a time that is not one": ({"test_started_at": "yesterday"}, "test_started_at is not a time"),
    "a time that is a number": ({"trial_ended_at": 1717236298}, "trial_ended_at is not a time"),
    "naive and zoned times": (
        {"trial_ended_at": "2025-06-01T10:05:00"},
        "timestamps mix naive and zoned times",
    ),
    "is_resolved a word": ({"is_resolved": "yes"}, "is_resolved is not a boolean"),
    "is_resolved a number": ({"is_resolved": 1}, "is_resolved is not a boolean"),
    # imported, and then the simulator refused the whole trace at this line (agent_s: 251,698,233,594 s)
    "an agent end far off": (
        {
            "agent_ended_at": "9999-12-31T23:59:59+00:00",
            "test_started_at": None,
            "test_ended_at": None,
            "trial_ended_at": None,
        },
        "agent_s over 1,000,000 s",
    ),
}


@pytest.mark.parametrize(("overrides", "why"), BAD_TRIALS.values(), ids=BAD_TRIALS.keys())
def test_a_trial_with_bad_times_or_outcome_is_skipped_with_its_reason(
    tmp_path: Path, overrides: dict, why: str
) -> None:
    run = write_run(
        tmp_path, [make_trial("good", "good.1", True), {**make_trial("bad", "bad.1", True), **overrides}]
    )
    result = import_terminal_bench(run)
    assert [r["task"] for r in result.records] == ["good"]
    assert result.skipped == {why: 1}
    out = tmp_path / "trace.jsonl"  # what is imported loads
    assert write_trace(result.records, out) == 1
    assert list(load_trace(out)) == ["good"]


def test_missing_phase_times_count_as_zero_and_null_is_resolved_as_unresolved(tmp_path: Path) -> None:
    trial = make_trial("t", "t.1", None, trial_started_at=None, test_started_at=None, test_ended_at=None)
    result = import_terminal_bench(write_run(tmp_path, [trial]))
    assert result.skipped == {}
    assert result.records == [
        {"task": "t", "reset_s": 0.0, "agent_s": 270.0, "validate_s": 0.0, "cleanup_s": 21.5, "reward": 0.0}
    ]


def test_a_trial_that_never_wrote_its_results_is_counted(tmp_path: Path) -> None:
    run = write_run(tmp_path, [make_trial("t", "t.1-of-3", True), make_trial("t", "t.2-of-3", False)])
    # The third trial was killed: its directory has logs but no results.json, and the run-level
    # summary (written by write_run) does not name it.
    (run / "t" / "t.3-of-3" / "agent-logs").mkdir(parents=True)
    (run / "t" / "t.3-of-3" / "commands.txt").write_text("ls\n")
    # A trial the summary names although its own file is missing is not counted twice.
    summary = json.loads((run / "results.json").read_text())
    summary["results"].append(make_trial("u", "u.1-of-1", True))
    (run / "results.json").write_text(json.dumps(summary))
    (run / "u" / "u.1-of-1").mkdir(parents=True)
    (run / "t" / "t.1-of-3" / "sessions").mkdir()  # a trial's own subdirectory is no trial
    result = import_terminal_bench(run)
    assert len(result.records) == 3
    assert result.skipped == {NO_RESULTS: 1}


def test_a_trial_whose_agent_or_tests_never_ended_imports_with_the_time_its_sandbox_was_held(
    tmp_path: Path,
) -> None:
    """A crashed agent (terminal-bench: failure_mode unknown_agent_error, agent_ended_at null) was
    skipped, so a trace replayed attempts that never die; a test timeout (test_ended_at null) had its
    test time counted as cleanup. Each is imported with the time its sandbox was held, and counted."""
    crashed = make_trial("c", "c.1", False, agent_ended_at=None)
    crashed["failure_mode"] = "unknown_agent_error"
    crashed_untested = make_trial(
        "c", "c.2", None, agent_ended_at=None, test_started_at=None, test_ended_at=None
    )
    test_timeout = make_trial("t", "t.1", False, test_ended_at=None)
    both = make_trial("b", "b.1", False, agent_ended_at=None, test_ended_at=None)
    never_ended = make_trial(
        "n", "n.1", None, agent_ended_at=None, test_started_at=None, test_ended_at=None, trial_ended_at=None
    )
    result = import_terminal_bench(
        write_run(tmp_path, [crashed, crashed_untested, test_timeout, both, never_ended])
    )
    by_task = {(r["task"], r["agent_s"]): r for r in result.records}
    # agent start 10:00:07; test start 10:04:40; trial end 10:04:58.5
    assert by_task[("c", 273.0)] == {
        "task": "c",
        "reset_s": 7.0,
        "agent_s": 273.0,
        "validate_s": 5.5,
        "cleanup_s": 13.0,
        "reward": 0.0,
    }
    assert by_task[("c", 291.5)] == {
        "task": "c",
        "reset_s": 7.0,
        "agent_s": 291.5,
        "validate_s": 0.0,
        "cleanup_s": 0.0,
        "reward": 0.0,
    }
    assert by_task[("t", 270.0)] == {
        "task": "t",
        "reset_s": 7.0,
        "agent_s": 270.0,
        "validate_s": 18.5,
        "cleanup_s": 0.0,
        "reward": 0.0,
    }
    assert by_task[("b", 273.0)]["validate_s"] == 18.5
    assert result.assumed == {AGENT_CUT: 3, TEST_CUT: 2}
    assert result.skipped == {"no agent start/end": 1}
    # with no test, the crashed agent held its sandbox from trial start to trial end, 298.5 s
    assert sum(v for k, v in by_task[("c", 291.5)].items() if k.endswith("_s")) == 298.5


def test_an_unreadable_run_summary_is_no_skipped_trial_and_skipped_trials_are_named(tmp_path: Path) -> None:
    """A truncated run-level results.json was counted as a skipped trial ("not JSON"), though every
    trial had been read from its own file; and no skipped trial was named, so among thousands a user
    could not find them."""
    trials = [make_trial("t", f"t.{i}", True, agent_started_at=None) for i in range(MAX_EXAMPLES + 2)]
    run = write_run(tmp_path, [make_trial("good", "good.1", True), *trials])
    (run / "results.json").write_text('{"results": [')
    result = import_terminal_bench(run)
    assert len(result.records) == 1
    assert result.skipped == {"no agent start/end": MAX_EXAMPLES + 2}
    assert result.examples["no agent start/end"] == [str(run / "t" / f"t.{i}") for i in range(MAX_EXAMPLES)]
    assert result.unread == {
        "a run summary (not JSON); the trials below it were read from their own files": 1
    }
    # a broken trial file is still a skipped trial, named by its path
    (run / "good" / "good.1" / "results.json").write_text("{")
    (run / "results.json").unlink()
    with pytest.raises(WorkloadError, match="no usable"):
        import_terminal_bench(run)


def test_a_trial_file_not_read_whose_trial_a_summary_holds_is_no_skipped_trial(tmp_path: Path) -> None:
    """With a run summary listing t.1 and t.2 and t.1's own file truncated, t.1 was imported from the
    summary and counted skipped ("not JSON") as well."""
    run = write_run(tmp_path, [make_trial("t", "t.1", True), make_trial("t", "t.2", False)])
    (run / "t" / "t.1" / "results.json").write_text("{")
    result = import_terminal_bench(run)
    assert sorted(r["reward"] for r in result.records) == [0.0, 1.0]
    assert result.skipped == {}
    assert result.unread == {
        "a trial's results.json (not JSON); the trial was read from its run's summary": 1
    }


def test_a_trial_directory_imported_alone_has_no_unfinished_siblings(tmp_path: Path) -> None:
    """Importing one trial's directory counted the folders beside it, outside the import, as trials
    that never finished."""
    run = write_run(tmp_path, [make_trial("t", "t.1", True)])
    (run / "t" / "t.2-unrelated").mkdir()
    alone = import_terminal_bench(run / "t" / "t.1")
    assert len(alone.records) == 1
    assert alone.skipped == {}
    assert import_terminal_bench(run).skipped == {NO_RESULTS: 1}  # from the run's directory, it is one


def test_a_test_that_starts_before_the_agent_ends_is_skipped() -> None:
    """Its overlap was counted twice, in agent_s and validate_s: a 305 s trial imported as 530 s."""
    line, why, _ = terminal_bench_record(
        make_trial("t", "t.1", True, test_started_at="2025-06-01T10:04:00+00:00")
    )
    assert line is None
    assert why == "tests start before the agent ends"


@pytest.mark.parametrize(("tasks", "share"), [("uniform", 0.5), ("as_recorded", 0.9)])
def test_groups_pick_their_tasks_alike_or_as_often_as_the_trace_holds_them(
    tmp_path: Path, tasks: str, share: float
) -> None:
    """A `corral run` trace holds each task as often as that run picked it (its fast tasks most, here);
    `as_recorded` replays that mix, `uniform` (the default) gives every task the same chance."""
    from app.sim.workload import TrajectorySource, Workload

    line = {"reset_s": 1.0, "agent_s": 2.0, "validate_s": 1.0, "cleanup_s": 0.0, "reward": 1.0}
    often = [json.dumps({**line, "task": "often"})] * 90
    rarely = [json.dumps({**line, "task": "rarely", "reset_s": 7.0})] * 10
    (tmp_path / "t.jsonl").write_text("\n".join(often + rarely) + "\n")
    workload = Workload.model_validate({"trace": {"path": str(tmp_path / "t.jsonl"), "tasks": tasks}})
    source = TrajectorySource(workload)
    picked = [source.trajectory(group, 0).reset_s == 1.0 for group in range(4000)]
    assert sum(picked) / len(picked) == pytest.approx(share, abs=0.03)
    # a group's attempts all play the task it picked
    assert {source.trajectory(7, attempt).reset_s for attempt in range(8)} == {
        source.trajectory(7, 0).reset_s
    }


def test_a_corral_run_import_says_how_to_replay_it_without_counting_its_contention_twice(
    tmp_path: Path,
) -> None:
    """Replayed at the simulator's default CPU demands, a `full` run of this machine's came out 6×
    slower and behind `sync` (benchmarks/sim_vs_real.py); the import names the demands its times hold."""
    from app.sim.traces import import_corral_run

    report = Path(__file__).resolve().parents[2] / "docs" / "runs" / "stop45" / "pair1-full.json"
    notes = import_corral_run(report).notes
    assert notes == [
        "note: 24 of these attempts were cut short (cancelled with their group, or running when the run "
        "ended) and are marked censored: a replay takes for each a finished attempt of its task that took "
        "at least as long, or the cut-short one, a lower bound, where none did",
        "note: these times hold the run's own CPU contention under `full`; to replay them at its settings "
        "without counting it twice, give the workload cpus: {engine_demand: 0.5, sandbox_demand: 0.052} "
        "(docs/simulator.md, Traces); another policy's contention is not in them",
    ]
    # a report that does not say its engines and serving CPUs gets no note (and no error)
    data = json.loads(report.read_text())
    for broken in ({"engines": []}, {"cpus": None}, {"cpus": {"serving": "0"}}):
        (tmp_path / "r.json").write_text(json.dumps({**data, **broken}))
        assert import_corral_run(tmp_path / "r.json").notes == notes[:1]
    (tmp_path / "r.json").write_text(json.dumps({**data, "lane_op_demand_cores": float("nan")}))
    assert "sandbox_demand" not in import_corral_run(tmp_path / "r.json").notes[1]
