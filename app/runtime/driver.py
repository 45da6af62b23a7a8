"""The runtime: an asyncio driver that feeds events to the core scheduler and carries out its decisions.

It runs unchanged under the real clock and under the simulator's virtual clock: time comes only from
the running loop, and every task it starts belongs to one TaskGroup.

Invariants:
- every attempt task ends exactly once: it reports done, or it is cancelled because its group was
  discarded, or it is restarted by a stop-the-world update (counted by the scheduler's `restarts`);
- every sandbox that an attempt created is cleaned up in the cleanup lane, whatever ended the attempt;
- a turn is routed only to an engine that is not updating and not down, and at most `slots` turns run
  per engine;
- under rolling updates no trajectory is restarted;
- engine faults (docs/faults.md): a turn whose engine fails is sent again to another engine (up to
  `turn_retries` times); the failed engine leaves routing at once, an update it runs is abandoned and
  the rolling update goes on; it is restarted (or waited for) with backoff and serves again only once
  it holds the newest published version; every engine step is bounded (`update_timeout_s`);
- an engine that refuses a version (a 4xx to its load: weights it cannot load) while it still answers
  its health check is not down: that update fails with the engine's reason, the engine resumes on the
  version it had and is not offered the refused one again (nor brought to it after a restart); a
  newer publication goes to it as usual. A bad checkpoint never costs an engine restart, nor the run;
  when every engine refused the newest version and is more than K behind it, no turn can run, and the
  run says so (a warning, once a version) rather than stall without a word;
- a publication the engines could not load (no weights path where they load weights from disk) is
  refused to its caller before anything changes: a bad command never costs the run;
- a stop, or the duration deadline, ends the trainer's wait and withdraws the batch request in the
  same step, so no batch is ever delivered that nobody waits for;
- every state change is published on the run's `EventBus` (app.runtime.events) as a typed event; the
  run report is folded from that stream (`report_acc`), and its `lost_groups` from a `Ledger` over it;
- a group whose attempts cannot be started (`make_attempt` raised) fails with the error as its
  reason: it holds no B + S slot and the run goes on;
- memory is O(groups in flight): what finished leaves the runtime's maps; history lives in the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from app.core.config import MAX_POLICY_VERSION, PolicyConfig, UpdatePacing
from app.core.events import (
    AgentGateWait,
    AttemptCancelled,
    AttemptFinished,
    AttemptRestarted,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Event,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    LaneResized,
    PolicyChanged,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
)
from app.core.rollout import BeginUpdate, RestartInFlight, UpdateAction, UpdatePlan
from app.core.scheduler import CancelGroup, Decision, DeliverBatch, DiscardReason, Scheduler, StartGroup
from app.engines.base import Engine, PauseMode, TurnRequest, TurnResult
from app.engines.errors import EngineError, EngineRequestError, TurnAborted
from app.lanes.adaptive import LaneAdapter
from app.lanes.base import LaneName, Lanes
from app.lanes.ops import LaneOp, SandboxHandle
from app.runtime.context import Agent, AttemptOutcome
from app.runtime.engine_pool import (
    EngineFaultConfig,
    EnginePool,
    EngineSupervisor,
    is_engine_fault,
    is_unreachable,
)
from app.runtime.events import EventBus
from app.runtime.gate import AgentGate
from app.runtime.ports import AttemptSource, Trainer, TrainingBatch
from app.runtime.report import ReportAccumulator
from app.sandboxes.base import ExecResult, Sandbox
from app.tasks.spec import TaskSpec

log = logging.getLogger(__name__)
# `extra` of a log record whose news also goes out as an event (an engine's state, a refusal): a reader
# that prints the events (`corral run`'s progress) filters such records out (`without_event_records`)
AS_EVENT = {"as_event": True}


def without_event_records(logger: logging.Logger) -> logging.Logger:
    """`logger`, given a filter that drops the records marked `AS_EVENT` (once, however often asked)."""
    if not any(f is _not_an_event for f in logger.filters):
        logger.addFilter(_not_an_event)
    return logger


def _not_an_event(record: logging.LogRecord) -> bool:
    return not getattr(record, "as_event", False)


AttemptKey = tuple[int, int]
T = TypeVar("T")
# How long a stopping run waits for weight updates under way before it abandons them (the engines are
# stopped by their owner). Left to `update_timeout_s`, a hung update held a Ctrl-C'd run for two minutes.
UPDATE_STOP_GRACE_S = 5.0
_LANE_VALUE = {lane: lane.value for lane in LaneName}  # `Enum.value` is a slow descriptor


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


@dataclass
class BatchRecord:
    index: int
    requested_at: float
    delivered_at: float
    ready_at: float
    trainer_version: int
    max_staleness: int
    mean_reward: float


@dataclass
class EngineRecord:
    turns: int = 0
    tokens: int = 0
    updates: int = 0
    busy_s: float = 0.0
    versions: list[tuple[float, int]] = field(default_factory=list)
    restarts: int = 0
    up_since: float = 0.0  # when it last came back; a failure soon after continues the backoff
    backoff_s: float = 0.0  # wait before its next restart
    crash_tries: int = 0  # restart tries since it last served a while; `max_restarts` caps them


@dataclass
class RunState:
    """What the runtime measured; the report is built from this and the scheduler's own accounts."""

    started_at: float = 0.0
    ended_at: float = 0.0
    batches: list[BatchRecord] = field(default_factory=list)
    engines: dict[str, EngineRecord] = field(default_factory=dict)
    max_engines_updating: int = 0
    update_log: list[tuple[float, str, int, str]] = field(default_factory=list)  # phase begin/end/failed
    update_failures: list[tuple[float, str, int, str]] = field(default_factory=list)  # why, per failed
    engine_events: list[tuple[float, str, str, str]] = field(default_factory=list)  # t, engine, state, detail
    turn_retries: int = 0  # turns sent again after an engine failed under them
    all_down_s: float = 0.0  # time with every engine down (turns waited for a restart)
    given_up: dict[str, str] = field(default_factory=dict)  # engines no longer restarted, and why
    trainer_wait_s: float = 0.0
    error: str | None = None  # why the run ended early, when it could not go on (RunCannotProceed)


class RunCannotProceed(RuntimeError):
    """Groups keep failing and none completes (`Runtime._failure_limit` in a row): no batch can be
    filled, so the run ends instead of admitting and failing groups forever."""


def cannot_proceed(exc: BaseException) -> RunCannotProceed | None:
    """The `RunCannotProceed` that ended a run, found inside the task groups' exception groups."""
    if isinstance(exc, RunCannotProceed):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = cannot_proceed(inner)
            if found is not None:
                return found
    return None


def failure_detail(exc: BaseException) -> str:
    """What ended a failed run, in words: the errors inside the task groups' exception groups, each once
    (a run's error read "ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)")."""
    if not isinstance(exc, BaseExceptionGroup):
        return f"{type(exc).__name__}: {exc}"
    return "; ".join(dict.fromkeys(failure_detail(inner) for inner in exc.exceptions))


class EngineTurnFailed(RuntimeError):
    """A turn met more engine failures than `EngineFaultConfig.turn_retries` allows."""


class EngineStoppedAnswering(Exception):
    """An engine in the middle of a weight update failed its health check: it is down, whatever its
    update was waiting for."""


class _AttemptContext:
    """The agent's window onto the runtime for one attempt (see app.runtime.context)."""

    __slots__ = ("_key", "_rt", "attempt_id", "handle", "sandbox", "task")  # one per attempt

    def __init__(self, runtime: Runtime, key: AttemptKey, task: TaskSpec | None, sandbox: Sandbox) -> None:
        self._rt = runtime
        self._key = key
        self.attempt_id = f"g{key[0]}a{key[1]}"
        self.task = task
        self.sandbox = sandbox
        self.handle = runtime.lanes.attach(sandbox)

    def now(self) -> float:
        return self._rt.now()

    # Plain functions returning the runtime's coroutine, awaited at once by the agent: the same calls as
    # `async def` wrappers, without a coroutine frame of their own on every turn and sandbox operation.

    def generate(self, request: TurnRequest) -> Coroutine[Any, Any, TurnResult]:
        return self._rt.generate(self._key, request)

    def reset(self) -> Coroutine[Any, Any, ExecResult]:
        task = self.task
        if task is None:
            raise RuntimeError(f"{self.attempt_id}: this attempt has no task to reset from")
        if self._rt.gate is not None:
            return self._rt.reset_then_enter(self, LaneOp.reset(self.handle, task))
        return self._rt.lane_op(self._key, LaneOp.reset(self.handle, task))

    def exec(self, command: str, timeout_s: float) -> Coroutine[Any, Any, ExecResult]:
        return self._rt.lane_op(self._key, LaneOp.exec(self.handle, command, timeout_s))

    def validate(self) -> Coroutine[Any, Any, float]:
        if self._rt.gate is not None:
            self._rt.gate.leave(self)  # the agent phase is over
        return self._rt.lane_op(self._key, LaneOp.validate(self.handle))


class Runtime:
    """Drives one collection run: admission, attempts, batches, trainer steps and weight publication."""

    def __init__(
        self,
        policy: PolicyConfig,
        engines: Sequence[Engine],
        engine_slots: int,
        lanes: Lanes,
        source: AttemptSource,
        trainer: Trainer,
        faults: EngineFaultConfig | None = None,
        supervisor: EngineSupervisor | None = None,
        bus: EventBus | None = None,
        timeline: bool = False,
        lane_adapter: LaneAdapter | None = None,
        logger: logging.Logger = log,
        weights_from_disk: bool = False,
        history: int | None = None,
    ) -> None:
        self.policy = policy
        # None: keep the whole history for the run's report (`corral run`, the simulator). A number: a
        # run that goes on until stopped (`corral serve`, whose store keeps the stream) keeps the newest
        # that many entries of each list in `state` and folds no report, so memory stays flat.
        self.history = history
        # The engines load each version from a weights directory (vLLM, SGLang, the embedded engine):
        # a publication without one is refused, as they would refuse it (`publish`).
        self.weights_from_disk = weights_from_disk
        self._log = logger  # a simulation passes one that keeps only errors (app.sim.run)
        # Resizes the lanes' slots in wall time while the run collects (adaptive lanes, real runs)
        self.lane_adapter = lane_adapter
        if lane_adapter is not None:
            lane_adapter.on_change = self._lane_resized
        self.faults = faults or EngineFaultConfig()
        self.supervisor = supervisor
        self.scheduler = Scheduler(policy)
        self.plan = UpdatePlan(
            [e.name for e in engines],
            policy.rolling_updates,
            policy.max_updating_engines,
            may_join=self._free_slots_for_update if policy.update_pacing is UpdatePacing.FREE_SLOTS else None,
            max_staleness=policy.max_staleness,
        )
        self.pool = EnginePool(engines, engine_slots, self.plan)
        self.lanes = lanes
        self.source = source
        self.trainer = trainer
        self.state = RunState(engines={e.name: EngineRecord() for e in engines})
        self._tg: asyncio.TaskGroup | None = None
        self._attempts: dict[AttemptKey, asyncio.Task[None]] = {}
        self._group_tasks: dict[int, int] = {}  # groups with attempt tasks: their size
        self.bus = bus if bus is not None else EventBus("run")
        self.report_acc = ReportAccumulator(timeline=timeline)
        if history is None:
            self.bus.subscribe(self.report_acc.on_envelope, self.report_acc.by_type())
        self._lane_queued = dict.fromkeys(LaneName, 0)
        self._lane_busy = dict.fromkeys(LaneName, 0)
        # Attempts past their reset enter their agent phase while the exec lane can serve them
        # (app.runtime.gate); None: no gate (the policy has none, or the lanes' slots cannot be read).
        self.gate = AgentGate.for_lanes(policy.agent_gate, lanes, self.now)
        if self.gate is None and policy.agent_gate is not None:  # asked for, but the lanes cannot have one
            self.policy = policy.with_changes(agent_gate=None)  # so RunStarted and the report say so
        self._start_failures = 0  # consecutive groups that could not start
        self._failed_in_a_row = 0  # groups discarded as failed since a group last completed
        self._flat_in_a_row = 0  # groups discarded for equal rewards since a group was last kept
        self._run_target: tuple[int | None, float | None] = (None, None)
        self._batch_waiter: asyncio.Future[DeliverBatch | None] | None = None
        self._stop_requested = False
        self._weights: dict[int, str | None] = {0: None}
        self._outcomes: dict[int, dict[int, AttemptOutcome]] = {}  # live groups' finished attempts
        self._version = 0
        self._stopping = False
        self._update_tasks: dict[str, asyncio.Task[None]] = {}
        self._recoveries: dict[str, asyncio.Task[None]] = {}
        self._all_down_since: float | None = None
        self._stall_said = 0  # the newest version whose refusal by every engine stalled the run, said
        self._health_watch: asyncio.Task[None] | None = None
        self._adapting: asyncio.Task[None] | None = None
        self._down_at_start: dict[str, str] = {}  # engines dead before the run began: restarted first
        self.phase = "startup"  # startup, collecting, trainer_step, stopping: where a stop landed
        # Called once the run executes (its task group open, its first groups admitted): from then on a
        # live change (S, K, a publication, a pause) has somewhere to start what it decides.
        self.on_collecting: Callable[[], None] | None = None
        # Called once the trainer loop is over (its last batch trained, its deadline passed, or a stop),
        # before the run drains its work: no batch is asked for and no version is taken from then on.
        self.on_trainer_done: Callable[[], None] | None = None
        # Awaited before the first batch is asked for: a resumed run's trainer steps on the batches it
        # had handed out before the restart (app.service.gateway.TrainerGateway.restored_steps).
        self.before_batches: Callable[[], Awaitable[None]] | None = None
        # The clock: the running loop's, looked up per call until `run` binds the loop it runs on (a
        # lookup per call was a measurable share of the simulator's time).
        self._time: Callable[[], float] = _loop_time

    def now(self) -> float:
        return self._time()

    def gate_report(self) -> dict[str, Any]:
        """The report's `agent_gate`: its figures, or None when the run had no gate."""
        return {"agent_gate": None if self.gate is None else self.gate.report()}

    def _trim(self, entries: list[Any]) -> None:
        """Past twice `history` entries, drop the oldest down to `history` (amortised O(1))."""
        if self.history is not None and len(entries) > 2 * self.history:
            del entries[: len(entries) - self.history]

    # -- the run -------------------------------------------------------------------------------

    async def run(self, batches: int | None = None, duration_s: float | None = None) -> RunState:
        if batches is None and duration_s is None:
            raise ValueError("a run needs a number of batches or a duration")
        loop = asyncio.get_running_loop()
        self._time = loop.time
        self.bus.bind_loop(loop)
        self.state.started_at = self.now()
        self._run_target = (batches, duration_s)
        self._publish(
            RunStarted(
                self.policy.model_dump(mode="json"),
                tuple(self.state.engines),
                tuple(lane.value for lane in LaneName),
            )
        )
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self.phase = "collecting"
                for name, detail in self._down_at_start.items():
                    self._engine_down(name, detail)
                if self.faults.health_interval_s is not None:
                    self._health_watch = tg.create_task(self._watch_health(self.faults.health_interval_s))
                if self.lane_adapter is not None:
                    self._adapting = tg.create_task(self.lane_adapter.run())
                self._apply(self.scheduler.on_start(self.now()))
                if self.on_collecting is not None:
                    self.on_collecting()
                await self._trainer_loop(batches, duration_s)
                if self.on_trainer_done is not None:
                    self.on_trainer_done()
                self._begin_shutdown()
        except asyncio.CancelledError:
            # Stopped at once (a second Ctrl-C): the TaskGroup has cancelled every task and each
            # attempt cleaned up its sandbox; the account still closes so the report covers the run.
            if not self._stopping:
                self._begin_shutdown()
            raise
        except Exception:
            # Ended by an error (groups that all fail, a bug): the account still closes, so every live
            # group gets its terminal event and the ledger finds none lost. The error is what is raised.
            if not self._stopping:
                with contextlib.suppress(Exception):
                    self._begin_shutdown()
            raise
        finally:
            self._publish_run_ended(sys.exc_info()[1])
            self._time = _loop_time
            self.bus.bind_loop(None)
        return self.state

    async def _abandon_updates(self, updates: list[asyncio.Task[None]]) -> None:
        """Give the weight updates under way as the run stops `UPDATE_STOP_GRACE_S`, then cancel those
        still going (each logged; the run's events show the update begun and never ended)."""
        _, going = await asyncio.wait(updates, timeout=UPDATE_STOP_GRACE_S)
        for task in going:
            engine = next((name for name, t in self._update_tasks.items() if t is task), "an engine")
            self._log.warning(
                "stopping: %s's weight update abandoned after %g s",
                engine,
                UPDATE_STOP_GRACE_S,
            )
            task.cancel()

    def _lane_resized(self, lane: str, old: int, new: int, why: str) -> None:
        assert self.lane_adapter is not None
        self._publish(LaneResized(lane, old, new, self.lane_adapter.controller.configured[lane], why))

    def engine_down_at_start(self, name: str, detail: str) -> None:
        """Engine `name` died before the run began: the run starts with it down and restarts it."""
        self._down_at_start[name] = detail

    def _begin_shutdown(self) -> None:
        # The run's measured span ends with the trainer; draining cleanups after it is housekeeping.
        self.state.ended_at = self.now()
        self._stopping = True
        self.phase = "stopping"
        self.source.stopping()
        self._all_down_ended(back=False)
        for task in self._recoveries.values():
            task.cancel()  # a restart in progress is abandoned; the engines are stopped by their owner
        if self._health_watch is not None:
            self._health_watch.cancel()
        if self._adapting is not None:
            self._adapting.cancel()
        if self._update_tasks and self._tg is not None:
            abandon = self._abandon_updates(list(self._update_tasks.values()))
            try:
                self._tg.create_task(abandon)
            except RuntimeError:  # stopped at once: the group has ended, and its updates with it
                abandon.close()  # else "coroutine was never awaited" on stderr after a Ctrl-C's one line
        self._apply(self.scheduler.on_stop(self.now()))

    async def _trainer_loop(self, batches: int | None, duration_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        deadline = None if duration_s is None else self.state.started_at + duration_s
        n = 0
        if self.before_batches is not None:
            self.phase = "trainer_step"
            await self.before_batches()
        while (batches is None or n < batches) and not self._stop_requested:
            if self._version >= MAX_POLICY_VERSION:
                # The batch would be trained into a version nobody may publish: the run waited forever.
                raise RunCannotProceed(
                    f"policy version {self._version} is the newest a run takes ({MAX_POLICY_VERSION}): no "
                    "batch after it can be published as a newer one"
                )
            requested = self.now()
            self._batch_waiter = loop.create_future()
            self._publish(BatchRequested(self.scheduler.batches_delivered))
            self._apply(self.scheduler.on_batch_requested(requested))
            self.phase = "collecting"
            # The deadline ends the wait as a stop does: in one step, with the request withdrawn.
            timer = None if deadline is None else loop.call_at(deadline, self._end_batch_wait)
            try:
                batch = await self._batch_waiter
            finally:
                if timer is not None:
                    timer.cancel()
            if batch is None:  # the deadline passed or an operator asked the run to stop
                self.state.trainer_wait_s += self.now() - requested
                return
            delivered = self.now()
            self.state.trainer_wait_s += delivered - requested
            self._record_batch(batch, requested, delivered)
            version = self._version + 1
            self.phase = "trainer_step"
            path = await self.trainer.step(self._training_batch(batch), version)
            # An external trainer publishes through `publish` itself; a stopping run publishes nothing.
            if self._version < version and not self._stop_requested:
                self.publish(version, path)
            n += 1
            if self._stop_requested or (deadline is not None and self.now() >= deadline):
                return

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def request_stop(self) -> None:
        """End the run after the current trainer step: live groups are discarded as cancelled, every
        sandbox is cleaned up, and the report covers the batches delivered so far."""
        self._stop_requested = True
        self._end_batch_wait()

    def _end_batch_wait(self) -> None:
        """End the trainer's wait without a batch (a stop or the deadline), withdrawing the request in
        the same step: a group completing before the trainer loop resumes must not be delivered into
        the void ("a batch nobody asked for")."""
        if self._batch_waiter is not None and not self._batch_waiter.done():
            self._batch_waiter.set_result(None)
            self._apply(self.scheduler.on_batch_withdrawn(self.now()))

    def _training_batch(self, batch: DeliverBatch) -> TrainingBatch:
        attempts = {}
        for group in batch.groups:
            finished = self._outcomes.pop(group.group_id)
            attempts[group.group_id] = tuple(finished[i] for i in sorted(finished))
        return TrainingBatch(batch, attempts)

    def _record_batch(self, batch: DeliverBatch, requested: float, delivered: float) -> None:
        ready = max(g.completed_at for g in batch.groups)
        rewards = [r for g in batch.groups for r in g.rewards]
        group_ids = tuple(g.group_id for g in batch.groups)
        staleness = tuple(g.staleness for g in batch.groups)
        self._publish(
            BatchDelivered(batch.index, group_ids, batch.trainer_version, requested, ready, staleness)
        )
        self.state.batches.append(
            BatchRecord(
                index=batch.index,
                requested_at=requested,
                delivered_at=delivered,
                ready_at=ready,
                trainer_version=batch.trainer_version,
                max_staleness=max(g.staleness for g in batch.groups),
                mean_reward=sum(rewards) / len(rewards),
            )
        )
        self._trim(self.state.batches)

    @property
    def version(self) -> int:
        """The trainer's latest published policy version."""
        return self._version

    def publish(self, version: int, path: str | None, actor: str = "trainer", command_id: str = "") -> None:
        """Publish policy `version` (weights directory `path`, or None for a sentinel): staleness is
        measured against it from now on and a weight update starts across the engines.

        ValueError, and nothing changes, for a version not newer than the current one, or without a
        path when the engines load weights from disk: each engine would refuse it in turn, and an
        update no engine can make must not cost the run."""
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the published version {self._version}")
        if path is None and self.weights_from_disk:
            raise ValueError(
                f"version {version} has no weights path, and this run's engines load their weights from disk"
            )
        self._version = version
        self._weights[version] = path
        self._publish(VersionPublished(version, path, actor, command_id))
        self._apply(self.scheduler.on_version_published(version, self.now()))
        self._do_updates(self.plan.on_publish(version))

    def weights_path(self, version: int) -> str | None:
        """The weights directory `version` was published with (None: a sentinel, or never published)."""
        return self._weights.get(version)

    # -- live changes (operators retune S and K while the run goes on) ---------------------------

    def set_surplus(self, surplus: int, actor: str = "operator", command_id: str = "") -> None:
        old = self.scheduler.surplus
        decisions = self.scheduler.set_surplus(surplus, self.now())
        self._publish(PolicyChanged("surplus_groups", old, surplus, actor, command_id))
        self._apply(decisions)

    def set_max_staleness(self, max_staleness: int, actor: str = "operator", command_id: str = "") -> None:
        old = self.scheduler.max_staleness
        decisions = self.scheduler.set_max_staleness(max_staleness, self.now())
        self._publish(PolicyChanged("max_staleness", old, max_staleness, actor, command_id))
        self._apply(decisions)
        self._do_updates(self.plan.set_max_staleness(max_staleness))
        self.pool.wake()  # engines within the new K serve again

    def set_agent_gate(self, factor: float, actor: str = "operator", command_id: str = "") -> None:
        """Change the agent-phase gate's factor (0: open). ValueError for a run without a gate."""
        if self.gate is None:
            raise ValueError("this run has no agent-phase gate")
        old = self.gate.factor
        self.gate.set_factor(factor)
        self.policy = self.policy.with_changes(agent_gate=factor)
        self._publish(PolicyChanged("agent_gate", old, factor, actor, command_id))

    def hold(self, held: bool) -> None:
        """An operator paused (or resumed) the run: while held no turn starts on any engine and no
        weight update begins (the caller pauses the engines, so turns in flight freeze); released, the
        turns waiting for a slot go and the updates due meanwhile begin."""
        self._do_updates(self.plan.set_held(held))
        if not held:
            self.pool.wake()

    # -- decisions -----------------------------------------------------------------------------

    def _apply(self, decisions: list[Decision]) -> None:
        """Publish the scheduler's group events, then carry out its decisions, in order."""
        self._publish_group_events()
        if not decisions:  # most events (a turn done) decide nothing
            return
        pending = deque(decisions)
        while pending:
            decision = pending.popleft()
            if isinstance(decision, StartGroup):
                failed = self._start_group(decision)
                if failed is not None:  # the group fails; the scheduler may admit another
                    pending.extend(self._fail_start((decision.group_id, failed[0]), failed[1]))
                    continue
            elif isinstance(decision, CancelGroup):
                self._outcomes.pop(decision.group_id, None)
                for i in range(self._group_tasks.pop(decision.group_id, 0)):
                    key = (decision.group_id, i)
                    task = self._attempts.pop(key, None)
                    if task is not None:
                        task.cancel()
                        self._publish(AttemptCancelled(key[0], key[1], decision.reason.value))
            elif isinstance(decision, DeliverBatch):
                if self._batch_waiter is None or self._batch_waiter.done():
                    raise RuntimeError("the scheduler delivered a batch nobody asked for")
                self._batch_waiter.set_result(decision)

    def _publish(self, event: Event) -> None:
        self.bus.publish(event)

    def _publish_group_events(self) -> None:
        given_up: str | None = None
        for event in self.scheduler.drain_events():
            self.bus.publish(event)
            if isinstance(event, GroupReady):
                self._failed_in_a_row = self._flat_in_a_row = 0
            elif isinstance(event, GroupDiscarded) and event.reason == DiscardReason.ZERO_VARIANCE.value:
                self._flat_in_a_row += 1
                if self._flat_in_a_row > self._flat_limit() and given_up is None:
                    given_up = (
                        f"{self._flat_in_a_row} groups in a row had all their rewards equal (no learning "
                        "signal) and filter_zero_variance discarded each, so no batch can be filled; the "
                        "tasks are all solved or all failed at this policy (attempts cut short fail too)"
                    )
            elif isinstance(event, GroupDiscarded) and event.reason == DiscardReason.FAILED.value:
                self._failed_in_a_row += 1
                if self._failed_in_a_row > self._failure_limit() and given_up is None:
                    given_up = (
                        f"{self._failed_in_a_row} groups in a row failed and none completed, so no batch "
                        f"can be filled; last: {event.detail}"
                    )
            if isinstance(event, GroupDelivered | GroupDiscarded):
                gid = event.group_id
                if isinstance(event, GroupDiscarded):
                    self._outcomes.pop(gid, None)  # a delivered group's leave with its training batch
                size = self._group_tasks.get(gid, 0)
                if not any((gid, i) in self._attempts for i in range(size)):
                    self._group_tasks.pop(gid, None)  # else its CancelGroup follows and clears it
        if given_up is not None:  # raised after every drained event is published: none may be lost
            raise RunCannotProceed(given_up)

    def _publish_run_ended(self, exc: BaseException | None) -> None:
        batches, _ = self._run_target
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            reason, detail = "error", failure_detail(exc)
        elif self._stop_requested or exc is not None:
            reason, detail = "stopped", ""
        elif batches is not None and self.scheduler.batches_delivered >= batches:
            reason, detail = "completed", ""
        else:
            reason, detail = "duration", ""
        ended = self.state.ended_at if self._stopping else self.now()
        self._publish(RunEnded(reason, detail, ended, self.scheduler.counters.events))

    def _start_group(self, decision: StartGroup) -> tuple[int, str] | None:
        """Start every attempt of an admitted group; on failure, (attempt, error) and nothing started."""
        made = []
        for i in range(decision.group_size):
            try:
                made.append(self.source.make_attempt(decision.group_id, decision.task_index, i))
            except Exception as exc:  # fault tolerance: a group that cannot start fails, not the run
                self._log.warning("group %d: attempt %d could not start: %r", decision.group_id, i, exc)
                # Sandboxes made so far never ran an op: they hold nothing to clean up.
                return i, f"could not start attempt {i}: {type(exc).__name__}: {exc}"
        self._group_tasks[decision.group_id] = decision.group_size
        for i, (agent, task, sandbox) in enumerate(made):
            self._launch((decision.group_id, i), decision.task_index, agent, task, sandbox)
        self._start_failures = 0
        return None

    def _start_attempt(self, key: AttemptKey, task_index: int) -> str | None:
        """Start a new try of one attempt; the error if it could not start."""
        try:
            agent, task, sandbox = self.source.make_attempt(key[0], task_index, key[1])
        except Exception as exc:  # fault tolerance: the group fails, not the run
            self._log.warning("attempt g%da%d could not start: %r", key[0], key[1], exc)
            return f"could not start attempt {key[1]}: {type(exc).__name__}: {exc}"
        self._launch(key, task_index, agent, task, sandbox)
        return None

    def _launch(
        self, key: AttemptKey, task_index: int, agent: Agent, task: TaskSpec | None, sandbox: Sandbox
    ) -> None:
        assert self._tg is not None
        self.bus.publish(AttemptStarted(key[0], key[1]))
        self._attempts[key] = self._tg.create_task(self._run_attempt(key, task_index, agent, task, sandbox))

    def _failure_limit(self) -> int:
        """Groups that may fail in a row before the run ends: a source or sandbox that fails every group
        would otherwise admit and fail groups forever (a simulation with `p_infra_error: 1` did)."""
        return max(100, 4 * self.scheduler.capacity)

    def _flat_limit(self) -> int:
        """Groups that may be discarded for equal rewards in a row before the run ends: with every task
        always failed (or every attempt cut short) a run that discards each such group never ends (a
        simulated peer on `cpu-scarce` did not). Far above what a low but real share of groups with a
        learning signal gives in a row (at 2%, 1,000 in a row has a chance of about 2 in a billion)."""
        return max(1_000, 16 * self.scheduler.capacity)

    def _fail_start(self, key: AttemptKey, error: str) -> list[Decision]:
        """The group of `key` fails because that attempt could not start; many in a row end the run
        (a source that always fails would otherwise admit and fail groups forever)."""
        self._start_failures += 1
        if self._start_failures > self._failure_limit():
            raise RunCannotProceed(f"{self._start_failures} groups in a row could not start; last: {error}")
        self._publish(AttemptFinished(key[0], key[1], 0.0, error))
        decisions = self.scheduler.on_attempt_done(key[0], key[1], 0.0, error, self.now())
        self._publish_group_events()
        return decisions

    async def _run_attempt(
        self, key: AttemptKey, task_index: int, agent: Agent, task: TaskSpec | None, sandbox: Sandbox
    ) -> None:
        ctx = _AttemptContext(self, key, task, sandbox)
        try:
            try:
                outcome = await agent.run(ctx)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # fault tolerance: an infrastructure error fails the group, not the run
                self._log.warning("attempt %s failed: %r", ctx.attempt_id, exc)
                outcome = AttemptOutcome(reward=0.0, turns=0, error=f"{type(exc).__name__}: {exc}")
        finally:
            assert self._tg is not None
            if self.gate is not None:
                self.gate.leave(ctx)  # ended (or failed) before its validation
            # An attempt ended before any op started on its sandbox (cancelled while its reset queued)
            # has nothing to clean up: a stop after a surplus flood queued tens of thousands of these.
            if not self.lanes.forget(ctx.handle):
                cleanup = self._cleanup(key, ctx.handle)
                try:
                    self._tg.create_task(cleanup)
                except RuntimeError:
                    await cleanup  # the run is aborting: no sandbox may be left behind, so clean up here
        if self._attempts.get(key) is not asyncio.current_task():
            return  # this try was superseded (restarted or its group discarded): its finish must not count
        del self._attempts[key]
        self.bus.publish(AttemptFinished(key[0], key[1], outcome.reward, outcome.error))
        if outcome.error is None:
            self._outcomes.setdefault(key[0], {})[key[1]] = outcome
        self._apply(self.scheduler.on_attempt_done(key[0], key[1], outcome.reward, outcome.error, self.now()))

    async def _cleanup(self, key: AttemptKey, handle: SandboxHandle) -> None:
        try:
            await self.lane_op(key, LaneOp.cleanup(handle))
        except Exception as exc:  # a failed cleanup must not end the run; it is logged with context
            self._log.warning("sandbox cleanup failed: %r", exc)

    async def reset_then_enter(self, ctx: _AttemptContext, op: LaneOp[ExecResult]) -> ExecResult:
        """The reset, then a wait at the agent-phase gate: the agent's time starts when this returns. A
        reset that failed or timed out ends the attempt (the agent reports it), so it does not wait."""
        result = await self.lane_op(ctx._key, op)
        if result.timed_out or result.exit_code != 0:
            return result
        assert self.gate is not None
        reached = self._time()
        await self.gate.enter(ctx)
        entered = self._time()
        if entered > reached:
            key = ctx._key
            self.bus.publish(AgentGateWait(key[0], key[1], reached, entered))
        return result

    async def lane_op(self, key: AttemptKey, op: LaneOp[T]) -> T:
        """Run `op` in its lane and publish it as a `SandboxOp` (also when it fails or is cancelled)."""
        lane = op.name
        now = self._time
        lane_queued, lane_busy = self._lane_queued, self._lane_busy
        queued = now()
        depth = lane_queued[lane] = lane_queued[lane] + 1
        started: float | None = None
        busy = 0

        def on_start() -> None:
            nonlocal started, busy
            started = now()
            lane_queued[lane] -= 1
            busy = lane_busy[lane] = lane_busy[lane] + 1

        ok, detail = False, "cancelled"
        try:
            result = await self.lanes.run_op(op, on_start, key[0])
            ok, detail = True, ""
            return result
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            end = now()
            if started is None:
                lane_queued[lane] -= 1
                started = end
            else:
                lane_busy[lane] -= 1
                if lane is LaneName.EXEC and self.gate is not None:
                    self.gate.exec_done(started - queued, end - started)
            self.bus.publish(
                SandboxOp(key[0], key[1], _LANE_VALUE[lane], queued, started, end, ok, detail, depth, busy)
            )

    async def generate(self, key: AttemptKey, request: TurnRequest) -> TurnResult:
        failures = 0
        now = self._time
        while True:
            queued = now()
            fresh = None
            if self.plan.lagging:  # a rolling update is under way: keep the group from getting older
                fresh = self.plan.fresh_for(self.scheduler.oldest_version(key[0]))
            engine = self.pool.try_acquire(fresh)
            if engine is None:  # most turns find a slot at once, without a coroutine
                engine = await self.pool.acquire(fresh)
            epoch = self.pool.epoch[engine.name]
            started = now()
            error: EngineError | TimeoutError | None = None
            try:
                with self.pool.call(engine.name):
                    result = await engine.generate(request)
            except (EngineError, TimeoutError) as exc:
                error = exc
            finally:
                record = self.state.engines[engine.name]
                record.busy_s += now() - started
                self.pool.release(engine)
            if error is None:
                break
            # version -1: the call failed, so no policy version produced anything
            self._publish(
                TurnDone(
                    key[0],
                    key[1],
                    engine.name,
                    -1,
                    queued,
                    started,
                    self.now(),
                    0,
                    f"{type(error).__name__}: {error}",
                )
            )
            failures = await self._turn_failed(engine, epoch, error, failures)
        record.turns += 1
        record.tokens += result.tokens
        version = result.weight_version
        end = now()
        self.bus.publish(TurnDone(key[0], key[1], engine.name, version, queued, started, end, result.tokens))
        self._apply(self.scheduler.on_turn(key[0], key[1], version, end))
        return result

    # -- engine faults -------------------------------------------------------------------------

    async def _turn_failed(self, engine: Engine, epoch: int, error: Exception, failures: int) -> int:
        """A turn's engine call failed: return (the turn's failures so far) to retry it, elsewhere if
        the engine is down, or raise to fail the attempt. Fault tolerance is the point here, so engine
        failures are caught.

        Only failures on an engine that stays up count against `turn_retries` (the engines keep
        failing this turn). When the engine is down the turn is not to blame and waits for another
        engine, however many die: when every engine dies at once, a turn may meet each of them before
        the runtime knows they are all down."""
        name = engine.name
        if isinstance(error, TurnAborted) and not self.plan.up(name):
            # Paused with `abort` for its update: the turn was cut short, through no fault of its own,
            # and goes to an engine that is not updating. (An abort by an engine this run did not pause
            # counts as the turn's failure below, so that such an engine cannot take a turn forever.)
            self.state.turn_retries += 1
            self._log.info("turn sent again: %s", error)
            return failures
        interrupted = isinstance(error, TimeoutError)
        if interrupted and self.pool.epoch[name] == epoch:
            raise error  # not an interruption by `_engine_down`: someone else's timeout
        if not interrupted and not is_engine_fault(error):
            raise error  # the engine refused the turn; any engine would
        if not interrupted and self.pool.epoch[name] == epoch:
            down = is_unreachable(error) or not await self._probe(engine)
            if down and self.pool.epoch[name] == epoch:  # nobody took it down while we probed
                self._engine_down(name, f"a turn failed: {error}")
        what = f"engine {name} went down during the turn" if interrupted else str(error)
        if self.pool.epoch[name] == epoch:  # the engine is up: this failure is the turn's
            failures += 1
            if failures > self.faults.turn_retries:
                raise EngineTurnFailed(
                    f"{what} (failed {failures} times on engines that stayed up)"
                ) from error
        self.state.turn_retries += 1
        self._log.info("turn retried after an engine failure: %s", what)
        return failures

    async def _watch_health(self, interval_s: float) -> None:
        """Probe each serving engine every `interval_s`: one that dies while it takes no turns (the
        router prefers the least loaded, so an engine can sit idle) leaves rotation all the same."""
        misses: dict[tuple[str, int], int] = {}  # unanswered probes in a row, by engine and epoch
        while True:
            await asyncio.sleep(interval_s)
            for name in list(self.pool.by_name):
                if not self.plan.up(name):
                    continue  # down (being restarted) or updating (its update has its own timeout)
                # Read the client now, not before the loop: while an earlier probe waited, this engine
                # may have been restarted and its old client closed.
                engine, epoch = self.pool.by_name[name], self.pool.epoch[name]
                answer = await self._probe_answer(engine)
                key = (name, epoch)
                misses[key] = misses.get(key, 0) + 1 if answer is None else 0
                if self.pool.epoch[name] != epoch or not self.plan.up(name):
                    continue
                if answer is False:
                    self._engine_down(name, "health check failed")
                elif misses[key] >= self.faults.health_misses:
                    self._engine_down(name, self._unanswered(misses[key]))

    def _with_exit(self, detail: str, name: str) -> str:
        """`detail`, and how the engine's process ended where it did (a `kill -9` read as a failed
        health check alone)."""
        ended = None if self.supervisor is None else self.supervisor.exit_status(name)
        return detail if ended is None else f"{detail}: its process {ended}"

    def _unanswered(self, probes: int) -> str:
        limit = self.faults.health_timeout_s
        if probes == 1:
            return f"stopped answering /health within {limit:g}s"
        return f"stopped answering /health within {limit:g}s ({probes} probes in a row)"

    async def _while_answering(self, engine: Engine, work: Coroutine[Any, Any, T]) -> T:
        """Await `work` (a weight update's steps) while the health watch, if on, goes on probing
        `engine`: a frozen engine (a stopped process, which takes connections and never answers) fails
        the update within `health_misses` probes, not at `update_timeout_s`, so that the rolling update
        goes on. Left to the timeout, it held the rolling update for `update_timeout_s` (two minutes by
        default), and the groups on the engines it held back went stale."""
        interval = self.faults.health_interval_s
        if interval is None:
            return await work
        task = asyncio.ensure_future(work)
        misses = 0
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=interval)
                if done:
                    return task.result()
                answer = await self._probe_answer(engine)
                misses = misses + 1 if answer is None else 0
                if task.done():
                    continue
                if answer is False:
                    raise EngineStoppedAnswering("health check failed during the update")
                if misses >= self.faults.health_misses:
                    raise EngineStoppedAnswering(f"{self._unanswered(misses)} during the update")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait((task,))
            if not task.cancelled():
                # Its outcome is decided above. A failure it ended with after all (a request to a killed
                # engine raises its connection error through the cancel, or the work failed while the
                # probe ran and the probe was then cancelled) is no news, but left unread it was logged
                # as "Task exception was never retrieved" with three tracebacks, after Ctrl-C in CI.
                task.exception()

    async def _probe(self, engine: Engine) -> bool:
        return await self._probe_answer(engine) is True

    async def _probe_answer(self, engine: Engine) -> bool | None:
        """The engine's health: healthy (True), unhealthy or unreachable (False), or no answer within
        `health_timeout_s` (None: frozen, or only slow on a loaded host)."""
        try:
            async with asyncio.timeout(self.faults.health_timeout_s):
                return await engine.health()
        except TimeoutError:
            return None
        except Exception as exc:  # a probe that cannot even be made says the same as one that fails
            self._log.warning("health probe of %s failed: %s", engine.name, exc)
            return False

    def _engine_state(self, name: str, state: str, detail: str = "") -> None:
        self.state.engine_events.append((self.now(), name, state, detail))
        self._trim(self.state.engine_events)
        self._publish(EngineStateChanged(name, state, detail))

    def _engine_down(self, name: str, detail: str) -> None:
        """`name` leaves rotation: its in-flight turns retry elsewhere, an update it runs is abandoned
        (the rolling update goes on to the next engine), and a restart with backoff begins."""
        if name in self.plan.down:
            return
        if not detail.startswith("exited"):  # said already by a death at start-up
            detail = self._with_exit(detail, name)
        assert self._tg is not None
        self._log.warning("engine %s is down: %s", name, detail, extra=AS_EVENT)
        self.pool.mark_down(name)
        update = self._update_tasks.pop(name, None)
        if update is not None and update is not asyncio.current_task():
            update.cancel()
        self._engine_state(name, "unhealthy", detail)
        actions = self.plan.on_engine_down(name)
        if not self._stopping:
            self._do_updates(actions)
        if self.plan.all_down and self._all_down_since is None:
            self._all_down_since = self.now()
            self._log.warning("every engine is down: turns wait for a restart", extra=AS_EVENT)
            self._engine_state("*", "all_down", "every engine is down; turns wait for a restart")
        if not self._stopping:
            self._recoveries[name] = self._tg.create_task(self._recover_engine(name))

    def _all_down_ended(self, back: bool = True) -> None:
        if self._all_down_since is None:
            return
        self.state.all_down_s += self.now() - self._all_down_since
        self._all_down_since = None
        if back:  # not when the run merely stops
            # pairs with "every engine is down"
            self._log.warning("an engine is back: turns flow again", extra=AS_EVENT)
            self._engine_state("*", "serving", "an engine is back; turns flow again")

    async def _recover_engine(self, name: str) -> None:
        """Restart `name` (or wait until it answers again), bring it to the newest version, and only
        then route turns to it. Failed tries back off exponentially; a run stopping cancels this."""
        record = self.state.engines[name]
        if self.now() - record.up_since > self.faults.restart_backoff_max_s:
            record.backoff_s = 0.0  # it served for a while: this is a new failure, not a crash loop
            record.crash_tries = 0
        tries = 0
        last = "it died again soon after its last restart"
        while True:
            if 0 < self.faults.max_restarts <= record.crash_tries:
                self._give_up(name, f"{record.crash_tries} restarts in a row failed or did not last; {last}")
                return
            if record.backoff_s > 0:
                self._engine_state(name, "unhealthy", f"next restart in {record.backoff_s:g}s")
                await asyncio.sleep(record.backoff_s)
            record.backoff_s = min(
                max(record.backoff_s * 2, self.faults.restart_backoff_s), self.faults.restart_backoff_max_s
            )
            tries += 1
            if self.supervisor is not None:
                record.crash_tries += 1
            try:
                engine = await self._bring_back(name, tries)
                version = await self._catch_up(engine)
            except Exception as exc:  # fault tolerance: a failed restart is retried after a backoff
                if self.supervisor is None:  # nothing to restart: the engine is probed until it answers
                    self._log.info("engine %s: not back yet (probe %d): %s", name, tries, exc)
                    self._engine_state(name, "unhealthy", f"not back yet (probe {tries}): {exc}")
                else:
                    self._log.warning("engine %s: restart %d failed: %s", name, tries, exc, extra=AS_EVENT)
                    self._engine_state(name, "unhealthy", f"restart {tries} failed: {exc}")
                last = f"the last one: {exc}"
                continue
            break
        del self._recoveries[name]
        record.up_since = self.now()
        record.restarts += 1 if self.supervisor is not None else 0
        # pairs with "is down"
        self._log.warning("engine %s is back at version %s", name, version, extra=AS_EVENT)
        self._engine_state(name, "serving", f"back at version {version}")
        actions = self.plan.on_engine_up(name, version)
        self._do_updates(actions)
        self._all_down_ended()
        self.pool.wake()

    def _give_up(self, name: str, reason: str) -> None:
        """`name` stays down for the rest of the run; when no engine is left, the run stops."""
        del self._recoveries[name]
        self.state.given_up[name] = reason
        self._log.error("engine %s given up: %s", name, reason, extra=AS_EVENT)
        self._engine_state(name, "given_up", reason)
        if self.state.given_up.keys() == self.pool.by_name.keys():
            self._engine_state("*", "given_up", "every engine was given up: the run stops")
            self.request_stop()

    async def _bring_back(self, name: str, tries: int) -> Engine:
        if self.supervisor is None:
            engine = self.pool.by_name[name]
            if not await self._probe(engine):
                raise EngineTurnFailed("health check failed")
            return engine
        self._engine_state(name, "restarting", f"try {tries}")
        engine = await self.supervisor.restart(name)
        old = self.pool.replace(engine)
        if old is not engine:
            await old.aclose()
        return engine

    async def _catch_up(self, engine: Engine) -> int:
        """Bring `engine` to the newest published version (again, if one is published meanwhile), or,
        when it refuses that version, back to the version it served before; return the version."""
        name = engine.name
        async with asyncio.timeout(self.faults.update_timeout_s):
            if self.supervisor is None:
                await engine.resume()  # it may have gone down paused, in the middle of an update
            while True:
                target = self.plan.target
                want = self.plan.versions[name] if self.plan.refuses(name, target) else target
                if await engine.weight_version() != want:
                    try:
                        await engine.publish_weights(want, self._weights.get(want))
                    except EngineRequestError as exc:
                        if want != target:
                            raise  # it refuses the version it served: a failed restart
                        self._refused(name, target, exc)
                        continue
                    self.state.engines[name].versions.append((self.now(), want))
                    self._trim(self.state.engines[name].versions)
                if self.plan.target == target:
                    return want

    # -- weight publication --------------------------------------------------------------------

    def _refused(self, name: str, version: int, error: EngineRequestError) -> None:
        """`name` refused to load `version`: the update to it fails with the engine's reason, and the
        engine keeps the version it had (`UpdatePlan.on_refused`)."""
        now, reason = self.now(), str(error)
        self._log.warning(
            "engine %s refused version %d and serves on at version %d: %s",
            name,
            version,
            self.plan.versions[name],
            reason,
            extra=AS_EVENT,
        )
        self.state.update_log.append((now, name, version, "failed"))
        self.state.update_failures.append((now, name, version, reason))
        self._trim(self.state.update_log)
        self._trim(self.state.update_failures)
        self._publish(
            EngineUpdateEnd(name, version, ok=False, error=reason, refused=True, said=error.summary)
        )
        actions = self.plan.on_refused(name, version)
        if not self._stopping:
            self._do_updates(actions)
        self._say_if_stalled_by_refusals()

    def _say_if_stalled_by_refusals(self) -> None:
        """Every engine (but drained ones) refused the newest version and serves one more than K behind
        it: no turn can run until a version they load is published or K is raised. Say so, once a
        version; the run stalled without a word."""
        plan, target = self.plan, self.plan.target
        engines = [e for e in plan.versions if e not in plan.drained]
        if self._stall_said >= target or not engines:
            return
        if all(e in plan.too_stale and plan.refuses(e, target) for e in engines):
            self._stall_said = target
            self._log.warning(
                "every engine refused version %d and serves a version more than K = %s behind it: no turn "
                "can run until a version they can load is published or K is raised",
                target,
                plan.max_staleness,
            )

    def _free_slots_for_update(self, engine: str, updating: tuple[str, ...]) -> bool:
        """Free-slot pacing: `engine` may begin updating beside `updating` while the engines left serving
        have a free slot for every turn in flight on the engines updating, itself included: their share
        of new turns moves to the others, so no turn waits for a slot because more engines update."""
        pool, routable = self.pool, self.plan.routable
        active = pool.active
        held = active[engine] + sum(active[name] for name in updating)
        free = sum(pool.slots - n for name, n in active.items() if name != engine and routable(name))
        return free - pool.waiting >= held

    def _do_updates(self, actions: list[UpdateAction]) -> None:
        assert self._tg is not None
        for action in actions:
            if isinstance(action, RestartInFlight):
                self._restart_in_flight()
            elif isinstance(action, BeginUpdate):
                self._update_tasks[action.engine] = self._tg.create_task(self._update_engine(action))
        self.state.max_engines_updating = max(self.state.max_engines_updating, len(self.plan.updating))

    def _restart_in_flight(self) -> None:
        for key, task in list(self._attempts.items()):
            if self._attempts.get(key) is not task:
                continue  # its group failed while this loop restarted a sibling
            task.cancel()
            del self._attempts[key]
            self._publish(AttemptRestarted(key[0], key[1]))
            self._apply(self.scheduler.on_attempt_restarted(key[0], key[1], self.now()))
            error = self._start_attempt(key, self.scheduler.group_of(key[0]).task_index)
            if error is not None:
                self._apply(self._fail_start(key, error))

    async def _update_engine(self, action: BeginUpdate) -> None:
        engine = self.pool.by_name[action.engine]
        epoch = self.pool.epoch[engine.name]
        mode = PauseMode(self.policy.pause_mode.value) if self.plan.rolling else PauseMode.ABORT
        self.state.update_log.append((self.now(), engine.name, action.version, "begin"))
        self._publish(EngineUpdateBegin(engine.name, action.version))

        async def steps() -> EngineRequestError | None:
            await engine.pause(mode)
            if mode is PauseMode.WAIT:
                await self.pool.drained(engine.name)
            refusal: EngineRequestError | None = None
            try:
                await engine.publish_weights(action.version, self._weights.get(action.version))
            except EngineRequestError as exc:
                # It answered that it cannot load these weights. Alive and healthy, it serves on at
                # its version: a restart would only load the same weights and be refused again.
                if not await self._probe(engine):
                    raise
                refusal = exc
            if not self.plan.held:  # held: the engine stays paused until the operator resumes
                await engine.resume()
            return refusal

        try:
            async with asyncio.timeout(self.faults.update_timeout_s):
                refusal = await self._while_answering(engine, steps())
        except (EngineError, TimeoutError, EngineStoppedAnswering) as exc:  # the engine leaves rotation
            timed_out = isinstance(exc, TimeoutError)
            reason = f"timed out after {self.faults.update_timeout_s:g}s" if timed_out else str(exc)
            now = self.now()
            self.state.update_log.append((now, engine.name, action.version, "failed"))
            self.state.update_failures.append((now, engine.name, action.version, reason))
            self._trim(self.state.update_log)
            self._trim(self.state.update_failures)
            self._publish(EngineUpdateEnd(engine.name, action.version, ok=False, error=reason))
            if self.pool.epoch[engine.name] == epoch:
                self._engine_down(engine.name, f"update to version {action.version} failed: {reason}")
            return
        finally:
            if self._update_tasks.get(engine.name) is asyncio.current_task():
                del self._update_tasks[engine.name]
        if refusal is not None:
            if engine.name in self.plan.updating and self.pool.epoch[engine.name] == epoch:
                self._refused(engine.name, action.version, refusal)
            self.pool.wake()
            return
        record = self.state.engines[engine.name]
        record.updates += 1
        record.versions.append((self.now(), action.version))
        self._trim(record.versions)
        self.state.update_log.append((self.now(), engine.name, action.version, "end"))
        self._trim(self.state.update_log)
        self._publish(EngineUpdateEnd(engine.name, action.version))
        if not self._stopping:
            self._do_updates(self.plan.on_updated(engine.name))
        else:
            self.plan.on_updated(engine.name)
        self.pool.wake()
