"""The runtime's typed event stream and the accounts folded from it: lost groups seen independently of
the scheduler, groups that cannot start, wasted time counted once, reports rebuilt from stored events.

The runtime runs on the simulator's virtual clock with scripted attempts, so every time below is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from factories import make_workload_data

from app.core.config import PolicyConfig
from app.core.events import (
    AttemptStarted,
    Envelope,
    Event,
    GroupDelivered,
    GroupDiscarded,
    Ledger,
    RunEnded,
    SandboxOp,
    TurnDone,
    envelope_from_dict,
)
from app.core.scheduler import DiscardReason, GroupRecord, GroupState, Scheduler
from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.lanes.base import LaneName
from app.lanes.inprocess import InProcessLanes
from app.runtime.context import AttemptContext, AttemptOutcome
from app.runtime.driver import RunCannotProceed, Runtime
from app.runtime.events import EventBus
from app.runtime.ports import TrainingBatch
from app.runtime.report import ReportStatic, build_report, report_from_events, static_of
from app.sandboxes.base import ExecResult
from app.sim.clock import run_virtual
from app.sim.run import policy_for, simulate
from app.sim.workload import Workload
from app.tasks.spec import TaskSpec


class FakeEngine:
    """Turns take `meta["s"]` seconds; the version is read when the turn ends. `bump` makes the first
    turn report a version the trainer has not published."""

    def __init__(self, name: str = "engine-0", bump: bool = False) -> None:
        self.name = name
        self.version = 0
        self.bump = bump

    async def generate(self, request: TurnRequest) -> TurnResult:
        await asyncio.sleep(float(request.meta["s"]))
        version = self.version + 1 if self.bump else self.version
        self.bump = False
        return TurnResult(text="", weight_version=version, tokens=10)

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def publish_weights(self, version: int, path: str | None) -> None:
        self.version = version

    async def weight_version(self) -> int:
        return self.version

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


class NullSandbox:
    async def reset(self, task: TaskSpec, cpus: Any = None) -> ExecResult:
        return ExecResult(0, "")

    async def exec(self, command: str, timeout_s: float, cpus: Any = None) -> ExecResult:
        return ExecResult(0, "")

    async def validate(self, cpus: Any = None) -> float:
        return 1.0

    async def cleanup(self, cpus: Any = None) -> None:
        return None


@dataclass(frozen=True)
class Try:
    """One try of an attempt: a turn of `turn_s`, or a failure after `fail_after_s`."""

    turn_s: float = 50.0
    fail_after_s: float | None = None


class ScriptedAgent:
    def __init__(self, script: Try, reward: float) -> None:
        self.script = script
        self.reward = reward

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        if self.script.fail_after_s is not None:
            await asyncio.sleep(self.script.fail_after_s)
            raise RuntimeError("sandbox died")
        await ctx.generate(TurnRequest(prompt="", meta={"s": self.script.turn_s}))
        return AttemptOutcome(reward=self.reward, turns=1)


class ScriptedSource:
    """Attempt (group, index, try number) plays `scripts[...]` or `default`; attempts in `unmakeable`
    fail to be made. Rewards alternate 1, 0 within a group, so every group is trainable."""

    def __init__(
        self,
        scripts: dict[tuple[int, int, int], Try] | None = None,
        default: Try = Try(),
        unmakeable: set[tuple[int, int]] | None = None,
    ) -> None:
        self.scripts = scripts or {}
        self.default = default
        self.unmakeable = unmakeable or set()
        self.tries: Counter[tuple[int, int]] = Counter()

    def make_attempt(self, group_id: int, task_index: int, attempt: int) -> tuple[Any, Any, Any]:
        if (group_id, attempt) in self.unmakeable or (-1, -1) in self.unmakeable:
            raise OSError("no sandbox left")
        n = self.tries[group_id, attempt]
        self.tries[group_id, attempt] += 1
        script = self.scripts.get((group_id, attempt, n), self.default)
        return ScriptedAgent(script, float(1 - attempt % 2)), None, NullSandbox()

    def stopping(self) -> None:
        pass


class SleepTrainer:
    def __init__(self, step_s: float = 1.0) -> None:
        self.step_s = step_s

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        await asyncio.sleep(self.step_s)
        return None


def make_policy(**overrides: Any) -> PolicyConfig:
    base: dict[str, Any] = {
        "groups_per_batch": 1,
        "group_size": 2,
        "surplus_groups": 1,
        "max_staleness": 0,
        "pinned_lanes": False,
    }
    return PolicyConfig.model_validate({**base, **overrides})


def make_runtime(
    source: ScriptedSource,
    bus: EventBus | None = None,
    engine: FakeEngine | None = None,
    timeline: bool = False,
    **policy: Any,
) -> Runtime:
    lanes = InProcessLanes(dict.fromkeys(LaneName, 64), dict.fromkeys(LaneName), pinned=False)
    return Runtime(
        policy=make_policy(**policy),
        engines=[engine or FakeEngine()],
        engine_slots=8,
        lanes=lanes,
        source=source,
        trainer=SleepTrainer(),
        bus=bus,
        timeline=timeline,
    )


def run_report(runtime: Runtime, batches: int) -> dict[str, Any]:
    run_virtual(runtime.run(batches=batches))
    return build_report(runtime.report_acc, ReportStatic("test"))


def capture(runtime: Runtime) -> list[Envelope]:
    envelopes: list[Envelope] = []
    runtime.bus.subscribe(envelopes.append)
    return envelopes


# -- wasted time -----------------------------------------------------------------------------------


def test_wasted_time_counts_each_second_once() -> None:
    """Stop-the-world updates (B=1, S=1, G=2, trainer steps of 1 s), worked out by hand:

    t=0   groups 0 and 1 start; group 0's attempts take 2 s, everything else 50 s unless scripted
    t=2   group 0 is delivered (batch 0); group 2 starts
    t=3   version 1: the tries of groups 1 (3 s each) and 2 (1 s each) are restarted: 8 s thrown away
    t=4   group 2's second tries (1 s turns) finish: batch 1; group 3 starts
    t=4.5 group 1's attempt 0 fails 1.5 s into its second try; its sibling is cancelled: 3 s failed
    t=5   version 2: groups 3 (1 s each) and 4 (0.5 s each) restarted: 3 s; the run ends, both cancelled
          with tries 0 s old.
    Restarted 6 + 2 + 2 + 1 = 11 s; failed 3 s (not 9 s: the restarted 6 s are not counted again).
    """
    scripts = {
        (0, 0, 0): Try(turn_s=2.0),
        (0, 1, 0): Try(turn_s=2.0),
        (2, 0, 1): Try(turn_s=1.0),
        (2, 1, 1): Try(turn_s=1.0),
        (1, 0, 1): Try(fail_after_s=1.5),
    }
    runtime = make_runtime(ScriptedSource(scripts), rolling_updates=False, timeline=True)
    report = run_report(runtime, batches=2)
    assert report["batches"] == 2
    assert report["restarted_trajectories"] == 8
    assert report["wasted_trajectory_s"] == {
        "stale": 0.0,
        "failed": 3.0,
        "cancelled": 0.0,
        "zero_variance": 0.0,
        "restarted": 11.0,
    }
    assert report["discarded_groups"] == {"stale": 0, "failed": 1, "cancelled": 2, "zero_variance": 0}
    # The failed attempt's error text is kept: in the report and in the group's timeline row.
    assert report["discard_details"]["failed"] == {"RuntimeError: sandbox died": 1}
    row = next(r for r in report["groups_timeline"] if r["group"] == 1)
    assert (row["outcome"], row["detail"], row["ended_s"]) == ("failed", "RuntimeError: sandbox died", 4.5)
    assert report["lost_groups"] == 0


# -- lost groups, seen from the stream alone --------------------------------------------------------


class DroppingBus(EventBus):
    """Loses the first terminal event of `group_id` before it is numbered (no sequence gap shows)."""

    def __init__(self, group_id: int) -> None:
        super().__init__("run-lossy")
        self.group_id = group_id
        self.dropped = 0

    def publish(self, event: Event) -> Envelope:
        terminal = isinstance(event, GroupDelivered | GroupDiscarded)
        if terminal and event.group_id == self.group_id and not self.dropped:  # type: ignore[attr-defined]
            self.dropped += 1
            return Envelope(self.run_id, -1, 0.0, event)
        return super().publish(event)


def test_lost_groups_counts_a_group_whose_terminal_event_never_arrived() -> None:
    source = ScriptedSource(default=Try(turn_s=2.0))
    runtime = make_runtime(source, bus=DroppingBus(group_id=0))
    report = run_report(runtime, batches=2)
    counters = runtime.scheduler.counters
    # The scheduler's own counters balance: they cannot see the loss.
    assert counters.admitted == counters.delivered + sum(counters.discarded.values())
    assert report["lost_groups"] == 1
    assert report["event_stream"]["gaps"] == 0


class ForgetfulScheduler(Scheduler):
    """Ends group 1 without telling anyone (the bug an independent ledger exists to catch)."""

    def _end(
        self, group: GroupRecord, state: GroupState, now: float, reason: DiscardReason | None, detail: str
    ) -> None:
        super()._end(group, state, now, reason, detail)
        if group.id == 1:
            self._outbox.pop()


def test_lost_groups_catches_a_scheduler_that_forgets_a_group() -> None:
    runtime = make_runtime(ScriptedSource(default=Try(turn_s=2.0)))
    runtime.scheduler = ForgetfulScheduler(runtime.policy)
    report = run_report(runtime, batches=3)
    assert report["lost_groups"] == 1
    assert report["admitted_groups"] == runtime.scheduler.counters.admitted


# -- groups that cannot start -----------------------------------------------------------------------


def test_a_group_whose_attempt_cannot_be_made_fails_with_the_error_and_frees_its_slot() -> None:
    source = ScriptedSource(default=Try(turn_s=2.0), unmakeable={(1, 1)})
    runtime = make_runtime(source)
    envelopes = capture(runtime)
    report = run_report(runtime, batches=3)
    assert report["batches"] == 3
    assert report["discarded_groups"]["failed"] == 1
    assert report["discard_details"]["failed"] == {"could not start attempt 1: OSError: no sandbox left": 1}
    assert report["max_groups_in_flight"] <= 2  # B + S: the failed group held no slot
    assert report["lost_groups"] == 0
    assert not [e for e in envelopes if isinstance(e.event, AttemptStarted) and e.event.group_id == 1]


def test_a_start_failure_inside_generate_fails_only_that_group() -> None:
    """The first turn reports a version the trainer has not published: its group is refused inside
    `generate`, which admits group 2, whose attempts cannot be made. Neither error reaches an agent
    or the run; both groups fail with their reasons."""
    source = ScriptedSource(default=Try(turn_s=2.0), unmakeable={(2, 0)})
    runtime = make_runtime(source, engine=FakeEngine(bump=True))
    report = run_report(runtime, batches=2)
    assert report["batches"] == 2
    assert report["refused_turns"] == 1
    assert runtime.scheduler.counters.refused_turns == 1
    details = report["discard_details"]["failed"]
    assert details == {
        "turn by policy version 1, newer than the trainer's 0": 1,
        "could not start attempt 0: OSError: no sandbox left": 1,
    }
    assert report["lost_groups"] == 0
    assert report["max_groups_in_flight"] <= 2


def test_groups_that_all_fail_end_the_run_instead_of_admitting_forever() -> None:
    """Every attempt dies: before the limit existed the run admitted and failed groups for ever (a
    simulation with `p_infra_error: 1` never ended). Now it ends once max(100, 4·(B + S)) groups have
    failed in a row with none completed, naming the last failure."""
    runtime = make_runtime(ScriptedSource(default=Try(fail_after_s=1.0)))
    envelopes = capture(runtime)
    with pytest.raises(ExceptionGroup) as info:
        run_virtual(runtime.run(batches=1))
    assert info.group_contains(RunCannotProceed, match="101 groups in a row failed and none completed")
    assert info.group_contains(RunCannotProceed, match="last: RuntimeError: sandbox died")
    failed = [e for e in envelopes if isinstance(e.event, GroupDiscarded) and e.event.reason == "failed"]
    assert len(failed) >= 101  # the 101st ended it; a group failing at that instant may follow
    ledger = Ledger()
    for env in envelopes:
        ledger.on_envelope(env)
    assert ledger.lost == 0  # the groups live when it ended were closed, as cancelled
    assert ledger.discarded.get("cancelled", 0) >= 1
    end = envelopes[-1].event
    assert isinstance(end, RunEnded)
    assert end.reason == "error"


def test_a_failure_streak_is_reset_by_a_completed_group() -> None:
    """Failures that alternate with completed groups are a flaky source, not a dead one: the run goes
    on and delivers, with far more than the limit's worth of failed groups in total."""
    scripts = {(g, 0, 0): Try(fail_after_s=1.0) for g in range(0, 400) if g % 50}  # 1 in 50 completes
    runtime = make_runtime(ScriptedSource(scripts=scripts, default=Try(turn_s=1.0)))
    report = run_report(runtime, batches=6)
    assert report["batches"] == 6
    assert report["discarded_groups"]["failed"] > 101
    assert report["lost_groups"] == 0


def test_a_source_that_never_starts_ends_the_run_with_the_error() -> None:
    runtime = make_runtime(ScriptedSource(unmakeable={(-1, -1)}))
    envelopes = capture(runtime)
    with pytest.raises(ExceptionGroup) as info:
        run_virtual(runtime.run(batches=1))
    assert info.group_contains(RunCannotProceed, match="groups in a row could not start; last: could not")
    ledger = Ledger()
    for env in envelopes:
        ledger.on_envelope(env)
    assert ledger.lost == 0
    end = envelopes[-1].event
    assert isinstance(end, RunEnded)
    assert end.reason == "error"


# -- the report, rebuilt from stored events ------------------------------------------------------------


def test_report_rebuilt_from_stored_events_equals_the_runtimes() -> None:
    workload = Workload.model_validate(
        make_workload_data(batches=3, trajectory={"p_infra_error": 0.2}, policy={"max_staleness": 0})
    )
    envelopes: list[Envelope] = []
    report = simulate(
        workload, policy_for(workload, "lanes"), "lanes", timeline=True, events=envelopes.append
    )
    assert [e.seq for e in envelopes] == list(range(len(envelopes)))
    assert isinstance(envelopes[-1].event, RunEnded)
    stored = [json.dumps(e.to_dict(), allow_nan=False) for e in envelopes]  # strict JSON, as a store keeps
    static = static_of(report)  # wall time, the simulator's bounds and lane figures: not in the stream
    assert set(static.extra) >= {"lower_bound_given_admissions_s"}
    rebuilt = report_from_events([envelope_from_dict(json.loads(s)) for s in stored], static, timeline=True)
    assert rebuilt == report
    # The stream really carries the run: the figures agree with what the scheduler counted itself.
    assert report["batches"] == 3
    assert report["event_stream"]["events"] == len(envelopes)
    assert report["lost_groups"] == 0
    assert sum(report["discarded_groups"].values()) + report["delivered_groups"] == report["admitted_groups"]
    assert len(report["groups_timeline"]) == report["admitted_groups"]


def test_every_kind_of_state_change_is_published() -> None:
    workload = Workload.model_validate(
        make_workload_data(batches=3, trajectory={"p_infra_error": 0.2}, policy={"max_staleness": 0})
    )
    kinds: Counter[str] = Counter()
    simulate(
        workload,
        policy_for(workload, "full", filter_zero_variance=True),
        "full",
        changes=[(5.0, "surplus_groups", 3)],
        events=lambda env: kinds.update([env.kind]),
    )
    expected = {
        "run_started",
        "group_admitted",
        "attempt_started",
        "turn",
        "sandbox_op",
        "attempt_finished",
        "group_ready",
        "batch_requested",
        "group_delivered",
        "batch_delivered",
        "version_published",
        "engine_update_begin",
        "engine_update_end",
        "policy_changed",
        "group_discarded",
        "run_ended",
    }
    assert expected <= set(kinds)
    assert kinds["run_started"] == kinds["run_ended"] == 1


class SlowSink:
    """A store that takes 50 ms a batch, with a buffer far too small for the run."""

    def __init__(self) -> None:
        self.written = 0

    def write_batch(self, envelopes: Sequence[Envelope]) -> None:
        time.sleep(0.05)
        self.written += len(envelopes)


def test_a_slow_sink_loses_events_to_itself_only_and_the_report_says_how_many() -> None:
    bus = EventBus("run-slow")
    sink = SlowSink()
    bus.add_sink(sink, name="store", batch_size=4, flush_interval_s=0.01, capacity=8)
    runtime = make_runtime(ScriptedSource(default=Try(turn_s=2.0)), bus=bus)
    run_virtual(runtime.run(batches=5))
    bus.close()
    report = build_report(runtime.report_acc, ReportStatic("test"), bus)
    stats = report["event_sinks"]["store"]
    assert stats["dropped"] > 0  # the run never waited for the sink
    assert stats["written"] == sink.written
    assert stats["written"] + stats["dropped"] + stats["failed"] + stats["unflushed"] == bus.published
    # The run's own accounts, folded synchronously, are whole.
    assert report["batches"] == 5
    assert report["lost_groups"] == 0
    assert report["event_stream"]["events"] == bus.published


def test_the_runtimes_memory_follows_the_groups_in_flight_not_the_run_history() -> None:
    workload = Workload.model_validate(
        make_workload_data(batches=30, trajectory={"p_infra_error": 0.1}, policy={"max_staleness": 1})
    )
    policy = policy_for(workload, "full")
    live_cap = policy.groups_per_batch + policy.surplus_groups
    sizes: list[tuple[int, ...]] = []
    captured: dict[str, Runtime] = {}

    def observe(runtime: Runtime, event: Event) -> None:
        captured["rt"] = runtime
        acc = runtime.report_acc
        sizes.append(
            (
                len(runtime.scheduler.groups),
                len(runtime._group_tasks),
                len(runtime._outcomes),
                len(acc._group_s),
                len(acc._rows),
                len(acc.ledger.open_groups),
            )
        )
        assert len(runtime._attempts) <= live_cap * policy.group_size
        assert len(acc._tries) <= live_cap * policy.group_size

    report = simulate(workload, policy, "full", observer=observe)
    assert report["admitted_groups"] > 10 * live_cap  # a history much longer than what is in flight
    # B + S live groups, plus the batch's B groups whose outcomes wait for the trainer's step.
    assert max(max(s) for s in sizes) <= live_cap + policy.groups_per_batch
    rt = captured["rt"]
    assert rt.scheduler.groups == rt._group_tasks == rt._attempts == rt._outcomes == {}
    assert rt.report_acc._tries == rt.report_acc._group_s == {}


def test_a_sandbox_gets_one_cleanup_exactly_when_an_op_started_on_it() -> None:
    """Attempts cancelled while their reset still queued (the run ended, or a stale group) leave nothing
    behind, so no cleanup op is queued for them; every sandbox on which an op started gets exactly one.
    Counted from the run's own SandboxOp events (`busy` is 0 for an op cancelled before it started)."""
    workload = Workload.model_validate(
        make_workload_data(
            batches=3,
            policy={"surplus_groups": 12, "max_staleness": 0},
            lanes={"reset": 1, "exec": 4, "validate": 2, "cleanup": 2},
        )
    )
    ops: dict[tuple[int, int], list[SandboxOp]] = {}

    def on_envelope(env: Envelope) -> None:
        if isinstance(env.event, SandboxOp):
            ops.setdefault((env.event.group_id, env.event.attempt), []).append(env.event)

    # fixed lane slots, so resets queue; rolling updates, so no try restarts under another sandbox
    simulate(workload, policy_for(workload, "full", adaptive_lanes=False), "full", events=on_envelope)
    started = {key for key, seen in ops.items() if any(op.lane != "cleanup" and op.busy > 0 for op in seen)}
    never = set(ops) - started
    cleaned = Counter(key for key, seen in ops.items() for op in seen if op.lane == "cleanup")
    assert never, "the workload should cancel some attempts while their reset queues"
    assert set(cleaned) == started
    assert set(cleaned.values()) == {1}


def test_an_observer_that_raises_on_every_turn_costs_the_run_nothing() -> None:
    """The dashboard's live view raising (a bug in it) failed every attempt that published a turn, until
    the run gave up; an observer's errors are now counted in the report, and the run is unchanged."""
    clean = make_runtime(ScriptedSource(default=Try(turn_s=2.0)))
    expected = run_report(clean, batches=3)

    def broken_view(env: Envelope) -> None:
        if isinstance(env.event, TurnDone):
            raise AttributeError("the view's bug")

    runtime = make_runtime(ScriptedSource(default=Try(turn_s=2.0)))
    runtime.bus.observe(broken_view, "live view")
    envelopes = capture(runtime)
    run_virtual(runtime.run(batches=3))
    report = build_report(runtime.report_acc, ReportStatic("test"), runtime.bus)
    turns = sum(isinstance(env.event, TurnDone) for env in envelopes)
    assert turns > 0
    assert report["event_observer_errors"] == {"live view": turns}
    assert report["batches"] == expected["batches"] == 3
    assert report["batch_collection_s"] == expected["batch_collection_s"]
    for key in ("delivered_groups", "discarded_groups", "turns", "lost_groups"):
        assert report[key] == expected[key], key
    assert report["discarded_groups"]["failed"] == 0


class _FailingResetSandbox(NullSandbox):
    async def reset(self, task: TaskSpec, cpus: Any = None) -> ExecResult:
        return ExecResult(1, "set-up failed")


class _GateAgent:
    """Resets (a ShellAgent stops there when the set-up failed), then holds its agent phase `hold_s`."""

    def __init__(self, hold_s: float, returned: dict[int, float], attempt: int) -> None:
        self.hold_s, self.returned, self.attempt = hold_s, returned, attempt

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        setup = await ctx.reset()
        self.returned[self.attempt] = asyncio.get_running_loop().time()
        if setup.exit_code != 0:
            return AttemptOutcome(reward=0.0, turns=0, error="set-up failed")
        await asyncio.sleep(self.hold_s)
        await ctx.validate()
        return AttemptOutcome(reward=float(self.attempt % 2), turns=1)


def test_a_failed_reset_does_not_wait_at_the_agent_gate() -> None:
    """An exec lane of one slot: the gate lets one attempt into its agent phase until a tool call has
    ended. Attempt 0 holds it 100 s; attempt 1, whose reset failed, gets its result at once instead of
    waiting for a place it will never use."""
    returned: dict[int, float] = {}

    class Source:
        def make_attempt(self, group_id: int, task_index: int, attempt: int) -> tuple[Any, Any, Any]:
            task = TaskSpec(name="t", instruction="", root=Path("."), validation="true")
            sandbox = _FailingResetSandbox() if attempt == 1 else NullSandbox()
            return _GateAgent(100.0, returned, attempt), task, sandbox

        def stopping(self) -> None:
            pass

    lanes = InProcessLanes({**dict.fromkeys(LaneName, 64), LaneName.EXEC: 1}, dict.fromkeys(LaneName))
    runtime = Runtime(
        policy=make_policy(surplus_groups=0, agent_gate=1.0),
        engines=[FakeEngine()],
        engine_slots=8,
        lanes=lanes,
        source=Source(),
        trainer=SleepTrainer(),
    )
    assert runtime.gate is not None

    async def main() -> None:
        task = asyncio.create_task(runtime.run(batches=1))
        await asyncio.sleep(10)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, BaseExceptionGroup):
            await task

    run_virtual(main())
    assert returned[1] < 1.0  # not after attempt 0's 100 s
    assert runtime.gate.report()["waited"] == 0
