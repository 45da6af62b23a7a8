from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import docker.errors
import pytest
from docker_fixtures import DaemonProxy
from factories import make_echo_task as make_task

from app.sandboxes.docker import DockerSandboxFactory
from app.sandboxes.local import SandboxError

pytestmark = pytest.mark.docker

IMAGE = "corral-sandbox:test"
ALLOWED = sorted(os.sched_getaffinity(0))


def make_factory(client: Any, **overrides: Any) -> DockerSandboxFactory:
    return DockerSandboxFactory(IMAGE, client=client, mem_limit="256m", pids_limit=64, **overrides)


async def test_happy_path(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client).create("pytest-d-happy")
    reset = await sb.reset(make_task(task_root, setup="echo setting up; echo ran > setup.log"))
    assert reset.exit_code == 0
    assert reset.output == "setting up\n"
    result = await sb.exec("cat greeting.txt lib/helper.sh setup.log; pwd", timeout_s=10)
    assert result.output == "hello world\necho helper\nran\n/work\n"
    assert await sb.validate() == 1.0
    failed = await sb.exec("echo bye > greeting.txt; echo oops >&2; exit 3", timeout_s=10)
    assert failed.exit_code == 3
    assert failed.output == "oops\n"
    assert not failed.timed_out
    assert await sb.validate() == 0.0
    container_id = sb.container_id
    await sb.cleanup()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container_id)
    with pytest.raises(SandboxError, match="before reset"):
        await sb.exec("true", timeout_s=1)
    await sb.cleanup()  # a second cleanup is a no-op


async def test_container_limits_and_no_network(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client).create("pytest-d-net")
    await sb.reset(make_task(task_root, setup=""))
    host = docker_client.containers.get(sb.container_id).attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["PidsLimit"] == 64
    assert host["Memory"] == 256 << 20
    result = await sb.exec("ls /sys/class/net; cat /proc/net/route | wc -l", timeout_s=10)
    assert result.output.split() == ["lo", "1"]  # only the loopback, and no routes (header line only)
    await sb.cleanup()


async def test_cpuset_applied_and_updated_per_lane(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client).create("pytest-d-cpus")
    await sb.reset(make_task(task_root, setup=""), cpus=[ALLOWED[-1]])
    container = docker_client.containers.get(sb.container_id)
    assert container.attrs["HostConfig"]["CpusetCpus"] == str(ALLOWED[-1])
    inside = await sb.exec("grep Cpus_allowed_list /proc/self/status", timeout_s=10, cpus=[ALLOWED[-1]])
    assert inside.output.split(":")[1].strip() == str(ALLOWED[-1])
    moved = await sb.exec("grep Cpus_allowed_list /proc/self/status", timeout_s=10, cpus=[ALLOWED[0]])
    assert moved.output.split(":")[1].strip() == str(ALLOWED[0])
    container.reload()
    assert container.attrs["HostConfig"]["CpusetCpus"] == str(ALLOWED[0])
    await sb.cleanup()


async def test_timeout_kills_the_command_and_its_children(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client).create("pytest-d-timeout")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("sleep 321 & echo $! > gc.pid; (sleep 322 &); sleep 600", timeout_s=1.0)
    assert result.timed_out
    assert result.exit_code is None
    assert result.duration_s < 5
    left = await sb.exec("ps -o pid,args | grep 'sleep 32[12]' || echo none-left", timeout_s=10)
    assert left.output == "none-left\n"
    # A command that itself dies of SIGKILL before its deadline is not a timeout.
    killed = await sb.exec("kill -KILL $$", timeout_s=10)
    assert not killed.timed_out
    assert killed.exit_code == 137
    await sb.cleanup()


async def test_output_is_capped_with_a_notice(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client, output_limit=1000).create("pytest-d-trunc")
    await sb.reset(make_task(task_root, setup=""))
    result = await sb.exec("head -c 5000 /dev/zero | tr '\\0' x", timeout_s=10)
    assert result.truncated
    assert result.output == "x" * 1000 + "\n[corral: output truncated, 4000 bytes dropped]"
    await sb.cleanup()


async def test_reset_replaces_the_container(docker_client: Any, task_root: Path) -> None:
    sb = make_factory(docker_client).create("pytest-d-reset")
    task = make_task(task_root, setup="")
    await sb.reset(task)
    first = sb.container_id
    await sb.exec("echo junk > extra.txt", timeout_s=10)
    await sb.reset(task)
    assert sb.container_id != first
    listing = await sb.exec("ls", timeout_s=10)
    assert listing.output.split() == ["greeting.txt", "lib"]
    await sb.cleanup()


class _SlowCreation:
    """The real client, whose container creation says when it begins and takes half a second longer:
    time for a cancelled reset's cleanup to run meanwhile."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.containers = self
        self.creating = threading.Event()
        self.created = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client.containers if name in ("get", "list") else self._client, name)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.creating.set()
        time.sleep(0.5)
        try:
            return self._client.containers.run(*args, **kwargs)
        finally:
            self.created.set()


async def test_a_reset_cancelled_while_its_container_is_created_leaves_no_container(
    docker_client: Any, task_root: Path
) -> None:
    # A run that stops cancels the resets in flight and cleans their sandboxes up; the creation goes on
    # in its thread. Before the fix the cleanup removed nothing and the container was created after it.
    client = _SlowCreation(docker_client)
    sb = make_factory(client).create("pytest-d-cancel")
    reset = asyncio.create_task(sb.reset(make_task(task_root, setup="")))
    assert await asyncio.to_thread(client.creating.wait, 30)
    reset.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reset
    await sb.cleanup()
    assert await asyncio.to_thread(client.created.wait, 30)
    await asyncio.sleep(0.5)  # the creation's thread copies the task files after the container exists
    assert docker_client.containers.list(all=True, filters={"name": sb.container_name}) == []


async def test_a_container_killed_mid_command_fails_it_with_the_reason(
    docker_client: Any, task_root: Path
) -> None:
    # `docker kill` of a sandbox during a tool call. Before, the command came back as a plain exit 137
    # and every later op raised APIError(HTTPError('409 Client Error: Conflict for url: ...')).
    sb = make_factory(docker_client).create("pytest-d-killed")
    await sb.reset(make_task(task_root, setup=""))
    running = asyncio.create_task(sb.exec("echo started; sleep 60", timeout_s=120))
    container = docker_client.containers.get(sb.container_id)
    for _ in range(100):
        if "sleep 60" in str(container.top()["Processes"]):
            break
        await asyncio.sleep(0.1)
    container.kill()
    with pytest.raises(
        SandboxError, match=r"corral-pytest-d-killed: the container is exited \(exit code 137\)"
    ):
        await running
    with pytest.raises(SandboxError, match="killed or stopped outside corral"):
        await sb.validate()
    await sb.cleanup()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(container.id)


def _hang_up_on_every_request(path: Path, stop: threading.Event) -> None:
    """A daemon dying under its clients: each connection is accepted and closed unanswered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen()
        server.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                server.accept()[0].close()


@pytest.mark.parametrize("op", ["exec", "cleanup"])
async def test_a_daemon_that_does_not_answer_is_named(tmp_path: Path, task_root: Path, op: str) -> None:
    # dockerd killed mid-run. Before: every op failed with ConnectionError(ProtocolError('Connection
    # aborted.', ...)), naming neither docker nor the container.
    path = tmp_path / "dying.sock"
    stop = threading.Event()
    server = threading.Thread(target=_hang_up_on_every_request, args=(path, stop))
    server.start()
    client = docker.DockerClient(base_url=f"unix://{path}", version="1.41")  # made while it answered
    try:
        factory = DockerSandboxFactory(IMAGE, client=client, base_url=f"unix://{path}", daemon_wait_s=0.3)
        sb = factory.create("pytest-d-gone")
        sb.adopt(make_task(task_root, setup=""), "0123456789ab")
        with pytest.raises(SandboxError, match=rf"corral-pytest-d-gone: docker daemon at unix://{path}: "):
            await (sb.exec("true", timeout_s=5) if op == "exec" else sb.cleanup())
    finally:
        client.close()
        stop.set()
        server.join()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the SDK drops a failed connection unclosed
            gc.collect()


async def test_ops_wait_for_a_daemon_that_comes_back(
    docker_client: Any, task_root: Path, tmp_path: Path
) -> None:
    # dockerd restarted mid-run. Before, every op in the gap failed at once: a run failed 101 groups
    # within 5 s and stopped (docs/sandboxes.md), though the daemon was back 8 s later.
    proxy = DaemonProxy(tmp_path / "proxy.sock", docker_client.api._custom_adapter.socket_path)
    proxy.up()
    where = f"unix://{proxy.path}"
    client = docker.DockerClient(base_url=where, version="1.41")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the SDK leaks the socket of the op that failed
        try:
            sb = make_factory(client, base_url=where, daemon_wait_s=30).create("pytest-d-outage")
            await sb.reset(make_task(task_root, setup=""))
            for op in ("exec", "cleanup"):
                proxy.down()
                waiting = asyncio.create_task(
                    sb.exec("cat greeting.txt", timeout_s=10) if op == "exec" else sb.cleanup()
                )
                await asyncio.sleep(1.5)
                assert not waiting.done()
                proxy.up()
                result = await waiting
                if op == "exec":
                    assert result is not None
                    assert result.output == "hello world\n"
            assert docker_client.containers.list(all=True, filters={"name": sb.container_name}) == []
        finally:
            client.close()
            proxy.down()
            gc.collect()


async def test_a_sandbox_at_its_process_limit_says_so(docker_client: Any, task_root: Path) -> None:
    # Background processes of earlier commands hold the pids limit: every later command failed with
    # exit 126 and only "OCI runtime exec failed ... read init-p: connection reset by peer".
    sb = make_factory(docker_client).create("pytest-d-pids")
    await sb.reset(make_task(task_root, setup=""))
    try:
        await sb.exec("i=0; while [ $i -lt 80 ]; do sleep 600 & i=$((i+1)); done; true", timeout_s=30)
        held = await sb.exec("sleep 0; echo hi", timeout_s=10)  # it forks, after the wrapper took the rest
        assert held.exit_code != 0
        assert "at its process limit (64 processes, " in held.output
        assert "left running" in held.output
    finally:
        await sb.cleanup()
