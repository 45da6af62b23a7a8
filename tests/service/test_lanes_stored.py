"""A run's lanes' CPU sets are stored as it starts executing, whoever watches it: they are in no event,
and a run that ended before a restart can only show what was stored."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.cpulist import format_cpu_list
from app.service.manager import RunManager
from app.service.schemas import RunCreate
from app.service.store import ServiceStore
from app.store.repos import LaneRepo


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_run_nobody_views_has_its_lane_cpu_sets_stored_for_after_a_restart(tmp_path: Path) -> None:
    # They were written only when a dashboard page read the run while it executed: a run driven by
    # the API alone showed "not recorded" for every lane's CPU set once the server had restarted.
    db = f"sqlite:///{tmp_path / 'corral.db'}"
    manager = RunManager(ServiceStore(db), tmp_path / "data", 30.0)
    try:
        spec = {"name": "unviewed", "kind": "sim", "speed": 5.0, "trainer": "sentinel", "policy": "full"}
        run_id = manager.create(RunCreate.model_validate(spec))
        handle = manager.get(run_id)
        assert handle is not None
        wait_for(lambda: handle.state.value == "running", 60, "the run to run")
        described = handle.runtime.lanes.describe()
    finally:
        manager.shutdown()

    expected = {
        name: (format_cpu_list(lane["cpus"]) if lane["cpus"] else "unpinned", lane["configured"])
        for name, lane in described.items()
    }
    assert set(expected) == {"reset", "exec", "validate", "cleanup"}
    assert all(cpus != "unpinned" for cpus, _ in expected.values())  # full pins its lanes
    restarted = ServiceStore(db)  # what a later server reads
    try:
        with restarted.session() as s:
            stored = {lane.name: (lane.cpus, lane.slots) for lane in LaneRepo(s).list(run_id)}
    finally:
        restarted.close()
    assert stored == expected
