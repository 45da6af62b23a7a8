"""A simulation frees what it made before it returns: sweeps and servers run many in one process."""

from __future__ import annotations

import gc

from app.sim.family import builtin_workload
from app.sim.run import policy_for, simulate


def test_a_simulation_leaves_no_cyclic_garbage_behind() -> None:
    workload = builtin_workload("default", batches=2)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(2):
        report = simulate(workload, policy_for(workload, "full"), "full")
        assert report["batches"] == 2
        # The run's runtime, loop and tasks are in cycles; left to the collector, tens of thousands
        # of objects (35,071 for this 2-batch `default` run) outlived each run.
        assert gc.collect() < 100
    assert len(gc.get_objects()) - before < 1_000


def test_one_simulation_keeps_no_draws_and_reports_what_a_cached_source_gives() -> None:
    """`corral sim` kept every attempt's drawn trajectory (about 1 MB a batch on `default`: 121 MB at
    60 batches, 180 MB at 120) though one policy never replays them; the draws are seeded, so drawing
    again gives the same report."""
    from app.sim import workload as sim_workload

    workload = builtin_workload("default", batches=3)
    original = sim_workload.TrajectorySource.__init__

    def spy(self: sim_workload.TrajectorySource, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        sources.append(self)

    sources: list[sim_workload.TrajectorySource] = []
    sim_workload.TrajectorySource.__init__ = spy  # type: ignore[method-assign]
    try:
        alone = simulate(workload, policy_for(workload, "full"), "full")
    finally:
        sim_workload.TrajectorySource.__init__ = original  # type: ignore[method-assign]
    assert len(sources) == 1
    assert sources[0]._cache == {}  # nothing kept
    cached = sim_workload.TrajectorySource(workload)
    shared = simulate(workload, policy_for(workload, "full"), "full", trajectories=cached)
    assert cached._cache  # the bench's way: every draw kept
    assert {k: v for k, v in alone.items() if k != "wall_s"} == {
        k: v for k, v in shared.items() if k != "wall_s"
    }
