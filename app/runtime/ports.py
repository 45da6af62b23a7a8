"""Ports the runtime drives besides engines, sandboxes and lanes: where attempts come from, and the
trainer that consumes batches and publishes weights."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from app.core.scheduler import DeliverBatch
from app.runtime.context import AttemptOutcome

if TYPE_CHECKING:
    from app.runtime.context import Agent
    from app.sandboxes.base import Sandbox
    from app.tasks.spec import TaskSpec


class AttemptSource(Protocol):
    """Builds one attempt of a group: its agent, its task and its sandbox."""

    def make_attempt(
        self, group_id: int, task_index: int, attempt: int
    ) -> tuple[Agent, TaskSpec | None, Sandbox]: ...

    def stopping(self) -> None:
        """The run is stopping: its sandboxes' clean-ups no longer wait for infrastructure that went
        away (a docker daemon) to come back; what they leave, the next start removes."""
        ...


@dataclass(frozen=True)
class TrainingBatch:
    """A delivered batch with the trajectories behind it: rewards and advantages per group from the
    scheduler, and each group's G attempt outcomes (transcripts, turn versions, logprobs)."""

    batch: DeliverBatch
    attempts: Mapping[int, tuple[AttemptOutcome, ...]]  # group id -> outcomes in attempt order


class Trainer(Protocol):
    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        """Train on `batch`, producing policy `version`; return its weights directory, if any."""
        ...
