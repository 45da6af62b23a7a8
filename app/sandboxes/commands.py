"""What every shell-command sandbox shares: the set-up step, exec and validation on top of `_run`.

Invariant: a sandbox runs no command before `reset` or after `cleanup` (`SandboxError` says so), and
validation gives reward 1.0 only for exit 0 within the task's validation timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from app.sandboxes.base import ExecResult

if TYPE_CHECKING:
    from app.tasks.spec import TaskSpec


class CommandSandbox:
    """Base for `LocalSandbox` and `DockerSandbox`; subclasses provide `_run` and `_require_reset`."""

    _task: TaskSpec | None = None

    async def _run(
        self, command: str, timeout_s: float, cpus: Sequence[int] | None, lane: str = "exec"
    ) -> ExecResult:
        """Run `command` on `cpus` as work of `lane` (reset, exec or validate: its CPU share group)."""
        raise NotImplementedError

    def _require_reset(self) -> TaskSpec:
        raise NotImplementedError

    async def _set_up(self, task: TaskSpec, cpus: Sequence[int] | None) -> ExecResult:
        """Record `task` as reset and run its set-up script, if it has one."""
        self._task = task
        if not task.setup.strip():
            return ExecResult(exit_code=0, output="")
        return await self._run(task.setup, task.setup_timeout_s, cpus, "reset")

    async def exec(self, command: str, timeout_s: float, cpus: Sequence[int] | None = None) -> ExecResult:
        self._require_reset()
        return await self._run(command, timeout_s, cpus, "exec")

    async def validate(self, cpus: Sequence[int] | None = None) -> float:
        task = self._require_reset()
        result = await self._run(task.validation, task.validation_timeout_s, cpus, "validate")
        return 1.0 if result.exit_code == 0 and not result.timed_out else 0.0
