"""Protocol fakes for the runtime's fault and stop tests: engines that die or hang on cue, a supervisor
that restarts them, sandboxes, agents, a source and a trainer. Used on the simulator's virtual clock,
so timeouts and backoffs take no wall time."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.config import PolicyConfig
from app.engines.base import PauseMode, TurnRequest, TurnResult
from app.engines.errors import EngineRequestError, EngineServerError, EngineUnavailable
from app.lanes.base import LaneName
from app.lanes.inprocess import InProcessLanes
from app.runtime.context import AttemptContext, AttemptOutcome
from app.runtime.driver import Runtime
from app.runtime.engine_pool import EngineFaultConfig
from app.runtime.ports import TrainingBatch
from app.sandboxes.base import ExecResult
from app.tasks.spec import TaskSpec

# -- fakes ------------------------------------------------------------------------------------------


@dataclass
class FakeEngine:
    """Turns take `turn_s`; `down` makes every call fail as a dead process would."""

    name: str
    turn_s: float = 1.0
    version: int = 0
    down: bool = False
    healthy: bool = True  # False: turns still work, /health fails (a degraded engine)
    failing: int = 0  # the next this many turns answer 500 while /health stays fine
    update: str | None = None  # "hang" or "error" for the next publication
    health_s: float = 0.0  # how long a health probe takes
    closed: bool = False  # aclose() was called: every call raises, as a closed HTTP client does
    disk: bool = False  # loads weights from disk: a publication without a path raises, as vLLM's client
    refuse: set[int] = field(default_factory=set)  # versions whose weights it answers 400 to, staying up
    turns: int = 0
    published: list[int] = field(default_factory=list)

    def _check(self, route: str) -> None:
        if self.down:
            raise EngineUnavailable(f"fake://{self.name}", route, "unreachable (connection refused)")

    async def generate(self, request: TurnRequest) -> TurnResult:
        self._check("/v1/completions")
        if self.failing > 0:
            self.failing -= 1
            raise EngineServerError(f"fake://{self.name}", "/v1/completions", 500, "this turn fails")
        version = self.version
        await asyncio.sleep(self.turn_s)
        self._check("/v1/completions")
        self.turns += 1
        return TurnResult(text="ok", weight_version=version, tokens=4)

    async def pause(self, mode: PauseMode) -> None:
        self._check("/pause")

    async def resume(self) -> None:
        self._check("/resume")

    async def publish_weights(self, version: int, path: str | None) -> None:
        self._check("/update_weights")
        if self.disk and path is None:
            raise ValueError(f"engine {self.name}: the disk backend needs a checkpoint path")
        if version in self.refuse:
            raise EngineRequestError(
                f"fake://{self.name}",
                "/update_weights",
                400,
                f"refused weights (still serving version {self.version})",
            )
        kind, self.update = self.update, None
        if kind == "hang":
            await asyncio.Event().wait()
        if kind == "error":
            raise EngineServerError(f"fake://{self.name}", "/update_weights", 500, "injected")
        await asyncio.sleep(0.1)
        self.version = version
        self.published.append(version)

    async def weight_version(self) -> int:
        self._check("/weight_info")
        return self.version

    async def health(self) -> bool:
        if self.closed:
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        if self.health_s:
            await asyncio.sleep(self.health_s)
        return self.healthy and not self.down

    async def aclose(self) -> None:
        self.closed = True


@dataclass
class FakeSupervisor:
    """Restarts take `start_s`; the first `failing` restarts fail."""

    start_s: float = 2.0
    failing: int = 0
    restarts: list[tuple[float, str]] = field(default_factory=list)
    engines: dict[str, FakeEngine] = field(default_factory=dict)
    refuse: set[int] = field(default_factory=set)  # versions the engines it starts refuse

    def exit_status(self, name: str) -> str | None:
        return None  # no process of its own

    async def restart(self, name: str) -> FakeEngine:
        self.restarts.append((asyncio.get_running_loop().time(), name))
        await asyncio.sleep(self.start_s)
        if self.failing > 0:
            self.failing -= 1
            raise RuntimeError(f"{name} did not come up")
        self.engines[name] = FakeEngine(name, refuse=set(self.refuse))
        return self.engines[name]


class FakeSandbox:
    async def reset(self, task: TaskSpec, cpus: Sequence[int] | None = None) -> ExecResult:
        return ExecResult(exit_code=0, output="")

    async def exec(self, command: str, timeout_s: float, cpus: Sequence[int] | None = None) -> ExecResult:
        await asyncio.sleep(0.5)
        return ExecResult(exit_code=0, output="")

    async def validate(self, cpus: Sequence[int] | None = None) -> float:
        return 1.0

    async def cleanup(self, cpus: Sequence[int] | None = None) -> None:
        return None


@dataclass
class TurnsAgent:
    turns: int
    reward: float

    async def run(self, ctx: AttemptContext) -> AttemptOutcome:
        for _ in range(self.turns):
            await ctx.generate(TurnRequest(prompt="p"))
            await ctx.exec("true", 10.0)
        return AttemptOutcome(reward=self.reward, turns=self.turns)


@dataclass
class FakeSource:
    turns: int = 4

    def make_attempt(self, group_id: int, task_index: int, attempt: int) -> tuple[Any, None, FakeSandbox]:
        return TurnsAgent(self.turns, float(attempt % 2)), None, FakeSandbox()

    def stopping(self) -> None:
        pass


@dataclass
class FakeTrainer:
    step_s: float = 1.0
    weights: str | None = None  # publishes `<weights>/v<version>`; None: sentinel versions, no path
    published: list[tuple[float, int]] = field(default_factory=list)

    async def step(self, batch: TrainingBatch, version: int) -> str | None:
        await asyncio.sleep(self.step_s)
        self.published.append((asyncio.get_running_loop().time(), version))
        return None if self.weights is None else f"{self.weights}/v{version}"

    def version_at(self, t: float) -> int:
        return max((v for tv, v in self.published if tv <= t), default=0)


def make_runtime(
    engines: Sequence[FakeEngine],
    supervisor: FakeSupervisor | None = None,
    faults: EngineFaultConfig | None = None,
    trainer: FakeTrainer | None = None,
    source: Any = None,
    policy: str = "full",
    weights_from_disk: bool = False,
    **knobs: Any,
) -> Runtime:
    settings: dict[str, Any] = {
        "groups_per_batch": 2,
        "group_size": 2,
        "surplus_groups": 2,
        "max_staleness": 4,
    }
    settings.update(knobs)
    lanes = InProcessLanes(concurrency=dict.fromkeys(LaneName, 8), cpus=dict.fromkeys(LaneName), pinned=False)
    return Runtime(
        PolicyConfig.ladder(policy, **settings),
        engines=list(engines),
        engine_slots=4,
        lanes=lanes,
        source=source or FakeSource(),
        trainer=trainer or FakeTrainer(),
        faults=faults
        or EngineFaultConfig(update_timeout_s=5.0, restart_backoff_s=1.0, restart_backoff_max_s=8.0),
        supervisor=supervisor,
        weights_from_disk=weights_from_disk,
    )


def accounted(runtime: Runtime) -> None:
    counters = runtime.scheduler.counters
    assert counters.admitted == counters.delivered + sum(counters.discarded.values())


def states(runtime: Runtime, engine: str) -> list[str]:
    return [s for _, e, s, _ in runtime.state.engine_events if e == engine]


async def kill_at(engine: FakeEngine, t: float) -> None:
    await asyncio.sleep(t)
    engine.down = True


async def run_with(runtime: Runtime, batches: int, *side: Any) -> None:
    async with asyncio.TaskGroup() as tg:
        for coro in side:
            tg.create_task(coro)
        await runtime.run(batches=batches)
