"""How an updating engine treats the turns in flight on it, in the simulator: `keep` freezes them until
the weights are loaded, `wait` lets them finish first, and `abort` ends them at once, as a real engine's
answer with `finish_reason: "abort"` is read (`TurnAborted`), so each is sent again, whole, to an engine
that is not updating. Before, a simulated abort let the turns run on through the load, for nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from app.core.config import PauseModeName
from app.core.events import EngineUpdateBegin, Envelope, TurnDone
from app.sim.family import builtin_workload
from app.sim.run import policy_for, simulate


@pytest.mark.parametrize("mode", list(PauseModeName))
def test_only_an_abort_ends_turns_at_an_update_and_they_are_sent_again(mode: PauseModeName) -> None:
    workload = builtin_workload("default", batches=3)
    turns: list[TurnDone] = []
    updates: set[tuple[str, float]] = set()  # (engine, when its update began)

    def keep(env: Envelope) -> None:
        if isinstance(env.event, TurnDone):
            turns.append(env.event)
        elif isinstance(env.event, EngineUpdateBegin):
            updates.add((env.event.engine, env.t))

    report = simulate(workload, policy_for(workload, "full", pause_mode=mode), "full", events=keep)
    assert report["lost_groups"] == 0
    assert updates
    failed = [t for t in turns if t.error is not None]
    if mode is not PauseModeName.ABORT:
        assert failed == []
        return
    assert failed, "no turn was in flight on an engine that began an update"
    for turn in failed:
        assert turn.error is not None
        assert turn.error.startswith("TurnAborted: ")
        assert (turn.version, turn.tokens) == (-1, 0)
        assert (turn.engine, turn.end) in updates  # ended by its engine's update, as it began
    assert sum(t.end - t.start for t in failed) > 0  # engine time lost: the turns had run a while
    done = Counter((t.group_id, t.attempt) for t in turns if t.error is None)
    assert all(done[(t.group_id, t.attempt)] >= 1 for t in failed)  # each was sent again
