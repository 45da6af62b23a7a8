"""Work-conserving CPU shares among the sandbox lanes.

The hard boundary is the cpuset: sandbox work runs on the sandbox CPUs and never on the serving CPUs
(`app.sandboxes.cpuset`). Inside that boundary the lanes either share all sandbox CPUs by weight
(work-conserving: a lane may use cores the others leave idle, and under contention each lane gets at
least its weight's fraction) or each lane keeps a CPU set of its own (partitioned: the older scheme,
kept for comparison; it starves a lane whose own cores are too few for its queue).

A lane's weight becomes the `cpu.shares` of its group on cgroup v1 (`/sys/fs/cgroup/cpu/corral/
lane-<name>`) or the `cpu.weight` on cgroup v2. The kernel's fair scheduler then splits contended CPU
time between the lane groups in proportion to their weights, whatever the number of processes in each:
a cleanup storm of fifty processes gets no more than its lane's share while the exec lane has work.

Invariants:
- `prepare_share` returns a placement that confines a process to its lane's group, or None when no
  writable cpu controller exists here (the caller then reports "no shares", never pretends);
- groups are named after the lane only, so every process of one lane, whatever its sandbox, competes
  as one group.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from app.sandboxes.cpuset import CGROUP_ROOT, GROUP_PREFIX, enable_controller

# cgroup v1 `cpu.shares` spans 2..262144 and v2 `cpu.weight` 1..10000; weights map into both.
MIN_WEIGHT = 1
MAX_WEIGHT = 10_000
V1_SHARES_PER_WEIGHT = 16

DEFAULT_LANE_WEIGHTS: dict[str, int] = {"exec": 400, "reset": 200, "validate": 200, "cleanup": 100}


class ShareError(RuntimeError):
    """A lane weight is out of range or its group cannot be written."""


@dataclass(frozen=True)
class SharePlacement:
    lane: str
    weight: int
    method: str  # "cgroup1" or "cgroup2"
    procs_file: Path

    def apply(self, pid: int) -> None:
        """Move `pid` into the lane's group. Only syscalls: usable in a preexec_fn."""
        fd = os.open(self.procs_file, os.O_WRONLY)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)


def _check_weight(lane: str, weight: int) -> None:
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ShareError(f"lane {lane}: weight must be in {MIN_WEIGHT}..{MAX_WEIGHT}, got {weight}")


def _write_if_changed(path: Path, value: str) -> None:
    if path.read_text().strip() != value:
        path.write_text(value)


def share_method(root: Path = CGROUP_ROOT) -> str | None:
    """Which cgroup flavour can hold lane shares here: "cgroup1", "cgroup2" or None."""
    if os.access(root / "cpu" / "cgroup.procs", os.W_OK) and (root / "cpu" / "cpu.shares").exists():
        return "cgroup1"
    try:
        if "cpu" in (root / "cgroup.controllers").read_text().split():
            return "cgroup2"
    except OSError:
        pass
    return None


def _lanes_parent(method: str, root: Path) -> tuple[Path, str]:
    """The lanes' parent cpu group, created, and the name of a group's weight file there."""
    if method == "cgroup1":
        parent = root / "cpu" / GROUP_PREFIX
        parent.mkdir(exist_ok=True)
        return parent, "cpu.shares"
    parent = root / f"{GROUP_PREFIX}-lanes"
    enable_controller(root, "cpu")
    parent.mkdir(exist_ok=True)
    enable_controller(parent, "cpu")
    return parent, "cpu.weight"


def prepare_share(lane: str, weight: int, *, root: Path = CGROUP_ROOT) -> SharePlacement | None:
    """Create (or update) the lane's group with `weight`; None where no cpu controller is writable."""
    _check_weight(lane, weight)
    method = share_method(root)
    if method is None:
        return None
    try:
        parent, weight_file = _lanes_parent(method, root)
        group = parent / f"lane-{lane}"
        group.mkdir(exist_ok=True)
        value = weight * V1_SHARES_PER_WEIGHT if method == "cgroup1" else weight
        _write_if_changed(group / weight_file, str(value))
    except OSError as exc:
        raise ShareError(f"lane {lane}: cannot set up its cpu group ({method}): {exc}") from exc
    return SharePlacement(lane, weight, method, group / "cgroup.procs")


# The lanes' parent group against serving when lanes borrow serving CPUs (`borrow_serving_cpus`). On
# cgroup v1 the engines sit in the root group, where each runnable thread weighs 1024 against the whole
# parent group; 64 leaves the lanes about 6% of a serving CPU while an engine thread wants it, and all
# of it while serving is idle. v2 weights are 100 by default: 6 is the same proportion.
BORROWING_SHARES_V1 = 64
BORROWING_WEIGHT_V2 = 6
DEFAULT_SHARES_V1 = 1024
DEFAULT_WEIGHT_V2 = 100


def set_lanes_priority(borrowing: bool, *, root: Path = CGROUP_ROOT) -> int | None:
    """Give all lanes together a low CPU weight against serving (borrowing serving CPUs) or the
    default; returns the weight now held by the kernel, None where no cpu controller is writable."""
    method = share_method(root)
    if method is None:
        return None
    if method == "cgroup1":
        value = BORROWING_SHARES_V1 if borrowing else DEFAULT_SHARES_V1
    else:
        value = BORROWING_WEIGHT_V2 if borrowing else DEFAULT_WEIGHT_V2
    try:
        parent, name = _lanes_parent(method, root)
        _write_if_changed(parent / name, str(value))
        return int((parent / name).read_text())
    except OSError as exc:
        raise ShareError(f"the lanes' cpu group ({method}): {exc}") from exc


def read_weight(placement: SharePlacement) -> int:
    """The weight the kernel holds for the lane's group now (read back, not remembered)."""
    group = placement.procs_file.parent
    if placement.method == "cgroup1":
        return int((group / "cpu.shares").read_text()) // V1_SHARES_PER_WEIGHT
    return int((group / "cpu.weight").read_text())
