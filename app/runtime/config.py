"""`corral run`'s config file: the schema of app/configs/local.yaml, validated before a run starts."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.core.config import LanesConfig


class LocalRunError(RuntimeError):
    """The run cannot start or went wrong in a way the operator must fix; the message says what."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchConfig(_Strict):
    groups: int = Field(4, ge=1, description="B")
    group_size: int = Field(4, ge=2, description="G")


class PolicyKnobs(_Strict):
    surplus_groups: int = Field(2, ge=0, description="S")
    max_staleness: int = Field(2, ge=0, description="K")
    max_updating_engines: int = Field(1, ge=1)


class EnginesConfig(_Strict):
    count: int = Field(2, ge=1, description="embedded engine processes")
    cpus: list[int] = Field(default_factory=lambda: [0], description="serving CPU set (pinned policies)")
    slots: int = Field(8, ge=1, description="concurrent turns per engine")
    layers: int = Field(2, ge=1)
    hidden: int = Field(64, ge=8)
    max_tokens: int = Field(32, ge=1, description="tokens generated per turn (real CPU work)")
    sentinel: bool = Field(True, description="weight updates swap only a marker tensor")
    startup_timeout_s: float = Field(60.0, gt=0)


class LocalLanesConfig(_Strict):
    cpus: list[int] = Field(default_factory=lambda: [1], description="CPU set of the sandbox lanes")
    reset: int = Field(2, ge=1)
    exec: int = Field(2, ge=1)
    validate_: int = Field(1, ge=1, alias="validate")
    cleanup: int = Field(1, ge=1)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class TrainerConfig(_Strict):
    step_s: float = Field(1.0, ge=0, description="seconds per (sentinel) trainer step")


class TasksConfig(_Strict):
    suite: str = Field("builtin", description="'builtin' or a directory of task directories")
    include: list[str] = Field(default_factory=list, description="task names to use; empty: all")


class SandboxConfig(_Strict):
    isolation: str = Field("auto", pattern="^(auto|bwrap|none)$")
    base_dir: str | None = Field(None, description="where work directories go; default: a temp dir")


class LocalRunConfig(_Strict):
    seed: int = 0
    batches: int = Field(3, ge=1, description="trainer steps when neither --batches nor --duration is given")
    batch: BatchConfig = Field(default_factory=BatchConfig)
    policy: PolicyKnobs = Field(default_factory=PolicyKnobs)
    engines: EnginesConfig = Field(default_factory=EnginesConfig)
    lanes: LocalLanesConfig = Field(default_factory=LocalLanesConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

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
            }
        )

    @model_validator(mode="after")
    def _cpus_usable(self) -> LocalRunConfig:
        try:
            self.lane_config()
        except ValidationError as exc:
            raise ValueError(f"engines.cpus / lanes.cpus: {exc.errors()[0]['msg']}") from None
        available = os.sched_getaffinity(0)
        for name, cpus in (("engines.cpus", self.engines.cpus), ("lanes.cpus", self.lanes.cpus)):
            if not cpus:
                raise ValueError(f"{name} must list at least one CPU")
            missing = sorted(set(cpus) - available)
            if missing:
                raise ValueError(f"{name}: CPUs {missing} are not available here (have {sorted(available)})")
        return self


def load_config(path: Path) -> LocalRunConfig:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise LocalRunError(f"cannot read run config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise LocalRunError(f"{path}: not valid YAML: {exc}") from None
    try:
        return LocalRunConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
        )
        raise LocalRunError(f"{path}: {problems}") from None
