"""`sandbox_factory`: the one place where a run config becomes local sandboxes, for `corral run` and for
a `corral serve` local run alike. (A service run used to build its own factory, without the lanes'
low weight on borrowed serving CPUs and without the config's time limits.) The weights are read back
from the kernel's cpu cgroups, where this machine has them writable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.core.config import PolicyConfig
from app.runtime.config import LocalRunConfig
from app.runtime.local import sandbox_factory
from app.sandboxes import cpushare
from app.sandboxes.limits import ENV_UID_CLAIMS
from app.sandboxes.timelimits import TimeLimits

PINNED = PolicyConfig(groups_per_batch=2, group_size=2, pinned_lanes=True)
SHARED = PolicyConfig(groups_per_batch=2, group_size=2, pinned_lanes=False)
WEIGHTS = {"reset": 300, "exec": 300, "validate": 120, "cleanup": 60}


def run_config(**lanes: Any) -> LocalRunConfig:
    sandbox = lanes.pop("sandbox", {})
    return LocalRunConfig.model_validate(
        {
            "engines": {"cpus": [0]},
            "lanes": {"cpus": [1], **lanes},
            "sandbox": {"isolation": "none", **sandbox},
        }
    )


needs_cpu_cgroup = pytest.mark.skipif(cpushare.share_method() is None, reason="no writable cpu cgroup here")


@needs_cpu_cgroup
def test_the_configured_lane_weights_reach_the_kernel(base_dir: Path) -> None:
    factory = sandbox_factory(run_config(borrow_serving_cpus=True, weights=WEIGHTS), PINNED, base_dir / "sb")
    try:
        assert {lane: cpushare.read_weight(p) for lane, p in factory.lane_shares.items()} == WEIGHTS
        # The lanes borrow the serving CPU, so together they yield to serving there.
        assert factory.lanes_weight in {cpushare.BORROWING_SHARES_V1, cpushare.BORROWING_WEIGHT_V2}
    finally:
        cpushare.set_lanes_priority(False)
    default = sandbox_factory(run_config(), PINNED, base_dir / "sb2")
    assert {lane: cpushare.read_weight(p) for lane, p in default.lane_shares.items()} == (
        cpushare.DEFAULT_LANE_WEIGHTS
    )
    assert default.lanes_weight in {cpushare.DEFAULT_SHARES_V1, cpushare.DEFAULT_WEIGHT_V2}


def test_unpinned_policies_get_no_lane_groups(base_dir: Path) -> None:
    factory = sandbox_factory(run_config(borrow_serving_cpus=True, weights=WEIGHTS), SHARED, base_dir / "sb")
    assert factory.lane_shares == {}
    assert factory.lanes_weight is None


def test_the_configured_time_limits_reach_the_sandboxes(base_dir: Path) -> None:
    given = sandbox_factory(run_config(sandbox={"backstop": 4.0}), SHARED, base_dir / "a").time_limits
    assert given == TimeLimits(backstop=4.0)
    assert given.counts_given("reset")
    wall = sandbox_factory(run_config(sandbox={"time_limits": "wall"}), SHARED, base_dir / "b").time_limits
    assert wall == TimeLimits.wall()
    assert not wall.counts_given("reset")


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="sandbox uids are claimed only as root"
)
def test_an_unsafe_uid_claims_directory_is_refused_in_one_line_before_any_engine(base_dir: Path) -> None:
    """Claim files decide whose processes a cleanup kills, so a claims directory others can write is
    refused: `corral run` says so in one line, exit 2, with no traceback, no report and no engine."""
    unsafe = base_dir / "claims"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    report = base_dir / "out.json"
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from app.cli import main; main()",
            "run",
            "--batches",
            "1",
            "--json",
            str(report),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, ENV_UID_CLAIMS: str(unsafe)},
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"uid claims directory {unsafe}" in out.stderr
    assert "engine-0 ready" not in out.stderr
    assert not report.exists()
