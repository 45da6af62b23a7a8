"""A task: what one group's G attempts work on.

A task is a directory with `task.yaml` and files. `app.tasks.loader` turns a directory into a
`TaskSpec`, refusing bad ones at load time; everything after loading may trust these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TaskSpec:
    name: str
    instruction: str
    root: Path  # the task directory; `files` are relative to it
    validation: str  # shell command run in the work directory; exit 0 means reward 1
    setup: str = ""  # shell script run in the work directory at reset
    files: tuple[str, ...] = ()  # relative paths copied into the work directory at reset
    candidate_actions: tuple[str, ...] = ()  # shell commands the embedded policy chooses among
    setup_timeout_s: float = 60.0
    agent_timeout_s: float = 120.0
    validation_timeout_s: float = 60.0
    max_turns: int = 8
    tags: tuple[str, ...] = field(default_factory=tuple)
