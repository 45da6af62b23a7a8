"""`corral run`'s config file: the schema of app/configs/local.yaml, validated before a run starts.

Invariants: every number is finite and every size has an upper bound (below); a count is a real
integer (`true` or `2.0` is refused, not coerced); `load_config` refuses a bad file with one line
naming the field, and checks that `sandbox.base_dir` is a writable directory before any engine starts;
it refuses engines that could load none of the versions `corral run`'s trainer publishes
(`sentinel_trainer_problem`), which would stall the run once they were K versions behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.core.config import (
    AdmissionMode,
    LaneOrder,
    LanesConfig,
    admission_option,
    gate_option,
    launch_gate,
)
from app.cpulist import MAX_CPU, parse_cpu_list
from app.documents import DocumentError, read_document
from app.sandboxes.cpushare import DEFAULT_LANE_WEIGHTS, MAX_WEIGHT, MIN_WEIGHT
from app.validation import MAX_SECONDS, MAX_SEED, human_bytes, problems

# Sizes of a run on one machine. An embedded engine at the default size is a torch process of about
# 250 MB resident (VmRSS of `corral engine --cpus 0 --sentinel`, measured idle).
MAX_ENGINES = 64
ENGINE_BYTES = 250_000_000
MAX_ENGINE_SLOTS = 4_096
MAX_GROUPS = 1_024
MAX_GROUP_SIZE = 256
MAX_SURPLUS = 4_096
MAX_STALENESS = 1_000
MAX_LANE_SLOTS = 1_024
MAX_RUN_BATCHES = 1_000_000
MAX_LAYERS = 64
MAX_HIDDEN = 8_192
MAX_TOKENS = 4_096


class LocalRunError(RuntimeError):
    """The run cannot start or went wrong in a way the operator must fix; the message says what."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _count(default: int, low: int, high: int, description: str = "") -> Any:
    """A bounded integer that refuses `true` and `2.0` instead of coercing them."""
    return Field(default, ge=low, le=high, strict=True, description=f"{description} ({low}..{high})".strip())


def _seconds(default: float, description: str, *, least: float = 0.0) -> Any:
    """Finite seconds up to MAX_SECONDS: ≥ 0, or ≥ `least` where less makes no sense."""
    if least:
        described = f"{description} (≥ {least:g})"
        return Field(default, ge=least, le=MAX_SECONDS, strict=True, description=described)
    return Field(default, ge=0, le=MAX_SECONDS, strict=True, description=description)


def engine_bytes(layers: int, hidden: int) -> int:
    """About how much memory one embedded engine holds: the torch process at the default size
    (ENGINE_BYTES) plus its GRU policy's float32 weights twice (those served and a version loading).
    Per layer a GRU has 3 gates of input and hidden weights, 6·h·(h + 1) parameters; the byte
    embedding and the output head add about 2·256·h."""
    params = layers * 6 * hidden * (hidden + 1) + 2 * 257 * hidden
    return ENGINE_BYTES + 2 * 4 * params


def machine_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def engines_memory_problem(count: int, layers: int, hidden: int) -> str | None:
    """Why `count` engines of this size cannot run here, or None."""
    each = engine_bytes(layers, hidden)
    have = machine_bytes()
    if count * each <= have:
        return None
    many = f"{count} engines" if count > 1 else "an engine"
    split = f" (≈ {human_bytes(each)} each)" if count > 1 else ""
    return (
        f"{many} of {layers} layers × {hidden} hidden would need about {human_bytes(count * each)} of "
        f"memory{split}; this machine has {human_bytes(have)}"
    )


def _cpu_list_text(value: object) -> object:
    """A CPU list may be written as the kernel writes it ('0-3,6'), as `--cpus` takes it, or as a list."""
    return parse_cpu_list(value) if isinstance(value, str) else value


_CpuList = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_CPU, strict=True)]], BeforeValidator(_cpu_list_text)
]


class BatchConfig(_Strict):
    groups: int = _count(4, 1, MAX_GROUPS, "B: groups per trainer batch")
    group_size: int = _count(4, 2, MAX_GROUP_SIZE, "G: attempts per task")


class PolicyKnobs(_Strict):
    surplus_groups: int = _count(2, 0, MAX_SURPLUS, "S: groups admitted beyond B")
    max_staleness: int = _count(2, 0, MAX_STALENESS, "K: most policy versions a group may lag")
    max_updating_engines: int = _count(1, 1, MAX_ENGINES, "engines loading weights at once")
    adaptive_lanes: bool | None = Field(
        None,
        strict=True,
        description="lane slots grow while work queues and the lanes' CPUs sit idle (app.lanes.adaptive); "
        "default: the rung's (on for full)",
    )
    agent_gate: float | None = gate_option("the rung's (1 for full, none for the others)")
    admission: AdmissionMode | None = admission_option("the rung's (in_flight for full)")


class EnginesConfig(_Strict):
    count: int = Field(2, ge=1, strict=True, description=f"embedded engine processes (1..{MAX_ENGINES})")
    cpus: _CpuList = Field(
        default_factory=lambda: [0], description="serving CPU set (pinned policies): [0, 1] or '0-1'"
    )
    slots: int = _count(8, 1, MAX_ENGINE_SLOTS, "concurrent turns per engine")
    layers: int = _count(2, 1, MAX_LAYERS, "GRU layers of the embedded policy")
    hidden: int = _count(64, 8, MAX_HIDDEN, "hidden size of the embedded policy")
    max_tokens: int = _count(32, 1, MAX_TOKENS, "tokens generated per turn (real CPU work)")
    sentinel: bool = Field(
        True,
        strict=True,
        description="weight updates swap only a marker tensor; false: real weights, loaded only from full "
        "checkpoints (the built-in sentinel trainer publishes none)",
    )
    startup_timeout_s: float = _seconds(60.0, "seconds an engine may take to become healthy", least=1.0)
    # Engine faults (docs/faults.md): a failed or hung engine leaves rotation and is restarted.
    # Each has a least value below which it is no real setting (a 1e-300 s update timeout failed every
    # update and restarted the engines in a loop): an update pauses, loads and resumes an engine (≥ 1 s);
    # a health answer crosses loopback HTTP (≥ 0.1 s); a restart wait under 0.1 s is a restart loop.
    update_timeout_s: float = _seconds(
        120.0, "seconds one engine's weight update (pause, load, resume) may take", least=1.0
    )
    health_timeout_s: float = _seconds(5.0, "a slower health answer counts as unhealthy", least=0.1)
    health_interval_s: float = _seconds(5.0, "seconds between health probes of each engine", least=0.1)
    health_misses: int = _count(
        3, 1, 100, "unanswered health probes in a row before a serving engine counts as frozen"
    )
    restart_backoff_s: float = _seconds(1.0, "wait after a failed engine restart; doubles", least=0.1)
    restart_backoff_max_s: float = _seconds(30.0, "longest wait between engine restarts", least=0.1)
    turn_retries: int = _count(3, 0, 100, "failures of one turn on engines that stay up, before it fails")
    max_restarts: int = _count(
        10, 0, 1000, "restarts in a row that fail or do not last before an engine is given up; 0: never"
    )

    @field_validator("count")
    @classmethod
    def _count_fits(cls, count: int) -> int:
        if count > MAX_ENGINES:
            raise ValueError(
                f"{count:,} embedded engines would need about {human_bytes(count * ENGINE_BYTES)} of memory "
                f"(≈ {human_bytes(ENGINE_BYTES)} each); the limit is {MAX_ENGINES}"
            )
        return count

    @model_validator(mode="after")
    def _fits_in_memory(self) -> EnginesConfig:
        problem = engines_memory_problem(self.count, self.layers, self.hidden)
        if problem is not None:
            raise ValueError(problem)
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_max_s {self.restart_backoff_max_s:g} is below restart_backoff_s "
                f"{self.restart_backoff_s:g}, the first wait; raise it or lower the other"
            )
        return self


class LaneWeightsConfig(_Strict):
    """Each lane's guaranteed share of the sandbox CPUs, relative to the others (cgroup `cpu.shares` on
    v1, `cpu.weight` on v2); a lane may use idle CPUs beyond it (work-conserving)."""

    reset: int = _count(DEFAULT_LANE_WEIGHTS["reset"], MIN_WEIGHT, MAX_WEIGHT, "reset lane weight")
    exec: int = _count(DEFAULT_LANE_WEIGHTS["exec"], MIN_WEIGHT, MAX_WEIGHT, "exec lane weight")
    validate_: int = Field(
        DEFAULT_LANE_WEIGHTS["validate"], ge=MIN_WEIGHT, le=MAX_WEIGHT, strict=True, alias="validate"
    )
    cleanup: int = _count(DEFAULT_LANE_WEIGHTS["cleanup"], MIN_WEIGHT, MAX_WEIGHT, "cleanup lane weight")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)

    def by_lane(self) -> dict[str, int]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}


class LocalLanesConfig(_Strict):
    cpus: _CpuList = Field(
        default_factory=lambda: [1], description="CPU set of the sandbox lanes: [1] or '1-3,6'"
    )
    reset: int = _count(2, 1, MAX_LANE_SLOTS, "concurrent resets")
    exec: int = _count(2, 1, MAX_LANE_SLOTS, "concurrent tool calls")
    validate_: int = Field(1, ge=1, le=MAX_LANE_SLOTS, strict=True, alias="validate")
    cleanup: int = _count(1, 1, MAX_LANE_SLOTS, "concurrent cleanups")
    borrow_serving_cpus: bool = Field(
        False,
        strict=True,
        description="lanes.cpus may include engines.cpus: sandbox work runs there at a low CPU weight",
    )
    weights: LaneWeightsConfig = Field(
        default_factory=LaneWeightsConfig, description="the lanes' relative CPU shares (pinned policies)"
    )
    order: LaneOrder = Field(
        LaneOrder.FIFO,
        description="fifo: queued sandbox work starts in arrival order; oldest_group: it and CPU time go "
        "to the oldest group first (CPU priority by niceness where this process may raise it again, as "
        "root; slower in real runs of 6 batches, docs/runs/stop34)",
    )

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


class TrainerConfig(_Strict):
    step_s: float = _seconds(1.0, "seconds per (sentinel) trainer step")


class TasksConfig(_Strict):
    suite: str = Field("builtin", min_length=1, description="'builtin' or a directory of task directories")
    include: list[str] = Field(default_factory=list, description="task names to use; empty: all")


class SandboxConfig(_Strict):
    isolation: str = Field("auto", pattern="^(auto|bwrap|none)$")
    base_dir: str | None = Field(None, min_length=1, description="where work directories go; default: temp")
    # Given time: wall time less the time the command waited for a CPU (app/sandboxes/timelimits.py).
    time_limits: str = Field(
        "given",
        pattern="^(given|wall)$",
        description="set-up and validation limits count 'given' time (wall less CPU waits) or 'wall' time",
    )
    backstop: float = Field(
        10.0,
        ge=1,
        le=1000,
        strict=True,
        description="given-time limits also end at this multiple in wall time",
    )
    docker_image: str | None = Field(
        None,
        min_length=1,
        max_length=512,
        pattern=r"^\S+$",
        description="run each sandbox as a container of this image on DOCKER_HOST's daemon; "
        "default: local sandboxes",
    )


class LocalRunConfig(_Strict):
    seed: int = Field(0, ge=0, le=MAX_SEED, strict=True, description="keys every random draw")
    batches: int = _count(
        3, 1, MAX_RUN_BATCHES, "trainer steps when neither --batches nor --duration is given"
    )
    batch: BatchConfig = Field(default_factory=BatchConfig)
    policy: PolicyKnobs = Field(default_factory=PolicyKnobs)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    lanes: LocalLanesConfig = Field(default_factory=LocalLanesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    def policy_settings(self) -> dict[str, object]:
        """What this config sets of the run's policy, for `PolicyConfig.ladder`."""
        settings: dict[str, object] = {
            "groups_per_batch": self.batch.groups,
            "group_size": self.batch.group_size,
            "surplus_groups": self.policy.surplus_groups,
            "max_staleness": self.policy.max_staleness,
            "max_updating_engines": self.policy.max_updating_engines,
        }
        if self.policy.adaptive_lanes is not None:
            settings["adaptive_lanes"] = self.policy.adaptive_lanes
        if self.policy.admission is not None:
            settings["admission"] = self.policy.admission
        if self.policy.agent_gate is not None:
            settings["agent_gate"] = launch_gate(self.policy.agent_gate)
        return settings

    def lane_config(self) -> LanesConfig:
        """The four lanes, all on `lanes.cpus`, kept off the serving CPUs (validated by the core)."""
        cpus = tuple(self.lanes.cpus)
        return LanesConfig.model_validate(
            {
                "reset": {"slots": self.lanes.reset, "cpus": cpus},
                "exec": {"slots": self.lanes.exec, "cpus": cpus},
                "validate": {"slots": self.lanes.validate_, "cpus": cpus},
                "cleanup": {"slots": self.lanes.cleanup, "cpus": cpus},
                "serving_cpus": tuple(self.engines.cpus),
                "borrow_serving_cpus": self.lanes.borrow_serving_cpus,
                "order": self.lanes.order,
            }
        )

    @model_validator(mode="after")
    def _cpus_usable(self) -> LocalRunConfig:
        available = os.sched_getaffinity(0)
        for name, cpus in (("engines.cpus", self.engines.cpus), ("lanes.cpus", self.lanes.cpus)):
            if not cpus:
                raise ValueError(f"{name} must list at least one CPU")
            missing = sorted(set(cpus) - available)
            if missing:
                raise ValueError(f"{name}: CPUs {missing} are not available here (have {sorted(available)})")
        try:
            self.lane_config()
        except ValidationError as exc:
            raise ValueError(f"lanes.cpus: {problems(exc)}") from None
        return self


def sentinel_trainer_problem(
    engines: EnginesConfig, field: str, trainer: str, instead: str = ""
) -> str | None:
    """Why engines of this config cannot load what the built-in sentinel trainer (`trainer`, as the
    caller names it) publishes, or None.

    That trainer publishes checkpoints of the sentinel tensor alone (`save_sentinel`). A sentinel engine
    takes that tensor from any checkpoint that holds it (every embedded policy's does); an engine of
    real weights (`engines.sentinel: false`) loads a checkpoint only whole and refuses every one of
    those, so it serves on at its first version until every engine is more than K versions behind and
    no turn can run (docs/faults.md)."""
    if engines.sentinel:
        return None
    return (
        f"{field}: false loads real weights, but {trainer} publishes sentinel weights the engines refuse "
        f"(every version, so the run would stall once they are K versions behind); set {field}: true{instead}"
    )


def default_config_path() -> Path:
    """The config shipped in the package, so `corral run` works from any directory."""
    return Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def default_config_data() -> object:
    """The fields of the shipped config (`default_config_path`), unvalidated: a run created without a
    config validates them as its own, so a refusal names the run's field."""
    path = default_config_path()
    return read_document(path, f"run config {path}")


def load_config(path: Path) -> LocalRunConfig:
    """Read and validate a run config for the built-in sentinel trainer (`corral run`'s, and `corral
    serve --demo`'s); refuse it with one line naming the file and the field."""
    try:
        data = read_document(Path(path), f"run config {path}")
    except DocumentError as exc:
        raise LocalRunError(str(exc)) from None
    if data is None:  # an empty or unsaved file, not a choice: `{}` asks for every default
        raise LocalRunError(f"run config {path} is empty; write {{}} in it for every default")
    if not isinstance(data, dict):
        raise LocalRunError(f"{path}: the top level must be a mapping of fields, not {type(data).__name__}")
    try:
        config = LocalRunConfig.model_validate(data)
    except ValidationError as exc:
        raise LocalRunError(f"{path}: {problems(exc)}") from None
    problem = sentinel_trainer_problem(config.engines, "engines.sentinel", "corral run's trainer")
    if problem is not None:
        raise LocalRunError(f"{path}: {problem}")
    if config.sandbox.base_dir is not None:
        check_writable_dir(Path(config.sandbox.base_dir), "sandbox.base_dir")
    return config


def check_writable_dir(path: Path, field: str) -> None:
    """Refuse `path` unless it is (or can be made) a directory this process can create files in.

    Directories created for the check are removed again: a check that passes may still be followed by
    a refusal, and the sandboxes make the directory when the run starts."""
    created: list[Path] = []
    try:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
        if not path.is_dir():
            raise LocalRunError(f"{field}: {path} is not a directory")
        with tempfile.NamedTemporaryFile(dir=path, prefix=".corral-check-"):
            pass
    except OSError as exc:
        raise LocalRunError(f"{field}: cannot create files in {path}: {exc.strerror or exc}") from None
    finally:
        for p in reversed(created):
            p.rmdir()
