from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import docker.errors
import pytest
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
