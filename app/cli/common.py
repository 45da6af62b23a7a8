"""What every `corral` command shares: one-line refusals, output paths checked before the work, strict
JSON reports and the progress bar.

Exit codes (README, "Commands"): `REFUSED` (2) for bad input, refused before any work (a flag, a
value, an input file, an output path that cannot be written); `FAILED` (1) when the work ran but did
not end well: an output (report, plot, trace, standard output) that could not be written once the work
was done (the path changed since it was checked, a disk filled), or a run that could not go on; 130
when interrupted. A standard error that cannot be written (a full disk, a pipe whose reader is gone)
ends no command: what goes there goes to /dev/null from then on, and a refusal goes to standard output.

Invariants: a refusal is one line on stderr, `error: <what the user typed>: <why>`, exit code 2; an
output that cannot be written after the work is one line too, `error: cannot write <path>: <why>`,
exit code 1, whichever output it is; text from the user (paths, values) is never read as rich markup;
an output path is proven writable (and left as it was) before any work starts, replaceable if it
exists, is a regular file or a new one (a link is written through), and is none of the command's
inputs or other outputs; a report is strict JSON (no NaN or Infinity).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, ParamSpec

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from app import early_signals, stdio, terminal
from app.outputs import is_null_device, write_text_atomically

P = ParamSpec("P")

# Why standard error could not be written, from the first write it refused on
_stderr_refused: list[str] = []


class _StderrConsole(Console):
    """Standard error, where a write it refuses (a full disk under `2> file`, a pipe whose reader is
    gone, a terminal hung up) is noted (`stderr_lost`) and standard error pointed at /dev/null: the
    command goes on, and nothing later (a log line, the interpreter's last flush) fails on it again.
    Before, the first such line raised into the command, and its traceback went into the same dead
    stream."""

    def print(self, *objects: Any, **kwargs: Any) -> None:
        try:
            super().print(*objects, **kwargs)
        except OSError as exc:
            self._refused(exc.strerror or str(exc))

    def on_broken_pipe(self) -> None:
        # rich's own ends the command, exit status 1, and points standard output (not error) at /dev/null
        self._refused(os.strerror(errno.EPIPE))

    def _refused(self, why: str) -> None:
        _stderr_refused.append(why)
        terminal.detach([2])


err = _StderrConsole(stderr=True, soft_wrap=True, highlight=False)


def stderr_lost() -> str | None:
    """Why standard error cannot be written (closed when the process started, or a write refused), or
    None while it can be, as far as anything written to it tells."""
    if sys.stderr is None:
        return "it is closed"
    return _stderr_refused[0] if _stderr_refused else None


def on_stdout(line: str) -> None:
    """`line` on standard output, unbuffered; nothing where that cannot be written either."""
    with contextlib.suppress(OSError):
        os.write(1, f"{line}\n".encode())


REFUSED = 2  # bad input, refused before any work: the usage error of POSIX utilities and click
FAILED = 1  # the work ran and did not end well: an output it could not write, a run that could not go on


def fail(message: str, code: int = REFUSED) -> NoReturn:
    """Refuse: one line naming the problem, exit code 2 (or `code`); on standard output when standard
    error cannot be written."""
    lines = [" ".join(line.split()) for line in message.splitlines()]
    line = "; ".join(line for line in lines if line)
    err.print(Text.assemble(("error:", "bold red"), " ", line))
    if stderr_lost() is not None:
        on_stdout(f"error: {line}")  # said where it can be
    raise typer.Exit(code)


def cannot_write(what: Path | str, why: str) -> NoReturn:
    """An output that the work made and that could not be written (its path was checked before the
    work, so something changed since: a directory removed, a disk filled): one line, exit code 1, the
    same for a report, a plot, a trace and standard output."""
    fail(f"cannot write {what}: {why}", FAILED)


def say(message: str) -> None:
    """A plain line on stderr; `[` in a path stays as typed."""
    err.print(Text(message))


@contextmanager
def progress_bar() -> Iterator[Progress]:
    with Progress(
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=not err.is_terminal,
        disable=not err.is_terminal,
    ) as progress:
        yield progress


PROGRESS_LINE_S = 10.0  # off a terminal, at most one progress line this often
# Off a terminal, `sim` and `trace import` say how far they are only once they have taken this long: a
# quick one prints only its result.
QUIET_S = 5.0


class ProgressLines:
    """Progress where the bar is off (stderr is a log or a pipe, not a terminal): `12/48 simulations,
    40 s` as a plain line on stderr at the first finished item, then at most once every `every_s`, so
    that a log shows the command is alive. Nothing before the first item: a command refused on its first
    item ends in its one line. With `quiet_s`, nothing before that either: a quick `trace import` says
    only its result."""

    def __init__(
        self,
        label: str,
        unit: str,
        every_s: float = PROGRESS_LINE_S,
        clock: Callable[[], float] = time.monotonic,
        write: Callable[[str], None] = say,
        quiet_s: float = 0.0,
    ) -> None:
        self.label, self.unit, self.every_s, self.quiet_s = label, unit, every_s, quiet_s
        self.clock, self.write = clock, write
        self.started = clock()
        self.last: float | None = None

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done == 0 or now - self.started < self.quiet_s:
            return
        if self.last is not None and now - self.last < self.every_s:
            return
        self.last = now
        self.write(f"{self.label}: {done}/{total} {self.unit}, {now - self.started:.0f} s")


def progress_lines(label: str, unit: str, quiet_s: float = 0.0) -> ProgressLines | None:
    """`ProgressLines` where the progress bar is off (stderr not a terminal), else None."""
    return None if err.is_terminal else ProgressLines(label, unit, quiet_s=quiet_s)


def interruptible_command(command: Callable[P, None]) -> Callable[P, None]:
    """A command that does not take the stop signals itself (every one but `corral run`): the signals
    held since start-up are released as it begins (one held meanwhile ends it there), and a Ctrl-C it
    does not handle itself (while it loads a workload, imports, or reads a trace) ends it as
    `interrupted`, exit 130 (`corral`'s entry point says so); typer would end it silently."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        if early_signals.release():
            raise typer.Abort()  # Ctrl-C while corral was still loading: this command never starts
        try:
            command(*args, **kwargs)
        except KeyboardInterrupt:
            raise typer.Abort() from None
        except ImportError as exc:
            if not interrupted_import(exc):
                raise
            raise typer.Abort() from None

    return wrapper


def interrupted_import(exc: ImportError) -> bool:
    """Whether a Ctrl-C cut an import short: in a C extension's initialisation (matplotlib's `_image`,
    while a plot is drawn) Python raises ImportError 'initialization failed' from the KeyboardInterrupt,
    which a handler of KeyboardInterrupt does not catch (a traceback reached the user)."""
    return isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt)


def sigterm_as_ctrl_c(command: Callable[P, None]) -> Callable[P, None]:
    """While the command works, SIGTERM (`kill PID`, `timeout`, a supervisor) and SIGHUP (its terminal
    closed, an ssh session dropped) act as Ctrl-C does, as they do for `corral run`: one line, exit
    130, `advise` keeps what it simulated, and `serve` says what became of its runs. After SIGHUP what
    went to the lost terminal goes to /dev/null (app.terminal), so that its first line does not fail
    the command. A SIGHUP ignored at start (`nohup`) stays ignored; so does a SIGINT (a background job),
    and SIGTERM then does what Ctrl-C would have done (`early_signals.ctrl_c_handler`)."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        fds = terminal.terminal_fds()

        def hangup(signum: int, frame: Any) -> None:
            terminal.detach(fds)
            _as_ctrl_c(signum, frame)

        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _as_ctrl_c)}
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, hangup)
        try:
            command(*args, **kwargs)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    return wrapper


def _as_ctrl_c(signum: int, frame: Any) -> None:
    # Also where SIGINT is ignored (a background job of a non-interactive shell: a supervisor's or a
    # script's `cmd & ... kill $!`): what a Ctrl-C would have done there, SIGINT staying ignored.
    handler = early_signals.ctrl_c_handler()
    if callable(handler):
        handler(signal.SIGINT, frame)
        return
    # Ctrl-C left to the OS: the signal does what it would have done.
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@contextmanager
def interrupt_says(json_out: Path, plot: Path | None = None) -> Iterator[None]:
    """A Ctrl-C during the work ends the command with one line saying nothing was written (the plot
    too, when one was asked for), exit 130 (typer would end it silently)."""
    try:
        yield
    except KeyboardInterrupt:
        say(f"interrupted; {json_out}{'' if plot is None else f' and {plot}'} not written")
        raise typer.Exit(130) from None


@contextmanager
def _os_refusal(flag: str, path: Path) -> Iterator[None]:
    """An OS error while merely looking at a path the user gave (a name too long to look up, which
    Python 3.11's `Path.exists` raises on) refused as that flag's error."""
    try:
        yield
    except OSError as exc:
        fail(f"{flag} {path}: {exc.strerror or exc}")


def output_path(value: str | Path) -> Path:
    """An output file's path as typed (typer's `parser` for --json, --plot and --out; a default comes
    as a `Path`). A path typed with a trailing separator names a directory: `Path` would drop the
    separator and write a file of that name."""
    if isinstance(value, Path):
        return value
    if value.endswith(("/", os.sep)):
        raise typer.BadParameter(f"{value}: ends with '/', so it names a directory; give a file name")
    return Path(value)


# What a user types for standard output. A shell's /dev/stdout is a link to /proc/self/fd/1, which names
# a pipe as `pipe:[N]`: `--json /dev/stdout | jq` was refused with "/proc/PID/fd/pipe:[N]: cannot write
# there: No such file or directory", and with stdout a file, that file was replaced under the shell.
STDOUT_NAMES = frozenset(Path(name) for name in ("-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"))


def is_stdout(path: Path | None) -> bool:
    """`-` (or /dev/stdout) given as --json or --out: the report goes to standard output (every other
    line the command prints goes to stderr). It used to be written to a file named `-`."""
    return path is not None and path in STDOUT_NAMES


def write_stdout(text: str) -> None:
    """`text` on standard output; a reader that stops early (`| head`) ends the output quietly, any
    other failure (a full disk under `> file`) is one line."""
    if sys.stdout is None:
        cannot_write("the report to standard output", "it is closed")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error again at exit
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is buffered is dropped
        cannot_write("the report to standard output", str(exc.strerror or exc))


def _stdout_closed() -> bool:
    if sys.stdout is None or stdio.closed_at_start(1):  # the latter: /dev/null since (app/stdio.py)
        return True
    try:
        os.fstat(sys.stdout.fileno())
    except (OSError, ValueError):
        return True
    return False


def check_output(path: Path, flag: str) -> None:
    """Prove `path` can be written, before the work: create it (and missing parents), then remove
    whatever the check created. Refuses a directory, an unwritable place, a name the OS refuses."""
    if is_stdout(path):
        if _stdout_closed():  # `>&-`: the report would be lost after the work
            fail(f"{flag} -: standard output is closed")
        return
    with _os_refusal(flag, path):
        _check_output(path, flag)


def _check_output(path: Path, flag: str) -> None:
    if path.is_dir():
        fail(f"{flag} {path}: is a directory; give a file name")
    if is_null_device(path):
        return  # thrown away, as asked
    # Before `_target`: the link /dev/stderr (/proc/self/fd/2) to a pipe reads as /proc/PID/fd/pipe:[N],
    # a path that does not exist, and was refused as "cannot write there: No such file or directory".
    if path.exists() and not path.is_file():
        fail(f"{flag} {path}: is not a regular file (a device, pipe or socket); give a file name")
    path = _target(path)
    created: list[Path] = []
    probe = path.with_name(path.name + ".tmp")  # write_json writes here first, then renames
    missing = [p for p in path.parents if not p.exists()]
    for parent in missing:
        if parent.is_symlink():  # a link to nothing: mkdir would fail with "exists"
            fail(f"{flag} {path}: {parent} is a link to {os.readlink(parent)}, which does not exist")
    try:
        for parent in reversed(missing):
            parent.mkdir()
            created.append(parent)
        with probe.open("x"):
            pass
        probe.unlink()
    except FileExistsError:
        fail(f"{flag} {path}: {probe} is in the way; remove it")
    except OSError as exc:
        fail(f"{flag} {path}: cannot write there: {exc.strerror or exc}")
    finally:
        for parent in reversed(created):
            parent.rmdir()
    if path.exists():
        _check_replaceable(path, probe, flag)


def _check_replaceable(path: Path, aside: Path, flag: str) -> None:
    """`write_json` renames its new file over `path`: prove that works (an immutable file, or another
    user's in a sticky directory such as /tmp, can be written beside but not replaced) by moving it to
    `aside` (the probe's name, free) and back. Its content, inode and modification time stay."""
    problem = None
    try:
        try:
            os.rename(path, aside)
        except OSError as exc:
            problem = exc.strerror or str(exc)
    finally:  # also after a Ctrl-C between the two renames
        if os.path.lexists(aside) and not os.path.lexists(path):
            os.rename(aside, path)
    if problem is not None:
        fail(f"{flag} {path}: cannot replace it: {problem}")


def _target(path: Path) -> Path:
    """Where writing `path` lands: through a symbolic link to its target, so the link stays a link."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def check_not_a_directory(path: Path, flag: str, what: str) -> None:
    """An input file given as a directory (`--config .`), refused as such: `check_apart` would call
    the outputs inside it."""
    with _os_refusal(flag, path):
        if path.is_dir():
            fail(f"{flag} {path}: is a directory; give {what}")


def check_apart(outputs: Mapping[str, Path | None], inputs: Mapping[str, Path | None]) -> None:
    """Refuse an output path that is one of the command's inputs (the workload, a trace, a config) or
    another of its outputs: writing it would destroy the file read, or the other output. `inputs` and
    `outputs` map what the user typed (a flag, or a description) to a path or None. An output inside an
    input directory is refused too (a terminal-bench run directory read as trials)."""
    files: dict[str, str] = {}
    dirs: list[tuple[str, str]] = []
    for name, path in inputs.items():
        if path is None:
            continue
        with _os_refusal(name, path):
            if not path.exists():
                continue
        real = os.path.realpath(path)
        if os.path.isdir(real):
            dirs.append((name, real))
        else:
            files.setdefault(real, name)
    for flag, path in outputs.items():
        if path is None or is_stdout(path):
            continue
        with _os_refusal(flag, path):
            real = os.path.realpath(path)
        if real == os.devnull:
            continue  # thrown away: as many outputs as like may go there
        if real in files:
            fail(f"{flag} {path}: is also {files[real]}; writing it would destroy that file")
        for name, folder in dirs:
            if real.startswith(folder + os.sep):
                fail(f"{flag} {path}: is inside {name} {folder}; write it somewhere else")
        files[real] = flag


def check_plot(path: Path | None, flag: str = "--plot") -> None:
    """A plot path must end in a format matplotlib writes, and be writable."""
    if path is None:
        return
    from matplotlib import rcParams
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    # PGF is written by a LaTeX program: without it the plot failed after the work, with a traceback.
    tex = str(rcParams["pgf.texsystem"])
    if shutil.which(tex) is None:
        formats.remove("pgf")
    listed = ", ".join(formats)
    suffix = path.suffix.lower().removeprefix(".")
    if is_stdout(path):
        fail(f"{flag} {path}: a plot is not written to standard output; give a file name, e.g. plot.png")
    if os.path.isdir(path):  # not Path.is_dir: it raises on a name the OS refuses (too long)
        fail(f"{flag} {path}: is a directory; give a file name, e.g. {path / 'plot.png'}")
    if is_null_device(path):
        return  # drawn and thrown away (as PNG), as asked
    if suffix not in formats:
        if not suffix:
            fail(f"{flag} {path}: the name has no image extension; end it with one of {listed}")
        if suffix == "pgf":
            fail(f"{flag} {path}: '.pgf' is made by {tex}, which is not installed; use one of {listed}")
        fail(f"{flag} {path}: '.{suffix}' is not an image format; use one of {listed}")
    check_output(path, flag)


_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
NON_FINITE = re.compile(r"[+-]?(nan|inf|infinity)", re.IGNORECASE)


def decimal_parser(unit: str, example: str) -> Callable[[str | float], float]:
    """typer's `parser` for a flag that takes a number of `unit` as typed: a plain decimal number in
    ASCII digits (`600`, `0.5`, `1e3`). `float()` alone also takes '_' between digits (`1_0` is 10),
    surrounding whitespace and other scripts' digits. 'nan' and 'inf' pass, for the flag's own check
    to refuse by name; a decimal too large for a float (`1e400`, which `float()` makes inf) is refused
    here, as typed."""

    def parse(value: str | float) -> float:
        if isinstance(value, float):
            return value
        if NON_FINITE.fullmatch(value):
            return float(value)
        if not _DECIMAL.fullmatch(value):
            raise typer.BadParameter(f"{value!r} is not a number of {unit}; give e.g. {example}")
        number = float(value)
        if not math.isfinite(number):
            raise typer.BadParameter(f"{value!r} is out of range for a number of {unit}")
        return number + 0.0  # -0 is 0

    return parse


seconds = decimal_parser("seconds", "600 or 2.5")  # a duration flag's


def check_seconds(value: float | None, flag: str, *, low: float, high: float) -> None:
    """A duration flag: finite, and within [low, high] seconds (a denormal such as 1e-320 is not a
    duration anyone means)."""
    if value is None:
        return
    if not math.isfinite(value):
        fail(f"{flag} must be a finite number of seconds, not {value}")
    if not low <= value <= high:
        shown = f"{value:,.0f}" if value.is_integer() else repr(value)  # repr: 1e-320 as typed
        fail(f"{flag} must be ≥ {low:g} s and ≤ {high:,.0f} s, not {shown}")


def write_json(path: Path, data: Any) -> None:
    """Strict JSON, atomically (a reader never sees a half-written report).

    A non-finite number (a bug upstream: every input is finite) is written as null, never as NaN, and
    named in a warning line, so the work of a long run is not lost to it."""
    bad = list(_non_finite(data))
    if bad:
        say(f"warning: {path}: no finite value at {', '.join(bad)}; written as null")
        data = _finite_or_none(data)
    write_output(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def write_output(path: Path, text: str) -> None:
    """`text` to the file at `path` (`-`: stdout), atomically; where it cannot be written there, the
    work is not lost: it goes where it can, said in one line, exit 1."""
    if is_stdout(path):
        write_stdout(text)
        return
    try:
        write_text_atomically(_target(path), text)
    except OSError as exc:
        kept = _keep_elsewhere(path, text)
        where = f"; written to {kept} instead" if kept is not None else "; it could not be written anywhere"
        cannot_write(path, why_not_written(path, exc) + where)


def why_not_written(path: Path, exc: OSError) -> str:
    """Why writing `path` failed, in words: its parent no longer a directory, or the OS's reason."""
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        return f"{parent} is not a directory"
    return str(exc.strerror or exc)


def _keep_elsewhere(path: Path, text: str) -> Path | None:
    """`text` written to a new file in the temporary directory, named after `path`; None when that
    fails too (and no part of it is left there)."""
    try:
        fd, name = tempfile.mkstemp(prefix=f"corral-{path.stem}-", suffix=path.suffix or ".json")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError:
        os.unlink(name)
        return None
    return Path(name)


def _finite_or_none(data: Any) -> Any:
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite_or_none(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite_or_none(value) for value in data]
    return data


def _non_finite(data: Any, where: str = "") -> Iterator[str]:
    if isinstance(data, float) and not math.isfinite(data):
        yield where or "(top)"
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _non_finite(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list | tuple):
        for i, value in enumerate(data):
            yield from _non_finite(value, f"{where}[{i}]")


def summary_line(report: dict[str, Any], json_out: Path, detail: str) -> str:
    """The one line a command ends with; a run with no batch says so instead of a mean of nothing."""
    share = report["trainer_idle_fraction"]
    idle = "stopped before collecting" if share is None else f"trainer idle {share:.0%}"
    if not report["batches"]:
        return f"{report['policy']}: no batch delivered, {detail}, {idle} → {json_out}"
    bc = report["batch_collection_s"]
    n = report["batches"]
    return (
        f"{report['policy']}: {n} batch{'es' if n != 1 else ''}, collection mean {bc['mean']:.1f} s "
        f"(p90 {bc['p90']:.1f} s), {detail}, {idle} → {json_out}"
    )


def write_plot(
    draw: Callable[[Path], None], path: Path | None, flag: str = "--plot", written: Path | None = None
) -> None:
    """Draw a plot to `path` (nothing when None), creating the missing parents that `check_output`
    proved could be created; a failure is one line, never a traceback, exit code 1 as for the report
    (it was 2, as if the path had been refused before the work). `written`: the report already
    written, which a Ctrl-C while the plot is drawn (a second or more) ends the command saying."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        draw(path)
    except OSError as exc:
        cannot_write(f"the plot {path}", why_not_written(path, exc))
    except ValueError as exc:
        cannot_write(f"the plot {path}", str(exc))
    except (KeyboardInterrupt, ImportError) as exc:
        if isinstance(exc, ImportError) and not interrupted_import(exc):
            raise
        if written is None:
            raise KeyboardInterrupt from None
        report = "the report (standard output)" if is_stdout(written) else str(written)
        say(f"interrupted; {report} written, {path} not written")
        raise typer.Exit(130) from None


def write_report(json_out: Path, data: Any, draw: Callable[[Path], None], plot: Path | None) -> None:
    """The report, then its plot. A report that cannot be written where asked (kept elsewhere, exit 1)
    still gets its plot: the command ended before drawing it, so a real run's plot was lost whatever
    disk it was to go to."""
    try:
        write_json(json_out, data)
    except typer.Exit:
        write_plot(draw, plot)
        raise
    write_plot(draw, plot, written=json_out)


def finish(report: dict[str, Any], json_out: Path, plot: Path | None, detail: str) -> None:
    """Write the report (and the timeline plot), then the summary line."""
    from app.plots import plot_timeline

    write_report(json_out, report, lambda out: plot_timeline(report, out), plot)
    say(summary_line(report, json_out, detail))


def settings_problem(exc: Any, flags: Mapping[str, str] | None = None) -> str:
    """One line for a settings `ValidationError`: the first problem, named as the user set it (the
    flag in `flags`, by field, else its `CORRAL_` variable), without pydantic's prefixes."""
    from app.validation import describe

    first = exc.errors()[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    name = (flags or {}).get(field, f"CORRAL_{field.upper()}")
    message = describe(first)
    return message if message.startswith(name) else f"{name}: {message}"


def check_run_dirs(data_dir: Path | None, spill_dir: Path | None) -> None:
    """Refuse, in one line, a CORRAL_DATA_DIR (or CORRAL_SPILL_DIR) this process cannot create files in,
    before the server starts: it was found only by each run, a local run failing at once with a
    traceback in the log and a simulated one keeping no batch for a restart. A file is made in each
    (directories made for it are removed again), since permission bits do not stop root."""
    from app.runtime.config import LocalRunError, check_writable_dir

    for name, path in (("CORRAL_DATA_DIR", data_dir), ("CORRAL_SPILL_DIR", spill_dir)):
        if path is None:
            continue
        try:
            check_writable_dir(path, name)
        except LocalRunError as exc:
            fail(str(exc))


def database_reason(exc: Exception) -> str:
    """A database error's reason in one line: the driver's own message, not SQLAlchemy's wrapping."""
    return str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]


def check_database(
    url: str, create: bool = True, migrate: bool = True, before_writing: Callable[[str], None] | None = None
) -> str:
    """Open the database (migrating it to the current schema) before the server starts, so that one
    that cannot be reached or created is one line, not the server's start-up traceback. Returns the URL
    to show, with any password hidden. With `create` False the database must be Corral's already: a
    SQLite file that does not exist is refused instead of made (`corral prune` in the wrong directory
    left a new, empty database there), and so is a database without Corral's schema, which is only read
    (a dry run's prune gave another program's SQLite file Corral's tables). With `migrate` False too, a
    schema behind this Corral's is refused rather than migrated: nothing is written. `before_writing`,
    given the URL to show, runs before anything is written (`corral serve` takes its hold there, so that
    a second server, refused, has not migrated the database under the one that uses it)."""
    from alembic.util import CommandError
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    from app.service.store import ServiceStore
    from app.store.db import sqlite_file
    from app.validation import hide_password

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        fail(f"CORRAL_DATABASE_URL {hide_password(url)}: not a database URL: {exc}")
    shown = parsed.render_as_string(hide_password=True)
    path = sqlite_file(parsed) if parsed.get_backend_name() == "sqlite" else None
    if path is not None:
        uri = bool(parsed.query.get("uri"))  # `file:...?mode=ro`: a URI, not a path
        if not create and not uri and not path.exists():
            fail(f"CORRAL_DATABASE_URL {shown}: no database at {path} (`corral serve` makes one)")
        if not uri:  # a URI's text made a directory named 'file:' in the working one
            with contextlib.suppress(OSError):  # a new database's directory; if it cannot be made, below
                path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if before_writing is not None:
            before_writing(shown)
        if create:
            ServiceStore(url).close()
        else:
            problem = _schema_problem(url, migrate)
            if problem is not None:
                fail(f"CORRAL_DATABASE_URL {shown}: {problem}")
    except SQLAlchemyError as exc:
        reason = database_reason(exc)
        fail(f"CORRAL_DATABASE_URL {shown}: cannot open the database: {reason}")
    except ImportError as exc:  # a driver named in the URL that is not installed
        fail(f"CORRAL_DATABASE_URL {shown}: its driver is not installed ({exc.name or exc})")
    except UnicodeError:  # the host's IDNA encoding failed: an empty label (`a..b`) or one over 63
        fail(f"CORRAL_DATABASE_URL {shown}: cannot open the database: its host is not a host name")
    except CommandError as exc:  # a revision these migrations do not know: a newer Corral's schema
        problem = _newer_schema(_stored_revision(url)) or f"cannot migrate the database: {exc}"
        fail(f"CORRAL_DATABASE_URL {shown}: {problem}")
    return shown


def _stored_revision(url: str) -> str | None:
    from sqlalchemy import create_engine

    from app.store.migrate import current_revision

    engine = create_engine(url)
    try:
        return current_revision(engine)
    finally:
        engine.dispose()


def _newer_schema(revision: str | None) -> str | None:
    """What to say of a schema at `revision` when these migrations do not know it (a newer Corral's, or
    another program's that Alembic manages too); None for any other."""
    from app.store.migrate import head_revision, is_known

    if revision is None or is_known(revision):
        return None
    return (
        f"its schema is at revision {revision}, which this Corral does not know (it knows up to "
        f"{head_revision()}): a newer Corral's, or another program's; use that one, or another database"
    )


def _schema_problem(url: str, migrate: bool) -> str | None:
    """Why the database at `url` is not one to work on, read without writing to it; None when it is
    (migrated to this Corral's schema first, with `migrate`)."""
    from app.store.migrate import head_revision, upgrade_to_head

    revision = _stored_revision(url)
    head = head_revision()
    if revision is None:
        return "not a Corral database (it has no Corral schema; `corral serve` makes one)"
    if revision == head:
        return None
    newer = _newer_schema(revision)
    if newer is not None:
        return newer
    if not migrate:
        return (
            f"its schema is at revision {revision}, not this Corral's {head}; a dry run writes nothing, "
            "so run it without --dry-run (or start `corral serve`) to migrate it first"
        )
    upgrade_to_head(url)
    return None
