"""Fixtures for sandbox tests: task specs, local sandbox factories, and a private dockerd.

The docker fixture uses a daemon that already answers (DOCKER_HOST or the default socket); otherwise it
starts its own `dockerd` (vfs storage, no iptables, no bridge) with its own data root, exec root and
socket under /tmp, and stops it at the end of the session. When no daemon can be had, docker tests skip
with the reason and the tail of dockerd's log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TEST_IMAGE = "corral-sandbox:test"


def _ping(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:
        return False


def _answers(sock: Path) -> bool:
    if not sock.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2)
        try:
            conn.connect(str(sock))
            conn.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b" 200 " in conn.recv(64)
        except OSError:
            return False


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    import docker
    import docker.errors

    # An existing daemon first; probed with a plain socket, since a failed DockerClient construction
    # leaks its connection.
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://") and _answers(Path(host.removeprefix("unix://"))):
        existing = docker.DockerClient(base_url=host, timeout=30)
        try:
            yield from _with_image(existing)
        finally:
            existing.close()
        return

    dockerd = shutil.which("dockerd")
    if dockerd is None:
        pytest.skip("dockerd not installed (scripts/test-setup.sh installs docker.io)")
    if os.geteuid() != 0:
        pytest.skip("no docker daemon answers and starting dockerd needs root")
    state = Path(tempfile.mkdtemp(prefix="corral-dockerd-", dir="/tmp"))
    sock = state / "docker.sock"
    log_path = state / "dockerd.log"
    cmd = [
        dockerd,
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--storage-driver=vfs",
        f"--data-root={state / 'data'}",
        f"--exec-root={state / 'exec'}",
        f"--pidfile={state / 'docker.pid'}",
        "-H",
        f"unix://{sock}",
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = None
    try:
        deadline = time.monotonic() + 30
        while client is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                pytest.skip(f"dockerd did not start (exit {proc.poll()}); log tail:\n{tail}")
            if _answers(sock):
                # The client asks the daemon for its API version on construction, so only build it
                # once the daemon answers.
                client = docker.DockerClient(base_url=f"unix://{sock}", timeout=30)
            if client is None:
                time.sleep(0.1)
        yield from _with_image(client, docker_host=f"unix://{sock}")
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(state, ignore_errors=True)


def _with_image(client: Any, docker_host: str | None = None) -> Iterator[Any]:
    import docker.errors

    try:
        client.images.get(TEST_IMAGE)
    except docker.errors.ImageNotFound:
        env = dict(os.environ)
        if docker_host:
            env["DOCKER_HOST"] = docker_host
        done = subprocess.run(
            ["bash", str(REPO / "scripts" / "docker-image.sh"), TEST_IMAGE],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot build {TEST_IMAGE}: {done.stderr.strip()[-1000:]}")
    try:
        yield client
    finally:
        # Only this suite's containers (attempt ids "pytest-..."), in case the daemon is a shared one.
        for container in client.containers.list(all=True, filters={"label": "corral.attempt"}):
            if not container.labels.get("corral.attempt", "").startswith("pytest-"):
                continue
            with contextlib.suppress(docker.errors.APIError):
                container.remove(force=True)
