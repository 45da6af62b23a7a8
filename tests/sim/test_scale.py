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


def test_the_virtual_loop_counts_its_own_work() -> None:
    """`loop_stats` counts every timer given to the loop and every handle it dispatched: here each task's
    timer sets a future directly, so each of its steps is one timer and one wake-up."""
    import asyncio

    from app.sim.clock import run_virtual

    tasks, steps = 50, 7

    async def sleeper() -> None:
        loop = asyncio.get_running_loop()
        for step in range(steps):
            done = loop.create_future()
            loop.call_fast(loop.time() + 1 + step, lambda _token, done=done: done.set_result(None))  # type: ignore[attr-defined]
            await done

    async def main() -> None:
        async with asyncio.TaskGroup() as group:
            for _ in range(tasks):
                group.create_task(sleeper())

    stats: dict[str, int] = {}
    run_virtual(main(), loop_stats=stats)
    assert stats["timers"] == tasks * steps
    # each wake-up, plus each task's first step and its completion callback, and the main task's few
    assert tasks * steps + 2 * tasks <= stats["dispatched"] <= tasks * steps + 2 * tasks + 10


def test_the_loop_floor_charges_each_handle_or_timer_one_bare_cycle() -> None:
    scale = load_scale_benchmark()
    result = {"loop_dispatched_per_event": 4.0, "loop_timers_per_event": 2.5, "events": 1000, "wall_s": 0.1}
    floor = scale.loop_floor(result, 5e-6)  # 4 cycles of 5 µs an event: 20 ms for the run
    assert floor["loop_floor_events_per_s"] == 50_000.0
    assert floor["loop_floor_share_of_wall"] == 0.2
    assert 0 < scale.bare_loop_cycle_s(tasks=100, steps=5, repeat=1) < 1e-3
