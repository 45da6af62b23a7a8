"""Benchmarks: each prints measured figures; none asserts a speed."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def check_outputs(**paths: object) -> None:
    """Before any work, prove each output path (flag name → path or None; a name ending in "plot" must
    also be an image format) can be written, as `corral`'s commands do; exit 2 with one line if not."""
    import typer

    from app.cli.common import check_apart, check_output, check_plot

    outputs: dict[str, Path | None] = {}
    for name, given in paths.items():
        outputs[f"--{name.replace('_', '-')}"] = None if given is None else Path(str(given))
    try:
        for flag, path in outputs.items():
            if path is None:
                continue
            if flag.endswith("plot"):
                check_plot(path, flag)
            else:
                check_output(path, flag)
        check_apart(outputs, {})
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None


def interruptible(work: Callable[[], T]) -> T | None:
    """`work()`, or None after a Ctrl-C, which reaches a process pool's workers too (they end quietly:
    `app.children.quiet_worker`), with one line saying nothing was written."""
    from concurrent.futures.process import BrokenProcessPool

    try:
        return work()
    except (KeyboardInterrupt, BrokenProcessPool):
        print("interrupted: nothing written", file=sys.stderr)
        return None


def write_results(
    result: dict[str, Any],
    json_out: Path | None,
    plot_out: Path | None,
    draw: Callable[[dict[str, Any], Path], None],
) -> None:
    """Write `result` as JSON to `json_out` and draw it to `plot_out`, each if given."""
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    if plot_out:
        draw(result, plot_out)
