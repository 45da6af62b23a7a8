"""Run the production runtime and scheduler on virtual time against a workload.

`simulate` builds the simulated ports for one policy and returns the report; `bench` runs the ablation
ladder and the sweeps on the same seeded draws.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

from app.core.config import AdmissionMode, PolicyConfig, PolicyName
from app.core.events import BatchDelivered, Envelope, Event, SandboxOp, TurnDone
from app.runtime.driver import RunCannotProceed, RunState, Runtime, cannot_proceed
from app.runtime.ports import Trainer
from app.runtime.report import ReportStatic, build_report
from app.runtime.timeline import GroupSpans
from app.sim.adapters import SimSource, SimTrainer
from app.sim.bound import admission_bound_s, lower_bound_s
from app.sim.clock import run_virtual
from app.sim.ports import build_ports, run_adapting
from app.sim.workload import TrajectorySource, Workload

Progress = Callable[[int], None]
P = ParamSpec("P")


def _freed_after(run: Callable[P, dict[str, Any]]) -> Callable[P, dict[str, Any]]:
    """Free a simulation's objects before its report is returned, and count that in its `wall_s`.

    A run's runtime, loop, tasks, timers and drawn trajectories hold one another in cycles (the bound
    methods a runtime hands its update plan and its event bus, for one), so only the cyclic collector
    frees them, and the raised GC threshold of a virtual-time run (app.sim.clock) kept it from doing so
    for a long time after: each 10,000-trajectory run of benchmarks/scale.py left about 164,000
    objects behind, and in one process the third run took 30% longer than the first and the process
    grew by 60 MB over five runs. A sweep (`corral bench`, `corral advise`) or a server running
    simulations one after another paid that."""

    @functools.wraps(run)
    def freed(*args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        wall = time.perf_counter()
        report = run(*args, **kwargs)
        gc.collect()
        report["wall_s"] = round(time.perf_counter() - wall, 3)
        return report

    return freed


# A simulation's failures are drawn from the workload (`p_infra_error`, faults) and counted in its report;
# one warning line per failed attempt buried the command's own output (948 lines for a run at
# `p_infra_error: 0.9`). Its runtime logs here, errors only; a real run's runtime in the same process
# keeps the driver's own logger as it is.
SIM_LOG = logging.getLogger("app.runtime.driver.simulated")
SIM_LOG.setLevel(logging.ERROR)


def policy_for(workload: Workload, name: str, **overrides: Any) -> PolicyConfig:
    return PolicyConfig.ladder(name, **{**workload.policy_settings(name), **overrides})


@_freed_after
def simulate(
    workload: Workload,
    policy: PolicyConfig,
    name: str,
    on_batch: Progress | None = None,
    trajectories: TrajectorySource | None = None,
    changes: Sequence[tuple[float, str, int]] = (),
    observer: Callable[[Runtime, Event], None] | None = None,
    timeline: bool = False,
    trainer: Trainer | None = None,
    events: Callable[[Envelope], None] | None = None,
    loop_stats: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Simulate `workload.batches` trainer steps under `policy`; return the run report.

    `changes` are live retunes at virtual times: (t, "surplus_groups" | "max_staleness", value).
    `observer` sees every event of the run's typed stream with the runtime, as published, for invariant
    checks; `events` gets every envelope of that stream; `loop_stats` gets the virtual loop's own
    work (`run_virtual`).
    """
    wall = time.perf_counter()
    # One policy replays no draw: only each group's duration is kept, for the bound
    source = trajectories or TrajectorySource(workload, cache=False, durations=True)
    ports = build_ports(workload, policy)
    engines, lanes, lane_cpus = ports.engines, ports.lanes, ports.lane_cpus

    runtime = Runtime(
        policy=policy,
        engines=engines,
        engine_slots=workload.engines.slots,
        lanes=lanes,
        source=(sim_source := SimSource(source, lane_cpus)),
        trainer=trainer or SimTrainer(workload.trainer.step_s),
        timeline=timeline,
        logger=SIM_LOG,
    )
    spans = GroupSpans()
    runtime.bus.subscribe(spans.on_envelope, GroupSpans.BY_TYPE)
    if on_batch is not None:
        batch_progress = on_batch

        def on_envelope(env: Envelope) -> None:
            if isinstance(env.event, BatchDelivered):
                batch_progress(env.event.batch_index + 1)

        runtime.bus.subscribe(on_envelope, {TurnDone: None, SandboxOp: None})  # skip the frequent kinds
    if observer is not None:
        watch = observer
        runtime.bus.subscribe(lambda env: watch(runtime, env.event))
    if events is not None:
        runtime.bus.subscribe(events)

    async def main() -> RunState:
        loop = asyncio.get_running_loop()
        setters = {"surplus_groups": runtime.set_surplus, "max_staleness": runtime.set_max_staleness}
        for at, knob, value in changes:
            if knob not in setters:
                raise ValueError(f"unknown live change {knob!r}; use surplus_groups or max_staleness")
            loop.call_at(at, setters[knob], value)
        return await run_adapting(runtime, ports, workload.batches)

    state = run_virtual(main(), loop_stats=loop_stats)
    durations = [source.group_duration(task) for task, _, _, _ in spans]
    most_live = policy.groups_per_batch + max(
        [policy.surplus_groups] + [v for _, k, v in changes if k == "surplus_groups"]
    )
    work = None
    if policy.admission is AdmissionMode.ATTEMPTS:  # B + S caps attempts, so more groups can be live
        work = [source.group_attempt_work(task) for task, _, _, _ in spans]
    bound = lower_bound_s(
        durations,
        len(state.batches),
        policy.groups_per_batch,
        most_live,
        workload.trainer.step_s,
        attempt_work=work,
        max_attempts=most_live * policy.group_size,
    )
    given = admission_bound_s(
        [b.requested_at for b in state.batches],
        [
            (admitted, d, ended, batch)
            for (_, admitted, ended, batch), d in zip(spans, durations, strict=True)
        ],
        policy.groups_per_batch,
    )
    static = ReportStatic(
        name, time.perf_counter() - wall, bound, {"lower_bound_given_admissions_s": round(given, 6)}
    )
    report = build_report(runtime.report_acc, static)
    report.update(ports.lane_report())
    report.update(runtime.gate_report())
    played, cut = sim_source.tally
    report["attempts_played"] = played
    report["attempts_cut_short"] = cut
    if trajectories is None:
        # Its draws, one per attempt, are ours alone: freed now by reference counting rather than by
        # the collection that ends the run (`_freed_after`), which would walk each of them first.
        source.clear()
    return report


LADDER = [PolicyName.SYNC, PolicyName.COMPLETION, PolicyName.LANES, PolicyName.FULL]


def simulate_unless_stopped(
    workload: Workload, policy: PolicyConfig, name: str, trajectories: TrajectorySource | None = None
) -> dict[str, Any] | RunCannotProceed:
    """`simulate`'s report, or the `RunCannotProceed` that stopped the run because it could fill no batch
    (every group failing, or, for trainable batches, none with a learning signal): for a sweep that is
    an outcome of its settings (`app.sim.family.simulated_row`, `app.sim.advise.evaluate`), not an
    error that ends the sweep."""
    try:
        return simulate(workload, policy, name, trajectories=trajectories)
    except Exception as exc:
        cause = cannot_proceed(exc)
        if cause is None:
            raise
        return cause
