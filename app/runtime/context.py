"""What an agent sees of the runtime while it runs one attempt.

The runtime records the policy version of every turn through `generate`, routes turns away from
engines that are updating, and runs sandbox work in the right lane. An agent never talks to an engine
or a lane directly, so no turn escapes version accounting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from app.engines.base import TurnRequest, TurnResult
    from app.sandboxes.base import ExecResult
    from app.tasks.spec import TaskSpec


@dataclass
class AttemptOutcome:
    reward: float
    turns: int
    error: str | None = None  # an infrastructure error: the group is then discarded as failed
    timed_out: bool = False
    transcript: list[dict[str, object]] = field(default_factory=list)


class AttemptContext(Protocol):
    attempt_id: str
    task: TaskSpec | None

    async def generate(self, request: TurnRequest) -> TurnResult: ...

    async def reset(self) -> ExecResult: ...

    async def exec(self, command: str, timeout_s: float) -> ExecResult: ...

    async def validate(self) -> float: ...

    def now(self) -> float: ...


class Agent(Protocol):
    async def run(self, ctx: AttemptContext) -> AttemptOutcome: ...
