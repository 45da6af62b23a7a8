"""Serialisable lane operations: what a lane runs, as data that can cross a process or a host.

A `LaneOp` is an operation name (`reset`, `exec`, `validate`, `cleanup`; the op runs in the lane of the
same name), a `SandboxHandle` naming the sandbox it acts on, JSON arguments and an op id. The handle
carries the sandbox's host once it has been placed: every later op of that sandbox routes to that
host's lane queues, since the sandbox's work directory, uid claim and cgroup live there.

Invariants:
- `LaneOp.from_dict(op.to_dict()) == op`, and `to_dict()` is plain JSON (str, int, float, list, dict);
  a malformed dict raises `LaneOpError` naming the field; non-finite numbers are refused.
- In-process lanes and Celery lanes run an op through the same function, `execute_op`; results cross
  the wire through `encode_result` / `decode_result`, which round-trip exactly.
- An op id names one logical operation: a repeated delivery of the same op id is the same op (Celery
  workers return the stored result instead of running it twice).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import re
import socket
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

from app.core.events import fast_frozen_init
from app.lanes.base import LaneName
from app.sandboxes.base import ExecResult, Sandbox
from app.tasks.spec import TaskSpec

R = TypeVar("R")


_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def _pid_prefix() -> str:
    return f"{_ID_PREFIX}-{os.getpid():x}-"


_ID_PID_PREFIX = _pid_prefix()


def _after_fork() -> None:
    global _ID_PID_PREFIX
    _ID_PID_PREFIX = _pid_prefix()


os.register_at_fork(after_in_child=_after_fork)


def new_op_id() -> str:
    """A fresh op id, unique across processes and hosts: a random prefix drawn once per process, the pid
    (forked children share the prefix; the pid part is renewed in the child at a fork), and a counter
    (a uuid4 per op costs several µs in the simulator's hot path)."""
    return f"{_ID_PID_PREFIX}{next(_ID_COUNTER):x}"


class LaneOpError(ValueError):
    """A lane operation that cannot be decoded or carried out as described."""


# A sandbox of a run driven over Celery lanes carries its incarnation in its id (`g3a1-<ns>-i<n>`): the
# number each start of the run draws (`CeleryLanes.begin_incarnation`), growing from one start to the
# next. A lane host tells a dead incarnation's sandboxes from the live one's by it (workers.sandboxes).
_INCARNATION = re.compile(r"-i([0-9]{1,20})$")
_ATTEMPT_SANDBOX = re.compile(r"^g[0-9]+a[0-9]+-[0-9]+(?:-i[0-9]{1,20})?$")


def incarnation_suffix(incarnation: int) -> str:
    """What a sandbox id of incarnation `incarnation` ends with."""
    return f"-i{incarnation}"


def incarnation_of(sandbox_id: str) -> int | None:
    """The incarnation a sandbox id names, or None for an id without one (in-process runs, `corral run`)."""
    found = _INCARNATION.search(sandbox_id)
    return None if found is None else int(found.group(1))


def is_attempt_sandbox(name: str) -> bool:
    """Whether `name` is one the task source gives an attempt's sandbox (`g3a1-<ns>`, with its run's
    incarnation or without): a sweep removes nothing else."""
    return _ATTEMPT_SANDBOX.match(name) is not None


def local_host() -> str:
    """This host's name as lane queues spell it."""
    return socket.gethostname()


@fast_frozen_init
@dataclass(frozen=True)
class SandboxHandle:
    """Names one sandbox: its kind, its id (the attempt id), the host it lives on and where it is there.

    `host` is None until the sandbox is placed; lanes place it on first use (see `Lanes.attach`).
    """

    kind: str  # "local" (a work directory), "docker" (a container), or an in-process-only kind
    id: str
    host: str | None = None
    work_dir: str | None = None
    container: str | None = None
    run: str | None = None  # a docker sandbox's run on Celery lanes: its container is labelled with it

    def on(self, host: str) -> SandboxHandle:
        return replace(self, host=host)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object) -> SandboxHandle:
        raw = _mapping(data, "handle")
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise LaneOpError(f"handle: unknown fields {unknown}")
        kind = _str(raw, "kind", "handle")
        ident = _str(raw, "id", "handle")
        if not kind or not ident:
            raise LaneOpError("handle.kind and handle.id must be non-empty")
        return cls(
            kind=kind,
            id=ident,
            host=_opt_str(raw, "host", "handle"),
            work_dir=_opt_str(raw, "work_dir", "handle"),
            container=_opt_str(raw, "container", "handle"),
            run=_opt_str(raw, "run", "handle"),
        )


def handle_of(sandbox: Sandbox, host: str | None = None) -> SandboxHandle:
    """The handle of a sandbox object: a work directory for local sandboxes, a container for docker ones;
    any other sandbox (the simulator's) gets an in-process-only handle named after the object."""
    if isinstance(sandbox, _local_sandbox_type()):
        return SandboxHandle("local", sandbox.attempt_id, host, work_dir=str(sandbox.work_dir))
    attempt_id = getattr(sandbox, "attempt_id", None)
    container = getattr(sandbox, "container_name", None) if isinstance(attempt_id, str) else None
    if isinstance(container, str) and isinstance(attempt_id, str):
        run = getattr(sandbox, "run", None)
        return SandboxHandle("docker", attempt_id, host, container=container, run=run)
    return SandboxHandle(type(sandbox).__name__, f"{type(sandbox).__name__}-{id(sandbox):x}", host)


@functools.cache
def _local_sandbox_type() -> type[Any]:
    from app.sandboxes.local import LocalSandbox  # imported on first use: it pulls in the sandbox stack

    return LocalSandbox


@fast_frozen_init
@dataclass(frozen=True)
class LaneOp(Generic[R]):
    """One sandbox operation as data. Build it with `reset`, `exec`, `validate` or `cleanup`; the type
    parameter is what running it returns."""

    name: LaneName
    handle: SandboxHandle
    args: Mapping[str, Any] = field(default_factory=dict)
    op_id: str = field(default_factory=new_op_id)
    # The `TaskSpec` a reset was built from, kept so that an op run in this process skips decoding
    # `args["task"]` again. Not data: never serialised, not compared; an op decoded from a dict has None
    # and decodes its args.
    local_task: TaskSpec | None = field(default=None, compare=False, repr=False)

    @property
    def lane(self) -> LaneName:
        return self.name

    @property
    def host(self) -> str | None:
        return self.handle.host

    def on(self, host: str) -> LaneOp[R]:
        return replace(self, handle=self.handle.on(host))

    @staticmethod
    def reset(handle: SandboxHandle, task: TaskSpec) -> LaneOp[ExecResult]:
        return LaneOp(LaneName.RESET, handle, {"task": _task_dict(task)}, local_task=task)

    @staticmethod
    def exec(handle: SandboxHandle, command: str, timeout_s: float) -> LaneOp[ExecResult]:
        timeout = float(timeout_s)
        op: LaneOp[ExecResult] = LaneOp(LaneName.EXEC, handle, {"command": command, "timeout_s": timeout})
        if not isinstance(command, str) or not 0 < timeout < math.inf:
            _check_args(op.name, op.args)  # raises, naming the field
        return op

    @staticmethod
    def validate(handle: SandboxHandle) -> LaneOp[float]:
        return LaneOp(LaneName.VALIDATE, handle)

    @staticmethod
    def cleanup(handle: SandboxHandle) -> LaneOp[None]:
        return LaneOp(LaneName.CLEANUP, handle)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op_id": self.op_id,
            "name": self.name.value,
            "handle": self.handle.to_dict(),
            "args": dict(self.args),
        }

    @classmethod
    def from_dict(cls, data: object) -> LaneOp[Any]:
        raw = _mapping(data, "op")
        unknown = sorted(set(raw) - {"op_id", "name", "handle", "args"})
        if unknown:
            raise LaneOpError(f"op: unknown fields {unknown}")
        name_text = _str(raw, "name", "op")
        try:
            name = LaneName(name_text)
        except ValueError:
            raise LaneOpError(f"op.name: {name_text!r} is not one of {[n.value for n in LaneName]}") from None
        op_id = _str(raw, "op_id", "op")
        if not op_id:
            raise LaneOpError("op.op_id must be non-empty")
        args = dict(_mapping(raw.get("args", {}), "op.args"))
        _check_args(name, args)
        return LaneOp(name, SandboxHandle.from_dict(raw.get("handle")), args, op_id)


# -- the one way an op is carried out ---------------------------------------------------------------


def execute_op(op: LaneOp[R], sandbox: Sandbox, cpus: Sequence[int] | None) -> Coroutine[Any, Any, R]:
    """Run `op` on `sandbox` with the lane's CPU set. In-process and Celery lanes both call this.

    A plain function returning the sandbox method's coroutine (validate's wrapped to return a float):
    the same as an `async def`, without a coroutine frame of its own on every op."""
    name = op.name
    if name is LaneName.RESET:
        task = op.local_task if op.local_task is not None else task_from_dict(op.args["task"])
        return cast(Coroutine[Any, Any, R], sandbox.reset(task, cpus))
    if name is LaneName.EXEC:
        args = op.args
        return cast(
            Coroutine[Any, Any, R], sandbox.exec(str(args["command"]), float(args["timeout_s"]), cpus)
        )
    if name is LaneName.VALIDATE:
        return cast(Coroutine[Any, Any, R], _reward(sandbox, cpus))
    return cast(Coroutine[Any, Any, R], sandbox.cleanup(cpus))


async def _reward(sandbox: Sandbox, cpus: Sequence[int] | None) -> float:
    return float(await sandbox.validate(cpus))


def encode_result(name: LaneName, result: object) -> Any:
    """A result as JSON: an `ExecResult` as a dict, a reward as a float, a cleanup as None."""
    if name in (LaneName.RESET, LaneName.EXEC):
        assert isinstance(result, ExecResult)
        return {f.name: getattr(result, f.name) for f in fields(ExecResult)}
    if name is LaneName.VALIDATE:
        assert isinstance(result, float)
        return result
    return None


def decode_result(op: LaneOp[R], data: Any) -> R:
    if op.name in (LaneName.RESET, LaneName.EXEC):
        raw = _mapping(data, f"{op.name.value} result")
        return cast(R, ExecResult(**{f.name: raw[f.name] for f in fields(ExecResult)}))
    if op.name is LaneName.VALIDATE:
        if not isinstance(data, int | float) or isinstance(data, bool):
            raise LaneOpError(f"validate result: expected a number, got {type(data).__name__}")
        return cast(R, float(data))
    return cast(R, None)


# -- tasks as JSON ------------------------------------------------------------------------------------


_last_task: tuple[TaskSpec | None, dict[str, Any]] = (None, {})  # the last task `_task_dict` converted


def _task_dict(task: TaskSpec) -> dict[str, Any]:
    """`task_to_dict`, remembering the last task: a run resets many sandboxes from the same task object
    in a row (a group's attempts, every simulated attempt). Each op gets its own copy of the dict."""
    global _last_task
    last = _last_task  # one read: another thread may replace it meanwhile
    if last[0] is not task:
        last = _last_task = (task, task_to_dict(task))
    return dict(last[1])


def task_to_dict(task: TaskSpec) -> dict[str, Any]:
    return {
        "name": task.name,
        "instruction": task.instruction,
        "root": str(task.root),
        "validation": task.validation,
        "setup": task.setup,
        "files": list(task.files),
        "candidate_actions": list(task.candidate_actions),
        "setup_timeout_s": task.setup_timeout_s,
        "agent_timeout_s": task.agent_timeout_s,
        "validation_timeout_s": task.validation_timeout_s,
        "max_turns": task.max_turns,
        "tags": list(task.tags),
    }


def task_from_dict(data: object) -> TaskSpec:
    raw = _mapping(data, "args.task")
    known = {f.name for f in fields(TaskSpec)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise LaneOpError(f"args.task: unknown fields {unknown}")
    values: dict[str, Any] = dict(raw)
    try:
        values["root"] = Path(values["root"])
        for name in ("files", "candidate_actions", "tags"):
            if name in values:
                values[name] = tuple(values[name])
        for name in ("setup_timeout_s", "agent_timeout_s", "validation_timeout_s"):
            if name in values:
                values[name] = _finite(values[name], f"args.task.{name}")
        return TaskSpec(**values)
    except (KeyError, TypeError) as exc:
        raise LaneOpError(f"args.task: {exc}") from None


# -- checks -------------------------------------------------------------------------------------------


def _check_args(name: LaneName, args: Mapping[str, Any]) -> None:
    expected = {
        LaneName.RESET: {"task"},
        LaneName.EXEC: {"command", "timeout_s"},
        LaneName.VALIDATE: set(),
        LaneName.CLEANUP: set(),
    }[name]
    if set(args) != expected:
        raise LaneOpError(f"op.args of {name.value}: expected {sorted(expected)}, got {sorted(args)}")
    if name is LaneName.EXEC:
        if not isinstance(args["command"], str):
            raise LaneOpError("op.args.command must be a string")
        if _finite(args["timeout_s"], "op.args.timeout_s") <= 0:
            raise LaneOpError(f"op.args.timeout_s must be positive, got {args['timeout_s']}")
    elif name is LaneName.RESET:
        task_from_dict(args["task"])


def _finite(value: object, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise LaneOpError(f"{where}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise LaneOpError(f"{where}: must be finite, got {value}")
    return float(value)


def _mapping(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise LaneOpError(f"{where}: expected an object, got {type(data).__name__}")
    return cast(Mapping[str, Any], data)


def _str(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise LaneOpError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _opt_str(raw: Mapping[str, Any], key: str, where: str) -> str | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, str):
        raise LaneOpError(f"{where}.{key}: expected a string or null, got {type(value).__name__}")
    return value
