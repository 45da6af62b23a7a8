"""`corral serve` killed with SIGKILL while a local run has sandboxes: the next `corral serve` removes
what the dead one left (work directories, pids cgroups) before it serves, and says so in its log; with
docker sandboxes, the dead one's containers once its docker factory first reaches the daemon (the sandbox
tests' private dockerd and busybox image) (app/sandboxes/leftovers.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import uuid
from pathlib import Path
from typing import Any

import docker_fixtures
import httpx
import pytest
from api_support import TOKEN, free_port, serve_env, wait_for
from docker_fixtures import docker_env
from factories import make_local_config
from test_serve_restart import _healthy, corral_serve

from app.sandboxes import leftovers
from app.sandboxes.cpuset import CGROUP_ROOT
from app.sandboxes.limits import pids_parent

docker_client = docker_fixtures.docker_client  # a fixture: the daemon that answers, or a private dockerd


def marked(registration: Path) -> list[Path]:
    """The sandbox markers of the process registered in `registration`."""
    if not registration.exists():
        return []
    roots = json.loads(registration.read_text())["roots"]
    return [m for root in roots for m in (Path(root) / ".corral-owners").glob("*")]


def work_dirs(registration: Path) -> list[Path]:
    """The sandbox work directories under the roots registered in `registration`. A marker is
    written before its work directory, so a marker alone does not mean there is one yet."""
    if not marked(registration):
        return []
    roots = json.loads(registration.read_text())["roots"]
    return [p for root in roots for p in Path(root).iterdir() if not p.name.startswith(".")]


@pytest.mark.slow
def test_what_a_killed_corral_serve_left_is_removed_by_the_next_start(
    tmp_path: Path, backend_url: str
) -> None:
    if backend_url.startswith("postgresql"):
        pytest.skip("one backend is enough for the real engines and sandboxes")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    owners = tmp_path / "owners"
    env = {
        **os.environ,
        "CORRAL_DATABASE_URL": backend_url,
        "CORRAL_OPERATOR_TOKEN": TOKEN,
        "CORRAL_PORT": str(port),
        "CORRAL_DATA_DIR": str(tmp_path / "data"),
        "CORRAL_OWNERS_DIR": str(owners),
    }
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    spec = {"name": "local", "kind": "local", "config": make_local_config(), "batches": 50}
    with api, corral_serve(env, log) as first:
        wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
        assert api.post("/api/runs", json=spec).status_code < 300
        registration = owners / f"{first.pid}.json"
        wait_for(lambda: work_dirs(registration), 240, what=f"sandboxes of the local run; log: {log}")
        roots = [Path(r) for r in json.loads(registration.read_text())["roots"]]
        first.send_signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
    left = [p for root in roots for p in root.iterdir() if not p.name.startswith(".")]
    assert left, "no sandbox left behind to remove"

    with corral_serve(env, log) as second:
        wait_for(lambda: _healthy(url), 120, what="corral serve to restart")
        text = log.read_text()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) in (0, -signal.SIGTERM), log.read_text()[-2000:]
    assert f"removed what dead corral process {first.pid} left behind" in text, text[-2000:]
    assert [p for p in left if p.exists()] == []
    parent = pids_parent(CGROUP_ROOT)
    if parent is not None:
        assert [g.name for g in parent[0].iterdir() if g.name.endswith(f"-{first.pid}")] == []


def owned_by(client: Any, pid: int) -> list[str]:
    """The ids of the containers on `client`'s daemon labelled as this host's corral process `pid` labels
    its own. Listed in one call: `containers.list` inspects each container it lists after, and one that a
    run's cleanup removed meanwhile fails it."""
    host = socket.gethostname()
    return [
        c["Id"]
        for c in client.api.containers(all=True, filters={"label": leftovers.OWNER_LABEL})
        if c["Labels"][leftovers.OWNER_LABEL].split()[:2] == [host, str(pid)]
    ]


@pytest.mark.docker
@pytest.mark.slow
def test_the_containers_a_killed_corral_serve_left_are_removed_by_the_next_start(
    docker_client: Any, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = serve_env(tmp_path, f"sqlite:///{tmp_path / 'corral.db'}", port, base=docker_env(docker_client))
    env["CORRAL_OWNERS_DIR"] = str(tmp_path / "owners")
    log = tmp_path / "serve.log"
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    # A built-in task whose agent's commands busybox has (its validation needs python3: reward 0).
    config = {
        **make_local_config(),
        "tasks": {"suite": "builtin", "include": ["patch-config-sed"]},
        "sandbox": {"docker_image": docker_fixtures.TEST_IMAGE},
    }
    spec = {"name": "docker", "kind": "local", "config": config, "batches": 50}
    # A container of a live owner (this process): no sweep may touch it. Created, never started: a
    # sweep lists stopped containers too. Its attempt id is the fixture's to remove ("pytest-").
    live = docker_client.containers.create(
        docker_fixtures.TEST_IMAGE,
        ["sleep", "600"],
        name=f"corral-pytest-live-{uuid.uuid4().hex[:8]}",
        labels={
            leftovers.OWNER_LABEL: f"{socket.gethostname()} {leftovers.Owner.me()}",
            "corral.attempt": "pytest-live",
        },
        network_mode="none",
    )
    pids: list[int] = []
    try:
        with api, corral_serve(env, log) as first:
            pids.append(first.pid)
            wait_for(lambda: _healthy(url), 120, what=f"corral serve to start; log: {log}")
            assert api.post("/api/runs", json=spec).status_code < 300
            # Two at once, so that one is surely left however the kill falls in their cleanups.
            wait_for(
                lambda: len(owned_by(docker_client, first.pid)) >= 2,
                240,
                what=f"containers of the docker run; log: {log}",
                every_s=0.1,
            )
            first.send_signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
        left = owned_by(docker_client, first.pid)
        assert left, "no container left behind to remove"

        before = log.stat().st_size
        with corral_serve(env, log) as second:
            pids.append(second.pid)
            # The run is resumed: its docker factory reaches the daemon, and first removes the dead
            # server's containers.
            wait_for(
                lambda: owned_by(docker_client, first.pid) == [],
                120,
                what=f"the containers of dead corral serve {first.pid} to go; log: {log}",
                every_s=0.2,
            )
            wait_for(lambda: owned_by(docker_client, second.pid), 240, what=f"the resumed run; log: {log}")
            text = log.read_bytes()[before:].decode(errors="replace")
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) in (0, -signal.SIGTERM), log.read_text()[-2000:]
        found = re.search(r"removed what dead corral processes left behind: (\d+) containers?", text)
        assert found, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
        kept = docker_client.api.containers(all=True, filters={"id": live.id})
        assert kept, "the container of a live owner (this process) was removed"
    finally:
        for pid in pids:  # what a failed check or a stop that did not end the run left
            for container in owned_by(docker_client, pid):
                with contextlib.suppress(Exception):
                    docker_client.api.remove_container(container, force=True)
        with contextlib.suppress(Exception):
            live.remove(force=True)
