"""`corral run`: collect real trajectories on this machine.

Order of work, so that every refusal comes before any engine starts: flags, output paths, the config
file (including `sandbox.base_dir`), the task suite; then the engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from app import early_signals
from app.cli.common import (
    check_apart,
    check_not_a_directory,
    check_output,
    check_plot,
    check_seconds,
    err,
    fail,
    finish,
    output_path,
    say,
    seconds,
)
from app.core.config import PolicyName
from app.runtime.config import MAX_RUN_BATCHES, LocalRunError, default_config_path, load_config

MAX_RUN_S = 365 * 24 * 3600.0
# Shortest --duration: the deadline counts from when the engines are up, and a batch takes at least a
# trainer step; below a second the run can only start its engines and stop, with no batch.
MIN_RUN_S = 1.0


def run(
    config: Annotated[
        Path | None,
        typer.Option(help="run config (YAML); default: the one shipped with Corral (app/configs/local.yaml)"),
    ] = None,
    json_out: Annotated[
        Path, typer.Option("--json", help="where to write the report; - for stdout", parser=output_path)
    ] = Path("run-report.json"),
    policy: Annotated[PolicyName, typer.Option(help="rung of the ablation ladder")] = PolicyName.FULL,
    duration: Annotated[
        float | None,
        typer.Option(
            help=f"stop after this many seconds, counted once the engines are up "
            f"({MIN_RUN_S:g} to {MAX_RUN_S:.0f})",
            parser=seconds,
        ),
    ] = None,
    batches: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_RUN_BATCHES, help="stop after this many batches; default: the config's"),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="write an image of every group's timeline (.png, .svg, .pdf ...)", parser=output_path
        ),
    ] = None,
) -> None:
    """Collect trajectories for real: embedded engines, local (or, with sandbox.docker_image, docker)
    sandboxes, the built-in tasks.

    Prints each step as it happens. Ctrl-C ends the run after the current step and still writes the
    report."""
    from app.runtime.local import run_local

    check_seconds(duration, "--duration", low=MIN_RUN_S, high=MAX_RUN_S)
    check_output(json_out, "--json")
    check_plot(plot)
    path = config if config is not None else default_config_path()
    check_not_a_directory(path, "--config", "the run config file")
    if path.exists() and not path.is_file():
        # A pipe (`--config <(...)`, a FIFO) blocked the read with Ctrl-C held for the run to act on:
        # nothing but SIGKILL ended it. The config is read again as the run starts, so a pipe cannot work.
        fail(
            f"--config {path}: not a regular file (a pipe, a device); corral run reads it twice: give a file"
        )
    check_apart({"--json": json_out, "--plot": plot}, {"--config": path})
    try:
        cfg = load_config(path)
        from app.runtime.task_source import load_tasks

        tasks = load_tasks(cfg.tasks)
    except LocalRunError as exc:
        fail(str(exc))
    count = batches or cfg.batches
    many = f"{count} batch{'es' if count != 1 else ''}"
    if duration and batches:
        steps = f"{many} or {duration:g} s, whichever comes first"
    else:
        steps = f"{duration:g} s" if duration else many
    say(
        f"corral run: policy {policy.value}, {steps}, B = {cfg.batch.groups} groups of "
        f"G = {cfg.batch.group_size}, S = {cfg.policy.surplus_groups}, K = {cfg.policy.max_staleness}, "
        f"{len(tasks)} tasks; config {path}; report → {json_out}"
    )
    try:
        report = run_local(path, policy.value, duration_s=duration, batches=batches, console=err)
    except LocalRunError as exc:
        fail(str(exc))
    try:
        finish(report, json_out, plot, f"{report['restarted_trajectories']} restarted trajectories")
    finally:
        early_signals.ignore_until_exit()  # the report is written (or could not be): nothing left to stop
    if report.get("error"):  # the run could not go on (every engine given up): the report says why
        err.print(f"error: {report['error']}", markup=False)
        raise typer.Exit(1)
