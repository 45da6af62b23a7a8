"""`make_x(**overrides)` factories shared by the test modules."""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Callable
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


def reloaded_after_a_resume() -> list[tuple[float, Event]]:
    """Version 1 rolled onto both engines, then a resumed run loading it again onto engines that restarted."""
    return [
        (0.0, RunStarted(engines=("e0", "e1"))),
        (0.5, VersionPublished(1, "/w/1", "trainer")),
        (1.0, EngineUpdateBegin("e0", 1)),
        (2.0, EngineUpdateEnd("e0", 1)),
        (3.0, EngineUpdateBegin("e1", 1)),
        (4.0, EngineUpdateEnd("e1", 1)),
        (20.0, RunStarted(engines=("e0", "e1"))),
        (20.0, VersionPublished(1, "/w/1", "resume")),
        (21.0, EngineUpdateBegin("e0", 1)),
        (23.0, EngineUpdateEnd("e0", 1)),
        (24.0, EngineUpdateBegin("e1", 1)),
        (26.0, EngineUpdateEnd("e1", 1)),
    ]


def redis_answers(host: str = "127.0.0.1", port: int = 6379) -> bool:
    """Does a Redis answer PING on `host:port` (the tests that need the real broker skip without it)?"""
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def wait_for(
    check: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition", every_s: float = 0.05
) -> Any:
    """`check()`'s first true value, asked every `every_s`; an AssertionError naming `what` after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)
    return value


def take_write_lock(db: Path, wait_s: float = 60.0) -> sqlite3.Connection:
    """A connection to the SQLite file `db` inside `BEGIN IMMEDIATE`: it holds the file's write lock
    until the caller commits. It is tried again every millisecond, with no busy wait of SQLite's own:
    a writer that commits and begins again at once (a busy run's event sink) starves that wait, whose
    sleeps grow to 100 ms, and CI's run got "database is locked" after its 5 s."""
    conn = sqlite3.connect(db, timeout=0, isolation_level=None, check_same_thread=False)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return conn
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                conn.close()
                raise
        time.sleep(0.001)


def make_local_config() -> dict[str, object]:
    """A local run's config for the tests: one small embedded engine, a built-in task, B = 1 of G = 2."""
    cpus = sorted(os.sched_getaffinity(0))
    serving, lanes = (cpus[:1], cpus[1:2]) if len(cpus) > 1 else (cpus, cpus)
    return {
        "batch": {"groups": 1, "group_size": 2},
        "policy": {"surplus_groups": 1, "max_staleness": 2, "max_updating_engines": 1},
        "engines": {"count": 1, "cpus": serving, "slots": 4, "layers": 1, "hidden": 16, "max_tokens": 8},
        "lanes": {"cpus": lanes, "reset": 2, "exec": 2, "validate": 1, "cleanup": 1},
        "tasks": {"suite": "builtin", "include": ["fix-off-by-one"]},
    }
