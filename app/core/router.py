"""Turn routing: which engine takes the next model turn.

An engine that is updating takes no new turns; among the others the least loaded engine with a free
slot wins, ties going to the earlier engine so that a seed reproduces a timeline exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


def choose_engine(active: Mapping[str, int], slots: int, routable: Callable[[str], bool]) -> str | None:
    best: str | None = None
    best_load = slots
    for name, load in active.items():
        if load < best_load and routable(name):
            best, best_load = name, load
    return best
