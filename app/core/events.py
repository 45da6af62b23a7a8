"""The typed event stream: every state change of a run, in the order it happened.

The runtime publishes one `Event` per state change; the store, the live stream to the browser, the
metrics and the run report all read this one stream. An event is a frozen payload wrapped in an
`Envelope` that carries the run id, a gap-free sequence number and the time (seconds on the run's clock).

Invariants:
- sequence numbers start at 0 and increase by one per event of a run, so a gap means a lost event;
- every admitted group has exactly one terminal event (`GroupDelivered` or `GroupDiscarded`); the
  `Ledger` checks this from the stream alone, independently of the scheduler's own counters;
- an attempt's tries: `AttemptStarted` opens a try; `AttemptFinished`, `AttemptCancelled` (its group
  was discarded) or `AttemptRestarted` (a stop-the-world update threw it away; an `AttemptStarted` for
  the next try follows at once) closes it. Every try that opened is closed by exactly one of them;
- a `SandboxOp` is published when the op ends (or is cancelled; then `ok` is False), a `TurnDone` when
  the engine call returns or fails (then `error` is set);
- `Envelope.to_dict` / `envelope_from_dict` round-trip exactly, and the dict is strict JSON (no NaN).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Event:
    """Base of every payload. `kind` is the stable name used on the wire and in the store."""

    kind: ClassVar[str] = "event"


# -- groups ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupAdmitted(Event):
    kind: ClassVar[str] = "group_admitted"
    group_id: int
    task_index: int
    group_size: int
    task: str = ""


@dataclass(frozen=True, slots=True)
class GroupReady(Event):
    """All G attempts finished; the group waits in the ready queue (completion order)."""

    kind: ClassVar[str] = "group_ready"
    group_id: int


@dataclass(frozen=True, slots=True)
class GroupDelivered(Event):
    kind: ClassVar[str] = "group_delivered"
    group_id: int
    batch_index: int
    staleness: int
    rewards: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupDiscarded(Event):
    """Terminal: `reason` is one of stale, failed, cancelled, zero_variance, orphaned."""

    kind: ClassVar[str] = "group_discarded"
    group_id: int
    reason: str
    detail: str = ""


# -- attempts and their spans -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttemptStarted(Event):
    kind: ClassVar[str] = "attempt_started"
    group_id: int
    attempt: int


@dataclass(frozen=True, slots=True)
class AttemptFinished(Event):
    kind: ClassVar[str] = "attempt_finished"
    group_id: int
    attempt: int
    reward: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class AttemptCancelled(Event):
    """The try was stopped because its group was discarded (`reason`: the group's discard reason)."""

    kind: ClassVar[str] = "attempt_cancelled"
    group_id: int
    attempt: int
    reason: str


@dataclass(frozen=True, slots=True)
class AttemptRestarted(Event):
    """A stop-the-world update threw the attempt's turns away; it starts over."""

    kind: ClassVar[str] = "attempt_restarted"
    group_id: int
    attempt: int


@dataclass(frozen=True, slots=True)
class TurnDone(Event):
    """One model turn: `queued_at` is when it asked for an engine slot, `start`/`end` the engine call."""

    kind: ClassVar[str] = "turn"
    group_id: int
    attempt: int
    engine: str
    version: int
    queued_at: float
    start: float
    end: float
    tokens: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class SandboxOp(Event):
    """One sandbox operation in a lane: `queued_at` → `start` is the lane queue wait.

    `queue_depth` counts the lane's ops submitted and not yet started when this one was submitted
    (itself included); `busy` the lane's ops running once this one started (itself included), 0 when
    it was cancelled before it started (then `start` = `end`, the time it was cancelled)."""

    kind: ClassVar[str] = "sandbox_op"
    group_id: int
    attempt: int
    lane: str
    queued_at: float
    start: float
    end: float
    ok: bool = True
    detail: str = ""
    queue_depth: int = 0
    busy: int = 0


@dataclass(frozen=True, slots=True)
class AgentGateWait(Event):
    """An attempt whose reset was done waited at the agent-phase gate (app.runtime.gate) from `queued_at`
    until `start`, when its agent phase (and its agent time) began. Published only for a wait."""

    kind: ClassVar[str] = "agent_gate_wait"
    group_id: int
    attempt: int
    queued_at: float
    start: float


# -- engines and weights ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VersionPublished(Event):
    """The trainer published `version` (weights at `path`, or a sentinel when `path` is None);
    `command_id`: the operator command that published it (its answer's), empty for the trainer's own."""

    kind: ClassVar[str] = "version_published"
    version: int
    path: str | None = None
    actor: str = "trainer"
    command_id: str = ""


@dataclass(frozen=True, slots=True)
class EngineUpdateBegin(Event):
    kind: ClassVar[str] = "engine_update_begin"
    engine: str
    version: int


@dataclass(frozen=True, slots=True)
class EngineUpdateEnd(Event):
    """`ok` False: the step failed or timed out (`error` says which) and the engine left rotation, or,
    `refused`, the engine refused the weights and serves on at the version it had."""

    kind: ClassVar[str] = "engine_update_end"
    engine: str
    version: int
    ok: bool = True
    error: str = ""
    refused: bool = False
    said: str = ""  # a refusal's reason for a reader: status, route and the engine's own message


@dataclass(frozen=True, slots=True)
class EngineStateChanged(Event):
    """`state` is one of serving, draining, updating, paused, unhealthy, restarting, stopped. An
    operator's drain or return says who in `detail` (`rotation_detail`), which the audit reads back,
    and which command in `command_id` (its answer's; empty for every other change)."""

    kind: ClassVar[str] = "engine_state"
    engine: str
    state: str
    detail: str = ""
    command_id: str = ""


ROTATION_CHANGES = ("drained", "returned")


def rotation_detail(did: str, actor: str) -> str:
    """An `EngineStateChanged` detail for an operator's drain (`did` "drained") or return ("returned")."""
    assert did in ROTATION_CHANGES, did
    return f"{did} by {actor}"


def rotation_change(detail: str) -> tuple[str, str] | None:
    """(what was done, by whom) from a `rotation_detail`; None for any other detail."""
    did, by, actor = detail.partition(" by ")
    return (did, actor) if by and did in ROTATION_CHANGES and actor else None


# -- trainer, batches and policy ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchRequested(Event):
    kind: ClassVar[str] = "batch_requested"
    batch_index: int


@dataclass(frozen=True, slots=True)
class BatchDelivered(Event):
    """`staleness` is each delivered group's, in the order of `group_ids` (empty in streams recorded
    before it was added)."""

    kind: ClassVar[str] = "batch_delivered"
    batch_index: int
    group_ids: tuple[int, ...]
    trainer_version: int
    requested_at: float
    ready_at: float
    staleness: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyChanged(Event):
    """A live change of a run policy knob (`field` is e.g. max_staleness or surplus_groups), by the
    operator command `command_id` (its answer's)."""

    kind: ClassVar[str] = "policy_changed"
    field: str
    old: int | float | str | None
    new: int | float | str | None
    actor: str = "operator"
    command_id: str = ""


@dataclass(frozen=True, slots=True)
class LaneResized(Event):
    """Adaptive lanes changed a lane's slots from `old` to `new` (`configured`: the run config's);
    `why` gives what the decision saw."""

    kind: ClassVar[str] = "lane_resized"
    lane: str
    old: int
    new: int
    configured: int
    why: str = ""


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    """`policy` is the run's PolicyConfig as JSON; `engines` and `lanes` name what the run drives."""

    kind: ClassVar[str] = "run_started"
    policy: dict[str, Any] = field(default_factory=dict)
    engines: tuple[str, ...] = ()
    lanes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RunEnded(Event):
    """`reason`: completed, duration, stopped (operator or signal), or error.

    The last event of a run. `collection_ended_at` closes the run's measured span: when the trainer
    loop stopped (draining cleanups after it is housekeeping). `scheduler_events` is how many events
    the scheduler processed (the report's `events`)."""

    kind: ClassVar[str] = "run_ended"
    reason: str
    detail: str = ""
    collection_ended_at: float | None = None
    scheduler_events: int = 0


def fast_frozen_init(cls: type[T]) -> type[T]:
    """Give a frozen dataclass an `__init__` with the same signature and defaults that stores each field
    without `object.__setattr__` (which a frozen dataclass's own `__init__` calls per field, and which
    made building events a measurable share of the simulator's time): through the slot's descriptor
    for a slotted class, into the instance dict otherwise. Frozen-ness, equality, hashing and repr are
    the dataclass's own. Classes with `__post_init__` or fields left out of `__init__` stay as they are."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or not all(f.init and not f.kw_only for f in fields):
        return cls
    slotted = "__slots__" in cls.__dict__ and all(f.name in cls.__slots__ for f in fields)  # type: ignore[attr-defined]
    env: dict[str, Any] = {"_FACTORY": _FACTORY}
    params, body = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            env[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_f_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_FACTORY")
            body.append(f"if {f.name} is _FACTORY: {f.name} = _f_{f.name}()")
        else:
            params.append(f.name)
        if slotted:
            env[f"_s_{f.name}"] = next(
                k.__dict__[f.name] for k in cls.__mro__ if f.name in k.__dict__
            ).__set__
            body.append(f"_s_{f.name}(self, {f.name})")
        else:
            body.append(f"d[{f.name!r}] = {f.name}")
    if not slotted:
        body.insert(0, "d = self.__dict__")
    names = ", ".join(env)
    src = (
        f"def _make({names}):\n"
        f" def __init__(self, {', '.join(params)}) -> None:\n"
        + "".join(f"  {line}\n" for line in body or ["pass"])
        + " return __init__\n"
    )
    scope: dict[str, Any] = {}
    exec(src, {}, scope)
    init = scope["_make"](**env)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


_FACTORY = object()  # `fast_frozen_init`'s default for a field with a default factory


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        GroupAdmitted,
        GroupReady,
        GroupDelivered,
        GroupDiscarded,
        AttemptStarted,
        AttemptFinished,
        AttemptCancelled,
        AttemptRestarted,
        TurnDone,
        SandboxOp,
        AgentGateWait,
        VersionPublished,
        EngineUpdateBegin,
        EngineUpdateEnd,
        EngineStateChanged,
        BatchRequested,
        BatchDelivered,
        PolicyChanged,
        LaneResized,
        RunStarted,
        RunEnded,
    )
}

TERMINAL_GROUP_EVENTS = (GroupDelivered, GroupDiscarded)


@dataclass(frozen=True, slots=True)
class Envelope:
    run_id: str
    seq: int
    t: float
    event: Event

    @property
    def kind(self) -> str:
        return self.event.kind

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"run_id": self.run_id, "seq": self.seq, "t": self.t, "kind": self.kind}
        for f in dataclasses.fields(self.event):
            value = getattr(self.event, f.name)
            body[f.name] = list(value) if isinstance(value, tuple) else value
        _check_finite(body)
        return body


for _cls in (*EVENT_TYPES.values(), Envelope):
    fast_frozen_init(_cls)


_ENVELOPE_KEYS = frozenset({"run_id", "seq", "t", "kind"})


_FIELD_NAMES: dict[type, frozenset[str]] = {}


def _field_names(cls: type) -> frozenset[str]:
    """An event class's field names, looked up once (a long stream's catch-up decodes every event)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return names


def envelope_from_dict(data: dict[str, Any]) -> Envelope:
    """The inverse of `Envelope.to_dict`; unknown kinds or fields raise `ValueError`."""
    kind = data.get("kind")
    cls = EVENT_TYPES.get(str(kind))
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    names = _field_names(cls)
    extra = data.keys() - names - _ENVELOPE_KEYS
    if extra:
        raise ValueError(f"{kind}: unknown fields {sorted(extra)}")
    values = {n: tuple(data[n]) if isinstance(data.get(n), list) else data[n] for n in names if n in data}
    event = cls(**values)
    return Envelope(str(data["run_id"]), int(data["seq"]), float(data["t"]), event)


def _check_finite(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"event {body.get('kind')} field {key} is not finite: {value}")


class _Bitmap:
    """A growable set of small non-negative integers, one bit each (group ids count up from 0)."""

    __slots__ = ("_bits",)

    def __init__(self) -> None:
        self._bits = bytearray()

    def add(self, n: int) -> bool:
        """Add `n`; False if it was already there."""
        byte, bit = divmod(n, 8)
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits)))
        was = self._bits[byte] >> bit & 1
        self._bits[byte] |= 1 << bit
        return not was

    def __contains__(self, n: int) -> bool:
        byte, bit = divmod(n, 8)
        return byte < len(self._bits) and bool(self._bits[byte] >> bit & 1)

    def members(self) -> set[int]:
        return {
            i * 8 + bit for i, byte in enumerate(self._bits) if byte for bit in range(8) if byte >> bit & 1
        }


class Ledger:
    """An account of groups kept from the event stream alone: which were admitted and which ended.

    It is independent of the scheduler's counters on purpose: `lost` counts admitted groups with no
    terminal event, terminal events of groups never admitted, and groups that ended more than once;
    `gaps` counts missing sequence numbers. Memory: the open groups, plus one bit per group id seen.
    """

    def __init__(self, next_seq: int = 0) -> None:
        self.open_groups: set[int] = set()  # admitted and not yet ended: in flight or ready
        self.ready_groups: set[int] = set()  # open and ready (all attempts done)
        self.admitted_count = 0
        self.delivered_count = 0
        self.discarded: dict[str, int] = {}  # reason -> groups
        self.ended_twice: set[int] = set()
        self.never_admitted: set[int] = set()
        self.max_open = 0
        self.max_running = 0  # open and not ready: in flight
        self.next_seq = next_seq  # a run resumed from its store continues its sequence
        self.gaps = 0
        self._admitted = _Bitmap()
        self._ended = _Bitmap()

    def on_envelope(self, env: Envelope) -> None:
        seq = env.seq
        if seq != self.next_seq:
            self.gaps += abs(seq - self.next_seq)
        self.next_seq = seq + 1
        cls = type(env.event)
        if cls is not TurnDone and cls is not SandboxOp:  # the frequent kinds touch no group
            self.on_event(env.event)

    def on_quiet(self, env: Envelope) -> None:
        """`on_envelope` for an envelope whose event touches no group (a `TurnDone`, a `SandboxOp`):
        only its sequence number counts."""
        seq = env.seq
        if seq != self.next_seq:
            self.gaps += abs(seq - self.next_seq)
        self.next_seq = seq + 1

    def on_event(self, event: Event) -> None:
        if isinstance(event, GroupAdmitted):
            if self._admitted.add(event.group_id):
                self.admitted_count += 1
                self.open_groups.add(event.group_id)
                self.max_open = max(self.max_open, len(self.open_groups))
                self.max_running = max(self.max_running, len(self.open_groups) - len(self.ready_groups))
        elif isinstance(event, GroupReady):
            if event.group_id in self.open_groups:
                self.ready_groups.add(event.group_id)
        elif isinstance(event, GroupDelivered | GroupDiscarded):
            gid = event.group_id
            if not self._ended.add(gid):
                self.ended_twice.add(gid)
                return
            if gid not in self._admitted:
                self.never_admitted.add(gid)
                return
            self.open_groups.discard(gid)
            self.ready_groups.discard(gid)
            if isinstance(event, GroupDelivered):
                self.delivered_count += 1
            else:
                self.discarded[event.reason] = self.discarded.get(event.reason, 0) + 1

    @property
    def admitted(self) -> set[int]:
        """Every group id admitted so far (built on demand: O(groups of the run))."""
        return self._admitted.members()

    @property
    def ended(self) -> set[int]:
        """Every group id with a terminal event so far (built on demand: O(groups of the run))."""
        return self._ended.members()

    @property
    def lost(self) -> int:
        """After the run has ended: admitted groups with no terminal event, plus terminal events for
        groups never admitted, plus double endings."""
        return len(self.open_groups) + len(self.never_admitted) + len(self.ended_twice)
