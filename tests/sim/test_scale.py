"""Scale: the production runtime and scheduler keep B + S groups live with thousands of trajectories in
flight and lose no group. A smaller cut of benchmarks/scale.py (which runs 10,000 in flight)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest


def load_scale_benchmark() -> ModuleType:
    # benchmarks/ is not an installed package and pytest puts only the test's own folder on sys.path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scale.py"
    spec = importlib.util.spec_from_file_location("benchmarks_scale", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_thousands_of_trajectories_in_flight_lose_no_group() -> None:
    groups, group_size, surplus = 100, 8, 400
    result = load_scale_benchmark().run_scale(groups, group_size, surplus, batches=2)
    assert result["max_groups_in_flight"] == groups + surplus
    assert result["trajectories_in_flight"] == (groups + surplus) * group_size
    assert result["lost_groups"] == 0
    assert result["batches"] == 2
