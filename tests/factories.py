"""`make_x(**overrides)` factories shared by the test modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app.core.events import EngineUpdateBegin, EngineUpdateEnd, Event, RunEnded, RunStarted, VersionPublished
from app.tasks.spec import TaskSpec


def make_workload_data(**overrides: Any) -> dict[str, Any]:
    """A tiny workload as file data: 2 batches of B=2 groups of G=2, seconds-long trajectories.

    A mapping override is merged one level deep (`trajectory={"timeout_s": 5}` keeps the other
    trajectory fields); anything else replaces the field.
    """
    base: dict[str, Any] = {
        "seed": 3,
        "batches": 2,
        "batch": {"groups": 2, "group_size": 2},
        "trainer": {"step_s": 1.0},
        "policy": {"surplus_groups": 2, "max_staleness": 2},
        "engines": {"count": 2, "slots": 4, "update_s": 1.0},
        "cpus": {"total": 8, "serving": 2},
        "lanes": {"reset": 4, "exec": 4, "validate": 2, "cleanup": 2},
        "trajectory": {
            "reset_s": {"uniform": [0.5, 2]},
            "turns": {"uniform": [2, 5]},
            "llm_s": {"lognormal": {"median": 1, "p90": 3}},
            "tool_s": 0.5,
            "validate_s": 1,
            "cleanup_s": 1,
            "timeout_s": 60,
        },
    }
    for key, value in overrides.items():
        base[key] = (
            {**base[key], **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        )
    return base


def make_echo_task(root: Path, **overrides: Any) -> TaskSpec:
    """A task whose files are `greeting.txt` and `lib/helper.sh` under `root` (the sandbox tests' fixture)."""
    fields: dict[str, Any] = {
        "name": "echo-task",
        "instruction": "make greeting.txt say hello",
        "root": root,
        "validation": "grep -q hello greeting.txt",
        "setup": "echo set-up ran > setup.log",
        "files": ("greeting.txt", "lib/helper.sh"),
        "setup_timeout_s": 20.0,
        "validation_timeout_s": 20.0,
    }
    fields.update(overrides)
    return TaskSpec(**fields)


def make_run_ended_mid_rollout() -> list[tuple[float, Event]]:
    """Timed events of a run stopped while its weights rolled out: version 1 is superseded while e1
    still loads it, and e0 is loading version 2 when the run ends at t = 4."""
    return [
        (0.0, RunStarted(engines=("e0", "e1"))),
        (1.0, VersionPublished(1)),
        (1.0, EngineUpdateBegin("e0", 1)),
        (2.0, EngineUpdateEnd("e0", 1)),
        (2.0, EngineUpdateBegin("e1", 1)),
        (3.0, VersionPublished(2)),
        (3.0, EngineUpdateBegin("e0", 2)),
        (4.0, RunEnded("stopped")),
    ]
