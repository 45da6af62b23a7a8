"""`corral sim` and `corral bench`: the production scheduler on simulated engines, sandboxes and time.

Every flag is checked before the simulation starts: S and K within their documented limits, the
trajectories in flight within the simulator's memory limit, sweep lists non-empty, output paths writable.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from app.cli.common import (
    QUIET_S,
    check_apart,
    check_output,
    check_plot,
    err,
    fail,
    finish,
    interrupt_says,
    output_path,
    progress_bar,
    progress_lines,
    say,
    write_report,
)
from app.core.config import MAX_AGENT_GATE, AdmissionMode, PolicyName, launch_gate
from app.runtime.report import shown_s
from app.sim.family import FAMILY
from app.sim.workload import Workload, WorkloadError, load_trace, load_workload
from app.validation import (
    MAX_STALENESS,
    MAX_SURPLUS,
    MAX_SWEEP_VALUES,
    in_flight_problem,
    parse_int,
    problems,
)

FLAGS = {"surplus_groups": "--surplus", "max_staleness": "--max-staleness"}
WORKLOAD_HELP = (
    f"workload spec, YAML or JSON (docs/simulator.md), or a built-in one by name: {', '.join(FAMILY)}"
)

SurplusOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=MAX_SURPLUS,
        help="S, the surplus: how many groups may run (or wait, ready) beyond the B a batch needs; "
        "default: the workload's",
    ),
]
StalenessOption = Annotated[
    int | None,
    typer.Option(
        min=0,
        max=MAX_STALENESS,
        help="K, the staleness bound: a group whose oldest turn is more than K policy versions behind "
        "the trainer is discarded; default: the workload's",
    ),
]


def load(workload: Path | None) -> Workload:
    if workload is not None and str(workload) in FAMILY and workload.exists():
        say(f"note: reading the file {workload}, not the built-in workload {str(workload)!r} of that name")
    try:
        return checked_trace(load_workload(workload))
    except WorkloadError as exc:
        fail(str(exc))


def say_serving_note(spec: Workload, report: Mapping[str, Any] | None) -> None:
    """After a simulation's results: the note below, if it applies."""
    if (note := serving_note(spec, report)) is not None:
        say(note)


def cut_short_note(name: str, spec: Workload, report: Mapping[str, Any]) -> str | None:
    """A note when at least `CUT_SHORT_NOTE` of the attempts ran out of their agent time before the turns
    an idle machine finishes in it: the simulator fails them (reward 0), so the batches come on time but
    hold failures. On `cpu-scarce` most of `full`'s attempts did, and nothing said so."""
    from app.sim.family import cut_short_share

    share = cut_short_share(report)
    if share is None or share < CUT_SHORT_NOTE:
        return None
    return (
        f"note: {name}: {report['attempts_cut_short']:,} of {report['attempts_played']:,} attempts "
        f"({share:.0%}) ran out of their {spec.trajectory.timeout_s:g} s (trajectory.timeout_s) before the "
        "turns an idle machine finishes in it, and fail (reward 0): its batches hold failures; engines or "
        "sandbox cores too few for what runs at once is the likely cause"
    )


CUT_SHORT_NOTE = 0.05


# The phases of the trainer's wait that more sandbox cores would shorten: lane queues, and the gate that
# holds attempts out of their agent phase while the exec lane is full (app.runtime.gate).
LANE_BOUND = ("lane_queue", "agent_gate")


def serving_note(spec: Workload, report: Mapping[str, Any] | None = None) -> str | None:
    """A note when the serving/sandbox split behind the hard boundary of pinned lanes held the run back,
    found by the random workloads benchmark, where `full` lost to rungs that share CPUs and nothing
    said why:
    - the serving cores are fewer than the engines use when busy: the engines slow down while sandbox
      cores may sit idle;
    - the serving cores are more than the busy engines use, lane queues (with the agent-phase gate in
      front of the exec lane, whose waits are waits for exec slots) were the largest part of the
      trainer's wait in `report` (`full`'s run) and at their peak the lanes ran operations asking for
      every sandbox core: the spare serving cores sat idle while sandbox work queued (on one such
      workload `full` was slower than `completion`, 298.5 s against 258.7 s)."""
    cpus, engines, demand = spec.cpus, spec.engines, spec.serving_demand
    if cpus.serving >= cpus.total or spec.lanes.borrow_serving_cpus:
        return None
    busy = f"{engines.count} busy engines use ({engines.count} × cpus.engine_demand {cpus.engine_demand:g})"
    if cpus.serving < demand:
        return (
            f"note: cpus.serving is {cpus.serving} core{'' if cpus.serving == 1 else 's'}, below the "
            f"{demand:g} that {busy}: behind the "
            "hard boundary of pinned lanes (`lanes`, `full`) their turns slow down; `corral advise` sweeps "
            "the split"
        )
    report = report or {}
    waits = report.get("wait_attribution") or {}
    spare = cpus.serving - demand
    phases = waits.get("phases") or {}
    gated = phases.get("agent_gate", 0.0)
    queued = phases.get("lane_queue", 0.0) + gated
    # A trainer that never waited (every duration 0) was held by nothing: "0.0 s of its 0.0 s wait".
    if (
        spare < 1
        or queued <= 0
        or queued < max((v for k, v in phases.items() if k not in LANE_BOUND), default=0.0)
    ):
        return None
    # Lane queues from too few slots, not too few cores, are not this: more cores would not shorten them.
    by_lane = cpus.sandbox_demand.by_lane()
    peak = sum(lane["max_busy"] * by_lane[name] for name, lane in report.get("lanes", {}).items())
    if peak < cpus.total - cpus.serving:
        return None
    held = "lane queues and the agent-phase gate" if gated > 0 else "lane queues"
    return (
        f"note: cpus.serving is {cpus.serving} cores, {spare:g} more than the {demand:g} that {busy}, while "
        f"{held} held the trainer for {queued:.1f} s of its {waits['total_s']:.1f} s wait: behind the "
        "hard boundary of pinned lanes the spare serving cores sit idle; `lanes.borrow_serving_cpus: true` "
        "lends the cores the engines leave idle to the lanes, and `corral advise` sweeps both"
    )


@contextmanager
def simulation_errors() -> Iterator[None]:
    """A simulated run that cannot fill a batch (every group fails: `p_infra_error` near 1) ends the
    command with one line, exit code 2: it is the workload's doing, not a crash."""
    from app.runtime.driver import cannot_proceed

    try:
        yield
    except Exception as exc:
        cause = cannot_proceed(exc)
        if cause is None:
            raise
        fail(f"the simulated run stopped: {cause}")


def workload_inputs(workload: Path | None, spec: Workload) -> dict[str, Path | None]:
    """The files a simulation reads, for `check_apart`: the workload file and the trace it names."""
    trace = spec.trace.path if spec.trace is not None else None
    return {"--workload": workload, "the workload's trace": trace}


def checked_trace(spec: Workload) -> Workload:
    """Read the workload's trace, if it has one, so that a bad line is refused before any simulation
    starts (in `corral advise` those run in worker processes), not as a worker's traceback."""
    if spec.trace is not None:
        load_trace(spec.trace.path)
    return spec


def check_surplus(spec: Workload, surplus: int, flag: str) -> None:
    problem = in_flight_problem(spec.batch.groups, spec.batch.group_size, surplus)
    if problem is not None:
        fail(f"{flag} {surplus}: {problem}")


def sim(
    workload: Annotated[Path, typer.Option(help=WORKLOAD_HELP)],
    policy: Annotated[PolicyName, typer.Option(help="rung of the ablation ladder")] = PolicyName.FULL,
    json_out: Annotated[
        Path, typer.Option("--json", help="where to write the report; - for stdout", parser=output_path)
    ] = Path("sim.json"),
    surplus: SurplusOption = None,
    max_staleness: StalenessOption = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write an image of every group's timeline (.png, .svg, .pdf ...)", parser=output_path
        ),
    ] = None,
    admission: Annotated[
        AdmissionMode | None,
        typer.Option(
            help="what B + S caps: live groups (in flight + ready), or only groups in flight (a ready "
            "group holds no sandbox and no engine slot), or attempts in flight ((B + S)·G: a group's "
            "finished attempts make room for more groups); default: for full the workload's "
            "policy.admission, else in_flight; live for the other rungs"
        ),
    ] = None,
    ready_surplus: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=MAX_SURPLUS,
            help="with --admission in_flight: room for ready groups beyond B + S; default: no admission "
            "while (K + 1)·B wait ready",
        ),
    ] = None,
    agent_gate: Annotated[
        float | None,
        typer.Option(
            min=0,
            max=MAX_AGENT_GATE,
            help="the agent-phase gate: attempts start their agent phase while fewer than this × the exec "
            "lane's slots ÷ the measured tool share are in theirs; 0: no gate; default: for full the "
            "workload's policy.agent_gate, else 1; none for the other rungs (docs/simulator.md)",
        ),
    ] = None,
) -> None:
    """Simulate one policy on a workload and write its report."""
    from app.sim.run import policy_for, simulate

    check_output(json_out, "--json")
    check_plot(plot)
    spec = load(workload)
    check_apart({"--json": json_out, "--plot": plot}, workload_inputs(workload, spec))
    if surplus and policy is PolicyName.SYNC:
        # The rung has no surplus (PolicyConfig.ladder sets S = 0): the flag was dropped without a word,
        # and the report was the plain sync run's. The API and the dashboard refuse it too.
        fail(
            f"--surplus: policy sync runs without surplus (S = 0), got {surplus}; leave --surplus out, "
            "or choose completion, lanes or full"
        )
    if surplus is not None:
        check_surplus(spec, surplus, "--surplus")
    overrides: dict[str, Any] = {
        k: v for k, v in {"surplus_groups": surplus, "max_staleness": max_staleness}.items() if v is not None
    }
    overrides |= {
        k: v for k, v in {"admission": admission, "ready_surplus": ready_surplus}.items() if v is not None
    }
    if agent_gate is not None:  # typer's range refuses NaN and infinities
        overrides["agent_gate"] = launch_gate(agent_gate)
    # The admission asked for: the flag's, else the workload's where the rung takes it
    own = spec.policy_settings(policy.value).get("admission")
    workload_says = f"; the workload's policy.admission is {own}" if admission is None and own else ""
    if ready_surplus is not None and (admission or own) is AdmissionMode.ATTEMPTS:
        fail(
            "--ready-surplus: only with --admission in_flight (attempts admission caps ready groups at "
            f"(K + 1)·B){workload_says}"
        )
    try:
        pol = policy_for(spec, policy.value, **overrides)
    except ValidationError as exc:
        fail(problems(exc, FLAGS))
    if ready_surplus is not None and pol.admission is AdmissionMode.LIVE:
        why = "" if admission is not None else f" (policy {policy.value} admits live unless told otherwise)"
        fail(f"--ready-surplus: only with --admission in_flight{workload_says or why}")
    if policy is not PolicyName.FULL and (keys := spec.full_only()):
        named = " and ".join(f"policy.{k}" for k in keys)
        say(f"note: the workload's {named} are full's; policy {policy.value} runs with its own")
    # Off a terminal too: a long workload (batches: 10000) ran for most of an hour without a word.
    lines = progress_lines("sim", "batches", quiet_s=QUIET_S)
    with interrupt_says(json_out, plot), simulation_errors(), progress_bar() as progress:
        task = progress.add_task(f"sim {policy.value}", total=spec.batches)

        def on_batch(done: int) -> None:
            progress.update(task, completed=done)
            if lines is not None:
                lines(done, spec.batches)

        report = simulate(spec, pol, policy.value, on_batch=on_batch, timeline=plot is not None)
    finish(report, json_out, plot, f"lower bound {report['lower_bound_s']:.1f} s")
    if (note := cut_short_note(policy.value, spec, report)) is not None:
        say(note)
    say_serving_note(spec, report)


def parse_sweep(text: str, flag: str, high: int, example: str) -> list[int]:
    """A comma-separated list of integers in 0..high, at least one and at most MAX_SWEEP_VALUES;
    `example` is one such list, for the refusals."""
    give = f"give comma-separated integers, e.g. {example}"
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        fail(f"{flag} is empty; {give}")
    values = []
    for item in items:
        if not item:
            fail(f"{flag} {text!r}: empty item; {give}")
        try:
            value = parse_int(item)
        except ValueError:
            fail(f"{flag}: {item!r} is not an integer; {give}")
        if not 0 <= value <= high:
            fail(f"{flag}: {value} is outside 0..{high}")
        if value in values:
            fail(f"{flag}: {value} is given twice; each value is a full simulation")
        values.append(value)
    if len(values) > MAX_SWEEP_VALUES:
        fail(f"{flag}: {len(values)} values; at most {MAX_SWEEP_VALUES} (each one is a full simulation)")
    return values


SURPLUS_SWEEP = "0,16,32,64,96"
STALENESS_SWEEP = "4,8"


def bench(
    json_out: Annotated[
        Path, typer.Option("--json", help="where to write the bench report; - for stdout", parser=output_path)
    ],
    workload: Annotated[
        Path | None,
        typer.Option(help=f"{WORKLOAD_HELP}; default: the built-in terminal-bench-style workload"),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write an image of the ladder and the sweeps (.png, .svg, .pdf ...)", parser=output_path
        ),
    ] = None,
    surplus_sweep: Annotated[
        str | None,
        typer.Option(
            help=f"comma-separated values of S (surplus groups) to sweep, each 0..{MAX_SURPLUS}; "
            f"default: {SURPLUS_SWEEP}"
        ),
    ] = None,
    staleness_sweep: Annotated[
        str | None,
        typer.Option(
            help=f"comma-separated values of K (staleness bound, in policy versions) to compare, "
            f"each 0..{MAX_STALENESS}; default: {STALENESS_SWEEP}"
        ),
    ] = None,
    peers: Annotated[
        bool, typer.Option("--peers", help="add rungs that emulate AReaL, prime-rl, PipelineRL, slime, SkyRL")
    ] = False,
    family: Annotated[
        bool,
        typer.Option(
            "--family", help="every built-in workload × every rung instead (default, design, cpu-scarce, ...)"
        ),
    ] = False,
) -> None:
    """Run the ablation ladder (sync, completion, lanes, full) and the S and K sweeps on the same draws."""
    from app.sim.bench import run_bench

    if family:
        if workload is not None:
            fail(f"--family runs every built-in workload; it takes no --workload (given {workload})")
        for flag, given in (("--surplus-sweep", surplus_sweep), ("--staleness-sweep", staleness_sweep)):
            if given is not None:  # it was run without a word, and the report had no sweep
                fail(f"--family runs the rungs of every built-in workload, no sweep; it takes no {flag}")
        _bench_family(json_out, plot, peers)
        return

    s_given = SURPLUS_SWEEP if surplus_sweep is None else surplus_sweep
    k_given = STALENESS_SWEEP if staleness_sweep is None else staleness_sweep
    s_values = parse_sweep(s_given, "--surplus-sweep", MAX_SURPLUS, "0,16,32")
    k_values = parse_sweep(k_given, "--staleness-sweep", MAX_STALENESS, "1,2,4")
    check_output(json_out, "--json")
    check_plot(plot)
    spec = load(workload)
    check_apart({"--json": json_out, "--plot": plot}, workload_inputs(workload, spec))
    for s in s_values:
        check_surplus(spec, s, "--surplus-sweep")
    with interrupt_says(json_out, plot), simulation_errors(), progress_bar() as progress:
        task = progress.add_task("bench", total=None)
        lines = progress_lines("bench", "simulations")

        def on_run(label: str, done: int, total: int) -> None:
            progress.update(task, description=f"bench: {label}", completed=done, total=total)
            if lines is not None:
                lines(done, total)

        result = run_bench(spec, s_values, k_values, on_run=on_run, peers=peers)
    from app.sim.plot import plot_bench  # before the report: a Ctrl-C in between would say nothing of it

    write_report(json_out, result, lambda out: plot_bench(result, out), plot)
    err.print(ladder_table(result), markup=False)
    err.print(sweep_table(result), markup=False)
    for line in result["findings"]:
        err.print(f"!!! {line}", markup=False)
    for name, report in result["policies"].items():
        if (note := cut_short_note(name, spec, report)) is not None:
            err.print(note, markup=False)
    say_serving_note(spec, result["policies"].get("full"))


def _bench_family(json_out: Path, plot: Path | None, peers: bool) -> None:
    """`corral bench --family`: the table of benchmarks/family.py, as a command."""
    from app.sim.family import run_family

    check_output(json_out, "--json")
    check_plot(plot)
    check_apart({"--json": json_out, "--plot": plot}, {})
    with interrupt_says(json_out, plot), progress_bar() as progress:
        task = progress.add_task("bench --family", total=None)
        lines = progress_lines("bench", "simulations")

        def on_run(label: str, done: int, total: int) -> None:
            progress.update(task, description=f"bench: {label}", completed=done, total=total)
            if lines is not None:
                lines(done, total)

        result = run_family(peers=peers, on_run=on_run)
    from app.sim.plot import plot_family

    write_report(json_out, result, lambda out: plot_family(result, out), plot)
    for name, data in result["workloads"].items():
        means = ", ".join(f"{rung} {shown_s(row['mean_s'])}" for rung, row in data["rungs"].items())
        err.print(f"{name}: {means}", markup=False)
        for line in data["findings"]:
            err.print(f"!!! {name}: {line}", markup=False)


def sweep_table(result: dict[str, Any]) -> str:
    """The S and K sweeps and the ablations of `full`, one row each (they were only in the JSON)."""
    rows = [
        "| full with | mean (s) | p90 (s) | idle | stale | wasted trajectory-s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    sweeps = result["sweeps"]
    named = [(f"S = {r['surplus_groups']}", r) for r in sweeps["surplus"]]
    named += [(f"K = {r['max_staleness']}, S = {r['surplus_groups']}", r) for r in sweeps["max_staleness"]]
    named += [(label.removeprefix("full "), r) for label, r in sweeps["ablations"].items()]
    for label, r in named:
        wasted = sum(r["wasted_trajectory_s"].values())  # by reason
        rows.append(
            f"| {label} | {shown_s(r['batch_collection_s'])} | {shown_s(r['p90_s'], none='')} "
            f"| {r['trainer_idle_fraction']:.0%} | {r['discarded_groups']['stale']} | {wasted:.0f} |"
        )
    return "\n".join(rows)


def ladder_table(result: dict[str, Any]) -> str:
    rows = ["| policy | mean (s) | p50 (s) | p90 (s) | vs sync | lower bound (s) | idle | stale | restarts |"]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    sync_mean = result["policies"]["sync"]["batch_collection_s"]["mean"]
    for name, rep in result["policies"].items():
        bc = rep["batch_collection_s"]
        ratio = f"{sync_mean / bc['mean']:.2f}×" if sync_mean is not None and bc["mean"] else "n/a"
        rows.append(
            f"| {name} | {shown_s(bc['mean'])} | {shown_s(bc['p50'], none='')} "
            f"| {shown_s(bc['p90'], none='')} | {ratio} "
            f"| {rep['lower_bound_s']:.1f} | {rep['trainer_idle_fraction']:.0%} "
            f"| {rep['discarded_groups']['stale']} | {rep['restarted_trajectories']} |"
        )
    return "\n".join(rows)
