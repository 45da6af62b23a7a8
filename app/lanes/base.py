"""The Lane port: sandbox work split by kind into pools with their own concurrency and CPU set.

Lanes are `reset`, `exec`, `validate` and `cleanup`. A lane's CPU set is disjoint from the serving CPUs
when lanes are pinned. Implementations: `InProcessLanes` (embedded default, also used by the simulator)
and `CeleryLanes` (one queue per lane and host, app.lanes.celery).

Sandbox work reaches a lane in one of two forms: a closure (`run`, in-process only) or a serialisable
`LaneOp` (`run_op`, app.lanes.ops) on a sandbox that `attach` has handed a handle for. An op that
crosses processes must be a `LaneOp`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from app.lanes.ops import LaneOp, SandboxHandle
    from app.sandboxes.base import Sandbox

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
    resent: int = 0  # ops sent again after the broker lost them (app.lanes.lost_ops)

    @property
    def wait_s_mean(self) -> float:
        return self.wait_s_total / self.completed if self.completed else 0.0


class Lanes(Protocol):
    async def run(self, lane: LaneName, op: Callable[[LaneSlot], Awaitable[T]]) -> T: ...

    def attach(self, sandbox: Sandbox) -> SandboxHandle:
        """The handle that names `sandbox` in `LaneOp`s; it is placed on a host here. The lanes forget
        the sandbox once its cleanup op has run."""
        ...

    def forget(self, handle: SandboxHandle) -> bool:
        """Drop a sandbox on which no op can have started, so it needs no cleanup op; False (nothing
        dropped) when one may have, and then its cleanup op must run."""
        ...

    async def run_op(self, op: LaneOp[T], on_start: Callable[[], None] | None = None, group: int = 0) -> T:
        """Run `op` in its lane; `on_start()` is called when it leaves the lane's queue and starts. `group`
        is the id of the op's group (ids grow with admission), for lanes ordered `oldest_group`."""
        ...

    def stats(self) -> dict[str, LaneStats]: ...
