"""A Ctrl-C in the middle of a simulation (the virtual loop raises KeyboardInterrupt between callbacks,
and every task is unwound) leaves nothing behind that Python complains of at exit."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from app.core.events import Envelope, VersionPublished
from app.sim.family import builtin_workload
from app.sim.run import policy_for, simulate


@pytest.mark.parametrize("nth", [1, 2])
def test_a_ctrl_c_as_updates_are_made_leaves_no_coroutine_unawaited(nth: int) -> None:
    """The interrupt lands as a version is published, when the engines' update tasks are made and not
    yet started. Unwound, they never ran, so they stayed listed as under way; the run's shutdown then
    made the coroutine that abandons them and offered it to its ended TaskGroup. `corral bench`'s one
    line was followed by "coroutine 'Runtime._abandon_updates' was never awaited" (seen in `make test`)."""
    workload = builtin_workload("default", batches=4)
    published = 0

    def interrupt_at_publication(envelope: Envelope) -> None:
        nonlocal published
        if isinstance(envelope.event, VersionPublished):
            published += 1
            if published == nth:
                asyncio.get_running_loop().interrupted = True  # type: ignore[attr-defined]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            simulate(workload, policy_for(workload, "full"), "full", events=interrupt_at_publication)
        gc.collect()  # an unawaited coroutine warns as it is collected
    assert published == nth
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []


def test_a_ctrl_c_after_the_loop_last_looked_still_stops_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A press that lands once the run's last callback is done (as the loop closes) set the loop's flag
    and nothing read it: `corral bench` went on to its next simulation."""
    import os
    import signal

    from app.sim import clock

    close = clock.VirtualTimeLoop.close

    def pressed_while_closing(loop: clock.VirtualTimeLoop) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # handled at once: it is our own, main thread
        close(loop)

    async def done() -> int:
        return 7

    monkeypatch.setattr(clock.VirtualTimeLoop, "close", pressed_while_closing)
    with pytest.raises(KeyboardInterrupt):
        clock.run_virtual(done())
    monkeypatch.undo()
    assert clock.run_virtual(done()) == 7
