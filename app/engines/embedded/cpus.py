"""CPU-list parsing and pinning for the embedded engine (no torch import, so the CLI can fail fast).

Invariant: a process that called `pin_cpus(cpus)` runs only on `cpus`, and threads it starts later
(torch's intra-op pool included) inherit that mask.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class CpuListError(ValueError):
    """A CPU list that cannot be parsed or pinned to."""


def parse_cpu_list(text: str) -> list[int]:
    """Parse the kernel's list format: "0,1", "0-3", "0-1,4" (sorted, duplicates removed)."""
    cpus: set[int] = set()
    if not text.strip():
        raise CpuListError("empty CPU list; expected e.g. '0,1' or '0-3'")
    for part in text.split(","):
        item = part.strip()
        if not item:
            raise CpuListError(f"empty item in CPU list {text!r}")
        low_text, sep, high_text = item.partition("-")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise CpuListError(f"{item!r} in CPU list {text!r} is not a CPU number or a range a-b") from None
        if low < 0 or high < 0:
            raise CpuListError(f"negative CPU in {item!r} of CPU list {text!r}")
        if high < low:
            raise CpuListError(f"range {item!r} in CPU list {text!r} runs backwards")
        cpus.update(range(low, high + 1))
    return sorted(cpus)


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


def format_cpu_list(cpus: Sequence[int]) -> str:
    """The kernel's compact list format, as in /proc/<pid>/status Cpus_allowed_list."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
