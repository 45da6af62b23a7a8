"""`corral run` with docker sandboxes (`sandbox.docker_image`), as real processes against a real daemon
(the sandbox tests' private dockerd and busybox image): what it refuses before any work starts, and
that a run leaves no container behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import docker_fixtures
import pytest
from docker_fixtures import DaemonProxy, docker_env

docker_client = docker_fixtures.docker_client  # a fixture: the daemon that answers, or a private dockerd
TEST_IMAGE = docker_fixtures.TEST_IMAGE

CORRAL = Path(sys.executable).with_name("corral")


def write_suite(root: Path, actions: list[str], agent_s: float = 60) -> Path:
    """A suite of one task that the busybox image can run: each candidate action is a shell command."""
    task = root / "suite" / "busybox-task"
    task.mkdir(parents=True)
    (task / "seed.txt").write_text("x\n")
    quoted = "\n".join(f"  - {json.dumps(action)}" for action in actions)
    (task / "task.yaml").write_text(
        "instruction: write out.txt\nsetup: echo ready > ready.txt\n"
        "validation:\n  command: test -s out.txt\n"
        f"timeouts: {{setup_s: 30, agent_s: {agent_s}, validation_s: 15}}\n"
        f"max_turns: 4\ncandidate_actions:\n{quoted}\n"
    )
    return task.parent


def write_config(root: Path, suite: Path, image: str, **extra: Any) -> Path:
    config = {
        "seed": 3,
        "batch": {"groups": 1, "group_size": 2},
        "policy": {"surplus_groups": 1, "max_staleness": 2},
        "engines": {"count": 1, "cpus": [0], "slots": 4, "max_tokens": 16},
        "lanes": {"cpus": [1], "reset": 2, "exec": 4, "validate": 2, "cleanup": 2},
        "trainer": {"step_s": 0.5},
        "tasks": {"suite": str(suite)},
        "sandbox": {"docker_image": image},
        **extra,
    }
    path = root / "run.yaml"
    path.write_text(json.dumps(config))
    return path


def corral_run(
    config: Path, report: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CORRAL), "run", "--config", str(config), "--json", str(report), *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )


def assert_refused_in_one_line(proc: subprocess.CompletedProcess[str], needle: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert needle in errors[0], proc.stderr
    assert "engine" not in proc.stderr  # refused before any engine started


def test_no_daemon_is_refused_in_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, write_suite(tmp_path, ["echo x > out.txt"]), "busybox:latest")
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path / 'no-daemon.sock'}"}
    started = time.monotonic()
    proc = corral_run(config, tmp_path / "report.json", env)
    assert_refused_in_one_line(proc, f"no docker daemon answers at unix://{tmp_path / 'no-daemon.sock'}")
    assert time.monotonic() - started < 60
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("image", ["", " ", "a b"])
def test_a_malformed_image_name_is_refused(tmp_path: Path, image: str) -> None:
    config = write_config(tmp_path, write_suite(tmp_path, ["echo x > out.txt"]), image)
    proc = corral_run(config, tmp_path / "report.json", dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "sandbox.docker_image" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.docker
def test_an_image_the_daemon_lacks_is_refused_in_one_line(docker_client: Any, tmp_path: Path) -> None:
    config = write_config(tmp_path, write_suite(tmp_path, ["echo x > out.txt"]), "corral-sandbox:missing")
    proc = corral_run(config, tmp_path / "report.json", docker_env(docker_client))
    assert_refused_in_one_line(proc, "docker image 'corral-sandbox:missing' is not on the daemon")
    assert not (tmp_path / "report.json").exists()


def run_containers(client: Any) -> list[Any]:
    """Containers of `corral run`s (attempt ids `g<n>a<n>-...`), not of other tests on a shared daemon."""
    return [
        c
        for c in client.containers.list(all=True, filters={"label": "corral.attempt"})
        if c.labels.get("corral.attempt", "").startswith("g")
    ]


@pytest.mark.docker
@pytest.mark.slow
def test_a_docker_run_delivers_and_leaves_no_container(docker_client: Any, tmp_path: Path) -> None:
    suite = write_suite(tmp_path, ["echo x > out.txt", "cat ready.txt", "# done"])
    config = write_config(tmp_path, suite, TEST_IMAGE)
    report_path = tmp_path / "report.json"
    proc = corral_run(config, report_path, docker_env(docker_client), "--batches", "2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["batches"] == 2
    assert report["lost_groups"] == 0
    assert report["sandbox_isolation"] == "docker"
    assert report["discarded_groups"]["failed"] == 0
    assert run_containers(docker_client) == []


def test_ctrl_c_while_the_daemon_is_away_stops_at_once_and_the_next_start_removes_its_containers(
    docker_client: Any, tmp_path: Path
) -> None:
    # Before, each clean-up waited the daemon's 60 s for it to come back, a lane's slots' worth at a
    # time: a Ctrl-C with the daemon down took 121.8 s for 4 sandboxes on 2 clean-up slots.
    proxy = DaemonProxy(tmp_path / "proxy.sock", docker_client.api._custom_adapter.socket_path)
    proxy.up()
    try:
        suite = write_suite(tmp_path, ["sleep 20", "sleep 20"])
        config = write_config(tmp_path, suite, TEST_IMAGE)
        report_path = tmp_path / "report.json"
        env = {**os.environ, "DOCKER_HOST": f"unix://{proxy.path}"}
        argv = [str(CORRAL), "run", "--config", str(config), "--json", str(report_path), "--batches", "3"]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 120
            while len(run_containers(docker_client)) < 2:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "no containers started"
                time.sleep(0.2)
            time.sleep(1.0)  # tool calls under way
            proxy.down()
            time.sleep(1.0)
            began = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            _, err = proc.communicate(timeout=180)
            took = time.monotonic() - began
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert proc.returncode == 0, err
        assert took < 30, f"{took:.1f} s\n{err}"  # the engine's stop and the report, not the daemon's wait
        assert "Traceback" not in err
        report = json.loads(report_path.read_text())
        assert report["lost_groups"] == 0
        assert run_containers(docker_client)  # left behind: the daemon could not be asked to remove them

        proxy.up()  # the daemon is back: the next start removes what the stopped run left
        again = corral_run(config, tmp_path / "again.json", env, "--batches", "1")
        assert again.returncode == 0, again.stderr
        assert run_containers(docker_client) == []
    finally:  # its threads are not daemons: one left up would hold pytest's exit
        proxy.down()
