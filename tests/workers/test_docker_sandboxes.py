"""Docker sandboxes on a lane worker: a sandbox reset in one pool process is carried on in another (two
`HostSandboxes`, as two pool processes of one host), and a run's start sweeps what its older incarnations
left (its containers, by their run label), against a real docker daemon (the sandbox tests' private
dockerd and busybox image)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from pathlib import Path
from typing import Any

import docker_fixtures
import pytest
from factories import make_echo_task

from app.lanes.ops import LaneOp, LaneOpError, SandboxHandle, execute_op, handle_of, incarnation_suffix
from app.sandboxes.docker import RUN_LABEL, DockerSandboxFactory
from workers.sandboxes import HostSandboxes, OlderIncarnation

docker_client = docker_fixtures.docker_client  # a fixture: the daemon that answers, or a private dockerd
TEST_IMAGE = docker_fixtures.TEST_IMAGE


def pool_process(docker_client: Any, state_dir: Path) -> HostSandboxes:
    """A lane worker's process of host `host-d`, its docker sandboxes' state in `state_dir`."""
    return HostSandboxes(
        "host-d", docker=DockerSandboxFactory(TEST_IMAGE, client=docker_client), state_dir=state_dir
    )


@pytest.mark.docker
async def test_a_docker_sandbox_is_carried_on_by_another_process_of_its_host(
    docker_client: object, tmp_path: Path, task_root: Path
) -> None:
    state_dir = tmp_path / "state"
    first, second = pool_process(docker_client, state_dir), pool_process(docker_client, state_dir)
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


def run_handle(run: str, attempt: str) -> SandboxHandle:
    """A docker sandbox's handle as a run on Celery lanes makes it (`open_ports` names the factory's run)."""
    factory = DockerSandboxFactory(TEST_IMAGE)
    factory.run = run
    return handle_of(factory.create(attempt), "host-d")


def carry_out(host: HostSandboxes, op: LaneOp[Any]) -> Any:
    """An op as a lane worker's `lane_op` carries it out: refused if of an older incarnation, then run,
    its state kept, and a reset that a newer incarnation overtook removed."""
    host.check_incarnation(op)
    sandbox = host.resolve(op.handle)
    try:
        result = asyncio.run(execute_op(op, sandbox, (1,)))
        host.after(op, sandbox)
    finally:
        reaped = host.reap_if_older(op, sandbox)
    return "reaped" if reaped else result


@pytest.mark.docker
def test_a_sweep_removes_an_older_incarnations_containers_and_no_other_runs(
    docker_client: Any, tmp_path: Path, task_root: Path
) -> None:
    state_dir = tmp_path / "state"
    # A reset worker's pool process and the cleanup worker.
    worker, cleaner = pool_process(docker_client, state_dir), pool_process(docker_client, state_dir)
    run, other_run = (f"pytest{uuid.uuid4().hex[:10]}" for _ in range(2))
    ns = random.randrange(10**12)  # attempt ids of a run: g<group>a<attempt>-<ns>-i<incarnation>
    old = run_handle(run, f"g0a0-{ns}{incarnation_suffix(1)}")  # what the killed incarnation left
    newest = run_handle(run, f"g1a0-{ns}{incarnation_suffix(3)}")  # the run started again
    other = run_handle(other_run, f"g0a0-{ns + 1}{incarnation_suffix(1)}")  # another run's, as old
    task = make_echo_task(task_root)

    def containers(handle: SandboxHandle) -> list[Any]:
        return list(docker_client.containers.list(all=True, filters={"name": f"^{handle.container}$"}))

    try:
        for handle in (old, newest, other):
            assert (carry_out(worker, LaneOp.reset(handle, task))).exit_code == 0
        assert containers(old)[0].labels[RUN_LABEL] == run
        kept = {h.id: containers(h)[0].id for h in (newest, other)}

        # A sweep of an incarnation between the two, arriving late: it removes what is older than the
        # newest incarnation of the run seen on the host, and nothing of the newest nor of another run.
        found = cleaner.sweep_docker(run, 2)
        assert containers(old) == []
        assert not list(state_dir.glob(f"{old.container}.json*"))
        assert (found.sandboxes, found.containers) == (1, 1)
        for handle in (newest, other):
            (container,) = containers(handle)
            assert (container.id, container.status) == (kept[handle.id], "running")
            done = carry_out(cleaner, LaneOp.exec(handle, "cat greeting.txt", 10))
            assert done.output == "hello world\n"
        assert cleaner.sweep_docker(run, 2).sandboxes == 0  # idempotent

        # A late reset of the older incarnation is refused before it runs: no container is made.
        late = run_handle(run, f"g2a0-{ns}{incarnation_suffix(1)}")
        with pytest.raises(OlderIncarnation, match="not run"):
            carry_out(worker, LaneOp.reset(late, task))
        assert containers(late) == []

        # A reset the next incarnation's sweep overtook (it had passed the check) removes what it made.
        overtaken = run_handle(run, f"g3a0-{ns}{incarnation_suffix(4)}")
        reset = LaneOp.reset(overtaken, task)
        worker.check_incarnation(reset)
        cleaner.sweep_docker(run, 5)
        sandbox = worker.resolve(overtaken)
        assert asyncio.run(execute_op(reset, sandbox, (1,))).exit_code == 0
        worker.after(reset, sandbox)
        assert worker.reap_if_older(reset, sandbox)
        assert containers(overtaken) == []
        assert not list(state_dir.glob(f"{overtaken.container}.json*"))
        assert len(containers(other)) == 1
    finally:
        for name in (run, other_run):
            for container in docker_client.containers.list(
                all=True, filters={"label": f"{RUN_LABEL}={name}"}
            ):
                with contextlib.suppress(Exception):
                    container.remove(force=True)


def test_a_sweep_of_a_docker_run_needs_a_docker_worker_and_a_run_id(tmp_path: Path) -> None:
    with pytest.raises(LaneOpError, match="--docker-image"):
        HostSandboxes("host-l").sweep_docker("r1", 2)
    docker = HostSandboxes("host-d", docker=DockerSandboxFactory(TEST_IMAGE), state_dir=tmp_path)
    with pytest.raises(LaneOpError, match="a run id is"):
        docker.sweep_docker("../r1", 2)
