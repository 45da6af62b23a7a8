"""`corral`: the command line. Bad input ends with a one-line message naming the problem and exit code 2,
never a traceback; long work shows a progress bar on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from app.core.config import PolicyName
from app.sim.workload import WorkloadError, load_workload

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Corral: keep the GRPO trainer fed.")
err = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(2)


@contextmanager
def progress_bar() -> Iterator[Progress]:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=not err.is_terminal,
        disable=not err.is_terminal,
    ) as progress:
        yield progress


def write_json(path: Path, data: Any) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        tmp.replace(path)  # a reader never sees a half-written report
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror}")


def _load(workload: Path | None) -> Any:
    try:
        return load_workload(workload)
    except WorkloadError as exc:
        fail(str(exc))


@app.command()
def sim(
    workload: Annotated[Path, typer.Option(help="workload spec, YAML or JSON")],
    policy: Annotated[PolicyName, typer.Option(help="rung of the ablation ladder")] = PolicyName.FULL,
    json_out: Annotated[Path, typer.Option("--json", help="where to write the report")] = Path("sim.json"),
    surplus: Annotated[int | None, typer.Option(help="override S")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="override K")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG of every group's timeline")] = None,
) -> None:
    """Simulate one policy on a workload and write its report."""
    from app.sim.run import policy_for, simulate

    spec = _load(workload)
    overrides = {
        k: v for k, v in {"surplus_groups": surplus, "max_staleness": max_staleness}.items() if v is not None
    }
    try:
        pol = policy_for(spec, policy.value, **overrides)
    except ValidationError as exc:
        fail(_validation_message(exc))
    with progress_bar() as progress:
        task = progress.add_task(f"sim {policy.value}", total=spec.batches)
        report = simulate(
            spec,
            pol,
            policy.value,
            on_batch=lambda n: progress.update(task, completed=n),
            timeline=plot is not None,
        )
    _finish(report, json_out, plot, f"lower bound {report['lower_bound_s']:.1f} s")


@app.command()
def bench(
    json_out: Annotated[Path, typer.Option("--json", help="where to write the bench report")],
    workload: Annotated[
        Path | None, typer.Option(help="workload spec; default: built-in terminal-bench-style")
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG of the ladder and the sweeps")] = None,
    surplus_sweep: Annotated[
        str, typer.Option(help="comma-separated S values for the sweep")
    ] = "0,16,32,64,96",
    staleness_sweep: Annotated[str, typer.Option(help="comma-separated K values to compare")] = "4,8",
) -> None:
    """Run the ablation ladder (sync, completion, lanes, full) and the S and K sweeps on the same draws."""
    from app.sim.bench import run_bench

    spec = _load(workload)
    try:
        s_values = [int(x) for x in surplus_sweep.split(",") if x.strip()]
        k_values = [int(x) for x in staleness_sweep.split(",") if x.strip()]
    except ValueError:
        fail("--surplus-sweep and --staleness-sweep take comma-separated integers")
    if any(v < 0 for v in s_values + k_values):
        fail("sweep values for S and K must be ≥ 0")
    with progress_bar() as progress:
        task = progress.add_task("bench", total=None)

        def on_run(label: str, done: int, total: int) -> None:
            progress.update(task, description=f"bench: {label}", completed=done, total=total)

        result = run_bench(spec, s_values, k_values, on_run=on_run)
    write_json(json_out, result)
    if plot is not None:
        from app.sim.plot import plot_bench

        try:
            plot_bench(result, plot)
        except OSError as exc:
            fail(f"cannot write {plot}: {exc.strerror}")
    err.print(ladder_table(result), highlight=False)


def _finish(report: dict[str, Any], json_out: Path, plot: Path | None, detail: str) -> None:
    """Write the report (and the timeline plot), then one summary line."""
    write_json(json_out, report)
    if plot is not None:
        from app.plots import plot_timeline

        try:
            plot_timeline(report, plot)
        except OSError as exc:
            fail(f"cannot write {plot}: {exc.strerror}")
    bc = report["batch_collection_s"]
    err.print(
        f"{report['policy']}: {report['batches']} batches, collection mean {bc['mean']:.1f} s "
        f"(p90 {bc['p90']:.1f}), {detail}, idle {report['trainer_idle_fraction']:.0%} → {json_out}",
        highlight=False,
    )


def ladder_table(result: dict[str, Any]) -> str:
    rows = ["| policy | mean (s) | p50 (s) | p90 (s) | vs sync | lower bound (s) | idle | stale | restarts |"]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    sync_mean = result["policies"]["sync"]["batch_collection_s"]["mean"]
    for name, rep in result["policies"].items():
        bc = rep["batch_collection_s"]
        rows.append(
            f"| {name} | {bc['mean']:.1f} | {bc['p50']:.1f} | {bc['p90']:.1f} "
            f"| {sync_mean / bc['mean']:.2f}× "
            f"| {rep['lower_bound_s']:.1f} | {rep['trainer_idle_fraction']:.0%} "
            f"| {rep['discarded_groups']['stale']} | {rep['restarted_trajectories']} |"
        )
    return "\n".join(rows)


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def engine(
    ctx: typer.Context,
    backend: Annotated[
        str, typer.Option(help="embedded (torch, this machine) or vllm (GPU host)")
    ] = "embedded",
    port: Annotated[int, typer.Option(help="port to serve on")] = 8100,
    cpus: Annotated[str | None, typer.Option(help="CPU list to pin to, e.g. 0,1 or 0-3")] = None,
    model: Annotated[str | None, typer.Option(help="vllm: the model to serve")] = None,
) -> None:
    """Serve an engine: the embedded torch engine, or `vllm serve` with the RL routes enabled.

    Extra options pass through (embedded: --layers, --hidden, --seed, --sentinel, --weights-dir ...).
    """
    if backend == "embedded":
        from app.engines.embedded.__main__ import main as embedded_main

        argv = ["--port", str(port), *(["--cpus", cpus] if cpus else []), *ctx.args]
        raise typer.Exit(embedded_main(argv))
    if backend == "vllm":
        from app.engines.vllm_launch import VLLMNotInstalledError, launch_vllm

        if not model:
            fail("--backend vllm needs --model")
        try:
            proc = launch_vllm(model, port, extra=list(ctx.args))
        except (VLLMNotInstalledError, ValueError) as exc:
            fail(str(exc))
        raise typer.Exit(proc.wait())
    fail(f"--backend must be 'embedded' or 'vllm', not {backend!r}")


@app.command()
def run(
    config: Annotated[Path, typer.Option(help="run config (YAML); see app/configs/local.yaml")] = Path(
        "app/configs/local.yaml"
    ),
    json_out: Annotated[Path, typer.Option("--json", help="where to write the report")] = Path(
        "run-report.json"
    ),
    policy: Annotated[PolicyName, typer.Option(help="rung of the ablation ladder")] = PolicyName.FULL,
    duration: Annotated[float | None, typer.Option(help="stop after this many seconds")] = None,
    batches: Annotated[int | None, typer.Option(help="stop after this many batches")] = None,
    plot: Annotated[Path | None, typer.Option(help="write a PNG of every group's timeline")] = None,
) -> None:
    """Collect trajectories for real: embedded engines, local sandboxes, the built-in tasks.

    Ctrl-C ends the run after the current step and still writes the report."""
    from app.runtime.local import LocalRunError, run_local

    if duration is not None and duration <= 0:
        fail("--duration must be > 0")
    if batches is not None and batches < 1:
        fail("--batches must be ≥ 1")
    try:
        report = run_local(config, policy.value, duration_s=duration, batches=batches, console=err)
    except LocalRunError as exc:
        fail(str(exc))
    _finish(report, json_out, plot, f"restarts {report['restarted_trajectories']}")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
