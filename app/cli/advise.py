"""`corral advise` and `corral trace import`: real traces in, recommended S, K and lanes out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from app import early_signals
from app.cli.common import (
    QUIET_S,
    cannot_write,
    check_apart,
    check_output,
    check_plot,
    fail,
    interrupt_says,
    interruptible_command,
    is_stdout,
    output_path,
    progress_bar,
    progress_lines,
    say,
    sigterm_as_ctrl_c,
    why_not_written,
    write_output,
    write_report,
    write_stdout,
)
from app.cli.sim import WORKLOAD_HELP, checked_trace, load, simulation_errors, workload_inputs
from app.sim.workload import WorkloadError, over_agent_limit
from app.validation import MAX_ADVICE_SEEDS, MAX_DEFAULT_WORKERS, MAX_SEED

if TYPE_CHECKING:
    from app.sim.advise import Advice, Outcome
    from app.sim.workload import Workload

trace_app = typer.Typer(help="Turn recorded runs into Corral traces for the simulator.", no_args_is_help=True)


class TraceFormat(StrEnum):
    TERMINAL_BENCH = "terminal-bench"
    CORRAL_RUN = "corral-run"


class PlainUsage(TyperCommand):
    """Usage names a required argument bare (`SOURCE`), as POSIX usage lines do, not Typer's `{SOURCE}`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:  # Typer's vendored click.Context
        return [piece.removeprefix("{").removesuffix("}") for piece in super().collect_usage_pieces(ctx)]


@trace_app.command("import", cls=PlainUsage)
@interruptible_command
@sigterm_as_ctrl_c
def trace_import(
    source: Annotated[
        Path, typer.Argument(metavar="SOURCE", help="a terminal-bench run directory, or a corral run report")
    ],
    fmt: Annotated[TraceFormat, typer.Option("--format", help="what SOURCE is")],
    out: Annotated[
        Path, typer.Option("--out", help="the trace to write (JSON Lines); - for stdout", parser=output_path)
    ] = Path("trace.jsonl"),
) -> None:
    """Read trials (terminal-bench) or attempts (a `corral run` report) into a Corral trace."""
    from app.sim.traces import import_corral_run, import_terminal_bench, trace_text, write_trace

    check_output(out, "--out")
    _check_source(source, fmt)
    check_apart({"--out": out}, {"SOURCE": source})
    lines = progress_lines("trace import", "results.json files", quiet_s=QUIET_S)
    with interrupt_says(out):
        try:
            if fmt is TraceFormat.TERMINAL_BENCH:
                with progress_bar() as progress:
                    task = progress.add_task("reading trials", total=None)

                    def on_file(read: int, total: int) -> None:
                        progress.update(task, completed=read, total=total)
                        if lines is not None:
                            lines(read, total)

                    result = import_terminal_bench(source, on_file=on_file)
            else:
                result = import_corral_run(source)
        except WorkloadError as exc:
            fail(str(exc))
        if is_stdout(out):
            write_stdout(trace_text(result.records))
            written = len(result.records)
        else:
            try:
                written = write_trace(result.records, out)
            except OSError as exc:  # checked before the import: something changed since (exit 1, not 2)
                cannot_write(out, why_not_written(out, exc))
    tasks = len({r["task"] for r in result.records})
    unit = "trial" if fmt is TraceFormat.TERMINAL_BENCH else "attempt"
    say(f"{_count(written, 'attempt')} of {_count(tasks, 'task')} → {out} ({_skipped(result.skipped, unit)})")
    for why, where in result.examples.items():
        more = result.skipped[why] - len(where)
        say(f"  {why}: {', '.join(where)}" + (f" and {more} more" if more else ""))
    for why, n in sorted(result.assumed.items()):
        say(f"imported {_count(n, unit)} with {why}")
    for what, n in sorted(result.unread.items()):
        say(f"not read: {what}" + (f" ({n} such files)" if n > 1 else ""))
    if (note := over_agent_limit(result.records)) is not None:
        say(note)
    for note in result.notes:
        say(note)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _skipped(skipped: Mapping[str, int], unit: str) -> str:
    """`skipped 23 attempts: 22 cancelled before it started, 1 failed`: the total names the
    unit (a terminal-bench trial, a corral run's attempt), each reason its count."""
    if not skipped:
        return "none skipped"
    reasons = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items()))
    return f"skipped {_count(sum(skipped.values()), unit)}: {reasons}"


def _check_source(source: Path, fmt: TraceFormat) -> None:
    """A directory given as a report (or a file as a run directory): say so and name the other format,
    before `check_apart` would call the output 'inside' it. A missing one is named as SOURCE too."""
    if not source.exists() and not source.is_symlink():  # a link to nowhere: the import says what it is
        fail(f"SOURCE {source}: no such {'directory' if fmt is TraceFormat.TERMINAL_BENCH else 'file'}")
    if fmt is TraceFormat.CORRAL_RUN and source.is_dir():
        fail(
            f"SOURCE {source}: is a directory; a corral run report is a file "
            "(a terminal-bench run directory takes --format terminal-bench)"
        )
    if fmt is TraceFormat.TERMINAL_BENCH and source.exists() and not source.is_dir():
        fail(
            f"SOURCE {source}: not a directory; a terminal-bench run is one "
            "(a corral run report takes --format corral-run)"
        )


def advise(
    workload: Annotated[Path, typer.Option(help=WORKLOAD_HELP)],
    trace: Annotated[
        Path | None, typer.Option(help="a Corral trace to replay instead of the workload's distributions")
    ] = None,
    json_out: Annotated[
        Path, typer.Option("--json", help="where to write the advice; - for stdout", parser=output_path)
    ] = Path("advice.json"),
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write an image of current against advised settings (.png, .svg, .pdf ...)",
            parser=output_path,
        ),
    ] = None,
    advised_out: Annotated[
        Path | None,
        typer.Option(
            "--advised-workload",
            help="also write the workload with the advised settings (YAML), which corral sim --workload "
            "simulates as advised",
            parser=output_path,
        ),
    ] = None,
    passes: Annotated[int, typer.Option(min=1, max=5, help="rounds over the knobs")] = 2,
    seeds: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_ADVICE_SEEDS,
            help="judge each candidate by its means over this many seeds (the workload's and the ones "
            "after it); one seed's draws can favour settings another's do not",
        ),
    ] = 1,
    workers: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=64,
            help="parallel simulations; default: the CPUs this process may use, "
            f"at most {MAX_DEFAULT_WORKERS}",
        ),
    ] = None,
) -> None:
    """Sweep S, K, admission, updating engines, lane slots and serving cores by simulation; recommend the
    fastest."""
    from app.sim.advise import plot_advice, workload_changes
    from app.sim.workload import TraceSpec, Workload, load_trace

    if advised_out is not None and is_stdout(advised_out) and is_stdout(json_out):
        fail("--advised-workload -: --json is standard output already; give one of them a file")
    check_output(json_out, "--json")
    check_plot(plot)
    if advised_out is not None:
        check_output(advised_out, "--advised-workload")
    spec = load(workload)
    if spec.seed + seeds - 1 > MAX_SEED:
        fail(f"--seeds {seeds}: the workload's seed {spec.seed} leaves room for {MAX_SEED - spec.seed + 1}")
    if trace is not None:
        try:
            load_trace(trace, "--trace")  # refused as typed, not as the absolute trace.path below
            data = spec.model_dump(by_alias=True)
            # the workload's own share of agent time on the engine, if it replays a trace already
            own = {} if spec.trace is None else {"llm_fraction": spec.trace.llm_fraction}
            data["trace"] = TraceSpec(path=trace.resolve(), **own)
            spec = checked_trace(Workload.model_validate(data))
        except WorkloadError as exc:
            fail(str(exc))
        except ValueError as exc:
            fail(f"--trace {trace}: {exc}")
    outputs = {"--json": json_out, "--plot": plot, "--advised-workload": advised_out}
    check_apart(outputs, {"--trace": trace, **workload_inputs(workload, spec)})
    with early_signals.interruptible_once(), simulation_errors():  # a second Ctrl-C must not break the save
        advice, lost = _search(spec, passes, workers, json_out, seeds)
        current, advised = advice.current.settings, advice.recommended.settings
        changes = workload_changes(spec, current, advised)
        if trace is not None:  # what --trace changed of the workload is part of what was simulated
            changes = {"trace": {"path": str(trace.resolve())}, **changes}
        report = {**advice.as_dict(), "changes": changes}
        write_report(json_out, report, lambda out: plot_advice(advice, str(out)), plot)
        if advised_out is not None:
            write_output(advised_out, _advised_yaml(spec, advice, changes, workload))
        if not advice.complete:  # what was simulated is kept: it cost minutes
            why, code = _stopped_by(lost)
            files = f'{json_out} ("complete": false)' + ("" if plot is None else f" and {plot}")
            files += "" if advised_out is None else f" and {advised_out}"
            if advice.candidates:
                say(f"{why} after {len(advice.evaluated)} settings simulated; the best of them → {files}")
                if changes:
                    say(f"to apply the best of them, in the workload: {_flow(changes)}")
            else:
                only = "only the current settings were simulated; no advice, their figures"
                say(f"{why} after {only} → {files}")
            raise typer.Exit(code)
    # no setting delivered a batch: there is no advised one to show, and the workload is at fault
    none_delivered = advice.recommended.batch_collection_s is None
    shown = (("current", advice.current),) if none_delivered else (
        ("current", advice.current), ("advised", advice.recommended)
    )  # fmt: skip
    for label, outcome in shown:
        s = outcome.settings
        lanes = ", ".join(f"{lane} {slots}" for lane, slots in s.lane_slots)
        say(
            f"{label}: S={s.surplus_groups} K={s.max_staleness} admission={s.admission()} "
            f"updating={s.updating()} gate={s.gate()} "
            f"lanes {lanes}; serving cores={s.serving_cores} borrowing={s.borrow_serving_cpus} → "
            f"{outcome.mean_text()}, idle {outcome.trainer_idle_fraction:.0%}, "
            f"wasted {outcome.wasted_trajectory_s:,.0f} traj-s{outcome.cut_text()}{_per_seed(outcome)}"
        )
    if none_delivered:  # as corral sim and corral bench: the workload can fill no batch (exit 2)
        say(f"error: {advice.verdict()}; the advice's figures → {json_out}")
        raise typer.Exit(2)
    each = f", each on {seeds} seeds" if seeds > 1 else ""
    say(f"{advice.verdict()} ({len(advice.evaluated)} settings simulated{each}) → {json_out}")
    wasted_now, wasted = advice.current.wasted_trajectory_s, advice.recommended.wasted_trajectory_s
    if advice.beats_current and wasted > WASTE_NOTE_FACTOR * max(wasted_now, 1.0):
        say(
            f"note: the advised settings waste {wasted / max(wasted_now, 1.0):.1f}× the trajectory-seconds "
            f"of the current ones ({wasted:,.0f} against {wasted_now:,.0f}: discarded and cancelled groups' "
            "sandbox work)"
        )
    if changes:
        say(f"to apply, in the workload: {_flow(changes)}")
    if advised_out is not None:
        say(f"the workload with them → {advised_out} (corral sim --workload {advised_out} simulates it)")
    if passed := advice.passed_over:
        fastest = min(passed, key=lambda o: o.batch_collection_s or math.inf)
        say(
            f"{len(passed)} faster candidate(s) not advised: they cut short more of their attempts than the "
            f"current settings (fastest {fastest.mean_text()}{fastest.cut_text()}); an attempt out of time "
            "before its turns fails"
        )
    if failed := advice.failed:
        say(
            f"{len(failed)} candidate(s) could not be simulated and were ranked last, the first: "
            f'{failed[0].error} (each one\'s "error" is in {json_out})'
        )


WASTE_NOTE_FACTOR = 2.0  # advised settings that waste more than this × the current ones' work are noted


def _per_seed(outcome: Outcome) -> str:
    """`; by seed 82.3 s, no batch, 80.0 s` where the outcome is a mean over seeds."""
    if outcome.per_seed_s is None:
        return ""
    return "; by seed " + ", ".join("no batch" if m is None else f"{m:.1f} s" for m in outcome.per_seed_s)


def _over_seeds(spec: Workload, advice: Advice) -> str:
    """`, the mean over seeds 1 to 3 (seed 1, which this file runs: 82.3 s)`, or "" for one seed."""
    per_seed = advice.recommended.per_seed_s
    if advice.seeds == 1 or not per_seed:
        return ""
    first = "none delivered" if per_seed[0] is None else f"{per_seed[0]:.1f} s"
    last = spec.seed + advice.seeds - 1
    return f", the mean over seeds {spec.seed} to {last} (seed {spec.seed}, which this file runs: {first})"


def _flow(changes: Mapping[str, Mapping[str, Any]]) -> str:
    """`policy: {surplus_groups: 12, admission: attempts}; lanes: {reset: 16}`: YAML's flow style."""
    import yaml

    return "; ".join(
        f"{section}: " + yaml.safe_dump(dict(keys), default_flow_style=True, sort_keys=False).strip()
        for section, keys in changes.items()
    )


def _advised_yaml(
    spec: Workload, advice: Advice, changes: Mapping[str, Mapping[str, Any]], source: Path
) -> str:
    """The workload with the advised settings, as a YAML file that says where it came from."""
    import yaml

    from app.sim.advise import advised_workload

    complete = "" if advice.complete else " (an interrupted search: the best of what it simulated)"
    lines = [
        f"{source} with the settings corral advise advised{complete}.",
        f"Predicted mean batch collection time: {advice.recommended.mean_text()} (the workload's own "
        f"settings: {advice.current.mean_text()}), policy full{_over_seeds(spec, advice)}.",
        "corral sim --workload THIS_FILE simulates it. What changed, in the workload's names:",
        *(f"  {part}" for part in _flow(changes).split("; ") if part),
    ]
    data = advised_workload(spec, advice.recommended.settings)
    return "".join(f"# {line}\n" for line in lines) + yaml.safe_dump(data, sort_keys=False)


def _search(
    spec: Workload, passes: int, workers: int | None, json_out: Path, seeds: int
) -> tuple[Advice, str | None]:
    """The advice, with a progress bar (plain lines off a terminal); after a Ctrl-C, or a worker lost
    otherwise (the second item says how), the advice from what was simulated."""
    from app.sim.advise import AdviceInterrupted
    from app.sim.advise import advise as run_advice

    lines = progress_lines("advise", "simulations")
    with progress_bar() as progress:
        task = progress.add_task("simulating candidates", total=1)

        def on_run(done: int, planned: int) -> None:
            progress.update(task, completed=done, total=planned)
            if lines is not None:
                lines(done, planned)

        try:
            return run_advice(spec, passes=passes, workers=workers, on_run=on_run, seeds=seeds), None
        except AdviceInterrupted as stopped:
            if stopped.partial is None:
                why, code = _stopped_by(stopped.lost)
                say(f"{why} before the current settings were simulated; {json_out} not written")
                raise typer.Exit(code) from None
            return stopped.partial, stopped.lost


def _stopped_by(lost: str | None) -> tuple[str, int]:
    """What ended a search before its end, in words to begin its line, and the exit status: a Ctrl-C
    (or SIGTERM, SIGHUP), or a simulation worker that died otherwise (`lost` says how)."""
    if lost is None:
        return "interrupted", 130
    return f"error: {lost}; the search stopped", 1
