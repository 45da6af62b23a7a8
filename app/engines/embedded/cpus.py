"""CPU-list parsing and pinning for the embedded engine (no torch import, so the CLI can fail fast).

Invariant: a process that called `pin_cpus(cpus)` runs only on `cpus`, and threads it starts later
(torch's intra-op pool included) inherit that mask.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from app.cpulist import CpuListError, format_cpu_list, parse_cpu_list

__all__ = ["CpuListError", "format_cpu_list", "parse_cpu_list", "pin_cpus"]


def pin_cpus(cpus: Sequence[int]) -> None:
    """Restrict this process to `cpus`; raise `CpuListError` naming CPUs this process may not use."""
    if not cpus:
        raise CpuListError("cannot pin to an empty CPU list")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise CpuListError(
            f"CPUs {format_cpu_list(missing)} are not available to this process "
            f"(allowed: {format_cpu_list(sorted(allowed))})"
        )
    os.sched_setaffinity(0, cpus)
