"""The Sandbox port: an isolated place where one attempt's tool calls run.

Implementations: `LocalSandbox` (process + bubblewrap + rlimits + CPU pinning), `DockerSandbox`
(docker SDK), and the simulator's `SimSandbox`. The lane that runs an operation passes its CPU set,
so pinning is decided by the lane, not by the sandbox.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.tasks.spec import TaskSpec


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    output: str
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class SandboxOp:
    """Simulated cost of an operation; real sandboxes ignore it."""

    meta: Mapping[str, float] = field(default_factory=dict)


class Sandbox(Protocol):
    async def reset(self, task: TaskSpec, cpus: Sequence[int] | None = None) -> ExecResult:
        """Create the work directory from the task and run its set-up script."""
        ...

    async def exec(self, command: str, timeout_s: float, cpus: Sequence[int] | None = None) -> ExecResult: ...

    async def validate(self, cpus: Sequence[int] | None = None) -> float:
        """Run the task's validation command; the reward is 1.0 on exit 0, else 0.0."""
        ...

    async def cleanup(self, cpus: Sequence[int] | None = None) -> None: ...


class SandboxFactory(Protocol):
    def create(self, attempt_id: str) -> Sandbox: ...

    def stopping(self) -> None:
        """The run is stopping: no op waits any longer for its infrastructure to come back."""
        ...
