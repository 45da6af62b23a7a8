"""Benchmarks: each prints measured figures; none asserts a speed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


def seconds_cell(value: float | None) -> str:
    """A mean in seconds for a table or a line; a rung that delivered no batch has no mean (null in its
    JSON), and says so."""
    return "no batch" if value is None else f"{value:.1f}"


class ScriptParser(argparse.ArgumentParser):
    """A benchmark's flags, refused as `corral`'s commands refuse theirs: one line, `error: --flag: why`
    (with `app.validation.int_between` as the type, `error: --batches: 0 is outside 1..1000`), exit code
    2, where argparse prints its usage and `prog: error: argument ...`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message.removeprefix('argument ')}\n")


@contextmanager
def _exits() -> Iterator[None]:
    """A `corral` helper's `typer.Exit` (its one line already said) as the script's own exit code."""
    import typer

    try:
        yield
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None


def check_outputs(**paths: object) -> None:
    """Before any work, prove each output path (flag name → path or None; a name ending in "plot" must
    also be an image format) can be written, as `corral`'s commands do; exit 2 with one line if not."""
    from app.cli.common import check_apart, check_output, check_plot

    outputs: dict[str, Path | None] = {}
    for name, given in paths.items():
        outputs[f"--{name.replace('_', '-')}"] = None if given is None else Path(str(given))
    with _exits():
        for flag, path in outputs.items():
            if path is None:
                continue
            if flag.endswith("plot"):
                check_plot(path, flag)
            else:
                check_output(path, flag)
        check_apart(outputs, {})


def save_json(path: Path, data: Any) -> None:
    """The figures a benchmark measured, as `corral`'s commands write a report: strict JSON (a
    non-finite number becomes null, with a warning), written whole or not at all. A write that fails
    after the work (the disk filled, the path changed since `check_outputs`) is one line, exit 1, and
    the figures are kept in the temporary directory, where the line says; it was a traceback, and the
    figures of an hour's run were lost."""
    from app.cli.common import write_json

    with _exits():
        write_json(path, data)


def save_plot(draw: Callable[[Path], None], path: Path | None, written: Path | None = None) -> None:
    """`draw(path)`, when a plot was asked for: a failure is one line, exit 1, not a traceback.
    `written`: the JSON already saved, which a Ctrl-C while drawing says was kept."""
    from app.cli.common import write_plot

    with _exits():
        write_plot(draw, path, written=written)


def interruptible(work: Callable[[], T]) -> T | None:
    """`work()`, or None after a Ctrl-C, which reaches a process pool's workers too (they end quietly:
    `app.children.quiet_worker`), with one line saying nothing was written; as a script (`run_script`),
    SIGTERM and SIGHUP too. Run as a script, it ignores stop signals once interrupted, so that it exits
    130 as it says (a second Ctrl-C killed it, -2). A worker lost otherwise (`WorkerLost`: killed,
    crashed) is one line, exit 1."""
    from concurrent.futures.process import BrokenProcessPool

    from app.children import WorkerLost

    try:
        return work()
    except (KeyboardInterrupt, BrokenProcessPool):
        _stopping()
        print("interrupted: nothing written", file=sys.stderr)
        return None
    except WorkerLost as exc:
        _stopping()
        print(f"error: {exc}; nothing written", file=sys.stderr)
        raise SystemExit(1) from None


def run_script(main: Callable[[], int | None]) -> None:
    """A benchmark's `if __name__ == "__main__"`: `main()`'s status as the exit status. SIGTERM and SIGHUP
    (the terminal closed) act as Ctrl-C does, through SIGINT's handler as for `corral`'s commands
    (`sigterm_as_ctrl_c`: a simulation then stops at a safe point of its loop; raised anywhere, the
    interrupt broke asyncio's state, "no running event loop"). One that `main` does not handle itself
    ends it with one line, exit 130: it was a KeyboardInterrupt traceback (or a silent -15) from
    wherever the script was, `benchmarks.scale` and the real-run benchmarks among them."""
    from app.cli.common import sigterm_as_ctrl_c

    code: int | None = None

    def work() -> None:
        nonlocal code
        code = main()

    try:
        sigterm_as_ctrl_c(work)()
    except KeyboardInterrupt:
        _stopping()
        print("interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code or 0)


def _stopping() -> None:
    """`app.early_signals.stopping` for a benchmark run as a script (`python -m benchmarks.NAME`), which
    owns its process; not when a test calls its `main`."""
    from app import early_signals

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", "").startswith("benchmarks."):
        early_signals.ignore_stops()


def write_results(
    result: dict[str, Any],
    json_out: Path | None,
    plot_out: Path | None,
    draw: Callable[[dict[str, Any], Path], None],
) -> None:
    """Write `result` as JSON to `json_out` and draw it to `plot_out`, each if given (`save_json`,
    `save_plot`)."""
    if json_out:
        save_json(json_out, result)
    save_plot(lambda path: draw(result, path), plot_out, written=json_out)
