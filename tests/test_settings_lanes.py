"""Settings of Celery lanes for `corral serve`: CORRAL_RESULT_BACKEND and CORRAL_LANE_HOSTS, checked with
the lanes' own helpers; a bad value is a one-line refusal naming the variable, exit code 2."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings

REDIS = "redis://127.0.0.1:6379/5"


def make_settings(**overrides: object) -> Settings:
    return Settings(operator_token="t" * 8, **overrides)  # type: ignore[arg-type]


def test_without_a_broker_lanes_are_in_process_and_need_nothing_else() -> None:
    settings = make_settings()
    assert (settings.broker_url, settings.result_backend, settings.lane_hosts) == (None, None, None)
    assert make_settings(broker_url="").broker_url is None  # empty is unset


def test_a_redis_broker_keeps_results_there_and_places_sandboxes_on_this_host() -> None:
    settings = make_settings(broker_url=REDIS)
    assert settings.result_backend == REDIS
    assert settings.lane_hosts == socket.gethostname()  # what `corral worker` calls this host


def test_named_hosts_and_backend_are_kept() -> None:
    settings = make_settings(broker_url=REDIS, result_backend="redis://127.0.0.1:6379/6", lane_hosts="a, b")
    assert settings.result_backend == "redis://127.0.0.1:6379/6"
    assert settings.lane_hosts == "a,b"


@pytest.mark.parametrize(
    ("overrides", "field", "needle"),
    [
        ({"broker_url": "http://127.0.0.1:6379"}, "broker_url", "CORRAL_BROKER_URL"),
        ({"broker_url": "amqp://guest@127.0.0.1//"}, "result_backend", "CORRAL_RESULT_BACKEND"),
        ({"broker_url": REDIS, "result_backend": "rpc://"}, "result_backend", "CORRAL_RESULT_BACKEND"),
        ({"broker_url": REDIS, "lane_hosts": "a b"}, "lane_hosts", "'a b'"),
        ({"broker_url": REDIS, "lane_hosts": "a,a"}, "lane_hosts", "named twice"),
    ],
)
def test_bad_lane_settings_name_the_field(overrides: dict[str, object], field: str, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        make_settings(**overrides)
    error = info.value.errors()[0]
    assert error["loc"] == (field,)
    assert needle in error["msg"]


def test_corral_serve_refuses_bad_lane_hosts_in_one_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "CORRAL_BROKER_URL": REDIS,
        "CORRAL_LANE_HOSTS": "node 1",
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp_path / 'c.db'}",
    }
    proc = subprocess.run(
        [sys.executable, "-c", "from app.cli import main; main()", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: CORRAL_LANE_HOSTS: ")
    assert "'node 1'" in lines[0]
    assert "Traceback" not in proc.stderr
