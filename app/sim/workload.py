"""Workload specs: what the simulator draws trajectories from.

The field names are a contract (other tools write these files). Every field has a default; a field
that a trace supplies is not needed when `trace` is given. A distribution is a number,
`{lognormal: {median, p90}}`, `{uniform: [lo, hi]}` or `{empirical: [...]}`.

Draws are keyed by (seed, group, attempt), never by the order in which a policy asks for them, so every
policy in a ladder sees exactly the same trajectories.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import os
import random
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from app.core.config import AdmissionMode, LaneOrder, PolicyName, admission_option, gate_option, launch_gate
from app.documents import DocumentError, TooLarge, check_size, open_input, read_document
from app.lanes.adaptive import AdaptiveLanesSpec
from app.sim.lanes import LaneSharing, LaneWeights
from app.validation import (
    MAX_BATCHES,
    MAX_CORES,
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_BATCH,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SIM_ENGINES,
    MAX_SLOTS,
    MAX_STALENESS,
    MAX_SURPLUS,
    MAX_TURNS,
    describe,
    in_flight_problem,
    problems,
)

Z90 = 1.2815515655446004  # the standard normal's 90th percentile


class WorkloadError(ValueError):
    """A workload file or trace is unusable; the message names the field or line."""


class Lognormal(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    median: float = Field(gt=0, le=MAX_SECONDS, strict=True)
    p90: float = Field(gt=0, le=MAX_SECONDS, strict=True)
    max: float | None = Field(
        None, gt=0, le=MAX_SECONDS, strict=True, description="cap, e.g. a harness timeout"
    )

    @model_validator(mode="after")
    def _p90_above_median(self) -> Lognormal:
        if self.p90 < self.median:
            raise ValueError(f"p90 ({self.p90}) must be ≥ median ({self.median})")
        return self

    @functools.cached_property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / Z90


# A bare number's bounds: those of `Dist.constant`, which it becomes.
_CONSTANT = TypeAdapter(Annotated[float, Field(ge=0, le=MAX_SECONDS, strict=True, allow_inf_nan=False)])


_LOG_MAX_SECONDS = math.log(MAX_SECONDS)


def _huge(value: float) -> str:
    """A number past a limit, as a person reads it: 52,760,771 in full, 5.28e+28 rather than 29 digits."""
    return f"{value:,.0f}" if value < 1e15 else f"{value:.3g}"


class Dist(BaseModel):
    """One of: a constant, a lognormal by median and p90, a uniform range, or empirical samples."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    constant: float | None = Field(None, ge=0, le=MAX_SECONDS, strict=True)
    lognormal: Lognormal | None = None
    uniform: tuple[float, float] | None = None
    empirical: tuple[float, ...] | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_number(cls, data: Any) -> Any:
        if isinstance(data, bool):
            raise ValueError("a distribution is a number or a mapping, not a boolean")
        if isinstance(data, int | float):
            # Checked before it becomes `constant`, so that a refusal names the key as typed (`turns`)
            try:
                _CONSTANT.validate_python(data)
            except ValidationError as exc:
                raise ValueError(describe(exc.errors()[0])) from None
            return {"constant": data}
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> Dist:
        given = [k for k in ("constant", "lognormal", "uniform", "empirical") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of: a number, lognormal, uniform, empirical")
        if self.uniform is not None and not 0 <= self.uniform[0] <= self.uniform[1]:
            raise ValueError(f"uniform needs 0 ≤ lo ≤ hi, got {list(self.uniform)}")
        if self.empirical is not None and (not self.empirical or min(self.empirical) < 0):
            raise ValueError("empirical needs a non-empty list of non-negative samples")
        if (upper := self.upper()) > MAX_SECONDS:
            raise ValueError(
                f"draws would reach {_huge(upper)} (for an uncapped lognormal: its one-in-a-billion "
                f"draw), above the limit of {MAX_SECONDS:,.0f}; give a smaller p90 or a max"
            )
        return self

    def upper(self) -> float:
        """The largest draw, or for an uncapped lognormal its one-in-a-billion quantile (6 σ)."""
        if self.constant is not None:
            return self.constant
        if self.lognormal is not None:
            if self.lognormal.max is not None:
                return self.lognormal.max
            # In logs: p90 / median can overflow, and a tiny median must not hide a sigma whose draws do.
            median = math.log(self.lognormal.median)
            sigma = (math.log(self.lognormal.p90) - median) / Z90
            return math.exp(min(median + 6 * sigma, 700.0))
        if self.uniform is not None:
            return self.uniform[1]
        return max(self.empirical or (0.0,))

    def draw(self, rng: random.Random, scale: float = 1.0) -> float:
        if self.constant is not None:
            return self.constant * scale
        if self.lognormal is not None:
            z = rng.gauss(0.0, self.lognormal.sigma)
            try:
                value = self.lognormal.median * math.exp(z)
            except OverflowError:  # past about 5.6 σ with a tiny median e^z alone overflows: in logs
                value = math.exp(min(math.log(self.lognormal.median) + z, _LOG_MAX_SECONDS))
            # The check above allows a one-in-a-billion draw of MAX_SECONDS; one further out is held to it
            # (a `max` is at most MAX_SECONDS).
            return min(value, self.lognormal.max or MAX_SECONDS) * scale
        if self.uniform is not None:
            return rng.uniform(*self.uniform) * scale
        assert self.empirical is not None
        return rng.choice(self.empirical) * scale

    def mean(self) -> float:
        if self.constant is not None:
            return self.constant
        if self.lognormal is not None:
            sigma = math.log(self.lognormal.p90 / self.lognormal.median) / Z90
            return self.lognormal.median * math.exp(sigma * sigma / 2)
        if self.uniform is not None:
            return sum(self.uniform) / 2
        assert self.empirical is not None
        return sum(self.empirical) / len(self.empirical)


def _ln(median: float, p90: float, cap: float | None = None) -> Dist:
    return Dist(lognormal=Lognormal(median=median, p90=p90, max=cap))


FULL_RUNG = PolicyName.FULL.value


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class BatchSpec(Strict):
    groups: int = Field(
        32, ge=1, le=MAX_GROUPS_PER_BATCH, strict=True, description="B: groups per trainer batch"
    )
    group_size: int = Field(8, ge=2, le=MAX_GROUP_SIZE, strict=True, description="G: attempts per task")


class TrainerSpec(Strict):
    step_s: float = Field(
        5.0, ge=0, le=MAX_SECONDS, strict=True, description="seconds per trainer step (sentinel-tensor scale)"
    )


class PolicySpec(Strict):
    surplus_groups: int = Field(64, ge=0, le=MAX_SURPLUS, strict=True, description="S")
    max_staleness: int = Field(4, ge=0, le=MAX_STALENESS, strict=True, description="K")
    max_updating_engines: int | None = Field(
        None,
        ge=1,
        le=MAX_SIM_ENGINES,
        strict=True,
        description="engines loading new weights at once, a fixed number (what `corral advise` calls "
        "`updating`); None: the policy's own pace (`full`: by free slots)",
    )
    # full's alone (Workload.policy_settings): the other rungs keep their own
    admission: AdmissionMode | None = admission_option(
        "in_flight; full's alone (the other rungs keep their own); `corral sim --admission` goes over it"
    )
    agent_gate: float | None = gate_option(
        "1; full's alone (the other rungs keep their own); `corral sim --agent-gate` goes over it"
    )


class EnginesSpec(Strict):
    count: int = Field(8, ge=1, le=MAX_SIM_ENGINES, strict=True, description="serving engines")
    slots: int = Field(96, ge=1, le=MAX_SLOTS, strict=True, description="concurrent sequences per engine")
    update_s: float = Field(
        5.0,
        ge=0,
        le=MAX_SECONDS,
        strict=True,
        description="seconds to load a new policy version (sentinel-scale)",
    )
    tokens_per_s: float = Field(
        40.0, gt=0, le=1e6, strict=True, description="decode tokens per second per sequence"
    )


class SandboxDemand(Strict):
    """Cores one running sandbox operation keeps busy, by kind: set-up and teardown mostly wait on I/O."""

    reset: float = Field(0.25, ge=0, le=MAX_CORES, strict=True)
    exec: float = Field(1.0, ge=0, le=MAX_CORES, strict=True)
    validate_: float = Field(0.5, ge=0, le=MAX_CORES, strict=True, alias="validate")
    cleanup: float = Field(0.25, ge=0, le=MAX_CORES, strict=True)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _from_number(cls, data: Any) -> Any:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return dict.fromkeys(("reset", "exec", "validate", "cleanup"), data)
        return data

    def by_lane(self) -> dict[str, float]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}


class CpusSpec(Strict):
    total: int = Field(288, ge=2, le=MAX_CORES, strict=True, description="cores on the rollout hosts")
    serving: int = Field(
        32, ge=1, le=MAX_CORES, strict=True, description="cores reserved for serving when lanes are pinned"
    )
    engine_demand: float = Field(
        2.0, ge=0, le=MAX_CORES, strict=True, description="cores a busy engine's serving loop uses"
    )
    sandbox_demand: SandboxDemand = Field(
        default_factory=lambda: SandboxDemand(), description="cores one running operation uses, per lane"
    )

    thrash: float = Field(
        0.5,
        ge=0,
        le=100,
        strict=True,
        description="efficiency lost per unit of oversubscription (0: pure processor sharing)",
    )

    interference: float = Field(
        0.5,
        ge=0,
        le=100,
        strict=True,
        description="serving slow-down per unit of co-located sandbox load (shared CPUs only)",
    )

    @model_validator(mode="after")
    def _serving_leaves_room(self) -> CpusSpec:
        # The simulator splits the cores left after serving into the four lanes, one core each at least.
        if self.total - self.serving < 4:
            raise ValueError(
                f"serving ({self.serving}) must leave at least 4 cores for the 4 lanes (total {self.total})"
            )
        return self


class LanesSpec(Strict):
    """Concurrent slots per lane, and how the lanes share the sandbox cores (see app.sim.lanes)."""

    reset: int = Field(192, ge=1, le=MAX_SLOTS, strict=True)
    exec: int = Field(192, ge=1, le=MAX_SLOTS, strict=True)
    validate_: int = Field(48, ge=1, le=MAX_SLOTS, strict=True, alias="validate")
    cleanup: int = Field(48, ge=1, le=MAX_SLOTS, strict=True)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    sharing: LaneSharing = Field(
        LaneSharing.WORK_CONSERVING,
        description="work_conserving: lanes borrow idle sandbox cores; partitioned: each lane owns its cores",
    )
    weights: LaneWeights | None = Field(
        None, description="guaranteed share per lane; default: slots × per-operation demand"
    )
    adaptive: AdaptiveLanesSpec | None = Field(None, description="lane slots that follow measured demand")
    borrow_serving_cpus: bool = Field(
        False,
        description="work-conserving pinned lanes also run on the serving cores serving leaves idle, at a "
        "weight far below serving's (the real runtime's `lanes.borrow_serving_cpus`)",
    )
    order: LaneOrder = Field(
        LaneOrder.FIFO,
        description="which queued operation of a lane goes next: the earliest queued (fifo) or the oldest "
        "group's (oldest_group: the real runtime's `lanes.order` option)",
    )
    cpu_priority: bool | None = Field(
        None,
        description="with oldest_group and pinned lanes: a contended lane's cores also go to its "
        "operations by their groups' age, at the CPU weight of niceness 4 × the group's age rank (the "
        "runtime's CPU priority, app.sim.cpu.GroupedStream); None: on with oldest_group, as the runtime "
        "run as root has it",
    )

    @model_validator(mode="after")
    def _borrow_needs_sharing(self) -> LanesSpec:
        if self.borrow_serving_cpus and self.sharing is LaneSharing.PARTITIONED:
            raise ValueError(
                "borrow_serving_cpus needs work_conserving lanes: partitioned lanes own their cores"
            )
        if self.cpu_priority and self.order is not LaneOrder.OLDEST_GROUP:
            raise ValueError("cpu_priority ranks groups by age: it needs order: oldest_group")
        return self

    def by_group_age(self) -> bool:
        """Whether a contended lane's cores go to its groups by age (`cpu_priority`, pinned lanes only)."""
        return self.order is LaneOrder.OLDEST_GROUP and self.cpu_priority is not False

    def slots(self) -> dict[str, int]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}


class TrajectorySpec(Strict):
    reset_s: Dist = Field(default_factory=lambda: _ln(7, 40, 300), description="sandbox set-up")
    turns: Dist = Field(default_factory=lambda: _ln(18, 36), description="agent turns per attempt")
    llm_s: Dist = Field(default_factory=lambda: _ln(9, 18), description="engine time per turn")
    tool_s: Dist = Field(default_factory=lambda: _ln(2.5, 10), description="tool-call time per turn")
    validate_s: Dist = Field(default_factory=lambda: _ln(5, 30, 120), description="tests for the reward")
    cleanup_s: Dist = Field(default_factory=lambda: _ln(13, 17), description="sandbox teardown")
    timeout_s: float = Field(
        420.0, gt=0, le=MAX_SECONDS, strict=True, description="cap on the agent phase (turns)"
    )
    task_spread: float = Field(
        0.3, ge=0, le=10, strict=True, description="log-sd of a per-task difficulty factor"
    )
    attempt_spread: float = Field(
        0.15, ge=0, le=10, strict=True, description="log-sd of a per-attempt speed factor"
    )
    p_success: float = Field(
        0.5, ge=0, le=1, strict=True, description="reward-1 probability of a task of difficulty 1"
    )
    p_infra_error: float = Field(
        0.0,
        ge=0,
        lt=1,
        strict=True,
        description="chance an attempt dies of an infra error (below 1: at 1 no group completes)",
    )

    @model_validator(mode="after")
    def _turns_bounded(self) -> TrajectorySpec:
        if self.turns.upper() < 1:  # was run as one turn an attempt, without a word
            raise ValueError(
                f"turns: every draw is below one turn (at most {self.turns.upper():g}); an attempt makes "
                "at least one"
            )
        most = self.turns.upper() * math.exp(6 * self.attempt_spread)
        if most > MAX_TURNS:
            raise ValueError(
                f"turns: draws would reach about {_huge(most)} turns per attempt (the one-in-a-billion draw, "
                f"{self.turns.upper():g} turns × e^(6 × attempt_spread {self.attempt_spread:g})); the limit "
                f"is {MAX_TURNS:,}: give a smaller p90, a lognormal max or a smaller attempt_spread"
            )
        return self


class TraceSpec(Strict):
    path: Path
    llm_fraction: float = Field(
        0.6, ge=0, le=1, strict=True, description="share of agent time spent on the engine"
    )
    tasks: Literal["uniform", "as_recorded"] = Field(
        "uniform",
        description="how a group picks its task: each task alike, or as often as the trace holds its "
        "attempts (a `corral run`'s own task mix)",
    )


class FaultSpec(Strict):
    """One injected engine fault (docs/faults.md): `engine_down` makes engine `engine` unreachable from
    `at_s` for `for_s` seconds (its turns in flight fail; it comes back on its initial weights);
    `update_hang` makes that engine's update to `version` never finish (the runtime's update timeout
    ends it)."""

    kind: str = Field(pattern="^(engine_down|update_hang)$", description="engine_down or update_hang")
    engine: int = Field(ge=0, lt=MAX_SIM_ENGINES, strict=True, description="engine index")
    at_s: float = Field(0.0, ge=0, le=MAX_SECONDS, strict=True, description="engine_down: when it dies")
    for_s: float = Field(60.0, gt=0, le=MAX_SECONDS, strict=True, description="engine_down: how long")
    version: int = Field(1, ge=1, le=MAX_BATCHES, strict=True, description="update_hang: which update")


class Workload(Strict):
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True)
    batches: int = Field(12, ge=1, le=MAX_BATCHES, strict=True, description="trainer steps")
    batch: BatchSpec = Field(default_factory=BatchSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    policy: PolicySpec = Field(default_factory=PolicySpec)
    engines: EnginesSpec = Field(default_factory=EnginesSpec)
    cpus: CpusSpec = Field(default_factory=CpusSpec)
    lanes: LanesSpec = Field(default_factory=LanesSpec)
    trajectory: TrajectorySpec = Field(default_factory=TrajectorySpec)
    trace: TraceSpec | None = None
    faults: list[FaultSpec] = Field(default_factory=list, max_length=1000, description="injected faults")

    @field_validator("trace", mode="before")
    @classmethod
    def _trace_path(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"path": value}
        return value

    @model_validator(mode="after")
    def _in_flight_bounded(self) -> Workload:
        problem = in_flight_problem(self.batch.groups, self.batch.group_size, self.policy.surplus_groups)
        if problem is not None:
            raise ValueError(problem)
        for i, fault in enumerate(self.faults):
            if fault.engine >= self.engines.count:
                raise ValueError(f"faults.{i}.engine: {fault.engine} is not below engines.count")
        return self

    @property
    def serving_demand(self) -> float:
        """Cores the engines' serving loops use when every engine is busy: `engines.count ×
        cpus.engine_demand`."""
        return self.engines.count * self.cpus.engine_demand

    def policy_settings(self, rung: str) -> dict[str, object]:
        """What this workload sets of rung `rung`'s policy, for `PolicyConfig.ladder` (`corral sim`,
        `bench`, `advise` and a simulated run of `corral serve` alike): B, G, S and K, the updating
        engines where given, and, for `full` alone, its admission and agent gate where given. Those two
        are `full`'s settings (what `corral advise` advises): a workload written by `--advised-workload`
        with a gate of 0.05 turned `corral bench`'s sync and completion rungs into something else."""
        base: dict[str, object] = {
            "groups_per_batch": self.batch.groups,
            "group_size": self.batch.group_size,
            "surplus_groups": self.policy.surplus_groups,
            "max_staleness": self.policy.max_staleness,
        }
        if self.policy.max_updating_engines is not None:  # else the rung's own pacing
            base["max_updating_engines"] = self.policy.max_updating_engines
        if rung == FULL_RUNG and self.policy.admission is not None:  # else the rung's own
            base["admission"] = self.policy.admission
        if rung == FULL_RUNG and self.policy.agent_gate is not None:
            base["agent_gate"] = launch_gate(self.policy.agent_gate)
        return base

    def full_only(self) -> list[str]:
        """The `policy` keys this workload sets that only `full` takes (`policy_settings`)."""
        return [k for k in ("admission", "agent_gate") if getattr(self.policy, k) is not None]


@dataclass(frozen=True)
class Turn:
    llm_s: float
    tool_s: float


@dataclass(frozen=True)
class Trajectory:
    """One attempt, fully drawn: what it would take on an idle machine."""

    reset_s: float
    turns: tuple[Turn, ...]
    validate_s: float
    cleanup_s: float
    timeout_s: float
    reward: float
    infra_error: bool = False

    @property
    def agent_s(self) -> float:
        return min(self.timeout_s, sum(t.llm_s + t.tool_s for t in self.turns))

    @property
    def duration_s(self) -> float:
        """Uncontended time from admission to reward (cleanup runs after, off the critical path)."""
        return self.reset_s + self.agent_s + self.validate_s

    @property
    def turns_in_time(self) -> int:
        """The turns an idle machine would finish within the agent's time cap: an attempt cut short
        before that many was cut by the run (its engines down, or contention), not by its own length."""
        left = self.timeout_s
        for done, turn in enumerate(self.turns):
            left -= turn.llm_s + turn.tool_s
            if left < 0:
                return done
        return len(self.turns)

    @property
    def llm_work_s(self) -> float:
        """Engine time within the agent time cap."""
        left, total = self.timeout_s, 0.0
        for turn in self.turns:
            if left <= 0:
                break
            total += min(turn.llm_s, left)
            left -= turn.llm_s + turn.tool_s
        return total


@dataclass(frozen=True)
class TraceAttempt:
    task: str
    reset_s: float
    agent_s: float
    validate_s: float
    cleanup_s: float
    reward: float
    turns: tuple[Turn, ...] | None
    # Cut short (cancelled with its group): it would have taken at least `duration_s`, reward unknown.
    censored: bool = False

    @property
    def duration_s(self) -> float:
        """As `Trajectory.duration_s`: admission to reward, cleanup left out."""
        return self.reset_s + self.agent_s + self.validate_s


class TrajectorySource:
    """Seeded trajectory draws for a workload, from its distributions or from a recorded trace.

    `cache`: keep every draw (about 1.3 KB a group), so that the rungs of a bench replay them cheaply;
    without it each is drawn again when asked for (the draws are seeded per group and attempt, so they
    are the same), as a run that goes on until stopped needs (`corral serve`'s simulated runs).
    `durations` (uncached): note each group's uncontended duration (`group_duration`) as its attempts
    are drawn, two numbers a group, so that a run's lower bound does not draw them all again."""

    def __init__(self, workload: Workload, cache: bool = True, durations: bool = False) -> None:
        self.workload = workload
        self._keep = cache
        self._note_durations = durations and not cache
        self._trace: dict[str, list[TraceAttempt]] | None = None
        self._trace_tasks: list[str] = []
        self._trace_weights: list[int] | None = None  # `as_recorded`: the tasks' attempts, added up
        self._finished: dict[str, tuple[list[float], list[TraceAttempt]]] = {}  # by task, for `_survivor`
        if workload.trace is not None:
            self._trace = load_trace(workload.trace.path)
            self._trace_tasks = sorted(self._trace)
            if workload.trace.tasks == "as_recorded":
                counts = (len(self._trace[task]) for task in self._trace_tasks)
                self._trace_weights = list(itertools.accumulate(counts))
        self._cache: dict[tuple[int, int], Trajectory] = {}
        self._tasks: dict[int, tuple[float, float, float, float]] = {}
        # With `durations`: each group's attempts drawn (a bit each) and its slowest duration so far
        self._noted: dict[int, tuple[int, float]] = {}

    def trajectory(self, group: int, attempt: int) -> Trajectory:
        key = (group, attempt)
        found = self._cache.get(key)
        if found is None:
            found = self._draw(group, attempt)
            if self._keep:
                self._cache[key] = found
            elif self._note_durations:
                self._note(group, attempt, found.duration_s)
        return found

    def _note(self, group: int, attempt: int, duration: float) -> None:
        drawn, slowest = self._noted.get(group, (0, 0.0))
        self._noted[group] = (drawn | 1 << attempt, max(slowest, duration))  # a restart's draw is the same

    def clear(self) -> None:
        """Drop every cached draw (they would be drawn again, the same, if asked for)."""
        self._cache.clear()
        self._tasks.clear()
        self._noted.clear()

    def group_duration(self, group: int) -> float:
        size = self.workload.batch.group_size
        drawn, slowest = self._noted.get(group, (0, 0.0))
        if drawn == (1 << size) - 1:  # every attempt drawn
            return slowest
        return max(self.trajectory(group, a).duration_s for a in range(size))

    def group_attempt_work(self, group: int) -> float:
        """The sum of the group's attempts' uncontended durations: the attempt room it needs."""
        size = self.workload.batch.group_size
        return sum(self.trajectory(group, a).duration_s for a in range(size))

    def group_llm_work(self, group: int) -> float:
        size = self.workload.batch.group_size
        return sum(self.trajectory(group, a).llm_work_s for a in range(size))

    def _rng(self, *key: int) -> random.Random:
        return random.Random(":".join(map(str, (self.workload.seed, *key))))

    def _task(self, group: int) -> tuple[float, float, float, float]:
        """The task-level draws of a group, shared by its attempts: difficulty, turns, reset, p(success)."""
        found = self._tasks.get(group)
        if found is None:
            spec = self.workload.trajectory
            task_rng = self._rng(group)
            difficulty = math.exp(task_rng.gauss(0.0, spec.task_spread))
            task_turns = spec.turns.draw(task_rng)
            reset_s = spec.reset_s.draw(task_rng)  # set-up cost is a property of the task (its image)
            found = (difficulty, task_turns, reset_s, spec.p_success ** min(difficulty, 50.0))
            if len(self._tasks) >= 4096:
                self._tasks.clear()  # a cache, not a record: groups draw their attempts close together
            self._tasks[group] = found
        return found

    def _draw(self, group: int, attempt: int) -> Trajectory:
        if self._trace is not None:
            return self._draw_trace(group, attempt)
        spec = self.workload.trajectory
        difficulty, task_turns, reset_s, p_task = self._task(group)
        rng = self._rng(group, attempt)
        speed = difficulty * math.exp(rng.gauss(0.0, spec.attempt_spread))
        n_turns = max(1, round(task_turns * math.exp(rng.gauss(0.0, spec.attempt_spread))))
        turns = tuple(Turn(spec.llm_s.draw(rng, speed), spec.tool_s.draw(rng, speed)) for _ in range(n_turns))
        return Trajectory(
            reset_s=reset_s,
            turns=turns,
            validate_s=spec.validate_s.draw(rng),
            cleanup_s=spec.cleanup_s.draw(rng),
            timeout_s=spec.timeout_s,
            reward=1.0 if rng.random() < p_task else 0.0,
            infra_error=rng.random() < spec.p_infra_error,
        )

    def _survivor(self, task: str, cut: TraceAttempt, rng: random.Random) -> TraceAttempt:
        """What a censored attempt stands for: one of its task's finished attempts that took at least as
        long as it had run when cancelled (each alike), or, where none did, itself: a lower bound."""
        assert self._trace is not None
        found = self._finished.get(task)
        if found is None:
            found = self._finished[task] = _finished_by_duration(self._trace[task])
        durations, finished = found
        longer = finished[bisect.bisect_left(durations, cut.duration_s) :]
        return rng.choice(longer) if longer else cut

    def _draw_trace(self, group: int, attempt: int) -> Trajectory:
        assert self._trace is not None
        assert self.workload.trace is not None
        if self._trace_weights is None:
            task = self._trace_tasks[self._rng(group).randrange(len(self._trace_tasks))]
        else:
            task = self._rng(group).choices(self._trace_tasks, cum_weights=self._trace_weights)[0]
        rng = self._rng(group, attempt)
        rec = rng.choice(self._trace[task])
        if rec.censored:
            rec = self._survivor(task, rec, rng)
        turns = rec.turns or _split_agent_time(rec.agent_s, self.workload, rng)
        return Trajectory(
            reset_s=rec.reset_s,
            turns=turns,
            validate_s=rec.validate_s,
            cleanup_s=rec.cleanup_s,
            timeout_s=self.workload.trajectory.timeout_s,
            reward=rec.reward,
        )


def _finished_by_duration(attempts: list[TraceAttempt]) -> tuple[list[float], list[TraceAttempt]]:
    """A task's finished (not censored) attempts, shortest first, and their durations."""
    finished = sorted((a for a in attempts if not a.censored), key=lambda a: a.duration_s)
    return [a.duration_s for a in finished], finished


def _split_agent_time(agent_s: float, workload: Workload, rng: random.Random) -> tuple[Turn, ...]:
    assert workload.trace is not None
    n = max(1, round(workload.trajectory.turns.draw(rng)))
    weights = [rng.expovariate(1.0) for _ in range(n)]
    total = sum(weights)
    frac = workload.trace.llm_fraction
    return tuple(Turn(agent_s * w / total * frac, agent_s * w / total * (1 - frac)) for w in weights)


class _TraceTurn(Strict):
    llm_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)
    tool_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)


class _TraceLine(Strict):
    task: str = Field(min_length=1)
    reset_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)
    agent_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)
    validate_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)
    cleanup_s: float = Field(ge=0, le=MAX_SECONDS, strict=True)
    # Corral's rewards are 0/1 outcomes (a task's validation exit status, a simulated draw, a resolved
    # terminal-bench trial); a fraction such as tests passed fits, a score on another scale does not.
    reward: float = Field(ge=0, le=1, strict=True)
    turns: list[_TraceTurn] | None = Field(None, max_length=MAX_TURNS)
    censored: bool = Field(False, strict=True)


# A trace is written to milliseconds: each turn's two figures and agent_s are rounded apart, so the
# turns may add up to more than agent_s by half a millisecond a figure.
TURN_ROUNDING_S = 0.001


def _turns_over_agent(rec: _TraceLine) -> float | None:
    """What `rec`'s turns add up to, when that is more than its agent_s (past their rounding): the
    simulator replays the turns, so it would run more agent time than the attempt had."""
    if not rec.turns:
        return None
    total = math.fsum(t.llm_s + t.tool_s for t in rec.turns)
    return total if total > rec.agent_s + TURN_ROUNDING_S * (len(rec.turns) + 1) else None


def _seconds(x: float) -> str:
    return f"{x:,.3f}".rstrip("0").rstrip(".")


def over_agent_limit(records: Iterable[Mapping[str, Any]]) -> str | None:
    """What to tell the user of a trace whose attempts ran their agent longer than the simulator's
    default agent time (`trajectory.timeout_s`), which a replay applies to them too: they would run out
    of it and fail, unless the workload sets a longer one. None when every attempt fits."""
    limit = TrajectorySpec.model_fields["timeout_s"].default
    agent = [float(r["agent_s"]) for r in records]
    over = [a for a in agent if a > limit]
    if not over:
        return None
    return (
        f"note: {len(over)} of {len(agent)} attempts ran their agent longer than {limit:g} s, the "
        f"simulator's default agent time (trajectory.timeout_s); a workload replaying this trace cuts them "
        f"short, and they fail, unless it sets trajectory: {{timeout_s: {math.ceil(max(over))}}} or more"
    )


def trace_line_problem(data: Mapping[str, Any]) -> str | None:
    """Why `load_trace` would refuse `data` as a trace line, in a few words that group alike lines (a
    span beyond `MAX_SECONDS`, as a trial with a far-future end has), or None: an importer keeps only
    lines the simulator then loads."""
    try:
        rec = _TraceLine.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"])
        if error["type"] in ("less_than_equal", "finite_number") and field.endswith("_s"):
            return f"{field} over {MAX_SECONDS:,.0f} s"
        if error["type"] in ("greater_than_equal", "less_than_equal") and field == "reward":
            return "reward outside [0, 1]"
        return f"{field}: {error['msg']}"
    if _turns_over_agent(rec) is not None:
        return "turns add up to more than agent_s"
    return None


# A trace line is about 100 bytes an attempt (more with turns) and holds about 3 times that in memory
# once read: 256 MB is some 2.5 million attempts, read in about a minute.
MAX_TRACE_BYTES = 256_000_000


def _trace_lines(path: Path, name: str, where: str) -> Iterator[tuple[int, str]]:
    """The lines of a trace file with their numbers, read one at a time and at most `MAX_TRACE_BYTES` in
    all: a device (/dev/zero) is refused before any reading, a larger regular file from its size, an
    endless pipe at the limit, so none fills memory."""
    try:
        with open_input(Path(path)) as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                raise WorkloadError(f"{name}: is a device, not a file")
            check_size(f, MAX_TRACE_BYTES)
            offset = 0
            lineno = 0
            while raw := f.readline(MAX_TRACE_BYTES - offset + 1):
                lineno += 1
                if offset + len(raw) > MAX_TRACE_BYTES:
                    raise TooLarge(MAX_TRACE_BYTES)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise WorkloadError(f"{name}: not UTF-8 text (byte {offset + exc.start})") from None
                offset += len(raw)
                yield lineno, line
    except TooLarge as exc:
        raise WorkloadError(f"{name} is {exc}; is it the right file?") from None
    except OSError as exc:
        what = f"{name}: cannot read" if where != "trace.path" else f"trace.path: cannot read {path}"
        raise WorkloadError(f"{what}: {exc.strerror or exc}") from None


def load_trace(path: Path, flag: str | None = None) -> dict[str, list[TraceAttempt]]:
    """Read a JSON Lines trace: one recorded attempt per line, grouped by task. Refusals name it as the
    workload's `trace.path`, or as `flag` (e.g. --trace) when the user gave it that way; a device, or a
    file of more than `MAX_TRACE_BYTES`, is refused before it fills memory."""
    name = f"{flag or 'trace'} {path}"
    by_task: dict[str, list[TraceAttempt]] = {}
    for lineno, line in _trace_lines(path, name, flag or "trace.path"):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{name}, line {lineno}: not JSON ({exc.msg})") from None
        except RecursionError:
            raise WorkloadError(f"{name}, line {lineno}: not JSON (nested too deeply)") from None
        except ValueError:  # an integer longer than Python reads (sys.get_int_max_str_digits)
            raise WorkloadError(f"{name}, line {lineno}: a number has too many digits") from None
        if not isinstance(data, dict):
            raise WorkloadError(f"{name}, line {lineno}: each line must be a JSON object")
        try:
            rec = _TraceLine.model_validate(data)
        except ValidationError as exc:
            raise WorkloadError(f"{name}, line {lineno}: {problems(exc)}") from None
        if (over := _turns_over_agent(rec)) is not None:
            raise WorkloadError(
                f"{name}, line {lineno}: its turns add up to {_seconds(over)} s, "
                f"more than its agent_s of {_seconds(rec.agent_s)} s"
            )
        turns = tuple(Turn(t.llm_s, t.tool_s) for t in rec.turns) if rec.turns else None
        agent_s = sum(t.llm_s + t.tool_s for t in turns) if turns else rec.agent_s
        by_task.setdefault(rec.task, []).append(
            TraceAttempt(
                rec.task, rec.reset_s, agent_s, rec.validate_s, rec.cleanup_s, rec.reward, turns, rec.censored
            )
        )
    if not by_task:
        raise WorkloadError(f"{name} is empty: it needs at least one recorded attempt")
    return by_task


def parse_workload(data: Any, source: str = "workload") -> Workload:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: the top level must be a mapping of fields")
    try:
        workload = Workload.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(f"{source}: {problems(exc)}") from None
    if workload.trace is not None:
        load_trace(workload.trace.path)  # refuse an empty or malformed trace now, not mid-run
    return workload


def load_workload(path: Path | None) -> Workload:
    """Read a YAML or JSON workload file; `None` gives the built-in terminal-bench-style default."""
    if path is None:
        return default_workload()
    from app.sim.family import FAMILY, builtin_workload

    if str(path) in FAMILY and not Path(path).exists():
        return builtin_workload(str(path))  # a built-in workload of the bench family, by name
    try:
        data = read_document(Path(path), f"workload {path}", json_suffix=True)
    except DocumentError as exc:
        if not Path(path).exists() and not Path(path).is_symlink():  # `cpu_scarce` for `cpu-scarce`
            raise WorkloadError(f"{exc}; the built-in workloads are {', '.join(FAMILY)}") from None
        raise WorkloadError(str(exc)) from None
    if data is None:  # an empty file, or comments only: most likely the wrong file, not "all defaults"
        raise WorkloadError(f"workload {path} is empty; write {{}} in it for every default")
    if isinstance(data, dict) and isinstance(data.get("trace"), dict | str):
        trace = data["trace"] if isinstance(data["trace"], dict) else {"path": data["trace"]}
        trace_path = Path(str(trace.get("path", "")))
        if trace.get("path") and not trace_path.is_absolute():
            data["trace"] = {**trace, "path": str(Path(path).parent / trace_path)}
    return parse_workload(data, str(path))


def default_workload() -> Workload:
    """Terminal-bench-style work, 32 groups × 8 attempts a batch, calibrated (not derived): its agent cap,
    task spread, reset and validate tails and engine slots were chosen to land `sync` at 591.8 s."""
    return Workload()


def group_durations(source: TrajectorySource, groups: Sequence[int]) -> list[float]:
    return [source.group_duration(g) for g in groups]
