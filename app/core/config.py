"""Run policy: the knobs of one collection run, frozen and validated.

Process settings (ports, URLs, paths) live elsewhere; this is only what the scheduler obeys. Every
field has a bound, so a bad value is refused when the policy is built, never half-way through a run.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The newest policy version a run takes (the API's bound, a signed 32-bit integer). A run whose trainer
# published it can train on no further batch, since the next one is to be published as a newer version.
MAX_POLICY_VERSION = 2**31 - 1


class PauseModeName(StrEnum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"


class AdmissionMode(StrEnum):
    LIVE = "live"  # B + S caps groups in flight + ready
    IN_FLIGHT = "in_flight"  # B + S caps groups in flight; ready groups have their own room
    # (B + S)·G caps the attempts in flight: a group's finished attempts hold no sandbox, so their room
    # admits further groups while its last attempts run; ready groups are capped at (K + 1)·B
    ATTEMPTS = "attempts"


class UpdatePacing(StrEnum):
    FIXED = "fixed"  # max_updating_engines engines load weights at once
    FREE_SLOTS = "free_slots"  # more at once while the engines left serving have room for their turns


class PolicyName(StrEnum):
    SYNC = "sync"
    COMPLETION = "completion"
    LANES = "lanes"
    FULL = "full"


# The largest agent-phase gate factor a policy, a run config or `corral sim --agent-gate` takes.
MAX_AGENT_GATE = 1_000


def gate_option(default: str) -> Any:
    """The agent-phase gate's factor as asked for at launch (a run config, a workload, `POST /api/runs`):
    0 asks for no gate (`launch_gate`); `default` says what leaving it out gives."""
    return Field(
        None,
        ge=0,
        le=MAX_AGENT_GATE,
        allow_inf_nan=False,
        strict=True,
        description="the agent-phase gate (app.runtime.gate): attempts start their agent phase while fewer "
        f"than this × the exec lane's slots ÷ the measured tool share are in theirs; 0: no gate; default: "
        f"{default}",
    )


def admission_option(default: str) -> Any:
    """What B + S caps, as asked for at launch; `default` says what leaving it out gives."""
    return Field(
        None,
        description="what B + S caps: live groups (live: in flight + ready), groups in flight (in_flight), "
        f"or attempts in flight ((B + S)·G, attempts); default: {default}",
    )


def launch_gate(factor: float) -> float | None:
    """The policy's `agent_gate` for a factor asked for at launch (a run config, `corral sim
    --agent-gate`, `POST /api/runs`): 0 asks for no gate (None). A live change's 0 opens a gate instead
    (app.runtime.gate)."""
    return factor or None


class PolicyConfig(BaseModel):
    """The scheduler's policy. The three techniques are separate switches, for ablation."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    groups_per_batch: int = Field(32, ge=1, description="B: groups per trainer batch")
    group_size: int = Field(8, ge=2, description="G: attempts per task; GRPO needs at least 2")
    surplus_groups: int = Field(32, ge=0, description="S: groups admitted beyond B (in flight + ready ≤ B+S)")
    max_staleness: int = Field(
        4, ge=0, description="K: largest allowed trainer version minus oldest turn version"
    )
    completion_order: bool = Field(True, description="fill batches in completion order, not start order")
    pinned_lanes: bool = Field(True, description="run sandbox work in lanes with their own CPU sets")
    rolling_updates: bool = Field(
        True, description="publish weights one engine at a time, keeping in-flight turns"
    )
    max_updating_engines: int = Field(1, ge=1, description="engines allowed to load weights at the same time")
    update_pacing: UpdatePacing = Field(
        UpdatePacing.FIXED,
        description="rolling updates: `fixed` updates `max_updating_engines` engines at once; `free_slots` "
        "starts a second and further engine (up to `max_updating_engines`) only while the engines left "
        "serving have a free turn slot for every turn in flight on the engines updating",
    )
    pause_mode: PauseModeName = Field(
        PauseModeName.KEEP, description="how an updating engine treats in-flight turns"
    )
    filter_zero_variance: bool = Field(False, description="discard groups whose rewards are all equal")
    admission: AdmissionMode = Field(
        AdmissionMode.LIVE,
        description="what B + S caps: live groups (in flight + ready), or only groups in flight (a ready "
        "group holds no sandbox and no engine slot), or (`attempts`) the attempts in flight, (B + S)·G "
        "of them, so a group's finished attempts make room for further groups",
    )
    adaptive_lanes: bool = Field(
        False,
        description="lane slots follow measured demand: in the simulator slots follow cores and shares "
        "follow demand (app.sim.lanes); real in-process lanes grow while they queue and their CPUs sit "
        "idle (app.lanes.adaptive); Celery lanes keep their workers' concurrency",
    )
    agent_gate: float | None = Field(
        None,
        ge=0,
        le=MAX_AGENT_GATE,
        allow_inf_nan=False,
        description="attempts past their reset start their agent phase (and its time) only while fewer "
        "than this × the exec lane's slots ÷ the measured share of agent time spent running tool calls "
        "are in theirs (app.runtime.gate); None: no gate; 0: a gate held open, as an operator's live "
        "change leaves it (a run config's or `corral sim`'s 0 asks for none). Needs lanes whose slots "
        "can be read (the simulator's, in-process lanes); Celery lanes have none",
    )
    ready_surplus: int | None = Field(
        None,
        ge=0,
        le=1_000_000,
        description="in-flight admission: room for ready groups beyond B + S, so in flight + ready ≤ "
        "B + S + this (None: no admission while (K + 1)·B wait ready, as many as the next K + 1 "
        "batches take)",
    )

    @field_validator("agent_gate")
    @classmethod
    def _no_negative_zero(cls, value: float | None) -> float | None:
        # -0.0 passes ge=0 and was stored and shown as "-0" (the dashboard's form, a PATCH)
        return None if value is None else value + 0.0

    @model_validator(mode="after")
    def _ready_surplus_in_flight(self) -> PolicyConfig:
        if self.ready_surplus is not None and self.admission is AdmissionMode.ATTEMPTS:
            raise ValueError(
                "ready_surplus applies to in_flight admission; attempts admission caps ready groups at "
                "(K + 1)·B"
            )
        return self

    def with_changes(self, **changes: object) -> PolicyConfig:
        """A copy with `changes` applied and validated (model_copy alone would skip validation)."""
        return type(self).model_validate({**self.model_dump(), **changes})

    @classmethod
    def ladder(cls, name: PolicyName | str, **overrides: object) -> PolicyConfig:
        """The ablation ladder: each rung adds one technique to the one before."""
        rung = PolicyName(name)
        table: dict[PolicyName, dict[str, object]] = {
            PolicyName.SYNC: {
                "completion_order": False,
                "surplus_groups": 0,
                "pinned_lanes": False,
                "rolling_updates": False,
            },
            PolicyName.COMPLETION: {
                "completion_order": True,
                "pinned_lanes": False,
                "rolling_updates": False,
            },
            PolicyName.LANES: {"completion_order": True, "pinned_lanes": True, "rolling_updates": False},
            PolicyName.FULL: {"completion_order": True, "pinned_lanes": True, "rolling_updates": True},
        }
        # Defaults a rung picks that the caller may override. `full` admits in flight: a ready group
        # holds no sandbox and no engine slot, so B + S caps only what runs (measured in
        # docs/simulator.md); K still ages ready groups out. Its lanes adapt to measured demand
        # (better or equal on every workload of the simulator's family, docs/simulator.md). Its attempts
        # enter their agent phase through the gate (app.runtime.gate): on `cpu-scarce` without it 92% of
        # them ran out of agent time queued for tool calls; elsewhere it changes nothing measurable.
        defaults: dict[PolicyName, dict[str, object]] = {
            PolicyName.FULL: {"admission": AdmissionMode.IN_FLIGHT, "adaptive_lanes": True, "agent_gate": 1.0}
        }
        pacing = overrides.get("update_pacing", UpdatePacing.FREE_SLOTS)
        if "max_updating_engines" not in overrides and pacing == UpdatePacing.FREE_SLOTS:
            # Given no maximum, `full` paces its rolling update by free slots: more than one engine
            # loads weights at once while the other engines have free slots for their turns (fewer
            # stale groups; docs/simulator.md), up to 64, the most engines a config may have. A
            # maximum given (`corral run` and `corral serve` pass their config's) is kept as given.
            defaults[PolicyName.FULL] |= {
                "update_pacing": UpdatePacing.FREE_SLOTS,
                "max_updating_engines": 64,
            }
        data = {**defaults.get(rung, {}), **overrides, **table[rung]}
        return cls.model_validate(data)


class LaneOrder(StrEnum):
    """Which queued operation of a lane takes the next free slot.

    `fifo` (the default): the earliest queued. `oldest_group`: the one whose group was admitted first
    (its group id), then the earliest queued; in-process lanes then also give the older groups' sandbox
    commands more CPU (app.lanes.inprocess). It finishes slow groups one at a time instead of all
    together, which spread the cost of real runs' slow groups over their early batches: `full` was
    slower with it in 3 of 3 real pairs of 6 batches (median 1.10×; docs/runs/stop34), so it is an
    option, not the default."""

    OLDEST_GROUP = "oldest_group"
    FIFO = "fifo"


class LaneConfig(BaseModel):
    """One sandbox lane: how many operations run at once, and on which CPUs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slots: int = Field(1, ge=1, description="operations of this lane running at once")
    cpus: tuple[int, ...] = Field((), description="CPU set of the lane's workers")


class LanesConfig(BaseModel):
    """The four lanes and the serving CPUs they must stay off.

    Lanes may share CPUs with one another (a 2-core machine has one CPU for all of them), and by default
    never with serving: that is what keeps tool calls from preempting model turns. With
    `borrow_serving_cpus` the lanes may also run on serving CPUs, where the runtime gives sandbox work a
    low CPU weight so that serving keeps priority and the lanes take only the cycles it leaves idle (for a
    machine too small to give the engines a whole core they don't use).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reset: LaneConfig
    exec: LaneConfig
    validate_: LaneConfig = Field(alias="validate")
    cleanup: LaneConfig
    serving_cpus: tuple[int, ...] = Field(description="CPUs of model serving")
    borrow_serving_cpus: bool = Field(
        False, description="lanes may use serving CPUs too, at a CPU weight far below serving's"
    )
    order: LaneOrder = Field(
        LaneOrder.FIFO,
        description="oldest_group: a lane's queue and its CPUs favour the oldest group; fifo: neither",
    )

    @model_validator(mode="after")
    def _off_serving(self) -> LanesConfig:
        serving = set(self.serving_cpus)
        for name, lane in self.by_name().items():
            if not lane.cpus:
                raise ValueError(f"lane {name} needs a CPU set")
            shared = sorted(serving & set(lane.cpus))
            if shared and not self.borrow_serving_cpus:
                raise ValueError(
                    f"lane {name} shares CPUs {shared} with serving; lanes must stay off them"
                    " (or set borrow_serving_cpus, which runs sandbox work there at a low CPU weight)"
                )
        return self

    def by_name(self) -> dict[str, LaneConfig]:
        return {"reset": self.reset, "exec": self.exec, "validate": self.validate_, "cleanup": self.cleanup}
