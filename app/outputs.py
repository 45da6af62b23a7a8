"""Writing a command's output files (reports, traces, plots): whole, or not at all.

Invariant: a reader of the path sees the old file or the new one, never a partial write; and whatever
ends the write (a full disk, an error, a Ctrl-C between the write and the rename), no `.tmp` file is
left beside it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
