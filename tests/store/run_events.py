"""A synthetic run's event stream, built from the typed events of `app.core.events`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.core.events import (
    AttemptFinished,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineStateChanged,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    PolicyChanged,
    RunEnded,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
)

ENGINES = ("e0", "e1")


@dataclass
class SyntheticRun:
    """The envelopes, and what a store fed them must end up holding."""

    run_id: str
    envelopes: list[Envelope]
    delivered: dict[int, tuple[int, int]]  # group -> (batch index, staleness)
    discarded: dict[int, str]  # group -> reason
    open_groups: set[int]  # admitted, never ended (in flight at a crash)
    group_size: int
    spans: int  # spans the stream implies
    turns: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (g, a) -> (turns, tokens)


def make_run_events(run_id: str = "run-a", **overrides: Any) -> SyntheticRun:
    """Groups 0..groups-1 run G attempts of `turns` turns each. The first `open` groups stay in
    flight (no ending, no RunEnded: a crash); of the rest, those in `discard` are discarded with the
    given reason and the others delivered in batches of `batch_size`, in group order. Mid-run, version 1
    is published to both engines and max_staleness changes from 2 to 3."""
    opts: dict[str, Any] = {"groups": 6, "group_size": 2, "turns": 3, "batch_size": 2, "open": 0,
                            "discard": {1: "stale"}}  # fmt: skip
    opts.update(overrides)
    events: list[tuple[float, Event]] = []
    clock = [0.0]

    def emit(event: Event, dt: float = 0.25) -> float:
        clock[0] += dt
        events.append((clock[0], event))
        return clock[0]

    out = SyntheticRun(run_id, [], {}, {}, set(), opts["group_size"], 0)
    emit(RunStarted(policy={"groups_per_batch": opts["batch_size"], "max_staleness": 2}))
    for engine in ENGINES:
        emit(EngineStateChanged(engine=engine, state="serving"))
    spans = 0
    open_groups = set(range(opts["open"]))
    for g in range(opts["groups"]):
        emit(GroupAdmitted(group_id=g, task_index=g % 3, group_size=opts["group_size"], task=f"task-{g % 3}"))
        for a in range(opts["group_size"]):
            emit(AttemptStarted(group_id=g, attempt=a))
            t = clock[0]
            emit(SandboxOp(group_id=g, attempt=a, lane="reset", queued_at=t, start=t + 0.1, end=t + 0.2))
            spans += 2  # reset + its lane queue
            tokens = 0
            turns = opts["turns"] if g not in open_groups else 1
            for k in range(turns):
                t = clock[0]
                engine = ENGINES[k % 2]
                emit(TurnDone(group_id=g, attempt=a, engine=engine, version=0, queued_at=t, start=t + 0.05,
                              end=t + 0.2, tokens=10 * (k + 1)))  # fmt: skip
                tokens += 10 * (k + 1)
                t = clock[0]
                emit(SandboxOp(group_id=g, attempt=a, lane="exec", queued_at=t, start=t, end=t + 0.1))
                spans += 3  # turn + engine queue + tool (no lane wait)
            out.turns[(g, a)] = (turns, tokens)
            if g in open_groups:
                continue
            t = clock[0]
            emit(SandboxOp(group_id=g, attempt=a, lane="validate", queued_at=t, start=t, end=t + 0.1))
            emit(AttemptFinished(group_id=g, attempt=a, reward=float(a % 2)))
            t = clock[0]
            emit(SandboxOp(group_id=g, attempt=a, lane="cleanup", queued_at=t, start=t + 0.3, end=t + 0.4))
            spans += 3  # validate + cleanup + its lane queue
        if g == opts["groups"] // 2:
            emit(VersionPublished(version=1, path=None))
            for engine in ENGINES:
                emit(EngineUpdateBegin(engine=engine, version=1))
                emit(EngineUpdateEnd(engine=engine, version=1), dt=1.0)
                spans += 1  # update pause
            emit(PolicyChanged(field="max_staleness", old=2, new=3, actor="operator"))
    finished = [g for g in range(opts["groups"]) if g not in open_groups]
    ready: list[int] = []
    batch = 0
    for g in finished:
        emit(GroupReady(group_id=g))
        if g in opts["discard"]:
            emit(GroupDiscarded(group_id=g, reason=opts["discard"][g], detail="synthetic"))
            out.discarded[g] = opts["discard"][g]
            continue
        ready.append(g)
        if len(ready) == opts["batch_size"]:
            requested = emit(BatchRequested(batch_index=batch))
            for gid in ready:
                emit(GroupDelivered(group_id=gid, batch_index=batch, staleness=1))
                out.delivered[gid] = (batch, 1)
            emit(BatchDelivered(batch_index=batch, group_ids=tuple(ready), trainer_version=1,
                                requested_at=requested, ready_at=clock[0]))  # fmt: skip
            batch += 1
            ready = []
    for g in ready:  # a partial batch at the end of the run is discarded
        emit(GroupDiscarded(group_id=g, reason="cancelled", detail="run ended"))
        out.discarded[g] = "cancelled"
    if not open_groups:
        emit(RunEnded(reason="completed"))
    out.open_groups = open_groups
    out.spans = spans
    out.envelopes = [Envelope(run_id, seq, t, ev) for seq, (t, ev) in enumerate(events)]
    return out


def batches_of(envelopes: list[Envelope], size: int) -> list[list[Envelope]]:
    return [envelopes[i : i + size] for i in range(0, len(envelopes), size)]
