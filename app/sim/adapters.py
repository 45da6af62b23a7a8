"""Simulated engines, sandboxes, agent and trainer: the ports the production runtime drives, on
virtual time and simulated CPU pools (see app.sim.cpu for the CPU model)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.engines.errors import EngineUnavailable, TurnAborted
from app.runtime.context import Agent, AttemptContext, AttemptOutcome
from app.runtime.ports import TrainingBatch
from app.sandboxes.base import ExecResult, Sandbox
from app.sim.cpu import CpuPool, GroupedStream, Stream
from app.sim.lanes import GroupLongOps, LongOps
from app.sim.workload import FaultSpec, Trajectory, TrajectorySource, Workload
from app.tasks.spec import TaskSpec

_current_task = asyncio.current_task


class SimInfraError(RuntimeError):
    """A simulated infrastructure failure (the sandbox died)."""


class SimEngine:
    """An engine whose turns take `llm_s` of work on its CPU pool; paused with `keep`, they freeze; paused
    with `abort`, they end at once as aborted (`TurnAborted`, as a real engine's answer with
    `finish_reason: "abort"` is read), and their work so far is lost.

    Injected faults (the workload's `faults`): while down, every call fails as an unreachable engine
    does (`EngineUnavailable`), a turn in flight when it dies fails then, and it comes back unpaused on
    its initial weights (version 0); an update to a hung version never finishes."""

    def __init__(
        self,
        name: str,
        pool: CpuPool,
        update_s: float,
        tokens_per_s: float,
        demand: float,
        faults: Sequence[FaultSpec] = (),
    ) -> None:
        self.name = name
        self._down = sorted((f.at_s, f.at_s + f.for_s) for f in faults if f.kind == "engine_down")
        self._hang = {f.version for f in faults if f.kind == "update_hang"}
        self._stream: Stream = pool.stream(name, serving=True)
        self._pool = pool
        self._update_s = update_s
        self._tokens_per_s = tokens_per_s
        self._demand = demand
        self._version = 0
        self._active = 0
        self._turns: dict[asyncio.Task[Any], None] = {}  # the tasks of the turns in flight, in order
        self._aborting: set[asyncio.Task[Any]] = set()  # those an abort cancelled

    def _check(self, route: str) -> None:
        now = asyncio.get_running_loop().time()
        if any(start <= now < end for start, end in self._down):
            self._version = 0  # whatever it had is gone
            self._stream.set_factor(1.0)
            raise EngineUnavailable(f"sim://{self.name}", route, "unreachable (injected: engine down)")

    def _next_death(self) -> float | None:
        now = asyncio.get_running_loop().time()
        return next((start for start, _ in self._down if start > now), None)

    async def generate(self, request: TurnRequest) -> TurnResult:
        faulty = bool(self._down)
        if faulty:
            self._check("/v1/completions")
        version = self._version
        llm_s = float(request.meta.get("llm_s", 0.0))
        if self._active == 0 and self._demand:
            self._pool.change_demand(self._demand)
        self._active += 1
        task: Any = _current_task()
        turns = self._turns
        turns[task] = None
        try:
            if faulty:  # a deadline only where the engine may die under the turn
                try:
                    async with asyncio.timeout_at(self._next_death()):
                        await self._stream.run(llm_s)
                except TimeoutError:
                    self._check("/v1/completions")  # it died under the turn
                    raise
            else:
                await self._stream.run(llm_s)
        except asyncio.CancelledError:
            if task in self._aborting:
                self._aborting.discard(task)
                if task.uncancel() == 0:  # cancelled by the abort alone
                    raise TurnAborted(
                        f"sim://{self.name}", "/v1/completions", "aborted (paused to load weights)"
                    ) from None
            raise
        finally:
            del turns[task]
            self._active -= 1
            if self._active == 0 and self._demand:
                self._pool.change_demand(-self._demand)
        return TurnResult(text="", weight_version=version, tokens=max(1, round(llm_s * self._tokens_per_s)))

    async def pause(self, mode: PauseMode) -> None:
        self._check("/pause")
        if mode is PauseMode.KEEP:
            self._stream.set_factor(0.0)
        elif mode is PauseMode.ABORT:
            for task in self._turns:
                if task not in self._aborting:
                    self._aborting.add(task)
                    task.cancel()

    async def resume(self) -> None:
        self._check("/resume")
        self._stream.set_factor(1.0)

    async def publish_weights(self, version: int, path: str | None) -> None:
        self._check("/update_weights")
        if version in self._hang:
            self._hang.discard(version)  # hangs once; a retry after the timeout goes through
            await asyncio.Event().wait()
        await asyncio.sleep(self._update_s)
        self._check("/finish_weight_update")
        self._version = version

    async def weight_version(self) -> int:
        self._check("/weight_info")
        return self._version

    async def health(self) -> bool:
        try:
            self._check("/health")
        except EngineUnavailable:
            return False
        return True

    async def aclose(self) -> None:
        return None


_OK = ExecResult(exit_code=0, output="")


@dataclass(frozen=True)
class SimLaneCpus:
    """Where each kind of sandbox operation runs (its lane's CPU stream) and the cores it keeps busy."""

    reset: tuple[Stream | LongOps | GroupLongOps, float]  # long resets may leave the lane (app.sim.lanes)
    exec: tuple[Stream, float]
    validate: tuple[Stream, float]
    cleanup: tuple[Stream, float]

    def by_group(self) -> bool:
        """Whether the lanes share their cores by group age (then each attempt takes `for_group`)."""
        return isinstance(self.exec[0], GroupedStream)

    def for_group(self, group: int) -> SimLaneCpus:
        """The streams of `group`'s operations, in lanes that share their cores by group age."""

        def mine(stream: Stream) -> Stream:
            return stream.for_group(group) if isinstance(stream, GroupedStream) else stream

        reset, demand = self.reset
        if isinstance(reset, LongOps) and isinstance(reset.lane, GroupedStream):
            reset = GroupLongOps(reset, reset.lane.for_group(group))
        elif isinstance(reset, Stream):
            reset = mine(reset)
        return SimLaneCpus(
            (reset, demand),
            (mine(self.exec[0]), self.exec[1]),
            (mine(self.validate[0]), self.validate[1]),
            (mine(self.cleanup[0]), self.cleanup[1]),
        )


class SimSandbox:
    """Sandbox operations cost the drawn durations as CPU work in the pool of the lane running them."""

    __slots__ = ("_lanes", "_turn", "trajectory")  # one per attempt: no instance dict

    def __init__(self, trajectory: Trajectory, lanes: SimLaneCpus) -> None:
        self.trajectory = trajectory
        self._lanes = lanes
        self._turn = 0

    # reset, exec and cleanup return their stream's coroutine, awaited at once by the lane: the same as
    # `async def` methods, without a coroutine frame of their own on every operation.

    def reset(self, task: TaskSpec, cpus: Sequence[int] | None = None) -> Coroutine[Any, Any, ExecResult]:
        stream, demand = self._lanes.reset
        return stream.run(self.trajectory.reset_s, demand, _OK)

    def exec(
        self, command: str, timeout_s: float, cpus: Sequence[int] | None = None
    ) -> Coroutine[Any, Any, ExecResult]:
        turns = self.trajectory.turns
        turn = turns[min(self._turn, len(turns) - 1)]
        self._turn += 1
        stream, demand = self._lanes.exec
        return stream.run(turn.tool_s, demand, _OK)

    async def validate(self, cpus: Sequence[int] | None = None) -> float:
        stream, demand = self._lanes.validate
        await stream.run(self.trajectory.validate_s, demand)
        if self.trajectory.infra_error:
            raise SimInfraError("sandbox lost during validation")
        return self.trajectory.reward

    def cleanup(self, cpus: Sequence[int] | None = None) -> Coroutine[Any, Any, None]:
        stream, demand = self._lanes.cleanup
        return stream.run(self.trajectory.cleanup_s, demand)


class SimAgent:
    """Plays a drawn trajectory: reset, turns of engine time then tool time, capped, then validation.
    With `record`, each turn leaves a transcript entry (its policy version, tokens and times), as a real
    agent's does: a trainer taking a simulated run's batches sees the versions it trains on."""

    __slots__ = ("record", "tally", "trajectory")  # one per attempt: no instance dict

    def __init__(self, trajectory: Trajectory, record: bool = False, tally: list[int] | None = None) -> None:
        self.trajectory = trajectory
        self.record = record
        self.tally = tally  # [attempts played to their validation, those cut short by the run]

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        await ctx.reset()
        turns = 0
        timed_out = False
        transcript: list[dict[str, object]] = []
        try:
            async with asyncio.timeout(self.trajectory.timeout_s):
                for turn in self.trajectory.turns:
                    result = await ctx.generate(TurnRequest(prompt="", meta={"llm_s": turn.llm_s}))
                    if self.record:
                        transcript.append(
                            {
                                "turn": turns,
                                "weight_version": result.weight_version,
                                "tokens": result.tokens,
                                "llm_s": turn.llm_s,
                                "tool_s": turn.tool_s,
                            }
                        )
                    await ctx.exec("", turn.tool_s + 1.0)
                    turns += 1
        except TimeoutError:
            timed_out = True
        reward = await ctx.validate()
        cut = turns < self.trajectory.turns_in_time
        if cut:
            # Its time ran out before turns an idle machine finishes in time (engines down or slow, a
            # lane queue): the work its drawn reward stands for was not done, so its tests fail.
            reward = 0.0
        if self.tally is not None:
            self.tally[0] += 1
            self.tally[1] += cut
        return AttemptOutcome(reward=reward, turns=turns, timed_out=timed_out, transcript=transcript)


class SimTrainer:
    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        await asyncio.sleep(self.step_s)
        return None


_SIM_TASK = TaskSpec(name="sim", instruction="", root=Path("."), validation="true")


class SimSource:
    """Attempts for the runtime, built from seeded trajectory draws."""

    def __init__(self, trajectories: TrajectorySource, lanes: SimLaneCpus, record: bool = False) -> None:
        self.trajectories = trajectories
        self._lanes = lanes
        self._by_group = lanes.by_group()
        self._record = record  # transcripts: for a trainer taking the batches (the service's sim runs)
        # Attempts played to their validation, and those the run cut short (their time ran out before
        # the turns an idle machine finishes in time): they fail, so a policy that starves its attempts
        # delivers fast batches of failures, and the report says how many.
        self.tally = [0, 0]

    def make_attempt(
        self, group_id: int, task_index: int, attempt: int
    ) -> tuple[Agent, TaskSpec | None, Sandbox]:
        trajectory = self.trajectories.trajectory(task_index, attempt)
        lanes = self._lanes.for_group(group_id) if self._by_group else self._lanes
        return SimAgent(trajectory, self._record, self.tally), _SIM_TASK, SimSandbox(trajectory, lanes)

    def stopping(self) -> None:
        """Simulated sandboxes wait on nothing outside the simulation."""


def lane_cpu_split(workload: Workload) -> dict[str, tuple[int, ...]]:
    """Give each lane whole cores, in proportion to the cores its full slots would use, from the cores
    left after serving."""
    demand = workload.cpus.sandbox_demand.by_lane()
    slots = {lane: n * max(demand[lane], 1e-3) for lane, n in workload.lanes.slots().items()}
    first = workload.cpus.serving
    free = workload.cpus.total - first
    if free < len(slots):
        raise ValueError(f"cpus: {free} cores left after serving, but the 4 lanes need at least one each")
    total_slots = sum(slots.values())
    shares = {lane: max(1, round(free * n / total_slots)) for lane, n in slots.items()}
    while sum(shares.values()) > free:
        biggest = max(shares, key=lambda lane: shares[lane])
        shares[biggest] -= 1
    leftover = free - sum(shares.values())
    shares["exec"] += leftover
    split: dict[str, tuple[int, ...]] = {}
    for lane, n in shares.items():
        split[lane] = tuple(range(first, first + n))
        first += n
    return split
