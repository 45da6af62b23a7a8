"""A real process that owns one local sandbox (`leftovers.declare_owner`), for the tests of what a
killed owner leaves and of what a sweep must not touch. (A module of its own at the tests root,
importable from every test directory.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A process that makes one sandbox, then (`then`): "hold" starts a detached process in it and waits;
# "keep" exits keeping its registration (`Registration.keep`); "exit" exits as usual
OWNER = """
import asyncio, sys
from pathlib import Path
from app.sandboxes import leftovers
from app.sandboxes.local import LocalSandboxFactory
from app.tasks.spec import TaskSpec

owners, base, task_root, token, then = sys.argv[1:]
leftovers.declare_owner(Path(owners))

async def main():
    sandbox = LocalSandboxFactory(Path(base), isolation="none").create("leftover-maker")
    await sandbox.reset(TaskSpec(name="t", instruction="", root=Path(task_root), validation="true"))
    if then == "hold":
        await sandbox.exec(f"setsid sleep {token} > /dev/null 2>&1 < /dev/null &", 10)
    print(sandbox.work_dir, sandbox.uid, flush=True)
    if then == "hold":
        await asyncio.sleep(600)

asyncio.run(main())
if then == "keep":
    leftovers.current().keep()
"""


def owner_argv(tmp_path: Path, base_dir: Path, token: str, then: str) -> list[str]:
    """The owner registers in `tmp_path/owners` and makes its sandbox in `base_dir`."""
    (tmp_path / "task").mkdir()
    places = [str(tmp_path / "owners"), str(base_dir), str(tmp_path / "task")]
    return [sys.executable, "-c", OWNER, *places, token, then]


def start_owner(tmp_path: Path, base_dir: Path, token: str) -> tuple[subprocess.Popen[str], Path, str]:
    """A live owner holding its sandbox, with a detached `sleep <token>` in it: (process, work
    directory, uid or "None")."""
    proc = subprocess.Popen(owner_argv(tmp_path, base_dir, token, "hold"), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    work, uid = proc.stdout.readline().split()
    return proc, Path(work), uid


def alive_with_token(token: str) -> list[int]:
    """Host pids whose command line contains `token` and that are not zombies."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = next(ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if token in cmdline and "Z (zombie)" not in state:
            found.append(int(entry.name))
    return found
