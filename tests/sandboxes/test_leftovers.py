"""What a killed owner of sandboxes leaves is removed by the next start (app/sandboxes/leftovers.py).

A real process declares itself the owner, makes a sandbox (isolation "none", so nothing dies with it)
whose command leaves a detached process behind, and is killed with SIGKILL; a sweep from this process
then finds the sandbox's work directory, its process, its cgroup and its uid claim, and removes them.
Nothing of a live owner is touched.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from factories import make_echo_task as make_task
from sandbox_owner import alive_with_token, owner_argv, start_owner

from app.sandboxes import leftovers
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import pids_parent, uid_claims_dir


def test_a_killed_owners_sandbox_is_removed_and_a_live_ones_is_not(tmp_path: Path, base_dir: Path) -> None:
    token = f"{os.getpid() % 1000}.4242"
    owner, work, uid = start_owner(tmp_path, base_dir, token)
    parent = pids_parent(CGROUP_ROOT)
    name = leftovers.sandbox_group_name(work.name, work.parent, owner.pid)
    group = None if parent is None else parent[0] / name
    try:
        assert work.is_dir()
        assert group is None or group.is_dir()  # the sandbox's pids cgroup, while its owner lives
        assert alive_with_token(token) != []
        # The owner lives: nothing of it is touched.
        assert leftovers.sweep(tmp_path / "owners") == []
        assert work.is_dir()
        assert alive_with_token(token) != []

        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
        assert alive_with_token(token) != []  # isolation "none": the detached process outlives it

        (line,) = leftovers.sweep(tmp_path / "owners")
    finally:
        owner.kill()
        owner.wait()
        assert owner.stdout is not None
        owner.stdout.close()
        for pid in alive_with_token(token):
            os.kill(pid, signal.SIGKILL)
    assert line.startswith(f"removed what dead corral process {owner.pid} left behind: 1 sandbox")
    time.sleep(0.1)
    assert alive_with_token(token) == []
    assert not work.exists()
    assert list((base_dir / leftovers.MARKERS).iterdir()) == []
    if uid != "None":
        assert not (uid_claims_dir() / uid).exists()
    if group is not None:
        assert not group.exists()
    assert list((tmp_path / "owners").iterdir()) == []
    assert leftovers.sweep(tmp_path / "owners") == []  # twice is harmless


def test_an_owner_whose_pid_was_reused_is_dead(tmp_path: Path) -> None:
    me = leftovers.Owner.me()
    assert me.alive()
    assert not leftovers.Owner(me.pid, me.start + 1).alive()
    assert leftovers.Owner.parse(str(me)) == me
    assert leftovers.Owner.parse("garbage") is None


@pytest.mark.parametrize(
    ("owner_of", "removed"),
    [
        ("dead-here", ["c-dead"]),
        ("alive-here", []),
        ("dead-elsewhere", []),
    ],
)
def test_containers_of_dead_owners_on_this_host_are_removed(owner_of: str, removed: list[str]) -> None:
    me = leftovers.Owner.me()
    host = socket.gethostname()
    value = {
        "dead-here": f"{host} {me.pid} {me.start + 1}",
        "alive-here": f"{host} {me}",
        "dead-elsewhere": f"another-host {me.pid} {me.start + 1}",
    }[owner_of]
    gone: list[str] = []

    def remove(container: str) -> bool:
        gone.append(container)
        return True

    count = leftovers.sweep_containers(lambda label: [("c-dead", value)], remove)
    assert gone == removed
    assert count == len(removed)


def test_a_dead_owner_that_left_nothing_is_forgotten_silently_a_corrupt_entry_kept(tmp_path: Path) -> None:
    owners = tmp_path / "owners"
    owners.mkdir()
    me = leftovers.Owner.me()
    dead = {"pid": me.pid, "start": me.start + 1, "roots": [str(tmp_path / "gone")], "dirs": []}
    (owners / "1.json").write_text(json.dumps(dead))
    (owners / "2.json").write_text("{half a reg")
    assert leftovers.sweep(owners) == []
    assert sorted(p.name for p in owners.iterdir()) == ["2.json"]


def test_a_dead_owners_directories_are_removed_whole(tmp_path: Path) -> None:
    owners = tmp_path / "owners"
    owners.mkdir()
    run_dir = tmp_path / "corral-run-x"
    (run_dir / "sandboxes" / leftovers.MARKERS).mkdir(parents=True)
    (run_dir / "weights").mkdir()
    me = leftovers.Owner.me()
    roots, dirs = [str(run_dir / "sandboxes")], [str(run_dir)]
    dead = {"pid": 4_000_000, "start": me.start, "roots": roots, "dirs": dirs}
    (owners / "4000000.json").write_text(json.dumps(dead))
    (line,) = leftovers.sweep(owners)
    assert line == "removed what dead corral process 4000000 left behind: 1 directory"
    assert not run_dir.exists()
    assert list(owners.iterdir()) == []


@pytest.mark.docker
async def test_containers_a_dead_owner_left_are_removed_on_a_real_daemon(
    docker_client: Any, task_root: Path
) -> None:
    """Real containers, labelled as a declared owner labels them: one by a dead process (this pid with
    another start time, as after a pid reuse), one by this live process. Only the first goes."""
    import docker.errors

    from app.sandboxes.docker import DockerSandboxFactory

    me = leftovers.Owner.me()
    host = socket.gethostname()
    made = []
    for who, owner in (("dead", leftovers.Owner(me.pid, me.start + 1)), ("live", me)):
        factory = DockerSandboxFactory("corral-sandbox:test", client=docker_client, mem_limit="256m")
        factory.owner_label = {leftovers.OWNER_LABEL: f"{host} {owner}"}
        sandbox = factory.create(f"pytest-leftover-{who}")
        await sandbox.reset(make_task(task_root, setup=""))
        made.append(sandbox)
    dead, live = made
    try:
        assert factory.remove_leftovers() == 1
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(dead.container_name)
        assert docker_client.containers.get(live.container_name).status == "running"
    finally:
        for sandbox in made:
            await sandbox.cleanup()


@pytest.mark.docker
def test_a_sweep_of_containers_is_not_failed_by_a_live_owners_containers_coming_and_going(
    docker_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Another corral process on the daemon (this one, live) makes and removes its containers while a
    factory sweeps: a container it removed between the sweep's listing and its look at it is no error."""
    from app.sandboxes.docker import DockerSandboxFactory

    me = leftovers.Owner.me()
    labels = {leftovers.OWNER_LABEL: f"{socket.gethostname()} {me}", "corral.attempt": "pytest-churn"}
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            made = docker_client.containers.create("corral-sandbox:test", ["true"], labels=labels)
            made.remove(force=True)

    factory = DockerSandboxFactory("corral-sandbox:test", client=docker_client)
    factory.owner_label = {leftovers.OWNER_LABEL: f"{socket.gethostname()} {me}"}
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        deadline = time.monotonic() + 5  # before the fix it failed within 1 s here
        while time.monotonic() < deadline:
            assert factory.remove_leftovers() == 0
        assert "could not remove" not in caplog.text  # a sweep that failed is logged, and says 0 too
    finally:
        stop.set()
        churner.join()


@pytest.mark.docker
def test_two_factories_sweeping_one_dead_owners_containers_at_once_both_start(
    docker_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two corral processes starting at once on one daemon sweep the same dead owner's containers: a
    removal the other has under way (409) or has done (404) is no error to either, and every container
    goes. Before, the 409 ("removal ... is already in progress") came out of the sweep, and so out of
    the factory's start-up check, in the first of five rounds of 8 containers. Each container is
    counted by the one sweep that removed it: before, both sweeps counted (and logged) all 8."""
    from app.sandboxes.docker import DockerSandboxFactory

    me = leftovers.Owner.me()
    dead = {leftovers.OWNER_LABEL: f"{socket.gethostname()} {me.pid} {me.start + 1}"}
    labels = {**dead, "corral.attempt": "pytest-two-sweeps"}
    errors: list[BaseException] = []
    counts: list[int] = []

    def sweep(barrier: threading.Barrier) -> None:
        factory = DockerSandboxFactory("corral-sandbox:test", client=docker_client)
        barrier.wait()
        try:
            counts.append(factory.remove_leftovers())
        except Exception as exc:  # what the test looks for
            errors.append(exc)

    for _ in range(5):
        counts.clear()
        for _ in range(8):
            docker_client.containers.create("corral-sandbox:test", ["true"], labels=labels)
        barrier = threading.Barrier(2)
        sweeps = [threading.Thread(target=sweep, args=(barrier,)) for _ in range(2)]
        for thread in sweeps:
            thread.start()
        for thread in sweeps:
            thread.join(60)
        assert errors == []
        assert "could not remove" not in caplog.text  # no sweep gave up
        assert sum(counts) == 8, counts  # each container counted by the sweep that removed it
        assert (
            docker_client.containers.list(all=True, filters={"label": "corral.attempt=pytest-two-sweeps"})
            == []
        )


@pytest.mark.parametrize("keep", ["keep", "exit"])
def test_an_owner_that_kept_its_registration_at_a_clean_exit_has_its_sandboxes_removed_by_the_next(
    tmp_path: Path, base_dir: Path, keep: str
) -> None:
    """`corral serve` that leaves its runs to the next start (`CORRAL_RUNS_ON_SHUTDOWN=resume`) exits
    cleanly with their sandboxes in place: it keeps its registration, so the next start removes them as a
    dead owner's. Without `keep`, a clean exit leaves nothing to find (its sandboxes are its own to end)."""
    argv = owner_argv(tmp_path, base_dir, "0", keep)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60)
    work = Path(done.stdout.split()[0])
    assert work.is_dir()
    lines = leftovers.sweep(tmp_path / "owners")
    if keep == "keep":
        assert len(lines) == 1
        assert "left behind: 1 sandbox" in lines[0]
        assert not work.exists()
    else:
        assert lines == []
        assert work.is_dir()
        leftovers.rmtree(work)
