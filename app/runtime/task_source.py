"""Where `corral run`'s attempts come from: a seeded draw of tasks from a suite, one sandbox per attempt."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from pathlib import Path

from app.runtime.config import LocalRunError, TasksConfig
from app.runtime.context import Agent
from app.sandboxes.base import Sandbox, SandboxFactory
from app.tasks.loader import TaskError, builtin_suite_path, load_suite
from app.tasks.spec import TaskSpec


class TaskSource:
    """Group n works on a task drawn by a seeded shuffle of the suite; each attempt gets its own sandbox,
    named `g<group>a<attempt>-<ns><suffix>` (`suffix`: the run's incarnation on Celery lanes)."""

    def __init__(
        self, tasks: Sequence[TaskSpec], factory: SandboxFactory, agent: Agent, seed: int, suffix: str = ""
    ) -> None:
        self.tasks = list(tasks)
        self.factory = factory
        self.agent = agent
        self.seed = seed
        self.suffix = suffix

    def task_for(self, task_index: int) -> TaskSpec:
        rng = random.Random(f"{self.seed}:{task_index}")
        return self.tasks[rng.randrange(len(self.tasks))]

    def make_attempt(
        self, group_id: int, task_index: int, attempt: int
    ) -> tuple[Agent, TaskSpec | None, Sandbox]:
        return (
            self.agent,
            self.task_for(task_index),
            self.factory.create(f"g{group_id}a{attempt}-{time.monotonic_ns()}{self.suffix}"),
        )

    def stopping(self) -> None:
        self.factory.stopping()


def load_tasks(config: TasksConfig) -> list[TaskSpec]:
    path = builtin_suite_path() if config.suite == "builtin" else Path(config.suite)
    try:
        suite = load_suite(path)
    except TaskError as exc:
        message = str(exc)
        if message.startswith(f"{path}:"):  # about the suite itself, not one task's file: name the field
            message = f"tasks.suite {message}"
        raise LocalRunError(message) from None
    if config.include:
        known = {t.name for t in suite}
        unknown = sorted(set(config.include) - known)
        if unknown:
            raise LocalRunError(f"tasks.include: unknown tasks {unknown}; the suite has {sorted(known)}")
        suite = [t for t in suite if t.name in config.include]
    if not suite:
        raise LocalRunError(f"no tasks in {path}")
    return suite
