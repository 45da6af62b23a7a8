"""One live run inside `corral serve`: the production `Runtime` on its own asyncio loop in a thread,
and the thread-safe commands that reach it from the API.

The run's loop owns the runtime; nothing else touches it. A command from another thread (an API
request) is a function scheduled on that loop with `call_soon_threadsafe`; its result or exception
comes back through a `concurrent.futures.Future`, which an async caller awaits with `wrap_future`.

Invariants:
- every command runs on the run's loop, one at a time, between the runtime's own steps;
- a command submitted after the loop has ended fails with `RunNotLiveError` (the API answers 409);
  one pending when the loop ends fails the same way, never hangs;
- the run's end is recorded exactly once (`RunEnded`), and every group the run admitted ends in the
  stream: delivered, or discarded with the scheduler's reason;
- a stopping run publishes no new version; its trainer gateway is closed, so waiting trainers learn it;
- a trainer is told the state the run ends in: once its trainer loop completed, the run takes no batch,
  version or policy change, and its trainer learns how it ended once its drain is over (which may fail
  it), not "completed" at the loop's end;
- a drained engine starts no turn and no update until it is put back; the last serving engine cannot
  be drained. (Adding an engine to a running run is not supported.)
- a local run's engine that dies is restarted by the runtime (`RunPorts.supervisor`); a pause or resume
  that meets a dead engine is logged and the run goes on, and the run's commands reach a restarted
  engine through its new client (`engines()`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from app.core.config import PauseModeName, PolicyConfig, UpdatePacing
from app.core.events import EngineStateChanged, PolicyChanged, RunEnded, rotation_detail
from app.engines.base import Engine, PauseMode
from app.engines.embedded.weights import save_sentinel
from app.engines.errors import EngineError
from app.outputs import until_written
from app.runtime.config import sentinel_trainer_problem
from app.runtime.driver import Runtime, failure_detail
from app.service.gateway import RunClosedError, TrainerGateway
from app.service.paced import PacedLoop
from app.service.ports import LanesFactory, RunPorts, open_ports, run_policy
from app.service.recorder import RunRecorder
from app.service.rollouts import rollout_answer
from app.service.schemas import PolicyPatch, RunCreate, RunKind, TrainerKind, surplus_problem
from app.service.store import ResumePoint
from app.store.models import TERMINAL_RUN_STATES, RunState
from app.validation import large_surplus_change

log = logging.getLogger(__name__)
# How long a policy change or a publication waits for its events to reach the store before it answers
STORED_WAIT_S = 5.0

T = TypeVar("T")

NO_GATE = (
    "agent_gate: run {} has no agent-phase gate (it started without one, or its lanes are Celery's); "
    "set agent_gate when launching"
)
# How a large change of S is confirmed, through either door
CONFIRM_LARGE = 'send "confirm_large_change": true (the dashboard: tick \u201ca large change\u201d)'

UNTIL_STOPPED = 2**31  # batches: a run without a batch count goes on until it is stopped
# The runtime keeps the newest this many batches, updates and engine events of its own account (the
# store has the whole stream) and folds no report: a run going on for days stays flat in memory.
RUNTIME_HISTORY = 100
# A local run starts nothing new while its events could not be kept anywhere (`_hold_for_store`): from a
# store sink's buffer this full with its spill's disk refusing, until the buffer is down to the second
# share or the disk takes writes again; looked at this often
STORE_HOLD_SHARE = 0.8
STORE_RELEASE_SHARE = 0.5
STORE_CHECK_S = 0.5


class RunNotLiveError(RuntimeError):
    """The run is not executing here (ended, or not started yet); the command cannot reach it."""


class RolloutForgottenError(LookupError):
    """A finished rollout old enough that the run's log dropped it (`KEEP_ROLLOUTS`): the store has it."""


class IllegalRunStateError(RuntimeError):
    """The command is not allowed in the run's current state (e.g. resuming a running run)."""


class RunHandle:
    def __init__(
        self,
        run_id: str,
        spec: RunCreate,
        work_dir: Path,
        ack_timeout_s: float,
        on_state: Callable[[RunHandle, RunState, str | None], None],
        resume: ResumePoint | None = None,
        lanes: LanesFactory | None = None,
        paused: bool = False,
    ) -> None:
        """`paused`: the run was paused when its previous incarnation died (`resume` given): it comes
        back paused, starting no turn until it is resumed."""
        self.run_id = run_id
        self._lanes = lanes  # how a local run gets its lanes (None: in-process)
        self.spec = spec
        self.policy = run_policy(spec)
        if resume is not None:
            self.policy = resumed_policy(self.policy, resume.policy)
        # The loop exists before its thread runs it: the run's clock is its time, readable from any
        # thread, so events published before the start (orphans of a resumed run) are on that clock.
        start = resume.last_t if resume is not None else 0.0
        self.loop: asyncio.AbstractEventLoop = (
            PacedLoop(spec.speed, start) if spec.kind is RunKind.SIM else asyncio.new_event_loop()
        )
        self.recorder = (
            RunRecorder(run_id, self.loop.time)
            if resume is None  # a resumed run's counters and rollouts go on from its stored stream
            else RunRecorder(run_id, self.loop.time, resume.next_seq, resume.view, resume.rollouts)
        )
        if isinstance(self.loop, PacedLoop):
            self.loop.hold = self._store_behind  # simulated time waits for the store
        self.work_dir = work_dir
        self.state = RunState.CREATED
        self.error: str | None = None
        self.knobs: dict[str, Any] = {
            "groups_per_batch": self.policy.groups_per_batch,
            "group_size": self.policy.group_size,
            "surplus_groups": self.policy.surplus_groups,
            "max_staleness": self.policy.max_staleness,
            "max_updating_engines": self.policy.max_updating_engines,
            "pause_mode": self.policy.pause_mode.value,
            "ready_surplus": self.policy.ready_surplus,
            "agent_gate": self.policy.agent_gate,  # the gate's factor (0: open); None: no gate
        }
        self.runtime: Runtime | None = None
        self.ports: RunPorts | None = None
        self.gateway = TrainerGateway(run_id, ack_timeout_s, self._published_version)
        self._on_state = on_state
        self._resume = resume
        self._start_paused = paused
        self._thread: threading.Thread | None = None
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._loop_open = False
        self._tg: asyncio.TaskGroup | None = None
        self._main_task: asyncio.Task[str] | None = None
        self._stopped_starting = False  # stopped before its runtime ran (engines still coming up)
        self._ended_as: str | None = None  # how its runtime ended, once it did without an error
        self._pausing = asyncio.Lock()
        self.done = threading.Event()
        self.flushing = threading.Event()  # it has ended, and its last events are being stored
        self.held_for_store = False  # a local run held: its events could be kept nowhere (`_hold_for_store`)
        self.started_wall: float | None = None

    # -- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._thread_main, name=f"run-{self.run_id}", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        return self.done.wait(timeout_s)

    def _thread_main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        with self._pending_lock:
            self._loop_open = True
        reason, detail = "error", ""
        try:
            self._main_task = loop.create_task(self._main())
            reason = loop.run_until_complete(self._main_task)
        except BaseException as exc:
            if self._stopped_starting and isinstance(exc, asyncio.CancelledError):
                reason, detail = "stopped", "stopped while its engines were starting"
            else:  # the run failed: recorded as its end, with the reason
                detail = failure_detail(exc)
                log.exception("run %s failed", self.run_id)
                self.error = detail
        finally:
            with self._pending_lock:
                self._loop_open = False
                pending, self._pending = self._pending, set()
            for fut in pending:
                if not fut.done():
                    fut.set_exception(RunNotLiveError(f"run {self.run_id} has ended"))
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
            if reason == "error" and self._ended_as is not None:
                reason = self._teardown_failed(self._ended_as)
            final = {"completed": RunState.COMPLETED, "stopped": RunState.STOPPED}.get(
                reason, RunState.FAILED
            )
            # Told the state the run ends in, as its other commands and a later server say it
            self.gateway.close(final.value)
            if self.runtime is None or self.runtime.phase == "startup":
                # It ended before the runtime ran (stopped while starting), so nobody recorded its end.
                self.recorder.publish(RunEnded(reason, detail))
            self.flushing.set()
            self.recorder.close()
            self._set_state(final, self.error)
            self.done.set()

    def _teardown_failed(self, ended_as: str) -> str:
        """The run's runtime ended `ended_as` (completed or stopped), its every group accounted for and
        that end in its events (`RunEnded`, which the store takes first), and the teardown after it (its
        engines' clients closed, their processes stopped) failed. Nothing of the run is lost, so it ends
        as recorded; the failure is logged. Before, the run ended `failed` here while the store kept
        `completed`: its API said one and, once it had let the run go, the other."""
        log.warning("run %s: %s; its teardown then failed: %s (it stays %s: its every batch and group "
                    "are accounted for)", self.run_id, ended_as, self.error, ended_as)  # fmt: skip
        self.error = None
        return ended_as

    async def _main(self) -> str:
        self.started_wall = time.time()
        async with open_ports(self.spec, self.policy, self.work_dir, self._lanes) as ports:
            self.ports = ports
            runtime = Runtime(
                policy=self.policy,
                engines=ports.engines,
                engine_slots=ports.engine_slots,
                lanes=ports.lanes,
                source=ports.source,
                trainer=self.gateway,
                bus=self.recorder.bus,
                faults=ports.faults,
                supervisor=ports.supervisor,
                lane_adapter=ports.lane_adapter,
                weights_from_disk=ports.weights_dir is not None,
                history=RUNTIME_HISTORY,
            )
            for name, detail in ports.down_at_start.items():
                log.warning("%s %s: the run starts without it and restarts it", name, detail)
                runtime.engine_down_at_start(name, detail)
            resume = self._resume
            if resume is not None:
                _continue_numbering(runtime, resume.group_offset, resume.batch_offset)
                runtime.before_batches = self.gateway.restored_steps
            self.runtime = runtime
            if runtime.gate is None:  # lanes whose slots the gate cannot read (Celery's): no gate
                self.knobs["agent_gate"] = None
            # "running" once the runtime executes, not before its first step: a command sent the moment
            # the state says so (a change of K starts groups) needs the runtime's task group.
            runtime.on_collecting = self._collecting
            runtime.on_trainer_done = self._trainer_done
            batches = self.spec.batches or UNTIL_STOPPED
            if resume is not None:  # the batches its earlier lives delivered count towards them
                batches = max(batches - resume.batch_offset, 0)
            try:
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    run = tg.create_task(runtime.run(batches=batches))
                    if resume is not None and resume.version > 0:
                        # A resumed run continues at its last published version: engines roll to it.
                        asyncio.get_running_loop().call_soon(
                            self._publish, resume.version, resume.weights_path, "resume"
                        )
                    if self.spec.trainer is TrainerKind.SENTINEL:
                        tg.create_task(self._sentinel_client(ports))
                    if not isinstance(self.loop, PacedLoop):  # a simulated run's clock waits instead
                        tg.create_task(self._hold_for_store(runtime, run))
                    await asyncio.wait([run])
                    if not run.cancelled() and run.exception() is None:  # its end recorded and stored
                        self._ended_as = "stopped" if runtime.stop_requested else "completed"
                    self._trainer_done()  # a run that failed never called it: its thread says "failed" next
            finally:
                for client in self.engines():  # a restarted engine's client is the runtime's, not the ports'
                    await client.aclose()
            run.result()
            return "stopped" if runtime.stop_requested else "completed"

    async def _hold_for_store(self, runtime: Runtime, run: asyncio.Task[Any]) -> None:
        """Hold the run (no turn starts, no update begins: `Runtime.hold`, as an operator's pause, the
        engines left serving the turns in flight) while its store sink would drop events: its buffer
        `STORE_HOLD_SHARE` full and its spill's disk refusing (the database and the spill on one full
        disk); released once the buffer is down to `STORE_RELEASE_SHARE` or the disk takes writes again.
        The work in flight while held is bounded (each attempt stops at its next turn), so the buffer's
        rest holds its events. Before, events past the buffer were dropped, counted, for as long as the
        disk stayed full."""
        bus = self.recorder.bus
        while not run.done():
            await asyncio.sleep(STORE_CHECK_S)
            if self._stopping():
                return  # `stop` released it: a stopping run's last events are few
            share = STORE_RELEASE_SHARE if self.held_for_store else STORE_HOLD_SHARE
            # the disk probed (off the loop) only for a buffer that filled: most checks cost nothing
            at_risk = bus.filled(share) and await asyncio.to_thread(bus.at_risk, share)
            if at_risk == self.held_for_store or self._stopping() or run.done():
                continue
            self.held_for_store = at_risk
            if self.state is not RunState.PAUSED:  # an operator's pause holds it already, and outlasts this
                runtime.hold(at_risk)
            if at_risk:
                last_error = bus.stats().get("store", {}).get("last_error") or "the disk refused a write"
                why = last_error.splitlines()[0]
                log.warning(
                    "run %s: held, starting no turn: %d events wait to be stored and neither the database "
                    "nor the spill (%s) takes them (%s); it goes on once they do",
                    self.run_id, bus.backlog(), ", ".join(bus.spill_directories()), why,
                )  # fmt: skip
            else:
                log.warning("run %s: goes on: its events are being stored again (%d wait)", self.run_id,
                            bus.backlog())  # fmt: skip

    def _trainer_done(self) -> None:
        """The trainer loop is over: the run has ended for its trainer (its `batches/next`, a
        publication: `publish`, a policy change), not a word of its own, while the run drains its turns
        and weight updates. Told once the run had drained, a publication meanwhile was published, 202,
        its weight update begun on a run that had ended for its trainer and waited for by the drain, and
        one as the run's loop closed was told "is running, not executing". A stopped run's trainer is
        told so at once (`stop`); a completed loop's trainer is told how the run ended once the drain is
        over (the run's thread: `gateway.close`), since a drain that fails ends the run `failed`."""
        if self._runtime().stop_requested:
            self.gateway.close("stopped")
        else:
            self.gateway.trainer_loop_over()

    def _stopping(self) -> bool:
        return self.state is RunState.STOPPING  # read again after an await: `stop` may have run meanwhile

    def engines(self) -> list[Engine]:
        """The run's engine clients now: a restarted engine has a new one (on its new port)."""
        if self.runtime is not None:
            return list(self.runtime.pool.by_name.values())
        return list(self.ports.engines) if self.ports is not None else []

    def _collecting(self) -> None:
        """The runtime executes: the run is running, or paused again when it was paused before the
        restart that resumed it (held before any of its turns can start: an operator's pause outlives
        a crash)."""
        if self._start_paused:
            self._start_paused = False
            self._hold(True)
            self._set_state(RunState.PAUSED, None)
        else:
            self._set_state(RunState.RUNNING, None)

    def _store_behind(self) -> bool:
        """Whether the simulated clock should stand still for the store (`RunRecorder.backlogged`); not
        while the run stops: its last events are few, and a stop must not wait on a database that is
        away (closing the recorder waits for them, `RunRecorder.close_wait_s`)."""
        return self.state is not RunState.STOPPING and self.recorder.backlogged()

    def _set_state(self, state: RunState, error: str | None) -> None:
        self.state = state
        self._on_state(self, state, error)

    # -- commands from other threads ------------------------------------------------------------------

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run `fn(*args)` on the run's loop; its result (or exception) arrives in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            with self._pending_lock:
                if fut not in self._pending:
                    return  # failed already: the run ended before this command's turn came
                self._pending.discard(fut)
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, who turns it into an answer
                fut.set_exception(exc)

        with self._pending_lock:
            # Under the lock the loop cannot close: the run's thread marks it closed under this lock
            # (and fails every pending command) before it closes it.
            # A run still starting takes commands too (stop does; the others refuse by its state).
            if not self._loop_open:
                if self.state in TERMINAL_RUN_STATES:  # as after a restart, when the store answers
                    raise RunNotLiveError(f"run {self.run_id!r} has ended ({self.state.value})")
                raise RunNotLiveError(f"run {self.run_id} is {self.state.value}, not executing")
            self._pending.add(fut)
            self.loop.call_soon_threadsafe(call)
        return fut

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    # Everything below runs on the run's loop.

    def _runtime(self) -> Runtime:
        if self.runtime is None:
            raise RunNotLiveError(f"run {self.run_id} has not started")
        return self.runtime

    def _require(self, *states: RunState) -> None:
        if self.state not in states:
            allowed = " or ".join(s.value for s in states)
            raise IllegalRunStateError(f"run {self.run_id} is {self.state.value}; this needs it {allowed}")

    def _published_version(self) -> int:
        return self.runtime.version if self.runtime is not None else 0

    def patch_problem(self, patch: PolicyPatch) -> str | None:
        """Why `patch` cannot apply to this run whatever its state: its S must be one the run's own
        config would take (`surplus_problem`: none on the sync rung, a local run's config's bound, a
        simulated run's (B + S) × G within the simulator's; B and G are fixed for the run's life); its
        agent gate needs a run that has the gate (`has_gate`)."""
        if patch.agent_gate is not None and not self.has_gate():
            return NO_GATE.format(self.run_id)
        wanted = patch.surplus_groups
        if wanted is None:
            return None
        b, g = self.policy.groups_per_batch, self.policy.group_size
        problem = surplus_problem(self.spec.kind, self.spec.policy, wanted, b, g)
        if problem is None and not patch.confirm_large_change:
            problem = large_surplus_change(b, g, int(self.knobs["surplus_groups"]), wanted, CONFIRM_LARGE)
        return problem

    def has_gate(self) -> bool:
        """Whether the run has an agent-phase gate to change: its policy has one, and its runtime (once
        there is one) made it (`AgentGate.for_lanes`: not with Celery lanes)."""
        runtime = self.runtime
        return self.policy.agent_gate is not None and (runtime is None or runtime.gate is not None)

    def set_policy_marked(
        self, patch: PolicyPatch, actor: str, command_id: str = ""
    ) -> tuple[dict[str, Any], int]:
        """`set_policy` (on the run's loop), with the sequence number of the last event published by then:
        its `PolicyChanged` events are at or before it, for `stored` to wait on."""
        return self.set_policy(patch, actor, command_id), self._last_seq()

    def publish_marked(
        self, version: int, path: str | None, actor: str, command_id: str = ""
    ) -> tuple[dict[str, Any], int]:
        """`publish`, with the sequence number its `VersionPublished` event has or precedes."""
        return self.publish(version, path, actor, command_id), self._last_seq()

    def published_again(
        self, version: int, path: str | None, sentinel: bool
    ) -> tuple[dict[str, Any], int] | None:
        """A repeat of the newest publication: `version` is the version published last, with the same
        weights (the same `path`, or a sentinel again). Its rollout and the sequence number of the last
        event published by now (the publication's is at or before it), for `stored` to wait on; None
        for anything else, which `publish` takes as a new publication (or refuses as not newer)."""
        runtime = self.runtime
        if runtime is None or version != runtime.version:
            return None
        weights = self.sentinel_path(version) if sentinel else path
        if _spelling_free(runtime.weights_path(version)) != _spelling_free(weights):
            return None
        return self.rollout(version), self._last_seq()

    def _last_seq(self) -> int:
        return self.recorder.bus.published - 1

    async def stored(self, seq: int, what: str) -> bool:
        """Wait, at most `STORED_WAIT_S`, until the event numbered `seq` is in the store: whether it is
        (a warning when not). The API and the dashboard answer an operator or a trainer after this, and
        answer 503 when it is not: the caller asks again (a repeat is safe, `published_again`).
        - The store's policy is written by the event sink from the `PolicyChanged` events in the order
          they were made; a write of the caller's own could land after a later change's.
        - A run resumed after a kill -9 goes on from what its store holds: a change or a publication
          answered before it was stored could be lost with the process, and a trainer told that version 7
          was published would then be offered the batches towards version 7 again."""
        if await asyncio.to_thread(self.recorder.wait_stored, seq, STORED_WAIT_S):
            return True
        log.warning("run %s: %s, not yet in the store after %.0f s", self.run_id, what, STORED_WAIT_S)
        return False

    def set_policy(self, patch: PolicyPatch, actor: str, command_id: str = "") -> dict[str, Any]:
        """Apply `patch`'s changes; each publishes a `PolicyChanged` carrying `command_id`. Not once the
        trainer loop is over (`_trainer_done`): a change then altered the settings of a run that had
        ended for its trainer."""
        self._require(RunState.RUNNING, RunState.PAUSED)
        self._require_trainer_loop("its policy is fixed")
        runtime = self._runtime()
        for name, new in patch.changes().items():
            old = self.knobs[name]
            if old == new:
                continue
            if name == "surplus_groups":
                runtime.set_surplus(int(new), actor, command_id)
            elif name == "max_staleness":
                runtime.set_max_staleness(int(new), actor, command_id)
            elif name == "max_updating_engines":
                runtime.plan.max_updating = int(new)  # paces the next steps of the rollout
                runtime.plan.may_join = None  # a maximum set by hand is kept as given, not free-slot paced
                self.recorder.publish(PolicyChanged(name, old, new, actor, command_id))
            elif name == "pause_mode":
                runtime.policy = runtime.policy.with_changes(pause_mode=PauseModeName(new))
                self.recorder.publish(PolicyChanged(name, old, new, actor, command_id))
            elif name == "agent_gate":
                runtime.set_agent_gate(float(new), actor, command_id)
            self.knobs[name] = new
        return dict(self.knobs)

    def publish(self, version: int, path: str | None, actor: str, command_id: str = "") -> dict[str, Any]:
        self._require(RunState.RUNNING, RunState.PAUSED)
        if self._runtime().stop_requested:
            raise IllegalRunStateError(f"run {self.run_id!r} is stopping; it takes no new version")
        self._require_trainer_loop("it takes no new version")
        return self._publish(version, path, actor, command_id)

    def _require_trainer_loop(self, refused: str) -> None:
        """Refuse a command, saying `refused`, once the run's trainer loop is over (`_trainer_done`): the
        run has ended for its trainer (409 "has ended", the client's `RunEnded`) while it drains. Until
        the drain is over the state it ends in is not known: app.service.commands waits for it."""
        if (ended := self.gateway.closed) is not None:
            raise IllegalRunStateError(f"run {self.run_id!r} has ended ({ended}); {refused}")
        if self.gateway.ending:
            raise IllegalRunStateError(f"run {self.run_id!r} is ending (its trainer loop is over); {refused}")

    def _publish(self, version: int, path: str | None, actor: str, command_id: str = "") -> dict[str, Any]:
        runtime = self._runtime()
        # ValueError for a version not newer than the current one
        runtime.publish(version, path, actor, command_id)
        self.gateway.notify()
        return self.rollout(version)

    def rollout(self, version: int) -> dict[str, Any]:
        """A rollout's progress engine by engine: the run's rollout log (the stored stream's rules, so
        the answer is the one the store gives once the run has ended) and the runtime's plan. KeyError
        for a version never published; `RolloutForgottenError` for one the log no longer keeps."""
        runtime = self._runtime()
        book = self.recorder.rollouts
        row = book.rollouts.get(version)
        if row is None:
            raise RolloutForgottenError(version) if book.forgot(version) else KeyError(version)
        plan = runtime.plan
        return rollout_answer(
            row,
            newest=max(book.newest, runtime.version),
            engines=list(plan.versions),
            served=dict(plan.versions),
            steps=book.steps_from(version),
            updating=dict(plan.updating),
            t0=book.first_t,
            knobs=self.knobs,
            run_ended=book.ended,
        )

    def drain_engine(self, name: str, actor: str, command_id: str = "") -> dict[str, Any]:
        """Take `name` out of rotation: it starts no new turn and no update; turns in flight on it
        finish. Refused for the last engine still serving."""
        self._require(RunState.RUNNING, RunState.PAUSED)
        runtime = self._runtime()
        plan = runtime.plan
        if name not in plan.versions:
            raise KeyError(name)
        if name in plan.drained:
            return self.engine_view(name)
        serving = [e for e in plan.versions if e not in plan.down and e not in plan.drained]
        if serving == [name]:
            raise IllegalRunStateError(
                f"engine {name} is the last one serving; draining it would stop the run"
            )
        # No new turn and no new update on it (one under way finishes); calls in flight go on. It
        # stays out of rotation if it dies and is restarted meanwhile.
        runtime._do_updates(plan.set_drained(name, True))
        self.recorder.publish(
            EngineStateChanged(name, "draining", rotation_detail("drained", actor), command_id)
        )
        return self.engine_view(name)

    def serve_engine(self, name: str, actor: str, command_id: str = "") -> dict[str, Any]:
        """Put a drained engine back into rotation; a rolling update brings it to the newest version."""
        self._require(RunState.RUNNING, RunState.PAUSED)
        runtime = self._runtime()
        plan = runtime.plan
        if name not in plan.versions:
            raise KeyError(name)
        if name not in plan.drained:
            raise IllegalRunStateError(f"engine {name} is not drained")
        runtime._do_updates(plan.set_drained(name, False))
        runtime.pool.wake()
        self.recorder.publish(
            EngineStateChanged(name, "serving", rotation_detail("returned", actor), command_id)
        )
        return self.engine_view(name)

    def engine_view(self, name: str) -> dict[str, Any]:
        runtime = self._runtime()
        plan = runtime.plan
        state = "draining" if name in plan.drained else "down" if name in plan.down else "serving"
        if name in plan.updating:
            state = "updating"
        return {"engine": name, "state": state, "version": plan.versions[name],
                "turns_in_flight": runtime.pool.active.get(name, 0)}  # fmt: skip

    def pause(self) -> None:
        self._require(RunState.RUNNING)
        self._hold(True)
        self._set_state(RunState.PAUSED, None)

    def resume(self) -> None:
        self._require(RunState.PAUSED)
        self._hold(False)
        self._set_state(RunState.RUNNING, None)

    def _hold(self, paused: bool) -> None:
        if isinstance(self.loop, PacedLoop):  # simulated time stops: nothing progresses until resume
            if paused:
                self.loop.pause()
            else:
                self.loop.resume()
        elif paused:
            self._runtime().hold(True)  # no turn starts and no update begins, on any engine
            self._engines_paused(True)
        else:
            self._engines_paused(False)
            self._runtime().hold(self.held_for_store)  # resumed, but still held for the store

    def _engines_paused(self, paused: bool) -> None:
        """Local runs: every engine holds its in-flight turns (`keep`) and starts none until resumed."""
        assert self._tg is not None
        for name in self._runtime().pool.by_name:
            self._tg.create_task(self._pause_engine(name, paused))

    async def _pause_engine(self, name: str, paused: bool) -> None:
        # One lock for every pause and resume: they reach the engines in the order they were asked
        # (asyncio's lock is first come, first served, and tasks start in creation order).
        async with self._pausing:
            engine = self._runtime().pool.by_name[name]  # now: a restart meanwhile replaced its client
            try:
                await (engine.pause(PauseMode.KEEP) if paused else engine.resume())
            except EngineError as exc:  # it died: the runtime restarts it; the run must go on
                log.warning("engine %s: %s failed: %s", name, "pause" if paused else "resume", exc)

    def stop(self) -> bool:
        """Stop the run; False when it was already stopping or stopped (a second stop, from a
        double-click or a retry, asks for what is under way: not an error)."""
        if self.state in (RunState.STOPPING, RunState.STOPPED):
            return False
        self._require(RunState.CREATED, RunState.RUNNING, RunState.PAUSED)
        if self.state is RunState.CREATED:
            # Still starting (engines coming up): nothing ran yet, so the start-up is cancelled, and
            # open_ports' cleanup stops whatever engines it had started.
            self._stopped_starting = True
            self._set_state(RunState.STOPPING, None)
            self.gateway.close("stopped")
            if self._main_task is not None:
                self._main_task.cancel()
            return True
        if isinstance(self.loop, PacedLoop):
            self.loop.resume()  # the run must reach its end: cleanups take (simulated) time
            self.loop.hurry()  # which nobody waits on: it ends in seconds, not minutes of wall time
        elif self.state is RunState.PAUSED or self.held_for_store:
            if self.state is RunState.PAUSED:
                self._engines_paused(False)
            self.held_for_store = False  # its last events are few: the buffer's rest holds them
            self._runtime().hold(False)
        self._set_state(RunState.STOPPING, None)
        self._runtime().request_stop()
        self.gateway.close("stopped")
        return True

    def live(self) -> dict[str, Any]:
        """What the run looks like now (safe from any thread: it reads values the loop replaces)."""
        runtime = self.runtime
        out: dict[str, Any] = {"state": self.state.value, "policy": dict(self.knobs)}
        out.update(self.recorder.view.as_dict())
        out["batches_unacked"] = len(self.gateway.pending())
        out["events_unwritten"] = self.recorder.bus.backlog()  # in the store sink's memory and spill
        out["held_for_store"] = self.held_for_store
        store = self.recorder.bus.stats().get("store")
        if store is not None:  # the store was away or slow: what waited on local disk, and waits now
            out["events_spill"] = {k: store[k] for k in ("spilled", "recovered", "spill_bytes", "dropped")}
        if isinstance(self.loop, PacedLoop):
            out["pace"] = self.loop.pace()
        if runtime is not None:
            out["trainer_version"] = runtime.version
            out["groups_live"] = runtime.scheduler.groups_live
            out["engine_versions"] = dict(runtime.plan.versions)
            out["engines_updating"] = sorted(runtime.plan.updating)
            out["lanes"] = {
                name: {"queue_depth": s.queue_depth, "busy": s.busy, "completed": s.completed}
                for name, s in runtime.lanes.stats().items()
            }
        return out

    # -- the built-in sentinel trainer, one client of the gateway ---------------------------------------

    @property
    def restarting(self) -> bool:
        """Whether this is a run of the previous server still starting again here (a local run's engines
        take seconds): its commands are asked again later, as while its stored stream is replayed."""
        return self._resume is not None and self.state is RunState.CREATED

    def sentinel_problem(self) -> str | None:
        """Why this run's engines cannot take a sentinel version, or None: engines of real weights
        (`engines.sentinel: false`) refuse every checkpoint of the sentinel tensor alone, one engine
        after another, and the run stalls once they are K versions behind. The rule is the launch
        check's (`sentinel_trainer_problem`); the advice differs, since a running run keeps its engines."""
        if self.spec.config is None:  # a simulated run: its engines take any version
            return None
        if sentinel_trainer_problem(self.spec.config.engines, "engines.sentinel", "sentinel: true") is None:
            return None
        return (
            "this run's engines load real weights (config.engines.sentinel: false) and refuse sentinel "
            "weights, every version, so the run would stall once they are K versions behind; publish "
            f"full checkpoints instead (POST /api/runs/{self.run_id}/weights with a path)"
        )

    def sentinel_weights(self, version: int) -> str | None:
        """Where a sentinel `version` lives for engines that load weights from disk (a local run's
        embedded engines): a directory written here; None where a sentinel needs no files (sim).
        ValueError (`sentinel_problem`), before anything is written, for engines that would refuse it.
        Blocking: call it off the run's loop."""
        if (problem := self.sentinel_problem()) is not None:
            raise ValueError(problem)
        target = self.sentinel_path(version)
        if target is not None:
            save_sentinel(Path(target), float(version))
        return target

    def sentinel_path(self, version: int) -> str | None:
        """Where `sentinel_weights` keeps a sentinel `version` (None where it needs no files); writes
        nothing."""
        if self.ports is None or self.ports.weights_dir is None:
            return None
        return str(self.ports.weights_dir / f"v{version}")

    async def _sentinel_client(self, ports: RunPorts) -> None:
        """Takes each batch, "trains" for `sentinel_step_s`, publishes a sentinel version, acks."""
        step_s = self.spec.sentinel_step_s
        while True:
            try:
                offer = await self.gateway.next_batch(3600.0, to_loop_end=True)
            except RunClosedError:
                return
            if offer is None:
                continue
            await asyncio.sleep(step_s)
            version = int(offer.payload["publish_version"])

            async def weights(version: int = version) -> str | None:
                return await asyncio.to_thread(self.sentinel_weights, version)

            # A disk that refuses the files (full) holds the step until it takes them, as a slow trainer
            what = f"run {self.run_id}: sentinel weights v{version}"
            path = await until_written(weights, what, lambda: self._runtime().stop_requested, asyncio.sleep)
            runtime = self._runtime()
            if not runtime.stop_requested and runtime.version < version:
                self._publish(version, path, "sentinel-trainer")
            self.gateway.ack(offer.batch_id, "sentinel-trainer")
            if ports.weights_dir is not None:
                floor = min([*runtime.plan.versions.values(), runtime.plan.target])
                await asyncio.to_thread(prune_sentinel_weights, ports.weights_dir, floor)


def prune_sentinel_weights(weights_dir: Path, floor: int) -> int:
    """Remove the sentinel weights of every version below `floor` (the oldest version an engine serves,
    or the newest published if lower: none of them may be asked for again: a restarted engine is brought
    to the newest or back to the one it served) from `weights_dir`; returns how many went. Before, the
    built-in trainer kept every version it wrote: 8,500 directories a day in the demo."""
    removed = 0
    for entry in weights_dir.glob("v*"):
        digits = entry.name[1:]
        if digits.isdigit() and int(digits) < floor and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


# PolicyPatch's
LIVE_KNOBS = ("surplus_groups", "max_staleness", "max_updating_engines", "pause_mode", "agent_gate")


def resumed_policy(policy: PolicyConfig, stored: Mapping[str, Any]) -> PolicyConfig:
    """A resumed run's policy: its spec's (`policy`), with the knobs changed live (`set_policy`, stored
    by their `PolicyChanged` events) and the ready cap its first start resolved (`run_policy`: B + S
    for an external trainer, which the stored spec no longer tells from one given as null) taken from
    the stored policy (`stored`), so a restart undoes neither."""
    changes: dict[str, object] = {
        k: stored[k] for k in LIVE_KNOBS if k in stored and stored[k] != getattr(policy, k)
    }
    if "max_updating_engines" in changes:  # set by hand: kept as given, not free-slot paced (set_policy)
        changes["update_pacing"] = UpdatePacing.FIXED
    if "ready_surplus" in stored:
        changes["ready_surplus"] = stored["ready_surplus"]
    return policy.with_changes(**changes) if changes else policy


def _continue_numbering(runtime: Runtime, first_group: int, first_batch: int) -> None:
    """A resumed run numbers its groups and batches after its predecessor's, so ids never collide in
    the store. (The scheduler has no public parameter for this yet; these are its two counters.)"""
    runtime.scheduler._next_group = first_group
    runtime.scheduler._batches = first_batch


def _spelling_free(path: str | None) -> str | None:
    """`path` without what only changes its spelling: repeated `/`, `.` names and a trailing `/` (a
    trainer retrying with `/ckpt/v5/` for `/ckpt/v5` sends the same weights). `..` is kept, unlike
    `os.path.normpath`: after a symbolic link it leads elsewhere than the name before it. Nothing on
    disk is read."""
    if path is None:
        return None
    names = [name for name in path.split("/") if name not in ("", ".")]
    return "/" + "/".join(names) if path.startswith("/") else "/".join(names)
