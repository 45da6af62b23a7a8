"""Lanes that borrow serving CPUs yield to serving there, on this machine's real cgroups: a spinning
"engine" in the serving group and a spinning tool call in a lane group on the same CPU."""

import pytest
from test_cpushare import measure, spin, stop

from app.core.config import LanesConfig
from app.sandboxes import cpushare

pytestmark = pytest.mark.skipif(
    cpushare.share_method() is None, reason="no writable cpu cgroup controller on this host"
)


def serving_share(borrowing: bool) -> float:
    assert cpushare.set_lanes_priority(borrowing) is not None
    lane = cpushare.prepare_share("test-exec", 400)
    procs = {"serving": [spin(None)], "lane": [spin(lane), spin(lane)]}
    try:
        got = measure(procs)
    finally:
        stop(procs)
    return got["serving"] / (got["serving"] + got["lane"])


def test_borrowing_lanes_leave_a_busy_serving_cpu_to_serving():
    try:
        borrowing = serving_share(True)
        equal = serving_share(False)
    finally:
        cpushare.set_lanes_priority(False)
    # At the default weight the lane group and the serving thread split the CPU about evenly; at the
    # borrowing weight serving keeps nearly all of it.
    assert borrowing > 0.85, (borrowing, equal)
    assert equal < 0.7, (borrowing, equal)


def test_the_lanes_weight_is_read_back_from_the_kernel():
    try:
        assert cpushare.set_lanes_priority(True) in {
            cpushare.BORROWING_SHARES_V1,
            cpushare.BORROWING_WEIGHT_V2,
        }
    finally:
        assert cpushare.set_lanes_priority(False) in {cpushare.DEFAULT_SHARES_V1, cpushare.DEFAULT_WEIGHT_V2}


def lanes(cpus: tuple[int, ...], borrow: bool) -> dict[str, object]:
    lane = {"slots": 1, "cpus": cpus}
    return {"reset": lane, "exec": lane, "validate": lane, "cleanup": lane, "serving_cpus": (0,),
            "borrow_serving_cpus": borrow}  # fmt: skip


def test_lanes_on_serving_cpus_are_refused_unless_they_borrow():
    with pytest.raises(ValueError, match=r"shares CPUs \[0\] with serving.*borrow_serving_cpus"):
        LanesConfig.model_validate(lanes((0, 1), borrow=False))
    assert LanesConfig.model_validate(lanes((0, 1), borrow=True)).borrow_serving_cpus
    assert not LanesConfig.model_validate(lanes((1,), borrow=False)).borrow_serving_cpus
