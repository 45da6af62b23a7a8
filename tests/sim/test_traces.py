"""Trace import: a synthetic terminal-bench run directory and a `corral run` event stream."""

import json
from pathlib import Path

import pytest

from app.sim.traces import attempts_from_events, import_terminal_bench, write_trace
from app.sim.workload import WorkloadError, load_trace


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
            make_trial("broken", "broken.1-of-1", None, agent_ended_at=None),
        ],
    )
    result = import_terminal_bench(run)
    assert len(result.records) == 2
    assert result.skipped == {"no agent start/end": 1}
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


def test_imported_trace_loads_in_the_simulator(tmp_path: Path) -> None:
    run = write_run(tmp_path, [make_trial("t", f"t.{i}", i % 2 == 0) for i in range(4)])
    out = tmp_path / "trace.jsonl"
    assert write_trace(import_terminal_bench(run).records, out) == 4
    by_task = load_trace(out)
    assert len(by_task["t"]) == 4


def test_a_directory_without_trials_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="no usable terminal-bench trial"):
        import_terminal_bench(tmp_path)
    with pytest.raises(WorkloadError, match="not a directory"):
        import_terminal_bench(tmp_path / "missing")


def test_corral_run_events_give_one_line_per_finished_attempt() -> None:
    def op(lane: str, start: float, end: float, attempt: int = 0) -> dict:
        return {"kind": "sandbox_op", "group_id": 0, "attempt": attempt, "lane": lane,
                "queued_at": start, "start": start, "end": end}  # fmt: skip

    events = [
        {"kind": "group_admitted", "group_id": 0, "task_index": 0, "group_size": 2, "task": "count-primes"},
        op("reset", 0.5, 2.5),
        {"kind": "turn", "group_id": 0, "attempt": 0, "engine": "e0", "version": 0, "queued_at": 2.5,
         "start": 2.5, "end": 3.5, "tokens": 8},
        op("exec", 3.5, 5.5),
        op("validate", 6, 7),
        {"kind": "attempt_finished", "group_id": 0, "attempt": 0, "reward": 1.0, "error": None},
        op("cleanup", 7, 7.25),
        {"kind": "attempt_finished", "group_id": 0, "attempt": 1, "reward": 0.0, "error": "SandboxError"},
    ]  # fmt: skip
    records, skipped = attempts_from_events(events)
    assert skipped == {"attempt failed": 1}
    assert records == [
        {
            "task": "count-primes",
            "reset_s": 2.0,
            "agent_s": 3.0,
            "validate_s": 1.0,
            "cleanup_s": 0.25,
            "reward": 1.0,
            "turns": [{"llm_s": 1.0, "tool_s": 2.0}],
        }
    ]
