"""A synthetic, seeded event stream of a whole run, for the render benchmark and the page tests.

It is not a simulator (no resource contention, no scheduler): every attempt draws its reset, turns,
tool calls and validation, groups complete when their last attempt does, batches take the first B
groups to complete, and each batch publishes a version that the engines load one at a time. Its only
job is to produce a stream with the shape and size of a real one (`spans_target` spans).
"""

from __future__ import annotations

import random
from typing import Any

from app.core.events import (
    AttemptFinished,
    AttemptStarted,
    BatchDelivered,
    BatchRequested,
    EngineUpdateBegin,
    EngineUpdateEnd,
    Envelope,
    Event,
    GroupAdmitted,
    GroupDelivered,
    GroupDiscarded,
    GroupReady,
    PolicyChanged,
    RunStarted,
    SandboxOp,
    TurnDone,
    VersionPublished,
)


def synthetic_run(
    run_id: str = "synthetic",
    groups: int = 24,
    group_size: int = 4,
    batch_groups: int = 4,
    turns: int = 6,
    engines: int = 2,
    seed: int = 7,
) -> list[Envelope]:
    """Envelopes of a finished run; about groups × group_size × (2 + 4 × turns) spans."""
    rng = random.Random(seed)
    timed: list[tuple[float, int, Event]] = []  # (t, tie-break, event)
    order = 0

    def at(t: float, event: Event) -> None:
        nonlocal order
        timed.append((t, order, event))
        order += 1

    policy: dict[str, Any] = {
        "groups_per_batch": batch_groups,
        "group_size": group_size,
        "surplus_groups": batch_groups,
        "max_staleness": 2,
    }
    at(0.0, RunStarted(policy))
    ready: list[tuple[float, int]] = []
    pending: list[tuple[int, int, str, float, float, float, int]] = []  # turns, versioned at the end
    version_at: list[tuple[float, int]] = [(0.0, 0)]
    rewards: dict[int, list[float]] = {}
    for gid in range(groups):
        admitted = (gid // (2 * batch_groups)) * 40.0 + rng.uniform(0, 2)
        at(admitted, GroupAdmitted(gid, gid, group_size, f"task-{gid}"))
        slow = 3.0 if rng.random() < 0.1 else 1.0
        ends = []
        for a in range(group_size):
            t = admitted
            at(t, AttemptStarted(gid, a))
            t = _op(at, rng, gid, a, "reset", t, rng.lognormvariate(0.5, 0.8))
            for k in range(turns):
                engine = f"engine-{rng.randrange(engines)}"
                queued = t
                start = queued + (rng.expovariate(2.0) if rng.random() < 0.3 else 0.0)
                end = start + rng.lognormvariate(0.3, 0.5) * slow
                pending.append((gid, a, engine, queued, start, end, rng.randrange(50, 400)))
                t = _op(at, rng, gid, a, "exec", end, rng.lognormvariate(-0.5, 1.0))
                del k
            t = _op(at, rng, gid, a, "validate", t, rng.uniform(0.2, 1.5))
            reward = rng.random()
            rewards.setdefault(gid, []).append(reward)
            at(t, AttemptFinished(gid, a, reward))
            _op(at, rng, gid, a, "cleanup", t, rng.uniform(0.1, 0.5))
            ends.append(t)
        done = max(ends)
        at(done, GroupReady(gid))
        ready.append((done, gid))
    ready.sort()
    requested = 0.0
    for index in range(len(ready) // batch_groups):
        version = index
        chunk = ready[index * batch_groups : (index + 1) * batch_groups]
        delivered = max(requested, chunk[-1][0]) + 0.01
        at(requested, BatchRequested(index))
        for _, gid in chunk:  # as the scheduler does: its groups first, with their rewards
            at(delivered, GroupDelivered(gid, index, rng.randrange(0, 3), tuple(rewards[gid])))
        at(delivered, BatchDelivered(index, tuple(g for _, g in chunk), version, requested, delivered))
        version = index + 1
        published = delivered + 1.0
        at(published, VersionPublished(version))
        version_at.append((published, version))
        t = published
        for e in range(engines):
            at(t, EngineUpdateBegin(f"engine-{e}", version))
            t += rng.uniform(0.5, 1.5)
            at(t, EngineUpdateEnd(f"engine-{e}", version))
        requested = published
        if index == 1:
            at(published, PolicyChanged("max_staleness", 2, 3, "operator"))
    for done, gid in ready[(len(ready) // batch_groups) * batch_groups :]:
        at(max(requested, done) + 1.0, GroupDiscarded(gid, "cancelled", "run ended"))
    for gid, a, engine, queued, start, end, tokens in pending:
        version = max(v for vt, v in version_at if vt <= start)
        at(end, TurnDone(gid, a, engine, version, queued, start, end, tokens))
    timed.sort(key=lambda x: (x[0], x[1]))
    return [Envelope(run_id, seq, t, ev) for seq, (t, _, ev) in enumerate(timed)]


def _op(at: Any, rng: random.Random, gid: int, attempt: int, lane: str, t: float, run_s: float) -> float:
    start = t + (rng.expovariate(1.0) if rng.random() < 0.25 else 0.0)
    end = start + run_s
    at(end, SandboxOp(gid, attempt, lane, t, start, end))
    return end
