"""The Lane port: sandbox work split by kind into pools with their own concurrency and CPU set.

Lanes are `reset`, `exec`, `validate` and `cleanup`. A lane's CPU set is disjoint from the serving CPUs
when lanes are pinned. Implementations: `InProcessLanes` (embedded default, also used by the simulator)
and, later, Celery queues (one queue per lane).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

T = TypeVar("T")


class LaneName(StrEnum):
    RESET = "reset"
    EXEC = "exec"
    VALIDATE = "validate"
    CLEANUP = "cleanup"


@dataclass(frozen=True)
class LaneSlot:
    """What an operation learns about the lane running it."""

    lane: LaneName
    cpus: tuple[int, ...] | None


@dataclass
class LaneStats:
    queue_depth: int = 0
    busy: int = 0
    max_busy: int = 0
    max_queue_depth: int = 0
    completed: int = 0
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0

    @property
    def wait_s_mean(self) -> float:
        return self.wait_s_total / self.completed if self.completed else 0.0


class Lanes(Protocol):
    async def run(self, lane: LaneName, op: Callable[[LaneSlot], Awaitable[T]]) -> T: ...

    def stats(self) -> dict[str, LaneStats]: ...
