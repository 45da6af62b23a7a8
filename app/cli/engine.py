"""`corral engine`: serve the embedded torch engine here, or `vllm serve` with the RL routes on a GPU host.

The port is checked (range, and free to bind) before anything heavy loads. Ctrl-C, SIGTERM and SIGHUP
stop it alike (`sigterm_as_ctrl_c`): the server shuts down, `vllm serve` is stopped with it (never left
behind), one line says so, exit 0.
"""

from __future__ import annotations

import subprocess
from enum import StrEnum
from typing import Annotated

import typer

from app.cli.common import fail, sigterm_as_ctrl_c

# How long a stopping `vllm serve` may take to shut its engine processes down before it is killed.
VLLM_STOP_GRACE_S = 30.0


class Backend(StrEnum):
    EMBEDDED = "embedded"
    VLLM = "vllm"


@sigterm_as_ctrl_c
def engine(
    ctx: typer.Context,
    backend: Annotated[
        Backend, typer.Option(help="embedded (torch on this machine's CPUs) or vllm (a GPU host)")
    ] = Backend.EMBEDDED,
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port to serve on")] = 8100,
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    cpus: Annotated[
        str | None, typer.Option(help="embedded: CPU list to pin to, e.g. 0,1 or 0-3; default: all")
    ] = None,
    model: Annotated[str | None, typer.Option(help="vllm: the model to serve (required)")] = None,
) -> None:
    """Serve an engine: the embedded torch engine, or `vllm serve` with the RL routes enabled.

    Prints the URL it serves on. Extra options pass through to the engine (embedded: --layers,
    --hidden, --seed, --sentinel, --weights-dir, --max-batch; see `corral engine -- --help`).
    """
    from app.engines.embedded.__main__ import port_problem

    if backend is Backend.EMBEDDED:
        from app.engines.embedded.__main__ import main as embedded_main

        if model is not None:
            fail("--model is for --backend vllm; the embedded engine serves its own small policy")
        repeated = owned_option(ctx.args)
        if repeated is not None:
            # passed through it overrode ours: the engine served on one port, the stop line named the other
            fail(f"{repeated} after `--`: corral engine sets {repeated} itself; give it before `--`")
        argv = ["--port", str(port), "--host", host, *(["--cpus", cpus] if cpus is not None else [])]
        code = embedded_main([*argv, *ctx.args], prog="corral engine")
        # uvicorn returns once a stop signal (Ctrl-C, SIGTERM, SIGHUP) has shut it down gracefully.
        typer.echo(f"corral engine: stopped; no longer serving on http://{host}:{port}")
        raise typer.Exit(code)
    from app.engines.vllm_launch import VLLMNotInstalledError, launch_vllm

    if not model:
        fail("--backend vllm needs --model, e.g. --model Qwen/Qwen2.5-0.5B-Instruct")
    if cpus is not None:
        fail("--cpus is for the embedded engine; vLLM places itself on the GPU host")
    problem = port_problem(host, port)
    if problem is not None:
        fail(problem)
    try:
        proc = launch_vllm(model, port, host=host, extra=list(ctx.args))
    except (VLLMNotInstalledError, ValueError) as exc:
        fail(str(exc))
    typer.echo(
        f"corral engine: vllm serve {model} on http://{host}:{port} (ready when GET /health answers 200)"
    )
    try:
        code = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM / SIGHUP as one: vLLM stops too, not left behind
        code = stop_child(proc)
        typer.echo(f"corral engine: stopped vllm serve {model} (its exit status {code})")
        raise typer.Exit(0) from None
    raise typer.Exit(code)


OWNED = ("--port", "--host", "--cpus")  # what `corral engine` passes the embedded engine itself


def owned_option(extra: list[str]) -> str | None:
    """The first of `OWNED` among the pass-through options, as the engine's parser reads them (a prefix
    such as `--po` is `--port` there too, and `--port=8197` is `--port`); None if there is none."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    for flag in OWNED:
        parser.add_argument(flag, nargs="?")
    try:
        found, _ = parser.parse_known_args(extra)
    except (argparse.ArgumentError, SystemExit):
        return None  # the engine's own parser refuses these options, naming them
    return next((flag for flag in OWNED if getattr(found, flag[2:]) is not None), None)


def stop_child(proc: subprocess.Popen[bytes], grace_s: float = VLLM_STOP_GRACE_S) -> int:
    """Ask `proc` to stop (SIGTERM; vLLM shuts its engine processes down on it), kill it after
    `grace_s`, and return its exit status."""
    if proc.poll() is None:
        proc.terminate()
    while True:
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait for the graceful stop
            proc.kill()
