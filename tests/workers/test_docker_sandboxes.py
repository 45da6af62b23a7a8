"""Docker sandboxes on a lane worker: a sandbox reset in one pool process is carried on in another (two
`HostSandboxes`, as two pool processes of one host), against a real docker daemon (the sandbox tests'
private dockerd and busybox image)."""

from __future__ import annotations

import uuid
from pathlib import Path

import docker_fixtures
import pytest
from factories import make_echo_task

from app.lanes.ops import LaneOp, LaneOpError, execute_op, handle_of
from app.sandboxes.docker import DockerSandboxFactory
from workers.sandboxes import HostSandboxes

docker_client = docker_fixtures.docker_client  # a fixture: the daemon that answers, or a private dockerd
TEST_IMAGE = docker_fixtures.TEST_IMAGE


@pytest.mark.docker
async def test_a_docker_sandbox_is_carried_on_by_another_process_of_its_host(
    docker_client: object, tmp_path: Path, task_root: Path
) -> None:
    state_dir = tmp_path / "state"

    def pool_process() -> HostSandboxes:
        return HostSandboxes(
            "host-d", docker=DockerSandboxFactory(TEST_IMAGE, client=docker_client), state_dir=state_dir
        )

    first, second = pool_process(), pool_process()
    attempt = f"pytest-{uuid.uuid4().hex[:8]}"  # the fixture removes leftover "pytest-" containers
    handle = handle_of(DockerSandboxFactory(TEST_IMAGE).create(attempt), "host-d")
    assert (handle.kind, handle.container) == ("docker", f"corral-{attempt}")

    reset = LaneOp.reset(handle, make_echo_task(task_root))
    sandbox = first.resolve(handle)
    assert (await execute_op(reset, sandbox, (1,))).exit_code == 0
    first.after(reset, sandbox)

    later = second.resolve(handle)  # a fresh object in another process: the state file carries it
    done = await execute_op(LaneOp.exec(handle, "cat greeting.txt; cat setup.log", 10), later, (1,))
    assert done.output.splitlines() == ["hello world", "set-up ran"]
    assert await execute_op(LaneOp.validate(handle), second.resolve(handle), (1,)) == 1.0

    cleanup = LaneOp.cleanup(handle)
    last = first.resolve(handle)
    await execute_op(cleanup, last, (1,))
    first.after(cleanup, last)
    assert list(state_dir.iterdir()) == []
    assert docker_client.containers.list(all=True, filters={"name": handle.container}) == []  # type: ignore[attr-defined]


def test_a_worker_without_docker_refuses_docker_handles(tmp_path: Path) -> None:
    handle = handle_of(DockerSandboxFactory(TEST_IMAGE).create("nodocker"), "host-l")
    with pytest.raises(LaneOpError, match="--docker-image"):
        HostSandboxes("host-l").resolve(handle)
    with pytest.raises(LaneOpError, match=r"handle\.host"):
        HostSandboxes("host-x").resolve(handle)
