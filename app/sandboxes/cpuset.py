"""CPU pinning for sandbox processes: a cpuset cgroup where one is writable, else scheduler affinity.

Invariants:
- `pin` either confines the process to exactly the requested CPUs or raises `CpuPinError`; it never
  leaves a process silently unpinned. The returned string names the method that held.
- Cgroups are named after the CPU set (`corral/cpus-0-1`), so every process of one lane shares one
  group and nothing needs removing per process. Groups live under the cpuset hierarchy of cgroup v1
  (`/sys/fs/cgroup/cpuset`) or, on cgroup v2, under the unified root with `cpuset` enabled.
- `prepare` does the file-system work (in the parent); `Placement.apply` is a few syscalls, safe to
  call in a `preexec_fn` so a command is pinned before it runs a single instruction of its own.
- A process may widen its own affinity mask, but not leave its cpuset cgroup: the cgroup methods hold
  against the sandboxed code, `affinity` only against accidents.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from app.cpulist import format_cpu_list, parse_cpu_list

CGROUP_ROOT = Path("/sys/fs/cgroup")
GROUP_PREFIX = "corral"

METHOD_CGROUP1 = "cgroup1"
METHOD_CGROUP2 = "cgroup2"
METHOD_AFFINITY = "affinity"


class CpuPinError(RuntimeError):
    """The requested CPU set cannot be applied (bad CPU ids, or not even affinity works)."""


def read_cpus_allowed(pid: int) -> tuple[int, ...]:
    """The CPUs a process may run on, from `Cpus_allowed_list` in /proc/<pid>/status."""
    status = Path(f"/proc/{pid}/status").read_text()
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return tuple(parse_cpu_list(line.split(":", 1)[1]))
    raise CpuPinError(f"/proc/{pid}/status has no Cpus_allowed_list line")


@dataclass(frozen=True)
class Placement:
    """Where to put a process so that it runs on `cpus`: a cgroup's `cgroup.procs`, or affinity only."""

    cpus: tuple[int, ...]
    method: str
    procs_file: Path | None = None

    def apply(self, pid: int) -> None:
        """Move `pid` into the group (or set its affinity). Only syscalls: usable in a preexec_fn."""
        if self.procs_file is not None:
            fd = os.open(self.procs_file, os.O_WRONLY)
            try:
                os.write(fd, str(pid).encode())
            finally:
                os.close(fd)
        else:
            os.sched_setaffinity(pid, self.cpus)


def _validate(cpus: Sequence[int]) -> tuple[int, ...]:
    wanted = tuple(sorted(set(cpus)))
    if not wanted:
        raise CpuPinError("empty CPU set")
    # Checked against the CPUs online, not this thread's mask: a control-plane thread pinned to the
    # serving CPUs still places sandbox commands on the lane CPUs.
    online = _online_cpus()
    outside = [c for c in wanted if c not in online]
    if outside:
        raise CpuPinError(f"CPUs {outside} are not online here (online: {sorted(online)})")
    return wanted


def _online_cpus() -> set[int]:
    try:
        return set(parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text()))
    except (OSError, ValueError):
        return os.sched_getaffinity(0)


def _write(path: Path, value: str) -> None:
    path.write_text(value)


def _cgroup1_group(root: Path, cpus: tuple[int, ...]) -> Path:
    base = root / "cpuset"
    parent = base / GROUP_PREFIX
    group = parent / f"cpus-{format_cpu_list(cpus)}"
    # v1 cpusets refuse tasks until both cpus and mems are set, at every level.
    for level, level_cpus in ((parent, (base / "cpuset.cpus").read_text().strip()), (group, None)):
        level.mkdir(exist_ok=True)
        if not (level / "cpuset.mems").read_text().strip():
            _write(level / "cpuset.mems", (base / "cpuset.mems").read_text().strip())
        want = level_cpus if level_cpus is not None else format_cpu_list(cpus)
        if (level / "cpuset.cpus").read_text().strip() != want:
            _write(level / "cpuset.cpus", want)
    return group


def enable_controller(group: Path, controller: str) -> None:
    """cgroup v2: turn `controller` on for `group`'s children (their `<controller>.*` files appear)."""
    control = group / "cgroup.subtree_control"
    if controller not in control.read_text().split():
        _write(control, f"+{controller}")


def _cgroup2_group(root: Path, cpus: tuple[int, ...]) -> Path:
    parent = root / GROUP_PREFIX
    enable_controller(root, "cpuset")
    parent.mkdir(exist_ok=True)
    enable_controller(parent, "cpuset")
    group = parent / f"cpus-{format_cpu_list(cpus)}"
    group.mkdir(exist_ok=True)
    _write(group / "cpuset.cpus", format_cpu_list(cpus))
    return group


def detect_method(root: Path = CGROUP_ROOT) -> str:
    """Which method `prepare` would try first on this host (it still falls back if that one fails)."""
    if "cpuset" in _read_or_empty(root / "cgroup.controllers").split():
        return METHOD_CGROUP2
    if os.access(root / "cpuset" / "cgroup.procs", os.W_OK):
        return METHOD_CGROUP1
    return METHOD_AFFINITY


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def prepare(cpus: Sequence[int], *, root: Path = CGROUP_ROOT, method: str | None = None) -> Placement:
    """Create (or reuse) the group for `cpus`; fall back to affinity when no cpuset cgroup is writable."""
    wanted = _validate(cpus)
    chosen = method or detect_method(root)
    if chosen == METHOD_CGROUP1:
        try:
            return Placement(wanted, METHOD_CGROUP1, _cgroup1_group(root, wanted) / "cgroup.procs")
        except OSError:
            if method is not None:
                raise
    elif chosen == METHOD_CGROUP2:
        try:
            return Placement(wanted, METHOD_CGROUP2, _cgroup2_group(root, wanted) / "cgroup.procs")
        except OSError:
            # A container's cgroup root usually holds processes, so it cannot enable controllers.
            if method is not None:
                raise
    elif chosen != METHOD_AFFINITY:
        raise CpuPinError(f"unknown pinning method {chosen!r}")
    return Placement(wanted, METHOD_AFFINITY)


def pin(pid: int, cpus: Sequence[int], *, root: Path = CGROUP_ROOT, method: str | None = None) -> str:
    """Confine `pid` to `cpus`; returns the method used: "cgroup2", "cgroup1" or "affinity"."""
    placement = prepare(cpus, root=root, method=method)
    try:
        placement.apply(pid)
    except OSError as exc:
        if placement.method == METHOD_AFFINITY:
            raise CpuPinError(f"cannot set affinity of pid {pid} to {list(placement.cpus)}: {exc}") from exc
        # e.g. a v2 group refusing a process that lives in a threaded or domain-invalid subtree.
        os.sched_setaffinity(pid, placement.cpus)
        return METHOD_AFFINITY
    return placement.method
