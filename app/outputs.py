"""Writing a command's output files (reports, traces, plots): whole, or not at all.

Invariant: a reader of the path sees the old file or the new one, never a partial write; and whatever
ends the write (a full disk, an error, a Ctrl-C between the write and the rename), no `.tmp` file is
left beside it. A write the run's own state needs while it runs (`until_written`) waits for a disk that
refuses it, full or read-only, instead of ending the run.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def is_null_device(path: Path) -> bool:
    """`/dev/null` (or a link to it): output a user asked to throw away."""
    return os.path.realpath(path) == os.devnull


def write_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` writes the whole file to a temporary name beside `path`, which then replaces
    `path`; missing parent directories are created. `/dev/null` is written to as it is: replacing it
    with a file would break every program that uses it."""
    if is_null_device(path):
        write(Path(os.devnull))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def save_figure(fig: Any, path: Path | str, dpi: int) -> None:
    """A matplotlib figure saved atomically, in the format its file name's extension names (PNG when
    it has none)."""
    path = Path(path)
    fmt = path.suffix.lower().removeprefix(".") or "png"
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=fmt))


# How often a write the disk refuses (full, read-only) is tried again by `until_written`
DISK_RETRY_S = 1.0


async def until_written(
    write: Callable[[], Awaitable[T]],
    what: str,
    given_up: Callable[[], bool],
    pause: Callable[[float], Awaitable[object]],
) -> T | None:
    """`await write()`, tried again every `DISK_RETRY_S` (`pause`) while the disk refuses it (`OSError`:
    full, read-only, its directory gone), until it is written or `given_up()` (the run is stopping):
    then None. One warning when the disk first refuses it and one when it takes it, not one a try. The
    writes it is for keep the run's own state (a batch's kept file, the trainer's weights): without it
    one full disk ended the run with a traceback."""
    refused_at: float | None = None
    while True:
        try:
            done = await write()
        except OSError as exc:
            if refused_at is None:
                refused_at = time.monotonic()
                log.warning("%s: the disk refuses it (%s); trying again every %g s", what, _said(exc),
                            DISK_RETRY_S)  # fmt: skip
            if given_up():
                log.warning("%s: given up, the run is stopping (%s)", what, _said(exc))
                return None
            await pause(DISK_RETRY_S)
            continue
        if refused_at is not None:
            log.warning("%s: written after %.0f s", what, time.monotonic() - refused_at)
        return done


def _said(exc: OSError) -> str:
    said = exc.strerror or str(exc)
    return said if exc.filename is None else f"{exc.filename}: {said}"
