"""A run is shown "running" only once its runtime executes: a command sent the moment it says so (the
dashboard's policy form, the API's PATCH) reaches a runtime that can carry it out."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

from app.service.handle import RunHandle
from app.service.schemas import PolicyPatch, RunCreate
from app.store.models import RunState


def test_a_policy_change_sent_as_the_run_turns_running_is_carried_out(tmp_path: Path) -> None:
    # The state turned "running" before the runtime's first step: a change of K sent in that window
    # started a group with no task group to run it in (AssertionError in Runtime._launch), seen in CI
    # as tests/web/test_live.py failing once in 1,478.
    sent: list[concurrent.futures.Future[tuple[dict, int]]] = []

    def on_state(handle: RunHandle, state: RunState, error: str | None) -> None:
        if state is RunState.RUNNING and not sent:  # on the run's loop, as the state changes
            patch = PolicyPatch(max_staleness=4)
            sent.append(handle.submit(handle.set_policy_marked, patch, "tester"))

    spec = RunCreate.model_validate(
        {"name": "window", "kind": "sim", "speed": 1000.0, "trainer": "sentinel", "policy": "sync",
         "batches": 2}
    )  # fmt: skip
    handle = RunHandle("r-window", spec, tmp_path, 30.0, on_state)
    handle.start()
    try:
        assert handle.join(30), "the run did not end"
    finally:
        if not handle.done.is_set():
            handle.stop()
    assert len(sent) == 1
    knobs, _ = sent[0].result(timeout=5)
    assert knobs["max_staleness"] == 4
    assert handle.state is RunState.COMPLETED, handle.error
