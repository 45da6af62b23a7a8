"""CeleryLanes without a broker: lane host names, and where sandboxes are placed (the fewest live
sandboxes first, ties in the given order; a sandbox keeps its host)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from app.lanes.base import LaneName
from app.lanes.celery import CeleryLanes, lane_queue, make_celery, parse_lane_hosts
from app.lanes.ops import LaneOpError
from app.sandboxes.local import LocalSandboxFactory


def make_lanes(*hosts: str) -> CeleryLanes:
    # Nothing here talks to the broker: attach and placement are local decisions.
    return CeleryLanes(make_celery("redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"), hosts)


def test_lane_hosts_parse_as_the_deployment_spells_them() -> None:
    assert parse_lane_hosts("node-1") == ("node-1",)
    assert parse_lane_hosts("node-1, node-2,gpu.box_3") == ("node-1", "node-2", "gpu.box_3")
    assert lane_queue("node-2", LaneName.EXEC) == "lane.node-2.exec"


@pytest.mark.parametrize(
    ("text", "needle"),
    [("", "''"), ("a,,b", "''"), ("a b", "'a b'"), ("a,a", "named twice"), ("-a", "'-a'"), ("x" * 64, "x")],
)
def test_bad_lane_hosts_are_refused_naming_the_host(text: str, needle: str) -> None:
    with pytest.raises(LaneOpError) as raised:
        parse_lane_hosts(text)
    assert needle in str(raised.value)


def test_constructor_refuses_no_hosts_duplicates_and_bad_names() -> None:
    for hosts, needle in [((), "at least one"), (("a", "a"), "duplicates"), (("a/b",), "'a/b'")]:
        with pytest.raises(LaneOpError, match=needle):
            make_lanes(*hosts)


def test_sandboxes_go_to_the_least_loaded_host_and_keep_it(tmp_path: Path) -> None:
    lanes = make_lanes("h1", "h2", "h3")
    factory = LocalSandboxFactory(tmp_path / "sb", isolation="none", uid_base=None)
    sandboxes = [factory.create(f"s{i}") for i in range(5)]
    handles = [lanes.attach(sb) for sb in sandboxes]
    assert [h.host for h in handles] == ["h1", "h2", "h3", "h1", "h2"]
    assert Counter(h.host for h in handles) == {"h1": 2, "h2": 2, "h3": 1}
    assert lanes.attach(sandboxes[2]).host == "h3"  # attached again: the same host
    lanes.close()
