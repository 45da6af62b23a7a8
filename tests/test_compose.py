"""docker-compose.yml: `docker compose config` accepts it, with and without the `gpu` profile, and the
services keep the deployment's rules: one lane worker per lane, each pinned (`cpuset`) to the CPUs its
`--cpus` names, lane CPUs disjoint from each other and from the engine's, every Corral service on the
same broker and database."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cpulist import parse_cpu_list
from app.lanes.base import LaneName
from app.service.manager import SHUTDOWN_BOUND_S

REPO = Path(__file__).resolve().parents[1]
CORRAL_SERVICES = {"api", "orchestrator", "engine", *(f"worker-{lane.value}" for lane in LaneName)}


def compose_command() -> list[str]:
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy is not None:
        return [legacy]
    pytest.skip("neither `docker compose` nor `docker-compose` is installed (scripts/test-setup.sh adds it)")


@functools.cache
def compose_config(*profile: str) -> dict[str, Any]:
    done = subprocess.run(
        [*compose_command(), "-f", str(REPO / "docker-compose.yml"), *profile, "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},  # no CORRAL_* or VLLM_* from the test's env
    )
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_service_but_vllm_runs_without_a_gpu_profile() -> None:
    services = compose_config()["services"]
    # `docker compose config` leaves out inactive profiles; docker-compose 1.x lists them all.
    assert set(services) - {"vllm"} == {"postgres", "redis", *CORRAL_SERVICES}
    assert {name for name, service in services.items() if service.get("profiles")} <= {"vllm"}


def test_compose_config_with_the_gpu_profile_adds_vllm_with_a_gpu() -> None:
    services = compose_config("--profile", "gpu")["services"]
    assert set(services) == {"postgres", "redis", "vllm", *CORRAL_SERVICES}
    vllm = services["vllm"]
    assert vllm["profiles"] == ["gpu"]
    [device] = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_lane_workers_are_pinned_to_disjoint_cpus_apart_from_the_engine() -> None:
    services = compose_config()["services"]
    engine = services["engine"]
    engine_cpus = set(parse_cpu_list(engine["cpuset"]))
    assert engine_cpus == set(parse_cpu_list(flag(engine["command"], "--cpus")))
    taken = set(engine_cpus)
    for lane in LaneName:
        worker = services[f"worker-{lane.value}"]
        command = worker["command"]
        assert command[:2] == ["corral", "worker"]
        assert flag(command, "--lane") == lane.value
        cpus = set(parse_cpu_list(worker["cpuset"]))
        assert cpus == set(parse_cpu_list(flag(command, "--cpus")))  # the container and the pool agree
        assert not cpus & taken, f"{lane.value} shares CPUs"
        taken |= cpus
        assert flag(command, "--host") == services["api"]["environment"]["CORRAL_LANE_HOSTS"]
    assert services["orchestrator"]["command"][:3] == ["corral", "worker", "--orchestrator"]
    assert services["api"]["command"][:2] == ["corral", "serve"]


def test_every_corral_service_shares_one_broker_and_database() -> None:
    services = compose_config()["services"]
    envs = [services[name]["environment"] for name in CORRAL_SERVICES]
    for key in ("CORRAL_BROKER_URL", "CORRAL_RESULT_BACKEND", "CORRAL_DATABASE_URL"):
        assert len({env[key] for env in envs}) == 1, key
    assert envs[0]["CORRAL_BROKER_URL"].startswith("redis://redis:")
    assert envs[0]["CORRAL_DATABASE_URL"].startswith("postgresql+psycopg://")


def test_the_image_gets_every_front_end_file_the_server_serves() -> None:
    """The dashboard's htmx and the API docs' Swagger UI come from `node_modules` (npm ci): the build
    context lets in exactly those files and the Dockerfile copies them. The image used to have none, so
    the compose dashboard ran without htmx."""
    from app.api.docs import ASSETS, SWAGGER_UI
    from app.web.views import VENDOR

    served = sorted(
        {str(path.relative_to(REPO)) for path in VENDOR.values()}
        | {str((SWAGGER_UI / name).relative_to(REPO)) for name in ASSETS}
    )
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    let_in = sorted(line[1:] for line in ignore if line.startswith("!node_modules/"))
    assert let_in == served
    assert "node_modules" in ignore  # the rest of it stays out
    assert "COPY node_modules ./node_modules" in (REPO / "Dockerfile").read_text().splitlines()


def _seconds(period: str) -> float:
    """A compose duration (`3m`, `1m30s`, `90s`) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", period)
    assert parts, f"not a duration: {period!r}"
    assert "".join(n + u for n, u in parts) == period, f"not a duration: {period!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_docker_stop_waits_out_a_shutdown_that_stores_the_runs_last_events() -> None:
    """`docker stop` sends SIGKILL after the service's stop_grace_period (10 s unless set): a `corral
    serve` or an orchestrator worker then still storing a run's last events, the database away, lost
    them. Each Corral service waits at least the shutdown's own bound and its 10 s for open requests."""
    needed = SHUTDOWN_BOUND_S + 10
    services = compose_config()["services"]
    for name in CORRAL_SERVICES:
        period = services[name].get("stop_grace_period")
        assert period is not None, f"{name}: no stop_grace_period (docker's 10 s)"
        assert _seconds(str(period)) >= needed, f"{name}: {period}, the shutdown may take {needed:.0f} s"
