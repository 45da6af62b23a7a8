"""choose_lanes: in-process lanes without a broker, Celery lanes on the named hosts with one."""

from __future__ import annotations

import pytest

from app.core.config import LanesConfig
from app.lanes.celery import CeleryLanes
from app.lanes.choose import choose_lanes
from app.lanes.inprocess import InProcessLanes
from app.lanes.ops import LaneOpError

REDIS = "redis://127.0.0.1:6379/0"


def make_config() -> LanesConfig:
    lane = {"slots": 1, "cpus": (1,)}
    return LanesConfig.model_validate(
        {"serving_cpus": (0,), "reset": lane, "exec": {"slots": 2, "cpus": (1,)}, "validate": lane,
         "cleanup": lane}
    )  # fmt: skip


def test_no_broker_means_in_process_lanes_with_the_runs_slots() -> None:
    lanes = choose_lanes(make_config(), pinned=True)
    assert isinstance(lanes, InProcessLanes)
    assert lanes.describe()["exec"] == {
        "slots": 2,
        "configured": 2,
        "cpus": (1,),
        "order": "fifo",
        "cpu_priority": False,  # a fifo lane's
    }


def test_a_broker_means_celery_lanes_on_the_named_hosts() -> None:
    lanes = choose_lanes(make_config(), True, REDIS, None, "node-1,node-2")
    assert isinstance(lanes, CeleryLanes)
    assert lanes.hosts == ("node-1", "node-2")
    lanes.close()


@pytest.mark.parametrize(
    ("backend", "hosts", "needle"),
    [
        (None, None, "CORRAL_LANE_HOSTS"),
        (None, "", "CORRAL_LANE_HOSTS"),
        ("rpc://", "node-1", "CORRAL_RESULT_BACKEND"),
        (None, "node 1", "'node 1'"),
    ],
)
def test_celery_lanes_need_hosts_and_a_redis_backend(
    backend: str | None, hosts: str | None, needle: str
) -> None:
    with pytest.raises(LaneOpError, match=needle):
        choose_lanes(make_config(), True, REDIS, backend, hosts)


def test_an_amqp_broker_needs_a_redis_backend() -> None:
    with pytest.raises(LaneOpError, match="CORRAL_RESULT_BACKEND"):
        choose_lanes(make_config(), True, "amqp://guest:guest@127.0.0.1:5672//", None, "node-1")
