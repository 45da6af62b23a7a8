"""Serialisable lane operations: JSON round trips, refusal of bad input, and in-process execution on a
real LocalSandbox through the same `execute_op` the Celery workers use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from factories import make_echo_task

from app.lanes.base import LaneName
from app.lanes.inprocess import InProcessLanes
from app.lanes.ops import (
    LaneOp,
    LaneOpError,
    SandboxHandle,
    decode_result,
    encode_result,
    handle_of,
    incarnation_of,
    incarnation_suffix,
    is_attempt_sandbox,
    task_from_dict,
    task_to_dict,
)
from app.sandboxes.base import ExecResult
from app.sandboxes.local import LocalSandboxFactory


def make_handle(**overrides: Any) -> SandboxHandle:
    fields: dict[str, Any] = {"kind": "local", "id": "g1a0-7", "host": "host-a", "work_dir": "/tmp/x/g1a0-7"}
    fields.update(overrides)
    return SandboxHandle(**fields)


def test_every_op_round_trips_through_json(tmp_path: Path) -> None:
    handle = make_handle()
    task = make_echo_task(tmp_path, tags=("a", "b"), candidate_actions=("ls",))
    ops: list[LaneOp[Any]] = [
        LaneOp.reset(handle, task),
        LaneOp.exec(handle, "echo hi", 2.5),
        LaneOp.validate(handle),
        LaneOp.cleanup(handle),
    ]
    for op in ops:
        wire = json.dumps(op.to_dict())
        back = LaneOp.from_dict(json.loads(wire))
        assert back == op
        assert back.host == "host-a"
        assert back.lane is op.name
    assert task_from_dict(json.loads(json.dumps(task_to_dict(task)))) == task
    assert len({op.op_id for op in ops}) == 4


def test_results_round_trip_through_json() -> None:
    handle = make_handle()
    result = ExecResult(exit_code=None, output="out", timed_out=True, truncated=True, duration_s=1.5)
    cases: list[tuple[LaneOp[Any], object]] = [
        (LaneOp.exec(handle, "x", 1), result),
        (LaneOp.validate(handle), 1.0),
        (LaneOp.cleanup(handle), None),
    ]
    for op, value in cases:
        assert decode_result(op, json.loads(json.dumps(encode_result(op.name, value)))) == value


def _op_dict(**overrides: Any) -> dict[str, Any]:
    data = LaneOp.exec(make_handle(), "echo hi", 2.0).to_dict()
    data.update(overrides)
    return data


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ("not a dict", "op"),
        (_op_dict(name="teleport"), "op.name"),
        (_op_dict(op_id=""), "op.op_id"),
        (_op_dict(extra=1), "unknown fields"),
        (_op_dict(handle={"kind": "local"}), "handle.id"),
        (_op_dict(handle={"kind": "local", "id": "a", "host": 3}), "handle.host"),
        (_op_dict(args={"command": "x"}), "op.args"),
        (_op_dict(args={"command": "x", "timeout_s": float("nan")}), "timeout_s"),
        (_op_dict(args={"command": "x", "timeout_s": float("inf")}), "timeout_s"),
        (_op_dict(args={"command": "x", "timeout_s": -1}), "timeout_s"),
        (_op_dict(args={"command": "x", "timeout_s": "5"}), "timeout_s"),
        (_op_dict(args={"command": 7, "timeout_s": 5}), "op.args.command"),
        (_op_dict(name="reset", args={"task": {"name": "t"}}), "args.task"),
        (_op_dict(name="validate", args={"x": 1}), "op.args"),
    ],
)
def test_malformed_ops_are_refused_naming_the_field(data: object, names: str) -> None:
    with pytest.raises(LaneOpError, match=names.replace(".", r"\.")):
        LaneOp.from_dict(data)


async def test_in_process_lanes_run_ops_on_a_real_sandbox_and_forget_it_after_cleanup(
    base_dir: Path, task_root: Path
) -> None:
    lanes = InProcessLanes({lane: 1 for lane in LaneName}, {lane: (0,) for lane in LaneName})
    sandbox = LocalSandboxFactory(base_dir, isolation="none", uid_base=None).create("g3a1")
    handle = lanes.attach(sandbox)
    assert handle == handle_of(sandbox, handle.host)
    assert handle.kind == "local"
    assert handle.work_dir == str(base_dir / "g3a1")
    reset = await lanes.run_op(LaneOp.reset(handle, make_echo_task(task_root)))
    assert reset.exit_code == 0
    done = await lanes.run_op(LaneOp.exec(handle, "cat greeting.txt; cat /proc/self/status", 10))
    assert done.output.startswith("hello world")
    assert "Cpus_allowed_list:\t0\n" in done.output  # the lane's CPU set reached the command
    assert await lanes.run_op(LaneOp.validate(handle)) == 1.0
    await lanes.run_op(LaneOp.cleanup(handle))
    assert not (base_dir / "g3a1").exists()
    assert lanes.stats()["exec"].completed == 1
    with pytest.raises(LaneOpError, match="not attached"):
        await lanes.run_op(LaneOp.validate(handle))


@pytest.mark.parametrize(
    ("name", "sandbox", "incarnation"),
    [
        ("g3a1-344885462903-i1796585394183", True, 1796585394183),
        ("g3a1-344885462903", True, None),  # in-process lanes, `corral run`
        ("g12a0-7-i1", True, 1),
        ("g3a1-7-i", False, None),
        ("notes", False, None),
        ("g3a1-7-i1.json", False, None),
        (".corral-state", False, None),
        ("x-g3a1-7-i1", False, 1),  # an incarnation, but no attempt's sandbox: a sweep leaves it
    ],
)
def test_sandbox_names_say_whether_they_are_an_attempts_and_of_which_incarnation(
    name: str, sandbox: bool, incarnation: int | None
) -> None:
    assert is_attempt_sandbox(name) is sandbox
    assert incarnation_of(name) == incarnation


def test_the_task_sources_sandbox_names_carry_the_runs_incarnation(tmp_path: Path) -> None:
    from app.runtime.task_source import TaskSource

    source = TaskSource([make_echo_task(tmp_path)], LocalSandboxFactory(tmp_path, uid_base=None), None, 1,
                        incarnation_suffix(42))  # fmt: skip
    _, _, sandbox = source.make_attempt(3, 0, 1)
    assert is_attempt_sandbox(sandbox.attempt_id)
    assert incarnation_of(sandbox.attempt_id) == 42
