"""Turn routing: which engine takes the next model turn.

An engine that is updating takes no new turns; among the others the least loaded engine with a free
slot wins, ties going to the earlier engine so that a seed reproduces a timeline exactly. With
`fresh` (during a rolling update, for a turn whose group would be made older by an engine not yet
updated), the least loaded engine that `fresh` accepts wins if one has a free slot; otherwise any.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


def choose_engine(
    active: Mapping[str, int],
    slots: int,
    routable: Callable[[str], bool],
    fresh: Callable[[str], bool] | None = None,
) -> str | None:
    if fresh is not None:
        best = choose_engine(active, slots, lambda name: routable(name) and fresh(name))
        if best is not None:
            return best
    best = None
    best_load = slots
    for name, load in active.items():
        if load < best_load and routable(name):
            best, best_load = name, load
    return best
