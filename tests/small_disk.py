"""A small file system of its own (a tmpfs mounted for the test) to fill up as a real disk fills: writes
then fail with ENOSPC, SQLite's with "database or disk is full". Mounting needs root (permission bits
and `ulimit -f` do not make a full disk); elsewhere the tests that use it are skipped."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of `size_mb` MiB mounted at `path` (made) for the block; skips the test where it cannot be."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small file system (a full disk)")
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)]
    if subprocess.run(mount, capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    with contextlib.ExitStack() as mounted:
        mounted.callback(subprocess.run, ["umount", "--lazy", str(path)], check=False)
        yield path


def fill(disk: Path) -> Path:
    """Fill `disk` to its last byte with one file, which is returned: remove it to free the space."""
    filler = disk / "filler"
    chunk = b"\0" * (1 << 20)
    with filler.open("wb", buffering=0) as out:
        while True:
            try:
                out.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return filler
                chunk = chunk[: len(chunk) // 2]


@contextlib.contextmanager
def read_only_switch(path: Path) -> Iterator[Callable[[bool], None]]:
    """`path` (made) bind-mounted on itself for the block, yielding `read_only(flag)`, which turns the
    mount read-only or writable again with files open in it, as a file system remounted read-only
    after an error; skips the test where it cannot be (root needed, as for `small_disk`)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to remount a directory read-only (permission bits do not stop root)")
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, check=False).returncode:
        pytest.skip("cannot bind-mount here")

    def read_only(flag: bool) -> None:
        option = "remount,bind,ro" if flag else "remount,bind,rw"
        subprocess.run(["mount", "-o", option, str(path)], check=True, capture_output=True)

    with contextlib.ExitStack() as mounted:
        mounted.callback(subprocess.run, ["umount", "--lazy", str(path)], check=False)
        yield read_only
