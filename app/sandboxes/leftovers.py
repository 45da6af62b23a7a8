"""What a dead Corral process left of its sandboxes, found and removed when the next one starts.

A process that owns the sandboxes it makes (`corral run`, `corral serve`) calls `declare_owner` when it
starts. It then registers in the owners directory (`$CORRAL_OWNERS_DIR`, by default
`<tmp>/corral-owners`): a file `<pid>.json` with its pid, its start time (so a reused pid is not taken
for it), the sandbox roots it uses and the directories it owns outright (`corral run`'s temporary
directory). In each root, every live sandbox has a marker `.corral-owners/<sandbox>` naming its owner,
written before its work directory and removed after its cleanup; its docker containers carry the
label `corral.owner`.

`declare_owner` first sweeps. For every registered process that is dead, and every marker of a dead
owner in its roots, it kills the sandbox's processes (its pids cgroup `<sandbox>-<directory tag>-<pid>`,
whatever runs as a uid the dead process had claimed in the host's claims directory, whatever runs in
the work directory) and removes the work directory, the cgroup, the uid claims and the marker; then the
directories the dead process owned outright, and its registration. A log line per dead process says
what went. A docker factory of a declared owner removes the containers of dead owners on this host when
it first reaches the daemon.

Only a declared owner marks its sandboxes. A lane worker's pool processes (forked by `corral worker`,
replaced at will while their sandboxes live on) never do, so their sandboxes are never leftovers.

Invariants: nothing of a live owner (same pid and start time) is touched; a sweep that finds nothing
says nothing; sweeping twice is harmless, and a sweep that fails (logged) never stops the start, and
keeps the registration for the next one; a registration is written atomically.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import (
    PidsGroup,
    SandboxLimitError,
    after_comm,
    kill_uid_if_claimed,
    kill_until_gone,
    owner_alive,
    pids_parent,
    uid_claims_dir,
)

log = logging.getLogger(__name__)

ENV_OWNERS_DIR = "CORRAL_OWNERS_DIR"
MARKERS = ".corral-owners"
OWNER_LABEL = "corral.owner"


def owners_dir() -> Path:
    return Path(os.environ.get(ENV_OWNERS_DIR) or Path(tempfile.gettempdir()) / "corral-owners")


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(after_comm(raw).split()[19])


@dataclass(frozen=True)
class Owner:
    """A process, told apart from a later one that reuses its pid."""

    pid: int
    start: int

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), _start_time(os.getpid()) or 0)

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            pid, start = (int(word) for word in text.split())
        except ValueError:
            return None
        return cls(pid, start)

    def alive(self) -> bool:
        return _start_time(self.pid) == self.start

    def __str__(self) -> str:
        return f"{self.pid} {self.start}"


@dataclass
class Found:
    """What one sweep of one dead process removed."""

    sandboxes: int = 0
    processes: int = 0
    cgroups: int = 0
    dirs: int = 0
    containers: int = 0
    uid_claims: int = 0

    def __bool__(self) -> bool:
        return any(vars(self).values())

    def __str__(self) -> str:
        parts = [
            (self.sandboxes, "sandbox"),
            (self.processes, "process"),
            (self.cgroups, "cgroup"),
            (self.uid_claims, "uid claim"),
            (self.dirs, "directory"),
            (self.containers, "container"),
        ]
        plural = {"process": "processes", "directory": "directories", "sandbox": "sandboxes"}
        return ", ".join(f"{n} {plural.get(w, w + 's') if n != 1 else w}" for n, w in parts if n)


class Registration:
    """This process, registered as the owner of its sandbox roots and directories."""

    def __init__(self, directory: Path, owner: Owner) -> None:
        self.owner = owner
        self.path = directory / f"{owner.pid}.json"
        self.roots: list[str] = []
        self.dirs: list[str] = []
        self.kept = False
        self._write()

    def add_root(self, root: Path) -> None:
        """Sandboxes will live under `root`; it gets its marker directory."""
        (root / MARKERS).mkdir(mode=0o700, parents=True, exist_ok=True)
        if str(root) not in self.roots:
            self.roots.append(str(root))
            self._write()

    def add_dir(self, path: Path) -> None:
        """`path` is this process's alone: if it dies, the next start removes it whole."""
        if str(path) not in self.dirs:
            self.dirs.append(str(path))
            self._write()

    def mark(self, root: Path, sandbox: str) -> None:
        (root / MARKERS / sandbox).write_text(str(self.owner))

    def unmark(self, root: Path, sandbox: str) -> None:
        (root / MARKERS / sandbox).unlink(missing_ok=True)

    def close(self) -> None:
        """A clean exit: nothing is left to find (unless `keep` was called)."""
        if not self.kept:
            self.path.unlink(missing_ok=True)

    def keep(self) -> None:
        """Leave the registration at exit, as a crash would: the process leaves sandboxes of runs it did
        not end (`RunManager.leave_for_next_start`), and the next start removes them as a dead owner's."""
        self.kept = True

    def _write(self) -> None:
        data = {"pid": self.owner.pid, "start": self.owner.start, "roots": self.roots, "dirs": self.dirs}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)


_current: Registration | None = None


def current() -> Registration | None:
    """This process's registration, if it declared itself the owner of its sandboxes."""
    return _current


def declare_owner(directory: Path | None = None) -> list[str]:
    """Sweep what dead owners left, then register this process as the owner of the sandboxes it will
    make (once per process). Returns the log lines of the sweep."""
    global _current
    if _current is not None:
        return []
    directory = directory or owners_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lines = sweep(directory)
        _current = Registration(directory, Owner.me())
    except OSError as exc:  # never a reason not to run: only the clean-up after a crash is lost
        log.warning("sandboxes are not tracked for clean-up after a crash: %s: %s", directory, exc)
        return []
    atexit.register(_current.close)
    return lines


def sweep(directory: Path) -> list[str]:
    """Remove what every dead registered owner in `directory` left; one line per owner that left any."""
    lines = []
    for entry in sorted(directory.glob("*.json")):
        try:
            data = json.loads(entry.read_text())
            owner = Owner(int(data["pid"]), int(data["start"]))
            roots, dirs = [Path(p) for p in data["roots"]], [Path(p) for p in data["dirs"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours to judge: leave it
        if owner.alive():
            continue
        found = Found()
        try:
            for root in roots:
                _sweep_root(root, found)
            _sweep_claims(uid_claims_dir(), owner)
            for path in dirs:
                if path.exists():
                    rmtree(path)
                    found.dirs += 1
        except (OSError, SandboxLimitError) as exc:  # e.g. another start sweeping the same owner
            log.warning("could not remove all that dead corral process %d left behind: %s", owner.pid, exc)
            continue  # its registration stays: the next start tries again
        entry.unlink(missing_ok=True)
        if found:
            line = f"removed what dead corral process {owner.pid} left behind: {found}"
            log.warning("%s", line)
            lines.append(line)
    return lines


def sandbox_group_name(sandbox: str, root: Path, pid: int) -> str:
    """The pids cgroup of sandbox `sandbox` in directory `root`, made by process `pid`. The root's tag
    keeps apart two sandbox directories of one process (two runs in one `corral serve`), whose sandboxes
    are named alike (g0a0, ...): each sandbox's cleanup kills everything in its group."""
    return f"{sandbox}-{zlib.crc32(str(root).encode()):08x}-{pid}"


def rmtree(path: Path) -> None:
    """Remove a sandbox's directory tree, whatever permissions its code left on it."""

    def fix_and_retry(func: Callable[..., Any], p: str, exc: object) -> None:
        if isinstance(exc, FileNotFoundError) or (
            isinstance(exc, tuple) and len(exc) > 1 and isinstance(exc[1], FileNotFoundError)
        ):
            return  # removed meanwhile by another cleanup of the same sandbox (a sweep, a late op)
        # The sandboxed code may have removed write/execute permission from its own directories.
        parent = os.path.dirname(p)
        with contextlib.suppress(OSError):
            os.chmod(parent, stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            with contextlib.suppress(OSError):
                os.chmod(p, stat.S_IRWXU)
        func(p)

    if not path.exists():
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix_and_retry)
    else:
        shutil.rmtree(path, onerror=fix_and_retry)


def _sweep_root(root: Path, found: Found) -> None:
    markers = root / MARKERS
    for marker in sorted(markers.glob("*")) if markers.is_dir() else []:
        owner = Owner.parse(marker.read_text())
        if owner is None or owner.alive():
            continue
        work = root / marker.name
        parent = pids_parent(CGROUP_ROOT)
        if parent is not None:
            group = PidsGroup(parent[0] / sandbox_group_name(marker.name, root, owner.pid), parent[1])
            if group.path.exists():
                found.processes += max(0, group.kill_all())
                group.remove()
                found.cgroups += 1
        found.processes += kill_in(work)
        if work.exists():
            rmtree(work)
        marker.unlink(missing_ok=True)
        found.sandboxes += 1


def _sweep_claims(claims: Path, dead: Owner) -> None:
    """Kill whatever still runs as a uid that `dead` had claimed, and drop its claims."""
    for claim in sorted(claims.glob("*")) if claims.is_dir() else []:
        try:
            holder = claim.read_text().strip()
        except FileNotFoundError:
            continue  # released meanwhile (the claims are the whole host's)
        if claim.name.isdigit() and holder == str(dead.pid) and not owner_alive(claim):
            kill_uid_if_claimed(claims, int(claim.name), dead.pid, release=True)


def kill_in(work: Path) -> int:
    """SIGKILL every process whose working directory lies in `work`; returns how many signals went."""
    inside = str(work)

    def find() -> list[int]:
        victims = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    cwd = os.readlink(f"/proc/{entry}/cwd")
                    if cwd == inside or cwd.startswith(inside + "/"):
                        victims.append(int(entry))
        return victims

    return kill_until_gone(find, rounds=5, pause_s=0.05)  # a dying process's children may be starting


def container_owner_label() -> dict[str, str]:
    """The label a declared owner's containers carry (none for any other process)."""
    if _current is None:
        return {}
    return {OWNER_LABEL: f"{socket.gethostname()} {_current.owner}"}


def sweep_containers(
    list_labelled: Callable[[str], list[tuple[str, str]]], remove: Callable[[str], bool]
) -> int:
    """Remove the containers of dead owners on this host; `list_labelled(label)` gives (container id,
    label value) pairs, and `remove(id)` says whether this call removed it (not another sweep, racing
    this one). Returns how many this sweep removed, so two sweeps at once count each container once."""
    host = socket.gethostname()
    removed = 0
    for container, value in list_labelled(OWNER_LABEL):
        name, _, owner_text = value.partition(" ")
        owner = Owner.parse(owner_text)
        if name == host and owner is not None and not owner.alive():
            removed += remove(container)
    if removed:
        found = Found(containers=removed)
        log.warning("removed what dead corral processes left behind: %s", found)
    return removed
