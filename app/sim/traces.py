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
A trial whose agent started and never ended (it crashed or was killed: terminal-bench's `failure_mode`
says which) held its sandbox all the same: its agent time runs to the test start, or to the trial end
when no test ran, and its outcome is as recorded (a crashed agent's trial is unresolved); a trial whose
tests started and never ended (they timed out) counts validation to the trial end and no cleanup. Each
such trial is counted in `ImportResult.assumed`. A trial with no agent start, or with neither an agent
end nor a later time to end it at, is skipped and counted; a missing timestamp of another phase counts
that phase as 0. A results.json that is not a JSON object, a time that is not ISO-8601, a span that
runs backwards or an `is_resolved` that is not a boolean (or null, which terminal-bench writes for an
unresolved trial) skips that trial, counted with its reason. A directory
beside a trial's with no results.json in it (a trial that never ended) is counted as not finished. A
run-level summary that cannot be read is no trial: it is counted apart (`ImportResult.unread`), since
the trials it lists were read from their own files. Up to `MAX_EXAMPLES` of the skipped of each reason
are named (`ImportResult.examples`), so that a user can find them among thousands.

A `corral run` report carries its event stream under `event_log`; each attempt's phases are summed from
its sandbox operations (by lane) and model turns, and its task is named by the report's `group_tasks`.
A malformed event (not an object, a missing field, a wrong type, a non-finite number) refuses the whole
report, naming its index: the report is not what `corral run` writes. An attempt that failed, or one
with an op or turn that ends before it starts, is skipped and counted with its reason, like a bad trial.
An attempt cancelled with its group (discarded, or still running when the run ended) is a line marked
`censored`: its spans up to the cancel, a lower bound on the attempt it would have been, which a replay
replaces by a finished attempt of its task that took at least as long (app.sim.workload); skipping them
left a run's slowest work out of its trace, since its slowest groups are those still running at its end.
One cancelled before any op or turn of it started is skipped. A turn an engine fault cut short (it has an
`error`; the attempt retried it) is left out of its attempt's model time, and each exec op's time goes to
the turn that asked for it (the latest turn that started before the op).

A report, and each results.json, is read up to `MAX_REPORT_BYTES` (app/validation.py); a larger
results.json, or one that is not a regular file (a pipe, a link to a device), is skipped and counted.

Invariant: every record written has finite, non-negative durations, a reward in [0, 1] and turns, if
any, that add up to no more than its agent_s; every trial file, trial or attempt not imported is counted
with its reason.
"""

from __future__ import annotations

import bisect
import codecs
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from app.documents import TooLarge, check_size, open_input, read_text_at_most
from app.outputs import write_text_atomically
from app.sim.workload import WorkloadError, trace_line_problem
from app.validation import MAX_REPORT_BYTES

FORMATS = ("terminal-bench", "corral-run")


MAX_EXAMPLES = 3  # of the trials skipped for one reason, named in what the import says


@dataclass
class ImportResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    sources: int = 0
    # Where to find the first skipped of each reason: a trial's directory, a results.json, a summary's
    # trial as `path: name`.
    examples: dict[str, list[str]] = field(default_factory=dict)
    # Trials imported with a phase's end taken from a later time (AGENT_CUT, TEST_CUT), by which.
    assumed: Counter[str] = field(default_factory=Counter)
    # Files not read that hold no trial of their own, by what they are and why: a run summary whose
    # trials were read from their own files, a trial's file whose trial a summary held.
    unread: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)  # what to know before replaying the trace

    def skip(self, why: str, where: str, n: int = 1) -> None:
        self.skipped[why] += n
        shown = self.examples.setdefault(why, [])
        if len(shown) < MAX_EXAMPLES:
            shown.append(where)


class _Skip(Exception):
    """A trial not imported; its message is the reason counted in `ImportResult.skipped`."""


def _stamp(record: dict[str, Any], key: str) -> datetime | None:
    """The time at `key`, or None when it is absent."""
    value = record.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _Skip(f"{key} is not a time")
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise _Skip(f"{key} is not a time") from None


def _span(
    record: dict[str, Any], start: str, end: str, backwards: str = "timestamps run backwards"
) -> float | None:
    """Seconds from `start` to `end`, or None when either is absent."""
    a, b = _stamp(record, start), _stamp(record, end)
    if a is None or b is None:
        return None
    if (a.tzinfo is None) != (b.tzinfo is None):
        raise _Skip("timestamps mix naive and zoned times")
    seconds = (b - a).total_seconds()
    if seconds < 0:
        raise _Skip(backwards)
    return seconds


AGENT_CUT = "no agent end (it crashed or was killed): agent time counted to the test start or trial end"
TEST_CUT = "no test end (the tests timed out): validation counted to the trial end"


STAMPS = ("agent_ended_at", "test_started_at", "test_ended_at", "trial_ended_at")


def terminal_bench_record(record: dict[str, Any]) -> tuple[dict[str, Any] | None, str, tuple[str, ...]]:
    """One trial record → (its trace line, "", what was assumed: AGENT_CUT, TEST_CUT), or (None, why it
    was skipped, ())."""
    try:
        line, assumed = _trial_line(record)
    except _Skip as skip:
        return None, str(skip), ()
    return line, "", assumed


def _trial_line(record: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    task = record.get("task_id")
    if not isinstance(task, str) or not task:
        raise _Skip("no task_id")
    resolved = record.get("is_resolved")
    if resolved is not None and not isinstance(resolved, bool):
        raise _Skip("is_resolved is not a boolean")
    assumed: tuple[str, ...] = ()
    agent_end, test_end = "agent_ended_at", "test_ended_at"
    has = {key: _stamp(record, key) is not None for key in (*STAMPS, "agent_started_at")}
    if has["agent_started_at"] and not has["agent_ended_at"]:
        # Its sandbox was held until the tests began, or the trial ended, whatever the agent did.
        agent_end = "test_started_at" if has["test_started_at"] else "trial_ended_at"
        assumed += (AGENT_CUT,)
    agent = _span(record, "agent_started_at", agent_end, backwards="agent ends before it starts")
    if agent is None:
        raise _Skip("no agent start/end")
    # a test that began while the agent still ran would count that time twice (in agent and validate)
    _span(record, agent_end, "test_started_at", backwards="tests start before the agent ends")
    if has["test_started_at"] and not has["test_ended_at"] and has["trial_ended_at"]:
        test_end, assumed = "trial_ended_at", (*assumed, TEST_CUT)
    reset = _span(record, "trial_started_at", "agent_started_at") or 0.0
    validate = _span(record, "test_started_at", test_end) or 0.0
    cleanup = _span(record, test_end, "trial_ended_at")
    if cleanup is None:
        cleanup = _span(record, agent_end, "trial_ended_at") or 0.0
    line = {
        "task": task,
        "reset_s": round(reset, 3),
        "agent_s": round(agent, 3),
        "validate_s": round(validate, 3),
        "cleanup_s": round(cleanup, 3),
        "reward": 1.0 if resolved else 0.0,
    }
    return line, assumed


def _trial_records(path: Path) -> tuple[list[Any], bool]:
    """The records in one results.json, and whether it is a run-level summary: the trial itself, or
    the summary's `results`."""
    if not path.is_file():  # a pipe would block the import, a device (/dev/zero) never end
        raise _Skip("not a regular file")
    try:
        data = json.loads(read_text_at_most(path, MAX_REPORT_BYTES))
    except OSError as exc:
        raise _Skip(f"unreadable ({exc.strerror or exc})") from None
    except TooLarge as exc:
        raise _Skip(str(exc)) from None
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep, an int too long
        raise _Skip("not JSON") from None
    results = data.get("results") if isinstance(data, dict) else None
    return (results, True) if isinstance(results, list) else ([data], False)


NO_RESULTS = "no results.json (the trial did not finish)"


def _unfinished_trials(root: Path, trial_dirs: set[Path], trial_names: set[str]) -> list[Path]:
    """Directories beside a trial's, under `root`, that hold no results.json at any depth and that no
    record named: trials of the same task that never wrote one (terminal-bench writes it when a trial
    ends). A trial directory imported alone has no siblings: those of `root` are not the import's."""
    unfinished = []
    for parent in sorted({d.parent for d in trial_dirs if d != root}):
        for sibling in sorted(parent.iterdir()):
            if sibling in trial_dirs or sibling.name in trial_names or not sibling.is_dir():
                continue
            if next(sibling.rglob("results.json"), None) is None:
                unfinished.append(sibling)
    return unfinished


def import_terminal_bench(directory: Path, on_file: Callable[[int, int], None] | None = None) -> ImportResult:
    """Every trial under `directory` (any depth), each counted once by (task, trial name; an unnamed
    trial by what it records). `on_file(read, total)` before each results.json is read, with how many
    were read so far."""
    if not directory.is_dir():
        missing = not directory.exists() and not directory.is_symlink()
        raise WorkloadError(f"{directory}: " + ("no such directory" if missing else "not a directory"))
    result = ImportResult()
    seen: set[tuple[str, str]] = set()
    trial_dirs: set[Path] = set()
    above_trials: set[Path] = set()  # the directories that hold a trial's below them
    unreadable: list[tuple[Path, str]] = []  # results.json files not read that are no run summary
    # Trial files first, so a run-level summary of the same trials adds nothing twice.
    files = sorted(directory.rglob("results.json"), key=lambda p: (-len(p.parts), str(p)))
    for path in files:
        result.sources += 1
        if on_file is not None:
            on_file(result.sources - 1, len(files))
        try:
            records, summary = _trial_records(path)
        except _Skip as skip:
            if path.parent in above_trials:  # the trials below it were read from their own files
                result.unread[
                    f"a run summary ({skip}); the trials below it were read from their own files"
                ] += 1
            else:  # a trial's, unless a summary read later holds that trial
                unreadable.append((path, str(skip)))
                trial_dirs.add(path.parent)
            continue
        if not summary:
            trial_dirs.add(path.parent)
            above_trials.update(path.parent.parents)
        for record in records:
            if not isinstance(record, dict):
                result.skip("not an object", str(path))
                continue
            # A trial without a name is known by what it records: by its directory, every unnamed trial of
            # a task in a run's summary was one, and all but the first were dropped uncounted.
            name = record.get("trial_name") or json.dumps(record, sort_keys=True, default=str)
            key = (str(record.get("task_id")), str(name))
            if key in seen:
                continue
            seen.add(key)
            line, why, assumed = terminal_bench_record(record)
            if line is not None and (unloadable := trace_line_problem(line)) is not None:
                line, why = None, unloadable  # it would be refused by the simulator that reads it
            if line is None:
                result.skip(why, f"{path}: {_shown(name)}" if summary else str(path.parent))
            else:
                result.records.append(line)
                result.assumed.update(assumed)
    if on_file is not None:
        on_file(len(files), len(files))
    names = {name for _, name in seen}
    for path, why in unreadable:
        if path.parent.name in names:  # a summary held it: the trial was imported, its own file not read
            result.unread[f"a trial's results.json ({why}); the trial was read from its run's summary"] += 1
        else:
            result.skip(why, str(path))
    for unfinished in _unfinished_trials(directory, trial_dirs, names):
        result.skip(NO_RESULTS, str(unfinished))
    if not result.records:
        raise WorkloadError(
            f"{directory}: no usable terminal-bench trial found "
            f"({result.sources} results.json files; skipped: {dict(result.skipped) or 'none'})"
        )
    return result


def import_corral_run(report_path: Path) -> ImportResult:
    """A `corral run` report's event stream → one trace line per finished or cancelled attempt."""
    try:
        report = json.loads(_report_text(report_path))
    except OSError as exc:
        raise WorkloadError(f"{report_path}: cannot read: {exc.strerror}") from None
    except TooLarge as exc:
        raise WorkloadError(f"{report_path}: {exc}; is it a corral run report?") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep, an int too long
        raise WorkloadError(f"{report_path}: not a JSON report ({exc})") from None
    events = report.get("event_log") if isinstance(report, dict) else None
    if not isinstance(events, list):
        raise WorkloadError(f"{report_path}: no `event_log` list; write it with a current `corral run`")
    names = report.get("group_tasks", {})
    if not isinstance(names, dict) or not all(isinstance(v, str) and v for v in names.values()):
        raise WorkloadError(f"{report_path}: group_tasks is {_shown(names)}, not an object of task names")
    result = ImportResult(sources=1)
    try:
        result.records, result.skipped = attempts_from_events(events, names)
    except WorkloadError as exc:
        raise WorkloadError(f"{report_path}: {exc}") from None
    censored = sum(1 for r in result.records if r.get("censored"))
    if censored == len(result.records):  # cut-short attempts stand in for finished ones: none to take
        cut = f"{censored} cut short, " if censored else ""
        raise WorkloadError(
            f"{report_path}: no finished attempt in its events "
            f"({cut}skipped: {dict(result.skipped) or 'none'})"
        )
    if censored:
        result.notes.append(_censored_note(censored))
    if (note := _replay_note(report)) is not None:
        result.notes.append(note)
    return result


def _censored_note(n: int) -> str:
    return (
        f"note: {n} of these attempts were cut short (cancelled with their group, or running when the run "
        "ended) and are marked censored: a replay takes for each a finished attempt of its task that took "
        "at least as long, or the cut-short one, a lower bound, where none did"
    )


def _replay_note(report: dict[str, Any]) -> str | None:
    """How to replay a `corral run`'s attempts at its own settings without counting its CPU contention
    twice (docs/simulator.md, "Traces"): its recorded times hold it already. None where the report does
    not say its engines and serving CPUs."""
    engines, cpus = report.get("engines"), report.get("cpus")
    serving = cpus.get("serving") if isinstance(cpus, dict) else None
    if not isinstance(engines, dict) or not engines or not isinstance(serving, list) or not serving:
        return None
    demands = f"engine_demand: {len(serving) / len(engines):g}"
    measured = report.get("lane_op_demand_cores")
    if isinstance(measured, int | float) and not isinstance(measured, bool) and 0 <= measured <= 1e6:
        demands += f", sandbox_demand: {measured:g}"
    policy = report.get("policy")
    under = f" under `{policy}`" if isinstance(policy, str) and policy.isidentifier() else ""
    return (
        f"note: these times hold the run's own CPU contention{under}; to replay them at its settings "
        f"without counting it twice, give the workload cpus: {{{demands}}} (docs/simulator.md, Traces); "
        "another policy's contention is not in them"
    )


def _report_text(path: Path) -> str:
    """A report's text, read up to `MAX_REPORT_BYTES`. What does not begin as a JSON object does (after
    whitespace) is refused from its first bytes: /dev/zero would otherwise be read to the limit."""
    with open_input(path) as f:
        check_size(f, MAX_REPORT_BYTES)
        raw = f.read(65_536)
        head = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark, which some Windows editors write
        start = head.lstrip()[:1]
        if start and start != b"{":
            shown = repr(chr(start[0])) if 32 < start[0] < 127 else f"byte 0x{start[0]:02x}"
            raise ValueError(f"a corral run report begins with '{{', this one with {shown}")
        if not start:
            raise ValueError("the file is empty" if not head else "the file is only whitespace")
        rest = f.read(MAX_REPORT_BYTES + 1 - len(head)) if len(raw) == 65_536 else b""
    data = head + rest
    if len(data) > MAX_REPORT_BYTES:
        raise TooLarge(MAX_REPORT_BYTES)
    return data.decode("utf-8")


def _shown(value: object) -> str:
    """`value` as the report spells it, cut short."""
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _field(ev: dict[str, Any], i: int, name: str) -> Any:
    if name not in ev:
        raise WorkloadError(f"event_log[{i}]: {ev['kind']} has no {name}")
    return ev[name]


def _integer(ev: dict[str, Any], i: int, name: str) -> int:
    value = _field(ev, i, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"event_log[{i}]: {ev['kind']} {name} is {_shown(value)}, not an integer")
    return value


def _finite(ev: dict[str, Any], i: int, name: str) -> float:
    value = _field(ev, i, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(f"event_log[{i}]: {ev['kind']} {name} is {_shown(value)}, not a finite number")
    return float(value)


def _name(ev: dict[str, Any], i: int, name: str) -> str:
    value = _field(ev, i, name)
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"event_log[{i}]: {ev['kind']} {name} is {_shown(value)}, not a name")
    return value


def attempts_from_events(
    events: Iterable[Any], group_tasks: Mapping[str, str] | None = None
) -> tuple[list[dict[str, Any]], Counter[str]]:
    """One trace line per finished attempt, in finishing order, then one `censored` line per attempt
    cancelled with its group, and what was skipped, by reason.
    Raises `WorkloadError` naming the first malformed event by its index.

    A line's task is its group's: the group_admitted event's `task`, else the report's `group_tasks`
    (group id → task name: `corral run`'s events leave `task` empty), else `task-<task_index>`."""
    named = group_tasks or {}
    tasks: dict[int, str] = {}
    sizes: dict[int, int] = {}  # each group's G, as admitted
    phases: dict[tuple[int, int], dict[str, float]] = {}
    turns: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (start, model time) of each turn
    tools: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (start, time) of each exec op
    done: list[tuple[tuple[int, int], dict[str, Any]]] = []
    finished: dict[tuple[int, int], dict[str, Any]] = {}  # cleanup runs after the attempt reports
    backwards: dict[tuple[int, int], str] = {}  # the attempt's first span that ends before it starts
    cut: dict[tuple[int, int], None] = {}  # attempts cancelled with their group or at the run's end
    skipped: Counter[str] = Counter()
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise WorkloadError(f"event_log[{i}] is {_shown(ev)}, not an event object")
        kind = ev.get("kind")
        if kind == "group_admitted":
            gid = _integer(ev, i, "group_id")
            tasks[gid] = str(ev.get("task") or named.get(str(gid)) or f"task-{ev.get('task_index')}")
            if isinstance(size := ev.get("group_size"), int) and not isinstance(size, bool):
                sizes[gid] = size
            continue
        if kind not in ("sandbox_op", "turn", "attempt_finished", "attempt_restarted", "attempt_cancelled"):
            continue
        key = (_integer(ev, i, "group_id"), _integer(ev, i, "attempt"))
        if kind == "attempt_restarted":  # its turns were thrown away: it starts over
            phases.pop(key, None)
            turns.pop(key, None)
            tools.pop(key, None)
            backwards.pop(key, None)
        elif kind == "attempt_cancelled":  # cut short: the ops it had running end after this event
            cut.setdefault(key, None)
        elif kind == "sandbox_op":
            lane = _name(ev, i, "lane")
            spent = _finite(ev, i, "end") - _finite(ev, i, "start")
            if spent < 0:
                backwards.setdefault(key, "a sandbox op ends before it starts")
            if key in finished and lane == "cleanup":
                finished[key]["cleanup_s"] = round(finished[key]["cleanup_s"] + spent, 3)
            else:
                phases.setdefault(key, {})[lane] = phases.get(key, {}).get(lane, 0.0) + spent
                if lane == "exec":
                    tools.setdefault(key, []).append((_finite(ev, i, "start"), spent))
        elif kind == "turn":
            start = _finite(ev, i, "start")
            spent = _finite(ev, i, "end") - start
            if spent < 0:
                backwards.setdefault(key, "a turn ends before it starts")
            if not ev.get("error"):  # a turn an engine fault cut short is retried: the retry is the turn
                turns.setdefault(key, []).append((start, spent))
        else:
            reward = _finite(ev, i, "reward")
            # What no attempt of a real run reports: each would be a line of made-up zero seconds.
            why = (
                "failed"
                if ev.get("error")
                else "an attempt index outside its group"
                if not 0 <= key[1] < sizes.get(key[0], key[1] + 1)
                else "a second finish of one attempt"
                if key in finished
                else "no sandbox op and no turn recorded"
                if key not in phases and key not in turns
                else None
            )
            if why is not None:
                skipped[why] += 1
                if key not in finished:
                    for kept in (phases, turns, tools, backwards):
                        kept.pop(key, None)
                continue
            cut.pop(key, None)
            finished[key] = record = _line(key, phases, turns, tools, tasks, named, reward)
            done.append((key, record))
    for key in cut:
        line = _line(key, phases, turns, tools, tasks, named, 0.0)
        if line["reset_s"] + line["agent_s"] + line["validate_s"] > 0:
            done.append((key, {**line, "censored": True}))
        else:  # nothing ran (a reset cancelled in its queue, then the clean-up): it says nothing
            skipped["cancelled before it started"] += 1
    records: list[dict[str, Any]] = []
    # Judged once every event is in: a cleanup that runs backwards may come after its attempt reports.
    for key, line in done:
        if key in backwards:
            skipped[backwards[key]] += 1
        elif (unloadable := trace_line_problem(line)) is not None:
            skipped[unloadable] += 1
        else:
            records.append(line)
    return records, skipped


def _line(
    key: tuple[int, int],
    phases: dict[tuple[int, int], dict[str, float]],
    turns: dict[tuple[int, int], list[tuple[float, float]]],
    tools: dict[tuple[int, int], list[tuple[float, float]]],
    tasks: Mapping[int, str],
    named: Mapping[str, str],
    reward: float,
) -> dict[str, Any]:
    """The trace line of attempt `key` from its spans so far (taken out of `phases`, `turns`, `tools`)."""
    lanes = phases.pop(key, {})
    attempt_turns = _turns_with_tools(turns.pop(key, []), tools.pop(key, []))
    agent = sum(t["llm_s"] for t in attempt_turns) + lanes.get("exec", 0.0)
    return {
        "task": tasks.get(key[0]) or named.get(str(key[0])) or f"group-{key[0]}",
        "reset_s": round(lanes.get("reset", 0.0), 3),
        "agent_s": round(agent, 3),
        "validate_s": round(lanes.get("validate", 0.0), 3),
        "cleanup_s": round(lanes.get("cleanup", 0.0), 3),
        "reward": reward,
        **({"turns": attempt_turns} if attempt_turns else {}),
    }


def _turns_with_tools(
    turns: list[tuple[float, float]], tools: list[tuple[float, float]]
) -> list[dict[str, float]]:
    """Each model turn with the tool calls it asked for: an exec op belongs to the latest turn that
    started before it (an op before the first turn, to the first). A turn an engine fault cut short is
    not among `turns`; its time is not model time."""
    turns = sorted(turns)
    starts = [start for start, _ in turns]
    tool_s = [0.0] * len(turns)
    for start, spent in tools if turns else ():
        tool_s[max(bisect.bisect_right(starts, start) - 1, 0)] += spent
    return [
        {"llm_s": round(llm, 3), "tool_s": round(tool, 3)}
        for (_, llm), tool in zip(turns, tool_s, strict=True)
    ]


def trace_text(records: Iterable[dict[str, Any]]) -> str:
    """`records` as JSON Lines."""
    return "".join(json.dumps(r, allow_nan=False) + "\n" for r in records)


def write_trace(records: Iterable[dict[str, Any]], out: Path) -> int:
    """Write `records` as JSON Lines, atomically, creating missing parent directories."""
    records = list(records)
    write_text_atomically(out, trace_text(records))
    return len(records)
