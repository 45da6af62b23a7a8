"""The service's API schemas: what a client sends and gets back. Separate from the ORM models (the
store's) and from the runtime's own configs, which they embed.

Every input model is strict: unknown fields are refused, numbers and flags are taken only as JSON numbers
and booleans (never "2", nor 1 for true), numbers are bounded and finite, and a run config is validated
in full (the workload or local-run config inside it) before anything starts.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from app.core.config import (
    MAX_AGENT_GATE,
    MAX_POLICY_VERSION,
    AdmissionMode,
    PauseModeName,
    PolicyName,
    launch_gate,
)
from app.runtime.config import MAX_SURPLUS as LOCAL_MAX_SURPLUS
from app.runtime.config import LocalRunConfig, default_config_data, sentinel_trainer_problem
from app.sim.workload import Workload
from app.tasks.loader import builtin_task_names
from app.validation import MAX_RUN_STALENESS, MAX_SURPLUS, in_flight_problem

# The agent-phase gate's factor (app.runtime.gate), a JSON number: at launch 0 asks for no gate, live 0
# opens the gate.
GateFactor = Annotated[float, Field(ge=0, le=MAX_AGENT_GATE, allow_inf_nan=False, strict=True)]
SYNC_SURPLUS = "surplus_groups: policy sync runs without surplus (S = 0), got {}"
LOCAL_SURPLUS = "surplus_groups: a local run takes S up to {:,}, got {:,}"


class _Input(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunKind(StrEnum):
    SIM = "sim"  # the production runtime on the simulator's engines and sandboxes, paced to the wall clock
    LOCAL = "local"  # the embedded default: embedded engines, local sandboxes, the built-in tasks


def surplus_problem(
    kind: RunKind, policy: PolicyName, surplus: int, groups: int, group_size: int
) -> str | None:
    """Why S = `surplus`, asked of a run (at its creation or live), is more than the run's own config
    would take: none on the sync rung (`PolicyConfig.ladder` sets its S to 0); a local run's config's
    bound (app.runtime.config.MAX_SURPLUS); a simulated run's (B + S) × G within the simulator's."""
    if policy is PolicyName.SYNC and surplus != 0:
        return SYNC_SURPLUS.format(surplus)
    if kind is RunKind.LOCAL and surplus > LOCAL_MAX_SURPLUS:
        return LOCAL_SURPLUS.format(LOCAL_MAX_SURPLUS, surplus)
    if kind is RunKind.SIM and (problem := in_flight_problem(groups, group_size, surplus)) is not None:
        return f"surplus_groups: {problem}"
    return None


NO_SERVER_FILES = "a run created through the API cannot read or write server files"


def server_files_problem(config: LocalRunConfig) -> str | None:
    """Why a local run's config, sent through the API, would reach files of the server's own choosing
    that are not the API's to give: a task suite directory (a failed load listed the directory's
    entries in the run's error, readable by any viewer) or a directory for sandboxes' work. A run
    created through the API takes the built-in suite, and an `include` naming no task of it is
    refused here rather than failing the run once started."""
    if config.tasks.suite != "builtin":
        return f"config.tasks.suite: {NO_SERVER_FILES}; only 'builtin' is taken (corral run reads others)"
    if config.sandbox.base_dir is not None:
        return f"config.sandbox.base_dir: {NO_SERVER_FILES}; the server's temporary directory is used"
    if config.tasks.include:
        known = builtin_task_names()
        if unknown := sorted(set(config.tasks.include) - known):
            return f"config.tasks.include: unknown tasks {unknown}; the built-in suite has {sorted(known)}"
    return None


class OrchestratorKind(StrEnum):
    IN_PROCESS = "in-process"  # the run executes in the API server (needed for an external trainer)
    CELERY = "celery"  # a worker of the `orchestrator` queue executes it (CORRAL_BROKER_URL)


class TrainerKind(StrEnum):
    EXTERNAL = "external"  # a trainer takes batches through the trainer API
    SENTINEL = "sentinel"  # the built-in client: acks each batch and publishes a sentinel version


def small_workload() -> dict[str, Any]:
    """The default simulated workload: batches every few seconds of wall time at speed 1."""
    return {
        "seed": 0,
        "batch": {"groups": 2, "group_size": 2},
        "policy": {"surplus_groups": 2, "max_staleness": 2},
        "engines": {"count": 2, "slots": 4, "update_s": 0.2},
        "cpus": {"total": 8, "serving": 2},
        "lanes": {"reset": 4, "exec": 4, "validate": 2, "cleanup": 2},
        "trajectory": {
            "reset_s": {"uniform": [0.05, 0.2]},
            "turns": {"uniform": [1, 3]},
            "llm_s": {"uniform": [0.05, 0.3]},
            "tool_s": 0.05,
            "validate_s": 0.05,
            "cleanup_s": 0.05,
            "timeout_s": 30,
        },
    }


class RunCreate(_Input):
    """A run to create and start. B, G, S and K come from the workload (sim) or config (local), and
    may be overridden here."""

    name: str = Field("run", min_length=1, max_length=100, pattern=r"^[\w .:-]+$")
    kind: RunKind = RunKind.SIM
    policy: PolicyName = Field(PolicyName.FULL, description="rung of the ablation ladder")
    workload: Workload | None = Field(None, description="sim: workload spec; default: a small one")
    config: LocalRunConfig | None = Field(
        None, description="local: run config; default: app/configs/local.yaml"
    )
    batches: StrictInt | None = Field(
        None, ge=1, le=1_000_000, description="trainer steps; none: until stopped"
    )
    speed: float = Field(
        1.0, ge=0.01, le=1000, allow_inf_nan=False, strict=True, description="sim: virtual s per wall s"
    )
    trainer: TrainerKind = TrainerKind.EXTERNAL
    orchestrator: OrchestratorKind = Field(
        OrchestratorKind.IN_PROCESS, description="where the run executes: this server, or a Celery worker"
    )
    sentinel_step_s: float = Field(
        0.2, ge=0, le=3600, allow_inf_nan=False, strict=True, description="built-in trainer step"
    )
    groups_per_batch: StrictInt | None = Field(None, ge=1, le=4096, description="B")
    group_size: StrictInt | None = Field(None, ge=2, le=1024, description="G")
    surplus_groups: StrictInt | None = Field(None, ge=0, le=MAX_SURPLUS, description="S")
    max_staleness: StrictInt | None = Field(None, ge=0, le=MAX_RUN_STALENESS, description="K")
    admission: AdmissionMode | None = Field(
        None,
        description="what B + S caps: live groups (in flight + ready), groups in flight (in_flight), or "
        "attempts in flight ((B + S)·G, attempts); default: a local config's policy.admission, for full a "
        "workload's, else the rung's (in_flight for full, live for the others)",
    )
    agent_gate: GateFactor | None = Field(
        None,
        description="the agent-phase gate: attempts start their agent phase while fewer than this × the "
        "exec lane's slots ÷ the measured tool share are in theirs; 0: no gate; default: a local config's "
        "policy.agent_gate, for full a workload's, else the rung's (1 for full, none for the others)",
    )
    ready_surplus: StrictInt | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="policy full: room for completed groups waiting for a batch beyond B + S (in flight + "
        "ready ≤ B + S + this). Not given: B + S for an external trainer, so a trainer that stops taking "
        "batches cannot make the run grow without bound; none for the sentinel trainer. null: no cap",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_workload_or_config(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind", "sim") == "sim" and data.get("workload") is None:
            return {**data, "workload": small_workload()}
        if isinstance(data, dict) and data.get("kind") == "local" and data.get("config") is None:
            return {**data, "config": default_config_data()}
        return data

    @model_validator(mode="after")
    def _kind_matches(self) -> RunCreate:
        if self.kind is RunKind.SIM:
            if self.config is not None:
                raise ValueError("config: for kind 'local' only; a sim run takes a workload")
            assert self.workload is not None
            if self.workload.trace is not None:
                raise ValueError(f"workload.trace: {NO_SERVER_FILES}")
            # The workload checks its own B, G and S; the overrides can go past the same bound.
            problem = in_flight_problem(
                self.groups_per_batch or self.workload.batch.groups,
                self.group_size or self.workload.batch.group_size,
                self.workload.policy.surplus_groups if self.surplus_groups is None else self.surplus_groups,
            )
            if problem is not None:  # only overrides can cause it: name those given
                knobs = ("groups_per_batch", "group_size", "surplus_groups")
                raise ValueError(f"{', '.join(k for k in knobs if getattr(self, k) is not None)}: {problem}")
        elif self.workload is not None:
            raise ValueError("workload: for kind 'sim' only; a local run takes a config")
        elif self.config is not None and (problem := server_files_problem(self.config)) is not None:
            raise ValueError(problem)
        elif self.config is not None and self.trainer is TrainerKind.SENTINEL:
            problem = sentinel_trainer_problem(
                self.config.engines,
                "config.engines.sentinel",
                "trainer 'sentinel'",
                ", or trainer 'external' with a trainer that publishes full checkpoints",
            )
            if problem is not None:
                raise ValueError(problem)
        if self.surplus_groups is not None:  # as a live change of S would be (RunHandle.patch_problem)
            batch = (
                self.workload.batch
                if self.workload is not None
                else self.config.batch
                if self.config
                else None
            )
            problem = surplus_problem(
                self.kind,
                self.policy,
                self.surplus_groups,
                self.groups_per_batch or (batch.groups if batch else 1),
                self.group_size or (batch.group_size if batch else 2),
            )
            if problem is not None:
                raise ValueError(problem)
        if self.ready_surplus is not None and self.policy is not PolicyName.FULL:
            raise ValueError("ready_surplus: only policy full admits in flight and keeps ready groups apart")
        if self.ready_surplus is not None and (admitting := self._admission_given()) is not None:
            field, admission = admitting
            if admission is not AdmissionMode.IN_FLIGHT:
                raise ValueError(
                    f"ready_surplus: {field} is {admission}, which keeps no room for ready groups apart "
                    "(live counts them in B + S, attempts caps them at (K + 1)·B); use in_flight"
                )
        if self.speed != 1.0 and self.kind is not RunKind.SIM:
            raise ValueError("speed: applies to sim runs only")
        if self.orchestrator is OrchestratorKind.CELERY and self.trainer is TrainerKind.EXTERNAL:
            raise ValueError(
                "orchestrator: celery runs with the sentinel trainer only: the trainer API reaches runs "
                "executing in the API server"
            )
        return self

    def stored(self) -> dict[str, Any]:
        """The run's config as stored and echoed (GET /api/runs/{id}): the workload's or local config's
        own `batches` is left out, since this run's `batches` governs (null: until stopped)."""
        return self.model_dump(
            mode="json", by_alias=True, exclude={"workload": {"batches"}, "config": {"batches"}}
        )

    def _admission_given(self) -> tuple[str, AdmissionMode] | None:
        """The admission this run asks for, and where it asks (None: the rung's own)."""
        if self.admission is not None:
            return "admission", self.admission
        if self.config is not None and self.config.policy.admission is not None:
            return "config.policy.admission", self.config.policy.admission
        return None

    def overrides(self) -> dict[str, object]:
        knobs: dict[str, object] = {
            "groups_per_batch": self.groups_per_batch,
            "group_size": self.group_size,
            "surplus_groups": self.surplus_groups,
            "max_staleness": self.max_staleness,
            "admission": self.admission,
        }
        overrides = {k: v for k, v in knobs.items() if v is not None}
        if self.agent_gate is not None:
            overrides["agent_gate"] = launch_gate(self.agent_gate)
        return overrides


class PolicyPatch(_Input):
    """Live changes: S and K, the pace of weight rollouts, and the agent-phase gate's factor."""

    max_staleness: StrictInt | None = Field(None, ge=0, le=MAX_RUN_STALENESS, description="K")
    surplus_groups: StrictInt | None = Field(None, ge=0, le=MAX_SURPLUS, description="S")
    max_updating_engines: StrictInt | None = Field(
        None, ge=1, le=1024, description="engines updating at once"
    )
    pause_mode: PauseModeName | None = Field(
        None, description="how an updating engine treats in-flight turns"
    )
    agent_gate: GateFactor | None = Field(
        None,
        description="the agent-phase gate's factor, on a run that has the gate; 0 opens it (nobody waits), "
        "a positive factor closes it again",
    )
    confirm_large_change: StrictBool | None = Field(
        None,
        description="true to apply an S that lets more than 4 times the trajectories now in flight run "
        "at once ((B + S)·G, and 64 more at least); such an S is refused (422) without it",
    )

    def changes(self) -> dict[str, Any]:
        """The knobs this patch changes, by name (JSON values), without the confirmation."""
        return self.model_dump(mode="json", exclude_none=True, exclude={"confirm_large_change"})

    @model_validator(mode="after")
    def _something(self) -> PolicyPatch:
        if not self.changes():
            raise ValueError(
                "give at least one of max_staleness, surplus_groups, max_updating_engines, pause_mode, "
                "agent_gate"
            )
        return self


class WeightsPublish(_Input):
    """A new policy version: weights in the directory `path` (on the engines' hosts), or a sentinel."""

    version: StrictInt = Field(ge=1, le=MAX_POLICY_VERSION)
    path: str | None = Field(None, min_length=1, max_length=4096)
    sentinel: StrictBool = False

    @model_validator(mode="after")
    def _path_or_sentinel(self) -> WeightsPublish:
        if (self.path is None) == (not self.sentinel):
            raise ValueError("give exactly one of path or sentinel: true")
        if self.path is not None:
            problem = weights_path_problem(self.path)
            if problem is not None:
                raise ValueError(f"path: {problem}")
        return self


# Linux's limits on a path a system call takes (PATH_MAX, with its NUL) and on each name in it (NAME_MAX):
# past them the server's directory check raised ENAMETOOLONG, a 500
MAX_PATH_BYTES = 4095
MAX_NAME_BYTES = 255


def weights_path_problem(path: str) -> str | None:
    """What is wrong with `path` as a weights directory, before the file system is asked: not absolute
    (it goes to the engines, whose working directory is not the server's), a NUL in it, or a length the
    OS refuses to look up."""
    if not path.startswith("/"):
        return f"{path!r} must be absolute (it is read by the engines)"
    if "\0" in path:
        return "contains a NUL character"
    encoded = path.encode("utf-8", "surrogatepass")
    if len(encoded) > MAX_PATH_BYTES:
        return f"{len(encoded):,} bytes long, over {MAX_PATH_BYTES:,} bytes (the longest path Linux takes)"
    if any(len(name) > MAX_NAME_BYTES for name in encoded.split(b"/")):
        return f"a name in it is over {MAX_NAME_BYTES} bytes (the longest Linux takes)"
    return None


class RunAction(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    STOP = "stop"


class AckResult(BaseModel):
    batch_id: str
    acked: Literal[True] = True
    already_acked: bool


# The most times one batch can have been handed out: a signed 32-bit integer, as a policy version
MAX_DELIVERY = 2**31 - 1


class BatchRelease(_Input):
    """A batch handed back untrained: `delivery` is the one the trainer holds (its batch's `delivery`)."""

    delivery: StrictInt = Field(ge=1, le=MAX_DELIVERY)


class ReleaseResult(BaseModel):
    batch_id: str
    released: bool
    delivery: int  # how many times it has been handed out
    detail: str | None = None  # why nothing was released


class BatchRenew(_Input):
    """A batch's lease extended while it is trained on: `delivery` is the one the trainer holds (its
    batch's `delivery`)."""

    delivery: StrictInt = Field(ge=1, le=MAX_DELIVERY)


class RenewResult(BaseModel):
    batch_id: str
    renewed: bool
    delivery: int  # how many times it has been handed out
    lease_s: float  # seconds the lease of that delivery has left: ack_timeout_s once renewed, else 0
    detail: str | None = None  # why it was not renewed


class Problem(BaseModel):
    """An error: `detail` says what is wrong, naming the field."""

    detail: str


class FieldProblem(BaseModel):
    field: str = Field(description="where, as typed: `workload.batch.groups`, `path.run_id`, `body`")
    problem: str = Field(description="the field and what is wrong with it, in one line")


class ValidationProblem(BaseModel):
    """Refused input (422): `detail` says what is wrong in one line, naming the field; `errors` lists each
    problem of a request that failed validation (absent when the request was valid but its values
    cannot apply, as a version not newer than the published one)."""

    detail: str
    errors: list[FieldProblem] = Field(default_factory=list)
