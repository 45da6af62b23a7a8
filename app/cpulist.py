"""CPU lists in the kernel's format ("0-2,5"), shared by the engine's and the sandboxes' pinning.

Invariant: `parse_cpu_list(format_cpu_list(cpus)) == sorted(set(cpus))`; bad text raises
`CpuListError` naming the item, never a bare ValueError. No CPU number above `MAX_CPU` is accepted, so
parsing never builds a set larger than the kernel's own limit, whatever the text says.
"""

from __future__ import annotations

from collections.abc import Iterable

# The kernel's largest configurable CPU count (CONFIG_NR_CPUS) is 8192, so no CPU number exceeds 8191.
MAX_CPU = 8191


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
            low = _cpu_number(low_text)
            high = _cpu_number(high_text) if sep else low
        except ValueError:
            raise CpuListError(f"{item!r} in CPU list {text!r} is not a CPU number or a range a-b") from None
        if low < 0 or high < 0:
            raise CpuListError(f"negative CPU in {item!r} of CPU list {text!r}")
        if high < low:
            raise CpuListError(f"range {item!r} in CPU list {text!r} runs backwards")
        if high > MAX_CPU:
            raise CpuListError(
                f"CPU {high} in {item!r} is above {MAX_CPU}, the largest CPU number Linux supports"
            )
        cpus.update(range(low, high + 1))
    return sorted(cpus)


def _cpu_number(text: str) -> int:
    """ASCII digits only: `int` would also read "0_1" as 1, "+0" and other scripts' digits."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()):
        raise ValueError(text)
    return int(digits)


def format_cpu_list(cpus: Iterable[int]) -> str:
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
