"""Real traces in: terminal-bench run directories and `corral run` reports become Corral traces.

A Corral trace is JSON Lines, one recorded attempt per line, with the fields the simulator replays
(`app.sim.workload.load_trace`): task, reset_s, agent_s, validate_s, cleanup_s, reward and, where
known, turns [{llm_s, tool_s}].

terminal-bench writes one `results.json` per trial (and a run-level `results.json` whose `results`
list holds the same records). A trial record has ISO-8601 timestamps `trial_started_at`,
`agent_started_at`, `agent_ended_at`, `test_started_at`, `test_ended_at`, `trial_ended_at`, and
`is_resolved`. The phases map as:
  reset = trial start → agent start;  agent = agent start → agent end;
  validate = test start → test end;   cleanup = test end → trial end;   reward = 1 if resolved else 0.
A trial missing a timestamp the agent phase needs is skipped and counted, never guessed.

A `corral run` report carries its event stream under `event_log`; each attempt's phases are summed from
its sandbox operations (by lane) and model turns.

Invariant: every record written has finite, non-negative durations; every skipped trial is counted
with its reason.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from app.sim.workload import WorkloadError

FORMATS = ("terminal-bench", "corral-run")


@dataclass
class ImportResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    sources: int = 0


def _stamp(record: dict[str, Any], key: str) -> datetime | None:
    value = record.get(key)
    if not isinstance(value, str) or not value:
        return None
    try:
        stamp = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return stamp


def _span(record: dict[str, Any], start: str, end: str) -> float | None:
    a, b = _stamp(record, start), _stamp(record, end)
    if a is None or b is None or (a.tzinfo is None) != (b.tzinfo is None):
        return None
    seconds = (b - a).total_seconds()
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def terminal_bench_record(record: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """One trial record → one trace line, or (None, why it was skipped)."""
    task = record.get("task_id")
    if not isinstance(task, str) or not task:
        return None, "no task_id"
    agent = _span(record, "agent_started_at", "agent_ended_at")
    if agent is None:
        return None, "no agent start/end"
    reset = _span(record, "trial_started_at", "agent_started_at") or 0.0
    validate = _span(record, "test_started_at", "test_ended_at") or 0.0
    cleanup = _span(record, "test_ended_at", "trial_ended_at")
    if cleanup is None:
        cleanup = _span(record, "agent_ended_at", "trial_ended_at") or 0.0
    resolved = record.get("is_resolved")
    return {
        "task": task,
        "reset_s": round(reset, 3),
        "agent_s": round(agent, 3),
        "validate_s": round(validate, 3),
        "cleanup_s": round(cleanup, 3),
        "reward": 1.0 if resolved is True else 0.0,
    }, ""


def _trial_records(path: Path) -> Iterator[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        yield from (r for r in data["results"] if isinstance(r, dict))
    elif isinstance(data, dict):
        yield data


def import_terminal_bench(directory: Path) -> ImportResult:
    """Every trial under `directory` (any depth), each counted once by (task, trial name)."""
    if not directory.is_dir():
        raise WorkloadError(f"{directory}: not a directory")
    result = ImportResult()
    seen: set[tuple[str, str]] = set()
    # Trial files first, so a run-level summary of the same trials adds nothing twice.
    files = sorted(directory.rglob("results.json"), key=lambda p: (-len(p.parts), str(p)))
    for path in files:
        result.sources += 1
        for record in _trial_records(path):
            key = (str(record.get("task_id")), str(record.get("trial_name") or path.parent))
            if key in seen:
                continue
            seen.add(key)
            line, why = terminal_bench_record(record)
            if line is None:
                result.skipped[why] += 1
            else:
                result.records.append(line)
    if not result.records:
        raise WorkloadError(
            f"{directory}: no usable terminal-bench trial found "
            f"({result.sources} results.json files; skipped: {dict(result.skipped) or 'none'})"
        )
    return result


def import_corral_run(report_path: Path) -> ImportResult:
    """A `corral run` report's event stream → one trace line per finished attempt."""
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise WorkloadError(f"{report_path}: cannot read: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(f"{report_path}: not a JSON report ({exc})") from None
    events = report.get("event_log") if isinstance(report, dict) else None
    if not isinstance(events, list):
        raise WorkloadError(f"{report_path}: no `event_log` list; write it with a current `corral run`")
    result = ImportResult(sources=1)
    result.records, result.skipped = attempts_from_events(events)
    if not result.records:
        raise WorkloadError(f"{report_path}: no finished attempt in its events")
    return result


def attempts_from_events(events: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], Counter[str]]:
    tasks: dict[int, str] = {}
    phases: dict[tuple[int, int], dict[str, float]] = {}
    turns: dict[tuple[int, int], list[dict[str, float]]] = {}
    records: list[dict[str, Any]] = []
    finished: dict[tuple[int, int], dict[str, Any]] = {}  # cleanup runs after the attempt reports
    skipped: Counter[str] = Counter()
    for ev in events:
        kind = ev.get("kind")
        if kind == "group_admitted":
            tasks[int(ev["group_id"])] = str(ev.get("task") or f"task-{ev.get('task_index')}")
            continue
        if kind not in ("sandbox_op", "turn", "attempt_finished", "attempt_restarted"):
            continue
        key = (int(ev["group_id"]), int(ev["attempt"]))
        if kind == "attempt_restarted":
            phases.pop(key, None)
            turns.pop(key, None)
        elif kind == "sandbox_op":
            lane = str(ev["lane"])
            spent = float(ev["end"]) - float(ev["start"])
            if key in finished and lane == "cleanup":
                finished[key]["cleanup_s"] = round(finished[key]["cleanup_s"] + spent, 3)
            else:
                phases.setdefault(key, {})[lane] = phases.get(key, {}).get(lane, 0.0) + spent
        elif kind == "turn":
            turns.setdefault(key, []).append({"llm_s": float(ev["end"]) - float(ev["start"]), "tool_s": 0.0})
        else:
            if ev.get("error"):
                skipped["attempt failed"] += 1
                continue
            lanes = phases.pop(key, {})
            attempt_turns = turns.pop(key, [])
            tool = lanes.get("exec", 0.0)
            if attempt_turns:
                for turn in attempt_turns:
                    turn["tool_s"] = round(tool / len(attempt_turns), 3)
                    turn["llm_s"] = round(turn["llm_s"], 3)
            agent = sum(t["llm_s"] for t in attempt_turns) + tool
            finished[key] = record = {
                "task": tasks.get(key[0], f"group-{key[0]}"),
                "reset_s": round(lanes.get("reset", 0.0), 3),
                "agent_s": round(agent, 3),
                "validate_s": round(lanes.get("validate", 0.0), 3),
                "cleanup_s": round(lanes.get("cleanup", 0.0), 3),
                "reward": float(ev.get("reward", 0.0)),
                **({"turns": attempt_turns} if attempt_turns else {}),
            }
            records.append(record)
    return records, skipped


def write_trace(records: Iterable[dict[str, Any]], out: Path) -> int:
    """Write `records` as JSON Lines, atomically, creating missing parent directories."""
    lines = [json.dumps(r, allow_nan=False) for r in records]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(out)
    return len(lines)
