"""`corral`: the command line. One module per command; this one wires them into one app.

Invariants: bad input ends with a one-line message naming the flag or field as the user typed it and
exit code 2, never a traceback (click's usage errors included); long work shows progress on stderr.
"""

from __future__ import annotations

from app import early_signals

# First, before the heavy imports below: a Ctrl-C from here on is held, not a KeyboardInterrupt inside
# an import. `corral run` takes it (and stops with a report); every other command releases it. Then,
# before any file is opened, a closed standard input, output or error is /dev/null (app/stdio.py).
if early_signals.is_command_process():
    early_signals.hold()
    early_signals.keep_ctrl_c_out_of_finalizers()
    from app import stdio

    stdio.fill_closed()

import errno
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from typer.exceptions import TyperException

from app.api.serve import serve
from app.cli.advise import advise, trace_app
from app.cli.common import NON_FINITE, err, fail, interruptible_command, sigterm_as_ctrl_c
from app.cli.engine import engine
from app.cli.prune import prune
from app.cli.run import run
from app.cli.sim import bench, sim
from app.cli.worker import worker

HELP = """Corral: keep the GRPO trainer fed with fresh, valid, trainable batches.

A batch is B groups of G attempts at one task each. Corral fills it with the first B groups to
complete, keeping up to S extra groups (the surplus) running so a slow group does not hold the batch.
New policy weights reach the engines one at a time; a group whose oldest turn is more than K policy
versions behind the trainer (the staleness bound) is discarded with a reason.
"""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, rich_markup_mode=None)
app.command()(interruptible_command(sigterm_as_ctrl_c(sim)))
app.command()(interruptible_command(sigterm_as_ctrl_c(bench)))
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
    interruptible_command(engine)
)
app.command()(run)  # takes the stop signals held since start-up itself: it stops with a report
# SIGTERM as Ctrl-C: uvicorn stops gracefully on either, then raises the signal again under the handler
# it found; SIGTERM's default action would kill the process before serve says what became of its runs.
app.command()(interruptible_command(sigterm_as_ctrl_c(serve)))
app.command()(interruptible_command(worker))
app.command()(interruptible_command(sigterm_as_ctrl_c(advise)))
app.command()(interruptible_command(sigterm_as_ctrl_c(prune)))  # stops between two runs
app.add_typer(trace_app, name="trace")


def _version() -> str:
    try:
        return version("corral")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"corral {_version()}")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_show_version, help="print the version and exit"),
    ] = False,
) -> None:
    """Corral: keep the GRPO trainer fed."""
    # A Ctrl-C while corral was still loading: this command never starts (nor is its usage checked).
    # The signals stay held until the command begins (`interruptible_command`).
    if ctx.invoked_subcommand != "run" and early_signals.take():
        raise typer.Abort()
    if ctx.invoked_subcommand == "serve" and early_signals.is_command_process():
        from app.sandboxes import leftovers

        # It owns the sandboxes it makes: first remove what a killed earlier one left (logged).
        leftovers.declare_owner()


def empty_argument(argv: list[str]) -> str | None:
    """Why the command line has an empty argument, or None. Every value `corral` takes is a path, a
    number, a name or a list, none of them empty; an empty path read as '.' (the current directory:
    `trace import ""` imported from it, `--json ""` said '.: is a directory')."""
    for i, arg in enumerate(argv):
        if arg == "":
            before = argv[i - 1] if i else ""
            where = before if before.startswith("-") else f"argument {i + 1}"
            return f"{where}: empty"
        if arg.startswith("--") and arg.endswith("=") and len(arg) > 3:
            return f"{arg[:-1]}: empty"
    return None


def typed_value(argv: list[str], opts: Any) -> str | None:
    """The value given on the command line for an option known by `opts` (`--surplus -1` or
    `--surplus=-1`; the last one when given twice), or None."""
    names = tuple(o for o in opts if isinstance(o, str) and o.startswith("-"))
    found = None
    for i, arg in enumerate(argv):
        if arg in names and i + 1 < len(argv):
            found = argv[i + 1]
        elif "=" in arg and arg.split("=", 1)[0] in names:
            found = arg.split("=", 1)[1]
    return found


def main() -> None:
    if (problem := empty_argument(sys.argv[1:])) is not None:
        err.print(f"error: {problem}", markup=False)
        early_signals.release()
        sys.exit(2)
    try:
        code = app(standalone_mode=False)
    except TyperException as exc:  # click's usage errors: a bad flag, value or command
        # `corral`, `corral trace`: no command. By name: typer raises its own vendored click's class.
        if type(exc).__name__ == "NoArgsIsHelpError":
            # Its message is the whole help, which the one-line form below squashed into one line.
            err.print(str(exc.format_message()), markup=False, highlight=False)
            sys.exit(2)
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        message = " ".join(str(exc.format_message()).split()).replace(": Value error, ", ": ")
        typed = typed_value(sys.argv[1:], getattr(getattr(exc, "param", None), "opts", ()))
        if typed is not None and message.startswith("Invalid value"):
            if NON_FINITE.fullmatch(typed.strip()):
                # a range's bound ("should be less than or equal to 1000, not 'nan'") missed the point
                message = f"{message.split(':', 1)[0]}: {typed!r} is not a finite number"
            elif repr(typed) not in message:
                message += f", not {typed!r}"  # as a workload file's refusals say
        err.print(f"error: {where}{message}", markup=False)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):  # the latter: a second Ctrl-C as click said the first
        early_signals.stopping()
        err.print("interrupted", markup=False)
        sys.exit(130)
    except OSError as exc:
        # A path the OS refuses to even look up (a name over 255 bytes): Python 3.11's `Path.exists`
        # raises on it. The flags' own checks name the flag; this catches any path they do not check.
        if exc.errno != errno.ENAMETOOLONG:
            raise
        err.print(f"error: {exc.filename or 'a path'}: file name too long", markup=False)
        sys.exit(2)
    finally:
        early_signals.release()  # a caller in the same process gets its handlers back
        # The command is over, however it ended: a stop signal from here on has nothing to stop, and
        # left to Python's default it killed the process as it exited (-2 after "stopped" or
        # "interrupted", where the status said was 0 or 130).
        early_signals.stopping()
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "fail", "main"]
